//! What a memory cgroup says that /proc will not tell a reader without CAP_SYS_PTRACE: its
//! anonymous memory, counted once however many of its processes map it (`anon` of cgroup v2's
//! `memory.stat`), and the processes in it (`cgroup.procs`). Both are world-readable. Near the
//! RAM floor the scan shares a cgroup's anonymous memory out among its processes in proportion
//! to each one's resident anonymous memory, for the processes whose PSS it may not read (other
//! accounts' under the packaged unit): forked workers that share copy-on-write pages then count
//! them once between them, as PSS would.

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
        let anon = parse_anon(&read_small(&dir.join("memory.stat"))?)?;
        let procs = read_small(&dir.join("cgroup.procs"))?
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        Some((anon, procs))
    }
}

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

/// `anon` of a cgroup v2 `memory.stat`, in bytes.
pub fn parse_anon(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("anon "))
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
