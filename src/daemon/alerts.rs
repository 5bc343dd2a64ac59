//! What the daemon tells the alert pipeline and the metrics: each action with its outcome and
//! subject, and the conditions that fire, repeat and resolve (`conditions`, a pure function of
//! the tick view).
//!
//! The policy's floor and budget events and the daemon's GPU events go to the event log only
//! (`EventKind::is_condition`); the conditions here are the webhooks' view of the same state.
//! Why the two are kept apart: docs/design.md, "Why floor, budget and GPU events keep their own
//! emitters".

use crate::act::Outcome;
use crate::alert::{ActionInfo, Condition};
use crate::kinds::{EventKind, ReasonKind};
use crate::policy::{About, Action, Level, Resource, Severity, Target, Verb};
use crate::secrets::Shown;
use crate::status::{ActionRow, GpuRow};
use crate::view::Subject;
use crate::view::{Floors, ModelFigures, OverBudget, Stuck, TickView};

use super::{unix_now, Daemon};

impl Daemon {
    pub(super) fn record_action(&mut self, action: &Action, outcome: &Outcome) {
        let failed = matches!(outcome, Outcome::Failed(_));
        let skipped = matches!(outcome, Outcome::Skipped(_));
        self.alert_action(action, &outcome.to_string(), failed, skipped);
        self.reporter.remember(ActionRow {
            at_unix: unix_now(),
            verb: action.verb,
            target: action.target.to_string(),
            reason_kind: action.reason.kind,
            reason: action.reason.detail.clone(),
            outcome: outcome.clone(),
        });
    }

    /// Tells the alert pipeline (and the metrics) about an action and its outcome.
    fn alert_action(&mut self, action: &Action, outcome: &str, failed: bool, skipped: bool) {
        let (event, severity) = match action.verb {
            Verb::Kill | Verb::Terminate => (EventKind::ProcessKilled, Severity::Critical),
            Verb::Stop => (EventKind::ProcessStopped, Severity::Warning),
            Verb::Throttle => (EventKind::ProcessThrottled, Severity::Warning),
            Verb::Resume => (EventKind::ProcessResumed, Severity::Info),
            Verb::Unthrottle => (EventKind::ProcessUnthrottled, Severity::Info),
        };
        let severity = if failed {
            Severity::Critical
        } else if skipped {
            Severity::Info
        } else {
            severity
        };
        let mut subject = self.target_subject(&action.target);
        let s = &self.sampler.snapshot;
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
            let f = self.model_figures(model);
            (subject.usage_bytes, subject.budget_bytes) = match action.reason.kind {
                ReasonKind::GpuBudget | ReasonKind::GpuFloor => {
                    (Some(f.gpu_bytes), f.gpu_budget_bytes)
                }
                _ => (Some(f.ram_bytes), f.ram_budget_bytes),
            };
        } else if action.reason.kind == ReasonKind::RamFloor {
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
        self.reporter.alerter.action(
            event,
            severity,
            summary,
            subject,
            ActionInfo {
                verb: action.verb.as_str().into(),
                reason: action.reason.kind.to_string(),
                detail: action.reason.detail.clone(),
                outcome: outcome.into(),
                after_term: action.after_term.map(|why| why.as_str()),
            },
        );
    }

    /// Who a target is: its model, its processes, and the first one's pid, uid, name, command.
    pub(super) fn target_subject(&self, target: &Target) -> Subject {
        let first = target.members.first();
        let cmdline = first
            .and_then(|m| self.sampler.snapshot.processes.get(m.id))
            .map(|p| Shown::of(&p.cmdline));
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
            self.sampler
                .snapshot
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
            cmdline: process.map(|p| Shown::of(&p.cmdline)),
            pids: about.pid.into_iter().collect(),
            ..Subject::default()
        };
        if let Some(model) = &about.model {
            let f = self.model_figures(model);
            let gpu = (Some(f.gpu_bytes), f.gpu_budget_bytes);
            (subject.usage_bytes, subject.budget_bytes) = match about.resource {
                Some(Resource::Gpu(_)) => gpu,
                _ if f.ram_budget_bytes.is_none() && f.gpu_budget_bytes.is_some() => gpu,
                _ => (Some(f.ram_bytes), f.ram_budget_bytes),
            };
        }
        subject
    }

    /// A model's budgets in bytes (its use left at zero), if it has a config.
    pub(super) fn budget_figures(&self, name: &str) -> ModelFigures {
        let s = &self.sampler.snapshot;
        let (ram_budget_bytes, gpu_budget_bytes) =
            crate::policy::model_config(&self.config, &self.launches, name)
                .map_or((None, None), |c| {
                    c.budget_bytes(s.host.total_bytes, s.gpus.largest_total_bytes())
                });
        ModelFigures {
            ram_budget_bytes,
            gpu_budget_bytes,
            ..ModelFigures::default()
        }
    }

    /// A model's use and budgets by name (no use if it has no processes).
    fn model_figures(&self, name: &str) -> ModelFigures {
        match self
            .state
            .attribution
            .models
            .iter()
            .find(|m| m.name == name)
        {
            Some(usage) => self.usage_figures(usage),
            None => self.budget_figures(name),
        }
    }
}

