//! What a memory cgroup says that /proc will not tell a reader without CAP_SYS_PTRACE: its
//! anonymous memory, counted once however many of its processes map it (`anon` of cgroup v2's
//! `memory.stat`), and the processes in it (`cgroup.procs`). Both are world-readable. Near the
//! RAM floor the scan shares a cgroup's anonymous memory out among its processes in proportion
//! to each one's resident anonymous memory, for the processes whose PSS it may not read (other
//! accounts' under the packaged unit): forked workers that share copy-on-write pages then count
//! them once between them, as PSS would.
//!
//! And the shared memory each login user's slice is charged for (`shmem` of
//! `user.slice/user-UID.slice`): tmpfs files its processes wrote, wherever they are and whoever
//! may look into their directory, unlinked ones still held open included.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

/// A cgroup v2 hierarchy (`/sys/fs/cgroup`; a fixture in tests).
pub struct Cgroups {
    root: PathBuf,
}

/// `memory.stat` and `cgroup.procs` are small; a larger file is not what the kernel writes.
const MAX_FILE_BYTES: u64 = 1 << 20;

impl Cgroups {
    /// The hierarchy at `root` if it is cgroup v2 with the memory controller (its root's
    /// `cgroup.controllers` names `memory`); None on cgroup v1, where nothing would be read
    /// each round in vain.
    pub fn open(root: impl Into<PathBuf>) -> Option<Cgroups> {
        let root = root.into();
        let controllers = read_small(&root.join("cgroup.controllers"))?;
        controllers
            .split_ascii_whitespace()
            .any(|c| c == "memory")
            .then_some(Cgroups { root })
    }

    /// The anonymous memory of the cgroup at `path` (as /proc/PID/cgroup names it) and the
    /// processes directly in it; None on cgroup v1, a path that leaves the hierarchy, or any
    /// read that fails.
    pub fn anon_and_procs(&self, path: &str) -> Option<(u64, Vec<i32>)> {
        let relative = Path::new(path.strip_prefix('/')?);
        if relative
            .components()
            .any(|c| !matches!(c, Component::Normal(_)))
        {
            return None;
        }
        let dir = self.root.join(relative);
        let anon = stat_field(&read_small(&dir.join("memory.stat"))?, "anon")?;
        let procs = read_small(&dir.join("cgroup.procs"))?
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        Some((anon, procs))
    }
}

impl Cgroups {
    /// Shared memory charged to each login user's slice (`user.slice/user-UID.slice`, as
    /// systemd-logind makes them for sessions and the user's own manager): tmpfs files its
    /// processes wrote, in any directory (one the reader may not enter too) or unlinked and
    /// still open, with its System V and shared anonymous memory. The kernel charges a tmpfs
    /// page to the cgroup of the process that first wrote it, and keeps it there (a session
    /// that ended included) until the page is freed. At most `MAX_USER_SLICES` slices.
    pub fn user_shmem(&self) -> BTreeMap<u32, u64> {
        let Ok(entries) = std::fs::read_dir(self.root.join("user.slice")) else {
            return BTreeMap::new();
        };
        entries
            .flatten()
            .take(MAX_USER_SLICES)
            .filter_map(|e| {
                let name = e.file_name();
                let uid = name
                    .to_str()?
                    .strip_prefix("user-")?
                    .strip_suffix(".slice")?
                    .parse()
                    .ok()?;
                let stat = read_small(&e.path().join("memory.stat"))?;
                Some((uid, stat_field(&stat, "shmem")?))
            })
            .filter(|&(_, bytes)| bytes > 0)
            .collect()
    }
}

/// More login users' slices than this are not read (a round near the floor stays short).
const MAX_USER_SLICES: usize = 4096;

fn read_small(path: &Path) -> Option<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)
        .ok()?
        .take(MAX_FILE_BYTES)
        .read_to_string(&mut text)
        .ok()?;
    Some(text)
}

/// Field `key` of a cgroup v2 `memory.stat` (`anon`, `shmem`, ...), in bytes.
pub fn stat_field(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// A process's share of its cgroup's anonymous memory: `own` (its resident anonymous memory)
/// over `all` (that of every process in the cgroup) of `cgroup_anon`, never more than `own`.
pub fn share(own: u64, all: u64, cgroup_anon: u64) -> u64 {
    if all == 0 {
        return 0;
    }
    let share = own as u128 * cgroup_anon as u128 / all as u128;
    (share as u64).min(own)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_anon_and_the_processes_of_a_v2_cgroup_and_nothing_outside_it() {
        let dir = tempfile::tempdir().unwrap();
        let cg = dir.path().join("user.slice/user-1000.slice");
        std::fs::create_dir_all(&cg).unwrap();
        std::fs::write(
            cg.join("memory.stat"),
            "anon_thp 0\nanon 1073741824\nfile 5\n",
        )
        .unwrap();
        std::fs::write(cg.join("cgroup.procs"), "10\n11\n").unwrap();
        assert!(
            Cgroups::open(dir.path()).is_none(),
            "no controllers: cgroup v1"
        );
        std::fs::write(dir.path().join("cgroup.controllers"), "cpu io pids\n").unwrap();
        assert!(Cgroups::open(dir.path()).is_none(), "no memory controller");
        std::fs::write(
            dir.path().join("cgroup.controllers"),
            "cpu io memory pids\n",
        )
        .unwrap();
        let cgroups = Cgroups::open(dir.path()).unwrap();
        assert_eq!(
            cgroups.anon_and_procs("/user.slice/user-1000.slice"),
            Some((1 << 30, vec![10, 11]))
        );
        for outside in ["/user.slice/../../etc", "user.slice", "/missing"] {
            assert_eq!(cgroups.anon_and_procs(outside), None, "{outside}");
        }
    }

    /// Each login user's slice says the shared memory its processes made; other slices, other
    /// names and empty figures say nothing.
    #[test]
    fn reads_the_shared_memory_of_each_login_users_slice() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("cgroup.controllers"), "memory\n").unwrap();
        let slice = |name: &str, stat: &str| {
            let d = dir.path().join("user.slice").join(name);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("memory.stat"), stat).unwrap();
        };
        slice("user-1001.slice", "anon 5\nshmem_thp 7\nshmem 2147483648\n");
        slice("user-1002.slice", "anon 5\nshmem 0\n");
        slice("user-x.slice", "shmem 9\n");
        slice("session-3.scope", "shmem 9\n");
        let cgroups = Cgroups::open(dir.path()).unwrap();
        assert_eq!(cgroups.user_shmem(), BTreeMap::from([(1001, 2u64 << 30)]));
        std::fs::remove_dir_all(dir.path().join("user.slice")).unwrap();
        assert!(cgroups.user_shmem().is_empty());
    }

    #[test]
    fn a_share_is_proportional_and_never_more_than_the_process_holds() {
        // Four forked workers, 2 GiB of resident anonymous memory each, 1.5 GiB of it the
        // parent's pages they share: the cgroup holds 2 + 3 * 0.5 = 3.5 GiB.
        let gib = 1u64 << 30;
        assert_eq!(share(2 * gib, 8 * gib, 7 * gib / 2), 7 * gib / 8);
        assert_eq!(share(gib, gib, 4 * gib), gib);
        assert_eq!(share(gib, 0, gib), 0);
        assert_eq!(share(u64::MAX, u64::MAX, u64::MAX), u64::MAX);
    }
}
