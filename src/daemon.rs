//! The daemon loop: sample -> evaluate -> execute -> log, at an adaptive interval, with SIGHUP
//! reload and SIGTERM/SIGINT shutdown that resumes every process gpuguard holds stopped.

use std::collections::{HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use tracing::{debug, error, info, warn};

use crate::act::held::HeldRecord;
use crate::act::signal::{self_test, PidfdControl};
use crate::act::{Executor, Outcome};
use crate::alert::{ActionInfo, Alerter, Condition, Subject};
use crate::config::{Config, Mode};
use crate::ipc::server::IpcEvent;
use crate::ipc::{self, Request, Response};
use crate::launch::Launches;
use crate::metrics::Metrics;
use crate::policy::{
    evaluate, Action, Event, Level, PolicyState, Resource, Severity, Stage, Target, Verb,
};
use crate::sample::nvml::{GpuMonitor, NvmlGpuSource};
use crate::sample::{ProcSource, ProcfsSource};
use crate::snapshot::{GpuStatus, ProcessId, Snapshot};
use crate::status::{
    ActionRow, GpuProtection, GpuRow, HeldRow, MemoryStatus, ModelRow, StatusReport,
    STATUS_SCHEMA_VERSION,
};

/// systemd's notify protocol: READY once serving, STATUS now and then, and watchdog pings from
/// the control loop itself, so a wedged loop gets the service restarted. No-ops outside systemd.
struct Systemd {
    watchdog: Option<Duration>,
    last_ping: Option<Instant>,
    last_status: Option<Instant>,
}

impl Systemd {
    fn new() -> Systemd {
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
        let watchdog = sd_notify::watchdog_enabled();
        if let Some(w) = watchdog {
            info!("systemd watchdog armed: {}", humantime::format_duration(w));
        }
        Systemd {
            watchdog,
            last_ping: None,
            last_status: None,
        }
    }

    /// The loop must come round at least this often to keep the watchdog fed.
    fn max_sleep(&self) -> Duration {
        self.watchdog.map_or(Duration::MAX, |w| w / 4)
    }

    fn tick(&mut self, now: Instant, status: impl FnOnce() -> String) {
        if let Some(w) = self.watchdog {
            if self
                .last_ping
                .is_none_or(|t| now.duration_since(t) >= w / 4)
            {
                let _ = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]);
                self.last_ping = Some(now);
            }
        }
        if self
            .last_status
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(5))
        {
            let _ = sd_notify::notify(&[sd_notify::NotifyState::Status(&status())]);
            self.last_status = Some(now);
        }
    }
}

/// Where the daemon looks at the system; tests and fixtures may point these elsewhere.
#[derive(Clone, Debug)]
pub struct Roots {
    pub proc: PathBuf,
    pub cgroup: PathBuf,
}

impl Default for Roots {
    fn default() -> Self {
        Roots {
            proc: PathBuf::from("/proc"),
            cgroup: PathBuf::from("/sys/fs/cgroup"),
        }
    }
}

pub struct Daemon {
    config_path: PathBuf,
    config: Config,
    procs: ProcfsSource,
    gpus: Option<GpuMonitor>,
    executor: Executor,
    state: PolicyState,
    snapshot: Snapshot,
    started: Instant,
    gpu_status: GpuStatus,
    unknown_gpu_pids: HashSet<i32>,
    launches: Launches,
    recent_actions: VecDeque<ActionRow>,
    /// From the last plan: how fresh the process table must be, and which pids to re-read.
    max_scan_age: Duration,
    watch: Vec<ProcessId>,
    metrics: Metrics,
    /// When the metrics' gauges were last refreshed (`None`: metrics off).
    metrics_updated: Option<Instant>,
    alerter: Alerter,
    /// NVML has worked at least once: losing it now is an alert, not a host without GPUs.
    gpu_seen_ok: bool,
}

/// What wakes the loop between ticks.
pub enum DaemonEvent {
    Signal(i32),
    Ipc(IpcEvent),
}

/// How many actions `status` shows.
const RECENT_ACTIONS: usize = 50;
/// While launches wait or load, the loop ticks at least this often.
const LAUNCH_TICK: Duration = Duration::from_millis(100);
/// The metrics' gauges are refreshed at most this often (counters and the histogram always).
const METRICS_REFRESH: Duration = Duration::from_millis(250);

