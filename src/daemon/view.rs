//! The tick view from the daemon's state: the one place that reads the snapshot, the policy
//! state, the executor and the reservation table for operators. The status report, the metrics
//! and the alert conditions are then worked out from the view alone.

use crate::kinds::{ModelSource, Protection};
use crate::policy::{ModelUsage, Resource, Stage};
use crate::protocol::RefusalReason;
use crate::secrets::Shown;
use crate::snapshot::GpuStatus;
use crate::status::{GpuProtection, GpuRow, HeldRow, MemoryStatus, ModelRow, ModelState};
use crate::view::{ModelFigures, OverBudget, ProcessInfo, Stuck, TickView, Victim};

use super::Daemon;

/// How much of the view to build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Detail {
    /// What the alert conditions read (every tick: cheap enough for a 2 ms tick).
    Conditions,
    /// Everything, for the status report, the metrics and systemd's status line (when they are
    /// due): also each model's processes and engine, the reservation rows, the held processes,
    /// the recent actions and the hostname.
    Full,
}

impl Daemon {
    /// What this tick saw, decided and did.
    pub(super) fn view(&self, detail: Detail) -> TickView {
        let full = detail == Detail::Full;
        TickView {
            hostname: if full {
                nix::unistd::gethostname()
                    .map(|h| h.to_string_lossy().into_owned())
                    .unwrap_or_default()
            } else {
                String::new()
            },
            mode: self.config.daemon.mode,
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            ram: self.ram_view(),
            gpu_status: self.sampler.snapshot.gpus.status.clone(),
            gpu_protection: self.gpu_protection(),
            nvml_lost: match (self.sampler.gpu_seen_ok, &self.sampler.gpu_status) {
                (true, GpuStatus::Unavailable(why)) => Some(why.clone()),
                _ => None,
            },
            gpus: self.gpu_rows(),
            models: self.model_rows(full),
            over_budget: self.over_budget(),
            stuck: self.stuck(),
            reservations: if full {
                self.shared.table().rows(self.sampler.snapshot.at)
            } else {
                Default::default()
            },
            held: if full { self.held_rows() } else { Vec::new() },
            cloud_notice: super::gce::notice_in_force(&self.gce_notices).map(RefusalReason::as_str),
            recent_actions: if full {
                self.reporter.recent_actions.iter().cloned().collect()
            } else {
                Vec::new()
            },
        }
    }

    fn held_rows(&self) -> Vec<HeldRow> {
        self.executor
            .held()
            .iter()
            .map(|h| HeldRow {
                pid: h.pid,
                comm: h.comm.clone(),
                why: h.why.clone(),
                since_unix: h.since_unix,
            })
            .collect()
    }

    fn ram_view(&self) -> MemoryStatus {
        let host = &self.sampler.snapshot.host;
        let (warn_available_bytes, min_available_bytes) =
            self.config.ram.floor_bytes(host.total_bytes);
        MemoryStatus {
            host: *host,
            warn_available_bytes,
            min_available_bytes,
            level: self.level(Resource::Ram),
            error: self.sampler.procs.host_error().map(str::to_string),
        }
    }

    /// Where a floor stands (`Ok` before the policy has judged it).
    fn level(&self, resource: Resource) -> crate::kinds::Level {
        self.state
            .levels
            .get(&resource)
            .copied()
            .unwrap_or_default()
    }

    fn gpu_protection(&self) -> GpuProtection {
        let gpus = &self.sampler.snapshot.gpus;
        let lost: Vec<String> = gpus
            .devices
            .iter()
            .filter(|g| g.lost)
            .map(|g| {
                format!(
                    "GPU {} lost ({})",
                    g.index,
                    g.error.as_deref().unwrap_or("?")
                )
            })
            .collect();
        let (state, reason, stale) = match &gpus.status {
            GpuStatus::Ok if !lost.is_empty() => {
                (Protection::Degraded, Some(lost.join("; ")), gpus.stale)
            }
            GpuStatus::Ok => (Protection::Ok, None, gpus.stale),
            GpuStatus::Unavailable(why) => (Protection::Unavailable, Some(why.clone()), gpus.stale),
            GpuStatus::Off if self.sampler.gpus.is_some() => (
                Protection::Starting,
                Some("NVML has not answered yet".into()),
                false,
            ),
            GpuStatus::Off => (Protection::Off, Some("disabled by config".into()), false),
        };
        GpuProtection {
            state,
            reason,
            stale,
        }
    }

    fn gpu_rows(&self) -> Vec<GpuRow> {
        self.sampler
            .snapshot
            .gpus
            .devices
            .iter()
            .map(|g| {
                let (warn_free_bytes, min_free_bytes) =
                    self.config.gpu.floor_bytes(g.index, &g.uuid, g.total_bytes);
                GpuRow {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    name: g.name.clone(),
                    total_bytes: g.total_bytes,
                    used_bytes: g.used_bytes,
                    free_bytes: g.free_bytes,
                    utilization_percent: g.utilization_percent,
                    warn_free_bytes,
                    min_free_bytes,
                    level: self.level(Resource::Gpu(g.index)),
                    error: g.error.clone(),
                    lost: g.lost,
                }
            })
            .collect()
    }

