//! When the loop asks for a process scan, and what it does with the answer. The scan runs on
//! its own thread (`sample::scan`); the loop only sends a request, and merges the table that comes
//! back at its next tick (at once when the policy is waiting for it), so no tick ever waits on
//! /proc, however many processes there are or however fast they come and go.
//!
//! Which processes a round re-reads: the members of every model, the victims watched, launched
//! processes (every round); near a RAM floor the largest processes; and all of them (a *full*
//! round) when a floor has been crossed with no victim chosen yet, or near a floor once
//! MemAvailable has moved by `FULL_SCAN_DRIFT_BYTES` or `FULL_SCAN_MAX_AGE` has passed since the
//! last full round. A process that is not re-read cannot have grown by more than MemAvailable
//! fell meanwhile, so the largest ones are known within that margin; for the same reason, while
//! only the RAM floor asks for fresh tables, a round is skipped altogether as long as
//! MemAvailable stays within `FULL_SCAN_DRIFT_BYTES` of the last one (memory held near a floor
//! costs next to nothing).

use std::path::Path;
use std::sync::mpsc::Sender;
use std::time::Duration;

use tracing::{debug, error, info, warn};

use crate::policy::{Level, Resource};
use crate::sample::proc_events::ProcEvents;
use crate::sample::procfs::{ProcReader, ReadError};
use crate::sample::scan::{
    apply, ScanRequest, ScanResult, ScanThread, Scanner, ROTATION_SCANS, YOUNG,
};
use crate::sample::TableSource;
use crate::snapshot::Process;

use crate::config::Config;
use crate::policy::{Launches, PolicyState};

use super::Sampler;
use crate::daemon::DaemonEvent;

/// Near a floor, a full round once MemAvailable has moved by this much since the last one...
const FULL_SCAN_DRIFT_BYTES: u64 = 64 << 20;
/// ...or this long after it.
const FULL_SCAN_MAX_AGE: Duration = Duration::from_secs(2);
/// A policy that keeps asking for a fresh table (a floor crossed and no victim found) gets a full
/// round at most this often.
const FORCED_FULL_SCAN_EVERY: Duration = Duration::from_millis(100);
/// Processes holding less than this are not worth a PSS read (the kernel walks their page tables).
const PSS_MIN_RSS: u64 = 32 << 20;

/// Makes a process-table source: the first at start, another if the scan thread dies.
pub type MakeTables = Box<dyn Fn() -> Box<dyn TableSource> + Send>;

/// Scanners of the real /proc, told about execs and uid changes by the kernel where it will
/// (`sample::proc_events`: root with CAP_NET_ADMIN on the host); another root (a test fixture)
/// gets none.
pub(in crate::daemon) fn real_tables(proc_root: &Path, cgroup_root: &Path) -> MakeTables {
    let root = proc_root.to_path_buf();
    let cgroup_root = cgroup_root.to_path_buf();
    Box::new(move || {
        let events = if root == Path::new("/proc") {
            match ProcEvents::open() {
                Ok(events) => {
                    info!(
                        filtered = events.filtered(),
                        "process events on: an exec or a uid change is seen at the next scan"
                    );
                    Some(events)
                }
                Err(e) => {
                    info!(
                        "process events off ({e}): an exec or a uid change of a process older \
                         than {} s is seen when the scan rotation reaches it",
                        YOUNG.as_secs()
                    );
                    None
                }
            }
        } else {
            None
        };
        Box::new(Scanner::with_events(ProcReader::new(&root), events).with_cgroups(&cgroup_root))
    })
}

/// The scan thread and what the loop knows about it.
pub(in crate::daemon) struct Scans {
    make: MakeTables,
    /// Rounds run on the loop's own thread, at the start of the tick after the one that asked, as
    /// if the thread had answered meanwhile (in-process tests).
    inline: bool,
    /// Inline: the round asked for, run when the next tick merges.
    pending: Option<ScanRequest>,
    /// Before `run` starts the thread (or always, inline), the source that made the first table.
    idle: Option<Box<dyn TableSource>>,
    thread: Option<ScanThread>,
    events: Option<Sender<DaemonEvent>>,
    in_flight: bool,
    /// A round that arrived between ticks.
    ready: Option<ScanResult>,
    /// When the last round and the last full round were asked for, and MemAvailable then.
    last_round: Option<(Duration, Option<u64>)>,
    last_full: Option<(Duration, Option<u64>)>,
    /// The current table came from a full round.
    table_full: bool,
    /// A full round is wanted at the next tick (after a reload).
    want_full: bool,
    /// The last round asked was asked for PSS (near the RAM floor, or a model's RSS over its
    /// RAM budget).
    pss_asked: bool,
}

