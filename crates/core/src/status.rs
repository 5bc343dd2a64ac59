//! The status report: what `gpuguard status` shows and `status --json` prints. Its JSON is a
//! stable, versioned schema (`schema_version`); fields are only ever added within a version.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::config::Mode;
use crate::engine::{EngineFlags, EngineStats};
use crate::kinds::{EngineState, LeaseState, Level, ModelSource, Protection, ReasonKind};
use crate::policy::{Outcome, Stage, Verb};
use crate::snapshot::HostMemory;

/// Bumped when a field changes meaning or disappears. 2: `models[].gpu_bytes` may be null
/// (unknown while NVML is unavailable).
pub const STATUS_SCHEMA_VERSION: u32 = 2;

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct StatusReport {
    pub schema_version: u32,
    pub hostname: String,
    pub version: String,
    pub mode: Mode,
    pub uptime_seconds: f64,
    pub memory: MemoryStatus,
    pub gpu_protection: GpuProtection,
    pub gpus: Vec<GpuRow>,
    pub models: Vec<ModelRow>,
    pub queue: Vec<QueuedRow>,
    pub leases: Vec<LeaseRow>,
    /// Memory permits per model.
    #[serde(default)]
    pub permits: Vec<PermitPoolRow>,
    /// Processes gpuguard holds stopped (SIGSTOP or a throttle duty cycle).
    pub held: Vec<HeldRow>,
    /// The latest actions, newest last.
    pub recent_actions: Vec<ActionRow>,
}

/// Host memory: the reading, its floors, and where it stands. The tick view holds it, the
/// metrics and the alert conditions read it, and `status` prints it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct MemoryStatus {
    /// The reading, its fields inline: `total_bytes`, `available_bytes`, `swap_total_bytes`,
    /// `swap_free_bytes`, `psi_some_avg10`, `shmem_bytes` (`Shmem`: tmpfs, shared memory,
    /// counted out of MemAvailable, held by no process).
    #[serde(flatten)]
    pub host: HostMemory,
    pub warn_available_bytes: Option<u64>,
    pub min_available_bytes: Option<u64>,
    pub level: Level,
    /// Why host memory could not be read, if the source says (for the alert conditions; not
    /// in the schema).
    #[serde(skip)]
    pub error: Option<String>,
}

