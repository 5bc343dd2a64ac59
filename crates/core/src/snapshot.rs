//! What one tick of sampling saw: plain data, no I/O. A reading that failed is `None` (unknown),
//! never zero: unknown may alert, never kill. A reading that contradicts itself (a GPU using more
//! than it has, more available than total) is unknown too: `inconsistency` says why.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::units::fmt_bytes;

/// Everything the policy decides from. `at` is the daemon's monotonic clock (time since start),
/// so the policy itself never reads a clock.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub at: Duration,
    pub host: HostMemory,
    /// The latest process scan (it runs every tick only near a floor or a budget).
    pub processes: ProcessTable,
    pub gpus: GpuSnapshot,
    /// gpuguard's own pid, never a victim.
    pub self_pid: i32,
    /// The weights files each GPU-holding process maps (/proc/PID/maps), read on scans.
    pub mapped_weights: BTreeMap<i32, Vec<MappedFile>>,
    /// Bytes of tmpfs files (`/dev/shm`, `/run/user/*`) per owning uid: memory no process holds,
    /// charged to whoever owns it. Read while RAM is below its warn floor only.
    pub tmpfs_owners: BTreeMap<u32, u64>,
}

/// A weights file (`.safetensors`, `.bin`, `.gguf`, `.pt`) a process has memory-mapped. The
/// file is identified by device and inode, so the same file under two paths is one file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MappedFile {
    pub path: String,
    /// `major:minor` of the file system, as /proc/PID/maps writes it.
    pub device: String,
    pub inode: u64,
    /// Bytes of the file this process maps.
    pub mapped_bytes: u64,
}

impl MappedFile {
    /// The file's identity: device and inode.
    pub fn key(&self) -> (&str, u64) {
        (&self.device, self.inode)
    }
}

/// Host memory from /proc/meminfo and /proc/pressure/memory, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HostMemory {
    pub total_bytes: Option<u64>,
    pub available_bytes: Option<u64>,
    pub swap_total_bytes: Option<u64>,
    pub swap_free_bytes: Option<u64>,
    /// PSI memory `some avg10`, percent; `None` where the kernel has no PSI.
    pub psi_some_avg10: Option<f64>,
    /// `Shmem`: tmpfs files (`/dev/shm`, a tmpfs `/tmp`), shared memory and memfds. It lowers
    /// MemAvailable, but no process needs to hold it: a file left in tmpfs by a process that has
    /// exited is in no process's RSS, and killing processes does not give it back.
    pub shmem_bytes: Option<u64>,
}

impl HostMemory {
    /// Why MemAvailable cannot be trusted, if it cannot: it is above MemTotal.
    pub fn inconsistency(&self) -> Option<String> {
        match (self.available_bytes, self.total_bytes) {
            (Some(a), Some(t)) if a > t => Some(format!(
                "inconsistent reading: MemAvailable {} > MemTotal {}",
                fmt_bytes(a),
                fmt_bytes(t)
            )),
            _ => None,
        }
    }

    /// SwapFree, if it is known and not above SwapTotal.
    pub fn trusted_swap_free_bytes(&self) -> Option<u64> {
        match (self.swap_free_bytes, self.swap_total_bytes) {
            (Some(free), Some(total)) if free <= total => Some(free),
            _ => None,
        }
    }
}

/// A process as a victim candidate: pid + start time identify it across pid reuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ProcessId {
    pub pid: i32,
    /// Start time in clock ticks since boot (field 22 of /proc/PID/stat).
    pub start_time: u64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Process {
    pub pid: i32,
    pub start_time: u64,
    pub ppid: i32,
    pub uid: u32,
    /// State letter from /proc/PID/stat (`R`, `S`, `T`, `Z`...).
    pub state: char,
    pub comm: String,
    /// Arguments joined by spaces.
    pub cmdline: String,
    pub cgroup: String,
    pub rss_bytes: u64,
    pub swap_bytes: Option<u64>,
    pub kernel_thread: bool,
    /// The executable of a system account's process (uid 1-999; read for those only): what the
    /// `[protect]` name rules trust instead of the name it gives itself.
    pub exe: Option<Exe>,
    /// Proportional set size (`/proc/PID/smaps_rollup`): its private pages plus its share of
    /// the pages it shares. Read only near the RAM floor, for processes of accounts other than
    /// root: what ranks an account by the memory killing its processes would really free.
    pub pss_bytes: Option<u64>,
}

