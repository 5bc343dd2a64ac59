//! The loop's reporting part (`Reporter`): the alert pipeline, the metrics, the actions status
//! shows and the tick view they are all told from; and the daemon's own view for operators, the
//! `gpuguard status` report and systemd's STATUS line, both worked out from the tick view alone.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use crate::alert::Alerter;
use crate::config::HistoryConfig;
use crate::history::input::{self, PolicyInput};
use crate::history::jumps::{Figures, Jumps};
use crate::history::kernel_log::{self, KernelLog};
use crate::history::{self, now_ms, Pressure, Record, Recorder};
use crate::ipc::server::Shared;
use crate::kinds::{EventKind, Level, ModelSource, Severity};
use crate::metrics::Metrics;
use crate::policy::{Attribution, Event, Launches, Verb};
use crate::snapshot::{GpuStatus, ProcessId, Snapshot};
use crate::state_dir::StateDir;
use crate::status::ActionRow;
use crate::status::{StatusReport, STATUS_SCHEMA_VERSION};
use crate::view::TickView;

/// How many actions `status` shows.
const RECENT_ACTIONS: usize = 50;
/// The status report (and the metrics' gauges) are refreshed at most this often (counters and
/// the histogram always); the socket serves the latest with the reservation table's live rows.
const STATUS_REFRESH: Duration = Duration::from_millis(250);

/// What operators and alert receivers are told, and what it is told from.
pub(super) struct Reporter {
    pub alerter: Alerter,
    pub metrics: Metrics,
    /// The metrics are served (`[metrics] listen`): their gauges follow the status report.
    metrics_served: bool,
    /// When the status report was last published.
    status_published: Option<Instant>,
    pub recent_actions: VecDeque<ActionRow>,
    /// What the last tick saw, decided and did (status, metrics and conditions read it).
    pub view: TickView,
    /// The flight recorder (`[history]`), if on.
    pub recorder: Option<Recorder>,
    /// Critical events and kills also go to the kernel log (`[history] kernel_log`; on GCE).
    pub(super) kernel_log: Option<KernelLog>,
    /// When each process the recorder keeps last had its details written (`history::input`).
    details_written: HashMap<ProcessId, Instant>,
    /// When a sample last carried the policy's input.
    input_recorded: Option<Instant>,
    /// The figures of the last sample kept, and the samples kept for jumps (`history::jumps`).
    jumps: Jumps,
}

impl Reporter {
    pub(super) fn new(alerter: Alerter, metrics: Metrics) -> Reporter {
        Reporter {
            alerter,
            metrics,
            metrics_served: false,
            status_published: None,
            recent_actions: VecDeque::new(),
            view: TickView::default(),
            recorder: None,
            kernel_log: None,
            details_written: HashMap::new(),
            input_recorded: None,
            jumps: Jumps::default(),
        }
    }

    /// With the flight recorder on (`[history] enabled`): reads what the previous run left in
    /// the state directory's `history/` (a post-mortem event if it did not stop cleanly), then
    /// starts recording there. A recorder that cannot start is a critical event, not a failed
    /// start: guarding comes first.
    pub(super) fn start_recording(&mut self, dir: &StateDir, config: &HistoryConfig) {
        match KernelLog::open(config.kernel_log, &kernel_log::Paths::real()) {
            Ok(log) => self.kernel_log = log,
            Err(why) => tracing::warn!("history.kernel_log: {why}"),
        }
        if !config.enabled {
            return;
        }
        let path = dir.path().join(history::DIR);
        let started = dir
            .public_subdir(history::DIR)
            .and_then(|fd| Recorder::start(fd, config));
        let recorder = match started {
            Ok(r) => r,
            Err(e) => {
                let why = format!("history: cannot record in {}: {e}", path.display());
                tracing::error!("{why}");
                self.lifecycle(EventKind::HistoryStopped, Severity::Critical, why);
                return;
            }
        };
        let previous = history::last_run(&path);
        let boot_id = boot_id();
        recorder.record(
            Record::Start {
                at_ms: now_ms(),
                version: env!("CARGO_PKG_VERSION").into(),
                boot_id: boot_id.clone(),
            },
            Pressure::Act,
        );
        self.recorder = Some(recorder);
        match previous {
            Ok((run, warnings)) => {
                for w in &warnings {
                    tracing::warn!("history: {w}");
                }
                if let Some(line) = run.and_then(|r| history::unclean_end(&r, &boot_id)) {
                    tracing::warn!("{line}");
                    self.lifecycle(EventKind::PreviousRunUnclean, Severity::Warning, line);
                }
            }
            Err(e) => tracing::warn!("history: cannot read {}: {e}", path.display()),
        }
    }

