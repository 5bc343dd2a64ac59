//! Who owns the memory in tmpfs files: `/dev/shm` and `/run/user/*` walked (a bounded number of
//! entries, a bounded depth), each regular file's allocated bytes added to its owner's uid.
//! `Shmem` says how much there is; this says whose it is.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Where users can leave files in memory.
pub const TMPFS_DIRS: &[&str] = &["/dev/shm", "/run/user"];
/// At most this many entries are looked at in all (a directory of millions of tiny files costs
/// no more than this).
const MAX_ENTRIES: usize = 20_000;
const MAX_DEPTH: usize = 6;

/// Allocated bytes of regular files under `dirs`, per owning uid (symlinks are not followed).
pub fn owners(dirs: &[&Path]) -> BTreeMap<u32, u64> {
    let mut owners = BTreeMap::new();
    let mut budget = MAX_ENTRIES;
    let mut stack: Vec<(std::path::PathBuf, usize)> =
        dirs.iter().map(|d| (d.to_path_buf(), 0)).collect();
    while let Some((dir, depth)) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            if budget == 0 {
                return owners;
            }
            budget -= 1;
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            if meta.is_dir() && depth < MAX_DEPTH {
                stack.push((entry.path(), depth + 1));
            } else if meta.is_file() {
                *owners.entry(meta.uid()).or_default() += meta.blocks() * 512;
            }
        }
    }
    owners
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_added_to_their_owners() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a"), vec![1u8; 1 << 20]).unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/b"), vec![1u8; 1 << 20]).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("link")).unwrap();
        let me = rustix::process::getuid().as_raw();
        let owners = owners(&[dir.path()]);
        assert!(owners[&me] >= 2 << 20, "{owners:?}");
        assert_eq!(owners.len(), 1, "{owners:?}");
    }
}
