//! One guard per host. A daemon claims its state directory for its whole life (`daemon.lock` in
//! it, flock'ed): a second daemon on the same directory refuses to start, naming the pid that
//! holds it, so two daemons never share (and empty) one record of stopped processes. To signal
//! anything it also holds the host's enforce lock (`/run/gpuguard/enforce.lock`): at most one
//! daemon enforces on a host at a time; others may observe beside it, and never signal.
//!
//! Both files are root's alone (0600, opened without following a symlink, refused if another
//! account owns them): any account that could open one could flock it and keep root's guard
//! from starting. A lock file that was unlinked and made anew while a daemon held the old one
//! would let a second daemon lock the new one: `/run/gpuguard` is kept across the service's
//! restarts (`RuntimeDirectoryPreserve=yes`), and a lock taken is checked to be the file the
//! path names now.

use std::fmt;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::{flock, FlockOperation};
use rustix::io::Errno;
use serde::{Deserialize, Serialize};

use crate::state_dir::{identity_of, StateDir};

/// The host's enforce lock, unless `GPUGUARD_ENFORCE_LOCK` names another (tests).
pub const DEFAULT_ENFORCE_LOCK: &str = "/run/gpuguard/enforce.lock";
/// The environment variable that moves the enforce lock (for tests that run daemons side by
/// side, each its own host as far as enforcing goes).
pub const ENFORCE_LOCK_ENV: &str = "GPUGUARD_ENFORCE_LOCK";
/// The state directory's lock, in it.
pub const STATE_LOCK: &str = "daemon.lock";

/// Who holds a lock, as it wrote itself into the lock file.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Holder {
    pub pid: i32,
    pub config: PathBuf,
    pub state_dir: PathBuf,
}

impl Holder {
    /// This process, running `config` on `state_dir`.
    pub fn me(config: &Path, state_dir: &Path) -> Holder {
        Holder {
            pid: std::process::id() as i32,
            config: config.to_path_buf(),
            state_dir: state_dir.to_path_buf(),
        }
    }
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "gpuguard pid {} (config {}, state dir {})",
            self.pid,
            self.config.display(),
            self.state_dir.display()
        )
    }
}

/// Why a lock was not taken.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// Another live daemon holds it (it may let go: a runtime condition, exit 1).
    #[error("{what} {} is held by {}: {}", path.display(), show_holder(holder), hint(what))]
    Held {
        what: &'static str,
        path: PathBuf,
        holder: Option<Holder>,
    },
    /// The lock file cannot be made or opened.
    #[error("{what} {}: {reason}", path.display())]
    Unusable {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
}

/// What the operator can do about a lock another daemon holds.
fn hint(what: &str) -> &'static str {
    if what == STATE_WHAT {
        "two daemons must not share one record of what they hold stopped; give this one a state \
         directory (--state-dir) and a socket (--socket) of its own"
    } else {
        "at most one daemon enforces on a host; run this one with --observe to watch beside it, \
         or stop that one first"
    }
}

fn show_holder(holder: &Option<Holder>) -> String {
    match holder {
        Some(h) => h.to_string(),
        None => "another gpuguard (its pid is not written yet)".into(),
    }
}

impl ClaimError {
    /// The daemon that holds the lock, if it said.
    #[cfg(test)]
    pub fn holder(&self) -> Option<&Holder> {
        match self {
            ClaimError::Held { holder, .. } => holder.as_ref(),
            ClaimError::Unusable { .. } => None,
        }
    }
}

/// An exclusive lock, held until dropped (or the process ends, whatever way it ends).
#[derive(Debug)]
pub struct Lock {
    _file: File,
    path: PathBuf,
}

