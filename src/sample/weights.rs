//! Which weights files the processes holding GPU memory have memory-mapped, from
//! /proc/PID/maps: two processes on one GPU that map the same `.safetensors`, `.bin`, `.gguf` or
//! `.pt` file hold the same weights twice, whatever their command lines. Reading maps is not
//! free (a Python process has thousands of lines), so it is done only on process scans, on the
//! scan thread (`scan/`), and only for processes NVML lists with GPU memory.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::snapshot::MappedFile;

/// File name endings that mark model weights.
pub const WEIGHT_SUFFIXES: &[&str] = &[".safetensors", ".bin", ".gguf", ".pt", ".pth"];
/// Smaller mappings are not weights worth reporting (a header page, a small `.bin` of a library).
pub const MIN_MAPPED_BYTES: u64 = 1 << 20;
/// At most this many lines of one maps file are read.
const MAX_LINES: usize = 200_000;

/// Said once: maps of other users' processes are not readable without CAP_SYS_PTRACE.
static DENIED_SAID: AtomicBool = AtomicBool::new(false);

/// One process's mapped weights files; empty if it is gone or its maps cannot be read.
pub fn read(proc_root: &Path, pid: i32) -> Vec<MappedFile> {
    match std::fs::File::open(proc_root.join(pid.to_string()).join("maps")) {
        Ok(file) => parse_maps(
            BufReader::new(file)
                .lines()
                .map_while(Result::ok)
                .take(MAX_LINES),
        ),
        Err(e) => {
            if e.kind() == std::io::ErrorKind::PermissionDenied
                && !DENIED_SAID.swap(true, Ordering::Relaxed)
            {
                tracing::warn!(
                    "cannot read /proc/{pid}/maps: {e}; duplicate weights of other users' \
                     processes are found by command line only (the kernel wants CAP_SYS_PTRACE \
                     to read another user's maps: add it to the unit's CapabilityBoundingSet= \
                     in a drop-in to have them found by the files they map)"
                );
            }
            Vec::new()
        }
    }
}

/// `start-end perms offset dev inode path` lines -> one entry per weights file, with the bytes
/// mapped summed over its mappings.
pub fn parse_maps(lines: impl Iterator<Item = String>) -> Vec<MappedFile> {
    let mut files: BTreeMap<(String, u64), MappedFile> = BTreeMap::new();
    for line in lines {
        let mut fields = line.splitn(6, ' ');
        let (Some(range), Some(_perms), Some(_offset), Some(device), Some(inode), Some(path)) = (
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
        ) else {
            continue;
        };
        let path = path.trim_start();
        let path = path.strip_suffix(" (deleted)").unwrap_or(path);
        if !WEIGHT_SUFFIXES.iter().any(|s| path.ends_with(s)) {
            continue;
        }
        let (Some(length), Ok(inode)) = (mapping_length(range), inode.parse::<u64>()) else {
            continue;
        };
        if inode == 0 {
            continue;
        }
        files
            .entry((device.to_string(), inode))
            .or_insert_with(|| MappedFile {
                // A user names its files: no control characters reach logs, events or status.
                path: crate::snapshot::printable(path).into_owned(),
                device: device.to_string(),
                inode,
                mapped_bytes: 0,
            })
            .mapped_bytes += length;
    }
    files
        .into_values()
        .filter(|f| f.mapped_bytes >= MIN_MAPPED_BYTES)
        .collect()
}

fn mapping_length(range: &str) -> Option<u64> {
    let (start, end) = range.split_once('-')?;
    let (start, end) = (
        u64::from_str_radix(start, 16).ok()?,
        u64::from_str_radix(end, 16).ok()?,
    );
    end.checked_sub(start)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Round three: a user names its weights file with an escape sequence, a bell and a carriage
    /// return; they reached the log, events, webhooks and `status` as they were.
    #[test]
    fn control_characters_in_a_path_are_escaped() {
        let line = "7f0000000000-7f0040000000 r--s 00000000 fd:01 9 /tmp/\u{1b}[2J\u{7}x\rERROR.safetensors";
        let files = parse_maps(std::iter::once(line.to_string()));
        assert_eq!(files.len(), 1);
        let path = &files[0].path;
        assert!(!path.chars().any(char::is_control), "{path:?}");
        assert!(path.contains("\\u{1b}[2J\\u{7}x\\u{d}ERROR"), "{path:?}");
    }

    #[test]
    fn keeps_weights_files_by_device_and_inode() {
        let maps = "\
7f0000000000-7f0040000000 r--s 00000000 fd:01 1234 /models/llama/model-00001-of-00002.safetensors
7f0040000000-7f0040200000 r--s 40000000 fd:01 1234 /models/llama/model-00001-of-00002.safetensors
7f1000000000-7f1000100000 r--p 00000000 fd:01 99 /usr/lib/x86_64-linux-gnu/libc.so.6
7f2000000000-7f2000001000 r--s 00000000 fd:01 77 /models/tiny/header.bin
7f3000000000-7f3000200000 r--s 00000000 fd:01 55 /models/with space/model.gguf (deleted)
7f4000000000-7f4000200000 rw-p 00000000 00:00 0 
garbage line
7f5000000000-zz r--s 00000000 fd:01 56 /x.pt
";
        let files = parse_maps(maps.lines().map(str::to_string));
        assert_eq!(files.len(), 2, "{files:?}");
        let a = &files.iter().find(|f| f.inode == 1234).unwrap();
        assert_eq!(
            a.mapped_bytes,
            (1 << 30) + (2 << 20),
            "both mappings of the file"
        );
        assert_eq!(a.device, "fd:01");
        let b = files.iter().find(|f| f.inode == 55).unwrap();
        assert_eq!(b.path, "/models/with space/model.gguf");
    }

    #[test]
    fn reads_a_real_mapping_of_this_process() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        std::fs::write(&path, vec![1u8; 2 << 20]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: a read-only shared mapping of a file this test owns, unmapped below.
        let mapping = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                2 << 20,
                rustix::mm::ProtFlags::READ,
                rustix::mm::MapFlags::SHARED,
                &file,
                0,
            )
        }
        .unwrap();
        let files = read(Path::new("/proc"), std::process::id() as i32);
        // SAFETY: the mapping made above, of that length.
        unsafe { rustix::mm::munmap(mapping, 2 << 20) }.unwrap();
        let found = files
            .iter()
            .find(|f| f.path.ends_with("model.safetensors"))
            .unwrap_or_else(|| panic!("{files:?}"));
        assert_eq!(found.mapped_bytes, 2 << 20);
        assert!(
            read(Path::new("/proc"), i32::MAX).is_empty(),
            "no such process"
        );
    }
}
