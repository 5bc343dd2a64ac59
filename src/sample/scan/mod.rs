//! The process table, kept current incrementally on a thread of its own, so the control loop
//! never waits on /proc and a scan's cost does not grow with idle processes.
//!
//! Each round lists /proc (one `getdents` pass) and then reads only what can have changed:
//! - a new pid: everything (stat, status, command line, cgroup);
//! - the *hot* pids the loop names (members of models, victims, launches): stat and status;
//! - processes holding GPU memory: stat (and their mapped weights files when their RSS moved),
//!   every round while their RSS moves (loading), then less often, down to every 8th round;
//! - near a floor, the `LARGEST` processes by last known RSS: stat;
//! - the processes the kernel said `exec`ed, changed uid/gid or renamed themselves since the last
//!   round (`proc_events`: the proc connector, when the daemon may listen to it): stat, status,
//!   and after an exec the command line and cgroup, whatever the layout says;
//! - without those events, processes started less than `young` ago (`YOUNG`, 60 s): stat and
//!   status (a launcher script `exec`s the server it starts within seconds; its new name and
//!   command line must reach the matchers at once);
//! - a *full* round: the stat of every process (near a floor, when MemAvailable has moved);
//! - and a rotating share of the rest, so every process is re-read in full at least once per
//!   `rotation_period` (by default 24 scan intervals, 2 min; `EVENTS_ROTATION_FACTOR` times that
//!   while events arrive, since then the rotation only refreshes memory figures).
//!
//! Every stat read checks for `exec` (a new name or a new address-space layout, see
//! `ExecMark`) and then reads the command line, cgroup and uid again; a status read refreshes the
//! real uid (a `setresuid` changes nothing else /proc shows). A pid whose start time changed is a
//! new process. A read that fails for any reason other than the process being gone keeps what
//! was known.
//!
//! The scanner keeps only what it needs to notice changes (start time, hashes of the layout and
//! the name, last RSS); a round returns the new processes and the *changes*, which `apply` merges
//! into the loop's table, so there is one copy of the table, the loop's.

use std::collections::hash_map::RandomState;
use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::snapshot::{MappedFile, Process, ProcessId};

use super::cgroup::Cgroups;
use super::proc_events::ProcEvents;
use super::procfs::{ProcReader, ReadError};
use pss::PssRead;

mod pss;

/// Processes started this recently have their stat re-read every round (exec, setuid...).
pub const YOUNG: Duration = Duration::from_secs(60);
/// Near a floor, this many of the largest processes are re-read every round.
pub const LARGEST: usize = 32;
/// Every process is re-read in full at least once per this many scan intervals.
pub const ROTATION_SCANS: u32 = 24;
/// On smaller hosts the rotation still re-reads this many processes per scan interval.
pub const ROTATION_MIN_PER_SCAN: usize = 32;
/// While the kernel reports execs and uid changes, the rotation (which then only refreshes memory
/// figures of idle processes) is this many times slower.
pub const EVENTS_ROTATION_FACTOR: u32 = 5;
/// The scan thread's nice value: it is background work, and must not preempt the control loop
/// it has just been woken by.
const SCAN_NICE: i32 = 5;

/// What the loop asks of one round.
#[derive(Debug, Default)]
pub struct ScanRequest {
    /// The loop's clock when it asked; the result carries it back as its `scanned_at`.
    pub at: Duration,
    /// Re-read the stat of every process.
    pub full: bool,
    /// Re-read the `LARGEST` processes by last known RSS.
    pub largest: bool,
    /// Pids to re-read this round (stat and status).
    pub hot: Vec<i32>,
    /// VmSwap is worth reading (the host has swap).
    pub host_has_swap: bool,
    /// Every process is re-read in full at least this often.
    pub rotation_period: Duration,
    /// Processes started less than this ago are re-read (stat and status) every round.
    pub young: Duration,
    /// Processes holding GPU memory, whose mapped weights files to read (`None`: GPUs off).
    pub maps: Option<Vec<i32>>,
    /// Near the RAM floor: read the proportional set size (PSS) of the processes holding at
    /// least this much RSS (`None`: away from it, nothing is read).
    pub pss_min_rss: Option<u64>,
}

/// What one round found: what changed since the previous round.
#[derive(Debug, Default)]
pub struct ScanResult {
    pub at: Duration,
    pub full: bool,
    /// Every pid still there, in order (`None` if /proc could not be listed): any other pid in
    /// the table has exited.
    pub live: Option<Vec<i32>>,
    /// Processes not seen before (or pids now used by another process), read in full.
    pub new: Vec<Process>,
    /// Known processes read again.
    pub updates: Vec<Update>,
    /// The weights files mapped by the processes in the request's `maps`.
    pub mapped_weights: Option<BTreeMap<i32, Vec<MappedFile>>>,
    /// With the request's `pss_min_rss`: the PSS of each process that holds that much, as far
    /// as it could be read (`None`: not asked; the table keeps no PSS).
    pub pss: Option<Vec<(ProcessId, u64)>>,
    pub stats: ScanStats,
}

