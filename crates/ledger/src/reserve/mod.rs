//! Reservations, a ledger: a launch lease and a request permit are one thing. Each is an amount
//! of GPU memory (on GPUs it is placed on, like launches) and/or host RAM, reserved against live
//! free memory minus the floors minus every other outstanding reservation, owned by a client
//! whose identity was pinned when it connected, and ended by release, by the owner's death or
//! closed connection, or by a TTL. One admission function (`policy::admission::place`) decides
//! both.
//!
//! The ledger is plain data: requests and readings in (time comes in as the daemon clock,
//! `now`), answers out — at once as a method's return value, or later through the outbox
//! (`take_outbox`) — plus the events and registrations the loop applies after a tick. It knows
//! no socket, channel or runtime: `ipc::server` owns the connections, their caps and reply
//! channels, delivers the outbox, and pins a launched process (`Launched`). Every count (a
//! uid's permits and launches, a pool's permits held, a connection's engagement) is derived
//! from the holdings and the queues, never kept beside them.
//!
//! Bounds: launches per uid, permits held and waiting per uid and in all, waiting requests per
//! pool, the TTL and timeout of each request, the length of every string. Whatever local users
//! send, the ledger's size stays proportional to those caps. And memory: what one uid holds
//! reserved, and what all accounts other than root hold reserved and not yet in use, together
//! (`rooms.rs`): root keeps the rest.

pub mod account;
mod books;
pub mod capacity;
mod drain;
mod launches;
mod learner;
pub mod lease;
mod limit;
mod permits;
mod rooms;
mod views;
mod waiting;

pub use drain::Drain;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use crate::config::{Config, ModelConfig, Users};
use crate::kinds::EventKind;
use crate::policy::admission::{never, place, Demand, Fit, GpuRoom, RamRoom, Short, Shortfall};
use crate::policy::{About, Event, ModelsInForce, Severity};
use crate::protocol::{
    check_model_name, check_url, AcquireRequest, Free, LaunchRequest, Needed, RefusalReason,
    Response,
};
use crate::snapshot::ProcessId;
use crate::status::{LeaseRow, PermitPoolRow, QueuedRow};
use crate::units::fmt_bytes;

use account::Account;
pub use capacity::Capacity;
use learner::SAMPLES_FOR_DEFAULT;
#[cfg(any(test, feature = "fakes"))]
pub use lease::FakeProcess;
pub use lease::{Launched, ReadyUrl};
use lease::{Lease, LeaseState, NewLease};
use limit::PerUid;

/// A connection to the socket, numbered by the server.
pub type ConnId = u64;

/// A pool of reservations: a model's, or (`None`) the host-wide pool of permits of no model.
pub type Pool = Option<String>;

/// Events kept between two ticks of the loop; beyond it they are counted, not kept.
const MAX_EVENTS: usize = 256;
/// Sizes above this are nonsense on any host (a petabyte of GPU memory).
const MAX_BYTES: u64 = 1 << 50;
/// Words and bytes of a launch command kept for status and logs.
const MAX_COMMAND_WORDS: usize = 64;
const MAX_COMMAND_BYTES: usize = 4096;
/// Why a permit request whose caller's model is not known yet waits.
const UNPLACED: &str = "a process scan newer than the request (to find the caller's model)";
/// Why a GPU request waits for the next GPU reading.
const FRESH_READING: &str = "a GPU reading newer than the request";
/// Why a caller's first GPU permit in a pool waits for a reading with the process lists.
const PROCESS_LISTS: &str = "a GPU reading with the process lists (what the caller holds)";
/// How long past its timeout such a request may wait for that scan (what the daemon needs to
/// decide is not the caller's wait; a forced scan comes within ~100 ms).
const UNPLACED_GRACE: Duration = Duration::from_secs(2);
/// A holder is asked to give its cache back (`Response::Trim`) at most this often.
const TRIM_EVERY: Duration = Duration::from_secs(1);
/// How long a request waits for GPU memory before processes whose cache NVML cannot see are
/// asked to give back what they may cache (not at once: a process's report of its cache comes
/// with its requests, and most waits end within a reading or two).
const BLIND_TRIM_AFTER: Duration = Duration::from_millis(250);

/// A client's pinned identity (`ipc::peer::pin`): pid + start time name one process, and the
/// uid is the one it connected as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Peer {
    pub uid: u32,
    pub pid: i32,
    /// Start time of `pid` (clock ticks since boot).
    pub start_time: u64,
}