impl MemoryStatus {
    pub fn floors(&self) -> Floors {
        Floors {
            warn_bytes: self.warn_available_bytes,
            min_bytes: self.min_available_bytes,
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GpuProtection {
    pub state: Protection,
    pub reason: Option<String>,
    /// The latest GPU sample is late or old: alerts only.
    pub stale: bool,
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

/// One GPU: its reading, its floors, and where it stands. The tick view holds it, the metrics
/// and the alert conditions read it, and `status` prints it.
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
    pub level: Level,
    pub error: Option<String>,
    /// Fell off the bus (GPU_IS_LOST) or left NVML's device list: its readings are unknown.
    #[serde(default)]
    pub lost: bool,
}

impl GpuRow {
    pub fn floors(&self) -> Floors {
        Floors {
            warn_bytes: self.warn_free_bytes,
            min_bytes: self.min_free_bytes,
        }
    }
}

/// One model: who it is, what it uses against its budgets, what its engine says, its
/// processes. The tick view holds it, the metrics read it, and `status` prints it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ModelRow {
    pub name: String,
    pub source: ModelSource,
    pub pids: Vec<i32>,
    pub ram_bytes: u64,
    pub ram_budget_bytes: Option<u64>,
    /// `None` while GPU readings are unavailable (no NVML): unknown, not zero.
    pub gpu_bytes: Option<u64>,
    pub gpu_budget_bytes: Option<u64>,
    /// Some member's GPU memory is unavailable: `gpu_bytes` is a lower bound.
    pub gpu_unknown: bool,
    /// Budget minus use, for each budget set (negative = over).
    pub ram_headroom_bytes: Option<i64>,
    pub gpu_headroom_bytes: Option<i64>,
    pub state: ModelState,
    /// The model's GPU memory as a share of the GPUs it is on (a vLLM-like server preallocates
    /// most of them: a high share is its reservation, not its load).
    #[serde(default)]
    pub gpu_reserved_ratio: Option<f64>,
    /// The model server's own view, from its metrics URL (`None`: it has none).
    #[serde(default)]
    pub engine: Option<EngineRow>,
    /// The limit the model is at, if any, in words: "KV cache 100%, 24 waiting" (the engine is
    /// full) is not "GPU 95% reserved" (memory taken up front, load unknown).
    #[serde(default)]
    pub limit: Option<String>,
    /// Its processes one by one (`status --model NAME`).
    #[serde(default)]
    pub processes: Vec<ProcessRow>,
    /// How many GPUs it holds memory on (`gpu_bytes` is over all of them).
    #[serde(default)]
    pub gpu_count: u32,
    /// The KV cache `gpuguard plan` planned for it (its `[[model]]`'s `planned_kv_tokens`), in
    /// tokens per engine, to set beside the engine's `kv_cache_blocks` × `block_size_tokens`.
    #[serde(default)]
    pub planned_kv_tokens: Option<u64>,
    /// What its vLLM server's command line says of the memory it takes besides weights and KV
    /// cache (`--max-num-batched-tokens`, `--max-num-seqs`, `--enforce-eager`): `plan --gpu host`
    /// carries what it was seen to take over to other flags.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_flags: Option<EngineFlags>,
}

/// A model server's own limits, as last scraped from its Prometheus endpoint.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct EngineRow {
    pub url: String,
    pub state: EngineState,
    pub error: Option<String>,
    /// Seconds since the last scrape (successful or not).
    pub age_seconds: Option<f64>,
    /// What the engine reported (all `None` unless `state` is "ok"), its fields inline:
    /// `kv_cache_usage_ratio`, `requests_running`, `requests_waiting`, `preemptions_total`,
    /// `kv_cache_blocks`, `block_size_tokens`, `gpu_memory_utilization`.
    #[serde(flatten)]
    pub stats: EngineStats,
}

/// One process of a model.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ProcessRow {
    pub pid: i32,
    pub ppid: i32,
    pub comm: String,
    /// "launched" (registered by `gpuguard launch`), "matched" (by the `[[model]]` match), or
    /// "child" (a descendant of one of those).
    pub role: String,
    /// The RAM counted for it, as the model's sum counts it: its proportional share (PSS, or
    /// its share of its memory cgroup) where read, else its RSS.
    pub ram_bytes: u64,
    /// Its RSS (pages it shares with other processes counted in each of them).
    #[serde(default)]
    pub rss_bytes: u64,
    /// GPU memory on each GPU it holds any on.
    pub gpus: Vec<ProcessGpu>,
    /// Weights files it maps (with GPU memory held; read on process scans).
    pub weights_files: Vec<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ProcessGpu {
    pub gpu: u32,
    /// `None`: NVML lists the process but cannot say how much (unknown, not zero).
    pub bytes: Option<u64>,
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
    /// How long it may wait in all (its --queue-timeout, capped by the config).
    #[serde(default)]
    pub queue_timeout_seconds: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct LeaseRow {
    pub lease: u64,
    pub model: String,
    pub pid: i32,
    pub uid: u32,
    pub gpus: Vec<u32>,
    pub state: LeaseState,
    pub seconds: f64,
    pub gpu_bytes: u64,
    pub ram_bytes: u64,
    /// A thread polls the lease's ready URL (only while it loads).
    #[serde(default)]
    pub polling_ready_url: bool,
    /// The longest it may hold the launch lock (its --ready-timeout, capped by the config).
    #[serde(default)]
    pub ready_timeout_seconds: f64,
}

/// Memory permits of one model (or `(host)`: permits of no model).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct PermitPoolRow {
    pub model: String,
    pub held: usize,
    pub waiting: usize,
    pub max_permits: Option<u32>,
    /// What the permits held reserve.
    pub reserved_gpu_bytes: u64,
    pub reserved_ram_bytes: u64,
    /// GPU growth per permit observed while permits were held (peak minus the use before,
    /// over the most permits held at once), median and 95th percentile.
    pub observed_gpu_bytes_p50: Option<u64>,
    pub observed_gpu_bytes_p95: Option<u64>,
    /// Since the daemon started.
    pub granted_total: u64,
    pub refused_total: u64,
    pub expired_total: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct HeldRow {
    pub pid: i32,
    pub comm: String,
    /// "stop" or "throttle".
    pub why: String,
    pub since_unix: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ActionRow {
    pub at_unix: u64,
    pub verb: Verb,
    pub target: String,
    pub reason_kind: ReasonKind,
    pub reason: String,
    pub outcome: Outcome,
}

/// Where a model's budget enforcement stands; in JSON "ok", "over_budget", or the stage of the
/// enforcement in force ("alerted", "throttled", "stopped", "terminated", "killed").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
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

impl From<ModelState> for String {
    fn from(s: ModelState) -> String {
        s.to_string()
    }
}

impl TryFrom<String> for ModelState {
    type Error = String;

    fn try_from(text: String) -> Result<ModelState, String> {
        match text.as_str() {
            "ok" => Ok(ModelState::Ok),
            "over_budget" => Ok(ModelState::OverBudget),
            name => Stage::ALL
                .iter()
                .find(|s| s.as_str() == name)
                .map(|&s| ModelState::Enforced(s))
                .ok_or_else(|| format!("not a model's state: {text:?}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `models[].engine` in `status --json` is the engine's figures inline, under the names and
    /// in the order the schema has always had.
    #[test]
    fn an_engine_row_keeps_its_json_names_and_order() {
        let row = EngineRow {
            url: "http://127.0.0.1:8000/metrics".into(),
            state: EngineState::Ok,
            error: None,
            age_seconds: Some(1.5),
            stats: EngineStats {
                kv_cache_usage: Some(0.25),
                requests_running: Some(8),
                requests_waiting: Some(2),
                preemptions_total: Some(3),
                kv_cache_blocks: Some(27000),
                block_size_tokens: Some(16),
                gpu_memory_utilization: Some(0.9),
            },
        };
        let json = serde_json::to_string(&row).unwrap();
        assert_eq!(
            json,
            "{\"url\":\"http://127.0.0.1:8000/metrics\",\"state\":\"ok\",\"error\":null,\
             \"age_seconds\":1.5,\"kv_cache_usage_ratio\":0.25,\"requests_running\":8,\
             \"requests_waiting\":2,\"preemptions_total\":3,\"kv_cache_blocks\":27000,\
             \"block_size_tokens\":16,\"gpu_memory_utilization\":0.9}"
        );
        assert_eq!(serde_json::from_str::<EngineRow>(&json).unwrap(), row);
        let pending = EngineRow {
            state: EngineState::Pending,
            ..EngineRow::default()
        };
        let json = serde_json::to_string(&pending).unwrap();
        assert!(json.contains("\"kv_cache_usage_ratio\":null"), "{json}");
        assert_eq!(serde_json::from_str::<EngineRow>(&json).unwrap(), pending);
    }

    /// The typed fields are written as the strings the schema has always had, and read back.
    #[test]
    fn typed_fields_keep_their_json_strings() {
        let action = ActionRow {
            at_unix: 7,
            verb: Verb::Terminate,
            target: "pid 4(x)".into(),
            reason_kind: ReasonKind::GpuFloor,
            reason: "r".into(),
            outcome: Outcome::Skipped("gone".into()),
        };
        let json = serde_json::to_string(&action).unwrap();
        assert_eq!(
            json,
            "{\"at_unix\":7,\"verb\":\"terminate\",\"target\":\"pid 4(x)\",\
             \"reason_kind\":\"gpu_floor\",\"reason\":\"r\",\"outcome\":\"skipped: gone\"}"
        );
        assert_eq!(serde_json::from_str::<ActionRow>(&json).unwrap(), action);
        for (state, text) in [
            (ModelState::Ok, "\"ok\""),
            (ModelState::OverBudget, "\"over_budget\""),
            (ModelState::Enforced(Stage::Stopped), "\"stopped\""),
        ] {
            assert_eq!(serde_json::to_string(&state).unwrap(), text);
            assert_eq!(serde_json::from_str::<ModelState>(text).unwrap(), state);
        }
        for outcome in [
            Outcome::Done,
            Outcome::Observed,
            Outcome::Failed("EPERM: x".into()),
        ] {
            let json = serde_json::to_string(&outcome).unwrap();
            assert_eq!(serde_json::from_str::<Outcome>(&json).unwrap(), outcome);
        }
        assert!(serde_json::from_str::<Outcome>("\"maybe\"").is_err());
        assert!(serde_json::from_str::<ModelState>("\"maybe\"").is_err());
    }

    /// `memory` is the reading's fields inline, then the floors and the level, as always; a
    /// report of a version before `shmem_bytes` reads.
    #[test]
    fn memory_keeps_its_json_names_and_order() {
        let memory = MemoryStatus {
            host: HostMemory {
                total_bytes: Some(64),
                available_bytes: Some(32),
                swap_total_bytes: Some(0),
                swap_free_bytes: None,
                psi_some_avg10: Some(1.5),
                shmem_bytes: Some(2),
            },
            warn_available_bytes: Some(8),
            min_available_bytes: None,
            level: Level::Warn,
            error: None,
        };
        let json = serde_json::to_string(&memory).unwrap();
        assert_eq!(
            json,
            "{\"total_bytes\":64,\"available_bytes\":32,\"swap_total_bytes\":0,\
             \"swap_free_bytes\":null,\"psi_some_avg10\":1.5,\"shmem_bytes\":2,\
             \"warn_available_bytes\":8,\"min_available_bytes\":null,\"level\":\"warn\"}"
        );
        assert_eq!(serde_json::from_str::<MemoryStatus>(&json).unwrap(), memory);
        let old = json.replace("\"shmem_bytes\":2,", "");
        let read = serde_json::from_str::<MemoryStatus>(&old).unwrap();
        assert_eq!(read.host.shmem_bytes, None);
    }
}