/// What a re-read found (`None`: not read this time, unchanged as far as is known).
#[derive(Clone, Debug, PartialEq)]
pub struct Update {
    pub id: ProcessId,
    pub state: char,
    pub ppid: i32,
    pub rss_bytes: u64,
    pub swap_bytes: Option<Option<u64>>,
    pub uid: Option<u32>,
    /// After an exec (or a new name): the name, command line and cgroup.
    pub exec: Option<Exec>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Exec {
    pub comm: String,
    pub cmdline: String,
    pub cgroup: String,
}

/// What one round cost, for the debug log and the benchmarks.
#[derive(Clone, Copy, Debug, Default)]
pub struct ScanStats {
    pub listed: usize,
    /// New pids read in full.
    pub new: usize,
    /// Known pids whose stat was read again.
    pub refreshed: usize,
    /// Of those, how many had exec'd (or changed their name).
    pub execs: usize,
    /// Reads that failed for a reason other than the process being gone (nothing was changed).
    pub unreadable: usize,
    /// /proc itself could not be listed: the table is the previous one.
    pub list_error: Option<ReadError>,
    /// Process events are live (`proc_events`).
    pub events: bool,
    /// Processes the events named this round.
    pub event_pids: usize,
    /// Events were lost: every process was re-read.
    pub events_lost: bool,
    pub took: Duration,
}

/// Merges a round into a table kept in pid order, in place (the new processes are moved in, not
/// copied; the first table is the first round's `new`).
pub fn apply(table: &mut Vec<Process>, result: &mut ScanResult) {
    if let Some(live) = &result.live {
        table.retain(|p| live.binary_search(&p.pid).is_ok());
    }
    for u in result.updates.drain(..) {
        if let Ok(i) = table.binary_search_by_key(&u.id.pid, |t| t.pid) {
            if table[i].id() == u.id {
                update(&mut table[i], u);
            }
        }
    }
    if table.is_empty() {
        *table = std::mem::take(&mut result.new);
        table.sort_unstable_by_key(|p| p.pid);
    } else {
        let sorted = table.len();
        table.reserve(result.new.len());
        for p in result.new.drain(..) {
            match table[..sorted].binary_search_by_key(&p.pid, |t| t.pid) {
                Ok(i) => table[i] = p,
                Err(_) => table.push(p),
            }
        }
        if table.len() > sorted {
            table.sort_unstable_by_key(|p| p.pid);
        }
    }
    for p in table.iter_mut() {
        p.pss_bytes = None;
    }
    for (id, pss) in result.pss.take().into_iter().flatten() {
        if let Ok(i) = table.binary_search_by_key(&id.pid, |t| t.pid) {
            if table[i].id() == id {
                table[i].pss_bytes = Some(pss);
            }
        }
    }
}

fn update(p: &mut Process, u: Update) {
    p.state = u.state;
    p.ppid = u.ppid;
    p.rss_bytes = u.rss_bytes;
    if let Some(swap) = u.swap_bytes {
        p.swap_bytes = swap;
    }
    if let Some(uid) = u.uid {
        p.uid = uid;
    }
    if let Some(exec) = u.exec {
        p.comm = exec.comm;
        p.cmdline = exec.cmdline;
        p.cgroup = exec.cgroup;
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Depth {
    /// stat (and VmSwap where there is swap).
    Vitals,
    /// stat and status (the real uid).
    Attributes,
    /// stat, status, command line and cgroup: the kernel said it `exec`ed.
    Exec,
}

/// What the scanner remembers of a process: enough to notice a change.
struct Entry {
    start_time: u64,
    /// Hashes of the address-space layout (`ExecMark`) and of the name.
    exec: u64,
    comm: u64,
    rss_bytes: u64,
    kernel_thread: bool,
    /// The round that last read it.
    round: u64,
    /// When it was first seen, and how old it was then (from its start time and the host's
    /// uptime; 0 where the uptime is not known): young processes are read every round.
    seen: Instant,
    age_when_seen: Duration,
    /// As a GPU holder, re-read every this many rounds (1 while its RSS moves).
    holder_backoff: u8,
    /// Its PSS as last read near the RAM floor, with its RSS then and when.
    pss: Option<PssRead>,
}

impl Entry {
    fn age(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.seen) + self.age_when_seen
    }
}

/// A GPU holder's mapped weights files, and when they were read.
struct MapsRead {
    start_time: u64,
    rss_bytes: u64,
    at: Instant,
    files: Vec<MappedFile>,
}

/// A GPU holder whose RSS moved less than this since its last read is settling: it is read
/// half as often as before, down to once every `HOLDER_MAX_BACKOFF` rounds.
const HOLDER_SETTLED_BYTES: u64 = 16 << 20;
const HOLDER_MAX_BACKOFF: u8 = 8;

/// A GPU holder's maps are read again once its RSS has moved by this much.
const MAPS_RSS_DRIFT_BYTES: u64 = 64 << 20;
/// The incremental process table.
pub struct Scanner {
    reader: ProcReader,
    /// The kernel's exec/uid/comm events (`None`: not available; the rotation and the young
    /// re-reads find changes instead).
    events: Option<ProcEvents>,
    entries: BTreeMap<i32, Entry>,
    maps: BTreeMap<i32, MapsRead>,
    hasher: RandomState,
    pids: Vec<i32>,
    todo: Vec<(i32, Depth)>,
    new: Vec<Process>,
    updates: Vec<Update>,
    /// The rotation goes on after this pid.
    cursor: i32,
    /// Processes the rotation owes (fractions carried from round to round).
    credit: f64,
    last_round: Option<Instant>,
    round: u64,
    /// The host's uptime in seconds, read once per round when a new process needs it.
    uptime: Option<Option<f64>>,
    /// A process left since PSS was last read: what it shared is its siblings' alone now.
    exited: bool,
    /// The memory cgroups, for the processes whose PSS is unreadable.
    cgroups: Option<Cgroups>,
}

impl Scanner {
    pub fn new(reader: ProcReader) -> Self {
        Self::with_events(reader, None)
    }

    /// A scanner told about execs and uid changes by the kernel.
    pub fn with_events(reader: ProcReader, events: Option<ProcEvents>) -> Self {
        Scanner {
            reader,
            events,
            entries: BTreeMap::new(),
            maps: BTreeMap::new(),
            hasher: RandomState::new(),
            pids: Vec::new(),
            todo: Vec::new(),
            new: Vec::new(),
            updates: Vec::new(),
            cursor: 0,
            credit: 0.0,
            last_round: None,
            round: 0,
            uptime: None,
            exited: false,
            cgroups: None,
        }
    }

    /// A scanner that shares the memory cgroups under `root` out among the processes whose PSS
    /// it may not read (cgroup v2 with the memory controller; elsewhere it keeps RSS).
    pub fn with_cgroups(mut self, root: &Path) -> Self {
        self.cgroups = Cgroups::open(root);
        self
    }

    /// One round: list, drop the gone, read the new, re-read what is due.
    pub fn round(&mut self, request: ScanRequest) -> ScanResult {
        let started = Instant::now();
        self.round += 1;
        self.uptime = None;
        let mut stats = ScanStats::default();
        let swap = request.host_has_swap;
        let listed = match self.reader.list_pids(&mut self.pids) {
            Ok(()) => {
                self.pids.sort_unstable();
                stats.listed = self.pids.len();
                let pids = &self.pids;
                let known = self.entries.len();
                self.entries
                    .retain(|pid, _| pids.binary_search(pid).is_ok());
                self.exited |= self.entries.len() < known;
                // The first round's `new` becomes the loop's table: no slack in it.
                let unknown = self.pids.len() - self.entries.len();
                self.new.reserve_exact(unknown);
                for i in 0..self.pids.len() {
                    let pid = self.pids[i];
                    if !self.entries.contains_key(&pid) {
                        self.read_new(pid, swap, &mut stats);
                    }
                }
                true
            }
            Err(e) => {
                stats.list_error = Some(e);
                false
            }
        };
        self.plan_refresh(&request, started, &mut stats);
        for i in 0..self.todo.len() {
            let (pid, depth) = self.todo[i];
            self.refresh(pid, depth, swap, &mut stats);
        }
        self.last_round = Some(started);
        let mapped_weights = request
            .maps
            .as_ref()
            .map(|pids| self.mapped_weights(pids, request.rotation_period, started));
        let pss = self.read_pss(request.pss_min_rss, started);
        stats.took = started.elapsed();
        ScanResult {
            at: request.at,
            full: request.full,
            live: listed.then(|| self.entries.keys().copied().collect()),
            new: std::mem::take(&mut self.new),
            updates: std::mem::take(&mut self.updates),
            mapped_weights,
            pss,
            stats,
        }
    }

    /// The weights files GPU holders map. Read here rather than on the loop (a Python process's
    /// maps run to thousands of lines), and again only for a new process, one whose RSS moved by
    /// `MAPS_RSS_DRIFT_BYTES` (weights are loaded or dropped), or once per rotation period.
    fn mapped_weights(
        &mut self,
        pids: &[i32],
        period: Duration,
        now: Instant,
    ) -> BTreeMap<i32, Vec<MappedFile>> {
        self.maps.retain(|pid, _| pids.binary_search(pid).is_ok());
        for &pid in pids {
            let Some(e) = self.entries.get(&pid) else {
                self.maps.remove(&pid);
                continue;
            };
            let fresh = self.maps.get(&pid).is_some_and(|m| {
                m.start_time == e.start_time
                    && m.rss_bytes.abs_diff(e.rss_bytes) < MAPS_RSS_DRIFT_BYTES
                    && now.saturating_duration_since(m.at) < period
            });
            if !fresh {
                let files = super::weights::read(self.reader.root(), pid);
                let read = MapsRead {
                    start_time: e.start_time,
                    rss_bytes: e.rss_bytes,
                    at: now,
                    files,
                };
                self.maps.insert(pid, read);
            }
        }
        self.maps
            .iter()
            .filter(|(_, m)| !m.files.is_empty())
            .map(|(&pid, m)| (pid, m.files.clone()))
            .collect()
    }

    fn read_new(&mut self, pid: i32, swap: bool, stats: &mut ScanStats) {
        match self.reader.process(pid, swap) {
            Ok(read) => {
                stats.new += 1;
                let p = read.process;
                let age_when_seen = self.age_of(p.start_time);
                self.entries.insert(
                    pid,
                    Entry {
                        start_time: p.start_time,
                        exec: self.hasher.hash_one(read.stat.stat.exec),
                        comm: self.hasher.hash_one(&p.comm),
                        rss_bytes: p.rss_bytes,
                        kernel_thread: p.kernel_thread,
                        round: self.round,
                        seen: Instant::now(),
                        age_when_seen,
                        holder_backoff: 1,
                        pss: None,
                    },
                );
                self.new.push(p);
            }
            // Exited since the listing: simply not in this table.
            Err(ReadError::Gone) => self.gone(pid),
            // Not readable now (no descriptor left...): tried again next round.
            Err(_) => stats.unreadable += 1,
        }
    }

    /// How long ago a process started (`start_time` in clock ticks since boot), from the host's
    /// uptime read once per round; 0 if the uptime cannot be read (a process is then as young
    /// as the scanner's knowledge of it). A daemon that starts, or a host with no process
    /// events, must not take every process it meets for one that may `exec` any moment.
    fn age_of(&mut self, start_time: u64) -> Duration {
        let uptime = *self.uptime.get_or_insert_with(|| {
            std::fs::read_to_string(self.reader.root().join("uptime"))
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
                .filter(|u| u.is_finite() && *u >= 0.0)
        });
        let Some(uptime) = uptime else {
            return Duration::ZERO;
        };
        let started = start_time as f64 / super::procfs::clock_ticks() as f64;
        Duration::try_from_secs_f64(uptime - started).unwrap_or(Duration::ZERO)
    }

    /// Exited since it was listed: not in `live`, so the loop drops it.
    fn gone(&mut self, pid: i32) {
        self.exited |= self.entries.remove(&pid).is_some();
    }

    /// Which known processes to re-read this round, and how deeply; the rotation advances.
    fn plan_refresh(&mut self, request: &ScanRequest, now: Instant, stats: &mut ScanStats) {
        self.todo.clear();
        let round = self.round;
        let fresh = |e: &Entry| e.round == round;
        let events = self.events.as_ref().map(ProcEvents::take);
        stats.events = events.is_some();
        if let Some(events) = &events {
            stats.event_pids = events.execs.len() + events.changed.len();
            stats.events_lost = events.lost;
            let named = (events.execs.iter().map(|&pid| (pid, Depth::Exec)))
                .chain(events.changed.iter().map(|&pid| (pid, Depth::Attributes)));
            for (pid, depth) in named {
                if self.entries.get(&pid).is_some_and(|e| !fresh(e)) {
                    self.todo.push((pid, depth));
                }
            }
            if events.lost {
                for (&pid, e) in &self.entries {
                    if !fresh(e) && !e.kernel_thread {
                        self.todo.push((pid, Depth::Attributes));
                    }
                }
            }
        }
        for &pid in &request.hot {
            if self.entries.get(&pid).is_some_and(|e| !fresh(e)) {
                self.todo.push((pid, Depth::Attributes));
            }
        }
        // GPU holders: their RSS tells when their mapped weights are worth reading again. One
        // whose RSS holds still is read less and less often (every `HOLDER_MAX_BACKOFF` rounds
        // at most); one that is loading (its RSS moving) every round.
        for &pid in request.maps.iter().flatten() {
            if self.entries.get(&pid).is_some_and(|e| {
                !fresh(e) && round.saturating_sub(e.round) >= u64::from(e.holder_backoff)
            }) {
                self.todo.push((pid, Depth::Vitals));
            }
        }
        // Without events, a young process is re-read until an exec is unlikely.
        for (&pid, e) in self.entries.iter().filter(|_| events.is_none()) {
            if !fresh(e) && !e.kernel_thread && e.age(now) < request.young {
                self.todo.push((pid, Depth::Attributes));
            }
        }
        if request.full {
            for (&pid, e) in &self.entries {
                if !fresh(e) && !e.kernel_thread {
                    self.todo.push((pid, Depth::Vitals));
                }
            }
        } else if request.largest {
            let mut by_rss: Vec<(u64, i32)> = self
                .entries
                .iter()
                .filter(|(_, e)| !fresh(e) && e.rss_bytes > 0)
                .map(|(&pid, e)| (e.rss_bytes, pid))
                .collect();
            if by_rss.len() > LARGEST {
                by_rss.select_nth_unstable_by(LARGEST - 1, |a, b| b.cmp(a));
                by_rss.truncate(LARGEST);
            }
            self.todo
                .extend(by_rss.into_iter().map(|(_, pid)| (pid, Depth::Vitals)));
        }
        self.rotate(request, now);
        // One read per pid, at the deepest depth asked.
        self.todo
            .sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        self.todo.dedup_by_key(|t| t.0);
    }

    /// The rotation's share of this round: the processes after the cursor, enough of them that
    /// each is re-read once per `rotation_period`.
    fn rotate(&mut self, request: &ScanRequest, now: Instant) {
        let elapsed = self
            .last_round
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        let factor = if self.events.is_some() {
            EVENTS_ROTATION_FACTOR
        } else {
            1
        };
        let period = (request.rotation_period * factor).as_secs_f64().max(1e-3);
        let total = self.entries.len();
        let rate = total.max(ROTATION_MIN_PER_SCAN * ROTATION_SCANS as usize) as f64 / period;
        self.credit = (self.credit + rate * elapsed.as_secs_f64()).min(total as f64);
        let due = self.credit.floor() as usize;
        self.credit -= due as f64;
        let round = self.round;
        let after = self.entries.range(self.cursor.saturating_add(1)..);
        let before = self.entries.range(..=self.cursor);
        for (&pid, e) in after.chain(before).take(due) {
            self.cursor = pid;
            if e.round != round && !e.kernel_thread {
                self.todo.push((pid, Depth::Attributes));
            }
        }
    }

    /// Re-reads one known process.
    fn refresh(&mut self, pid: i32, depth: Depth, swap: bool, stats: &mut ScanStats) {
        let Some(entry) = self.entries.get_mut(&pid) else {
            return;
        };
        let stat = match self.reader.proc_stat(pid) {
            Ok(s) => s,
            Err(ReadError::Gone) => return self.gone(pid),
            Err(_) => {
                stats.unreadable += 1;
                return;
            }
        };
        stats.refreshed += 1;
        entry.round = self.round;
        if stat.stat.start_time != entry.start_time {
            // The pid was reused: a new process.
            self.entries.remove(&pid);
            return self.read_new(pid, swap, stats);
        }
        let vitals = self.reader.vitals_of(&stat, None);
        entry.holder_backoff = if entry.rss_bytes.abs_diff(vitals.rss_bytes) >= HOLDER_SETTLED_BYTES
        {
            1
        } else {
            (entry.holder_backoff * 2).min(HOLDER_MAX_BACKOFF)
        };
        entry.rss_bytes = vitals.rss_bytes;
        let mut update = Update {
            id: vitals.id,
            state: vitals.state,
            ppid: vitals.ppid,
            rss_bytes: vitals.rss_bytes,
            swap_bytes: None,
            uid: None,
            exec: None,
        };
        let s = &stat.stat;
        let comm = self.hasher.hash_one(&s.comm);
        let mark = self.hasher.hash_one(s.exec);
        let exec =
            depth == Depth::Exec || comm != entry.comm || mark != entry.exec || !s.exec.known();
        // Exited (its last known name, command line and owner stay), or nothing more to read.
        if entry.kernel_thread
            || matches!(s.state, 'Z' | 'X' | 'x')
            || !(exec || depth >= Depth::Attributes || swap)
        {
            return self.updates.push(update);
        }
        let status = match self.reader.status(pid, stat.thread) {
            Ok(status) => status,
            Err(ReadError::Gone) => return self.gone(pid),
            Err(_) => {
                stats.unreadable += 1;
                return self.updates.push(update);
            }
        };
        if swap {
            update.swap_bytes = Some(status.swap_bytes);
        }
        update.uid = status.uid;
        if exec {
            match (
                self.reader.cmdline(pid, stat.thread),
                self.reader.cgroup(pid),
            ) {
                (Ok(cmdline), Ok(cgroup)) => {
                    if s.exec.known() {
                        stats.execs += 1;
                    }
                    let entry = self.entries.get_mut(&pid).expect("read above");
                    entry.exec = mark;
                    entry.comm = comm;
                    update.exec = Some(Exec {
                        comm: s.comm.clone(),
                        cmdline,
                        cgroup,
                    });
                }
                (Err(ReadError::Gone), _) | (_, Err(ReadError::Gone)) => return self.gone(pid),
                // Tried again at the next read: the mark is not updated.
                _ => stats.unreadable += 1,
            }
        }
        self.updates.push(update);
    }
}

/// Runs a `TableSource` (a `Scanner`) on a thread of its own: one round per request, each result handed to
/// `deliver` (which returns false when nobody listens any more).
pub struct ScanThread {
    requests: std::sync::mpsc::Sender<ScanRequest>,
    handle: std::thread::JoinHandle<()>,
}

impl super::TableSource for Scanner {
    fn round(&mut self, request: ScanRequest) -> ScanResult {
        Scanner::round(self, request)
    }
}

impl ScanThread {
    pub fn spawn(
        mut scanner: Box<dyn super::TableSource>,
        mut deliver: impl FnMut(ScanResult) -> bool + Send + 'static,
    ) -> std::io::Result<ScanThread> {
        let (requests, incoming) = std::sync::mpsc::channel::<ScanRequest>();
        let handle = std::thread::Builder::new()
            .name("proc-scan".into())
            .stack_size(256 << 10)
            .spawn(move || {
                // The id from rustix's system call: glibc's gettid() is 2.30 and newer.
                // Linux nice values are per thread: setpriority on this thread's own id.
                let _ =
                    rustix::process::setpriority_process(Some(rustix::thread::gettid()), SCAN_NICE);
                while let Ok(request) = incoming.recv() {
                    if !deliver(scanner.round(request)) {
                        break;
                    }
                }
            })?;
        Ok(ScanThread { requests, handle })
    }

    /// Queues a round; false if the thread is gone.
    pub fn request(&self, request: ScanRequest) -> bool {
        self.requests.send(request).is_ok()
    }

    /// The thread has ended (it panicked: a request in flight will never be answered).
    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::procfs::ProcReader;
    use std::path::Path;

    const STAT_TAIL: &str = "0 -1 4194304 100 0 0 0 5 3 0 0 20 0 1 0";

    /// A fixture process: what /proc shows of it.
    struct Fake<'a> {
        pid: i32,
        comm: &'a str,
        start: u64,
        rss: u64,
        /// Written into every layout field: a new value is an exec.
        layout: u64,
        uid: u32,
        cmdline: &'a str,
        ppid: i32,
    }

    fn fake<'a>(pid: i32, comm: &'a str, cmdline: &'a str) -> Fake<'a> {
        Fake {
            pid,
            comm,
            start: pid as u64 * 10,
            rss: 5,
            layout: 7,
            uid: 1000,
            cmdline,
            ppid: 1,
        }
    }

    fn write_proc(root: &Path, p: &Fake) {
        let Fake {
            pid,
            comm,
            start,
            rss,
            layout,
            uid,
            cmdline,
            ppid,
        } = p;
        let dir = root.join(pid.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        // Fields 23 (vsize) to 52; the layout fields get `layout`.
        let mut tail = vec!["0".to_string(); 30];
        tail[1] = rss.to_string(); // 24
        for i in [3usize, 4, 5, 22, 23, 24, 25, 26, 27, 28] {
            tail[i] = layout.to_string(); // 26-28, 45-51
        }
        std::fs::write(
            dir.join("stat"),
            format!(
                "{pid} ({comm}) S {ppid} {pid} {pid} {STAT_TAIL} {start} {}\n",
                tail.join(" ")
            ),
        )
        .unwrap();
        std::fs::write(
            dir.join("status"),
            format!("Name:\t{comm}\nUid:\t{uid}\t0\t0\t0\n"),
        )
        .unwrap();
        std::fs::write(dir.join("cmdline"), cmdline.replace(' ', "\0")).unwrap();
        std::fs::write(dir.join("cgroup"), "0::/test.slice\n").unwrap();
    }

    fn request(hot: &[i32]) -> ScanRequest {
        ScanRequest {
            hot: hot.to_vec(),
            rotation_period: Duration::from_secs(3600),
            ..Default::default()
        }
    }

    /// A round that re-reads processes started less than `YOUNG` ago.
    fn young_request() -> ScanRequest {
        ScanRequest {
            young: YOUNG,
            ..request(&[])
        }
    }

    /// A scanner and the table its changes are applied to, as the daemon keeps it.
    struct Table {
        scanner: Scanner,
        processes: Vec<Process>,
    }

    impl Table {
        fn new(root: &Path) -> Table {
            Table {
                scanner: Scanner::new(ProcReader::new(root)),
                processes: Vec::new(),
            }
        }

        fn round(&mut self, request: ScanRequest) -> ScanStats {
            let mut result = self.scanner.round(request);
            apply(&mut self.processes, &mut result);
            result.stats
        }

        fn find(&self, pid: i32) -> &Process {
            self.processes.iter().find(|p| p.pid == pid).unwrap()
        }
    }

    /// Writes a fixture process `pid (comm)` with `cmdline` and [start time, RSS pages, layout,
    /// uid].
    fn put(root: &Path, pid: i32, comm: &str, cmdline: &str, numbers: [u64; 4]) {
        let [start, rss, layout, uid] = numbers;
        write_proc(
            root,
            &Fake {
                start,
                rss,
                layout,
                uid: uid as u32,
                ..fake(pid, comm, cmdline)
            },
        );
    }

    #[test]
    fn new_pids_are_read_and_gone_ones_dropped() {
        let dir = tempfile::tempdir().unwrap();
        put(dir.path(), 10, "a", "a --x", [100, 5, 7, 1000]);
        put(dir.path(), 20, "b", "b", [200, 6, 7, 1000]);
        let mut table = Table::new(dir.path());
        assert_eq!(table.round(request(&[])).new, 2);
        assert_eq!(table.find(10).cmdline, "a --x");
        std::fs::remove_dir_all(dir.path().join("10")).unwrap();
        put(dir.path(), 30, "c", "c", [300, 6, 7, 1000]);
        let stats = table.round(request(&[]));
        let pids: Vec<i32> = table.processes.iter().map(|p| p.pid).collect();
        assert_eq!(pids, [20, 30]);
        assert_eq!(
            (stats.new, stats.refreshed),
            (1, 0),
            "the idle one is not re-read"
        );
    }

    #[test]
    fn young_processes_see_exec_and_setuid_at_once() {
        let dir = tempfile::tempdir().unwrap();
        put(dir.path(), 30, "bash", "bash run.sh", [300, 5, 7, 1000]);
        let mut table = Table::new(dir.path());
        table.round(young_request());
        // The launcher script execs the server, which then drops to another uid.
        put(
            dir.path(),
            30,
            "python3",
            "python3 -m vllm serve",
            [300, 5, 8, 998],
        );
        table.round(young_request());
        assert_eq!(table.find(30).cmdline, "python3 -m vllm serve");
        assert_eq!(table.find(30).uid, 998);
    }

    /// A GPU holder whose RSS holds still is read less and less often (its mapped weights cannot
    /// have changed), and every round again once its RSS moves (a model loading).
    #[test]
    fn a_settled_gpu_holder_is_read_less_often_a_loading_one_every_round() {
        let dir = tempfile::tempdir().unwrap();
        put(
            dir.path(),
            50,
            "python3",
            "python3 serve.py",
            [500, 1000, 7, 1000],
        );
        let mut table = Table::new(dir.path());
        let holders = || ScanRequest {
            maps: Some(vec![50]),
            ..request(&[])
        };
        table.round(holders());
        let reads: Vec<usize> = (2..=17).map(|_| table.round(holders()).refreshed).collect();
        // Rounds 2, 4, 8 and 16: the backoff doubles up to 8 rounds.
        assert_eq!(reads.iter().sum::<usize>(), 4, "{reads:?}");
        // It starts loading: 64 MiB more. Seen at its next read (round 24 at the latest), then
        // read every round while it moves.
        let pages = (64 << 20) / page();
        put(
            dir.path(),
            50,
            "python3",
            "python3 serve.py",
            [500, 1000 + pages, 7, 1000],
        );
        let mut rounds = 0;
        while table.round(holders()).refreshed == 0 {
            rounds += 1;
            assert!(rounds <= 8, "not read again within 8 rounds");
        }
        put(
            dir.path(),
            50,
            "python3",
            "python3 serve.py",
            [500, 1000 + 2 * pages, 7, 1000],
        );
        assert_eq!(
            table.round(holders()).refreshed,
            1,
            "a loading holder: every round"
        );
    }

    /// Young is the process's age (its start time against the host's uptime), not how long the
    /// scanner has known it: a scanner that has just started (a daemon restart) does not re-read
    /// every process on the host every round for a minute.
    #[test]
    fn young_is_counted_from_the_process_start_not_from_first_sight() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("uptime"), "100.00 150.00\n").unwrap();
        let ticks = crate::sample::procfs::clock_ticks();
        // Started 5 s ago, and 99 s ago.
        put(
            dir.path(),
            30,
            "bash",
            "bash run.sh",
            [95 * ticks, 5, 7, 1000],
        );
        put(dir.path(), 40, "bash", "bash old.sh", [ticks, 5, 7, 1000]);
        let mut table = Table::new(dir.path());
        table.round(young_request());
        put(
            dir.path(),
            30,
            "python3",
            "python3 new",
            [95 * ticks, 5, 8, 998],
        );
        put(dir.path(), 40, "python3", "python3 new", [ticks, 5, 8, 998]);
        table.round(young_request());
        assert_eq!(table.find(30).cmdline, "python3 new");
        // Older than `YOUNG`: left to the rotation (an hour here).
        assert_eq!(table.find(40).cmdline, "bash old.sh");
        assert_eq!(table.find(40).uid, 1000);
    }

