//! What the daemon tells the alert pipeline and the metrics: each action with its outcome and
//! subject, and the conditions that fire, repeat and resolve.

use crate::act::Outcome;
use crate::alert::{ActionInfo, Condition, Subject};
use crate::kinds::{EventKind, ReasonKind};
use crate::policy::{About, Action, Level, Resource, Severity, Stage, Target, Verb};
use crate::snapshot::GpuStatus;
use crate::status::ActionRow;

use super::{unix_now, Daemon, RECENT_ACTIONS};

impl Daemon {
    pub(super) fn record_action(&mut self, action: &Action, outcome: &Outcome) {
        let failed = matches!(outcome, Outcome::Failed(_));
        let outcome = match outcome {
            Outcome::Done => "done".to_string(),
            Outcome::Observed => "observed".to_string(),
            Outcome::Skipped(why) => format!("skipped: {why}"),
            Outcome::Failed(why) => format!("failed: {why}"),
        };
        self.alert_action(action, &outcome, failed);
        if self.recent_actions.len() == RECENT_ACTIONS {
            self.recent_actions.pop_front();
        }
        self.recent_actions.push_back(ActionRow {
            at_unix: unix_now(),
            verb: action.verb.as_str().into(),
            target: action.target.to_string(),
            reason_kind: action.reason.kind.to_string(),
            reason: action.reason.detail.clone(),
            outcome,
        });
    }

    /// Tells the alert pipeline (and the metrics) about an action and its outcome.
    fn alert_action(&mut self, action: &Action, outcome: &str, failed: bool) {
        let (event, severity) = match action.verb {
            Verb::Kill | Verb::Terminate => (EventKind::ProcessKilled, Severity::Critical),
            Verb::Stop => (EventKind::ProcessStopped, Severity::Warning),
            Verb::Throttle => (EventKind::ProcessThrottled, Severity::Warning),
            Verb::Resume => (EventKind::ProcessResumed, Severity::Info),
            Verb::Unthrottle => (EventKind::ProcessUnthrottled, Severity::Info),
        };
        let severity = if failed {
            Severity::Critical
        } else if outcome.starts_with("skipped") {
            Severity::Info
        } else {
            severity
        };
        let mut subject = self.target_subject(&action.target);
        let s = &self.snapshot;
        if let Some(recheck) = action.recheck {
            subject.resource = Some(recheck.resource.to_string());
            subject.floor_bytes = Some(recheck.below_bytes);
            subject.available_bytes = match recheck.resource {
                Resource::Ram => s.host.available_bytes,
                Resource::Gpu(i) => s
                    .gpus
                    .devices
                    .iter()
                    .find(|g| g.index == i)
                    .and_then(|g| g.free_bytes),
            };
        }
        if let Some(model) = &action.target.model {
            let (ram, ram_budget, gpu, gpu_budget) = self.model_figures(model);
            (subject.usage_bytes, subject.budget_bytes) = match action.reason.kind {
                ReasonKind::GpuBudget | ReasonKind::GpuFloor => (Some(gpu), gpu_budget),
                _ => (Some(ram), ram_budget),
            };
        } else if action.reason.kind == "ram_floor" {
            subject.usage_bytes = action
                .target
                .ids()
                .filter_map(|id| s.processes.get(id))
                .map(|p| p.rss_bytes)
                .reduce(|a, b| a + b);
        }
        let summary = format!(
            "{} {}: {} ({outcome})",
            action.verb.as_str(),
            action.target,
            action.reason.detail
        );
        self.alerter.action(
            event,
            severity,
            summary,
            subject,
            ActionInfo {
                verb: action.verb.as_str().into(),
                reason: action.reason.kind.to_string(),
                detail: action.reason.detail.clone(),
                outcome: outcome.into(),
            },
        );
    }

    /// Who a target is: its model, its processes, and the first one's pid, uid, name, command.
    fn target_subject(&self, target: &Target) -> Subject {
        let first = target.members.first();
        let cmdline = first
            .and_then(|m| self.snapshot.processes.get(m.id))
            .map(|p| p.cmdline.chars().take(1024).collect());
        Subject {
            model: target.model.clone(),
            pid: first.map(|m| m.id.pid),
            uid: first.map(|m| m.uid),
            comm: first.map(|m| m.comm.clone()),
            cmdline,
            pids: target.ids().map(|id| id.pid).collect(),
            ..Subject::default()
        }
    }

