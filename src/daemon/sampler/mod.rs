//! The loop's sampling part: what it knows of the host, and how it learns it. It owns the
//! sources it reads (the /proc source, the process scans of `scanning.rs`, the NVML worker), the
//! snapshot it builds from them each tick, and what it remembers about them (the GPUs' status,
//! GPUs lost, pids NVML lists that /proc does not know). The rest of the loop reads the snapshot
//! and tells it what to read next (`max_scan_age`, `watch`).

use std::collections::{BTreeSet, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::warn;

use crate::config::Config;
use crate::kinds::EventKind;
use crate::policy::{About, Event, Resource, Severity};
use crate::sample::nvml::GpuMonitor;
use crate::sample::ProcSource;
use crate::snapshot::{GpuStatus, ProcessId, Snapshot};

pub(super) mod scanning;

use self::scanning::Scans;
use crate::daemon::DaemonEvent;

pub(super) struct Sampler {
    /// Host memory every tick, and the loop's own reads of single processes.
    pub procs: Box<dyn ProcSource>,
    pub scans: Scans,
    pub gpus: Option<GpuMonitor>,
    /// What the latest tick sampled (everything else reads it).
    pub snapshot: Snapshot,
    pub gpu_status: GpuStatus,
    /// NVML has worked at least once: losing it now is an alert, not a host without GPUs.
    pub gpu_seen_ok: bool,
    /// GPUs reported lost (GPU_IS_LOST, or gone from NVML's list), said once each.
    pub lost_gpus: BTreeSet<u32>,
    unknown_gpu_pids: HashSet<i32>,
    /// Set while a request waits for a GPU reading newer than itself: the NVML worker then
    /// wakes the loop when its next sample is in.
    fresh_gpu_wanted: Arc<AtomicBool>,
    /// From the last plan: how fresh the process table must be, and which pids to re-read.
    pub max_scan_age: Duration,
    pub watch: Vec<ProcessId>,
    /// Reservations were out at the last tick (GPU process lists are then read every tick).
    pub reservations_busy: bool,
    /// GCE's maintenance and preemption notices (`[gce] watch`), if watched.
    pub gce: Option<crate::sample::gce::GceWatcher>,
}

impl Sampler {
    /// `wake` is told when a GPU reading asked for with `want_fresh_gpu` is in.
    pub(super) fn new(
        procs: Box<dyn ProcSource>,
        scans: Scans,
        gpus: Option<GpuMonitor>,
        mut snapshot: Snapshot,
        wake: Sender<DaemonEvent>,
    ) -> Sampler {
        // No NVML at all (`[gpu] enabled = false`): no GPU reading will ever come.
        snapshot.gpus.absent = gpus.is_none();
        let fresh_gpu_wanted = Arc::new(AtomicBool::new(false));
        if let Some(gpus) = &gpus {
            let wanted = fresh_gpu_wanted.clone();
            gpus.after_each_sample(Box::new(move || {
                if wanted.swap(false, Ordering::AcqRel) {
                    let _ = wake.send(DaemonEvent::Wake);
                }
            }));
        }
        Sampler {
            procs,
            scans,
            gpus,
            snapshot,
            gpu_status: GpuStatus::Off,
            gpu_seen_ok: false,
            lost_gpus: BTreeSet::new(),
            unknown_gpu_pids: HashSet::new(),
            fresh_gpu_wanted,
            max_scan_age: Duration::ZERO,
            watch: Vec::new(),
            reservations_busy: false,
            gce: None,
        }
    }

    /// Host memory, the process table (a round the scan thread finished, the victims waited
    /// on, PSS and tmpfs owners near the RAM floor) and the GPUs (with their Xid events) into
    /// the snapshot. Returns whether a scan was merged, the events sampling raised, and how
    /// long NVML took.
    pub(super) fn sample(
        &mut self,
        config: &Config,
        now: Instant,
        at: Duration,
        since_last: Duration,
    ) -> (bool, Vec<Event>, Duration) {
        self.snapshot.at = at;
        self.snapshot.host = self.procs.host_memory();
        let scan = self.merge_scan();
        self.reread_watched();
        self.read_tmpfs_owners_near_floor(config, scan);
        let mut events = Vec::new();
        let mut gpu_sample = Duration::ZERO;
        if let Some(gpus) = &self.gpus {
            let (gpu_snapshot, xids, took) = gpus.snapshot(now, at, since_last);
            gpu_sample = took;
            self.snapshot.gpus = gpu_snapshot;
            for x in xids {
                let gpu = x
                    .gpu
                    .map_or("unknown GPU".to_string(), |g| format!("GPU {g}"));
                let (severity, kind) = if x.critical() {
                    (Severity::Critical, EventKind::XidCritical)
                } else {
                    (Severity::Warning, EventKind::Xid)
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
        self.note_gpu_status(config, &mut events);
        self.note_lost_gpus(&mut events);
        (scan, events, gpu_sample)
    }

    /// A request waits for a GPU reading newer than itself: have one taken now, and the loop
    /// woken when it is in.
    pub(super) fn want_fresh_gpu(&self) {
        if let Some(gpus) = &self.gpus {
            self.fresh_gpu_wanted.store(true, Ordering::Release);
            gpus.request(true);
        }
    }

    fn note_gpu_status(&mut self, config: &Config, events: &mut Vec<Event>) {
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
                EventKind::GpuOk,
                format!(
                    "GPU protection on: {} GPU(s) seen through NVML",
                    self.snapshot.gpus.devices.len()
                ),
            ),
            GpuStatus::Unavailable(why) => Event::new(
                Severity::Warning,
                EventKind::GpuUnavailable,
                format!(
                    "GPU protection is off: {why}; guarding host RAM only, retrying NVML every {}",
                    crate::units::fmt_duration(config.gpu.retry_init)
                ),
            ),
            GpuStatus::Off => Event::new(
                Severity::Info,
                EventKind::GpuOff,
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
                // The table is in pid order.
                let known = table.processes.binary_search_by_key(pid, |p| p.pid).is_ok();
                if !known && self.unknown_gpu_pids.insert(*pid) {
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
}
