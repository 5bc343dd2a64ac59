//! The /proc sampler, on the `procfs` crate. The root is configurable so tests can point it at
//! fixture directories (hostile `comm` names included).

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use procfs::process::{Process as ProcfsProcess, Stat, Status};
use procfs::{FromRead, MemoryPressure};

use crate::snapshot::{HostMemory, Process, ProcessId};

use super::ProcSource;

/// `PF_KTHREAD` in /proc/PID/stat's flags.
const PF_KTHREAD: u32 = 0x0020_0000;

struct StaticInfo {
    comm: String,
    /// The real uid, from `status`.
    uid: u32,
    /// The owner of /proc/PID when this was read.
    owner: u32,
    cmdline: String,
    cgroup: String,
}

pub struct ProcfsSource {
    root: PathBuf,
    page_size: u64,
    /// uid, cmdline and cgroup rarely change during a process's life: read once per (process,
    /// comm, owner), since an exec (a launcher script becoming python) changes comm but not the
    /// start time, and a setuid() changes the owner of /proc/PID.
    static_info: HashMap<ProcessId, StaticInfo>,
    /// From the latest meminfo: per-process swap is only worth reading where there is swap.
    host_has_swap: bool,
}

impl ProcfsSource {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        ProcfsSource {
            root: root.into(),
            page_size: procfs::page_size(),
            static_info: HashMap::new(),
            host_has_swap: true,
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// One process. The scan's cost is per process, so only `stat` is read every time; uid,
    /// cmdline and cgroup are read once per (process, comm), and `status` (for VmSwap) only on
    /// hosts with swap.
    fn read_process(&mut self, dir: PathBuf) -> Option<Process> {
        let stat = Stat::from_file(dir.join("stat")).ok()?;
        let kernel_thread = stat.flags & PF_KTHREAD != 0;
        let id = ProcessId {
            pid: stat.pid,
            start_time: stat.starttime,
        };
        // The owner of /proc/PID is the effective uid: a setuid() without exec changes it.
        let owner = std::fs::metadata(&dir).ok()?.uid();
        let info = match self.static_info.get(&id) {
            Some(info) if info.comm == stat.comm && info.owner == owner => info,
            _ => {
                let proc = ProcfsProcess::new_with_root(dir.clone()).ok()?;
                let info = StaticInfo {
                    comm: stat.comm.clone(),
                    owner,
                    uid: match Status::from_file(dir.join("status")) {
                        Ok(status) => status.ruid,
                        Err(_) => proc.uid().ok()?,
                    },
                    cmdline: proc
                        .cmdline()
                        .map(|args| args.join(" "))
                        .unwrap_or_default(),
                    cgroup: std::fs::read_to_string(dir.join("cgroup"))
                        .map(|text| parse_cgroup(&text))
                        .unwrap_or_default(),
                };
                self.static_info.entry(id).insert_entry(info).into_mut()
            }
        };
        let swap_bytes = if self.host_has_swap && !kernel_thread {
            Status::from_file(dir.join("status"))
                .ok()
                .and_then(|s| s.vmswap)
                .map(|kib| kib * 1024)
        } else {
            Some(0).filter(|_| !kernel_thread)
        };
        Some(Process {
            pid: stat.pid,
            start_time: stat.starttime,
            ppid: stat.ppid,
            uid: info.uid,
            state: stat.state,
            comm: stat.comm,
            cmdline: info.cmdline.clone(),
            cgroup: info.cgroup.clone(),
            rss_bytes: stat.rss * self.page_size,
            swap_bytes,
            kernel_thread,
        })
    }
}

/// The four /proc/meminfo fields the guard needs, read every tick. (procfs's `Meminfo` parses
/// every field into a map and fails as a whole if one it expects is missing; this is the hot
/// path, and a missing field must leave only that reading unknown.)
fn parse_meminfo(text: &str, host: &mut HostMemory) {
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let slot = match key {
            "MemTotal" => &mut host.total_bytes,
            "MemAvailable" => &mut host.available_bytes,
            "SwapTotal" => &mut host.swap_total_bytes,
            "SwapFree" => &mut host.swap_free_bytes,
            _ => continue,
        };
        let mut parts = rest.split_whitespace();
        let value = parts.next().and_then(|v| v.parse::<u64>().ok());
        let scale = match parts.next() {
            Some("kB") => 1024,
            None => 1,
            Some(_) => continue,
        };
        *slot = value.map(|v| v * scale);
    }
}

/// The cgroup v2 path (`0::/system.slice/x.service`), else the first hierarchy's path.
fn parse_cgroup(text: &str) -> String {
    let path_of = |line: &str| line.splitn(3, ':').nth(2).map(str::to_string);
    text.lines()
        .find(|l| l.starts_with("0::"))
        .and_then(path_of)
        .or_else(|| text.lines().next().and_then(path_of))
        .unwrap_or_default()
}

impl ProcSource for ProcfsSource {
    fn host_memory(&mut self) -> HostMemory {
        let mut host = HostMemory::default();
        if let Ok(text) = std::fs::read_to_string(self.root.join("meminfo")) {
            parse_meminfo(&text, &mut host);
        }
        self.host_has_swap = host.swap_total_bytes != Some(0);
        if let Ok(psi) = MemoryPressure::from_file(self.root.join("pressure/memory")) {
            host.psi_some_avg10 = Some(psi.some.avg10 as f64);
            host.psi_full_avg10 = Some(psi.full.avg10 as f64);
        }
        host
    }