impl Peer {
    pub fn is_root(&self) -> bool {
        self.uid == 0
    }

    pub fn process(&self) -> ProcessId {
        ProcessId {
            pid: self.pid,
            start_time: self.start_time,
        }
    }
}

/// A client the ledger deals with: who it is, and since when (its GPU admissions wait for a
/// reading taken after that).
struct Client {
    peer: Peer,
    since: Duration,
}

/// A request waiting for memory.
struct Waiter {
    conn: ConnId,
    /// The client's number for it (launches: 0).
    id: u64,
    peer: Peer,
    pool: Pool,
    demand: Demand,
    arrived: Duration,
    deadline: Duration,
    /// A GPU demand is decided on a reading taken after this (its connection's start).
    fresh_after: Duration,
    wanted: Wanted,
    /// Why it is waiting, last time it was looked at.
    waiting_for: String,
    /// A launch was told it is queued (once).
    told: bool,
    /// A permit request that names no model, from a process the latest process scan has not
    /// seen: its pool (its process's model, else the host-wide pool) is decided on a scan newer
    /// than its connection. It waits in the host-wide pool's queue until then.
    unplaced: Option<Box<AcquireRequest>>,
}

impl Waiter {
    /// When it is refused for waiting too long: its deadline, or, while what it waits for is
    /// what the daemon needs to decide (a process scan to find its model, a GPU reading newer
    /// than itself: `decide_pending`), up to `UNPLACED_GRACE` past it. A `timeout_ms` of 0
    /// waits for those only.
    fn deadline_with_grace(&self, decide_pending: bool) -> Duration {
        if self.unplaced.is_some() || decide_pending {
            self.deadline + UNPLACED_GRACE
        } else {
            self.deadline
        }
    }
}

enum Wanted {
    Permit { ttl: Duration },
    Launch(Box<LaunchWait>),
}

struct LaunchWait {
    request: LaunchRequest,
    process: Arc<dyn Launched>,
    ready_timeout: Duration,
    queue_timeout: Duration,
}

/// Something granted.
struct Holding {
    pool: Pool,
    peer: Peer,
    gpus: Vec<u32>,
    gpu_bytes_per_gpu: u64,
    ram_bytes: u64,
    granted_at: Duration,
    kind: Held,
}

enum Held {
    Permit { conn: ConnId, expires_at: Duration },
    Lease(Box<Lease>),
}

impl Holding {
    /// A permit's connection (`None`: a lease).
    fn conn(&self) -> Option<ConnId> {
        match self.kind {
            Held::Permit { conn, .. } => Some(conn),
            Held::Lease(_) => None,
        }
    }

    /// A launch whose model is still loading (it holds the launch lock).
    fn loading(&self) -> bool {
        matches!(&self.kind, Held::Lease(l) if l.state == LeaseState::Loading)
    }

    /// Whether it still reserves memory (a lease stops when its model is ready).
    fn reserving(&self) -> bool {
        matches!(self.kind, Held::Permit { .. }) || self.loading()
    }
}

/// What the loop applies after a tick.
#[derive(Default)]
pub struct TickReport {
    pub events: Vec<Event>,
    /// Launched processes and the model each belongs to (the whole set, not a change).
    pub registered: HashMap<ProcessId, String>,
    /// Launched models that have no `[[model]]`: their budgets come from the launch.
    pub launched_models: Vec<ModelConfig>,
    /// Client-caused events suppressed by the per-uid rate limit since the last tick.
    pub events_suppressed: u64,
}

/// What `status` shows of the table.
#[derive(Clone, Debug, Default)]
pub struct Rows {
    pub queue: Vec<QueuedRow>,
    pub leases: Vec<LeaseRow>,
    pub permits: Vec<PermitPoolRow>,
}

/// Counts the metrics read (per pool, since start).
#[derive(Clone, Debug, Default)]
pub struct PoolFigures {
    pub pool: String,
    pub held: usize,
    pub waiting: usize,
    pub reserved_gpu_bytes: u64,
    pub reserved_ram_bytes: u64,
    pub granted: u64,
    pub refused: u64,
    pub expired: u64,
    pub observed_p50_bytes: Option<u64>,
    pub observed_p95_bytes: Option<u64>,
}