impl Lock {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the path still names the file locked: one unlinked or replaced (a runtime
    /// directory cleaned up under a daemon started by hand) lets another daemon lock the new file.
    pub fn still_named(&self) -> bool {
        use std::os::unix::fs::MetadataExt;
        let named = std::fs::symlink_metadata(&self.path)
            .ok()
            .map(|m| (m.dev(), m.ino()));
        named.is_some() && named == identity_of(&self._file).ok()
    }
}

const STATE_WHAT: &str = "state directory lock";
const ENFORCE_WHAT: &str = "the host's enforce lock";

/// Claims `dir` for this daemon: `daemon.lock` in it, held for the daemon's life.
pub fn claim_state_dir(dir: &StateDir, me: &Holder) -> Result<Lock, ClaimError> {
    let path = dir.path().join(STATE_LOCK);
    take(STATE_WHAT, &path, me, || {
        dir.open_lock_file(STATE_LOCK, true)
    })
}

/// The host's enforce lock at `path` (its parent made 0755 if missing).
pub fn take_enforce_lock(path: &Path, me: &Holder) -> Result<Lock, ClaimError> {
    take(ENFORCE_WHAT, path, me, || open_lock_path(path))
}

/// Who holds the state directory's lock now, if anyone (root alone may tell): for
/// `check-config`, which must not take the running daemon's port or socket for another's.
/// Never waits; takes nothing it keeps.
pub fn state_dir_holder(dir: &StateDir) -> Option<Holder> {
    probe(dir.open_lock_file(STATE_LOCK, false).ok()?)
}

/// Who holds the enforce lock at `path` now, if anyone (root alone may tell).
pub fn enforce_holder(path: &Path) -> Option<Holder> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .ok()?;
    probe(file)
}

/// A shared lock tried and let go at once: refused while someone holds it exclusively, whose
/// record is then read.
fn probe(mut file: File) -> Option<Holder> {
    match flock(&file, FlockOperation::NonBlockingLockShared) {
        // Let go as the file is closed.
        Ok(()) => None,
        // Held, by a daemon that may not have written itself in yet: then unknown.
        Err(_) => read_holder(&mut file),
    }
}

fn take(
    what: &'static str,
    path: &Path,
    me: &Holder,
    open: impl Fn() -> std::io::Result<File>,
) -> Result<Lock, ClaimError> {
    let unusable = |reason: String| ClaimError::Unusable {
        what,
        path: path.to_path_buf(),
        reason,
    };
    // A file unlinked (and perhaps made anew) between open and lock is not the lock any more:
    // open again. Bounded: someone deleting it in a loop is not a reason to spin.
    for _ in 0..8 {
        let file = open().map_err(|e| unusable(e.to_string()))?;
        check_own_file(&file).map_err(unusable)?;
        let mut locked = match lock_exclusive(file) {
            Ok(locked) => locked,
            Err((mut file, Errno::WOULDBLOCK)) => {
                return Err(ClaimError::Held {
                    what,
                    path: path.to_path_buf(),
                    holder: read_holder(&mut file),
                });
            }
            Err((_, e)) => return Err(unusable(format!("flock: {e}"))),
        };
        let still_there = std::fs::symlink_metadata(path).ok().map(|m| {
            use std::os::unix::fs::MetadataExt;
            (m.dev(), m.ino())
        });
        if still_there != identity_of(&locked).ok() {
            continue;
        }
        write_holder(&mut locked, me).map_err(|e| unusable(format!("cannot write: {e}")))?;
        return Ok(Lock {
            _file: locked,
            path: path.to_path_buf(),
        });
    }
    Err(unusable("it keeps being replaced".into()))
}

/// The exclusive lock, tried a few times over 100 ms before it is taken as held: a
/// `check-config` probing it (a shared lock for a moment) must not fail a daemon's start.
/// The lock is the file's, held until it is closed.
fn lock_exclusive(file: File) -> Result<File, (File, Errno)> {
    let lock = |file: &File| flock(file, FlockOperation::NonBlockingLockExclusive);
    for _ in 0..10 {
        match lock(&file) {
            Err(Errno::WOULDBLOCK) => std::thread::sleep(std::time::Duration::from_millis(10)),
            Ok(()) => return Ok(file),
            Err(e) => return Err((file, e)),
        }
    }
    match lock(&file) {
        Ok(()) => Ok(file),
        Err(e) => Err((file, e)),
    }
}

/// Opens (creating 0600) a lock file at an absolute path, never through a symlink.
fn open_lock_path(path: &Path) -> std::io::Result<File> {
    if let Some(parent) = path.parent().filter(|p| !p.exists()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(parent)?;
    }
    crate::state_dir::check_parent(path).map_err(std::io::Error::other)?;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// A lock file must be a regular file of this user's that nobody else may open: else another
/// account could hold the lock.
fn check_own_file(file: &File) -> Result<(), String> {
    let st = rustix::fs::fstat(file.as_fd()).map_err(|e| e.to_string())?;
    let me = rustix::process::geteuid().as_raw();
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err("not a regular file: refusing to use it".into());
    }
    if st.st_uid != me {
        return Err(format!(
            "owned by uid {}, not by gpuguard's uid {me}: refusing to use it (another account \
             could hold it)",
            st.st_uid
        ));
    }
    if st.st_mode & 0o077 != 0 {
        rustix::fs::fchmod(file.as_fd(), rustix::fs::Mode::from_bits_truncate(0o600))
            .map_err(|e| format!("chmod 600: {e}"))?;
    }
    Ok(())
}