    fn scan(&mut self) -> Vec<Process> {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name();
            if name
                .to_str()
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
            {
                // A process that exits mid-scan is normal: it is simply not in this scan.
                if let Some(p) = self.read_process(entry.path()) {
                    out.push(p);
                }
            }
        }
        let seen: HashSet<ProcessId> = out.iter().map(Process::id).collect();
        self.static_info.retain(|id, _| seen.contains(id));
        out
    }

    fn read(&mut self, pid: i32) -> Option<Process> {
        self.read_process(self.root.join(pid.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::write(
            root.join("meminfo"),
            "MemTotal:       24683656 kB\nMemFree:        1000 kB\nMemAvailable:   2048 kB\nSwapTotal:      0 kB\nSwapFree:       0 kB\n",
        )
        .unwrap();
        // A hostile name: parentheses and spaces inside comm.
        let p = root.join("4242");
        std::fs::create_dir_all(&p).unwrap();
        let stat = "4242 (foo) Z ) S 1 4242 4242 0 -1 4194304 100 0 0 0 5 3 0 0 20 0 1 0 98765 100000000 2560 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0 0 0 0 0 0 0 0 0\n";
        std::fs::write(p.join("stat"), stat).unwrap();
        // A real status file with the fields of interest rewritten.
        let status: String = std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .map(|l| match l.split(':').next() {
                Some("Name") => "Name:\tfoo) Z ".to_string(),
                Some("Uid") => "Uid:\t1000\t1000\t1000\t1000".to_string(),
                Some("VmSwap") => "VmSwap:\t512 kB".to_string(),
                _ => l.to_string(),
            })
            .map(|l| l + "\n")
            .collect();
        std::fs::write(p.join("status"), status).unwrap();
        std::fs::write(p.join("cmdline"), "python3\0-m\0vllm.entrypoints\0").unwrap();
        std::fs::write(p.join("cgroup"), "0::/system.slice/vllm.service\n").unwrap();
        // A kernel thread.
        let k = root.join("2");
        std::fs::create_dir_all(&k).unwrap();
        std::fs::write(k.join("stat"), "2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 1 0 0 18446744073709551615 0 0 0 0 0 0 0 2147483647 0 0 0 0 17 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n").unwrap();
        // A process that vanished between readdir and read: a directory with no files.
        std::fs::create_dir_all(root.join("999")).unwrap();
        dir
    }

    #[test]
    fn reads_meminfo_in_bytes_and_psi_absent_is_unknown() {
        let dir = fixture();
        let host = ProcfsSource::new(dir.path()).host_memory();
        assert_eq!(host.total_bytes, Some(24683656 * 1024));
        assert_eq!(host.available_bytes, Some(2048 * 1024));
        assert_eq!(
            host.psi_some_avg10, None,
            "no pressure file: unknown, not zero"
        );
    }

    #[test]
    fn parses_hostile_comm_and_skips_vanished_processes() {
        let dir = fixture();
        let mut source = ProcfsSource::new(dir.path());
        let mut procs = source.scan();
        procs.sort_by_key(|p| p.pid);
        assert_eq!(procs.len(), 2, "{procs:?}");
        let kthread = &procs[0];
        assert!(kthread.kernel_thread);
        let p = &procs[1];
        assert_eq!(p.comm, "foo) Z ");
        assert_eq!(p.state, 'S');
        assert_eq!(p.ppid, 1);
        assert_eq!(p.start_time, 98765);
        assert_eq!(p.uid, 1000);
        assert_eq!(p.rss_bytes, 2560 * procfs::page_size());
        assert_eq!(p.swap_bytes, Some(512 * 1024));
        assert_eq!(p.cmdline, "python3 -m vllm.entrypoints");
        assert_eq!(p.cgroup, "/system.slice/vllm.service");
        assert!(!p.kernel_thread);
        assert!(source.read(999).is_none());
    }

    #[test]
    fn reads_this_process_from_real_proc() {
        let mut source = ProcfsSource::new("/proc");
        let me = source.read(std::process::id() as i32).expect("own process");
        assert!(me.rss_bytes > 0);
        assert!(!me.kernel_thread);
        assert!(source.scan().iter().any(|p| p.pid == me.pid));
        assert!(source.host_memory().available_bytes.is_some());
    }

    #[test]
    fn missing_meminfo_fields_stay_unknown() {
        let mut host = HostMemory::default();
        parse_meminfo("MemTotal: 100 kB\nSwapFree: 0 kB\nBogus line\n", &mut host);
        assert_eq!(host.total_bytes, Some(102400));
        assert_eq!(host.available_bytes, None);
        assert_eq!(host.swap_free_bytes, Some(0));
    }

    #[test]
    fn cgroup_prefers_v2_line() {
        assert_eq!(parse_cgroup("4:memory:/a\n0::/b.service\n"), "/b.service");
        assert_eq!(parse_cgroup("4:memory:/a\n"), "/a");
    }
}