/// What is wrong right now, for alerts that fire, repeat and resolve: floors crossed or
/// unreadable, models over budget, GPUs lost, kills that did not free memory.
pub(super) fn conditions(v: &TickView) -> Vec<Condition> {
    let mut out = floor_conditions(v);
    out.extend(v.over_budget.iter().map(|o| budget_condition(v, o)));
    out.extend(gpu_lost_conditions(v));
    out.extend(v.stuck.iter().map(stuck_condition));
    out
}

/// Floors crossed (warn or act), and the RAM floor unreadable; in resource order (RAM, then the
/// GPUs by index).
fn floor_conditions(v: &TickView) -> Vec<Condition> {
    let mut out = Vec::new();
    let ram = &v.ram;
    if ram.level == Level::Unknown {
        out.push(ram_unreadable(ram.error.as_deref()));
    }
    let memory = &ram.host;
    let mut extra = String::new();
    if let Some(shmem) = memory.shmem_bytes {
        extra += &format!(
            ", Shmem (tmpfs, shared memory) {}",
            crate::units::fmt_bytes(shmem)
        );
    }
    if let Some(psi) = memory.psi_some_avg10 {
        extra += &format!(", PSI some avg10 {psi:.1}%");
    }
    out.extend(floor_condition(
        Resource::Ram,
        ram.level,
        memory.available_bytes,
        ram.floors(),
        &extra,
    ));
    let mut gpus: Vec<&GpuRow> = v.gpus.iter().collect();
    gpus.sort_by_key(|g| g.index);
    gpus.dedup_by_key(|g| g.index);
    for g in gpus {
        out.extend(floor_condition(
            Resource::Gpu(g.index),
            g.level,
            g.free_bytes,
            g.floors(),
            "",
        ));
    }
    out
}

/// A floor crossed: `available` (MemAvailable, or a GPU's free memory) under its warn or act
/// floor; `extra` is added to the summary.
fn floor_condition(
    resource: Resource,
    level: Level,
    available: Option<u64>,
    floors: Floors,
    extra: &str,
) -> Option<Condition> {
    let (event, severity, floor) = match level {
        Level::Warn => (EventKind::FloorWarn, Severity::Warning, floors.warn_bytes),
        Level::Act => (EventKind::FloorAct, Severity::Critical, floors.min_bytes),
        Level::Ok | Level::Unknown => return None,
    };
    let show = |b: Option<u64>| b.map_or("unknown".into(), crate::units::fmt_bytes);
    let summary = format!(
        "{resource} {} {} (warn floor {}, act floor {}){extra}",
        if resource == Resource::Ram {
            "available"
        } else {
            "free"
        },
        show(available),
        show(floors.warn_bytes),
        show(floors.min_bytes)
    );
    Some(Condition {
        key: format!("floor:{resource}"),
        event,
        severity,
        summary,
        subject: Subject {
            resource: Some(resource.to_string()),
            available_bytes: available,
            floor_bytes: floor,
            ..Subject::default()
        },
        caused_by: None,
    })
}

/// The RAM floor cannot be read: nothing guards host memory until it can.
fn ram_unreadable(error: Option<&str>) -> Condition {
    let why = error.unwrap_or("MemAvailable unknown");
    Condition {
        key: "floor_unreadable:RAM".into(),
        event: EventKind::FloorUnreadable,
        severity: Severity::Critical,
        summary: format!("RAM floor cannot be read ({why}): host memory is not guarded"),
        subject: Subject {
            resource: Some(Resource::Ram.to_string()),
            ..Subject::default()
        },
        caused_by: None,
    }
}

