//! The tick view from the daemon's state: the one place that reads the snapshot, the policy
//! state, the executor and the reservation table for operators. The status report, the metrics
//! and the alert conditions are then worked out from the view alone.

use crate::policy::{ModelUsage, Resource, Stage};
use crate::protocol::RefusalReason;
use crate::secrets::Shown;
use crate::snapshot::GpuStatus;
use crate::status::{GpuProtection, HeldRow};
use crate::view::{
    GpuView, ModelFigures, ModelState, ModelView, OverBudget, ProcessInfo, RamView, Stuck,
    TickView, Victim,
};

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
            gpus: self.gpu_views(),
            models: self.model_views(full),
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

    fn ram_view(&self) -> RamView {
        let host = &self.sampler.snapshot.host;
        RamView {
            memory: *host,
            floors: self.config.ram.floor_bytes(host.total_bytes).into(),
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
            GpuStatus::Ok if !lost.is_empty() => ("degraded", Some(lost.join("; ")), gpus.stale),
            GpuStatus::Ok => ("ok", None, gpus.stale),
            GpuStatus::Unavailable(why) => ("unavailable", Some(why.clone()), gpus.stale),
            GpuStatus::Off if self.sampler.gpus.is_some() => {
                ("starting", Some("NVML has not answered yet".into()), false)
            }
            GpuStatus::Off => ("off", Some("disabled by config".into()), false),
        };
        GpuProtection {
            state: state.into(),
            reason,
            stale,
        }
    }

    fn gpu_views(&self) -> Vec<GpuView> {
        self.sampler
            .snapshot
            .gpus
            .devices
            .iter()
            .map(|g| GpuView {
                index: g.index,
                uuid: g.uuid.clone(),
                name: g.name.clone(),
                total_bytes: g.total_bytes,
                used_bytes: g.used_bytes,
                free_bytes: g.free_bytes,
                utilization_percent: g.utilization_percent,
                floors: self
                    .config
                    .gpu
                    .floor_bytes(g.index, &g.uuid, g.total_bytes)
                    .into(),
                level: self.level(Resource::Gpu(g.index)),
                error: g.error.clone(),
                lost: g.lost,
            })
            .collect()
    }

    fn model_views(&self, full: bool) -> Vec<ModelView> {
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
            .map(|m| ModelView {
                name: m.name.clone(),
                configured: self.config.model(&m.name).is_some(),
                pids: m.members.iter().map(|id| id.pid).collect(),
                figures: self.usage_figures(m),
                gpu_known,
                gpu_unknown: m.gpu_unknown,
                state: self.model_state(&m.name),
                gpu_reserved_ratio: self.gpu_reserved_ratio(m),
                engine: engines.remove(&m.name),
                gpu_count: m.gpu_bytes.len() as u32,
                planned_kv_tokens: models.planned_kv_tokens(&m.name),
                // Read from command lines for the status and the flight recorder only (the alert
                // conditions, every tick, need none).
                engine_flags: if full { self.engine_flags(m) } else { None },
                processes: if full {
                    self.process_rows(m)
                } else {
                    Vec::new()
                },
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