    #[test]
    fn hot_pids_see_exec_and_setuid_at_once_the_rest_by_rotation() {
        let dir = tempfile::tempdir().unwrap();
        put(
            dir.path(),
            10,
            "python3",
            "python3 launcher.py",
            [100, 5, 7, 1000],
        );
        put(
            dir.path(),
            20,
            "python3",
            "python3 other.py",
            [200, 5, 7, 1000],
        );
        let mut table = Table::new(dir.path());
        table.round(request(&[]));
        // Both exec with the same name (a new layout), and both change their real uid only.
        put(
            dir.path(),
            10,
            "python3",
            "python3 -m vllm serve",
            [100, 5, 8, 0],
        );
        put(
            dir.path(),
            20,
            "python3",
            "python3 -m vllm serve",
            [200, 5, 8, 0],
        );
        let stats = table.round(request(&[10]));
        assert_eq!(table.find(10).cmdline, "python3 -m vllm serve");
        assert_eq!(table.find(10).uid, 0);
        assert_eq!(stats.execs, 1);
        assert_eq!(table.find(20).cmdline, "python3 other.py", "not due yet");
        // A ruid change with no exec: seen by the next read of status.
        put(
            dir.path(),
            10,
            "python3",
            "python3 -m vllm serve",
            [100, 5, 8, 1234],
        );
        table.round(request(&[10]));
        assert_eq!(table.find(10).uid, 1234);
        // The rotation reaches the other one within its period.
        let mut rotating = request(&[]);
        rotating.rotation_period = Duration::from_millis(1);
        std::thread::sleep(Duration::from_millis(2));
        table.round(rotating);
        assert_eq!(table.find(20).cmdline, "python3 -m vllm serve");
        assert_eq!(table.find(20).uid, 0);
    }

