//! The tick view: what one tick of the daemon saw, decided and did, as plain data. The daemon
//! derives it once per tick (`daemon/view.rs`, the one place that reads the loop's internals for
//! operators); the status report (`daemon/report.rs`), the metrics (`Metrics::update`) and the
//! alert conditions (`daemon/alerts.rs`) are pure functions of it, so each fact in them (a floor
//! in bytes, which resource a model is over, a model's figures) is worked out once.

use std::fmt;

use serde::Serialize;

use crate::config::Mode;
use crate::kinds::Level;
use crate::policy::{Overage, Resource, Stage};
use crate::reserve::Rows;
use crate::secrets::Shown;
use crate::snapshot::{GpuStatus, HostMemory};
use crate::status::{ActionRow, EngineRow, GpuProtection, HeldRow, ProcessRow};

/// One tick, seen whole.
#[derive(Clone, Debug, Default)]
pub struct TickView {
    pub hostname: String,
    pub mode: Mode,
    pub uptime_seconds: f64,
    pub ram: RamView,
    /// The GPU reading's status as sampled (`Off` also until NVML's first answer).
    pub gpu_status: GpuStatus,
    /// What GPU protection amounts to now: the sampled status, lost GPUs, not started yet.
    pub gpu_protection: GpuProtection,
    /// NVML worked once and is unavailable now (why): an alert, not a host without GPUs.
    pub nvml_lost: Option<String>,
    pub gpus: Vec<GpuView>,
    pub models: Vec<ModelView>,
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

/// A free-memory floor pair in bytes (`None`: not set, or not resolvable without a total).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Floors {
    /// Below it: alert.
    pub warn_bytes: Option<u64>,
    /// Below it: act.
    pub min_bytes: Option<u64>,
}

impl From<(Option<u64>, Option<u64>)> for Floors {
    /// From `config`'s `(warn, min)`.
    fn from((warn_bytes, min_bytes): (Option<u64>, Option<u64>)) -> Floors {
        Floors {
            warn_bytes,
            min_bytes,
        }
    }
}

/// Host memory: the reading, its floors, and where it stands.
#[derive(Clone, Debug, Default)]
pub struct RamView {
    pub memory: HostMemory,
    pub floors: Floors,
    pub level: Level,
    /// Why host memory could not be read, if the source says.
    pub error: Option<String>,
}

/// One GPU: its reading, its floors, and where it stands.
#[derive(Clone, Debug, Default)]
pub struct GpuView {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub total_bytes: Option<u64>,
    pub used_bytes: Option<u64>,
    pub free_bytes: Option<u64>,
    pub utilization_percent: Option<u32>,
    pub floors: Floors,
    pub level: Level,
    /// Why its reading failed (or that it is lost).
    pub error: Option<String>,
    pub lost: bool,
}

/// A model's memory use and budgets, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModelFigures {
    pub ram_bytes: u64,
    pub ram_budget_bytes: Option<u64>,
    /// Summed over its GPUs, as far as known (see `ModelView::gpu_bytes`).
    pub gpu_bytes: u64,
    pub gpu_budget_bytes: Option<u64>,
}

/// Where a model's budget enforcement stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ModelState {
    #[default]
    Ok,
    /// Over budget, within its grace (or its action is done).
    OverBudget,
    /// An enforcement is in force.
    Enforced(Stage),
}

impl fmt::Display for ModelState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelState::Ok => f.write_str("ok"),
            ModelState::OverBudget => f.write_str("over_budget"),
            ModelState::Enforced(stage) => stage.fmt(f),
        }
    }
}

/// One model: who it is, what it uses, what its engine says, its processes.
#[derive(Clone, Debug, Default)]
pub struct ModelView {
    pub name: String,
    /// It has a `[[model]]` (else it came from `gpuguard launch`).
    pub configured: bool,
    pub pids: Vec<i32>,
    pub figures: ModelFigures,
    /// GPU readings are available (NVML works): without them `figures.gpu_bytes` means nothing.
    pub gpu_known: bool,
    /// Some member's GPU memory is unavailable: `figures.gpu_bytes` is a lower bound.
    pub gpu_unknown: bool,
    pub state: ModelState,
    /// Its GPU memory over the total of the GPUs it is on.
    pub gpu_reserved_ratio: Option<f64>,
    pub engine: Option<EngineRow>,
    pub processes: Vec<ProcessRow>,
    /// How many GPUs it holds memory on.
    pub gpu_count: u32,
    /// The KV cache its `[[model]]` says was planned, in tokens per engine.
    pub planned_kv_tokens: Option<u64>,
    /// What its vLLM server's command line says of the memory it takes (its first member that
    /// is one).
    pub engine_flags: Option<crate::engine::EngineFlags>,
}

impl ModelView {
    /// Its GPU memory: `None` while GPU readings are unavailable (unknown, not zero).
    pub fn gpu_bytes(&self) -> Option<u64> {
        self.gpu_known.then_some(self.figures.gpu_bytes)
    }
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
