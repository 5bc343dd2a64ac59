//! The daemon loop: sample -> evaluate -> execute -> log, at an adaptive interval, with SIGHUP
//! reload and SIGTERM/SIGINT shutdown that resumes every process gpuguard holds stopped.
//! `view.rs` derives the tick view once per tick; from it `alerts.rs` works out the alert
//! conditions (it also feeds actions to the alert pipeline), `report.rs` what operators see and
//! `Metrics::update` the gauges. `sampler/` is the sampling part: it owns the sources, the
//! snapshot it builds from them and what it remembers about them; its `sampler/scanning.rs` schedules the process scans (on a thread of their own). `warm.rs` runs the kill path once at
//! start, `systemd.rs` speaks sd_notify.
//!
//! # Threads
//!
//! Each thread owns its own state; they talk to the loop through channels and a few locks, never
//! by waiting on each other's I/O.
//! - *the control loop* (the thread that calls `run`): owns `Daemon` (config, sampler and snapshot, policy
//!   state, executor, alerter). Ends on SIGTERM/SIGINT, lets go of what it holds
//!   (`Executor::shutdown`) and shuts the others down.
//! - `signals`: turns SIGHUP/SIGTERM/SIGINT into `DaemonEvent::Signal`; ends when `run` closes
//!   its handle.
//! - `proc-scan` (`sample::scan::ScanThread`): owns the incremental scanner, answers each request
//!   with a `DaemonEvent::Scan`; ends when the loop drops its sender (restarted if it panics).
//! - `gpu-sampler` (`sample::nvml::GpuMonitor`): owns the `GpuSource` (NVML) and publishes the
//!   latest reading under a lock; ends when the monitor is dropped. NVML's Xid listener
//!   (`nvml-events`) belongs to it and stops with it.
//! - `io` (`io.rs`, the one current-thread tokio runtime), with two servers on it as tasks of their
//!   own (a panic ends its task alone): the socket, which shares the reservation table and the
//!   status report with the loop (`ipc::server::Shared`) and wakes it with `DaemonEvent::Wake`;
//!   and, when `[metrics] listen` is set, the metrics endpoint, which serves the registry the
//!   loop updates. Ends with the process.
//! - `engine-metrics`: scrapes the model servers' metrics URLs (started when there are any);
//!   ends when the scraper is dropped.
//! - one worker per alert sink and `event-log`: fed by bounded queues; `Alerter::shutdown` gives
//!   them a grace to drain, then they end.
//! - `reaper` (`act::signal`): `process_mrelease` after SIGKILL, off the loop; `throttle`: the
//!   SIGSTOP/SIGCONT duty cycle while a process is throttled that way, ended by
//!   `Executor::shutdown`.
//!
//! The loop reads and acts only through its `Sources` (a /proc source, a process-table source, a
//! GPU source, a process control): `Sources::real` in the binary, fakes in `tests/`, which
//! drive whole ticks in process with the clock in hand (`tick_at`).

use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use tracing::{debug, error, info, warn};

use crate::act::claim::{self, ClaimError, Holder, Lock};
use crate::act::signal::{self_test, PidfdControl};
use crate::act::{Executor, ProcessControl};
use crate::alert::Alerter;
use crate::config::{Config, ConfigError, Overrides};
use crate::ipc::server::Shared;
use crate::kinds::EventKind;
use crate::metrics::Metrics;
use crate::policy::{
    evaluate, Action, Event, Executed, Launches, PolicyState, Resource, Severity, Target,
};
use crate::reserve::Capacity;
use crate::sample::engine::EngineScraper;
use crate::sample::nvml::{GpuMonitor, GpuSource, NvmlGpuSource};
use crate::sample::scan::ScanResult;
use crate::sample::{ProcSource, ProcfsSource};
use crate::snapshot::Snapshot;
use crate::state_dir::StateDir;