    #[test]
    fn full_rounds_refresh_every_rss_and_catch_reused_pids() {
        let dir = tempfile::tempdir().unwrap();
        put(dir.path(), 10, "a", "a", [100, 5, 7, 1000]);
        let mut table = Table::new(dir.path());
        table.round(request(&[]));
        put(dir.path(), 10, "a", "a", [100, 50, 7, 1000]);
        table.round(request(&[]));
        assert_eq!(table.find(10).rss_bytes, 5 * page(), "idle: not re-read");
        let full = || ScanRequest {
            full: true,
            ..request(&[])
        };
        table.round(full());
        assert_eq!(table.find(10).rss_bytes, 50 * page());
        // Another process now has pid 10 (another start time).
        put(dir.path(), 10, "b", "b --new", [999, 1, 9, 1000]);
        table.round(full());
        let p = table.find(10);
        assert_eq!(
            (p.start_time, p.comm.as_str(), p.cmdline.as_str()),
            (999, "b", "b --new")
        );
        assert_eq!(table.processes.len(), 1);
    }

    /// Near the RAM floor the scan reads the PSS of the processes that hold enough, keeps it
    /// while nothing moved, reads it again once a process exited (its siblings' share grew),
    /// and keeps none away from the floor.
    #[test]
    fn pss_is_read_near_the_floor_only_and_again_once_a_process_exited() {
        const MIB: u64 = 1 << 20;
        let dir = tempfile::tempdir().unwrap();
        let pss = |pid: i32, mib: u64| {
            std::fs::write(
                dir.path().join(format!("{pid}/smaps_rollup")),
                format!("Rss: 1 kB\nPss:   {} kB\n", mib * 1024),
            )
            .unwrap();
        };
        let pages = |mib: u64| mib * MIB / page();
        put(dir.path(), 10, "w", "w", [100, pages(100), 7, 1000]);
        put(dir.path(), 20, "w", "w", [200, pages(100), 7, 1000]);
        put(dir.path(), 30, "small", "small", [300, pages(1), 7, 1000]);
        for (pid, mib) in [(10, 40), (20, 30), (30, 1)] {
            pss(pid, mib);
        }
        let mut table = Table::new(dir.path());
        let near = || ScanRequest {
            pss_min_rss: Some(32 * MIB),
            ..request(&[])
        };
        table.round(request(&[]));
        assert!(table.processes.iter().all(|p| p.pss_bytes.is_none()));
        table.round(near());
        let read = |t: &Table| [10, 20, 30].map(|pid| t.find(pid).pss_bytes.map(|b| b / MIB));
        assert_eq!(read(&table), [Some(40), Some(30), None]);
        // Nothing moved: the figure is kept, not read again.
        pss(10, 50);
        table.round(near());
        assert_eq!(table.find(10).pss_bytes, Some(40 * MIB));
        // A sibling exited: what it shared is the others' now.
        std::fs::remove_dir_all(dir.path().join("20")).unwrap();
        table.round(near());
        assert_eq!(table.find(10).pss_bytes, Some(50 * MIB));
        // Away from the floor: none kept.
        table.round(request(&[]));
        assert_eq!(table.find(10).pss_bytes, None);
    }

