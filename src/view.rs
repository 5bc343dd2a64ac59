//! The tick view: what one tick of the daemon saw, decided and did, as plain data. The daemon
//! derives it once per tick (`daemon/view.rs`, the one place that reads the loop's internals for
//! operators); the status report (`daemon/report.rs`), the metrics (`Metrics::update`) and the
//! alert conditions (`daemon/alerts.rs`) are pure functions of it, so each fact in them (a floor
//! in bytes, which resource a model is over, a model's figures) is worked out once. A GPU and a
//! model are held as the status report's own rows (`status::GpuRow`, `status::ModelRow`): one
//! type per fact, not a view copied into a row.

use serde::Serialize;

use crate::config::Mode;
use crate::policy::{Overage, Resource};
use crate::reserve::Rows;
use crate::secrets::Shown;
use crate::snapshot::GpuStatus;
pub use crate::status::Floors;
use crate::status::{ActionRow, GpuProtection, GpuRow, HeldRow, MemoryStatus, ModelRow};

/// One tick, seen whole.
#[derive(Clone, Debug, Default)]
pub struct TickView {
    pub hostname: String,
    pub mode: Mode,
    pub uptime_seconds: f64,
    pub ram: MemoryStatus,
    /// The GPU reading's status as sampled (`Off` also until NVML's first answer).
    pub gpu_status: GpuStatus,
    /// What GPU protection amounts to now: the sampled status, lost GPUs, not started yet.
    pub gpu_protection: GpuProtection,
    /// NVML worked once and is unavailable now (why): an alert, not a host without GPUs.
    pub nvml_lost: Option<String>,
    pub gpus: Vec<GpuRow>,
    pub models: Vec<ModelRow>,
    /// The models the policy found over budget (in name order).
    pub over_budget: Vec<OverBudget>,
    /// Floors whose victim was killed without the memory coming back (in resource order).
    pub stuck: Vec<Stuck>,
    /// The launch queue, the leases and the permits.
    pub reservations: Rows,
    /// Processes gpuguard holds stopped or throttled.
    pub held: Vec<HeldRow>,
    /// The cloud's notice in force for this VM ("host_maintenance", "preempted"), if any.
    pub cloud_notice: Option<&'static str>,
    /// The latest actions, newest last.
    pub recent_actions: Vec<ActionRow>,
}

/// A model's memory use and budgets, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModelFigures {
    pub ram_bytes: u64,
    pub ram_budget_bytes: Option<u64>,
    /// Summed over its GPUs, as far as known.
    pub gpu_bytes: u64,
    pub gpu_budget_bytes: Option<u64>,
}

/// A process as alerts name it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessInfo {
    pub pid: i32,
    pub uid: u32,
    pub comm: String,
    pub cmdline: Shown,
}

/// A model the policy found over budget (`BudgetState::over`), with its first process.
#[derive(Clone, Debug, PartialEq)]
pub struct OverBudget {
    pub model: String,
    pub over: Overage,
    pub first: Option<ProcessInfo>,
    /// The account that launched it, for a model with no `[[model]]` (`BudgetState::launched_by`).
    pub launched_by: Option<u32>,
}

/// A floor stuck: its victim was killed and the memory did not come back.
#[derive(Clone, Debug)]
pub struct Stuck {
    pub resource: Resource,
    pub victim: Option<Victim>,
}

/// Who or what a notice is about. Every field is optional: each event fills what it knows.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Subject {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// "RAM" or "GPU 0".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<Shown>,
    /// Every process of the target (a model has several).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub pids: Vec<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub floor_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub available_bytes: Option<u64>,
}

/// A victim as alerts name it.
#[derive(Clone, Debug, Default)]
pub struct Victim {
    /// The target in words (`Target`'s `Display`).
    pub name: String,
    pub subject: Subject,
}