mod alerts;
mod faults;
mod gce;
pub(crate) mod io;
mod model_detail;
pub mod preflight;
mod report;
mod sampler;

mod systemd;
#[cfg(test)]
mod tests;
mod view;
mod watch;
use report::Reporter;
use sampler::Sampler;
use view::Detail;
mod warm;

pub use sampler::scanning::MakeTables;
use systemd::Systemd;

/// What the loop reads and acts through: the real ones (`Sources::real`) in the binary, fakes in
/// the in-process tick tests (`tests/`).
pub struct Sources {
    /// Host memory every tick, and the loop's own re-reads of the victims it waits on.
    pub procs: Box<dyn ProcSource>,
    /// Makes the process-table source (the first at start, another if the scan thread dies).
    pub tables: MakeTables,
    /// GPU readings (`None`: GPU protection disabled by the config).
    pub gpus: Option<Box<dyn GpuSource>>,
    /// Signals processes identified by pid + start time.
    pub control: Arc<dyn ProcessControl>,
    /// The cgroup v2 tree throttles write to.
    pub cgroup_root: PathBuf,
    /// /proc, where the socket reads its peers' start times.
    pub proc_root: PathBuf,
    /// The host's enforce lock (`act::claim`): one daemon at a time signals on a host.
    pub enforce_lock: PathBuf,
    /// Sample and scan on the loop's own thread, at the tick that asks, instead of on threads of
    /// their own: ticks are then deterministic (tests).
    pub inline: bool,
}

impl Sources {
    /// /proc, NVML (when `[gpu] enabled`), pidfd signals, the cgroup tree: what the binary runs.
    pub fn real(config: &Config, roots: &Roots) -> Sources {
        let proc_root = roots.proc.clone();
        Sources {
            procs: Box::new(ProcfsSource::new(&proc_root).with_cgroups(&roots.cgroup)),
            tables: sampler::scanning::real_tables(&proc_root, &roots.cgroup),
            gpus: config.gpu.enabled.then(|| {
                Box::new(NvmlGpuSource::new(
                    config.gpu.nvml_library.clone(),
                    config.gpu.retry_init,
                )) as Box<dyn GpuSource>
            }),
            control: Arc::new(PidfdControl::new(&proc_root)),
            cgroup_root: roots.cgroup.clone(),
            proc_root,
            enforce_lock: roots.enforce_lock.clone(),
            inline: false,
        }
    }
}

/// Where the daemon looks at the system; tests and fixtures may point these elsewhere.
#[derive(Clone, Debug)]
pub struct Roots {
    pub proc: PathBuf,
    pub cgroup: PathBuf,
    /// The host's enforce lock (`act::claim::DEFAULT_ENFORCE_LOCK`).
    pub enforce_lock: PathBuf,
}

impl Default for Roots {
    fn default() -> Self {
        Roots {
            proc: PathBuf::from("/proc"),
            cgroup: PathBuf::from("/sys/fs/cgroup"),
            enforce_lock: PathBuf::from(crate::act::claim::DEFAULT_ENFORCE_LOCK),
        }
    }
}