    /// Round three under the packaged unit: without CAP_SYS_PTRACE another account's PSS is
    /// unreadable, so four forked workers sharing their parent's pages were ranked by RSS (each
    /// counting the shared pages) against a hog with as much RSS of its own. Their share of
    /// their memory cgroup's anonymous memory counts the shared pages once between them.
    /// A fixture /proc and cgroup v2 tree for the cgroup share: processes with a parent, a name,
    /// a command line and resident anonymous memory, each in a cgroup; no smaps_rollup anywhere
    /// (as unreadable as EACCES makes it).
    struct CgroupFixture {
        dir: tempfile::TempDir,
    }

    impl CgroupFixture {
        const MIB: u64 = 1 << 20;

        fn new() -> CgroupFixture {
            let dir = tempfile::tempdir().unwrap();
            let cgroups = dir.path().join("cgroup");
            std::fs::create_dir_all(&cgroups).unwrap();
            // A cgroup v2 root with the memory controller, as /sys/fs/cgroup is.
            std::fs::write(cgroups.join("cgroup.controllers"), "cpu io memory pids\n").unwrap();
            CgroupFixture { dir }
        }

        fn proc_root(&self) -> std::path::PathBuf {
            self.dir.path().join("proc")
        }

        /// Process `pid`, child of `ppid`, with `anon_mib` of resident anonymous memory.
        fn process(&self, pid: i32, ppid: i32, comm: &str, cmdline: &str, anon_mib: u64) {
            let pages = anon_mib * Self::MIB / page();
            let root = self.proc_root();
            write_proc(
                &root,
                &Fake {
                    start: 100,
                    rss: pages,
                    ppid,
                    ..fake(pid, comm, cmdline)
                },
            );
            let statm = format!("0 {pages} 0 0 0 0 0\n");
            std::fs::write(root.join(format!("{pid}/statm")), statm).unwrap();
        }