    /// The subject of an event: what it says it is about, with the process's name and command
    /// line and the model's usage where the daemon knows them.
    pub(super) fn event_subject(&self, about: &About) -> Subject {
        let process = about.pid.and_then(|pid| {
            self.snapshot
                .processes
                .processes
                .iter()
                .find(|p| p.pid == pid)
        });
        let mut subject = Subject {
            model: about.model.clone(),
            resource: about.resource.map(|r| r.to_string()),
            pid: about.pid,
            uid: about.uid.or(process.map(|p| p.uid)),
            comm: process.map(|p| p.comm.clone()),
            cmdline: process.map(|p| p.cmdline.chars().take(1024).collect()),
            pids: about.pid.into_iter().collect(),
            ..Subject::default()
        };
        if let Some(model) = &about.model {
            let (ram, ram_budget, gpu, gpu_budget) = self.model_figures(model);
            (subject.usage_bytes, subject.budget_bytes) = match about.resource {
                Some(Resource::Gpu(_)) => (Some(gpu), gpu_budget),
                _ if ram_budget.is_none() && gpu_budget.is_some() => (Some(gpu), gpu_budget),
                _ => (Some(ram), ram_budget),
            };
        }
        subject
    }

    /// A model's (RAM budget, GPU budget) in bytes, if it has a config.
    pub(super) fn model_budgets(&self, name: &str) -> (Option<u64>, Option<u64>) {
        let s = &self.snapshot;
        crate::policy::model_config(&self.config, &self.state, name).map_or((None, None), |c| {
            c.budget_bytes(s.host.total_bytes, s.gpus.largest_total_bytes())
        })
    }

    /// A model's (RAM used, RAM budget, GPU used, GPU budget), in bytes.
    fn model_figures(&self, name: &str) -> (u64, Option<u64>, u64, Option<u64>) {
        let usage = self
            .state
            .attribution
            .models
            .iter()
            .find(|m| m.name == name);
        let (ram_budget, gpu_budget) = self.model_budgets(name);
        (
            usage.map_or(0, |m| m.rss_bytes),
            ram_budget,
            usage.map_or(0, |m| m.gpu_total_bytes()),
            gpu_budget,
        )
    }

    /// The RAM floor cannot be read: nothing guards host memory until it can.
    fn ram_unreadable(&self) -> Condition {
        let why = self
            .procs
            .host_error()
            .unwrap_or("MemAvailable unknown")
            .to_string();
        Condition {
            key: "floor_unreadable:RAM".into(),
            event: EventKind::FloorUnreadable,
            severity: Severity::Critical,
            summary: format!("RAM floor cannot be read ({why}): host memory is not guarded"),
            subject: Subject {
                resource: Some(Resource::Ram.to_string()),
                ..Subject::default()
            },
        }
    }