    fn model_rows(&self, full: bool) -> Vec<ModelRow> {
        let mut engines = if full {
            self.engine_rows()
        } else {
            Default::default()
        };
        let gpu_known = self.sampler.snapshot.gpus.status == GpuStatus::Ok;
        let models = self.launches.models(&self.config);
        self.state
            .attribution
            .models
            .iter()
            .map(|m| {
                let gpu_reserved_ratio = self.gpu_reserved_ratio(m);
                let engine = engines.remove(&m.name);
                ModelRow {
                    name: m.name.clone(),
                    source: if self.config.model(&m.name).is_some() {
                        ModelSource::Config
                    } else {
                        ModelSource::Launch
                    },
                    pids: m.members.iter().map(|id| id.pid).collect(),
                    gpu_unknown: m.gpu_unknown,
                    state: self.model_state(&m.name),
                    limit: super::model_detail::describe_limit(gpu_reserved_ratio, engine.as_ref()),
                    gpu_reserved_ratio,
                    engine,
                    gpu_count: m.gpu_bytes.len() as u32,
                    planned_kv_tokens: models.planned_kv_tokens(&m.name),
                    // Read from command lines for the status and the flight recorder only (the
                    // alert conditions, every tick, need none).
                    engine_flags: if full { self.engine_flags(m) } else { None },
                    processes: if full {
                        self.process_rows(m)
                    } else {
                        Vec::new()
                    },
                    ..with_figures(self.usage_figures(m), gpu_known)
                }
            })
            .collect()
    }

    /// What the command line of a model's vLLM server (its first member that is one) says of
    /// the memory it takes.
    fn engine_flags(&self, m: &ModelUsage) -> Option<crate::engine::EngineFlags> {
        let processes = &self.sampler.snapshot.processes;
        m.members
            .iter()
            .filter_map(|&id| processes.get(id))
            .find_map(|p| crate::engine::EngineFlags::from_vllm_cmdline(&p.cmdline))
    }

    /// A model's use (from its attribution) and budgets.
    pub(super) fn usage_figures(&self, usage: &ModelUsage) -> ModelFigures {
        ModelFigures {
            ram_bytes: usage.ram_bytes,
            gpu_bytes: usage.gpu_total_bytes(),
            ..self.budget_figures(&usage.name)
        }
    }

    fn model_state(&self, name: &str) -> ModelState {
        match self.state.budgets.get(name) {
            Some(b) => match &b.enforced {
                Some(e) => ModelState::Enforced(e.stage),
                None if b.over_since.is_some() => ModelState::OverBudget,
                None => ModelState::Ok,
            },
            None => ModelState::Ok,
        }
    }

    /// The models over budget: what the policy found over (`BudgetState::over`), not worked
    /// out again.
    fn over_budget(&self) -> Vec<OverBudget> {
        self.state
            .budgets
            .iter()
            .filter(|(_, b)| b.over_since.is_some())
            .filter_map(|(name, b)| {
                let first = self
                    .state
                    .attribution
                    .models
                    .iter()
                    .find(|m| &m.name == name)
                    .and_then(|m| m.members.first())
                    .and_then(|id| self.process_info(id.pid));
                Some(OverBudget {
                    model: name.clone(),
                    over: b.over?,
                    first,
                    launched_by: b.launched_by,
                })
            })
            .collect()
    }

    /// A process of the table by pid, as alerts name it.
    fn process_info(&self, pid: i32) -> Option<ProcessInfo> {
        let p = self
            .sampler
            .snapshot
            .processes
            .processes
            .iter()
            .find(|p| p.pid == pid)?;
        Some(ProcessInfo {
            pid: p.pid,
            uid: p.uid,
            comm: p.comm.clone(),
            cmdline: Shown::of(&p.cmdline),
        })
    }

    fn stuck(&self) -> Vec<Stuck> {
        self.state
            .incidents
            .iter()
            .filter(|(_, incident)| incident.stage == Stage::Stuck)
            .map(|(resource, incident)| Stuck {
                resource: *resource,
                victim: incident.victim.as_ref().map(|v| Victim {
                    name: v.to_string(),
                    subject: self.target_subject(v),
                }),
            })
            .collect()
    }
}

/// A model's row with its figures: its use against its budgets, and the headroom of each budget
/// set (negative: over). `gpu_known`: GPU readings are available (without them, its GPU use is
/// unknown, not zero).
pub(super) fn with_figures(f: ModelFigures, gpu_known: bool) -> ModelRow {
    let gpu_bytes = gpu_known.then_some(f.gpu_bytes);
    ModelRow {
        ram_bytes: f.ram_bytes,
        ram_budget_bytes: f.ram_budget_bytes,
        gpu_bytes,
        gpu_budget_bytes: f.gpu_budget_bytes,
        ram_headroom_bytes: f.ram_budget_bytes.map(|b| b as i64 - f.ram_bytes as i64),
        gpu_headroom_bytes: f
            .gpu_budget_bytes
            .zip(gpu_bytes)
            .map(|(b, used)| b as i64 - used as i64),
        ..ModelRow::default()
    }
}
