//! The state directory (`daemon.state_dir`, `/var/lib/gpuguard`): what gpuguard holds stopped or
//! throttled, and the event log. Root writes there, so the directory is trusted only if it is
//! gpuguard's own (owned by its user, not writable by group or others; created 0700), and every
//! file in it is opened relative to the directory's descriptor without following symlinks:
//! a symlink planted there is set aside and reported, never written through.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use rustix::fs::{fstat, openat, renameat, statat, unlinkat, AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

/// Why a state directory is not used.
#[derive(Debug, thiserror::Error)]
#[error("state directory {}: {reason}", path.display())]
pub struct StateDirError {
    pub path: PathBuf,
    pub reason: String,
}

/// An open, checked state directory.
#[derive(Debug)]
pub struct StateDir {
    path: PathBuf,
    fd: OwnedFd,
}

/// Which file a descriptor is: (device, inode).
pub type FileIdentity = (u64, u64);

/// Whether root may create, open and chmod files by name in the directory that holds `path`:
/// every directory from `/` down to it (symlinks resolved) is owned by root or this user, and
/// not writable by group or others unless sticky (as `/tmp` is: there nobody can rename or
/// remove another's entries). A directory another account may write is where it swaps a name
/// for a symlink between root's check and root's use (chmod through it, write through it).
/// The directory itself must exist.
pub fn check_parent(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) else {
        return Ok(());
    };
    let real = std::fs::canonicalize(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    let me = rustix::process::geteuid().as_raw();
    for dir in real.ancestors() {
        let m = std::fs::metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let mode = m.mode();
        let sticky = mode & 0o1000 != 0;
        if (m.uid() != 0 && m.uid() != me) || (mode & 0o022 != 0 && !sticky) {
            return Err(format!(
                "{} is not safe for it: {} is {} (owner uid {}, mode {:04o}), so another account \
                 could put a symlink in its place; use a directory only root may write",
                path.display(),
                dir.display(),
                if m.uid() != 0 && m.uid() != me {
                    "another account's"
                } else {
                    "writable by others"
                },
                m.uid(),
                mode & 0o7777
            ));
        }
    }
    Ok(())
}