/// A model over budget, on the resource the policy found over.
fn budget_condition(v: &TickView, o: &OverBudget) -> Condition {
    let name = &o.model;
    let (resource, used, limit) = (
        o.over.resource_name(),
        o.over.used_bytes,
        o.over.budget_bytes,
    );
    let pids = v
        .models
        .iter()
        .find(|m| &m.name == name)
        .map(|m| m.pids.clone())
        .unwrap_or_default();
    let first = o.first.as_ref();
    Condition {
        key: format!("budget:{name}"),
        event: EventKind::BudgetExceeded,
        severity: Severity::Warning,
        summary: format!(
            "model '{name}' over budget: {resource} {} > budget {}",
            crate::units::fmt_bytes(used),
            crate::units::fmt_bytes(limit)
        ),
        subject: Subject {
            model: Some(name.clone()),
            resource: Some(resource.into()),
            pid: first.map(|p| p.pid),
            uid: first.map(|p| p.uid),
            comm: first.map(|p| p.comm.clone()),
            cmdline: first.map(|p| p.cmdline.clone()),
            pids,
            usage_bytes: Some(used),
            budget_bytes: Some(limit),
            ..Subject::default()
        },
        caused_by: o.launched_by,
    }
}

/// GPUs whose reading failed or that are lost, and NVML lost after it had worked.
fn gpu_lost_conditions(v: &TickView) -> Vec<Condition> {
    let mut out: Vec<Condition> = v
        .gpus
        .iter()
        .filter_map(|g| {
            let error = g.error.as_ref()?;
            Some(Condition {
                key: format!("gpu_lost:{}", g.index),
                event: EventKind::GpuLost,
                severity: Severity::Critical,
                summary: format!("GPU {} ({}): {error}", g.index, g.uuid),
                subject: Subject {
                    resource: Some(Resource::Gpu(g.index).to_string()),
                    ..Subject::default()
                },
                caused_by: None,
            })
        })
        .collect();
    if let Some(why) = &v.nvml_lost {
        out.push(Condition {
            key: "gpu_lost:nvml".into(),
            event: EventKind::GpuLost,
            severity: Severity::Critical,
            summary: format!("GPU protection is off: {why}"),
            subject: Subject::default(),
            caused_by: None,
        });
    }
    out
}

