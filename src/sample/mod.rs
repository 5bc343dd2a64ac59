//! Sampling: turns /proc and NVML into a `Snapshot`. Each source sits behind a small trait
//! (`ProcSource`, `TableSource`, `nvml::GpuSource`) so the daemon can be driven by fakes
//! (`src/daemon/tests/`) and the policy never touches the OS. `procfs.rs` reads /proc, `scan/`
//! keeps the process table current on a thread of its own, `nvml.rs` samples GPUs on another.
//! `sockets.rs` tells whose a listening socket is, and `own_sockets.rs` asks a model server's
//! URLs of its own sockets only.

pub(crate) mod cgroup;
pub(crate) mod engine;
pub(crate) mod gce;
pub(crate) mod host_facts;
pub mod nvml;
pub(crate) mod own_sockets;
pub(crate) mod proc_events;
pub(crate) mod procfs;
pub(crate) mod prometheus;
pub(crate) mod scan;
pub(crate) mod sockets;
pub(crate) mod tmpfs;
pub(crate) mod weights;

use crate::snapshot::HostMemory;

pub(crate) use self::procfs::ProcfsSource;
use self::procfs::{ReadError, Vitals};
use self::scan::{ScanRequest, ScanResult};

/// Host memory, and the few processes the loop reads itself (the victims it waits on). The
/// process table comes from a `TableSource`.
pub trait ProcSource: Send {
    /// MemTotal/MemAvailable/swap/PSI: cheap, read every tick.
    fn host_memory(&mut self) -> HostMemory;
    /// Why host memory is unknown, while it is.
    fn host_error(&self) -> Option<&str>;
    /// The host has swap (as of the last `host_memory`): VmSwap is worth reading.
    fn host_has_swap(&self) -> bool;
    /// State and memory of one process; `Err(Gone)` only when it has exited.
    fn vitals(&mut self, pid: i32) -> Result<Vitals, ReadError>;
    /// Bytes of tmpfs files per owning uid (read near the RAM floor only).
    fn tmpfs_owners(&mut self) -> std::collections::BTreeMap<u32, u64> {
        std::collections::BTreeMap::new()
    }
}

/// Rounds of the process table: what changed since the previous round (`scan::Scanner` over
/// /proc; the daemon runs it on a thread of its own).
pub trait TableSource: Send {
    fn round(&mut self, request: ScanRequest) -> ScanResult;
}

/// The Python interpreter itself (`sys.executable`), not a wrapper script that execs it (pyenv's
/// shims): the unit tests that watch a real child's `exec` must not see the wrapper's own.
#[cfg(test)]
pub(crate) fn python3() -> &'static str {
    static PYTHON: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PYTHON.get_or_init(|| {
        let out = std::process::Command::new("python3")
            .args(["-c", "import sys; print(sys.executable)"])
            .output()
            .expect("python3 is needed for the tests (apt-get install python3)");
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    })
}