    /// What is wrong right now, for alerts that fire, repeat and resolve: floors crossed or
    /// unreadable, models over budget, GPUs lost, kills that did not free memory.
    pub(super) fn conditions(&self) -> Vec<Condition> {
        let s = &self.snapshot;
        let c = &self.config;
        let mut out = Vec::new();
        for (resource, level) in &self.state.levels {
            let (event, severity) = match level {
                Level::Warn => (EventKind::FloorWarn, Severity::Warning),
                Level::Act => (EventKind::FloorAct, Severity::Critical),
                Level::Unknown if *resource == Resource::Ram => {
                    out.push(self.ram_unreadable());
                    continue;
                }
                Level::Ok | Level::Unknown => continue,
            };
            let (available, (warn, min)) = match resource {
                Resource::Ram => (
                    s.host.available_bytes,
                    c.ram.floor_bytes(s.host.total_bytes),
                ),
                Resource::Gpu(i) => {
                    let Some(g) = s.gpus.devices.iter().find(|g| g.index == *i) else {
                        continue;
                    };
                    (
                        g.free_bytes,
                        c.gpu.floor_bytes(g.index, &g.uuid, g.total_bytes),
                    )
                }
            };
            let show = |b: Option<u64>| b.map_or("unknown".into(), crate::units::fmt_bytes);
            let mut summary = format!(
                "{resource} {} {} (warn floor {}, act floor {})",
                if *resource == Resource::Ram {
                    "available"
                } else {
                    "free"
                },
                show(available),
                show(warn),
                show(min)
            );
            if let (Resource::Ram, Some(shmem)) = (resource, s.host.shmem_bytes) {
                summary += &format!(
                    ", Shmem (tmpfs, shared memory) {}",
                    crate::units::fmt_bytes(shmem)
                );
            }
            if let (Resource::Ram, Some(psi)) = (resource, s.host.psi_some_avg10) {
                summary += &format!(", PSI some avg10 {psi:.1}%");
            }
            out.push(Condition {
                key: format!("floor:{resource}"),
                event,
                severity,
                summary,
                subject: Subject {
                    resource: Some(resource.to_string()),
                    available_bytes: available,
                    floor_bytes: if *level == Level::Act { min } else { warn },
                    ..Subject::default()
                },
            });
        }
        for (name, budget) in &self.state.budgets {
            // What is over is the policy's finding (`BudgetState::over`), not worked out again.
            let (Some(_), Some(over)) = (budget.over_since, budget.over) else {
                continue;
            };
            let (resource, used, limit) = (
                over.resource_name(),
                over.used_bytes,
                Some(over.budget_bytes),
            );
            let pids: Vec<i32> = self
                .state
                .attribution
                .models
                .iter()
                .find(|m| &m.name == name)
                .map(|m| m.members.iter().map(|id| id.pid).collect())
                .unwrap_or_default();
            let first = pids
                .first()
                .and_then(|pid| s.processes.processes.iter().find(|p| p.pid == *pid));
            out.push(Condition {
                key: format!("budget:{name}"),
                event: EventKind::BudgetExceeded,
                severity: Severity::Warning,
                summary: format!(
                    "model '{name}' over budget: {resource} {} > budget {}",
                    crate::units::fmt_bytes(used),
                    limit.map_or("?".into(), crate::units::fmt_bytes)
                ),
                subject: Subject {
                    model: Some(name.clone()),
                    resource: Some(resource.into()),
                    pid: first.map(|p| p.pid),
                    uid: first.map(|p| p.uid),
                    comm: first.map(|p| p.comm.clone()),
                    cmdline: first.map(|p| p.cmdline.chars().take(1024).collect()),
                    pids,
                    usage_bytes: Some(used),
                    budget_bytes: limit,
                    ..Subject::default()
                },
            });
        }
        for g in &s.gpus.devices {
            if let Some(error) = &g.error {
                out.push(Condition {
                    key: format!("gpu_lost:{}", g.index),
                    event: EventKind::GpuLost,
                    severity: Severity::Critical,
                    summary: format!("GPU {} ({}): {error}", g.index, g.uuid),
                    subject: Subject {
                        resource: Some(Resource::Gpu(g.index).to_string()),
                        ..Subject::default()
                    },
                });
            }
        }
        if let (true, GpuStatus::Unavailable(why)) = (self.gpu_seen_ok, &self.gpu_status) {
            out.push(Condition {
                key: "gpu_lost:nvml".into(),
                event: EventKind::GpuLost,
                severity: Severity::Critical,
                summary: format!("GPU protection is off: {why}"),
                subject: Subject::default(),
            });
        }
        for (resource, incident) in &self.state.incidents {
            if incident.stage != Stage::Stuck {
                continue;
            }
            let mut subject = incident
                .victim
                .as_ref()
                .map(|v| self.target_subject(v))
                .unwrap_or_default();
            subject.resource = Some(resource.to_string());
            out.push(Condition {
                key: format!("kill_ineffective:{resource}"),
                event: EventKind::KillIneffective,
                severity: Severity::Critical,
                summary: format!(
                    "{} was killed but {resource} did not come back (stuck in the kernel or driver); not killing more for {resource}",
                    incident
                        .victim
                        .as_ref()
                        .map_or("the victim".into(), |v| v.to_string())
                ),
                subject,
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use crate::config::Config;
    use crate::daemon::{Daemon, Roots};

    /// A /proc whose meminfo has no MemAvailable (a kernel older than 3.14, a broken mount):
    /// the RAM floor cannot be read, which is a critical alert, not a silent "unknown".
    #[test]
    fn an_unreadable_ram_floor_is_a_critical_alert() {
        let dir = tempfile::tempdir().unwrap();
        let proc_root = dir.path().join("proc");
        std::fs::create_dir_all(&proc_root).unwrap();
        std::fs::write(proc_root.join("meminfo"), "MemTotal: 1000 kB\n").unwrap();
        let state = dir.path().join("state");
        let text = format!(
            "[daemon]\nstate_dir = \"{}\"\n[gpu]\nenabled = false\n",
            state.display()
        );
        let path = dir.path().join("config.toml");
        let config = Config::parse(&text, &path).unwrap();
        let roots = Roots {
            proc: proc_root,
            cgroup: dir.path().join("cgroup"),
        };
        let mut daemon = Daemon::new(&path, config, roots).unwrap();
        daemon.tick(Duration::ZERO);
        let log = state.join("events.jsonl");
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut text = String::new();
        while Instant::now() < deadline && !text.contains("floor_unreadable") {
            std::thread::sleep(Duration::from_millis(20));
            text = std::fs::read_to_string(&log).unwrap_or_default();
        }
        let line = text
            .lines()
            .find(|l| l.contains("floor_unreadable"))
            .unwrap_or_else(|| panic!("no floor_unreadable in the event log:\n{text}"));
        assert!(line.contains("critical"), "{line}");
        assert!(line.contains("has no MemAvailable"), "{line}");
    }
}