pub struct Reservations {
    config: Config,
    capacity: Capacity,
    pools: BTreeMap<Pool, Account>,
    /// Permit requests waiting, per pool, first come first served.
    waiting: BTreeMap<Pool, VecDeque<Waiter>>,
    launch_queue: VecDeque<Waiter>,
    holdings: HashMap<u64, Holding>,
    /// Clients by connection, from `join` to `leave`.
    clients: HashMap<ConnId, Client>,
    /// Launched models: those with no `[[model]]` (budgets and owner from the launch), and
    /// configured ones launched with a metrics URL (kept for that URL alone).
    launched: BTreeMap<String, ModelConfig>,
    next_id: u64,
    events: Vec<Event>,
    events_dropped: u64,
    /// The per-uid rate limit on the events clients cause.
    event_limit: PerUid,
    /// When each holder was last asked to give its cache back.
    trims: HashMap<ProcessId, Duration>,
    /// Answers decided outside a client's own request (a wait that ended, a TTL, a trim hint),
    /// in order, until the transport takes them.
    outbox: Vec<(ConnId, Response)>,
    /// The host drains (a maintenance or preemption notice): new requests are refused.
    drain: Option<Drain>,
}

fn model_label(pool: &Pool) -> String {
    pool.clone().unwrap_or_else(|| "(host)".into())
}

fn ms(d: Duration) -> u64 {
    d.as_millis().min(u64::MAX as u128) as u64
}

impl Reservations {
    pub fn new(config: Config) -> Reservations {
        Reservations {
            config,
            capacity: Capacity::default(),
            pools: BTreeMap::new(),
            waiting: BTreeMap::new(),
            launch_queue: VecDeque::new(),
            holdings: HashMap::new(),
            clients: HashMap::new(),
            launched: BTreeMap::new(),
            next_id: 0,
            events: Vec::new(),
            events_dropped: 0,
            event_limit: PerUid::default(),
            trims: HashMap::new(),
            outbox: Vec::new(),
            drain: None,
        }
    }

    /// A reloaded config: new limits, users and sizes apply to new requests.
    pub fn configure(&mut self, config: Config) {
        self.config = config;
    }

    /// Keeps an event for the next tick. Every event here is caused by a client (it names the
    /// client's uid, and says so in `caused_by`): past the uid's share of the rate limit it is
    /// counted, not kept, so one user's request loop cannot flood the event log and the
    /// webhooks.
    fn event(&mut self, mut e: Event) {
        e.caused_by = e.caused_by.or(e.about.uid);
        if let Some(uid) = e.caused_by {
            if !self.admit_event(uid, e.kind, e.severity) {
                return;
            }
        }
        if self.events.len() < MAX_EVENTS {
            self.events.push(e);
        } else {
            self.events_dropped += 1;
        }
    }

    /// Whether a notice of `uid`'s own doing may be told, by the per-uid rate limit this table's
    /// own events go through: the loop asks it for the rest of what a client causes (the budget
    /// events and conditions of the models it launched). Past the uid's share it is counted
    /// here and summed up in the window's `events_suppressed` event.
    pub fn admit_event(&mut self, uid: u32, kind: EventKind, severity: Severity) -> bool {
        self.event_limit.admit(uid, kind, severity)
    }

    fn new_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// The name of a model the config does not know, for `uid`: the models other accounts launch
    /// are in their own namespace (`NAME@UID`), so nobody can take a name that root (or another
    /// account) launches under, nor slip into its model. Root's launches and `[[model]]`s keep
    /// their names.
    fn scoped(&self, name: &str, uid: u32) -> String {
        let own = format!("@{uid}");
        if uid == 0 || self.config.model(name).is_some() || name.ends_with(&own) {
            name.to_string()
        } else {
            format!("{name}{own}")
        }
    }

    /// An answer for a client, delivered by the transport after the call (`take_outbox`).
    fn send(&mut self, conn: ConnId, response: Response) {
        if self.clients.contains_key(&conn) {
            self.outbox.push((conn, response));
        }
    }

    /// The answers decided since the last call, in order.
    pub fn take_outbox(&mut self) -> Vec<(ConnId, Response)> {
        std::mem::take(&mut self.outbox)
    }

    // --- clients -------------------------------------------------------------------------------

    /// A client pinned on connection `conn` (connected at `since`) may now ask.
    pub fn join(&mut self, conn: ConnId, peer: Peer, since: Duration) {
        self.clients.insert(conn, Client { peer, since });
    }