impl Daemon {
    /// Sets the daemon up: state directory, leftovers from a crash, NVML worker.
    pub fn new(config_path: &Path, config: Config, roots: Roots) -> anyhow::Result<Daemon> {
        let control = Arc::new(PidfdControl::new(&roots.proc));
        let held = HeldRecord::open(&config.daemon.state_dir)
            .with_context(|| format!("state directory {}", config.daemon.state_dir.display()))?;
        let mut executor = Executor::new(control, held, &roots.cgroup.to_string_lossy());
        executor.resume_leftovers();
        let gpus = config.gpu.enabled.then(|| {
            let source = NvmlGpuSource::new(config.gpu.nvml_library.clone(), config.gpu.retry_init);
            GpuMonitor::start(Box::new(source), config.gpu.sample_timeout)
        });
        let snapshot = Snapshot {
            self_pid: std::process::id() as i32,
            ..Default::default()
        };
        let metrics = Metrics::new();
        let alerter = Alerter::new(&config, &metrics).context("[alert]")?;
        Ok(Daemon {
            config_path: config_path.to_path_buf(),
            config,
            procs: ProcfsSource::new(&roots.proc),
            gpus,
            executor,
            state: PolicyState::default(),
            snapshot,
            started: Instant::now(),
            gpu_status: GpuStatus::Off,
            unknown_gpu_pids: HashSet::new(),
            launches: Launches::default(),
            recent_actions: VecDeque::new(),
            max_scan_age: Duration::ZERO,
            watch: Vec::new(),
            metrics,
            metrics_updated: None,
            alerter,
            gpu_seen_ok: false,
        })
    }