/// A floor whose victim was killed and whose memory did not come back.
fn stuck_condition(stuck: &Stuck) -> Condition {
    let resource = stuck.resource;
    let mut subject = stuck
        .victim
        .as_ref()
        .map(|v| v.subject.clone())
        .unwrap_or_default();
    subject.resource = Some(resource.to_string());
    Condition {
        key: format!("kill_ineffective:{resource}"),
        event: EventKind::KillIneffective,
        severity: Severity::Critical,
        summary: format!(
            "{} was killed but {resource} did not come back (stuck in the kernel or driver); not killing more for {resource}",
            stuck.victim.as_ref().map_or("the victim", |v| v.name.as_str())
        ),
        subject,
        caused_by: None,
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{conditions, Shown};
    use crate::config::Config;
    use crate::daemon::{Daemon, Roots};
    use crate::kinds::{EventKind, Level, Severity};
    use crate::policy::{Overage, Resource};
    use crate::snapshot::HostMemory;
    use crate::status::{GpuRow, MemoryStatus, ModelRow};
    use crate::view::Subject;
    use crate::view::{OverBudget, ProcessInfo, Stuck, TickView, Victim};

    const GIB: u64 = 1 << 30;

    /// Every kind of condition from a view written by hand: no daemon, no policy run.
    #[test]
    fn conditions_are_read_from_the_view() {
        let view = TickView {
            ram: MemoryStatus {
                host: HostMemory {
                    available_bytes: Some(3 * GIB),
                    shmem_bytes: Some(GIB),
                    psi_some_avg10: Some(12.5),
                    ..HostMemory::default()
                },
                warn_available_bytes: Some(8 * GIB),
                min_available_bytes: Some(4 * GIB),
                level: Level::Act,
                error: None,
            },
            // Out of index order, and one fine: conditions come in resource order.
            gpus: vec![
                GpuRow {
                    index: 1,
                    uuid: "GPU-b".into(),
                    free_bytes: Some(5 * GIB),
                    warn_free_bytes: Some(6 * GIB),
                    min_free_bytes: Some(2 * GIB),
                    level: Level::Warn,
                    ..GpuRow::default()
                },
                GpuRow {
                    index: 0,
                    uuid: "GPU-a".into(),
                    level: Level::Unknown,
                    error: Some("GPU is lost".into()),
                    lost: true,
                    ..GpuRow::default()
                },
            ],
            nvml_lost: Some("NVML gone".into()),
            models: vec![ModelRow {
                name: "llm".into(),
                pids: vec![200, 201],
                ..ModelRow::default()
            }],
            over_budget: vec![OverBudget {
                model: "llm".into(),
                over: Overage {
                    gpu: true,
                    used_bytes: 30 * GIB,
                    budget_bytes: 20 * GIB,
                },
                first: Some(ProcessInfo {
                    pid: 200,
                    uid: 1000,
                    comm: "vllm".into(),
                    cmdline: Shown::of("vllm serve"),
                }),
                launched_by: None,
            }],
            stuck: vec![Stuck {
                resource: Resource::Ram,
                victim: Some(Victim {
                    name: "pid 300 (hog)".into(),
                    subject: Subject {
                        pid: Some(300),
                        ..Subject::default()
                    },
                }),
            }],
            ..TickView::default()
        };
        let got = conditions(&view);
        let keys: Vec<&str> = got.iter().map(|c| c.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "floor:RAM",
                "floor:GPU 1",
                "budget:llm",
                "gpu_lost:0",
                "gpu_lost:nvml",
                "kill_ineffective:RAM"
            ]
        );
        let ram = &got[0];
        assert_eq!(
            (ram.event, ram.severity),
            (EventKind::FloorAct, Severity::Critical)
        );
        assert_eq!(
            ram.summary,
            "RAM available 3.0 GiB (warn floor 8.0 GiB, act floor 4.0 GiB), \
             Shmem (tmpfs, shared memory) 1.0 GiB, PSI some avg10 12.5%"
        );
        assert_eq!(ram.subject.floor_bytes, Some(4 * GIB), "the act floor");
        assert_eq!(ram.subject.available_bytes, Some(3 * GIB));
        let gpu = &got[1];
        assert_eq!(
            (gpu.event, gpu.severity),
            (EventKind::FloorWarn, Severity::Warning)
        );
        assert_eq!(gpu.subject.floor_bytes, Some(6 * GIB), "the warn floor");
        assert_eq!(
            gpu.summary,
            "GPU 1 free 5.0 GiB (warn floor 6.0 GiB, act floor 2.0 GiB)"
        );
        let budget = &got[2];
        assert_eq!(
            budget.summary,
            "model 'llm' over budget: GPU memory 30.0 GiB > budget 20.0 GiB"
        );
        assert_eq!(budget.subject.pids, [200, 201]);
        assert_eq!(budget.subject.pid, Some(200));
        assert_eq!(budget.subject.cmdline, Some(Shown::of("vllm serve")));
        assert_eq!(
            (budget.subject.usage_bytes, budget.subject.budget_bytes),
            (Some(30 * GIB), Some(20 * GIB))
        );
        assert_eq!(got[3].summary, "GPU 0 (GPU-a): GPU is lost");
        assert_eq!(got[4].summary, "GPU protection is off: NVML gone");
        let stuck = &got[5];
        assert!(stuck
            .summary
            .starts_with("pid 300 (hog) was killed but RAM"));
        assert_eq!(stuck.subject.pid, Some(300));
        assert_eq!(stuck.subject.resource.as_deref(), Some("RAM"));
    }

    #[test]
    fn a_quiet_view_has_no_conditions_and_an_unknown_ram_level_is_unreadable() {
        assert_eq!(conditions(&TickView::default()), []);
        let view = TickView {
            ram: MemoryStatus {
                level: Level::Unknown,
                error: Some("/proc/meminfo has no MemAvailable".into()),
                ..MemoryStatus::default()
            },
            ..TickView::default()
        };
        let got = conditions(&view);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].key, "floor_unreadable:RAM");
        assert_eq!(got[0].severity, Severity::Critical);
        assert_eq!(
            got[0].summary,
            "RAM floor cannot be read (/proc/meminfo has no MemAvailable): host memory is not guarded"
        );
    }

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
            enforce_lock: dir.path().join("enforce.lock"),
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