    /// The client on `conn` left (hung up, or its connection is being closed): its permits end,
    /// its requests stop waiting, and nothing more is sent to it.
    pub fn leave(&mut self, conn: ConnId, now: Duration) {
        if self.clients.remove(&conn).is_none() {
            return;
        }
        let held: Vec<u64> = self
            .holdings
            .iter()
            .filter(|(_, h)| h.conn() == Some(conn))
            .map(|(id, _)| *id)
            .collect();
        for id in held {
            self.end_permit(id, now);
        }
        for queue in self.waiting.values_mut() {
            queue.retain(|w| w.conn != conn);
        }
        self.waiting.retain(|_, q| !q.is_empty());
        self.launch_queue.retain(|w| {
            if w.conn == conn {
                tracing::info!(
                    "launch of model '{}' by pid {} left the queue (caller hung up)",
                    model_label(&w.pool),
                    w.peer.pid
                );
            }
            w.conn != conn
        });
        self.outbox.retain(|(c, _)| *c != conn);
        self.admit_waiting(now);
    }

    /// True while the client on `conn` holds a permit or waits for something: it is not idle.
    pub fn engaged(&self, conn: ConnId) -> bool {
        self.holdings.values().any(|h| h.conn() == Some(conn))
            || self.waiters().any(|w| w.conn == conn)
    }

    // --- counts, derived from the holdings and the queues --------------------------------------

    /// Every waiting request: permits (per pool), then launches.
    fn waiters(&self) -> impl Iterator<Item = &Waiter> {
        self.waiting.values().flatten().chain(&self.launch_queue)
    }

    /// Permits `uid` holds or waits for (`None`: everyone's).
    fn permits_of(&self, uid: Option<u32>) -> usize {
        self.permits_where(|u| uid.is_none_or(|x| x == u))
    }

    /// Permits held or waited for by the uids `mine` picks.
    fn permits_where(&self, mine: impl Fn(u32) -> bool) -> usize {
        let held = self
            .holdings
            .values()
            .filter(|h| h.conn().is_some() && mine(h.peer.uid))
            .count();
        held + self
            .waiting
            .values()
            .flatten()
            .filter(|w| mine(w.peer.uid))
            .count()
    }

    /// Launches of `uid` waiting or loading.
    fn launches_of(&self, uid: u32) -> usize {
        let loading = self
            .holdings
            .values()
            .filter(|h| h.loading() && h.peer.uid == uid)
            .count();
        loading
            + self
                .launch_queue
                .iter()
                .filter(|w| w.peer.uid == uid)
                .count()
    }

    /// Permits held in `pool`.
    fn permits_held(&self, pool: &Pool) -> usize {
        self.holdings
            .values()
            .filter(|h| h.conn().is_some() && h.pool == *pool)
            .count()
    }
}

/// A duration a request asks for in milliseconds: the config's `default` when it names none,
/// never more than the config's `max`.
fn asked_ms(ms: Option<u64>, default: Duration, max: Duration) -> Duration {
    ms.map_or(default, Duration::from_millis).min(max)
}

/// `pool`'s books in `pools`; a new one starts from the pool's use now (its baseline).
fn account_in<'a>(
    pools: &'a mut BTreeMap<Pool, Account>,
    capacity: &Capacity,
    pool: &Pool,
) -> &'a mut Account {
    pools.entry(pool.clone()).or_insert_with(|| {
        let mut account = Account::default();
        account.observe(pool.as_deref(), capacity);
        account
    })
}

fn about(pool: &Pool, peer: &Peer) -> About {
    About {
        model: pool.clone(),
        pid: Some(peer.pid),
        uid: Some(peer.uid),
        resource: None,
    }
}

/// Why a request that could wait for `short` is refused when its queue has no room for it: its
/// model's slots, or the queue (derived from what was short, never from a message's text).
fn queue_full_reason(short: Short) -> RefusalReason {
    match short {
        Short::MaxPermits => RefusalReason::MaxPermits,
        _ => RefusalReason::QueueFull,
    }
}

/// `asked` beside `held` against `limit` (a limit of kind `short`): `None` when it fits, `Later`
/// when it may once some of `held` is given back, `Never` when it alone is over.
fn limit_fit(
    short: Short,
    held: u64,
    asked: u64,
    limit: u64,
    message: impl FnOnce() -> String,
) -> Option<Fit> {
    if asked == 0 || held + asked <= limit {
        return None;
    }
    let shortfall = Shortfall::new(short, message());
    Some(if asked > limit {
        Fit::Never(shortfall)
    } else {
        Fit::Later(shortfall)
    })
}

#[cfg(test)]
mod tests;