impl StateDir {
    /// Opens the directory, creating it (mode 0700, parents as needed) if it does not exist.
    /// A symlink is never followed, and the directories above it must be root's alone.
    pub fn create(path: &Path) -> Result<StateDir, StateDirError> {
        if std::fs::symlink_metadata(path).is_err() {
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent).map_err(|e| error(path, e))?;
            }
            check_parent(path).map_err(|reason| StateDirError {
                path: path.to_path_buf(),
                reason,
            })?;
            match std::fs::DirBuilder::new().mode(0o700).create(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(error(path, e)),
            }
        }
        StateDir::open(path)
    }

    /// Opens the directory if it exists (`None` if it does not); never creates it.
    pub fn open_existing(path: &Path) -> Result<Option<StateDir>, StateDirError> {
        match std::fs::symlink_metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            _ => StateDir::open(path).map(Some),
        }
    }

    /// Opens and checks: a directory (not a symlink to one) owned by this user, not writable by
    /// group or others, in directories only root may write (`check_parent`).
    fn open(path: &Path) -> Result<StateDir, StateDirError> {
        check_parent(path).map_err(|reason| StateDirError {
            path: path.to_path_buf(),
            reason,
        })?;
        let fd = rustix::fs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            Errno::LOOP | Errno::NOTDIR
                if std::fs::symlink_metadata(path).is_ok_and(|m| m.is_symlink()) =>
            {
                StateDirError {
                    path: path.to_path_buf(),
                    reason: "a symlink: refusing to follow it (name the directory itself)".into(),
                }
            }
            e => error(path, e),
        })?;
        let st = fstat(&fd).map_err(|e| error(path, e))?;
        let me = rustix::process::geteuid().as_raw();
        let refuse = |reason: String| {
            StateDirError {
            path: path.to_path_buf(),
            reason: format!("{reason}: refusing to use it (it holds what gpuguard, as root, signals and writes)"),
        }
        };
        if st.st_uid != me {
            return Err(refuse(format!(
                "owned by uid {}, not by gpuguard's uid {me}",
                st.st_uid
            )));
        }
        let mode = st.st_mode & 0o7777;
        if mode & 0o022 != 0 {
            return Err(refuse(format!(
                "writable by group or others (mode {mode:04o}; chmod 700 it)"
            )));
        }
        Ok(StateDir {
            path: path.to_path_buf(),
            fd,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The whole content of `name`, or `None` if it does not exist. A symlink is an error
    /// (`ELOOP`): it is never followed.
    pub fn read(&self, name: &str) -> std::io::Result<Option<Vec<u8>>> {
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK;
        let fd = match openat(&self.fd, name, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let mut file = File::from(fd);
        if !file.metadata()?.is_file() {
            return Err(std::io::Error::other("not a regular file"));
        }
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(Some(bytes))
    }

    /// Replaces `name` with `bytes` at once: written to `name.tmp` (created exclusively, after
    /// removing whatever a crash or anyone else left under that name), then renamed over it.
    pub fn write_atomic(&self, name: &str, bytes: &[u8]) -> std::io::Result<()> {
        let tmp = format!("{name}.tmp");
        match unlinkat(&self.fd, tmp.as_str(), AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(e) => return Err(e.into()),
        }
        let flags =
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = openat(
            &self.fd,
            tmp.as_str(),
            flags,
            Mode::from_bits_truncate(0o600),
        )?;
        File::from(fd).write_all(bytes)?;
        renameat(&self.fd, tmp.as_str(), &self.fd, name)?;
        Ok(())
    }

    /// Opens `name` for appending (created 0600). Something other than a regular file under
    /// that name (a symlink planted there) is set aside first; returns the file and, if so, why.
    pub fn open_append(&self, name: &str) -> std::io::Result<(File, Option<String>)> {
        let mut set_aside = None;
        if let Some(kind) = self.odd_entry(name)? {
            let aside = self.set_aside(name, "not-a-file")?;
            set_aside = Some(format!(
                "{}/{name} was {kind}: moved to {aside}, never written through",
                self.path.display()
            ));
        }
        let flags =
            OFlags::WRONLY | OFlags::APPEND | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = openat(&self.fd, name, flags, Mode::from_bits_truncate(0o600))?;
        Ok((File::from(fd), set_aside))
    }

    /// Opens `name` for reading and writing (created 0600 if `create`), never through a
    /// symlink: a lock file (`act::claim`).
    pub fn open_lock_file(&self, name: &str, create: bool) -> std::io::Result<File> {
        let mut flags = OFlags::RDWR | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        if create {
            flags |= OFlags::CREATE;
        }
        let fd = openat(&self.fd, name, flags, Mode::from_bits_truncate(0o600))?;
        Ok(File::from(fd))
    }

    /// What `name` is if it exists and is not a regular file ("a symlink", "a directory", ...).
    fn odd_entry(&self, name: &str) -> std::io::Result<Option<&'static str>> {
        let st = match statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        Ok(match FileType::from_raw_mode(st.st_mode) {
            FileType::RegularFile => None,
            FileType::Symlink => Some("a symlink"),
            FileType::Directory => Some("a directory"),
            _ => Some("not a regular file"),
        })
    }

    /// A directory `name` in it that any user may read (the flight recorder's, for `gpuguard
    /// history`), created 0755 if missing (one already there keeps its mode: an operator may
    /// make it root's alone), opened without following a symlink and checked as the
    /// state directory is (this user's, not writable by group or others). The state directory
    /// itself is made traversable (`o+x`, never readable: its own files stay 0600 and unlisted).
    pub fn public_subdir(&self, name: &str) -> std::io::Result<OwnedFd> {
        let st = fstat(&self.fd)?;
        let mode = st.st_mode & 0o7777;
        if mode & 0o011 != 0o011 {
            rustix::fs::fchmod(&self.fd, Mode::from_bits_truncate(mode | 0o011))?;
        }
        let created = match rustix::fs::mkdirat(&self.fd, name, Mode::from_bits_truncate(0o755)) {
            Ok(()) => true,
            Err(Errno::EXIST) => false,
            Err(e) => return Err(e.into()),
        };
        let fd = openat(
            &self.fd,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let st = fstat(&fd)?;
        let me = rustix::process::geteuid().as_raw();
        if st.st_uid != me || st.st_mode & 0o022 != 0 {
            return Err(std::io::Error::other(format!(
                "{}/{name} is not gpuguard's own (owner uid {}, mode {:04o}): refusing to write there",
                self.path.display(),
                st.st_uid,
                st.st_mode & 0o7777
            )));
        }
        // Whatever the umask made of it (the systemd unit runs with 0077). One that was there
        // keeps the mode it has: an operator may have made it root's alone (0700).
        if created && st.st_mode & 0o7777 != 0o755 {
            rustix::fs::fchmod(&fd, Mode::from_bits_truncate(0o755))?;
        }
        Ok(fd)
    }

    /// The (device, inode) of `name` itself (a symlink is not followed), if it exists.
    pub fn identity(&self, name: &str) -> std::io::Result<Option<FileIdentity>> {
        match statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some((st.st_dev, st.st_ino))),
            Err(Errno::NOENT) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Renames `from` to `to` within the directory (neither is followed if a symlink).
    pub fn rename(&self, from: &str, to: &str) -> std::io::Result<()> {
        renameat(&self.fd, from, &self.fd, to).map_err(Into::into)
    }

    /// Moves `name` out of the way as `name.<why>-<unix time>` (kept for the operator); returns
    /// the new name.
    pub fn set_aside(&self, name: &str, why: &str) -> std::io::Result<String> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let aside = format!("{name}.{why}-{now}");
        self.rename(name, &aside)?;
        Ok(aside)
    }
}

/// The identity of an open file.
pub fn identity_of(file: &File) -> std::io::Result<FileIdentity> {
    let st = fstat(file.as_fd())?;
    Ok((st.st_dev, st.st_ino))
}

fn error(path: &Path, e: impl std::fmt::Display) -> StateDirError {
    StateDirError {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A public subdirectory is made 0755 when created (whatever the umask), and keeps the mode
    /// an operator gave it afterwards (0700: the history root's alone, on a hidepid host).
    #[test]
    fn a_public_subdir_is_0755_when_made_and_keeps_a_stricter_mode() {
        let root = tempfile::tempdir().unwrap();
        let dir = StateDir::create(&root.path().join("state")).unwrap();
        let sub = dir.path().join("history");
        drop(dir.public_subdir("history").unwrap());
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&sub), 0o755);
        std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o700)).unwrap();
        drop(dir.public_subdir("history").unwrap());
        assert_eq!(mode(&sub), 0o700);
    }

    #[test]
    fn created_0700_and_refused_when_group_or_world_writable() {
        let root = tempfile::tempdir().unwrap();
        let path = root.path().join("a/state");
        let dir = StateDir::create(&path).unwrap();
        let mode = std::fs::metadata(dir.path()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = StateDir::create(&path).unwrap_err().to_string();
        assert!(
            e.contains("writable by group or others (mode 0777; chmod 700 it)"),
            "{e}"
        );
        assert!(StateDir::open_existing(&root.path().join("none"))
            .unwrap()
            .is_none());
        if rustix::process::geteuid().is_root() {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700)).unwrap();
            let nobody = rustix::fs::Uid::from_raw(65534);
            rustix::fs::chown(&path, Some(nobody), None).unwrap();
            let e = StateDir::create(&path).unwrap_err().to_string();
            assert!(
                e.contains("owned by uid 65534, not by gpuguard's uid 0"),
                "{e}"
            );
        }
    }

    #[test]
    fn symlinks_in_it_are_never_followed() {
        let root = tempfile::tempdir().unwrap();
        let dir = StateDir::create(&root.path().join("state")).unwrap();
        let victim = root.path().join("elsewhere");
        std::fs::write(&victim, "precious\n").unwrap();
        std::os::unix::fs::symlink(&victim, dir.path().join("stopped.json")).unwrap();
        std::os::unix::fs::symlink(&victim, dir.path().join("stopped.json.tmp")).unwrap();
        std::os::unix::fs::symlink(&victim, dir.path().join("events.jsonl")).unwrap();

        assert!(dir.read("stopped.json").is_err(), "a symlink is not read");
        dir.write_atomic("stopped.json", b"[]").unwrap();
        let (mut log, aside) = dir.open_append("events.jsonl").unwrap();
        log.write_all(b"line\n").unwrap();

        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
        assert_eq!(dir.read("stopped.json").unwrap().unwrap(), b"[]");
        assert!(aside
            .unwrap()
            .contains("was a symlink: moved to events.jsonl.not-a-file-"));
        assert_eq!(
            std::fs::read_to_string(dir.path().join("events.jsonl")).unwrap(),
            "line\n"
        );
    }
}