        /// The cgroup at `path` holding `pids`, with `anon_mib` of anonymous memory.
        fn cgroup(&self, path: &str, pids: &[i32], anon_mib: u64) {
            let dir = self.dir.path().join("cgroup").join(&path[1..]);
            std::fs::create_dir_all(&dir).unwrap();
            let stat = format!("anon {}\nfile 0\n", anon_mib * Self::MIB);
            std::fs::write(dir.join("memory.stat"), stat).unwrap();
            let procs: String = pids.iter().map(|p| format!("{p}\n")).collect();
            std::fs::write(dir.join("cgroup.procs"), procs).unwrap();
            for pid in pids {
                let file = self.proc_root().join(format!("{pid}/cgroup"));
                std::fs::write(file, format!("0::{path}\n")).unwrap();
            }
        }

        /// One round near the floor; each process's figure in MiB.
        fn figures(&self, pids: &[i32]) -> Vec<Option<u64>> {
            let mut table = Table {
                scanner: Scanner::new(ProcReader::new(self.proc_root()))
                    .with_cgroups(&self.dir.path().join("cgroup")),
                processes: Vec::new(),
            };
            table.round(ScanRequest {
                pss_min_rss: Some(32 * Self::MIB),
                ..request(&[])
            });
            pids.iter()
                .map(|&pid| table.find(pid).pss_bytes.map(|b| b / Self::MIB))
                .collect()
        }
    }

