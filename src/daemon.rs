//! The daemon loop: sample -> evaluate -> execute -> log, at an adaptive interval, with SIGHUP
//! reload and SIGTERM/SIGINT shutdown that resumes every process gpuguard holds stopped.

use std::collections::HashSet;
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
use crate::config::Config;
use crate::policy::{evaluate, Event, PolicyState, Resource, Severity, Target};
use crate::sample::nvml::{GpuMonitor, NvmlGpuSource};
use crate::sample::{ProcSource, ProcfsSource};
use crate::snapshot::{GpuStatus, Snapshot};

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
}

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
        })
    }

    /// Runs until SIGTERM or SIGINT.
    pub fn run(mut self) -> anyhow::Result<()> {
        let (tx, signals_rx) = channel();
        let mut signals = signal_hook::iterator::Signals::new([SIGHUP, SIGTERM, SIGINT])
            .context("installing signal handlers")?;
        let signal_thread = signals.handle();
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                for signal in signals.forever() {
                    if tx.send(signal).is_err() {
                        break;
                    }
                }
            })?;
        if let Err(e) = self_test() {
            warn!("{e}");
        }
        self.log_start();

        let mut wait = Duration::ZERO;
        let mut max_scan_age = Duration::ZERO;
        let mut watch = Vec::new();
        loop {
            let plan = self.tick(wait, max_scan_age, &watch);
            wait = plan.0;
            max_scan_age = plan.1;
            watch = plan.2;
            match signals_rx.recv_timeout(wait) {
                Ok(SIGHUP) => self.reload(),
                Ok(signal) => {
                    let name =
                        nix::sys::signal::Signal::try_from(signal).map_or("signal", |s| s.as_str());
                    info!("{name}: resuming held processes and stopping");
                    break;
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        self.executor.shutdown();
        signal_thread.close();
        info!("gpuguard stopped");
        Ok(())
    }

    /// One pass of the pipeline. Returns (sleep, max process-scan age, pids to watch).
    fn tick(
        &mut self,
        since_last: Duration,
        max_scan_age: Duration,
        watch: &[crate::snapshot::ProcessId],
    ) -> (Duration, Duration, Vec<crate::snapshot::ProcessId>) {
        let now = Instant::now();
        let at = now.duration_since(self.started);
        self.snapshot.at = at;
        self.snapshot.host = self.procs.host_memory();

        let table = &mut self.snapshot.processes;
        let scan = table
            .scanned_at
            .is_none_or(|t| at.saturating_sub(t) >= max_scan_age);
        if scan {
            table.processes = self.procs.scan();
            table.scanned_at = Some(at);
        } else {
            // Re-read only the victims we wait on.
            for id in watch {
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

        let plan = evaluate(&self.config, &self.snapshot, &mut self.state);
        for e in events.iter().chain(&plan.events) {
            log_event(e);
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
        }
        debug!(
            took_us = now.elapsed().as_micros() as u64,
            scan,
            gpu_sample_us = gpu_sample.as_micros() as u64,
            next_ms = plan.next_interval.as_millis() as u64,
            "tick"
        );
        (plan.next_interval, plan.max_scan_age, plan.watch)
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
                if config.daemon.state_dir != self.config.daemon.state_dir {
                    warn!("daemon.state_dir changes only at restart");
                }
                self.config = config;
                self.state.config_changed();
                // Rescan at once so new matchers and budgets apply now.
                self.snapshot.processes.scanned_at = None;
                info!("config {} reloaded", self.config_path.display());
            }
            Err(e) => error!("config reload failed, keeping the previous config: {e}"),
        }
    }

    fn log_start(&self) {
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
        info!(
            "gpuguard {} started: mode {:?}, RAM warn_available {}, min_available {}, action {:?}; {} model(s); GPU: {}",
            env!("CARGO_PKG_VERSION"),
            c.daemon.mode,
            show(c.ram.warn_available),
            show(c.ram.min_available),
            c.ram.action,
            c.models.len(),
            if c.gpu.enabled { "NVML starting" } else { "disabled" },
        );
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

fn log_event(e: &Event) {
    match e.severity {
        Severity::Critical => error!(event = e.kind, "{}", e.message),
        Severity::Warning => warn!(event = e.kind, "{}", e.message),
        Severity::Info => info!(event = e.kind, "{}", e.message),
    }
}
