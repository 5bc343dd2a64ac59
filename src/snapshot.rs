//! What one tick of sampling saw: plain data, no I/O. A reading that failed is `None` (unknown),
//! never zero: unknown may alert, never kill.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

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
}

/// Host memory from /proc/meminfo and /proc/pressure/memory, in bytes.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct HostMemory {
    pub total_bytes: Option<u64>,
    pub available_bytes: Option<u64>,
    pub swap_total_bytes: Option<u64>,
    pub swap_free_bytes: Option<u64>,
    /// PSI memory `some avg10`, percent; `None` where the kernel has no PSI.
    pub psi_some_avg10: Option<f64>,
    pub psi_full_avg10: Option<f64>,
}

/// A process as a victim candidate: pid + start time identify it across pid reuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
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
}

impl Process {
    pub fn id(&self) -> ProcessId {
        ProcessId {
            pid: self.pid,
            start_time: self.start_time,
        }
    }

    /// Gone in all but name: a zombie or dead task holds no memory and cannot be signalled usefully.
    pub fn exited(&self) -> bool {
        matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// One process scan. Its order is fixed until the next scan (the policy's attribution indexes
/// it): between scans, entries are only updated in place, and a process that is gone is marked
/// `X` rather than removed.
#[derive(Clone, Debug, Default)]
pub struct ProcessTable {
    /// When the scan ran (daemon clock); `None` before the first scan.
    pub scanned_at: Option<Duration>,
    pub processes: Vec<Process>,
}

impl ProcessTable {
    pub fn get(&self, id: ProcessId) -> Option<&Process> {
        self.processes.iter().find(|p| p.id() == id)
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
}

impl GpuSnapshot {
    /// The largest GPU's memory (a `%` GPU budget is a share of it).
    pub fn largest_total_bytes(&self) -> Option<u64> {
        self.devices.iter().filter_map(|g| g.total_bytes).max()
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(tag = "state", content = "reason", rename_all = "snake_case")]
pub enum GpuStatus {
    /// No GPU support configured or NVML never loaded.
    #[default]
    Off,
    Unavailable(String),
    Ok,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Gpu {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub total_bytes: Option<u64>,
    pub used_bytes: Option<u64>,
    pub free_bytes: Option<u64>,
    pub utilization_percent: Option<u32>,
    /// An error NVML gave for this device (e.g. "GPU is lost"): its readings are unknown.
    pub error: Option<String>,
    /// GPU memory per pid; `None` where NVML says the figure is unavailable.
    pub processes: BTreeMap<i32, Option<u64>>,
    /// False if the process list could not be read this time (the map above is then empty).
    pub processes_known: bool,
}