    /// Four forked workers of 512 MiB resident anonymous memory each, 384 MiB of it shared, in a
    /// cgroup of their own (a service): it holds 128 * 4 + 384 = 896 MiB, 224 MiB each. The hog
    /// (its own cgroup) holds 512 MiB alone. Without the cgroup tree (cgroup v1): RSS.
    #[test]
    fn where_pss_is_unreadable_a_cgroups_anonymous_memory_is_shared_out_among_its_processes() {
        let f = CgroupFixture::new();
        f.process(10, 1, "worker", "worker", 512);
        for pid in [11, 12, 13] {
            f.process(pid, 10, "worker", "worker", 512);
        }
        f.process(20, 1, "hog", "hog", 512);
        f.cgroup("/system.slice/workers.service", &[10, 11, 12, 13], 896);
        f.cgroup("/user.slice/user-1001.slice/session-2.scope", &[20], 512);
        assert_eq!(
            f.figures(&[10, 11, 12, 13, 20]),
            [Some(224), Some(224), Some(224), Some(224), Some(512)]
        );
        let mut v1 = Table::new(&f.proc_root());
        v1.round(ScanRequest {
            pss_min_rss: Some(32 * CgroupFixture::MIB),
            ..request(&[])
        });
        assert_eq!(v1.find(10).pss_bytes, None);
    }

    /// Twin processes (one forked from the other) of 10 GiB private memory each, moved into a
    /// cgroup after they touched it (their pages stay charged where they were): the cgroup is
    /// charged 1 GiB, less than the family's largest member holds, so its figure says nothing
    /// of them and each counts its own (shared out, they counted 1 GiB together; with only the
    /// family's lower bound, 10 of their 20).
    #[test]
    fn a_cgroup_charged_less_than_its_family_must_hold_is_not_believed() {
        let f = CgroupFixture::new();
        f.process(10, 1, "twin", "twin", 10 << 10);
        f.process(11, 10, "twin", "twin", 10 << 10);
        f.cgroup(
            "/user.slice/user-1001.slice/user@1001.service/moved",
            &[10, 11],
            1 << 10,
        );
        assert_eq!(f.figures(&[10, 11]), [Some(10 << 10), Some(10 << 10)]);
        // Moved in after their start-up only (a server moved before it loads, its interpreter's
        // first 8 MiB charged where it started): believed. Seen on a real cgroup v2 kernel,
        // where a bound without slack took forked workers for twins moved in.
        f.process(20, 1, "worker", "worker", 520);
        for pid in [21, 22, 23] {
            f.process(pid, 20, "worker", "worker", 520);
        }
        f.cgroup("/system.slice/workers.service", &[20, 21, 22, 23], 512);
        assert_eq!(f.figures(&[20, 21, 22, 23]), [Some(130); 4]);
    }

    /// The same workers in a cgroup they share with others (a login session, a CI job): the
    /// shell that started them (8 MiB), a hog it started (512 MiB, its own command line), and
    /// a worker that exec'd a new command line (256 MiB). Only the family that forked without
    /// exec shares pages: the hog and the exec'd worker keep their whole figure, the four
    /// workers share out what is left (1672 - 512 - 256 - 8 = 896 MiB). Shared out over
    /// everyone instead, the hog counted 303 MiB and the workers 1.2 GiB between them, and the
    /// RAM floor took the workers for the larger (seen on a real cgroup v2 kernel).
    #[test]
    fn in_a_shared_cgroup_only_a_family_that_forked_without_exec_shares_its_memory() {
        let f = CgroupFixture::new();
        f.process(5, 1, "bash", "bash", 8);
        f.process(10, 5, "worker", "worker", 512);
        for pid in [11, 12, 13] {
            f.process(pid, 10, "worker", "worker", 512);
        }
        f.process(20, 5, "hog", "hog", 512);
        f.process(30, 10, "worker", "worker --spawned", 256);
        f.cgroup(
            "/user.slice/user-1001.slice/session-3.scope",
            &[5, 10, 11, 12, 13, 20, 30],
            1672,
        );
        assert_eq!(
            f.figures(&[10, 11, 12, 13, 20, 30]),
            [
                Some(224),
                Some(224),
                Some(224),
                Some(224),
                Some(512),
                Some(256)
            ]
        );
    }

    #[test]
    fn an_unreadable_process_keeps_what_was_known() {
        let dir = tempfile::tempdir().unwrap();
        put(dir.path(), 10, "a", "a", [100, 5, 7, 1000]);
        let mut table = Table::new(dir.path());
        table.round(request(&[]));
        // stat becomes a directory: reads fail with EISDIR, not ENOENT.
        let stat = dir.path().join("10/stat");
        std::fs::remove_file(&stat).unwrap();
        std::fs::create_dir(&stat).unwrap();
        let stats = table.round(request(&[10]));
        assert_eq!(table.find(10).rss_bytes, 5 * page());
        assert_eq!(stats.unreadable, 1);
    }

