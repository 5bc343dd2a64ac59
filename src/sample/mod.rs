//! Sampling: turns /proc and NVML into a `Snapshot`. Each source sits behind a small trait so the
//! daemon can be driven by fakes and the policy never touches the OS. `procfs.rs` reads /proc,
//! `scan.rs` keeps the process table current on a thread of its own, `nvml.rs` samples GPUs on
//! another.

pub mod engine;
pub mod nvml;
pub mod procfs;
pub mod prometheus;
pub mod scan;
pub mod weights;

use crate::snapshot::{HostMemory, Process};

pub use self::procfs::ProcfsSource;

/// Host memory and processes.
pub trait ProcSource {
    /// MemTotal/MemAvailable/swap/PSI: cheap, read every tick.
    fn host_memory(&mut self) -> HostMemory;
    /// Every process on the host (a process that exits mid-scan is skipped).
    fn scan(&mut self) -> Vec<Process>;
    /// One process, or `None` if it is gone.
    fn read(&mut self, pid: i32) -> Option<Process>;
}
