//! The status report: what `gpuguard status` shows and `status --json` prints. Its JSON is a
//! stable, versioned schema (`schema_version`); fields are only ever added within a version.

use serde::{Deserialize, Serialize};

/// Bumped when a field changes meaning or disappears.
pub const STATUS_SCHEMA_VERSION: u32 = 1;

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct StatusReport {
    pub schema_version: u32,
    pub hostname: String,
    pub version: String,
    /// "enforce" or "observe".
    pub mode: String,
    pub uptime_seconds: f64,
    pub memory: MemoryStatus,
    pub gpu_protection: GpuProtection,
    pub gpus: Vec<GpuRow>,
    pub models: Vec<ModelRow>,
    pub queue: Vec<QueuedRow>,
    pub leases: Vec<LeaseRow>,
    /// Processes gpuguard holds stopped (SIGSTOP or a throttle duty cycle).
    pub held: Vec<HeldRow>,
    /// The latest actions, newest last.
    pub recent_actions: Vec<ActionRow>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct MemoryStatus {
    pub total_bytes: Option<u64>,
    pub available_bytes: Option<u64>,
    pub swap_total_bytes: Option<u64>,
    pub swap_free_bytes: Option<u64>,
    pub psi_some_avg10: Option<f64>,
    pub warn_available_bytes: Option<u64>,
    pub min_available_bytes: Option<u64>,
    /// "ok", "warn", "act" or "unknown".
    pub level: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GpuProtection {
    /// "ok", "starting" (NVML not sampled yet), "unavailable" or "off".
    pub state: String,
    pub reason: Option<String>,
    /// The latest GPU sample is late or old: alerts only.
    pub stale: bool,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GpuRow {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub total_bytes: Option<u64>,
    pub used_bytes: Option<u64>,
    pub free_bytes: Option<u64>,
    pub utilization_percent: Option<u32>,
    pub warn_free_bytes: Option<u64>,
    pub min_free_bytes: Option<u64>,
    pub level: String,
    pub error: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ModelRow {
    pub name: String,
    /// "config" or "launch".
    pub source: String,
    pub pids: Vec<i32>,
    pub ram_bytes: u64,
    pub ram_budget_bytes: Option<u64>,
    pub gpu_bytes: u64,
    pub gpu_budget_bytes: Option<u64>,
    /// Some member's GPU memory is unavailable: `gpu_bytes` is a lower bound.
    pub gpu_unknown: bool,
    /// Budget minus use, for each budget set (negative = over).
    pub ram_headroom_bytes: Option<i64>,
    pub gpu_headroom_bytes: Option<i64>,
    /// "ok", "over_budget", "alerted", "throttled", "stopped", "terminated", "killed".
    pub state: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct QueuedRow {
    pub position: usize,
    pub model: String,
    pub pid: i32,
    pub uid: u32,
    pub waiting_seconds: f64,
    pub gpu_bytes: u64,
    pub ram_bytes: u64,
    pub waiting_for: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct LeaseRow {
    pub lease: u64,
    pub model: String,
    pub pid: i32,
    pub uid: u32,
    pub gpus: Vec<u32>,
    /// "loading" (holds the launch lock) or "ready".
    pub state: String,
    pub seconds: f64,
    pub gpu_bytes: u64,
    pub ram_bytes: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct HeldRow {
    pub pid: i32,
    pub comm: String,
    /// "stop" or "throttle".
    pub why: String,
    pub since_unix: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ActionRow {
    pub at_unix: u64,
    pub verb: String,
    pub target: String,
    pub reason_kind: String,
    pub reason: String,
    /// "done", "observed", "skipped: ..." or "failed: ...".
    pub outcome: String,
}