/// Why a daemon did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The config cannot work on this host (exit 2: restarting does not help).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Another gpuguard holds the state directory or enforces on the host (exit 1: it may let
    /// go, and systemd tries again).
    #[error("{0}")]
    Claimed(#[from] ClaimError),
    #[error("{0:#}")]
    Runtime(#[from] anyhow::Error),
}

pub struct Daemon {
    config_path: PathBuf,
    config: Config,
    /// What the command line set over the config (kept across reloads).
    overrides: Overrides,
    /// The state directory, claimed for the daemon's life.
    dir: Arc<StateDir>,
    _claim: Lock,
    /// What the start's checks bound for the daemon (the metrics address).
    ready: preflight::Ready,
    /// When a metrics port another program held was last tried.
    metrics_tried: Option<Instant>,
    /// What the loop knows of the host (sources, snapshot), and what it reads next.
    sampler: Sampler,
    executor: Executor,
    state: PolicyState,
    /// What `gpuguard launch` registered, from the reservation ledger's latest tick.
    launches: Launches,
    started: Instant,
    /// The reservation table and the status report, shared with the socket thread.
    shared: Arc<Shared>,
    events: Receiver<DaemonEvent>,
    events_tx: Sender<DaemonEvent>,
    /// What operators and alert receivers are told (alerts, metrics, status).
    reporter: Reporter,
    /// Scrapes the model servers' metrics URLs on a thread of its own.
    engines: EngineScraper,
    /// GCE's notices as last acted on (`gce.rs`).
    gce_notices: crate::sample::gce::Notices,
    /// `--watch-config`: the config file reloaded when its content changes (`watch.rs`).
    watch: Option<watch::ConfigWatch>,
}

/// What the reservation ledger's tick gives the loop.
struct Reserved {
    events: Vec<Event>,
    /// A permit request waits for a scan to find its caller's model.
    scan_wanted: bool,
}

/// What wakes the loop between ticks.
pub enum DaemonEvent {
    Signal(i32),
    /// A request started waiting for memory: tick now, so its capacity is fresh.
    Wake,
    /// A process scan round from the scan thread.
    Scan(Box<ScanResult>),
}

/// While launches wait or load, the loop ticks at least this often.
const LAUNCH_TICK: Duration = Duration::from_millis(100);
/// While permits are held or wait, the loop ticks at least this often, reading the GPU process
/// lists each time, so admission sees each model's use beside the GPU's free memory.
const PERMIT_TICK: Duration = Duration::from_millis(200);
/// The least time between the end of one tick and a tick the socket or the GPU sampler woke
/// early: a client that loops acquire/cancel or acquire/release wakes the loop with every
/// request, and would otherwise have it tick as fast as the CPU allows.
const MIN_WAKE_GAP: Duration = Duration::from_millis(2);

impl Daemon {
    /// Sets the daemon up on the real system: /proc, NVML, pidfd signals (`Sources::real`).
    pub fn new(config_path: &Path, config: Config, roots: Roots) -> Result<Daemon, StartError> {
        one_malloc_arena();
        let sources = Sources::real(&config, &roots);
        Daemon::with_sources(config_path, config, sources)
    }

    /// Sets the daemon up on the given sources: claims the state directory (refused if another
    /// daemon holds it) and, to enforce, the host's enforce lock; lets go of what a previous run
    /// left there if it may; starts the NVML worker and reads the first process table. Nothing
    /// is recorded and nothing is served until `run`.
    pub fn with_sources(
        config_path: &Path,
        config: Config,
        sources: Sources,
    ) -> Result<Daemon, StartError> {
        let Sources {
            procs,
            tables,
            gpus,
            control,
            cgroup_root,
            proc_root,
            enforce_lock,
            inline,
        } = sources;
        warm::warm_up(control.as_ref());
        let dir = StateDir::create(&config.daemon.state_dir)
            .map_err(|e| preflight::state_dir_error(config_path, e))?;
        let dir = Arc::new(dir);
        let me = Holder::me(config_path, dir.path());
        let claim = claim::claim_state_dir(&dir, &me)?;
        let (executor, leftovers) = Executor::new(
            control,
            dir.clone(),
            &cgroup_root,
            config.daemon.mode,
            &enforce_lock,
            me,
        )?;
        leftovers.log();
        let timeout = config.gpu.sample_timeout;
        let gpus = gpus.map(|source| match inline {
            true => GpuMonitor::inline(source, timeout),
            false => GpuMonitor::start(source, timeout),
        });
        let (scans, processes) = sampler::scanning::Scans::new(tables, inline);
        let snapshot = Snapshot {
            self_pid: std::process::id() as i32,
            processes: crate::snapshot::ProcessTable {
                scanned_at: Some(Duration::ZERO),
                processes,
                pss_read: false,
            },
            ..Default::default()
        };
        let metrics = Metrics::new();
        preflight::check_secrets(&config, config_path)?;
        let mut alerter = Alerter::new(&config, &metrics).context("[alert]")?;
        faults::announce_leftovers(&mut alerter, &leftovers);
        let reporter = Reporter::new(alerter, metrics);
        let (events_tx, events) = channel();
        let mut sampler = Sampler::new(procs, scans, gpus, snapshot, events_tx.clone());
        sampler.gce = gce::start(&config);
        let wake = events_tx.clone();
        let shared = Arc::new(Shared::new(
            &config,
            Instant::now(),
            proc_root,
            Box::new(move || {
                let _ = wake.send(DaemonEvent::Wake);
            }),
        ));
        Ok(Daemon {
            config_path: config_path.to_path_buf(),
            config,
            overrides: Overrides::default(),
            dir,
            _claim: claim,
            ready: preflight::Ready::default(),
            metrics_tried: None,
            sampler,
            executor,
            state: PolicyState::default(),
            launches: Launches::default(),
            started: shared.epoch,
            shared,
            events,
            events_tx,
            reporter,
            engines: EngineScraper::default(),
            gce_notices: Default::default(),
            watch: None,
        })
    }

    /// What the command line set over the config file: applied again at every reload.
    pub fn keep_overrides(&mut self, overrides: Overrides) {
        self.overrides = overrides;
    }

    /// `--watch-config`: from now on, the config file is looked at every `every` and reloaded
    /// as SIGHUP reloads it when its content changed (`watch.rs`: a ConfigMap volume).
    pub fn watch_config(&mut self, every: Duration) {
        self.watch = Some(watch::ConfigWatch::new(
            &self.config_path,
            every,
            Instant::now(),
        ));
    }

    /// At start, before anything is served or recorded: every check `check-config` runs too
    /// (`preflight::check`), against this host's totals (GPU totals from NVML's first answer).
    pub fn preflight(&mut self) -> Result<(), ConfigError> {
        let totals = preflight::host_totals(
            &self.config,
            self.sampler.procs.as_mut(),
            self.sampler.gpus.as_ref(),
        );
        let checker = preflight::Checker::Daemon;
        self.ready = preflight::check(&self.config, &self.config_path, &totals, &checker)?;
        for note in &self.ready.notes {
            warn!("config {}: {note}", self.config_path.display());
        }
        Ok(())
    }

    /// Serves the metrics once their port is bound: at once when the start's checks bound it;
    /// when another program held it, the port is tried again every `METRICS_RETRY` (from the
    /// loop), and said when served at last.
    fn serve_metrics(&mut self, now: Instant, io: &tokio::runtime::Handle) {
        let listener = match std::mem::take(&mut self.ready.metrics) {
            preflight::MetricsPort::Bound(listener) => listener,
            preflight::MetricsPort::Off => return,
            preflight::MetricsPort::Held(address, why) => {
                if self
                    .metrics_tried
                    .is_some_and(|t| now < t + preflight::METRICS_RETRY)
                {
                    self.ready.metrics = preflight::MetricsPort::Held(address, why);
                    return;
                }
                let first = self.metrics_tried.is_none();
                self.metrics_tried = Some(now);
                match std::net::TcpListener::bind(address) {
                    Ok(listener) => listener,
                    Err(_) => {
                        if first {
                            self.reporter.lifecycle(
                                EventKind::MetricsUnavailable,
                                Severity::Critical,
                                format!(
                                    "metrics.listen: {why}: no metrics are served until it is \
                                     free (tried again every {}s); the guard runs",
                                    preflight::METRICS_RETRY.as_secs()
                                ),
                            );
                        }
                        self.ready.metrics = preflight::MetricsPort::Held(address, why);
                        return;
                    }
                }
            }
        };
        match crate::metrics::serve(listener, self.reporter.metrics.clone(), io) {
            Ok(bound) => {
                info!("metrics on http://{bound}/metrics");
                if self.metrics_tried.is_some() {
                    self.reporter.lifecycle(
                        EventKind::MetricsUnavailable,
                        Severity::Info,
                        format!("metrics.listen: served on {bound} at last"),
                    );
                }
                self.reporter.metrics_served();
            }
            Err(e) => error!("metrics.listen: {e:#}"),
        }
    }

    /// The flight recorder, from now on (`[history] enabled`): what the previous run left is
    /// read first. Started by `run` once the daemon serves, so that a start that fails is never
    /// taken for a crash by the next one.
    pub(crate) fn start_recording(&mut self) {
        self.reporter
            .start_recording(&self.dir, &self.config.history);
    }

    /// The signals the daemon handles, registered as early as the caller can (a SIGTERM that
    /// comes during startup then waits for `run` instead of killing the process half started).
    pub fn signals() -> anyhow::Result<Signals> {
        Signals::new([SIGHUP, SIGTERM, SIGINT]).context("installing signal handlers")
    }

    /// Runs until SIGTERM or SIGINT (from `signals`, which may already hold some).
    pub fn run(mut self, mut signals: Signals) -> anyhow::Result<()> {
        let tx = self.events_tx.clone();
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
        self.shared
            .publish_status(report::status_report(&self.view(Detail::Full)));
        self.sampler
            .scans
            .start(self.events_tx.clone())
            .context("starting the process scan thread")?;
        let io = io::start()?;
        let _socket =
            crate::ipc::server::spawn(&self.config.launch.socket, self.shared.clone(), &io)?;
        self.start_recording();
        self.serve_metrics(Instant::now(), &io);
        for warning in self.config.warnings() {
            warn!("config {}: {warning}", self.config_path.display());
        }
        self.warn_about_rules();
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
                self.serve_metrics(now, &io);
                systemd.tick(now, || report::one_line_status(&self.view(Detail::Full)));
                last_tick = now;
                next_tick = now + wait.min(systemd.max_sleep());
            }
            let wait = next_tick.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(wait) {
                Ok(DaemonEvent::Signal(SIGHUP)) => self.reload_notified(),
                Ok(DaemonEvent::Signal(signal)) => {
                    let name = if signal == SIGINT {
                        "SIGINT"
                    } else {
                        "SIGTERM"
                    };
                    info!("{name}: resuming held processes and stopping");
                    self.reporter.lifecycle(
                        EventKind::DaemonStopping,
                        Severity::Warning,
                        format!(
                            "gpuguard stopping ({name}): memory is not guarded until it starts again"
                        ),
                    );
                    break;
                }
                Ok(DaemonEvent::Wake) => next_tick = woken(next_tick, last_tick, Instant::now()),
                Ok(DaemonEvent::Scan(result)) => {
                    self.sampler.scans.arrived(*result);
                    if self.sampler.max_scan_age.is_zero() {
                        // The policy is waiting for this table (a floor crossed, no victim yet).
                        next_tick = Instant::now();
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
        self.executor.shutdown();
        self.reporter.stop_recording();
        signal_thread.close();
        self.reporter.alerter.shutdown();
        info!("gpuguard stopped");
        Ok(())
    }

    /// One pass of the pipeline; returns how long to sleep.
    fn tick(&mut self, since_last: Duration) -> Duration {
        self.tick_at(Instant::now(), since_last)
    }

    /// One pass of the pipeline as at `now` (tests drive the clock); returns how long to sleep:
    /// sample, decide (the policy's plan, the reservation ledger's tick), tell (events to the
    /// log and alerts), act, report (status, metrics, conditions), then ask for the next
    /// samples.
    fn tick_at(&mut self, now: Instant, since_last: Duration) -> Duration {
        if self
            .watch
            .as_mut()
            .is_some_and(|w| w.changed(&self.config_path, now))
        {
            info!(
                "config {} changed on disk (--watch-config): reloading",
                self.config_path.display()
            );
            self.reload_notified();
        }
        let at = now.saturating_duration_since(self.started);
        let (scan, mut events, gpu_sample) = self.sampler.sample(&self.config, now, at, since_last);
        self.note_gce(&mut events);
        self.reporter.metrics.observe_sample(now.elapsed());
        let mut plan = evaluate(
            &self.config,
            &self.sampler.snapshot,
            &self.launches,
            &mut self.state,
        );
        let reserved = self.reserve(at, scan);
        let decisions = self.within_client_shares(std::mem::take(&mut plan.events));
        events.extend(reserved.events);
        self.tell(events.iter().chain(&decisions));
        // A tick that decided something is recorded whatever the pressure: a replay must see
        // the moments its decisions turn on. Not for what a client caused (a model it launched
        // crossing the budget it declared): anyone can make that happen every second.
        let decided = decisions.iter().any(|e| e.caused_by.is_none()) || !plan.actions.is_empty();
        self.keep_enforce_lock();
        self.act(plan.actions);
        // A permit request waits for a scan to find its caller's model: one now.
        self.sampler.max_scan_age = if reserved.scan_wanted {
            Duration::ZERO
        } else {
            plan.max_scan_age
        };
        self.sampler.watch = plan.watch;
        self.report(now, decided);
        self.schedule(now, at, plan.next_interval, scan, gpu_sample)
    }

    /// The reservation ledger's tick on this tick's capacity: its events, and the launches it
    /// registered for the policy; a fresh GPU reading or scan when a request waits for one.
    fn reserve(&mut self, at: Duration, scan: bool) -> Reserved {
        if scan {
            let targets = self.engine_targets();
            self.engines
                .set_targets(targets, self.config.daemon.scan_interval);
        }
        let (report, fresh_wanted, scan_wanted) = {
            let mut capacity =
                Capacity::from_tick(&self.config, &self.sampler.snapshot, &self.state);
            capacity.preallocated = self.engines.preallocated();
            let mut table = self.shared.table();
            let report = table.tick(at, capacity);
            (report, table.wants_fresh_gpu(), table.wants_fresh_scan())
        };
        if fresh_wanted {
            self.sampler.want_fresh_gpu();
        }
        let launches = Launches::new(report.registered, report.launched_models);
        if !launches.same_members(&self.launches) {
            self.state.launches_changed();
        }
        self.launches = launches;
        self.reporter
            .metrics
            .count_suppressed(report.events_suppressed);
        Reserved {
            events: report.events,
            scan_wanted,
        }
    }

    /// The policy's events, those a client caused (`Event::caused_by`: the budget events of a
    /// model it launched) only within its uid's share of the per-uid rate limit, the one the
    /// reservation ledger's own events go through.
    fn within_client_shares(&self, events: Vec<Event>) -> Vec<Event> {
        if events.iter().all(|e| e.caused_by.is_none()) {
            return events;
        }
        let mut table = self.shared.table();
        events
            .into_iter()
            .filter(|e| {
                e.caused_by
                    .is_none_or(|uid| table.admit_event(uid, e.kind, e.severity))
            })
            .collect()
    }

    /// Every event of the tick to the log and the alerts.
    fn tell<'e>(&mut self, events: impl Iterator<Item = &'e Event>) {
        for e in events {
            log_event(e);
            let subject = self.event_subject(&e.about);
            self.reporter.remember_event(e);
            self.reporter.alerter.event(e, subject);
        }
    }

    /// The host's enforce lock, still this daemon's: taken anew if its file was removed, or, once
    /// another daemon holds it, this one observes from now on (as if reloaded to observe).
    fn keep_enforce_lock(&mut self) {
        let Some((said, observes)) = self.executor.keep_enforce_lock() else {
            return;
        };
        let severity = if observes {
            self.config.daemon.mode = crate::config::Mode::Observe;
            error!("{said}");
            Severity::Critical
        } else {
            warn!("{said}");
            Severity::Warning
        };
        self.reporter
            .lifecycle(EventKind::EnforceLockLost, severity, said);
    }

    /// The plan's actions through the executor; their outcomes move the policy's stages.
    fn act(&mut self, actions: Vec<Action>) {
        let mut outcomes = Vec::with_capacity(actions.len());
        for action in actions {
            let cgroup = own_cgroup(&self.sampler.snapshot, &action.target);
            let procs = &mut self.sampler.procs;
            let mut reread = |r: Resource| match r {
                Resource::Ram => procs.host_memory().available_bytes,
                Resource::Gpu(_) => None,
            };
            let outcome = self.executor.execute(
                self.config.daemon.mode,
                &action,
                cgroup.as_deref(),
                &mut reread,
            );
            self.record_action(&action, &outcome);
            outcomes.push(Executed { action, outcome });
        }
        self.state.apply(&outcomes);
    }

    /// The tick's view for the alert conditions, and the status and metrics when they are due
    /// (every `STATUS_REFRESH`, and on a tick that `decided` something: its sample is kept).
    fn report(&mut self, now: Instant, decided: bool) {
        let publish = decided || self.reporter.due(now);
        self.reporter.view = self.view(if publish {
            Detail::Full
        } else {
            Detail::Conditions
        });
        let r = &mut self.reporter;
        r.metrics
            .probes
            .ticked(now, self.config.daemon.interval, &r.view);
        // A model a user launched, over the budget it declared: its condition fires within
        // that user's share of the per-uid rate limit.
        let shared = &self.shared;
        r.alerter
            .conditions(now, alerts::conditions(&r.view), |uid, c| {
                shared.table().admit_event(uid, c.event, c.severity)
            });
        if publish {
            let decided_from = (
                &self.sampler.snapshot,
                &self.launches,
                &self.state.attribution,
            );
            r.publish(now, &self.shared, decided_from, decided);
        }
        r.check_recorder();
    }

    /// How long to sleep (the policy's interval, shorter while launches or permits are out),
    /// and the next process table and GPU sample asked for now: they arrive while the loop
    /// sleeps.
    fn schedule(
        &mut self,
        now: Instant,
        at: Duration,
        mut next: Duration,
        scan: bool,
        gpu_sample: Duration,
    ) -> Duration {
        let (launching, reserving) = {
            let table = self.shared.table();
            (table.launching(), table.busy())
        };
        if launching {
            // Admission and readiness are checked every tick: look often while launches wait.
            self.sampler.max_scan_age = self.sampler.max_scan_age.min(LAUNCH_TICK);
            next = next.min(LAUNCH_TICK);
        }
        if reserving {
            next = next.min(PERMIT_TICK);
        }
        self.sampler.reservations_busy = reserving;
        // Permits are admitted against each model's use beside the GPU's free memory: the GPU
        // process lists are read in the same pass while any reservation is out.
        let scan_request =
            self.sampler
                .schedule_scan(&self.config, &self.state, &self.launches, at);
        let scan_requested = scan_request.is_some();
        debug!(
            took_us = now.elapsed().as_micros() as u64,
            scan,
            scan_requested,
            gpu_sample_us = gpu_sample.as_micros() as u64,
            next_ms = next.as_millis() as u64,
            "tick"
        );
        // Last: the threads these wake may take the CPU from the loop for a while.
        if let Some(gpus) = &self.sampler.gpus {
            gpus.request(scan_requested || reserving);
        }
        if let Some(request) = scan_request {
            self.sampler.send_scan(request);
        }
        next
    }

    /// A reload, said to systemd (SIGHUP's, or `--watch-config`'s).
    fn reload_notified(&mut self) {
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Reloading]);
        self.reload();
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
    }

    fn reload(&mut self) {
        if let Some(w) = self.watch.as_mut() {
            w.loading(&self.config_path);
        }
        let loaded = Config::load(&self.config_path).and_then(|mut c| {
            self.overrides.apply(&mut c);
            self.vet_reload(c)
        });
        let config = match loaded {
            Ok(config) => config,
            Err(e) => return self.reload_failed(e.to_string()),
        };
        if config.launch.socket != self.config.launch.socket {
            warn!("launch.socket changes only at restart");
        }
        if config.metrics.listen != self.config.metrics.listen {
            warn!("metrics.listen changes only at restart");
        }
        // To enforce, the host's enforce lock first: refused while another daemon holds it.
        let (old_mode, mode) = (self.config.daemon.mode, config.daemon.mode);
        match self.executor.set_mode(mode) {
            Ok(leftovers) => {
                leftovers.log();
                faults::announce_leftovers(&mut self.reporter.alerter, &leftovers);
            }
            Err(e) => return self.reload_failed(format!("daemon.mode '{mode}': {e}")),
        }
        if let Err(e) = self.reporter.alerter.configure(&config) {
            if let Err(back) = self.executor.set_mode(old_mode) {
                error!("daemon.mode stays {mode}: {back}");
            }
            return self.reload_failed(format!("{e:#}"));
        }
        self.shared.table().reconfigure(&config);
        self.config = config;
        self.state.config_changed();
        // Rescan at once so new matchers and budgets apply now.
        self.sampler.scans.want_full();
        info!("config {} reloaded", self.config_path.display());
        self.warn_about_rules();
    }

    /// A reload that failed: said, and the running config kept.
    fn reload_failed(&mut self, why: String) {
        let message = format!("config reload failed, keeping the previous config: {why}");
        error!("{message}");
        self.reporter
            .lifecycle(EventKind::ConfigReloadFailed, Severity::Warning, message);
    }

    /// What the rules catch that they probably should not (`policy::rules::survey`), on the
    /// latest table: at start the first full scan, made before the loop runs
    /// (`Scans::new`); after a reload, the table the old config was applied to.
    fn warn_about_rules(&self) {
        let s = &self.sampler.snapshot;
        for warning in crate::policy::rules::survey(&self.config, &s.processes, s.self_pid).warnings
        {
            warn!("config {}: {warning}", self.config_path.display());
        }
    }

    fn log_start(&mut self) {
        let c = &self.config;
        let total = self
            .sampler
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
            "gpuguard {} started: mode {}, RAM warn_available {}, min_available {}, action {}; {} model(s); GPU: {}",
            env!("CARGO_PKG_VERSION"),
            c.daemon.mode,
            show(c.ram.warn_available),
            show(c.ram.min_available),
            c.ram.action,
            c.models.len(),
            if c.gpu.enabled { "NVML starting" } else { "disabled" },
        );
        info!("{message}");
        self.reporter
            .lifecycle(EventKind::DaemonStarted, Severity::Info, message);
    }
}

/// When to tick after a wake-up that came at `now`: at once, but never sooner than
/// `MIN_WAKE_GAP` after the last tick, and never later than the tick already due.
fn woken(next_tick: Instant, last_tick: Instant, now: Instant) -> Instant {
    next_tick.min(now.max(last_tick + MIN_WAKE_GAP))
}

/// All threads allocate from one malloc arena: glibc gives each thread that allocates an arena of
/// its own (and its slack), a few hundred KiB of resident memory for a daemon that allocates
/// little. Called before any thread starts.
fn one_malloc_arena() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt takes two integers and changes only the allocator's settings.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
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

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn log_event(e: &Event) {
    match e.severity {
        Severity::Critical => error!(event = e.kind.as_str(), "{}", e.message),
        Severity::Warning => warn!(event = e.kind.as_str(), "{}", e.message),
        Severity::Info => info!(event = e.kind.as_str(), "{}", e.message),
    }
}