/// A process's executable, as `/proc/PID/exe` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Exe {
    /// Its file name (`sshd`).
    pub name: String,
    /// Owned by root and writable by nobody else: not a file the account made or could change.
    pub system: bool,
}

impl Process {
    pub fn id(&self) -> ProcessId {
        ProcessId {
            pid: self.pid,
            start_time: self.start_time,
        }
    }

    /// The RAM counted for it (model sums, budgets, the RAM floor's ranking, status rows): its
    /// proportional share (PSS, or its share of its memory cgroup) where the scan read one,
    /// else its RSS. Forked workers share their pages; their RSS counts them once each.
    pub fn ram_bytes(&self) -> u64 {
        self.pss_bytes.unwrap_or(self.rss_bytes)
    }

    /// Gone in all but name: a zombie or dead task holds no memory and cannot be signalled usefully.
    pub fn exited(&self) -> bool {
        matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// One process scan, in pid order (the scan keeps it so). Between scans the loop re-reads the
/// victims it waits on in place, and marks one that is gone `X`. Everything that refers to a
/// process holds its `ProcessId` (pid + start time), never its position here.
#[derive(Clone, Debug, Default)]
pub struct ProcessTable {
    /// When the scan ran (daemon clock); `None` before the first scan.
    pub scanned_at: Option<Duration>,
    /// The scan read PSS (`Process::pss_bytes`) of the processes large enough to be worth it,
    /// where it could: a process of that size without one could not be read (RSS stands in).
    pub pss_read: bool,
    pub processes: Vec<Process>,
}

impl ProcessTable {
    pub fn get(&self, id: ProcessId) -> Option<&Process> {
        // In pid order from a scan; a table made by hand (tests) may not be.
        match self.processes.binary_search_by_key(&id.pid, |p| p.pid) {
            Ok(i) if self.processes[i].id() == id => Some(&self.processes[i]),
            _ => self.processes.iter().find(|p| p.id() == id),
        }
    }

    /// The process the scan saw with this pid, whichever it is (pid order: a binary search).
    pub fn by_pid(&self, pid: i32) -> Option<&Process> {
        match self.processes.binary_search_by_key(&pid, |p| p.pid) {
            Ok(i) => Some(&self.processes[i]),
            Err(_) => self.processes.iter().find(|p| p.pid == pid),
        }
    }

    /// True if the process is still there and has not exited.
    pub fn alive(&self, id: ProcessId) -> bool {
        self.get(id).is_some_and(|p| !p.exited())
    }
}

/// GPU state as NVML last reported it.
#[derive(Clone, Debug, Default)]
pub struct GpuSnapshot {
    /// Why GPU protection is off or degraded, if it is (no driver, GPU lost...).
    pub status: GpuStatus,
    /// When the reading below was taken (daemon clock); `None` if there never was one.
    pub sampled_at: Option<Duration>,
    /// True if the latest reading is older than the sample deadline: alert on it, never kill.
    pub stale: bool,
    pub devices: Vec<Gpu>,
    /// Counts the reads of the per-process lists (they are read less often than memory).
    pub process_lists_read: u64,
    /// The latest reading read the per-process lists in the same pass as the memory figures.
    pub processes_fresh: bool,
    /// This host has no GPU to read, and will have none while it runs as it is: GPU support is
    /// disabled (`[gpu] enabled = false`), NVML's library cannot be loaded, or the NVIDIA
    /// driver is not loaded (`status` says which). Not while NVML starts, nor when it fails in
    /// a way that may pass (a panic, a permission, a driver/library version mismatch): there the
    /// GPUs are unknown, and may be there.
    pub absent: bool,
}

impl GpuSnapshot {
    /// The largest GPU's memory (a `%` GPU budget is a share of it).
    pub fn largest_total_bytes(&self) -> Option<u64> {
        self.devices.iter().filter_map(|g| g.total_bytes).max()
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", content = "reason", rename_all = "snake_case")]
pub enum GpuStatus {
    /// No GPU support configured or NVML never loaded.
    #[default]
    Off,
    Unavailable(String),
    Ok,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub total_bytes: Option<u64>,
    pub used_bytes: Option<u64>,
    pub free_bytes: Option<u64>,
    /// Driver-reserved memory (NVML's v2 memory API): `total = used + free + reserved`.
    pub reserved_bytes: Option<u64>,
    pub utilization_percent: Option<u32>,
    /// An error NVML gave for this device (e.g. "GPU is lost"): its readings are unknown.
    pub error: Option<String>,
    /// The GPU fell off the bus (NVML says GPU_IS_LOST) or is no longer in NVML's device list.
    pub lost: bool,
    /// GPU memory per pid; `None` where NVML says the figure is unavailable. (In JSON a list of
    /// `[pid, bytes]`: the flight recorder's records are an internally tagged enum, whose maps
    /// cannot have number keys.)
    #[serde(with = "pid_pairs")]
    pub processes: BTreeMap<i32, Option<u64>>,
    /// False if the process list could not be read this time (the map above is then empty).
    pub processes_known: bool,
    /// The lists were read just before and just after the memory figures, were the same, and
    /// held no more than the card's used memory: this GPU's free memory and its processes'
    /// figures describe one moment.
    pub processes_steady: bool,
}

/// A map by pid as a list of `[pid, value]` pairs.
mod pid_pairs {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(
        map: &BTreeMap<i32, Option<u64>>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        map.iter().collect::<Vec<_>>().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<i32, Option<u64>>, D::Error> {
        Ok(Vec::<(i32, Option<u64>)>::deserialize(d)?
            .into_iter()
            .collect())
    }
}

/// How far `used + free + reserved` may be from `total` before a GPU reading counts as
/// inconsistent: a share of the total (1/64, about 1.6 %), and at least this much.
pub const GPU_MEMORY_SLACK_BYTES: u64 = 64 << 20;

impl Gpu {
    /// Why this GPU's memory figures cannot be trusted, if they cannot: more used (or free) than
    /// the card has, used + free + reserved far from the total, or a process holding more than
    /// the card. Figures NVML did not give are not checked (they are unknown already).
    pub fn inconsistency(&self) -> Option<String> {
        let total = self.total_bytes?;
        let over = |what: &str, bytes: u64| {
            Some(format!(
                "inconsistent reading: {what} {} > total {}",
                fmt_bytes(bytes),
                fmt_bytes(total)
            ))
        };
        if let Some(used) = self.used_bytes.filter(|&u| u > total) {
            return over("used", used);
        }
        if let Some(free) = self.free_bytes.filter(|&f| f > total) {
            return over("free", free);
        }
        if let (Some(used), Some(free)) = (self.used_bytes, self.free_bytes) {
            let sum =
                u128::from(used) + u128::from(free) + u128::from(self.reserved_bytes.unwrap_or(0));
            let slack = u128::from((total / 64).max(GPU_MEMORY_SLACK_BYTES));
            if sum.abs_diff(u128::from(total)) > slack {
                return Some(format!(
                    "inconsistent reading: used {} + free {} + reserved {} is far from total {}",
                    fmt_bytes(used),
                    fmt_bytes(free),
                    fmt_bytes(self.reserved_bytes.unwrap_or(0)),
                    fmt_bytes(total)
                ));
            }
        }
        let holder = self
            .processes
            .iter()
            .filter_map(|(pid, bytes)| bytes.map(|b| (*pid, b)))
            .find(|&(_, b)| b > total);
        holder.and_then(|(pid, bytes)| over(&format!("pid {pid} holds"), bytes))
    }

    /// Why nothing may be decided from this GPU's memory figures, if so: an NVML error, a lost
    /// GPU, or an inconsistent reading.
    pub fn untrusted(&self) -> Option<String> {
        match &self.error {
            Some(e) => Some(e.clone()),
            None if self.lost => Some("GPU lost".into()),
            None => self.inconsistency(),
        }
    }
}

/// Text a process chose (its name, its command line) made safe for logs, alerts and terminals:
/// control characters (newlines, escape sequences, bidirectional overrides) become `\u{..}`
/// escapes, so a process cannot forge log lines or rewrite an operator's screen.
pub fn printable(text: &str) -> Cow<'_, str> {
    let unsafe_char = |c: char| {
        c.is_control()
            || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    if !text.chars().any(unsafe_char) {
        return Cow::Borrowed(text);
    }
    Cow::Owned(
        text.chars()
            .map(|c| {
                if unsafe_char(c) {
                    c.escape_unicode().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped() {
        assert!(matches!(printable("python3 -m vllm"), Cow::Borrowed(_)));
        assert_eq!(
            printable("evil\n2026-01-01 INFO killed sshd\x1b[2J"),
            "evil\\u{a}2026-01-01 INFO killed sshd\\u{1b}[2J"
        );
        assert_eq!(printable("a\u{202e}b"), "a\\u{202e}b");
    }
}