    /// Runs until SIGTERM or SIGINT.
    pub fn run(mut self) -> anyhow::Result<()> {
        let (tx, events) = channel();
        let mut signals = signal_hook::iterator::Signals::new([SIGHUP, SIGTERM, SIGINT])
            .context("installing signal handlers")?;
        let signal_thread = signals.handle();
        let signal_tx = tx.clone();
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                for signal in signals.forever() {
                    if signal_tx.send(DaemonEvent::Signal(signal)).is_err() {
                        break;
                    }
                }
            })?;
        let _socket = ipc::server::spawn(&self.config.launch.socket, tx, DaemonEvent::Ipc)?;
        if let Some(address) = self.config.metrics.address() {
            let bound =
                crate::metrics::serve(address, self.metrics.clone()).context("[metrics] listen")?;
            if !bound.ip().is_loopback() {
                warn!("metrics listen on {bound}, which is not a loopback address");
            }
            info!("metrics on http://{bound}/metrics");
            // Refresh at the first tick.
            self.metrics_updated = Instant::now().checked_sub(METRICS_REFRESH);
        }
        if let Err(e) = self_test() {
            warn!("{e}");
        }
        self.log_start();
        let mut systemd = Systemd::new();

        let mut last_tick = Instant::now();
        let mut next_tick = last_tick;
        loop {
            let now = Instant::now();
            if now >= next_tick {
                let wait = self.tick(now.saturating_duration_since(last_tick));
                systemd.tick(now, || self.one_line_status());
                last_tick = now;
                next_tick = now + wait.min(systemd.max_sleep());
            }
            match events.recv_timeout(next_tick.saturating_duration_since(Instant::now())) {
                Ok(DaemonEvent::Signal(SIGHUP)) => {
                    let _ = sd_notify::notify(&[sd_notify::NotifyState::Reloading]);
                    self.reload();
                    let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
                }
                Ok(DaemonEvent::Signal(signal)) => {
                    let name =
                        nix::sys::signal::Signal::try_from(signal).map_or("signal", |s| s.as_str());
                    info!("{name}: resuming held processes and stopping");
                    self.alerter.lifecycle(
                        "daemon_stopping",
                        Severity::Warning,
                        format!(
                            "gpuguard stopping ({name}): memory is not guarded until it starts again"
                        ),
                    );
                    break;
                }
                Ok(DaemonEvent::Ipc(event)) => {
                    if self.handle_ipc(event) {
                        // A new launch: try to admit it now rather than at the next tick.
                        next_tick = Instant::now();
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
        self.executor.shutdown();
        signal_thread.close();
        self.alerter.shutdown();
        info!("gpuguard stopped");
        Ok(())
    }

    /// One pass of the pipeline; returns how long to sleep.
    fn tick(&mut self, since_last: Duration) -> Duration {
        let now = Instant::now();
        let at = now.duration_since(self.started);
        self.snapshot.at = at;
        self.snapshot.host = self.procs.host_memory();

        let table = &mut self.snapshot.processes;
        let scan = table
            .scanned_at
            .is_none_or(|t| at.saturating_sub(t) >= self.max_scan_age);
        if scan {
            table.processes = self.procs.scan();
            table.scanned_at = Some(at);
        } else {
            // Re-read only the victims we wait on.
            for id in &self.watch {
                let fresh = self.procs.read(id.pid).filter(|p| p.id() == *id);
                match (table.processes.iter().position(|p| p.id() == *id), fresh) {
                    (Some(i), Some(p)) => table.processes[i] = p,
                    (Some(i), None) => {
                        table.processes.swap_remove(i);
                    }
                    (None, _) => {}
                }
            }
        }

        let mut events = Vec::new();
        let mut gpu_sample = Duration::ZERO;
        if let Some(gpus) = &self.gpus {
            let (gpu_snapshot, xids, took) = gpus.snapshot(now, at, since_last);
            gpu_sample = took;
            gpus.request(scan);
            self.snapshot.gpus = gpu_snapshot;
            for x in xids {
                let gpu = x
                    .gpu
                    .map_or("unknown GPU".to_string(), |g| format!("GPU {g}"));
                let (severity, kind) = if x.critical() {
                    (Severity::Critical, "xid_critical")
                } else {
                    (Severity::Warning, "xid")
                };
                events.push(Event {
                    severity,
                    kind,
                    message: format!("Xid {} on {gpu}", x.xid),
                });
            }
            if scan {
                self.note_unknown_gpu_pids();
            }
        }
        self.note_gpu_status(&mut events);
        self.metrics.observe_sample(now.elapsed());

        let plan = evaluate(&self.config, &self.snapshot, &mut self.state);
        let procs = &mut self.procs;
        let mut alive = |id: ProcessId| {
            procs
                .read(id.pid)
                .is_some_and(|p| p.id() == id && !p.exited())
        };
        events.extend(self.launches.tick(
            &self.config,
            &self.snapshot,
            &mut self.state,
            &mut alive,
        ));
        for e in events.iter().chain(&plan.events) {
            log_event(e);
            self.alerter.event(e, Subject::default());
        }
        for action in &plan.actions {
            let cgroup = own_cgroup(&self.snapshot, &action.target);
            let procs = &mut self.procs;
            let mut reread = |r: Resource| match r {
                Resource::Ram => procs.host_memory().available_bytes,
                Resource::Gpu(_) => None,
            };
            let outcome = self.executor.execute(
                self.config.daemon.mode,
                action,
                cgroup.as_deref(),
                &mut reread,
            );
            if matches!(outcome, Outcome::Skipped(_) | Outcome::Failed(_)) {
                self.state
                    .action_not_done(action, matches!(outcome, Outcome::Failed(_)));
            }
            self.record_action(action, &outcome);
        }
        debug!(
            took_us = now.elapsed().as_micros() as u64,
            scan,
            gpu_sample_us = gpu_sample.as_micros() as u64,
            next_ms = plan.next_interval.as_millis() as u64,
            "tick"
        );
        self.max_scan_age = plan.max_scan_age;
        self.watch = plan.watch;
        let conditions = self.conditions();
        self.alerter.conditions(now, conditions);
        if let Some(updated) = self.metrics_updated {
            if now.duration_since(updated) >= METRICS_REFRESH {
                self.metrics.update(&self.status());
                self.metrics_updated = Some(now);
            }
        }
        if self.launches.busy() {
            // Admission and readiness are checked every tick: look often while launches wait.
            self.max_scan_age = self.max_scan_age.min(LAUNCH_TICK);
            return plan.next_interval.min(LAUNCH_TICK);
        }
        plan.next_interval
    }

    /// What `systemctl status` shows.
    fn one_line_status(&self) -> String {
        let s = &self.snapshot;
        let ram = s
            .host
            .available_bytes
            .map_or("unknown".into(), crate::units::fmt_bytes);
        let gpus = match &s.gpus.status {
            GpuStatus::Ok => format!("{} GPU(s)", s.gpus.devices.len()),
            GpuStatus::Unavailable(_) => "GPU protection off (no NVML)".into(),
            GpuStatus::Off => "GPU protection disabled".into(),
        };
        format!(
            "{:?}: RAM available {ram}, {gpus}, {} model(s), {} queued, {} held stopped",
            self.config.daemon.mode,
            self.state
                .attribution
                .models
                .iter()
                .filter(|m| !m.members.is_empty())
                .count(),
            self.launches.queue.len(),
            self.executor.held().len()
        )
    }

    /// Answers a client; returns true if a launch was queued.
    fn handle_ipc(&mut self, event: IpcEvent) -> bool {
        match event {
            IpcEvent::Closed { conn } => {
                self.launches.cancel(conn);
                false
            }
            IpcEvent::Request {
                conn,
                peer,
                request,
                reply,
            } => match request {
                Request::Status => {
                    let _ = reply.send(Response::Status(Box::new(self.status())));
                    false
                }
                Request::Release { lease } => {
                    let _ = reply.send(self.launches.release(lease, peer));
                    false
                }
                Request::Launch(launch) => {
                    self.launches
                        .enqueue(&self.config, &self.snapshot, conn, peer, launch, reply);
                    true
                }
            },
        }
    }

    fn record_action(&mut self, action: &Action, outcome: &Outcome) {
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
            reason_kind: action.reason.kind.into(),
            reason: action.reason.detail.clone(),
            outcome,
        });
    }

    /// Tells the alert pipeline (and the metrics) about an action and its outcome.
    fn alert_action(&mut self, action: &Action, outcome: &str, failed: bool) {
        let (event, severity) = match action.verb {
            Verb::Kill | Verb::Terminate => ("process_killed", Severity::Critical),
            Verb::Stop => ("process_stopped", Severity::Warning),
            Verb::Throttle => ("process_throttled", Severity::Warning),
            Verb::Resume => ("process_resumed", Severity::Info),
            Verb::Unthrottle => ("process_unthrottled", Severity::Info),
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
                "gpu_budget" | "gpu_floor" => (Some(gpu), gpu_budget),
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
                reason: action.reason.kind.into(),
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

    /// A model's (RAM used, RAM budget, GPU used, GPU budget), in bytes.
    fn model_figures(&self, name: &str) -> (u64, Option<u64>, u64, Option<u64>) {
        let s = &self.snapshot;
        let cfg = crate::policy::model_config(&self.config, &self.state, name);
        let largest_gpu = s.gpus.devices.iter().filter_map(|g| g.total_bytes).max();
        let usage = self
            .state
            .attribution
            .models
            .iter()
            .find(|m| m.name == name);
        (
            usage.map_or(0, |m| m.rss_bytes),
            cfg.and_then(|c| c.ram)
                .and_then(|a| a.resolve(s.host.total_bytes)),
            usage.map_or(0, |m| m.gpu_total_bytes()),
            cfg.and_then(|c| c.gpu_memory)
                .and_then(|a| a.resolve(largest_gpu)),
        )
    }

    /// What is wrong right now, for alerts that fire, repeat and resolve: floors crossed,
    /// models over budget, GPUs lost, kills that did not free memory.
    fn conditions(&self) -> Vec<Condition> {
        let s = &self.snapshot;
        let c = &self.config;
        let mut out = Vec::new();
        for (resource, level) in &self.state.levels {
            let (event, severity) = match level {
                Level::Warn => ("floor_warn", Severity::Warning),
                Level::Act => ("floor_act", Severity::Critical),
                Level::Ok | Level::Unknown => continue,
            };
            let (available, warn, min) = match resource {
                Resource::Ram => (
                    s.host.available_bytes,
                    c.ram
                        .warn_available
                        .and_then(|a| a.resolve(s.host.total_bytes)),
                    c.ram
                        .min_available
                        .and_then(|a| a.resolve(s.host.total_bytes)),
                ),
                Resource::Gpu(i) => {
                    let Some(g) = s.gpus.devices.iter().find(|g| g.index == *i) else {
                        continue;
                    };
                    let (warn, min) = c.gpu.floors_for(g.index, &g.uuid);
                    (
                        g.free_bytes,
                        warn.and_then(|a| a.resolve(g.total_bytes)),
                        min.and_then(|a| a.resolve(g.total_bytes)),
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
            if budget.over_since.is_none() {
                continue;
            }
            let (ram, ram_budget, gpu, gpu_budget) = self.model_figures(name);
            let (resource, used, limit) = match (ram_budget, gpu_budget) {
                (Some(b), _) if ram > b => ("RAM", ram, Some(b)),
                (_, Some(b)) if gpu > b => ("GPU memory", gpu, Some(b)),
                _ => ("RAM", ram, ram_budget),
            };
            let pids: Vec<i32> = self
                .state
                .attribution
                .models
                .iter()
                .find(|m| &m.name == name)
                .map(|m| {
                    m.members
                        .iter()
                        .map(|&i| s.processes.processes[i].pid)
                        .collect()
                })
                .unwrap_or_default();
            let first = pids
                .first()
                .and_then(|pid| s.processes.processes.iter().find(|p| p.pid == *pid));
            out.push(Condition {
                key: format!("budget:{name}"),
                event: "budget_exceeded",
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
                    event: "gpu_lost",
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
                event: "gpu_lost",
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
                event: "kill_ineffective",
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

    /// The status report for `gpuguard status`.
    fn status(&self) -> StatusReport {
        let s = &self.snapshot;
        let c = &self.config;
        let level = |r: Resource| level_name(self.state.levels.get(&r).copied());
        let memory = MemoryStatus {
            total_bytes: s.host.total_bytes,
            available_bytes: s.host.available_bytes,
            swap_total_bytes: s.host.swap_total_bytes,
            swap_free_bytes: s.host.swap_free_bytes,
            psi_some_avg10: s.host.psi_some_avg10,
            warn_available_bytes: c
                .ram
                .warn_available
                .and_then(|a| a.resolve(s.host.total_bytes)),
            min_available_bytes: c
                .ram
                .min_available
                .and_then(|a| a.resolve(s.host.total_bytes)),
            level: level(Resource::Ram),
        };
        let gpu_protection = match &s.gpus.status {
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
                let (warn, min) = c.gpu.floors_for(g.index, &g.uuid);
                GpuRow {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    name: g.name.clone(),
                    total_bytes: g.total_bytes,
                    used_bytes: g.used_bytes,
                    free_bytes: g.free_bytes,
                    utilization_percent: g.utilization_percent,
                    warn_free_bytes: warn.and_then(|a| a.resolve(g.total_bytes)),
                    min_free_bytes: min.and_then(|a| a.resolve(g.total_bytes)),
                    level: level(Resource::Gpu(g.index)),
                    error: g.error.clone(),
                }
            })
            .collect();
        let largest_gpu = s.gpus.devices.iter().filter_map(|g| g.total_bytes).max();
        let models = self
            .state
            .attribution
            .models
            .iter()
            .map(|m| {
                let cfg = crate::policy::model_config(c, &self.state, &m.name);
                let ram_budget = cfg
                    .and_then(|c| c.ram)
                    .and_then(|a| a.resolve(s.host.total_bytes));
                let gpu_budget = cfg
                    .and_then(|c| c.gpu_memory)
                    .and_then(|a| a.resolve(largest_gpu));
                let gpu_bytes = m.gpu_total_bytes();
                let budget = self.state.budgets.get(&m.name);
                let state = match budget {
                    Some(b) => match &b.enforced {
                        Some((stage, _, _)) => format!("{stage:?}").to_lowercase(),
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
                    pids: m
                        .members
                        .iter()
                        .map(|&i| s.processes.processes[i].pid)
                        .collect(),
                    ram_bytes: m.rss_bytes,
                    ram_budget_bytes: ram_budget,
                    gpu_bytes,
                    gpu_budget_bytes: gpu_budget,
                    gpu_unknown: m.gpu_unknown,
                    ram_headroom_bytes: ram_budget.map(|b| b as i64 - m.rss_bytes as i64),
                    gpu_headroom_bytes: gpu_budget.map(|b| b as i64 - gpu_bytes as i64),
                    state,
                }
            })
            .collect();
        StatusReport {
            schema_version: STATUS_SCHEMA_VERSION,
            hostname: nix::unistd::gethostname()
                .map(|h| h.to_string_lossy().into_owned())
                .unwrap_or_default(),
            version: env!("CARGO_PKG_VERSION").into(),
            mode: match c.daemon.mode {
                Mode::Enforce => "enforce",
                Mode::Observe => "observe",
            }
            .into(),
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            memory,
            gpu_protection,
            gpus,
            models,
            queue: self.launches.queue_rows(s.at),
            leases: self.launches.lease_rows(s.at),
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

    fn note_gpu_status(&mut self, events: &mut Vec<Event>) {
        let status = match &self.gpus {
            None => GpuStatus::Off,
            Some(_) if self.snapshot.gpus.sampled_at.is_none() => return,
            Some(_) => self.snapshot.gpus.status.clone(),
        };
        if status == self.gpu_status {
            return;
        }
        self.gpu_seen_ok |= status == GpuStatus::Ok;
        let event = match &status {
            GpuStatus::Ok => Event {
                severity: Severity::Info,
                kind: "gpu_ok",
                message: format!(
                    "GPU protection on: {} GPU(s) seen through NVML",
                    self.snapshot.gpus.devices.len()
                ),
            },
            GpuStatus::Unavailable(why) => Event {
                severity: Severity::Warning,
                kind: "gpu_unavailable",
                message: format!(
                    "GPU protection is off: {why}; guarding host RAM only, retrying NVML every {}",
                    humantime::format_duration(self.config.gpu.retry_init)
                ),
            },
            GpuStatus::Off => Event {
                severity: Severity::Info,
                kind: "gpu_off",
                message: "GPU protection disabled by config ([gpu] enabled = false)".into(),
            },
        };
        events.push(event);
        self.gpu_status = status;
    }

    /// NVML can report pids /proc does not know (other pid namespaces, garbage from old drivers).
    fn note_unknown_gpu_pids(&mut self) {
        let table = &self.snapshot.processes;
        for gpu in &self.snapshot.gpus.devices {
            for pid in gpu.processes.keys() {
                if !table.processes.iter().any(|p| p.pid == *pid)
                    && self.unknown_gpu_pids.insert(*pid)
                {
                    warn!(
                        gpu = gpu.index,
                        pid,
                        "GPU {} reports pid {pid}, which /proc does not know: ignored",
                        gpu.index
                    );
                }
            }
        }
    }

    fn reload(&mut self) {
        match Config::load(&self.config_path) {
            Ok(config) => {
                if config.daemon.state_dir != self.config.daemon.state_dir
                    || config.launch.socket != self.config.launch.socket
                {
                    warn!("daemon.state_dir and launch.socket change only at restart");
                }
                if config.metrics.listen != self.config.metrics.listen {
                    warn!("metrics.listen changes only at restart");
                }
                if let Err(e) = self.alerter.configure(&config) {
                    let message =
                        format!("config reload failed, keeping the previous config: {e:#}");
                    error!("{message}");
                    self.alerter
                        .lifecycle("config_reload_failed", Severity::Warning, message);
                    return;
                }
                self.config = config;
                self.state.config_changed();
                // Rescan at once so new matchers and budgets apply now.
                self.snapshot.processes.scanned_at = None;
                info!("config {} reloaded", self.config_path.display());
            }
            Err(e) => {
                let message = format!("config reload failed, keeping the previous config: {e}");
                error!("{message}");
                self.alerter
                    .lifecycle("config_reload_failed", Severity::Warning, message);
            }
        }
    }

    fn log_start(&mut self) {
        let c = &self.config;
        let total = self
            .snapshot
            .host
            .total_bytes
            .or_else(|| ProcfsSource::new("/proc").host_memory().total_bytes);
        let show = |a: Option<crate::units::Amount>| match a {
            Some(a) => match a.resolve(total) {
                Some(b) => format!("{a} ({})", crate::units::fmt_bytes(b)),
                None => a.to_string(),
            },
            None => "off".into(),
        };
        let message = format!(
            "gpuguard {} started: mode {:?}, RAM warn_available {}, min_available {}, action {:?}; {} model(s); GPU: {}",
            env!("CARGO_PKG_VERSION"),
            c.daemon.mode,
            show(c.ram.warn_available),
            show(c.ram.min_available),
            c.ram.action,
            c.models.len(),
            if c.gpu.enabled { "NVML starting" } else { "disabled" },
        );
        info!("{message}");
        self.alerter
            .lifecycle("daemon_started", Severity::Info, message);
    }
}

/// The cgroup the target's processes share, if they all live in one that is not the root.
fn own_cgroup(snapshot: &Snapshot, target: &Target) -> Option<String> {
    let mut groups = target
        .ids()
        .filter_map(|id| snapshot.processes.get(id))
        .map(|p| p.cgroup.clone());
    let first = groups.next()?;
    (first != "/" && !first.is_empty() && groups.all(|g| g == first)).then_some(first)
}

fn level_name(level: Option<Level>) -> String {
    match level {
        None | Some(Level::Ok) => "ok",
        Some(Level::Unknown) => "unknown",
        Some(Level::Warn) => "warn",
        Some(Level::Act) => "act",
    }
    .into()
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn log_event(e: &Event) {
    match e.severity {
        Severity::Critical => error!(event = e.kind, "{}", e.message),
        Severity::Warning => warn!(event = e.kind, "{}", e.message),
        Severity::Info => info!(event = e.kind, "{}", e.message),
    }
}
