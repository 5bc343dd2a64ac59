//! Reservations: a launch lease and a request permit are one thing. Each is an amount of GPU
//! memory (on GPUs it is placed on, like launches) and/or host RAM, reserved against live free
//! memory minus the floors minus every other outstanding reservation, owned by a client whose
//! identity was pinned when it connected, and ended by release, by the owner's death or closed
//! connection, or by a TTL. One admission function (`policy::admission::place`) decides both.
//!
//! The table lives behind a mutex shared by the socket thread (which admits and releases permits
//! at once, without waiting for the control loop) and the control loop (which publishes the
//! capacity after every tick, watches launched servers load, and takes the events and the
//! registrations the table wants applied). Every method is short and does no I/O but sending on
//! a client's reply channel; time comes in as the daemon clock (`now`).
//!
//! Bounds: connections per uid and in all, launches per uid, permits held and waiting per uid,
//! waiting requests per pool, the TTL and timeout of each request, the length of every string.
//! Whatever local users send, the table's size stays proportional to those caps.

pub mod account;
pub mod capacity;
pub mod lease;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::Sender;
use tokio::sync::Notify;

use crate::alert::limit::PerUid;
use crate::config::{Config, ModelAction, ModelConfig, User, Users};
use crate::ipc::peer::Peer;
use crate::ipc::{
    check_model_name, check_url, AcquireRequest, Free, LaunchRequest, Needed, RefusalReason,
    Response,
};
use crate::kinds::EventKind;
use crate::policy::admission::{place, Demand, Fit, GpuRoom, RamRoom, Shortfall};
use crate::policy::{About, Event, ModelsInForce, Severity};
use crate::snapshot::ProcessId;
use crate::status::{LeaseRow, PermitPoolRow, QueuedRow};
use crate::units::{fmt_bytes, Amount};

use account::{Account, SAMPLES_FOR_DEFAULT};
pub use capacity::Capacity;
use lease::{Lease, LeaseState, NewLease};

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
/// How long past its timeout such a request may wait for that scan (what the daemon needs to
/// decide is not the caller's wait; a forced scan comes within ~100 ms).
const UNPLACED_GRACE: Duration = Duration::from_secs(2);
/// A holder is asked to give its cache back (`Response::Trim`) at most this often.
const TRIM_EVERY: Duration = Duration::from_secs(1);

struct Conn {
    uid: u32,
    /// When it connected: its GPU admissions wait for a reading taken after that.
    since: Duration,
    peer: Option<Peer>,
    reply: Option<Sender<Response>>,
    /// Woken when answers pile up unread: the server then closes the connection.
    overflow: Arc<Notify>,
    permits: usize,
    waiting: usize,
}

#[derive(Default)]
struct UidUse {
    connections: usize,
    /// Permits held plus permit requests waiting.
    permits: usize,
    /// Launches waiting or loading.
    launches: usize,
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
    /// When it is refused for waiting too long.
    fn deadline_with_grace(&self) -> Duration {
        match self.unplaced {
            Some(_) => self.deadline + UNPLACED_GRACE,
            None => self.deadline,
        }
    }
}

enum Wanted {
    Permit { ttl: Duration },
    Launch(Box<LaunchWait>),
}

