//! The daemon loop: sample -> evaluate -> execute -> log, at an adaptive interval, with SIGHUP
//! reload and SIGTERM/SIGINT shutdown that resumes every process gpuguard holds stopped.
//! `alerts.rs` feeds the alert pipeline and metrics, `report.rs` builds what operators see,
//! `systemd.rs` speaks sd_notify.

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
use crate::alert::Alerter;
use crate::config::Config;
use crate::ipc::server::IpcEvent;
use crate::ipc::{self, Request, Response};
use crate::launch::Launches;
use crate::metrics::Metrics;
use crate::policy::{evaluate, About, Event, Level, PolicyState, Resource, Severity, Target};
use crate::sample::nvml::{GpuMonitor, NvmlGpuSource};
use crate::sample::{ProcSource, ProcfsSource};
use crate::snapshot::{GpuStatus, ProcessId, Snapshot};
use crate::status::ActionRow;

mod alerts;
mod report;
mod systemd;

use systemd::Systemd;

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
                    // Gone: marked dead in place, since the policy's attribution holds indices
                    // into this table until the next scan.
                    (Some(i), None) => {
                        let p = &mut table.processes[i];
                        p.state = 'X';
                        p.rss_bytes = 0;
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
                let about = About {
                    resource: x.gpu.map(Resource::Gpu),
                    ..About::default()
                };
                events.push(
                    Event::new(severity, kind, format!("Xid {} on {gpu}", x.xid)).about(about),
                );
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
            let subject = self.event_subject(&e.about);
            self.alerter.event(e, subject);
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
            GpuStatus::Ok => Event::new(
                Severity::Info,
                "gpu_ok",
                format!(
                    "GPU protection on: {} GPU(s) seen through NVML",
                    self.snapshot.gpus.devices.len()
                ),
            ),
            GpuStatus::Unavailable(why) => Event::new(
                Severity::Warning,
                "gpu_unavailable",
                format!(
                    "GPU protection is off: {why}; guarding host RAM only, retrying NVML every {}",
                    humantime::format_duration(self.config.gpu.retry_init)
                ),
            ),
            GpuStatus::Off => Event::new(
                Severity::Info,
                "gpu_off",
                "GPU protection disabled by config ([gpu] enabled = false)".into(),
            ),
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