    /// How close the host is to a floor, as the flight recorder keeps samples.
    fn pressure(&self) -> Pressure {
        let v = &self.view;
        let levels = std::iter::once(v.ram.level).chain(v.gpus.iter().map(|g| g.level));
        if !v.held.is_empty() || levels.clone().any(|l| l == Level::Act) {
            Pressure::Act
        } else if levels.into_iter().any(|l| l == Level::Warn) || configured_over_budget(v) {
            Pressure::Warn
        } else {
            Pressure::Quiet
        }
    }

    fn record(&self, record: Record) {
        if let Some(r) = &self.recorder {
            r.record(record, self.pressure());
        }
    }

    /// An event of the tick: to the flight recorder (the caller logs and alerts it), and to the
    /// kernel log if critical.
    pub(super) fn remember_event(&self, e: &Event) {
        self.note(e.kind, e.severity, &e.message);
    }

    /// The daemon's own notices (started, stopping, reload failed...): to the alert pipeline,
    /// the flight recorder and (critical ones) the kernel log.
    pub(super) fn lifecycle(&mut self, kind: EventKind, severity: Severity, message: String) {
        self.note(kind, severity, &message);
        self.alerter.lifecycle(kind, severity, message);
    }

    /// An event to the flight recorder, and to the kernel log if critical.
    fn note(&self, kind: EventKind, severity: Severity, message: &str) {
        if let (Severity::Critical, Some(k)) = (severity, &self.kernel_log) {
            k.critical(&format!("{}: {message}", kind.as_str()));
        }
        self.record(Record::Event {
            at_ms: now_ms(),
            severity,
            kind: kind.as_str().into(),
            message: message.into(),
        });
    }

    /// Says once, as a critical event, that the flight recorder stopped recording, and as a
    /// warning that it resumed (the disk it stopped on has room again) and what it did not keep.
    pub(super) fn check_recorder(&mut self) {
        let Some(recorder) = self.recorder.as_ref() else {
            return;
        };
        let (stopped, resumed) = (recorder.stopped(), recorder.resumed());
        if let Some(why) = stopped {
            tracing::error!("history: {why}");
            self.lifecycle(
                EventKind::HistoryStopped,
                Severity::Critical,
                format!("history: {why}"),
            );
        }
        if let Some(what) = resumed {
            tracing::warn!("history: {what}");
            self.lifecycle(
                EventKind::HistoryResumed,
                Severity::Warning,
                format!("history: {what}"),
            );
        }
    }

    /// A clean stop, recorded and synced (the next start finds it and writes no post-mortem).
    pub(super) fn stop_recording(&mut self) {
        if let Some(mut r) = self.recorder.take() {
            r.record(Record::Stop { at_ms: now_ms() }, Pressure::Act);
            r.shutdown();
        }
    }

    /// The metrics are served from now on.
    pub(super) fn metrics_served(&mut self) {
        self.metrics_served = true;
    }

    /// The status report and the metrics' gauges are due for a refresh at `now`.
    pub(super) fn due(&self, now: Instant) -> bool {
        self.status_published
            .is_none_or(|t| now.duration_since(t) >= STATUS_REFRESH)
    }

    /// Keeps `row` among the actions status shows (the latest `RECENT_ACTIONS`), and in the
    /// flight recorder.
    pub(super) fn remember(&mut self, row: ActionRow) {
        if let (true, Some(k)) = (
            matches!(row.verb, Verb::Kill | Verb::Terminate),
            &self.kernel_log,
        ) {
            k.critical(&format!(
                "{} {}: {} ({})",
                row.verb, row.target, row.reason, row.outcome
            ));
        }
        self.record(Record::Action {
            at_ms: now_ms(),
            action: row.clone(),
        });
        if self.recent_actions.len() == RECENT_ACTIONS {
            self.recent_actions.pop_front();
        }
        self.recent_actions.push_back(row);
    }