    #[test]
    fn largest_are_refreshed_near_a_floor() {
        let dir = tempfile::tempdir().unwrap();
        for pid in 1..=(LARGEST as i32 + 10) {
            put(dir.path(), pid, "p", "p", [pid as u64, pid as u64, 7, 1000]);
        }
        let mut table = Table::new(dir.path());
        table.round(request(&[]));
        let near = ScanRequest {
            largest: true,
            ..request(&[])
        };
        assert_eq!(table.round(near).refreshed, LARGEST);
    }

    #[test]
    fn changes_merge_into_the_table_in_pid_order() {
        let p = |pid: i32| Process {
            pid,
            start_time: pid as u64,
            ..Process::default()
        };
        let changed = |pid: i32, start_time: u64| Update {
            id: ProcessId { pid, start_time },
            state: 'R',
            ppid: 1,
            rss_bytes: 42,
            swap_bytes: None,
            uid: Some(7),
            exec: None,
        };
        let mut table = Vec::new();
        let mut first = ScanResult {
            live: Some(vec![1, 5, 9]),
            new: vec![p(9), p(1), p(5)],
            ..ScanResult::default()
        };
        apply(&mut table, &mut first);
        let mut result = ScanResult {
            live: Some(vec![1, 2, 5, 7, 12]),
            new: vec![p(12), p(2), p(7)],
            // An update for another process that had pid 1 is not applied.
            updates: vec![changed(5, 5), changed(1, 999)],
            ..ScanResult::default()
        };
        apply(&mut table, &mut result);
        let pids: Vec<i32> = table.iter().map(|p| p.pid).collect();
        assert_eq!(pids, [1, 2, 5, 7, 12]);
        assert_eq!(
            (table[2].rss_bytes, table[2].uid, table[2].state),
            (42, 7, 'R')
        );
        assert_eq!(table[0].rss_bytes, 0);
        // A pid taken by another process: replaced.
        let mut reused = ScanResult {
            live: Some(vec![1, 2, 5, 7, 12]),
            new: vec![Process {
                start_time: 77,
                ..p(7)
            }],
            ..ScanResult::default()
        };
        apply(&mut table, &mut reused);
        assert_eq!((table.len(), table[3].start_time), (5, 77));
    }

    fn page() -> u64 {
        crate::sample::procfs::page_size()
    }

    /// A real child that `exec`s and another that calls `setuid`, both older than `young` (0
    /// here) and outside the rotation (an hour): the kernel's events make the very next round
    /// read their new name, command line and uid; a scanner without events does not. Needs root
    /// on the host (CAP_NET_ADMIN), as the daemon does.
    #[test]
    fn an_exec_or_setuid_reaches_the_next_round_through_process_events() {
        use crate::sample::proc_events::ProcEvents;
        use std::io::Write;
        use std::process::{Command, Stdio};
        if !rustix::process::geteuid().is_root() {
            crate::test_skip::skip("root", "the kernel's process events need root");
            return;
        }
        let script = "import os, sys\nif sys.stdin.readline() == 'uid\\n':\n    os.setuid(65534)\n\
                      else:\n    os.execv('/bin/sleep', ['sleep', '31'])\nsys.stdin.readline()\n";
        let spawn = || {
            Command::new(crate::sample::python3())
                .args(["-c", script])
                .stdin(Stdio::piped())
                .spawn()
                .unwrap()
        };
        let request = || ScanRequest {
            rotation_period: Duration::from_secs(3600),
            young: Duration::ZERO,
            ..Default::default()
        };
        let read = |pid: u32, file: &str| {
            std::fs::read_to_string(format!("/proc/{pid}/{file}")).unwrap_or_default()
        };
        let wait_until = |done: &dyn Fn() -> bool| {
            let deadline = Instant::now() + Duration::from_secs(5);
            while !done() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            assert!(done(), "the child did not get there");
        };
        let events = ProcEvents::open().expect("root on the host gets process events");
        for with_events in [true, false] {
            let mut scanner = if with_events {
                Scanner::with_events(ProcReader::new("/proc"), Some(ProcEvents::open().unwrap()))
            } else {
                Scanner::new(ProcReader::new("/proc"))
            };
            let (mut execs, mut setuid) = (spawn(), spawn());
            let (e, u) = (execs.id(), setuid.id());
            // Python has started (its own exec is behind it) before the first round.
            wait_until(&|| {
                [e, u]
                    .iter()
                    .all(|&p| read(p, "comm").starts_with("python"))
            });
            let first = scanner.round(request());
            assert!(first
                .new
                .iter()
                .any(|p| p.pid == e as i32 && p.comm.starts_with("python")));
            execs.stdin.as_mut().unwrap().write_all(b"exec\n").unwrap();
            setuid.stdin.as_mut().unwrap().write_all(b"uid\n").unwrap();
            wait_until(&|| read(e, "comm") == "sleep\n");
            wait_until(&|| {
                read(u, "status")
                    .lines()
                    .any(|l| l.starts_with("Uid:\t65534"))
            });
            // The kernel sends each event to every listener at once: once this listener has
            // both, the scanner's has them too (/proc shows a change just before its event).
            let (mut exec_seen, mut uid_seen) = (false, false);
            let deadline = Instant::now() + Duration::from_secs(5);
            while !(exec_seen && uid_seen) && Instant::now() < deadline {
                let p = events.take();
                exec_seen |= p.execs.contains(&(e as i32));
                uid_seen |= p.changed.contains(&(u as i32));
                std::thread::sleep(Duration::from_millis(2));
            }
            assert!(exec_seen && uid_seen, "the kernel did not report both");
            let next = scanner.round(request());
            let of = |pid: u32| next.updates.iter().find(|u| u.id.pid == pid as i32);
            let exec = of(e).and_then(|u| u.exec.clone());
            let uid = of(u).and_then(|u| u.uid);
            if with_events {
                let exec = exec.expect("the exec reached the next round");
                assert_eq!(
                    (exec.comm.as_str(), exec.cmdline.as_str()),
                    ("sleep", "sleep 31")
                );
                assert_eq!(uid, Some(65534), "the setuid reached the next round");
                assert!(next.stats.events && next.stats.event_pids >= 2);
            } else {
                // Without events the rotation (an hour here) would find them later.
                assert_eq!((exec, uid), (None, None));
                assert!(!next.stats.events);
            }
            for mut child in [execs, setuid] {
                child.kill().unwrap();
                child.wait().unwrap();
            }
        }
        drop(events);
    }
}
