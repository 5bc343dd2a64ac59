//! The daemon's own view for operators: the `gpuguard status` report and systemd's STATUS line.

use crate::policy::Resource;
use crate::snapshot::GpuStatus;
use crate::status::{
    GpuProtection, GpuRow, HeldRow, MemoryStatus, ModelRow, StatusReport, STATUS_SCHEMA_VERSION,
};

use super::Daemon;

impl Daemon {
    /// The status report for `gpuguard status`.
    pub(super) fn status(&self) -> StatusReport {
        let s = &self.snapshot;
        let c = &self.config;
        let level = |r: Resource| {
            let level = self.state.levels.get(&r).copied().unwrap_or_default();
            level.to_string()
        };
        let (ram_warn, ram_min) = c.ram.floor_bytes(s.host.total_bytes);
        let memory = MemoryStatus {
            total_bytes: s.host.total_bytes,
            available_bytes: s.host.available_bytes,
            swap_total_bytes: s.host.swap_total_bytes,
            swap_free_bytes: s.host.swap_free_bytes,
            psi_some_avg10: s.host.psi_some_avg10,
            shmem_bytes: s.host.shmem_bytes,
            warn_available_bytes: ram_warn,
            min_available_bytes: ram_min,
            level: level(Resource::Ram),
        };
        let lost: Vec<String> = s
            .gpus
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
        let gpu_protection = match &s.gpus.status {
            GpuStatus::Ok if !lost.is_empty() => GpuProtection {
                state: "degraded".into(),
                reason: Some(lost.join("; ")),
                stale: s.gpus.stale,
            },
            GpuStatus::Ok => GpuProtection {
                state: "ok".into(),
                reason: None,
                stale: s.gpus.stale,
            },
            GpuStatus::Unavailable(why) => GpuProtection {
                state: "unavailable".into(),
                reason: Some(why.clone()),
                stale: s.gpus.stale,
            },
            GpuStatus::Off if self.gpus.is_some() => GpuProtection {
                state: "starting".into(),
                reason: Some("NVML has not answered yet".into()),
                stale: false,
            },
            GpuStatus::Off => GpuProtection {
                state: "off".into(),
                reason: Some("disabled by config".into()),
                stale: false,
            },
        };
        let gpus = s
            .gpus
            .devices
            .iter()
            .map(|g| {
                let (warn, min) = c.gpu.floor_bytes(g.index, &g.uuid, g.total_bytes);
                GpuRow {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    name: g.name.clone(),
                    total_bytes: g.total_bytes,
                    used_bytes: g.used_bytes,
                    free_bytes: g.free_bytes,
                    utilization_percent: g.utilization_percent,
                    warn_free_bytes: warn,
                    min_free_bytes: min,
                    level: level(Resource::Gpu(g.index)),
                    error: g.error.clone(),
                    lost: g.lost,
                }
            })
            .collect();
        let mut engines = self.engine_rows();
        let models = self
            .state
            .attribution
            .models
            .iter()
            .map(|m| {
                let engine = engines.remove(&m.name);
                let reserved = self.gpu_reserved_ratio(m);
                let (ram_budget, gpu_budget) = self.model_budgets(&m.name);
                // Without a working NVML a model's GPU use is unknown, not zero.
                let gpu_bytes = (s.gpus.status == GpuStatus::Ok).then(|| m.gpu_total_bytes());
                let budget = self.state.budgets.get(&m.name);
                let state = match budget {
                    Some(b) => match &b.enforced {
                        Some(e) => e.stage.to_string(),
                        None if b.over_since.is_some() => "over_budget".into(),
                        None => "ok".into(),
                    },
                    None => "ok".into(),
                };
                ModelRow {
                    name: m.name.clone(),
                    source: if c.model(&m.name).is_some() {
                        "config"
                    } else {
                        "launch"
                    }
                    .into(),
                    pids: m.members.iter().map(|id| id.pid).collect(),
                    ram_bytes: m.rss_bytes,
                    ram_budget_bytes: ram_budget,
                    gpu_bytes,
                    gpu_budget_bytes: gpu_budget,
                    gpu_unknown: m.gpu_unknown,
                    ram_headroom_bytes: ram_budget.map(|b| b as i64 - m.rss_bytes as i64),
                    gpu_headroom_bytes: gpu_budget
                        .zip(gpu_bytes)
                        .map(|(b, used)| b as i64 - used as i64),
                    state,
                    limit: super::model_detail::describe_limit(reserved, engine.as_ref()),
                    gpu_reserved_ratio: reserved,
                    engine,
                    processes: self.process_rows(m),
                }
            })
            .collect();
        let rows = self.shared.table().rows(s.at);
        StatusReport {
            schema_version: STATUS_SCHEMA_VERSION,
            hostname: nix::unistd::gethostname()
                .map(|h| h.to_string_lossy().into_owned())
                .unwrap_or_default(),
            version: env!("CARGO_PKG_VERSION").into(),
            mode: c.daemon.mode.to_string(),
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            memory,
            gpu_protection,
            gpus,
            models,
            queue: rows.queue,
            leases: rows.leases,
            permits: rows.permits,
            held: self
                .executor
                .held()
                .iter()
                .map(|h| HeldRow {
                    pid: h.pid,
                    comm: h.comm.clone(),
                    why: h.why.clone(),
                    since_unix: h.since_unix,
                })
                .collect(),
            recent_actions: self.recent_actions.iter().cloned().collect(),
        }
    }

    /// What `systemctl status` shows.
    pub(super) fn one_line_status(&self) -> String {
        let s = &self.snapshot;
        let ram = s
            .host
            .available_bytes
            .map_or("unknown".into(), crate::units::fmt_bytes);
        let gpus = match &s.gpus.status {
            GpuStatus::Ok => match s.gpus.devices.iter().filter(|g| g.lost).count() {
                0 => format!("{} GPU(s)", s.gpus.devices.len()),
                lost => format!("{} GPU(s), {lost} LOST", s.gpus.devices.len()),
            },
            GpuStatus::Unavailable(_) => "GPU protection off (no NVML)".into(),
            GpuStatus::Off => "GPU protection disabled".into(),
        };
        format!(
            "{}: RAM available {ram}, {gpus}, {} model(s), {} queued, {} held stopped",
            self.config.daemon.mode,
            self.state
                .attribution
                .models
                .iter()
                .filter(|m| !m.members.is_empty())
                .count(),
            self.shared.table().rows(s.at).queue.len(),
            self.executor.held().len()
        )
    }
}