impl Scans {
    /// Makes the first table here and now (before the loop runs, so the first tick has one).
    pub(in crate::daemon) fn new(make: MakeTables, inline: bool) -> (Scans, Vec<Process>) {
        let mut source = make();
        let mut first = source.round(ScanRequest {
            full: true,
            host_has_swap: true,
            rotation_period: Duration::from_secs(60),
            ..ScanRequest::default()
        });
        let mut table = Vec::new();
        apply(&mut table, &mut first);
        let scans = Scans {
            make,
            inline,
            pending: None,
            idle: Some(source),
            thread: None,
            events: None,
            in_flight: false,
            ready: None,
            last_round: None,
            last_full: None,
            table_full: true,
            want_full: false,
            pss_asked: false,
        };
        (scans, table)
    }

    /// Starts the scan thread; its tables come back as `DaemonEvent::Scan`. Inline: nothing to
    /// start.
    pub(in crate::daemon) fn start(&mut self, events: Sender<DaemonEvent>) -> std::io::Result<()> {
        if self.inline {
            return Ok(());
        }
        let source = self.idle.take().unwrap_or_else(|| (self.make)());
        let tx = events.clone();
        self.thread = Some(ScanThread::spawn(source, move |result| {
            tx.send(DaemonEvent::Scan(Box::new(result))).is_ok()
        })?);
        self.events = Some(events);
        self.in_flight = false;
        Ok(())
    }

    /// A table arrived.
    pub(in crate::daemon) fn arrived(&mut self, result: ScanResult) {
        self.in_flight = false;
        self.ready = Some(result);
    }

    pub(in crate::daemon) fn want_full(&mut self) {
        self.want_full = true;
    }

    /// A round can be asked for: the thread runs (or rounds run inline).
    fn running(&self) -> bool {
        self.thread.is_some() || (self.inline && self.idle.is_some())
    }

    /// The scan thread died (a panic): say so, and start a new one.
    fn restart_if_dead(&mut self) {
        if !self.thread.as_ref().is_some_and(ScanThread::is_finished) {
            return;
        }
        error!("the process scan thread stopped; starting a new one");
        self.thread = None;
        if let Some(events) = self.events.take() {
            if let Err(e) = self.start(events) {
                error!("cannot start the process scan thread: {e}");
            }
        }
    }
}

impl Sampler {
    /// Merges a round that arrived into the table; true if there was one.
    pub(in crate::daemon) fn merge_scan(&mut self) -> bool {
        if let (Some(request), Some(source)) = (self.scans.pending.take(), &mut self.scans.idle) {
            self.scans.ready = Some(source.round(request));
            self.scans.in_flight = false;
        }
        let Some(mut result) = self.scans.ready.take() else {
            return false;
        };
        let s = &result.stats;
        if let Some(e) = s.list_error {
            warn!("cannot list the processes in /proc: {e}; keeping the previous process table");
        }
        debug!(
            took_us = s.took.as_micros() as u64,
            listed = s.listed,
            new = s.new,
            refreshed = s.refreshed,
            execs = s.execs,
            events = s.events,
            event_pids = s.event_pids,
            events_lost = s.events_lost,
            unreadable = s.unreadable,
            full = result.full,
            "scan"
        );
        let table = &mut self.snapshot.processes;
        table.pss_read = result.pss.is_some();
        apply(&mut table.processes, &mut result);
        table.scanned_at = Some(result.at);
        if let Some(weights) = result.mapped_weights {
            self.snapshot.mapped_weights = weights;
        }
        self.scans.table_full = result.full;
        true
    }

    /// Re-reads the victims the policy waits on. Gone (or the pid reused): marked dead, so the
    /// policy sees it exited before the next scan drops it. Unreadable: left as is,
    /// never taken for gone.
    pub(in crate::daemon) fn reread_watched(&mut self) {
        for id in &self.watch {
            let table = &mut self.snapshot.processes.processes;
            let Some(p) = table.iter_mut().find(|p| p.id() == *id) else {
                continue;
            };
            match self.procs.vitals(id.pid) {
                Ok(v) if v.id == *id => {
                    p.state = v.state;
                    p.ppid = v.ppid;
                    p.rss_bytes = v.rss_bytes;
                    p.swap_bytes = v.swap_bytes;
                }
                // Gone, or the pid belongs to another process now.
                Ok(_) | Err(ReadError::Gone) => {
                    p.state = 'X';
                    p.rss_bytes = 0;
                }
                Err(_) => {}
            }
        }
    }

    /// MemAvailable is below its warn floor (act floor if no warn) in this tick's reading:
    /// near enough to the RAM floor that victims are ranked by what killing them would free.
    fn near_ram_floor(&self, config: &Config) -> bool {
        let host = &self.snapshot.host;
        let (warn, min) = config.ram.floor_bytes(host.total_bytes);
        matches!(
            (host.available_bytes, warn.or(min)),
            (Some(available), Some(floor)) if available < floor
        )
    }

    /// Near the RAM floor: who owns the tmpfs files (once per scan round: a walk of /dev/shm
    /// and /run/user), so memory no process holds is charged to its owner. The processes' PSS
    /// is read by the scan (`ScanRequest::pss_min_rss`), off the loop.
    pub(in crate::daemon) fn read_tmpfs_owners_near_floor(
        &mut self,
        config: &Config,
        scanned: bool,
    ) {
        if !self.near_ram_floor(config) {
            self.snapshot.tmpfs_owners.clear();
        } else if scanned || self.snapshot.tmpfs_owners.is_empty() {
            self.snapshot.tmpfs_owners = self.procs.tmpfs_owners();
        }
    }