    /// Refreshes what operators read from the (full) view: the status report the socket
    /// serves, and the metrics.
    /// `decided_from`: the tick's snapshot, launches and attribution (what the policy decided
    /// from: recorded with the sample for `gpuguard replay`); `decided`: the policy said or did
    /// something this tick (the sample is kept whatever the pressure).
    pub(super) fn publish(
        &mut self,
        now: Instant,
        shared: &Shared,
        decided_from: (&Snapshot, &Launches, &Attribution),
        decided: bool,
    ) {
        self.status_published = Some(now);
        if self.metrics_served {
            self.metrics.update(&self.view);
        }
        let report = status_report(&self.view);
        let pressure = self.pressure();
        if let Some(r) = self.recorder.as_mut() {
            let figures = Figures::of(&self.view);
            let due = r.sample_due(now, pressure) || decided;
            // A GPU's or a model's figures moved far since the last sample kept (bounded).
            let jumped = !due && self.jumps.due(now, &figures);
            if due || jumped {
                self.jumps.kept(figures);
                let input_due = decided
                    || jumped
                    || pressure != Pressure::Quiet
                    || self
                        .input_recorded
                        .is_none_or(|t| now.saturating_duration_since(t) >= input::QUIET_EVERY);
                let input = input_due.then(|| {
                    self.input_recorded = Some(now);
                    let details = &mut self.details_written;
                    Box::new(policy_input(now, decided_from, pressure, details))
                });
                let sample = Record::Sample {
                    at_ms: now_ms(),
                    status: Box::new(report.clone()),
                    input,
                };
                r.record(sample, pressure);
            }
        }
        shared.publish_status(report);
    }
}

/// The policy's input at this tick, for the flight recorder (`history::input`). `details`: when
/// each process kept last had its details written.
fn policy_input(
    now: Instant,
    (snapshot, launches, attribution): (&Snapshot, &Launches, &Attribution),
    pressure: Pressure,
    details: &mut HashMap<ProcessId, Instant>,
) -> PolicyInput {
    let input = PolicyInput::of_tick(
        snapshot,
        launches,
        attribution,
        pressure != Pressure::Quiet,
        |id| match details.get(&id) {
            Some(t) if now.saturating_duration_since(*t) < input::DETAIL_EVERY => false,
            _ => {
                details.insert(id, now);
                true
            }
        },
    );
    // Forget the processes this sample did not keep (they get details again if they come back).
    let kept: HashSet<ProcessId> = input
        .processes
        .iter()
        .map(|p| ProcessId {
            pid: p.pid,
            start_time: p.start_time,
        })
        .collect();
    details.retain(|id, _| kept.contains(id));
    input
}

