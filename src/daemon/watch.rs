//! `daemon --watch-config INTERVAL`: the config file reloaded when its content changes, without
//! a signal. A Kubernetes ConfigMap volume changes that way: the kubelet writes the new files
//! into a new directory and swaps the `..data` symlink the file's own symlink goes through, and
//! nobody sends SIGHUP. Every INTERVAL the loop looks at the file (following symlinks): when its
//! metadata (device, inode, size, modification and change times) differs from the last look, it
//! reads the file, and when the content differs from what was last loaded or tried, reloads it
//! exactly as SIGHUP does (a bad config keeps the running one, and says why once: the same
//! content is not tried again until it changes). Off unless asked for: under systemd an edit
//! takes effect at `systemctl reload`, after `check-config`.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// What identifies one version of a file without reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

fn stamp(path: &Path) -> Option<Stamp> {
    let m = std::fs::metadata(path).ok()?;
    Some(Stamp {
        dev: m.dev(),
        ino: m.ino(),
        len: m.len(),
        mtime: (m.mtime(), m.mtime_nsec()),
        ctime: (m.ctime(), m.ctime_nsec()),
    })
}

/// The file's content as a load would read it (without blocking, bounded, only from a file
/// root alone can change: `host::HostFacts::read_config`), None if it cannot be.
fn read(path: &Path) -> Option<Vec<u8>> {
    crate::host::facts()
        .read_config(path)
        .ok()
        .map(String::into_bytes)
}

/// The watch on the config file.
#[derive(Debug)]
pub(super) struct ConfigWatch {
    every: Duration,
    next: Instant,
    stamp: Option<Stamp>,
    /// The content last loaded or tried (`None`: the file could not be read).
    content: Option<Vec<u8>>,
}

impl ConfigWatch {
    /// Watches `path` from `now` on, every `every`, taking what it holds now as loaded.
    pub(super) fn new(path: &Path, every: Duration, now: Instant) -> ConfigWatch {
        let mut w = ConfigWatch {
            every,
            next: now + every,
            stamp: None,
            content: None,
        };
        w.loading(path);
        w
    }

    /// The file is being (re)loaded, by a signal or by the watch: what it holds now is what
    /// was tried. Read before the load, so a change after it is seen at the next look.
    pub(super) fn loading(&mut self, path: &Path) {
        self.stamp = stamp(path);
        self.content = read(path);
    }

    /// Whether the file's content changed since it was last loaded or tried, looked at when a
    /// look is due at `now`.
    pub(super) fn changed(&mut self, path: &Path, now: Instant) -> bool {
        if now < self.next {
            return false;
        }
        self.next = now + self.every;
        let stamp = stamp(path);
        if stamp == self.stamp {
            return false;
        }
        self.stamp = stamp;
        let content = read(path);
        let changed = content != self.content;
        self.content = content;
        changed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    /// A ConfigMap volume as the kubelet writes it: `config.toml -> ..data/config.toml`,
    /// `..data -> ..VERSION`; an update writes a new version directory and swaps `..data`.
    fn configmap_version(dir: &Path, version: &str, text: &str) {
        let v = dir.join(version);
        std::fs::create_dir(&v).unwrap();
        std::fs::write(v.join("config.toml"), text).unwrap();
        let tmp = dir.join("..data_tmp");
        std::os::unix::fs::symlink(version, &tmp).unwrap();
        std::fs::rename(&tmp, dir.join("..data")).unwrap();
    }

    #[test]
    fn a_configmap_symlink_swap_is_a_change_once_and_a_touch_with_the_same_content_is_not() {
        let dir = tempfile::tempdir().unwrap();
        configmap_version(dir.path(), "..v1", "a = 1\n");
        let path = dir.path().join("config.toml");
        std::os::unix::fs::symlink("..data/config.toml", &path).unwrap();
        let t0 = Instant::now();
        let mut w = ConfigWatch::new(&path, 10 * S, t0);
        assert!(!w.changed(&path, t0 + 10 * S), "nothing changed yet");
        configmap_version(dir.path(), "..v2", "a = 2\n");
        assert!(!w.changed(&path, t0 + 15 * S), "no look is due before 20 s");
        assert!(
            w.changed(&path, t0 + 20 * S),
            "the swap is seen at the next look"
        );
        assert!(!w.changed(&path, t0 + 30 * S), "and only once");
        // Same content in a new version (the kubelet rewrote every key): no reload.
        configmap_version(dir.path(), "..v3", "a = 2\n");
        assert!(!w.changed(&path, t0 + 40 * S));
        // A file that cannot be read is a change (the reload says why), once.
        std::fs::remove_file(&path).unwrap();
        assert!(w.changed(&path, t0 + 50 * S));
        assert!(!w.changed(&path, t0 + 60 * S));
        std::os::unix::fs::symlink("..data/config.toml", &path).unwrap();
        assert!(w.changed(&path, t0 + 70 * S));
    }
}