    /// At the end of a tick: the round to ask for, if the table is older than the policy wants
    /// and none is under way (`send_scan` sends it, as the tick's very last step: the scan
    /// thread it wakes may take the CPU from the loop).
    pub(in crate::daemon) fn schedule_scan(
        &mut self,
        config: &Config,
        state: &PolicyState,
        launches: &Launches,
        at: Duration,
    ) -> Option<ScanRequest> {
        self.scans.restart_if_dead();
        if self.scans.in_flight || self.scans.ready.is_some() || !self.scans.running() {
            return None;
        }
        let age = self
            .snapshot
            .processes
            .scanned_at
            .map_or(Duration::MAX, |t| at.saturating_sub(t));
        // A policy that wants a fresh table now gets one full round; then one per
        // FORCED_FULL_SCAN_EVERY while it keeps asking.
        let forced = self.max_scan_age.is_zero();
        let min_age = if forced && self.scans.table_full {
            FORCED_FULL_SCAN_EVERY
        } else {
            self.max_scan_age
        };
        let near = |r: &Resource| matches!(state.levels.get(r), Some(Level::Warn | Level::Act));
        let ram_near = near(&Resource::Ram);
        // PSS decides near the RAM floor (the ranking) and for a model whose RSS is over its
        // RAM budget (its budget). Just come to want it: a round at once (read by the scan,
        // off the loop; until it lands, processes are ranked by RSS and the budget waits).
        let pss = ram_near || state.budgets.values().any(|b| b.wants_pss);
        let pss_wanted = pss && !self.scans.pss_asked;
        if !pss {
            // Come to want it again later: a round at once then too.
            self.scans.pss_asked = false;
        }
        if age < min_age && !self.scans.want_full && !pss_wanted {
            return None;
        }
        let available = self.snapshot.host.available_bytes;
        let drifted = |(t, then): (Duration, Option<u64>)| {
            at.saturating_sub(t) >= FULL_SCAN_MAX_AGE
                || match (then, available) {
                    (Some(a), Some(b)) => a.abs_diff(b) >= FULL_SCAN_DRIFT_BYTES,
                    _ => true,
                }
        };
        // Only the RAM floor wants fresh tables (no GPU floor near, no budget over, no launch):
        // nothing can have changed enough to matter while MemAvailable stays where it was.
        let ram_only = ram_near
            && !state
                .levels
                .keys()
                .any(|r| matches!(r, Resource::Gpu(_)) && near(r))
            && !state.budgets.values().any(|b| b.over_since.is_some())
            && !self.reservations_busy;
        let quiet =
            !forced && !self.scans.want_full && self.scans.last_round.is_some_and(|r| !drifted(r));
        if ram_only && quiet && !pss_wanted {
            return None;
        }
        let full = self.scans.want_full
            || forced
            || ram_only
            || (ram_near && self.scans.last_full.is_none_or(drifted));
        let request = ScanRequest {
            at,
            full,
            largest: ram_near,
            hot: self.hot_pids(state, launches),
            host_has_swap: self.procs.host_has_swap(),
            rotation_period: config.daemon.scan_interval * ROTATION_SCANS,
            young: YOUNG,
            maps: self.gpus.as_ref().map(|_| self.gpu_holders()),
            pss_min_rss: pss.then_some(PSS_MIN_RSS),
        };
        self.scans.last_round = Some((at, available));
        self.scans.pss_asked = pss;
        if full {
            self.scans.last_full = Some((at, available));
            self.scans.want_full = false;
        }
        Some(request)
    }

    /// Hands a round to the scan thread (inline: keeps it for the next tick to run).
    pub(in crate::daemon) fn send_scan(&mut self, request: ScanRequest) {
        if self.scans.inline {
            self.scans.pending = Some(request);
            self.scans.in_flight = true;
            return;
        }
        self.scans.in_flight = self
            .scans
            .thread
            .as_ref()
            .is_some_and(|t| t.request(request));
    }

    /// Processes NVML lists with GPU memory (their mapped weights files are read with the scan).
    fn gpu_holders(&self) -> Vec<i32> {
        let mut pids: Vec<i32> = self
            .snapshot
            .gpus
            .devices
            .iter()
            .flat_map(|g| g.processes.iter())
            .filter(|(_, used)| used.is_some_and(|b| b > 0))
            .map(|(&pid, _)| pid)
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Members of every model, the victims watched, launched processes.
    fn hot_pids(&self, state: &PolicyState, launches: &Launches) -> Vec<i32> {
        let mut hot: Vec<i32> = self.watch.iter().map(|id| id.pid).collect();
        for model in &state.attribution.models {
            hot.extend(model.members.iter().map(|id| id.pid));
        }
        hot.extend(launches.registered.keys().map(|id| id.pid));
        hot.sort_unstable();
        hot.dedup();
        hot
    }
}