/// A model of the config (not one a user launched and declared: anyone can keep that over its
/// budget, and must not make the recorder write every second) is over its budget.
fn configured_over_budget(v: &TickView) -> bool {
    v.over_budget.iter().any(|o| {
        v.models
            .iter()
            .any(|m| m.source == ModelSource::Config && m.name == o.model)
    })
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`), empty if unknown.
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The status report for `gpuguard status`.
pub(super) fn status_report(v: &TickView) -> StatusReport {
    StatusReport {
        schema_version: STATUS_SCHEMA_VERSION,
        hostname: v.hostname.clone(),
        version: env!("CARGO_PKG_VERSION").into(),
        mode: v.mode,
        uptime_seconds: v.uptime_seconds,
        memory: v.ram.clone(),
        gpu_protection: v.gpu_protection.clone(),
        gpus: v.gpus.clone(),
        models: v.models.clone(),
        queue: v.reservations.queue.clone(),
        leases: v.reservations.leases.clone(),
        permits: v.reservations.permits.clone(),
        held: v.held.clone(),
        recent_actions: v.recent_actions.clone(),
    }
}

/// What `systemctl status` shows.
pub(super) fn one_line_status(v: &TickView) -> String {
    let ram = v
        .ram
        .host
        .available_bytes
        .map_or("unknown".into(), crate::units::fmt_bytes);
    let gpus = match &v.gpu_status {
        GpuStatus::Ok => match v.gpus.iter().filter(|g| g.lost).count() {
            0 => format!("{} GPU(s)", v.gpus.len()),
            lost => format!("{} GPU(s), {lost} LOST", v.gpus.len()),
        },
        GpuStatus::Unavailable(_) => "GPU protection off (no NVML)".into(),
        GpuStatus::Off => "GPU protection disabled".into(),
    };
    format!(
        "{}: RAM available {ram}, {gpus}, {} model(s), {} queued, {} held stopped",
        v.mode,
        v.models.iter().filter(|m| !m.pids.is_empty()).count(),
        v.reservations.queue.len(),
        v.held.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Mode;
    use crate::kinds::Level;
    use crate::policy::Stage;
    use crate::status::{
        GpuProtection, GpuRow, HeldRow, MemoryStatus, ModelRow, ModelState, QueuedRow,
    };
    use crate::view::ModelFigures;

    const GIB: u64 = 1 << 30;

    /// A model's row as the tick view builds it (`daemon::view::with_figures`).
    fn model(name: &str, configured: bool, state: ModelState, gpu_known: bool) -> ModelRow {
        let figures = ModelFigures {
            ram_bytes: 3 * GIB,
            ram_budget_bytes: Some(2 * GIB),
            gpu_bytes: 10 * GIB,
            gpu_budget_bytes: Some(12 * GIB),
        };
        ModelRow {
            name: name.into(),
            source: if configured {
                ModelSource::Config
            } else {
                ModelSource::Launch
            },
            pids: vec![10, 11],
            state,
            gpu_reserved_ratio: Some(0.95),
            ..super::super::view::with_figures(figures, gpu_known)
        }
    }

    /// The report from a view written by hand: every row is the view's, in the report's words.
    #[test]
    fn the_report_is_read_from_the_view() {
        let mut unknown_gpu = model("chat", false, ModelState::OverBudget, false);
        unknown_gpu.pids.clear();
        let mut view = TickView {
            hostname: "h1".into(),
            mode: Mode::Observe,
            ram: MemoryStatus {
                warn_available_bytes: Some(8 * GIB),
                level: Level::Warn,
                ..MemoryStatus::default()
            },
            gpu_status: GpuStatus::Ok,
            gpu_protection: GpuProtection {
                state: crate::kinds::Protection::Ok,
                reason: None,
                stale: true,
            },
            gpus: vec![GpuRow {
                index: 0,
                uuid: "GPU-a".into(),
                warn_free_bytes: Some(GIB),
                min_free_bytes: Some(GIB / 2),
                level: Level::Act,
                ..GpuRow::default()
            }],
            models: vec![
                model("llm", true, ModelState::Enforced(Stage::Stopped), true),
                unknown_gpu,
            ],
            held: vec![HeldRow {
                pid: 10,
                why: "stop".into(),
                ..HeldRow::default()
            }],
            ..TickView::default()
        };
        view.reservations.queue.push(QueuedRow::default());
        let r = status_report(&view);
        assert_eq!(r.schema_version, STATUS_SCHEMA_VERSION);
        assert_eq!((r.hostname.as_str(), r.mode), ("h1", Mode::Observe));
        assert_eq!(r.memory.level, "warn");
        assert_eq!(r.memory.warn_available_bytes, Some(8 * GIB));
        assert_eq!(r.memory.min_available_bytes, None);
        assert!(r.gpu_protection.stale);
        assert_eq!(r.gpus[0].level, "act");
        assert_eq!(r.gpus[0].min_free_bytes, Some(GIB / 2));
        let llm = &r.models[0];
        assert_eq!(
            (llm.source.as_str(), llm.state.to_string().as_str()),
            ("config", "stopped")
        );
        assert_eq!(llm.ram_headroom_bytes, Some(-(GIB as i64)));
        assert_eq!(llm.gpu_headroom_bytes, Some(2 * GIB as i64));
        assert_eq!(llm.gpu_bytes, Some(10 * GIB));
        let chat = &r.models[1];
        assert_eq!(
            (chat.source.as_str(), chat.state.to_string().as_str()),
            ("launch", "over_budget")
        );
        assert_eq!(chat.gpu_bytes, None, "unknown without NVML, not zero");
        assert_eq!(chat.gpu_headroom_bytes, None);
        assert_eq!(r.held.len(), 1);
        assert_eq!(r.queue.len(), 1);
        assert_eq!(
            one_line_status(&view),
            "observe: RAM available unknown, 1 GPU(s), 1 model(s), 1 queued, 1 held stopped"
        );
    }

    /// A model of the config over its budget makes the recorder keep a sample a second; a model
    /// a user launched and declared, over its own budget, does not (anyone can keep one over).
    #[test]
    fn only_a_configured_model_over_budget_raises_the_recording_rate() {
        use crate::policy::Overage;
        use crate::view::OverBudget;
        let over = |configured: bool| {
            let mut v = TickView::default();
            v.models.push(ModelRow {
                name: "m".into(),
                source: if configured {
                    ModelSource::Config
                } else {
                    ModelSource::Launch
                },
                ..ModelRow::default()
            });
            v.over_budget.push(OverBudget {
                model: "m".into(),
                over: Overage {
                    gpu: false,
                    used_bytes: 2,
                    budget_bytes: 1,
                },
                first: None,
                launched_by: (!configured).then_some(1000),
            });
            v
        };
        assert!(configured_over_budget(&over(true)));
        assert!(!configured_over_budget(&over(false)));
        assert!(!configured_over_budget(&TickView::default()));
    }
}