struct LaunchWait {
    request: LaunchRequest,
    pidfd: Arc<OwnedFd>,
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
    conns: HashMap<ConnId, Conn>,
    uids: HashMap<u32, UidUse>,
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
            conns: HashMap::new(),
            uids: HashMap::new(),
            launched: BTreeMap::new(),
            next_id: 0,
            events: Vec::new(),
            events_dropped: 0,
            event_limit: PerUid::default(),
            trims: HashMap::new(),
        }
    }

    /// A reloaded config: new limits, users and sizes apply to new requests.
    pub fn configure(&mut self, config: Config) {
        self.config = config;
    }

    /// Keeps an event for the next tick. Every event here is caused by a client (it names the
    /// client's uid): past the uid's share of the rate limit it is counted, not kept, so one
    /// user's request loop cannot flood the event log and the webhooks.
    fn event(&mut self, e: Event) {
        if let Some(uid) = e.about.uid {
            if !self.event_limit.admit(uid, e.kind, e.severity) {
                return;
            }
        }
        if self.events.len() < MAX_EVENTS {
            self.events.push(e);
        } else {
            self.events_dropped += 1;
        }
    }

    fn new_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    // --- connections ---------------------------------------------------------------------------

    /// A new connection from `uid`: refused when it would pass a connection cap.
    pub fn connect(&mut self, conn: ConnId, uid: u32, now: Duration) -> Result<(), String> {
        let c = &self.config.clients;
        if self.conns.len() >= c.max_connections {
            return Err(format!(
                "{} connections open (clients.max_connections)",
                self.conns.len()
            ));
        }
        let used = self.uids.entry(uid).or_default();
        if used.connections >= c.max_connections_per_uid {
            return Err(format!(
                "uid {uid} has {} connections open (clients.max_connections_per_uid)",
                used.connections
            ));
        }
        used.connections += 1;
        self.conns.insert(
            conn,
            Conn {
                uid,
                since: now,
                peer: None,
                reply: None,
                overflow: Arc::new(Notify::new()),
                permits: 0,
                waiting: 0,
            },
        );
        Ok(())
    }

    /// The connection's pinned identity and where its answers go. Returns what wakes when the
    /// client leaves its answers unread (the connection must then be closed).
    pub fn attach(&mut self, conn: ConnId, peer: Peer, reply: Sender<Response>) -> Arc<Notify> {
        match self.conns.get_mut(&conn) {
            Some(c) => {
                c.peer = Some(peer);
                c.reply = Some(reply);
                c.overflow.clone()
            }
            None => Arc::new(Notify::new()),
        }
    }

    /// How long a connection that holds nothing may stay silent.
    pub fn idle_timeout(&self) -> Duration {
        self.config.clients.idle_timeout
    }

    /// True while the connection holds a permit or waits for something: it is not idle.
    pub fn engaged(&self, conn: ConnId) -> bool {
        self.conns
            .get(&conn)
            .is_some_and(|c| c.permits > 0 || c.waiting > 0)
            || self.launch_queue.iter().any(|w| w.conn == conn)
    }

    /// The connection closed: its permits end, its requests stop waiting.
    pub fn disconnect(&mut self, conn: ConnId, now: Duration) {
        self.hang_up(conn, now);
        let Some(c) = self.conns.remove(&conn) else {
            return;
        };
        if let Some(used) = self.uids.get_mut(&c.uid) {
            used.connections = used.connections.saturating_sub(1);
        }
    }

    /// Ends what a connection holds and waits for (its caller hung up, or is being closed), but
    /// keeps it counted against the connection caps until `disconnect`: its descriptor lives
    /// on while its last answers are written.
    pub fn hang_up(&mut self, conn: ConnId, now: Duration) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        c.reply = None;
        let uid = c.uid;
        let held: Vec<u64> = self
            .holdings
            .iter()
            .filter(|(_, h)| matches!(h.kind, Held::Permit { conn: hc, .. } if hc == conn))
            .map(|(id, _)| *id)
            .collect();
        for id in held {
            self.end_permit(id, now);
        }
        for queue in self.waiting.values_mut() {
            queue.retain(|w| w.conn != conn);
        }
        let mut gone = Vec::new();
        self.launch_queue.retain(|w| {
            let keep = w.conn != conn;
            if !keep {
                gone.push((w.peer, model_label(&w.pool)));
            }
            keep
        });
        for (peer, model) in gone {
            self.uid_use(peer.uid).launches = self.uid_use(peer.uid).launches.saturating_sub(1);
            tracing::info!(
                "launch of model '{model}' by pid {} left the queue (caller hung up)",
                peer.pid
            );
        }
        self.recount_waiting(uid);
        self.admit_waiting(now);
    }

    fn uid_use(&mut self, uid: u32) -> &mut UidUse {
        self.uids.entry(uid).or_default()
    }

    /// Recounts one uid's waiting permit requests (after waiters were dropped wholesale).
    fn recount_waiting(&mut self, uid: u32) {
        let waiting: usize = self
            .waiting
            .values()
            .flatten()
            .filter(|w| w.peer.uid == uid)
            .count();
        let held = self
            .holdings
            .values()
            .filter(|h| h.peer.uid == uid && matches!(h.kind, Held::Permit { .. }))
            .count();
        self.uid_use(uid).permits = waiting + held;
        self.uids
            .retain(|_, u| u.connections + u.permits + u.launches > 0);
    }

    // --- pools and rooms -----------------------------------------------------------------------

    /// A pool's books; a new one starts from the pool's use now (its baseline).
    fn account(&mut self, pool: &Pool) -> &mut Account {
        account_in(&mut self.pools, &self.capacity, pool)
    }

    /// The models in force: the config's, then those launched without a `[[model]]`.
    fn models(&self) -> ModelsInForce<'_> {
        ModelsInForce::new(&self.config, &self.launched)
    }

    fn model_config(&self, name: &str) -> Option<&ModelConfig> {
        self.models().get(name)
    }

    /// Who may act for a model (launch it, take its permits), if it exists.
    fn users_of(&self, name: &str) -> Option<Users> {
        self.model_config(name).map(|m| m.allowed_users())
    }

    /// The room for `holder`'s next reservation of `pool` on every GPU and in RAM: free memory
    /// minus the floors and what every reservation may still take, less the holder's own cache.
    fn rooms(&self, pool: &Pool, holder: ProcessId) -> (Vec<GpuRoom>, RamRoom) {
        let consistent = self.capacity.gpu_consistent;
        let own = self.pools.get(pool);
        let gpus = self
            .capacity
            .gpus
            .iter()
            .map(|g| {
                let others: i64 = self
                    .pools
                    .iter()
                    .filter(|(p, _)| *p != pool)
                    .map(|(_, a)| a.gpu_promised(g.index, consistent) as i64)
                    .sum();
                let mine = own.map_or(0, |a| {
                    a.gpu_promised_to(holder, &self.capacity, g.index, consistent)
                });
                let room = (g.usable)
                    .then(|| g.free.map(|f| f as i64 - g.floor as i64 - others - mine))
                    .flatten();
                GpuRoom {
                    index: g.index,
                    room,
                    ceiling: g.total.map(|t| t.saturating_sub(g.floor)),
                    free: g.free.filter(|_| g.usable),
                    floor: g.floor,
                    promised: (others + mine.max(0)) as u64,
                    preferred: own.is_some_and(|a| a.on_gpu(g.index)),
                }
            })
            .collect();
        let ram = &self.capacity.ram;
        let others: i64 = self
            .pools
            .iter()
            .filter(|(p, _)| *p != pool)
            .map(|(_, a)| a.ram_promised())
            .sum();
        let mine = own.map_or(0, |a| a.ram_promised());
        let ram_room = RamRoom {
            room: ram
                .available
                .map(|a| a as i64 - ram.floor as i64 - others - mine),
            ceiling: ram.total.map(|t| t.saturating_sub(ram.floor)),
            available: ram.available,
            floor: ram.floor,
            promised: (others + mine) as u64,
        };
        (gpus, ram_room)
    }

    /// Does `demand` fit `pool` now: its model's slots and budget, then the memory.
    fn fit(&self, peer: &Peer, pool: &Pool, demand: &Demand, permit: bool) -> Fit {
        if let Some(f) = self.uid_cap_fit(peer.uid, demand) {
            return f;
        }
        if let Some(name) = pool {
            if let Some(model) = self.model_config(name) {
                if let Some(f) = self.budget_fit(name, model, demand, permit) {
                    return f;
                }
            }
        }
        let (gpus, ram) = self.rooms(pool, peer.process());
        place(demand, &gpus, &ram)
    }

    /// `fit`, on a GPU reading taken after `fresh_after` only (the request's connection's
    /// start): memory a client allocated before it asked (weights it just loaded) is in the
    /// reading its requests are decided on.
    fn fit_fresh(
        &self,
        peer: &Peer,
        pool: &Pool,
        demand: &Demand,
        permit: bool,
        fresh_after: Duration,
    ) -> Fit {
        match self.fit(peer, pool, demand, permit) {
            Fit::Now { .. } if self.stale_for(demand, fresh_after) => Fit::Later(Shortfall {
                message: "a GPU reading newer than the request".into(),
                ..Default::default()
            }),
            fit => fit,
        }
    }

    fn stale_for(&self, demand: &Demand, fresh_after: Duration) -> bool {
        demand.gpus_wanted() > 0 && self.capacity.gpu_sampled_at.is_none_or(|t| t < fresh_after)
    }

    /// True while a request waits only for a GPU reading newer than itself: the loop then has
    /// one taken at once.
    pub fn wants_fresh_gpu(&self) -> bool {
        self.waiting
            .values()
            .filter_map(VecDeque::front)
            .chain(self.launch_queue.front())
            .any(|w| self.stale_for(&w.demand, w.fresh_after))
    }

    /// Whether `demand` would come wholly out of the memory its caller's processes already hold
    /// beyond their reservations (their allocator's cache), on one GPU.
    fn held_in_own_cache(&self, peer: &Peer, pool: &Pool, demand: &Demand) -> bool {
        if demand.ram_bytes > 0 || demand.gpu_bytes_per_gpu == 0 || demand.gpu_count != 1 {
            return false;
        }
        let Some(account) = self.pools.get(pool) else {
            return false;
        };
        self.capacity
            .gpus
            .iter()
            .filter(|g| g.usable)
            .filter(|g| demand.pinned.as_ref().is_none_or(|p| p.contains(&g.index)))
            .any(|g| {
                account.own_cache_holds(
                    peer.process(),
                    &self.capacity,
                    g.index,
                    demand.gpu_bytes_per_gpu,
                )
            })
    }

    /// `[clients] max_reserved_per_uid`: what a uid other than root holds reserved (loading
    /// launches and permits) plus `demand`, against the cap: `None` when within it.
    fn uid_cap_fit(&self, uid: u32, demand: &Demand) -> Option<Fit> {
        let cap = self.config.clients.max_reserved_per_uid?;
        if uid == 0 {
            return None;
        }
        let (gpu_held, ram_held) = self
            .holdings
            .values()
            .filter(|h| h.peer.uid == uid && h.reserving())
            .fold((0u64, 0u64), |(g, r), h| {
                (
                    g + h.gpu_bytes_per_gpu * h.gpus.len() as u64,
                    r + h.ram_bytes,
                )
            });
        let gpu_total = self
            .capacity
            .gpus
            .iter()
            .map(|g| g.total)
            .sum::<Option<u64>>()
            .filter(|&t| t > 0);
        let check = |held: u64, asked: u64, total: Option<u64>, what: &str| {
            let limit = cap.resolve(total)?;
            limit_fit(held, asked, limit, || {
                format!(
                    "uid {uid}: {what} {} reserved + {} asked > {} (clients.max_reserved_per_uid)",
                    fmt_bytes(held),
                    fmt_bytes(asked),
                    fmt_bytes(limit)
                )
            })
        };
        check(gpu_held, demand.gpu_bytes_total(), gpu_total, "GPU memory")
            .or_else(|| check(ram_held, demand.ram_bytes, self.capacity.ram.total, "RAM"))
    }

    /// A model's `max_permits` and budget, before the memory: `None` when they allow it.
    fn budget_fit(
        &self,
        name: &str,
        model: &ModelConfig,
        demand: &Demand,
        permit: bool,
    ) -> Option<Fit> {
        let account = self.pools.get(&Some(name.to_string()));
        if permit {
            if let Some(max) = model.max_permits {
                let held = account.map_or(0, |a| a.permits_held);
                if held >= max as usize {
                    return Some(Fit::Later(Shortfall {
                        message: format!(
                            "model '{name}': {held} of max_permits {max} permits held"
                        ),
                        ..Default::default()
                    }));
                }
            }
        }
        let (ram_budget, gpu_budget) =
            model.budget_bytes(self.capacity.ram.total, self.capacity.largest_gpu_bytes());
        // A launched model (no `[[model]]`) gives permits only out of what it declared: one
        // that declared nothing has no budget, and its permits must not be unbounded.
        let launched = permit && self.config.model(name).is_none();
        let check = |budget: Option<u64>, committed: u64, asked: u64, what: &str| {
            let budget = if launched {
                budget.unwrap_or(0)
            } else {
                budget?
            };
            limit_fit(committed, asked, budget, || {
                format!(
                    "model '{name}': {what} {} committed + {} asked > budget {}{}",
                    fmt_bytes(committed),
                    fmt_bytes(asked),
                    fmt_bytes(budget),
                    if launched {
                        " (a launched model's permits come out of the memory its launch declared)"
                    } else {
                        ""
                    }
                )
            })
        };
        check(
            gpu_budget,
            account.map_or(0, Account::gpu_committed),
            demand.gpu_bytes_total(),
            "GPU memory",
        )
        .or_else(|| {
            check(
                ram_budget,
                account.map_or(0, Account::ram_committed),
                demand.ram_bytes,
                "RAM",
            )
        })
    }

    // --- permits -------------------------------------------------------------------------------

    /// A permit request. Answers at once (granted or refused), or `None`: it waits, and its
    /// answer goes out on the connection's reply channel.
    pub fn acquire(
        &mut self,
        conn: ConnId,
        request: AcquireRequest,
        now: Duration,
    ) -> Option<Response> {
        let id = request.id;
        let refuse = |reason, message| Some(Response::refused(Some(id), reason, message));
        let Some(peer) = self.conns.get(&conn).and_then(|c| c.peer) else {
            return refuse(RefusalReason::Invalid, "connection not ready".into());
        };
        let fresh_after = self.conns.get(&conn).map_or(now, |c| c.since);
        // Only a uid that may be some model's member waits for a scan to find its model (the
        // daemon forces scans for it): anyone else's request is decided now.
        let unplaced = request.model.is_none()
            && !self.capacity.member_of.contains_key(&peer.process())
            && self.capacity.scanned_at.is_none_or(|t| t < fresh_after)
            && self
                .models()
                .iter()
                .any(|m| m.allowed_users().member(peer.uid));
        let pool = match self.permit_pool(&peer, request.model.as_deref()) {
            Ok(pool) => pool,
            Err(_) if unplaced => None,
            Err((reason, message)) => return refuse(reason, message),
        };
        let (demand, ttl, timeout) = match self.permit_demand(&pool, &request) {
            Ok(d) => d,
            Err(message) => return refuse(RefusalReason::Invalid, message),
        };
        if !unplaced {
            self.report_cache(&pool, &peer, &request);
        }
        let duplicate = self
            .waiting
            .values()
            .flatten()
            .any(|w| w.conn == conn && w.id == id);
        if duplicate {
            return refuse(
                RefusalReason::Invalid,
                format!("request id {id} is already waiting on this connection"),
            );
        }
        let limits = self.config.permits.clone();
        let total: usize = self.uids.values().map(|u| u.permits).sum();
        let over_cap = if self.uid_use(peer.uid).permits >= limits.max_per_uid {
            Some(format!(
                "uid {} holds or waits for {} permits (permits.max_per_uid)",
                peer.uid, limits.max_per_uid
            ))
        } else if total >= limits.max_total {
            Some(format!(
                "{total} permits held or waiting (permits.max_total)"
            ))
        } else {
            None
        };
        if let Some(message) = over_cap {
            let reason = RefusalReason::QueueFull;
            return Some(self.refusal(id, &peer, &pool, &demand, reason, message));
        }
        let queued = self
            .waiting
            .get(&pool)
            .map_or(0, |q| q.iter().filter(|w| w.unplaced.is_none()).count());
        let fit = match self.fit_fresh(&peer, &pool, &demand, true, fresh_after) {
            Fit::Now { .. } | Fit::Never(_) if unplaced => Fit::Later(Shortfall {
                message: UNPLACED.into(),
                ..Default::default()
            }),
            // First come, first served: nobody overtakes a request of the same pool that waits,
            // but for one its own cache holds (it takes nothing the others wait for).
            Fit::Now { .. } if queued > 0 && !self.held_in_own_cache(&peer, &pool, &demand) => {
                Fit::Later(Shortfall {
                    message: format!("{queued} request(s) of this model wait ahead"),
                    ..Default::default()
                })
            }
            fit => fit,
        };
        match fit {
            Fit::Now { gpus } => {
                self.uid_use(peer.uid).permits += 1;
                Some(self.grant(conn, id, peer, pool, &demand, gpus, ttl, now, now))
            }
            Fit::Never(s) => {
                let message = format!("{}: can never fit: {}", model_label(&pool), s.message);
                Some(self.refusal_with(id, &pool, &demand, RefusalReason::TooLarge, message, &s))
            }
            Fit::Later(s) => {
                if queued >= limits.queue {
                    let reason = if s.message.contains("max_permits") {
                        RefusalReason::MaxPermits
                    } else {
                        RefusalReason::QueueFull
                    };
                    let message = format!(
                        "{}: {queued} requests wait already (permits.queue); {}",
                        model_label(&pool),
                        s.message
                    );
                    return Some(self.refusal_with(id, &pool, &demand, reason, message, &s));
                }
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.waiting += 1;
                }
                self.uid_use(peer.uid).permits += 1;
                self.waiting
                    .entry(pool.clone())
                    .or_default()
                    .push_back(Waiter {
                        conn,
                        id,
                        peer,
                        pool,
                        demand,
                        arrived: now,
                        deadline: now + timeout,
                        fresh_after,
                        wanted: Wanted::Permit { ttl },
                        waiting_for: s.message,
                        told: true,
                        unplaced: unplaced.then(|| Box::new(request)),
                    });
                None
            }
        }
    }

    /// The pool a permit request belongs to, if the caller may use it.
    fn permit_pool(
        &self,
        peer: &Peer,
        model: Option<&str>,
    ) -> Result<Pool, (RefusalReason, String)> {
        let own = self.capacity.member_of.get(&peer.process()).cloned();
        let Some(name) = model else {
            if own.is_none() && !self.config.permits.host_pool_users().may_act(peer.uid) {
                return Err((
                    RefusalReason::NotAllowed,
                    format!(
                        "uid {} may not take permits from the host-wide pool (permits.users): \
                         name a model you are a user of",
                        peer.uid
                    ),
                ));
            }
            return Ok(own);
        };
        check_model_name(name).map_err(|e| (RefusalReason::Invalid, e))?;
        let Some(users) = self.users_of(name) else {
            return Err((
                RefusalReason::Invalid,
                format!("no model '{name}' (not in the config, not launched)"),
            ));
        };
        if users.may_act(peer.uid) || own.as_deref() == Some(name) {
            Ok(Some(name.to_string()))
        } else {
            Err((
                RefusalReason::NotAllowed,
                format!(
                    "uid {} may not take permits for model '{name}' (not one of its users)",
                    peer.uid
                ),
            ))
        }
    }

    /// What the caller's allocator says it caches (`cache_bytes`), for its books in `pool`.
    fn report_cache(&mut self, pool: &Pool, peer: &Peer, request: &AcquireRequest) {
        if let Some(bytes) = request.cache_bytes {
            account_in(&mut self.pools, &self.capacity, pool).report_cache(
                peer.process(),
                &self.capacity,
                bytes.min(MAX_BYTES),
            );
        }
    }

    /// What a permit request asks for, with its defaults and caps applied.
    fn permit_demand(
        &self,
        pool: &Pool,
        r: &AcquireRequest,
    ) -> Result<(Demand, Duration, Duration), String> {
        let limits = &self.config.permits;
        let gpu_bytes = match r.gpu_bytes {
            Some(b) => b,
            None => self.default_permit_size(pool),
        };
        let ram_bytes = r.ram_bytes.unwrap_or(0);
        if gpu_bytes > MAX_BYTES || ram_bytes > MAX_BYTES {
            return Err("gpu_bytes and ram_bytes must be below 1 PiB".into());
        }
        let ttl = r
            .ttl_ms
            .map_or(limits.default_ttl, Duration::from_millis)
            .min(limits.max_ttl);
        let timeout = r
            .timeout_ms
            .map_or(limits.default_timeout, Duration::from_millis)
            .min(limits.max_timeout);
        let demand = Demand {
            gpu_bytes_per_gpu: gpu_bytes,
            gpu_count: u32::from(gpu_bytes > 0 || r.gpu.is_some()),
            pinned: r.gpu.map(|g| vec![g]),
            ram_bytes,
        };
        Ok((demand, ttl, timeout))
    }

    /// The size of a permit that names none: the pool's observed p95 once known (never for an
    /// engine that preallocates), else its model's `permit_gpu_memory`, else 0 (a slot).
    fn default_permit_size(&self, pool: &Pool) -> u64 {
        let preallocated = pool
            .as_ref()
            .is_some_and(|name| self.capacity.preallocated.contains(name));
        let learner = self.pools.get(pool).map(|a| &a.learner);
        // An engine that preallocated its KV cache (its metrics say so) serves requests out of
        // it: a permit is a slot, whatever its warm-up taught the learner.
        let learner = learner.filter(|_| !preallocated);
        if let Some(l) = learner.filter(|l| l.samples() >= SAMPLES_FOR_DEFAULT) {
            if let Some(p95) = l.quantile(0.95) {
                return p95;
            }
        }
        pool.as_deref()
            .and_then(|name| self.model_config(name))
            .and_then(|m| m.permit_gpu_memory)
            .and_then(|a| a.resolve(self.capacity.largest_gpu_bytes()))
            .unwrap_or(0)
    }

    /// Grants a permit (the uid's count already includes it: as a waiter, or just before).
    #[allow(clippy::too_many_arguments)]
    fn grant(
        &mut self,
        conn: ConnId,
        id: u64,
        peer: Peer,
        pool: Pool,
        demand: &Demand,
        gpus: Vec<u32>,
        ttl: Duration,
        arrived: Duration,
        now: Duration,
    ) -> Response {
        let permit = self.new_id();
        let capacity = &self.capacity;
        let account = account_in(&mut self.pools, capacity, &pool);
        account.reserve(
            peer.process(),
            capacity,
            (&gpus, demand.gpu_bytes_per_gpu, demand.ram_bytes),
            now,
        );
        account.permit_granted();
        account.counts.granted += 1;
        let waited = now.saturating_sub(arrived);
        if !waited.is_zero() {
            account.counts.granted_after_wait += 1;
        }
        if let Some(c) = self.conns.get_mut(&conn) {
            c.permits += 1;
        }
        let gpu = gpus.first().copied();
        self.holdings.insert(
            permit,
            Holding {
                pool: pool.clone(),
                peer,
                gpus,
                gpu_bytes_per_gpu: demand.gpu_bytes_per_gpu,
                ram_bytes: demand.ram_bytes,
                granted_at: now,
                kind: Held::Permit {
                    conn,
                    expires_at: now + ttl,
                },
            },
        );
        if waited >= Duration::from_millis(1) {
            self.event(
                Event::new(
                    Severity::Info,
                    EventKind::PermitGranted,
                    format!(
                        "permit {permit} for {}: GPU {} RAM {} granted to pid {} after waiting {}",
                        model_label(&pool),
                        fmt_bytes(demand.gpu_bytes_per_gpu),
                        fmt_bytes(demand.ram_bytes),
                        peer.pid,
                        humantime::format_duration(Duration::from_millis(ms(waited)))
                    ),
                )
                .about(about(&pool, &peer)),
            );
        }
        Response::Granted {
            id,
            permit,
            gpu,
            gpu_bytes: demand.gpu_bytes_per_gpu,
            ram_bytes: demand.ram_bytes,
            waited_ms: ms(waited),
            ttl_ms: ms(ttl),
        }
    }

    fn refusal(
        &mut self,
        id: u64,
        peer: &Peer,
        pool: &Pool,
        demand: &Demand,
        reason: RefusalReason,
        message: String,
    ) -> Response {
        let (gpus, ram) = self.rooms(pool, peer.process());
        let best = demand
            .pinned
            .as_ref()
            .and_then(|p| p.first())
            .and_then(|i| gpus.iter().find(|g| g.index == *i))
            .or_else(|| gpus.iter().max_by_key(|g| g.room));
        let shortfall = Shortfall {
            free_gpu_bytes: best.and_then(|g| g.room).map(|r| r.max(0) as u64),
            free_ram_bytes: ram.room.map(|r| r.max(0) as u64),
            gpu: best.map(|g| g.index),
            message: String::new(),
        };
        self.refusal_with(id, pool, demand, reason, message, &shortfall)
    }

    fn refusal_with(
        &mut self,
        id: u64,
        pool: &Pool,
        demand: &Demand,
        reason: RefusalReason,
        message: String,
        shortfall: &Shortfall,
    ) -> Response {
        let account = self.account(pool);
        account.counts.refused += 1;
        let retry_after = match reason {
            RefusalReason::Timeout | RefusalReason::QueueFull | RefusalReason::MaxPermits => {
                Some(ms(account
                    .learner
                    .typical_hold()
                    .unwrap_or(Duration::from_secs(1))
                    .clamp(Duration::from_millis(100), Duration::from_secs(60))))
            }
            _ => None,
        };
        Response::Refused {
            id: Some(id),
            reason,
            message,
            retry_after_ms: retry_after,
            needed: Needed {
                gpu_bytes: demand.gpu_bytes_per_gpu,
                ram_bytes: demand.ram_bytes,
                gpu: demand
                    .pinned
                    .as_ref()
                    .and_then(|p| p.first().copied())
                    .or(shortfall.gpu),
            },
            free: Free {
                gpu_bytes: shortfall.free_gpu_bytes,
                ram_bytes: shortfall.free_ram_bytes,
            },
        }
    }

    /// The holder gives a permit back.
    pub fn release_permit(
        &mut self,
        conn: ConnId,
        id: u64,
        permit: u64,
        now: Duration,
    ) -> Response {
        let owned = self
            .holdings
            .get(&permit)
            .is_some_and(|h| matches!(h.kind, Held::Permit { conn: c, .. } if c == conn));
        if !owned {
            return Response::Error {
                id: Some(id),
                message: format!("permit {permit} is not held by this connection"),
            };
        }
        self.end_permit(permit, now);
        self.admit_waiting(now);
        Response::Released {
            lease: None,
            id: Some(id),
            permit: Some(permit),
        }
    }

    /// Ends a permit: its memory is free for others.
    fn end_permit(&mut self, permit: u64, now: Duration) {
        let Some(h) = self.holdings.remove(&permit) else {
            return;
        };
        if let Held::Permit { conn, .. } = h.kind {
            if let Some(c) = self.conns.get_mut(&conn) {
                c.permits = c.permits.saturating_sub(1);
            }
        }
        let used = self.uid_use(h.peer.uid);
        used.permits = used.permits.saturating_sub(1);
        if let Some(a) = self.pools.get_mut(&h.pool) {
            a.unreserve(
                h.peer.process(),
                (&h.gpus, h.gpu_bytes_per_gpu, h.ram_bytes),
                now,
            );
            a.permit_ended(now.saturating_sub(h.granted_at));
        }
    }

    /// The client stopped waiting for request `id`.
    pub fn cancel(&mut self, conn: ConnId, id: u64) -> Option<Response> {
        let waiter = self.take_waiter(|w| w.conn == conn && w.id == id)?;
        self.forget_waiter(&waiter);
        self.waiting.retain(|_, q| !q.is_empty());
        Some(Response::refused(
            Some(id),
            RefusalReason::Cancelled,
            format!("request {id} cancelled by the client"),
        ))
    }

    /// Removes the first waiting permit request that `which` picks.
    fn take_waiter(&mut self, which: impl Fn(&Waiter) -> bool) -> Option<Waiter> {
        for queue in self.waiting.values_mut() {
            if let Some(i) = queue.iter().position(&which) {
                return queue.remove(i);
            }
        }
        None
    }

    /// The counters of a permit request that stopped waiting without a permit.
    fn forget_waiter(&mut self, w: &Waiter) {
        if let Some(c) = self.conns.get_mut(&w.conn) {
            c.waiting = c.waiting.saturating_sub(1);
        }
        let used = self.uid_use(w.peer.uid);
        used.permits = used.permits.saturating_sub(1);
    }

    // --- launches ------------------------------------------------------------------------------

    /// A launch request. Returns the answer to send now: `admitted` or `refused`, `queued` (it
    /// waits; the final answer follows on the reply channel), or `None` when it only waits for a
    /// GPU reading newer than itself (then `queued` is sent only if it has to wait for more).
    pub fn launch(
        &mut self,
        conn: ConnId,
        request: LaunchRequest,
        pidfd: Arc<OwnedFd>,
        now: Duration,
    ) -> Option<Response> {
        let refuse = |reason, message| Some(Response::refused(None, reason, message));
        let Some(peer) = self.conns.get(&conn).and_then(|c| c.peer) else {
            return refuse(RefusalReason::Invalid, "connection not ready".into());
        };
        let request = match self.check_launch(&peer, request) {
            Ok(r) => r,
            Err((reason, message)) => return refuse(reason, message),
        };
        let l = &self.config.launch;
        let ready_timeout = request
            .ready_timeout_ms
            .map_or(l.ready_timeout, Duration::from_millis)
            .min(l.max_ready_timeout);
        let queue_timeout = request
            .queue_timeout_ms
            .map_or(l.queue_timeout, Duration::from_millis)
            .min(l.max_queue_timeout);
        let demand = match self.launch_demand(&request) {
            Ok(d) => d,
            Err(message) => return refuse(RefusalReason::Invalid, message),
        };
        let pool = Some(request.model.clone());
        let waiter = Waiter {
            conn,
            id: 0,
            peer,
            pool,
            demand,
            arrived: now,
            deadline: now + queue_timeout,
            fresh_after: self.conns.get(&conn).map_or(now, |c| c.since),
            unplaced: None,
            wanted: Wanted::Launch(Box::new(LaunchWait {
                request,
                pidfd,
                ready_timeout,
                queue_timeout,
            })),
            waiting_for: String::new(),
            told: true,
        };
        self.uid_use(peer.uid).launches += 1;
        let slot = self.queue_slot(peer.uid);
        let alone = slot == 0;
        match self.launch_fit(&waiter) {
            Fit::Now { gpus } if alone => Some(self.admit_launch(waiter, gpus, now)),
            Fit::Never(s) => {
                self.uid_use(peer.uid).launches -= 1;
                let Wanted::Launch(l) = &waiter.wanted else {
                    unreachable!()
                };
                refuse(
                    RefusalReason::TooLarge,
                    format!(
                        "model '{}' not started: it can never fit on this host: {}",
                        l.request.model, s.message
                    ),
                )
            }
            // Only a GPU reading newer than the request is missing: it comes within a tick.
            Fit::Later(_) if alone && self.only_stale(&waiter) => {
                let mut waiter = waiter;
                waiter.told = false;
                self.launch_queue.insert(slot, waiter);
                None
            }
            fit => {
                let mut waiter = waiter;
                // Behind others it waits for its turn first (what it waits for at the head is
                // said once it gets there).
                waiter.waiting_for = match fit {
                    Fit::Later(s) if alone => s.message,
                    _ => "its turn: launches ahead of it in the queue".into(),
                };
                let answer = self.queued(&waiter, slot + 1);
                self.launch_queue.insert(slot, waiter);
                Some(answer)
            }
        }
    }

    /// True if a launch would be admitted now but for a GPU reading older than itself.
    fn only_stale(&self, w: &Waiter) -> bool {
        self.stale_for(&w.demand, w.fresh_after)
            && matches!(self.launch_fit_now(w), Fit::Now { .. })
    }

    /// The `queued` answer (logged once).
    fn queued(&self, w: &Waiter, position: usize) -> Response {
        tracing::info!(
            "launch of model '{}' by pid {} (uid {}) queued at position {position}: {}",
            model_label(&w.pool),
            w.peer.pid,
            w.peer.uid,
            w.waiting_for
        );
        Response::Queued {
            position,
            waiting_for: w.waiting_for.clone(),
        }
    }

    /// Bounds and authorizes a launch request.
    fn check_launch(
        &mut self,
        peer: &Peer,
        mut r: LaunchRequest,
    ) -> Result<LaunchRequest, (RefusalReason, String)> {
        let invalid = |e: String| (RefusalReason::Invalid, e);
        check_model_name(&r.model).map_err(|e| invalid(format!("--model: {e}")))?;
        if let Some(url) = &r.ready_url {
            check_url("--ready-url", url).map_err(invalid)?;
            crate::config::check_ready_url(url).map_err(|e| invalid(format!("--ready-url {e}")))?;
        }
        if let Some(url) = &r.metrics_url {
            crate::config::check_metrics_url(url)
                .map_err(|e| invalid(format!("--metrics-url {e}")))?;
        }
        if r.cuda_visible_devices
            .as_ref()
            .is_some_and(|v| v.len() > 1024)
        {
            return Err(invalid("CUDA_VISIBLE_DEVICES is too long".into()));
        }
        r.command.truncate(MAX_COMMAND_WORDS);
        let mut budget = MAX_COMMAND_BYTES;
        for word in &mut r.command {
            let mut keep = budget.min(word.len());
            while !word.is_char_boundary(keep) {
                keep -= 1;
            }
            word.truncate(keep);
            budget -= keep;
        }
        let name = r.model.clone();
        // A launched model's users are its launcher.
        let allowed = match self.model_config(&name) {
            Some(m) => m.allowed_users().may_act(peer.uid),
            None => !self
                .launch_queue
                .iter()
                .any(|w| w.pool.as_deref() == Some(&name) && w.peer.uid != peer.uid),
        };
        if !allowed {
            return Err((
                RefusalReason::NotAllowed,
                format!(
                    "uid {} may not launch model '{name}': it belongs to other users (its [[model]] users, or whoever launched it first)",
                    peer.uid
                ),
            ));
        }
        let c = &self.config.clients;
        let leases_of = |uid: Option<u32>| {
            self.holdings
                .values()
                .filter(|h| matches!(h.kind, Held::Lease(_)) && uid.is_none_or(|u| h.peer.uid == u))
                .count()
        };
        if leases_of(Some(peer.uid)) >= c.max_leases_per_uid || leases_of(None) >= c.max_leases {
            return Err((
                RefusalReason::QueueFull,
                format!(
                    "too many launched models still running (clients.max_leases_per_uid {}, max_leases {})",
                    c.max_leases_per_uid, c.max_leases
                ),
            ));
        }
        let max = self.config.clients.max_launches_per_uid;
        if self.uid_use(peer.uid).launches >= max {
            return Err((
                RefusalReason::QueueFull,
                format!(
                    "uid {} has {max} launches waiting or loading (clients.max_launches_per_uid)",
                    peer.uid
                ),
            ));
        }
        Ok(r)
    }

    /// What a launch declares: its flags, else its `[[model]]` budgets.
    fn launch_demand(&self, r: &LaunchRequest) -> Result<Demand, String> {
        let (ram_budget, gpu_budget) = self.config.model(&r.model).map_or((None, None), |m| {
            m.budget_bytes(self.capacity.ram.total, self.capacity.largest_gpu_bytes())
        });
        let gpu_bytes = r.gpu_memory_bytes.or(gpu_budget).unwrap_or(0);
        let ram_bytes = r.ram_bytes.or(ram_budget).unwrap_or(0);
        if gpu_bytes > MAX_BYTES || ram_bytes > MAX_BYTES {
            return Err("--gpu-mem and --ram must be below 1 PiB".into());
        }
        let pinned = match (r.gpu, &r.cuda_visible_devices) {
            (Some(index), _) => Some(vec![index]),
            (None, Some(visible)) if !visible.trim().is_empty() => {
                Some(parse_visible_devices(visible, &self.capacity)?)
            }
            _ => None,
        };
        let count = match (&pinned, r.gpus) {
            (Some(p), _) => p.len() as u32,
            (None, Some(n)) if n > 64 => return Err("--gpus: at most 64".into()),
            (None, Some(n)) => n.max(1),
            (None, None) => u32::from(gpu_bytes > 0),
        };
        Ok(Demand {
            gpu_bytes_per_gpu: gpu_bytes.div_ceil(u64::from(count.max(1))),
            gpu_count: count,
            pinned,
            ram_bytes,
        })
    }

    /// Models loading that hold the launch lock against a launch by `uid`: all of them, but for
    /// root only root's (another user's launch that loads for hours, or never, must not keep the
    /// host's own servers from starting; memory admission still counts it).
    fn loading_against(&self, uid: u32) -> usize {
        self.holdings
            .values()
            .filter(|h| h.loading())
            .filter(|h| !privileged(uid) || privileged(h.peer.uid))
            .count()
    }

    /// Where a launch by `uid` joins the queue: root's launches go ahead of everyone else's (first
    /// come, first served within each), so no user can hold them back.
    fn queue_slot(&self, uid: u32) -> usize {
        if privileged(uid) {
            self.launch_queue
                .iter()
                .take_while(|w| privileged(w.peer.uid))
                .count()
        } else {
            self.launch_queue.len()
        }
    }

    /// A launch fits when the lock is free, no warn floor is crossed and its memory fits.
    fn launch_fit(&self, w: &Waiter) -> Fit {
        match self.launch_fit_now(w) {
            Fit::Now { .. } if self.stale_for(&w.demand, w.fresh_after) => Fit::Later(Shortfall {
                message: "a GPU reading newer than the request".into(),
                ..Default::default()
            }),
            fit => fit,
        }
    }

    /// `launch_fit` on the reading there is, however old.
    fn launch_fit_now(&self, w: &Waiter) -> Fit {
        let fit = self.fit(&w.peer, &w.pool, &w.demand, false);
        if matches!(fit, Fit::Never(_)) {
            return fit;
        }
        let max = self.config.launch.max_loading;
        if self.loading_against(w.peer.uid) >= max {
            return Fit::Later(Shortfall {
                message: "the launch lock: another model is loading".into(),
                ..Default::default()
            });
        }
        if let Some(why) = &self.capacity.launch_pause {
            return Fit::Later(Shortfall {
                message: why.clone(),
                ..Default::default()
            });
        }
        fit
    }

    fn admit_launch(&mut self, w: Waiter, gpus: Vec<u32>, now: Duration) -> Response {
        let Wanted::Launch(l) = w.wanted else {
            unreachable!("only launches are admitted here")
        };
        let LaunchWait {
            request,
            pidfd,
            ready_timeout,
            ..
        } = *l;
        let lease_id = self.new_id();
        let model = request.model.clone();
        let need = &w.demand;
        let mut env = vec![
            ("GPUGUARD_MODEL".to_string(), model.clone()),
            ("GPUGUARD_LEASE".to_string(), lease_id.to_string()),
            (
                "GPUGUARD_GPU_MEMORY_BYTES".to_string(),
                need.gpu_bytes_total().to_string(),
            ),
            ("GPUGUARD_RAM_BYTES".to_string(), need.ram_bytes.to_string()),
        ];
        if !gpus.is_empty() {
            let list: Vec<String> = gpus.iter().map(u32::to_string).collect();
            // NVML numbers GPUs by PCI bus id; make CUDA number them the same way.
            env.push(("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into()));
            env.push(("CUDA_VISIBLE_DEVICES".into(), list.join(",")));
            if let Some(fraction) = self.memory_fraction(&gpus, need.gpu_bytes_per_gpu) {
                env.push(("GPUGUARD_GPU_MEMORY_FRACTION".into(), fraction));
            }
        }
        let capacity = &self.capacity;
        let account = account_in(&mut self.pools, capacity, &w.pool);
        account.reserve(
            w.peer.process(),
            capacity,
            (&gpus, need.gpu_bytes_per_gpu, need.ram_bytes),
            now,
        );
        let by_gpu = need.gpu_bytes_per_gpu > 0;
        let usage = if by_gpu {
            account.usage().gpu_total_bytes()
        } else {
            account.usage().ram_bytes
        };
        // Also kept for a configured model launched with a metrics URL (its [[model]] wins
        // for everything else).
        if self.config.model(&model).is_none() || request.metrics_url.is_some() {
            let launched = self
                .launched
                .entry(model.clone())
                .or_insert_with(|| launched_model_config(&model, w.peer.uid, need));
            if request.metrics_url.is_some() {
                launched.metrics_url = request.metrics_url.clone();
            }
        }
        let ready_url = request
            .ready_url
            .clone()
            .or_else(|| lease::guess_ready_url(&request.command));
        self.event(
            Event::new(
                Severity::Info,
                EventKind::LaunchAdmitted,
                format!(
                    "model '{model}' admitted as lease {lease_id} (pid {}, uid {}) on GPU(s) {gpus:?}: GPU {} RAM {}; waited {}{}",
                    w.peer.pid,
                    w.peer.uid,
                    fmt_bytes(need.gpu_bytes_total()),
                    fmt_bytes(need.ram_bytes),
                    humantime::format_duration(Duration::from_millis(ms(now.saturating_sub(w.arrived)))),
                    match (&request.ready_url, &ready_url) {
                        (None, Some(url)) => format!("; ready when {url} answers (a known server)"),
                        _ => String::new(),
                    }
                ),
            )
            .about(about(&w.pool, &w.peer)),
        );
        let lease = Lease::new(
            NewLease {
                model,
                pidfd,
                ready_timeout,
                by_gpu,
                command: request.command.join(" "),
                ready_url,
            },
            usage,
            now,
        );
        self.holdings.insert(
            lease_id,
            Holding {
                pool: w.pool,
                peer: w.peer,
                gpus: gpus.clone(),
                gpu_bytes_per_gpu: need.gpu_bytes_per_gpu,
                ram_bytes: need.ram_bytes,
                granted_at: now,
                kind: Held::Lease(Box::new(lease)),
            },
        );
        Response::Admitted {
            lease: lease_id,
            gpus,
            env,
        }
    }

    /// The share of its GPUs a launch may take, for `vllm --gpu-memory-utilization`: its
    /// per-GPU need over the smallest chosen GPU's memory, rounded down.
    fn memory_fraction(&self, gpus: &[u32], per_gpu: u64) -> Option<String> {
        let total = gpus
            .iter()
            .filter_map(|g| self.capacity.gpu(*g).and_then(|c| c.total))
            .min()?;
        if per_gpu == 0 || total == 0 {
            return None;
        }
        let fraction = (per_gpu as f64 / total as f64).min(1.0);
        Some(format!("{:.4}", (fraction * 10_000.0).floor() / 10_000.0))
    }

    /// Ends a launch's loading early: its owner or root only.
    pub fn release_lease(&mut self, peer: Peer, lease: u64, now: Duration) -> Response {
        let Some(h) = self.holdings.get_mut(&lease) else {
            return Response::Error {
                id: None,
                message: format!("no lease {lease}"),
            };
        };
        if !peer.is_root() && h.peer.uid != peer.uid {
            return Response::Error {
                id: None,
                message: format!(
                    "lease {lease} belongs to uid {}, not to uid {}",
                    h.peer.uid, peer.uid
                ),
            };
        }
        let Held::Lease(l) = &mut h.kind else {
            return Response::Error {
                id: None,
                message: format!("{lease} is a permit, not a lease"),
            };
        };
        let model = l.model.clone();
        if l.state == LeaseState::Loading {
            self.lease_ready(lease, now);
        }
        tracing::info!(
            "lease {lease} of model '{model}' released by uid {}",
            peer.uid
        );
        self.admit_waiting(now);
        Response::Released {
            lease: Some(lease),
            id: None,
            permit: None,
        }
    }

    /// A lease's model is loaded: its memory is now the model's own.
    fn lease_ready(&mut self, lease: u64, now: Duration) {
        let Some(h) = self.holdings.get_mut(&lease) else {
            return;
        };
        if let Held::Lease(l) = &mut h.kind {
            l.set_ready();
        }
        let (pool, gpus, per_gpu, ram) = (
            h.pool.clone(),
            h.gpus.clone(),
            h.gpu_bytes_per_gpu,
            h.ram_bytes,
        );
        let (uid, holder) = (h.peer.uid, h.peer.process());
        if let Some(a) = self.pools.get_mut(&pool) {
            a.unreserve(holder, (&gpus, per_gpu, ram), now);
            a.rebase(holder);
        }
        let used = self.uid_use(uid);
        used.launches = used.launches.saturating_sub(1);
    }

    // --- time ----------------------------------------------------------------------------------

    /// Requests whose wait is over are refused; permits past their TTL are revoked.
    pub fn expire(&mut self, now: Duration) {
        let mut changed = false;
        let pools: Vec<Pool> = self.waiting.keys().cloned().collect();
        for pool in pools {
            while let Some(i) = self
                .waiting
                .get(&pool)
                .and_then(|q| q.iter().position(|w| w.deadline_with_grace() <= now))
            {
                let w = self.waiting.get_mut(&pool).and_then(|q| q.remove(i));
                let Some(w) = w else { break };
                self.forget_waiter(&w);
                self.time_out_permit(w, now);
                changed = true;
            }
        }
        while let Some(i) = self.launch_queue.iter().position(|w| w.deadline <= now) {
            let w = self.launch_queue.remove(i).expect("index is valid");
            self.time_out_launch(w);
            changed = true;
        }
        let expired: Vec<u64> = self
            .holdings
            .iter()
            .filter(|(_, h)| matches!(h.kind, Held::Permit { expires_at, .. } if expires_at <= now))
            .map(|(id, _)| *id)
            .collect();
        for permit in expired {
            self.revoke(permit, now);
            changed = true;
        }
        self.waiting.retain(|_, q| !q.is_empty());
        if changed {
            self.admit_waiting(now);
        }
    }

    fn time_out_permit(&mut self, w: Waiter, now: Duration) {
        let fit = self.fit(&w.peer, &w.pool, &w.demand, true);
        let shortfall = match fit {
            Fit::Later(s) | Fit::Never(s) => s,
            Fit::Now { .. } => Shortfall {
                message: w.waiting_for.clone(),
                ..Default::default()
            },
        };
        let message = format!(
            "{}: needs GPU {} RAM {}, not free within {}: {}",
            model_label(&w.pool),
            fmt_bytes(w.demand.gpu_bytes_total()),
            fmt_bytes(w.demand.ram_bytes),
            humantime::format_duration(Duration::from_millis(ms(now.saturating_sub(w.arrived)))),
            shortfall.message
        );
        let response = self.refusal_with(
            w.id,
            &w.pool,
            &w.demand,
            RefusalReason::Timeout,
            message.clone(),
            &shortfall,
        );
        self.event(
            // Info: a client's own request not granted in time (its answer says so); not news
            // for the operator, and a client can cause thousands a second.
            Event::new(
                Severity::Info,
                EventKind::PermitTimedOut,
                format!("permit for pid {} refused: {message}", w.peer.pid),
            )
            .about(about(&w.pool, &w.peer)),
        );
        self.send(w.conn, response);
    }

    fn time_out_launch(&mut self, w: Waiter) {
        let used = self.uid_use(w.peer.uid);
        used.launches = used.launches.saturating_sub(1);
        let Wanted::Launch(l) = &w.wanted else {
            return;
        };
        let message = format!(
            "model '{}' not started: it did not fit within the queue timeout of {}: {}",
            l.request.model,
            humantime::format_duration(l.queue_timeout),
            w.waiting_for
        );
        self.event(
            // Info: the client hears of it; a client's loop could make many.
            Event::new(
                Severity::Info,
                EventKind::LaunchTimedOut,
                format!("{message} (pid {})", w.peer.pid),
            )
            .about(about(&w.pool, &w.peer)),
        );
        self.send(w.conn, Response::TimedOut { message });
    }

    fn revoke(&mut self, permit: u64, now: Duration) {
        let Some(h) = self.holdings.get(&permit) else {
            return;
        };
        let Held::Permit { conn, .. } = h.kind else {
            return;
        };
        let (pool, peer) = (h.pool.clone(), h.peer);
        let held_for = now.saturating_sub(h.granted_at);
        self.end_permit(permit, now);
        if let Some(a) = self.pools.get_mut(&pool) {
            a.counts.expired += 1;
        }
        let message = format!(
            "permit {permit} of {} held by pid {} for {}, past its TTL: revoked",
            model_label(&pool),
            peer.pid,
            humantime::format_duration(Duration::from_millis(ms(held_for)))
        );
        self.event(
            // Info: the holder's own permit ended (it is told); client-caused.
            Event::new(Severity::Info, EventKind::PermitExpired, message.clone())
                .about(about(&pool, &peer)),
        );
        self.send(conn, Response::Expired { permit, message });
    }

    fn send(&self, conn: ConnId, response: Response) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        if let Some(reply) = &c.reply {
            if reply.try_send(response).is_err() {
                // Full: the client does not read its answers. Closing the connection ends
                // what it holds, so no permit stays granted to someone who never heard of it.
                c.overflow.notify_one();
            }
        }
    }

    /// Lets in what fits now: the heads of the permit queues, then the head of the launches.
    pub fn admit_waiting(&mut self, now: Duration) {
        self.place_unplaced(now);
        let pools: Vec<Pool> = self.waiting.keys().cloned().collect();
        let mut starved = Vec::new();
        for pool in pools {
            // In order; behind one that waits, only those their own cache holds go ahead.
            // Requests still looking for their model are not ahead of anyone.
            let (mut i, mut blocked) = (0, false);
            while let Some(w) = self.waiting.get(&pool).and_then(|q| q.get(i)) {
                if w.unplaced.is_some() {
                    i += 1;
                    continue;
                }
                let fit = self.fit_fresh(&w.peer, &pool, &w.demand, true, w.fresh_after);
                let may_go = !blocked || self.held_in_own_cache(&w.peer, &pool, &w.demand);
                match fit {
                    Fit::Now { gpus } if may_go => {
                        let w = self
                            .waiting
                            .get_mut(&pool)
                            .and_then(|q| q.remove(i))
                            .expect("it exists");
                        if let Some(c) = self.conns.get_mut(&w.conn) {
                            c.waiting = c.waiting.saturating_sub(1);
                        }
                        let Wanted::Permit { ttl } = w.wanted else {
                            continue;
                        };
                        let response = self.grant(
                            w.conn,
                            w.id,
                            w.peer,
                            pool.clone(),
                            &w.demand,
                            gpus,
                            ttl,
                            w.arrived,
                            now,
                        );
                        self.send(w.conn, response);
                    }
                    Fit::Now { .. } => i += 1,
                    Fit::Later(s) | Fit::Never(s) => {
                        if let Some(w) = self.waiting.get_mut(&pool).and_then(|q| q.get_mut(i)) {
                            w.waiting_for = s.message;
                            if !blocked && w.demand.gpu_bytes_total() > 0 {
                                starved.push((pool.clone(), w.peer));
                            }
                        }
                        blocked = true;
                        i += 1;
                    }
                }
            }
        }
        self.waiting.retain(|_, q| !q.is_empty());
        for (pool, peer) in starved {
            self.ask_to_trim(&pool, &peer, now);
        }
        while let Some(head) = self.launch_queue.front() {
            match self.launch_fit(head) {
                Fit::Now { gpus } => {
                    let w = self.launch_queue.pop_front().expect("head exists");
                    let conn = w.conn;
                    let response = self.admit_launch(w, gpus, now);
                    self.send(conn, response);
                }
                Fit::Later(s) | Fit::Never(s) => {
                    let stale_only = self.only_stale(head);
                    let Some(head) = self.launch_queue.front_mut() else {
                        break;
                    };
                    head.waiting_for = s.message;
                    if !head.told && !stale_only {
                        // It waits for more than a fresh reading: say so now, once.
                        head.told = true;
                        let answer = self.queued(&self.launch_queue[0], 1);
                        self.send(self.launch_queue[0].conn, answer);
                    }
                    break;
                }
            }
        }
    }

    /// The head of `pool`'s queue waits for GPU memory: the pool's other holders that keep
    /// memory cached unused are asked to give it back (`Response::Trim`, at most once per
    /// `TRIM_EVERY` each), those of the waiting request's uid only: a request never costs
    /// another user's server its cache.
    fn ask_to_trim(&mut self, pool: &Pool, waiting: &Peer, now: Duration) {
        let Some(account) = self.pools.get(pool) else {
            return;
        };
        let mut asks: Vec<(ProcessId, u32, u64)> = Vec::new();
        for g in self.capacity.gpus.iter().filter(|g| g.usable) {
            for (holder, bytes) in account.idle_caches(&self.capacity, g.index) {
                if holder != waiting.process() && !asks.iter().any(|(h, ..)| *h == holder) {
                    asks.push((holder, g.index, bytes));
                }
            }
        }
        self.trims.retain(|_, at| now < *at + TRIM_EVERY);
        for (holder, gpu, bytes) in asks {
            if self.trims.contains_key(&holder) {
                continue;
            }
            let conns: Vec<ConnId> = self
                .conns
                .iter()
                .filter(|(_, c)| c.reply.is_some())
                .filter(|(_, c)| c.peer.is_some_and(|p| p.process() == holder))
                .filter(|(_, c)| c.uid == waiting.uid)
                .map(|(id, _)| *id)
                .collect();
            if conns.is_empty() {
                continue;
            }
            tracing::debug!(
                "{}: asking pid {} to give back {} of cache on GPU {gpu} (pid {} waits)",
                model_label(pool),
                holder.pid,
                fmt_bytes(bytes),
                waiting.pid
            );
            self.trims.insert(holder, now);
            if let Some(account) = self.pools.get_mut(pool) {
                account.forget_report(holder);
            }
            for conn in conns {
                self.send(conn, Response::Trim { gpu, bytes });
            }
        }
    }

    /// Permit requests whose caller's model was not known yet, once a process scan newer than
    /// their connection is in: to their caller's model's queue (behind those waiting there), or
    /// the host-wide pool's if it has none and may use it, else refused.
    fn place_unplaced(&mut self, now: Duration) {
        let scanned_at = self.capacity.scanned_at;
        let Some(queue) = self.waiting.get_mut(&None) else {
            return;
        };
        let ready: Vec<usize> = queue
            .iter()
            .enumerate()
            .filter(|(_, w)| w.unplaced.is_some() && scanned_at.is_some_and(|t| t >= w.fresh_after))
            .map(|(i, _)| i)
            .collect();
        let mut placed = Vec::new();
        for i in ready.into_iter().rev() {
            placed.push(queue.remove(i).expect("index is valid"));
        }
        for mut w in placed.into_iter().rev() {
            let request = w.unplaced.take().expect("chosen for it");
            let placed = self.permit_pool(&w.peer, None).and_then(|pool| {
                match self.permit_demand(&pool, &request) {
                    Ok((demand, ..)) => Ok((pool, demand)),
                    Err(message) => Err((RefusalReason::Invalid, message)),
                }
            });
            match placed {
                Ok((pool, demand)) => {
                    self.report_cache(&pool, &w.peer, &request);
                    w.pool = pool.clone();
                    w.demand = demand;
                    // A wait that ended while its model was looked for is decided now.
                    w.deadline = w.deadline.max(now);
                    let queue = self.waiting.entry(pool).or_default();
                    // In arrival order among the host-wide pool's, behind a model's queue.
                    let at = queue
                        .iter()
                        .position(|q| q.arrived > w.arrived && w.pool.is_none());
                    queue.insert(at.unwrap_or(queue.len()), w);
                }
                Err((reason, message)) => {
                    self.forget_waiter(&w);
                    self.send(w.conn, Response::refused(Some(w.id), reason, message));
                }
            }
        }
        self.waiting.retain(|_, q| !q.is_empty());
    }

    /// True while a permit request waits for a process scan to find its caller's model: the
    /// loop then has one taken at once.
    pub fn wants_fresh_scan(&self) -> bool {
        self.waiting
            .get(&None)
            .is_some_and(|q| q.iter().any(|w| w.unplaced.is_some()))
    }

    /// After a tick of the loop: the new capacity, the launched servers' progress, expiries and
    /// admissions. Returns what the loop must apply.
    pub fn tick(&mut self, now: Duration, capacity: Capacity) -> TickReport {
        self.capacity = capacity;
        for (pool, account) in self.pools.iter_mut() {
            account.observe(pool.as_deref(), &self.capacity);
        }
        self.watch_leases(now);
        self.expire(now);
        self.admit_waiting(now);
        self.forget_unused();
        let summaries = self.event_limit.roll(now);
        self.events.extend(summaries);
        if self.events_dropped > 0 {
            let n = std::mem::take(&mut self.events_dropped);
            self.events.push(Event::new(
                Severity::Warning,
                EventKind::EventsDropped,
                format!("{n} reservation events were not kept (more than {MAX_EVENTS} between two ticks)"),
            ));
        }
        let registered = self
            .holdings
            .values()
            .filter_map(|h| match &h.kind {
                Held::Lease(l) => Some((h.peer.process(), l.model.clone())),
                Held::Permit { .. } => None,
            })
            .collect();
        TickReport {
            events: std::mem::take(&mut self.events),
            events_suppressed: self.event_limit.take_suppressed(),
            registered,
            launched_models: self.launched.values().cloned().collect(),
        }
    }

    /// Leases whose process died, or whose model became ready.
    fn watch_leases(&mut self, now: Duration) {
        let settle = self.config.launch.settle;
        let mut ready = Vec::new();
        let mut dead = Vec::new();
        for (id, h) in self.holdings.iter_mut() {
            let Held::Lease(l) = &mut h.kind else {
                continue;
            };
            if lease_process_gone(l) {
                dead.push(*id);
                continue;
            }
            if l.state != LeaseState::Loading {
                continue;
            }
            let usage = self.capacity.models.get(&l.model).map_or(0, |u| {
                if l.by_gpu {
                    u.gpu_total_bytes()
                } else {
                    u.ram_bytes
                }
            });
            if let Some(why) = l.readiness(usage, now, h.granted_at, settle) {
                ready.push((*id, why));
            }
        }
        for (id, why) in ready {
            let Some(h) = self.holdings.get(&id) else {
                continue;
            };
            // A model that overran its ready timeout held the launch lock all that while: a
            // warning. Ready in time is news for no one but the launcher.
            let severity = if why.starts_with("not ready") {
                Severity::Warning
            } else {
                Severity::Info
            };
            let (pool, peer) = (h.pool.clone(), h.peer);
            self.event(
                Event::new(
                    severity,
                    EventKind::LaunchReady,
                    format!(
                        "model '{}' (pid {}): {why}; launch lock released",
                        model_label(&pool),
                        peer.pid
                    ),
                )
                .about(about(&pool, &peer)),
            );
            self.lease_ready(id, now);
        }
        for id in dead {
            let Some(h) = self.holdings.get(&id) else {
                continue;
            };
            let loading = h.reserving();
            let (pool, peer) = (h.pool.clone(), h.peer);
            if loading {
                self.lease_ready(id, now);
                // Info: the launching client's own process exited (it can do so in a loop);
                // a kill by the guard has its own critical event.
                self.event(
                    Event::new(
                        Severity::Info,
                        EventKind::LaunchDied,
                        format!(
                            "model '{}' (pid {}) exited while loading; launch lock released",
                            model_label(&pool),
                            peer.pid
                        ),
                    )
                    .about(about(&pool, &peer)),
                );
            }
            self.holdings.remove(&id);
        }
    }

    /// Pools and launched models nothing refers to any more.
    fn forget_unused(&mut self) {
        let leased: Vec<String> = self
            .holdings
            .values()
            .filter(|h| matches!(h.kind, Held::Lease(_)))
            .filter_map(|h| h.pool.clone())
            .collect();
        let queued: Vec<String> = self
            .launch_queue
            .iter()
            .filter_map(|w| w.pool.clone())
            .collect();
        self.launched
            .retain(|name, _| leased.contains(name) || queued.contains(name));
        let waiting: Vec<Pool> = self.waiting.keys().cloned().collect();
        let models = &self.capacity.models;
        let config = &self.config;
        let launched = &self.launched;
        // The host-wide pool and known models keep their books (their totals and learned
        // sizes); a launched model's go with it.
        self.pools.retain(|pool, a| {
            !a.unused()
                || waiting.contains(pool)
                || pool.as_ref().is_none_or(|n| {
                    models.contains_key(n) || config.model(n).is_some() || launched.contains_key(n)
                })
        });
    }

    // --- views ---------------------------------------------------------------------------------

    /// True while anything is reserved or waiting: the loop then ticks often, with fresh GPU
    /// process lists.
    pub fn busy(&self) -> bool {
        !self.launch_queue.is_empty()
            || !self.waiting.is_empty()
            || self.holdings.values().any(Holding::reserving)
    }

    /// True while anything waits or holds a permit (something may reach its deadline or TTL).
    pub fn can_expire(&self) -> bool {
        !self.waiting.is_empty()
            || !self.launch_queue.is_empty()
            || self
                .holdings
                .values()
                .any(|h| matches!(h.kind, Held::Permit { .. }))
    }

    /// True while a launch waits or loads (admission and readiness are looked at every tick).
    pub fn launching(&self) -> bool {
        !self.launch_queue.is_empty() || self.holdings.values().any(Holding::loading)
    }

    /// The table as `status` shows it.
    pub fn rows(&self, now: Duration) -> Rows {
        let queue = self
            .launch_queue
            .iter()
            .enumerate()
            .map(|(i, w)| QueuedRow {
                position: i + 1,
                model: model_label(&w.pool),
                pid: w.peer.pid,
                uid: w.peer.uid,
                waiting_seconds: now.saturating_sub(w.arrived).as_secs_f64(),
                gpu_bytes: w.demand.gpu_bytes_total(),
                ram_bytes: w.demand.ram_bytes,
                waiting_for: w.waiting_for.clone(),
                queue_timeout_seconds: w.deadline.saturating_sub(w.arrived).as_secs_f64(),
            })
            .collect();
        let mut leases: Vec<LeaseRow> = self
            .holdings
            .iter()
            .filter_map(|(id, h)| match &h.kind {
                Held::Lease(l) => Some(LeaseRow {
                    lease: *id,
                    model: l.model.clone(),
                    pid: h.peer.pid,
                    uid: h.peer.uid,
                    gpus: h.gpus.clone(),
                    state: match l.state {
                        LeaseState::Loading => "loading",
                        LeaseState::Ready => "ready",
                    }
                    .into(),
                    seconds: now.saturating_sub(h.granted_at).as_secs_f64(),
                    gpu_bytes: h.gpu_bytes_per_gpu * h.gpus.len() as u64,
                    ram_bytes: h.ram_bytes,
                    polling_ready_url: l.polling(),
                    ready_timeout_seconds: l.ready_timeout.as_secs_f64(),
                }),
                Held::Permit { .. } => None,
            })
            .collect();
        leases.sort_by_key(|l| l.lease);
        let permits = self
            .figures()
            .into_iter()
            .filter(|f| f.held + f.waiting > 0 || f.granted + f.refused > 0)
            .map(|f| PermitPoolRow {
                max_permits: self.config.model(&f.pool).and_then(|m| m.max_permits),
                model: f.pool,
                held: f.held,
                waiting: f.waiting,
                reserved_gpu_bytes: f.reserved_gpu_bytes,
                reserved_ram_bytes: f.reserved_ram_bytes,
                observed_gpu_bytes_p50: f.observed_p50_bytes,
                observed_gpu_bytes_p95: f.observed_p95_bytes,
                granted_total: f.granted,
                refused_total: f.refused,
                expired_total: f.expired,
            })
            .collect();
        Rows {
            queue,
            leases,
            permits,
        }
    }

    /// Per pool figures, for status and metrics.
    pub fn figures(&self) -> Vec<PoolFigures> {
        self.pools
            .iter()
            .map(|(pool, a)| {
                let permits =
                    |h: &&Holding| h.pool == *pool && matches!(h.kind, Held::Permit { .. });
                let held: Vec<&Holding> = self.holdings.values().filter(permits).collect();
                PoolFigures {
                    pool: model_label(pool),
                    held: held.len(),
                    waiting: self.waiting.get(pool).map_or(0, VecDeque::len),
                    reserved_gpu_bytes: held
                        .iter()
                        .map(|h| h.gpu_bytes_per_gpu * h.gpus.len() as u64)
                        .sum(),
                    reserved_ram_bytes: held.iter().map(|h| h.ram_bytes).sum(),
                    granted: a.counts.granted,
                    refused: a.counts.refused,
                    expired: a.counts.expired,
                    observed_p50_bytes: a.learner.quantile(0.5),
                    observed_p95_bytes: a.learner.quantile(0.95),
                }
            })
            .collect()
    }
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

/// Whether a lease's process has exited (its pidfd says so).
fn lease_process_gone(l: &Lease) -> bool {
    crate::ipc::peer::exited(&l.pidfd)
}

fn about(pool: &Pool, peer: &Peer) -> About {
    About {
        model: pool.clone(),
        pid: Some(peer.pid),
        uid: Some(peer.uid),
        resource: None,
    }
}

/// `asked` beside `held` against `limit`: `None` when it fits, `Later` when it may once some of
/// `held` is given back, `Never` when it alone is over.
fn limit_fit(held: u64, asked: u64, limit: u64, message: impl FnOnce() -> String) -> Option<Fit> {
    if asked == 0 || held + asked <= limit {
        return None;
    }
    let shortfall = Shortfall {
        message: message(),
        ..Default::default()
    };
    Some(if asked > limit {
        Fit::Never(shortfall)
    } else {
        Fit::Later(shortfall)
    })
}

/// Root: its launches go first. (Not the system accounts: a model server's own account, `vllm`
/// say, runs code it downloaded.)
fn privileged(uid: u32) -> bool {
    uid == 0
}

/// A launched model with no `[[model]]`: its flags are its budgets, it is only alerted on, and
/// only its launcher's processes belong to it.
fn launched_model_config(name: &str, owner: u32, need: &Demand) -> ModelConfig {
    let amount = |b: u64| (b > 0).then_some(Amount::Bytes(b));
    ModelConfig {
        name: name.to_string(),
        matcher: Default::default(),
        ram: amount(need.ram_bytes),
        gpu_memory: amount(need.gpu_bytes_total()),
        action: ModelAction::Alert,
        grace: Duration::from_secs(10),
        priority: 0,
        users: Some(vec![User {
            name: owner.to_string(),
            uid: owner,
        }]),
        max_permits: None,
        permit_gpu_memory: None,
        metrics_url: None,
    }
}

/// CUDA_VISIBLE_DEVICES as GPU indices: "0,2", or GPU UUIDs (full or a unique prefix). A GPU
/// named twice is refused: the demand is split over the list, so "0,0" would otherwise be
/// admitted against half the memory it needs on GPU 0.
fn parse_visible_devices(text: &str, capacity: &Capacity) -> Result<Vec<u32>, String> {
    let indices = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .take(64)
        .map(|item| {
            if let Ok(index) = item.parse::<u32>() {
                return Ok(index);
            }
            let found: Vec<u32> = capacity
                .gpus
                .iter()
                .filter(|g| !g.uuid.is_empty() && g.uuid.starts_with(item))
                .map(|g| g.index)
                .collect();
            match found.as_slice() {
                [one] => Ok(*one),
                _ => Err(format!(
                    "CUDA_VISIBLE_DEVICES: '{item}' is not a GPU index or the uuid of exactly one GPU"
                )),
            }
        })
        .collect::<Result<Vec<u32>, String>>()?;
    for (i, index) in indices.iter().enumerate() {
        if indices[..i].contains(index) {
            return Err(format!("CUDA_VISIBLE_DEVICES: GPU {index} is named twice"));
        }
    }
    Ok(indices)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reserve::capacity::{GpuCapacity, ModelUse, RamCapacity};

    const GIB: u64 = 1 << 30;

    fn config(text: &str) -> Config {
        Config::parse(text, std::path::Path::new("t.toml")).unwrap()
    }

    /// A 16 GiB GPU with 4 GiB used by model "served", a 1 GiB floor.
    fn capacity(used: u64) -> Capacity {
        Capacity {
            gpus: vec![GpuCapacity {
                index: 0,
                uuid: "GPU-a".into(),
                total: Some(16 * GIB),
                free: Some(16 * GIB - used),
                floor: GIB,
                usable: true,
            }],
            ram: RamCapacity {
                total: Some(64 * GIB),
                available: Some(32 * GIB),
                floor: GIB,
            },
            models: HashMap::from([(
                "served".to_string(),
                ModelUse {
                    gpu_bytes: BTreeMap::from([(0, used)]),
                    members: 1,
                    ..Default::default()
                },
            )]),
            gpu_consistent: true,
            gpu_sampled_at: Some(Duration::ZERO),
            scanned_at: Some(Duration::ZERO),
            ..Default::default()
        }
    }

    /// Connects `peer` as connection `conn` at `at`; its answers come on the receiver.
    fn join(
        t: &mut Reservations,
        conn: ConnId,
        peer: Peer,
        at: Duration,
    ) -> tokio::sync::mpsc::Receiver<Response> {
        t.connect(conn, peer.uid, at).unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        t.attach(conn, peer, tx);
        rx
    }

    fn table() -> (Reservations, tokio::sync::mpsc::Receiver<Response>) {
        let mut t = Reservations::new(config(
            "[[model]]\nname = \"served\"\nmatch = { comm = \"x\" }\n",
        ));
        t.tick(Duration::ZERO, capacity(4 * GIB));
        let peer = Peer {
            uid: 0,
            pid: 42,
            start_time: 1,
        };
        let rx = join(&mut t, 1, peer, Duration::ZERO);
        (t, rx)
    }

    fn ask(gpu_gib: u64, id: u64) -> AcquireRequest {
        AcquireRequest {
            id,
            model: Some("served".into()),
            gpu_bytes: Some(gpu_gib * GIB),
            timeout_ms: Some(1000),
            ..Default::default()
        }
    }

    /// `table()` with `config_text` and a caller of `uid` on connection 1.
    fn table_for(
        config_text: &str,
        uid: u32,
    ) -> (Reservations, tokio::sync::mpsc::Receiver<Response>) {
        let mut t = Reservations::new(config(config_text));
        t.tick(Duration::ZERO, capacity(4 * GIB));
        let peer = Peer {
            uid,
            pid: std::process::id() as i32,
            start_time: 1,
        };
        let rx = join(&mut t, 1, peer, Duration::ZERO);
        (t, rx)
    }

    fn refusal(answer: Option<Response>) -> (RefusalReason, String) {
        match answer {
            Some(Response::Refused {
                reason, message, ..
            }) => (reason, message),
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn a_permit_of_a_preallocating_engine_that_names_no_size_is_a_slot() {
        // The model's permits were seen to grow it by 3 GiB each (its warm-up, say)...
        let (mut t, _rx) = table();
        let plain = AcquireRequest {
            id: 1,
            model: Some("served".into()),
            timeout_ms: Some(0),
            ..Default::default()
        };
        let mut at = Duration::ZERO;
        let mut reading = |t: &mut Reservations, used_gib: u64| {
            at += Duration::from_millis(10);
            let mut c = capacity(used_gib * GIB);
            c.gpu_sampled_at = Some(at);
            t.tick(at, c);
            at
        };
        for id in 1..=SAMPLES_FOR_DEFAULT as u64 {
            let now = reading(&mut t, 4);
            reading(&mut t, 4);
            let Some(Response::Granted { permit, .. }) = t.acquire(1, ask(3, id), now) else {
                panic!("not granted");
            };
            reading(&mut t, 7);
            let now = reading(&mut t, 7);
            t.release_permit(1, 100 + id, permit, now);
            reading(&mut t, 4);
        }
        let granted = |answer: Option<Response>| match answer {
            Some(Response::Granted { gpu_bytes, .. }) => gpu_bytes,
            other => panic!("{other:?}"),
        };
        let now = reading(&mut t, 4);
        assert_eq!(
            granted(t.acquire(1, plain.clone(), now)),
            3 * GIB,
            "learned"
        );
        // ...but once its metrics show a preallocated KV cache, a permit is a slot.
        at += Duration::from_millis(10);
        let mut c = capacity(4 * GIB);
        c.gpu_sampled_at = Some(at);
        c.preallocated.insert("served".into());
        t.tick(at, c);
        let again = AcquireRequest { id: 2, ..plain };
        assert_eq!(granted(t.acquire(1, again, at)), 0);
    }

    #[test]
    fn a_caller_the_scan_has_not_seen_yet_waits_for_one_to_find_its_model() {
        // A server of model "served" that started after the latest process scan asks at once,
        // naming no model: its pool is decided by the next scan, not by the host-wide pool.
        let (mut t, mut rx) = table_for(
            "[[model]]\nname = \"served\"\nmatch = { comm = \"x\" }\nmax_permits = 1\n\
             users = [\"1001\"]\n",
            1001,
        );
        let connected = Duration::from_millis(5);
        let server = Peer {
            uid: 1001,
            pid: 77,
            start_time: 9,
        };
        let mut rx2 = join(&mut t, 2, server, connected);
        let ask = |id| AcquireRequest {
            id,
            gpu_bytes: Some(GIB),
            timeout_ms: Some(if id == 1 { 0 } else { 5000 }),
            ..Default::default()
        };
        // A uid that may be no model's member is answered at once (no scan is forced for it).
        let stranger = Peer {
            uid: 1002,
            pid: 78,
            start_time: 9,
        };
        let _rx3 = join(&mut t, 3, stranger, connected);
        assert!(matches!(
            t.acquire(3, ask(9), connected),
            Some(Response::Refused {
                reason: RefusalReason::NotAllowed,
                ..
            })
        ));
        assert!(t.acquire(2, ask(1), connected).is_none(), "it waits");
        assert!(t.acquire(2, ask(2), connected).is_none());
        assert!(t.wants_fresh_scan());
        // Finding its model is not the caller's wait: a timeout of 0 still gets its answer.
        t.expire(connected + Duration::from_millis(100));
        assert!(rx2.try_recv().is_err());
        // A scan older than the connection decides nothing.
        t.tick(connected, capacity(4 * GIB));
        assert!(rx2.try_recv().is_err());
        assert!(t.wants_fresh_scan());
        // The next one has it in "served": one permit (max_permits 1), the other waits there.
        let mut scanned = capacity(4 * GIB);
        scanned.scanned_at = Some(connected);
        scanned.gpu_sampled_at = Some(connected);
        scanned.member_of.insert(server.process(), "served".into());
        t.tick(connected + Duration::from_millis(1), scanned);
        assert!(matches!(
            rx2.try_recv(),
            Ok(Response::Granted { id: 1, .. })
        ));
        assert!(!t.wants_fresh_scan());
        let rows = t.rows(connected);
        let served = rows.permits.iter().find(|p| p.model == "served").unwrap();
        assert_eq!((served.held, served.waiting), (1, 1));
        // A caller in no model, once scanned, is refused the host-wide pool it may not use.
        assert!(t
            .acquire(1, ask(3), Duration::ZERO)
            .is_some_and(|r| matches!(
                r,
                Response::Refused {
                    reason: RefusalReason::NotAllowed,
                    ..
                }
            )));
        assert!(rx.try_recv().is_err());
    }

    #[test]
    fn the_host_wide_pool_is_for_its_users_only() {
        let host = |id| AcquireRequest {
            id,
            gpu_bytes: Some(GIB),
            timeout_ms: Some(0),
            ..Default::default()
        };
        let (mut t, _rx) = table_for("", 1001);
        let (reason, message) = refusal(t.acquire(1, host(1), Duration::ZERO));
        assert_eq!(reason, RefusalReason::NotAllowed);
        assert!(message.contains("host-wide pool"), "{message}");
        // A system account neither (it may run a model server's downloaded code); root may.
        let (mut t, _rx) = table_for("", 999);
        assert_eq!(
            refusal(t.acquire(1, host(1), Duration::ZERO)).0,
            RefusalReason::NotAllowed
        );
        let (mut t, _rx) = table_for("", 0);
        assert!(matches!(
            t.acquire(1, host(1), Duration::ZERO),
            Some(Response::Granted { .. })
        ));
        let (mut t, _rx) = table_for("[permits]\nusers = [\"1001\"]\n", 1001);
        assert!(matches!(
            t.acquire(1, host(1), Duration::ZERO),
            Some(Response::Granted { .. })
        ));
    }

    #[test]
    fn a_uid_holds_at_most_its_share_reserved_and_root_is_not_capped() {
        let text = "[clients]\nmax_reserved_per_uid = \"50%\"\n[[model]]\nname = \"m\"\n\
                    match = { comm = \"x\" }\nusers = [\"1001\"]\n";
        let ask = |id, gib| AcquireRequest {
            id,
            model: Some("m".into()),
            gpu_bytes: Some(gib * GIB),
            timeout_ms: Some(0),
            ..Default::default()
        };
        // Half of the 16 GiB card: 8 GiB.
        let (mut t, mut rx) = table_for(text, 1001);
        assert!(matches!(
            t.acquire(1, ask(1, 6), Duration::ZERO),
            Some(Response::Granted { .. })
        ));
        // More than the share would ever allow: refused at once.
        let (reason, message) = refusal(t.acquire(1, ask(3, 9), Duration::ZERO));
        assert_eq!(reason, RefusalReason::TooLarge, "{message}");
        assert!(message.contains("max_reserved_per_uid"), "{message}");
        // Within the share but not beside what it holds: it waits, and times out saying why.
        assert_eq!(t.acquire(1, ask(2, 3), Duration::ZERO), None);
        t.expire(Duration::from_secs(1));
        let (_, message) = refusal(rx.try_recv().ok());
        assert!(message.contains("max_reserved_per_uid"), "{message}");
        let (mut t, _rx) = table_for(text, 0);
        for id in 1..=2 {
            assert!(matches!(
                t.acquire(1, ask(id, 5), Duration::ZERO),
                Some(Response::Granted { .. })
            ));
        }
    }

    #[test]
    fn a_launched_model_gives_permits_only_out_of_what_it_declared() {
        let (mut t, _rx) = table_for("", 1001);
        let own = rustix::process::pidfd_open(
            rustix::process::getpid(),
            rustix::process::PidfdFlags::empty(),
        )
        .unwrap();
        let launch = |gpu: Option<u64>| LaunchRequest {
            model: "mine".into(),
            gpu_memory_bytes: gpu,
            command: vec!["x".into()],
            ..Default::default()
        };
        let answer = t.launch(1, launch(None), Arc::new(own), Duration::ZERO);
        assert!(
            matches!(answer, Some(Response::Admitted { .. })),
            "{answer:?}"
        );
        let ask = AcquireRequest {
            id: 1,
            model: Some("mine".into()),
            gpu_bytes: Some(GIB),
            timeout_ms: Some(0),
            ..Default::default()
        };
        let (reason, message) = refusal(t.acquire(1, ask, Duration::ZERO));
        assert_eq!(reason, RefusalReason::TooLarge, "{message}");
        assert!(message.contains("its launch declared"), "{message}");
    }

    #[test]
    fn a_users_launch_never_holds_back_the_hosts_own() {
        let (mut t, _rx) = table_for("", 1001);
        let mut replies = Vec::new();
        let mut join = |t: &mut Reservations, conn: ConnId, uid: u32| {
            t.connect(conn, uid, Duration::ZERO).unwrap();
            let (tx, rx) = tokio::sync::mpsc::channel(16);
            replies.push(rx);
            let peer = Peer {
                uid,
                pid: std::process::id() as i32,
                start_time: 1,
            };
            t.attach(conn, peer, tx);
        };
        join(&mut t, 2, 999);
        join(&mut t, 3, 0);
        join(&mut t, 4, 0);
        join(&mut t, 5, 1002);
        let launch = |t: &mut Reservations, conn: ConnId, model: &str| {
            let own = rustix::process::pidfd_open(
                rustix::process::getpid(),
                rustix::process::PidfdFlags::empty(),
            )
            .unwrap();
            let request = LaunchRequest {
                model: model.into(),
                command: vec!["x".into()],
                ..Default::default()
            };
            t.launch(conn, request, Arc::new(own), Duration::ZERO)
        };
        // A user's launch takes the lock and loads (for hours, say)...
        assert!(matches!(
            launch(&mut t, 1, "mine"),
            Some(Response::Admitted { .. })
        ));
        // ...another account's (a system account is no different) waits for it...
        assert!(matches!(
            launch(&mut t, 2, "theirs"),
            Some(Response::Queued { position: 1, .. })
        ));
        // ...but root's is not held back by it,
        assert!(matches!(
            launch(&mut t, 3, "host"),
            Some(Response::Admitted { .. })
        ));
        // and root's next, waiting for root's first to load, goes ahead of the others.
        assert!(matches!(
            launch(&mut t, 4, "host2"),
            Some(Response::Queued { position: 1, .. })
        ));
        assert_eq!(t.launch_queue[0].peer.uid, 0);
        assert_eq!(t.launch_queue[1].peer.uid, 999);
        // Behind others, a launch says it waits for its turn (not for what the head waits for).
        match launch(&mut t, 5, "late") {
            Some(Response::Queued {
                position,
                waiting_for,
            }) => {
                assert_eq!(position, 3);
                assert!(waiting_for.starts_with("its turn"), "{waiting_for}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// Red-team finding 5: one user's request loop made thousands of warning events a second.
    /// They are info, at most `limit::PER_UID` per uid and window are kept (so they cannot crowd
    /// another user's events out of the table's per-tick cap), the rest are counted and summed up
    /// once the window ends.
    #[test]
    fn one_uids_flood_of_timeouts_is_rate_limited_and_does_not_crowd_out_another_uids_events() {
        use crate::alert::limit::{PER_UID, WINDOW};
        let mut t = Reservations::new(config(
            "[[model]]\nname = \"served\"\nmatch = { comm = \"x\" }\nusers = [\"1001\", \"1002\"]\n",
        ));
        t.tick(Duration::ZERO, capacity(4 * GIB));
        let mut replies = Vec::new();
        for (conn, uid) in [(1, 1001), (2, 1002)] {
            t.connect(conn, uid, Duration::ZERO).unwrap();
            let (tx, rx) = tokio::sync::mpsc::channel(4096);
            let peer = Peer {
                uid,
                pid: uid as i32,
                start_time: 1,
            };
            t.attach(conn, peer, tx);
            replies.push(rx);
        }
        let now = Duration::from_secs(1);
        // 1001: 1000 requests that can never be granted in time, in batches (its waiting cap).
        for batch in 0..10 {
            for id in 0..100 {
                assert_eq!(t.acquire(1, ask(14, batch * 100 + id + 1), now), None);
            }
            t.expire(now + Duration::from_secs(2));
        }
        // 1002: one of its own, which times out too.
        assert_eq!(t.acquire(2, ask(14, 1), now), None);
        t.expire(now + Duration::from_secs(2));
        let report = t.tick(now + Duration::from_secs(2), capacity(4 * GIB));
        let of = |uid| {
            report
                .events
                .iter()
                .filter(move |e| e.about.uid == Some(uid) && e.kind == EventKind::PermitTimedOut)
        };
        assert_eq!(of(1001).count(), PER_UID as usize);
        assert_eq!(of(1002).count(), 1, "the other uid's event is kept");
        assert!(of(1001)
            .chain(of(1002))
            .all(|e| e.severity == Severity::Info));
        assert_eq!(report.events_suppressed, 1000 - PER_UID as u64);
        assert!(report
            .events
            .iter()
            .all(|e| e.kind != EventKind::EventsDropped));
        // The window ends: one summary, for the uid that had events suppressed.
        let report = t.tick(WINDOW + Duration::from_secs(1), capacity(4 * GIB));
        let summaries: Vec<&Event> = report
            .events
            .iter()
            .filter(|e| e.kind == EventKind::EventsSuppressed)
            .collect();
        assert_eq!(summaries.len(), 1, "{summaries:?}");
        assert_eq!(summaries[0].about.uid, Some(1001));
        assert!(
            summaries[0]
                .message
                .contains("980 more events (permit_timed_out)"),
            "{}",
            summaries[0].message
        );
    }

    #[test]
    fn cuda_visible_devices_naming_a_gpu_twice_is_refused_not_half_reserved() {
        let mut two = capacity(0);
        let mut second = two.gpus[0].clone();
        second.index = 1;
        second.uuid = "GPU-b".into();
        two.gpus.push(second);
        assert_eq!(parse_visible_devices("1, 0", &two), Ok(vec![1, 0]));
        assert_eq!(parse_visible_devices("GPU-b,0", &two), Ok(vec![1, 0]));
        let err = parse_visible_devices("0,0", &two).unwrap_err();
        assert!(err.contains("GPU 0 is named twice"), "{err}");
        let err = parse_visible_devices("GPU-a,0", &two).unwrap_err();
        assert!(err.contains("GPU 0 is named twice"), "{err}");
    }

    #[test]
    fn permits_fill_the_room_then_wait_then_time_out_with_what_was_free() {
        let (mut t, mut rx) = table();
        let now = Duration::from_secs(1);
        for id in 1..=3 {
            assert!(
                matches!(
                    t.acquire(1, ask(3, id), now),
                    Some(Response::Granted { .. })
                ),
                "{id}"
            );
        }
        // A tick with the same use keeps the baseline (the permits are not taken yet).
        t.tick(now, capacity(4 * GIB));
        assert_eq!(t.acquire(1, ask(3, 4), now), None, "waits");
        assert!(matches!(
            t.acquire(1, ask(20, 5), now),
            Some(Response::Refused {
                reason: RefusalReason::TooLarge,
                ..
            })
        ));
        t.expire(now + Duration::from_secs(2));
        match rx.try_recv().unwrap() {
            Response::Refused {
                id, reason, free, ..
            } => {
                assert_eq!((id, reason), (Some(4), RefusalReason::Timeout));
                assert_eq!(free.gpu_bytes, Some(2 * GIB));
            }
            other => panic!("{other:?}"),
        }
    }
}