fn write_holder(file: &mut File, me: &Holder) -> std::io::Result<()> {
    let mut bytes = serde_json::to_vec(me).map_err(std::io::Error::other)?;
    bytes.push(b'\n');
    file.set_len(0)?;
    file.seek(SeekFrom::Start(0))?;
    file.write_all(&bytes)
}

fn read_holder(file: &mut File) -> Option<Holder> {
    let mut text = String::new();
    file.seek(SeekFrom::Start(0)).ok()?;
    file.take(4096).read_to_string(&mut text).ok()?;
    serde_json::from_str(text.trim()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn holder(pid: i32) -> Holder {
        Holder {
            pid,
            config: PathBuf::from("/etc/gpuguard/config.toml"),
            state_dir: PathBuf::from("/var/lib/gpuguard"),
        }
    }

    #[test]
    fn a_second_claim_of_a_state_dir_is_refused_naming_the_holder_until_the_first_ends() {
        let root = tempfile::tempdir().unwrap();
        let dir = StateDir::create(&root.path().join("state")).unwrap();
        let first = claim_state_dir(&dir, &holder(4242)).unwrap();
        // A second daemon opens the directory on its own (its own descriptors, as a second
        // process would).
        let again = StateDir::create(dir.path()).unwrap();
        let e = claim_state_dir(&again, &holder(77)).unwrap_err();
        assert_eq!(e.holder(), Some(&holder(4242)));
        assert!(
            e.to_string()
                .contains("is held by gpuguard pid 4242 (config /etc/gpuguard/config.toml"),
            "{e}"
        );
        assert_eq!(state_dir_holder(&again), Some(holder(4242)));
        drop(first);
        assert_eq!(state_dir_holder(&again), None);
        let _second = claim_state_dir(&again, &holder(77)).unwrap();
        assert_eq!(state_dir_holder(&dir), Some(holder(77)));
    }

    #[test]
    fn the_enforce_lock_is_one_per_path_and_root_alone_may_open_it() {
        let root = tempfile::tempdir().unwrap();
        let path = root.path().join("run/gpuguard/enforce.lock");
        let lock = take_enforce_lock(&path, &holder(1)).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "nobody else may open (and so flock) it");
        let e = take_enforce_lock(&path, &holder(2)).unwrap_err();
        assert!(matches!(e, ClaimError::Held { .. }), "{e}");
        assert_eq!(enforce_holder(&path), Some(holder(1)));
        drop(lock);
        assert_eq!(enforce_holder(&path), None);
        assert!(take_enforce_lock(&path, &holder(2)).is_ok());
    }

    /// A lock whose file is removed under it knows, and taking the path again gives a lock
    /// that is named again.
    #[test]
    fn a_lock_knows_when_its_file_is_no_longer_the_one_its_path_names() {
        let root = tempfile::tempdir().unwrap();
        let path = root.path().join("enforce.lock");
        let lock = take_enforce_lock(&path, &holder(1)).unwrap();
        assert!(lock.still_named());
        std::fs::remove_file(&path).unwrap();
        assert!(!lock.still_named());
        let again = take_enforce_lock(&path, &holder(1)).unwrap();
        assert!(again.still_named() && !lock.still_named());
    }

    #[test]
    fn a_lock_file_that_is_a_symlink_or_open_to_others_is_not_used_as_found() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("elsewhere");
        std::fs::write(&target, "precious\n").unwrap();
        let link = root.path().join("enforce.lock");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = take_enforce_lock(&link, &holder(1)).unwrap_err();
        assert!(matches!(e, ClaimError::Unusable { .. }), "{e}");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious\n");

        let open = root.path().join("open.lock");
        std::fs::write(&open, "").unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o666)).unwrap();
        let _lock = take_enforce_lock(&open, &holder(1)).unwrap();
        let mode = std::fs::metadata(&open).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
}
