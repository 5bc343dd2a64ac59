//! Property test of the ledger: any sequence of joins, permit requests, releases, cancels,
//! launches (whose processes exit), expiries, ticks with changing use, and leaves keeps it
//! consistent with what its clients were told, and its books with its holdings:
//!
//! - every request is answered exactly once (at once, or later through the outbox), or still
//!   waits in a queue, or its client left; nothing waits that nobody asked for;
//! - the permits the ledger holds are exactly those its clients were granted and not yet told
//!   ended; no reservation is left without a client;
//! - each pool's books reserve what its holdings reserve (per GPU, count, RAM), and the pool's
//!   books agree with its holders' books;
//! - the caps hold (permits per uid and in all).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;

use proptest::prelude::*;

use super::*;

#[derive(Clone, Debug)]
enum Op {
    Join(ConnId),
    Acquire {
        conn: ConnId,
        gib: u64,
        model: bool,
        timeout_ms: u64,
        ttl_ms: u64,
    },
    /// Releases the `nth` permit the client holds (if any).
    Release(ConnId, usize),
    /// Cancels the `nth` request the client has waiting (if any).
    Cancel(ConnId, usize),
    Launch(ConnId, u64),
    /// The `nth` launched process exits.
    Exit(usize),
    Expire(u64),
    Tick(u64, u64),
    Leave(ConnId),
}

fn op() -> impl Strategy<Value = Op> {
    let conn = 1..=4u64;
    prop_oneof![
        conn.clone().prop_map(Op::Join),
        (
            conn.clone(),
            0..7u64,
            any::<bool>(),
            prop_oneof![Just(0u64), Just(300), Just(5000)],
            prop_oneof![Just(200u64), Just(60_000)],
        )
            .prop_map(|(conn, gib, model, timeout_ms, ttl_ms)| Op::Acquire {
                conn,
                gib,
                model,
                timeout_ms,
                ttl_ms
            }),
        (conn.clone(), 0..4usize).prop_map(|(c, n)| Op::Release(c, n)),
        (conn.clone(), 0..4usize).prop_map(|(c, n)| Op::Cancel(c, n)),
        (conn.clone(), 0..10u64).prop_map(|(c, g)| Op::Launch(c, g)),
        (0..4usize).prop_map(Op::Exit),
        (0..1000u64).prop_map(Op::Expire),
        (0..1000u64, 0..16u64).prop_map(|(ms, used)| Op::Tick(ms, used)),
        conn.prop_map(Op::Leave),
    ]
}

/// Who is on each connection: root, two users of model "served", one stranger.
fn peer(conn: ConnId) -> Peer {
    let uid = [0, 1001, 1001, 1002][(conn as usize - 1) % 4];
    Peer {
        uid,
        pid: 100 + conn as i32,
        start_time: 1,
    }
}

/// What the clients were told.
#[derive(Default)]
struct Clients {
    joined: BTreeSet<ConnId>,
    next_id: BTreeMap<ConnId, u64>,
    /// Requests told nothing final yet (permits: by id; launches: id 0).
    pending: BTreeSet<(ConnId, u64)>,
    /// Permits granted and not yet ended, by connection.
    held: BTreeMap<ConnId, Vec<u64>>,
    launched: Vec<Arc<FakeProcess>>,
}

impl Clients {
    /// An answer for `conn`'s request: the first final one for it, and only for a request made.
    fn answered(&mut self, conn: ConnId, response: &Response) -> Result<(), String> {
        let id = match response {
            Response::Granted { id, permit, .. } => {
                self.held.entry(conn).or_default().push(*permit);
                *id
            }
            Response::Refused { id, .. } => id.unwrap_or(0),
            Response::Admitted { .. } | Response::TimedOut { .. } => 0,
            Response::Expired { permit, .. } => {
                let held = self.held.entry(conn).or_default();
                let at = held
                    .iter()
                    .position(|p| p == permit)
                    .ok_or(format!("conn {conn}: permit {permit} expired but not held"))?;
                held.remove(at);
                return Ok(());
            }
            Response::Queued { .. } | Response::Trim { .. } => return Ok(()),
            other => return Err(format!("conn {conn}: unexpected {other:?}")),
        };
        if !self.pending.remove(&(conn, id)) {
            return Err(format!(
                "conn {conn}: answer to no pending request {id}: {response:?}"
            ));
        }
        Ok(())
    }
}

fn check(t: &mut Reservations, clients: &mut Clients) -> Result<(), String> {
    for (conn, response) in t.take_outbox() {
        if !clients.joined.contains(&conn) {
            return Err(format!(
                "an answer for conn {conn}, which left: {response:?}"
            ));
        }
        clients.answered(conn, &response)?;
    }
    // Everything waiting was asked for and is pending; everything pending waits.
    let waiting: BTreeSet<(ConnId, u64)> = t.waiters().map(|w| (w.conn, w.id)).collect();
    if waiting != clients.pending {
        return Err(format!(
            "waiting {waiting:?} but pending {:?}",
            clients.pending
        ));
    }
    // The permits held are those granted and not ended, each with a client.
    let mut held: BTreeMap<ConnId, BTreeSet<u64>> = BTreeMap::new();
    for (id, h) in &t.holdings {
        if let Some(conn) = h.conn() {
            if !t.clients.contains_key(&conn) {
                return Err(format!("permit {id} of conn {conn}, which left"));
            }
            held.entry(conn).or_default().insert(*id);
        }
    }
    let told: BTreeMap<ConnId, BTreeSet<u64>> = clients
        .held
        .iter()
        .filter(|(_, p)| !p.is_empty())
        .map(|(c, p)| (*c, p.iter().copied().collect()))
        .collect();
    if held != told {
        return Err(format!("held {held:?} but the clients were told {told:?}"));
    }
    // Each pool's books reserve what its holdings reserve.
    for (pool, account) in &t.pools {
        let mut want = account::Reserved::default();
        for h in t
            .holdings
            .values()
            .filter(|h| h.pool == *pool && h.reserving())
        {
            for g in &h.gpus {
                if h.gpu_bytes_per_gpu > 0 {
                    *want.gpu.entry(*g).or_default() += h.gpu_bytes_per_gpu;
                    *want.count.entry(*g).or_default() += 1;
                }
            }
            want.ram += h.ram_bytes;
        }
        let (books, parts) = account.reserved();
        if books != want || parts != want {
            return Err(format!(
                "pool {pool:?}: holdings reserve {want:?}, the pool's books {books:?}, its holders' {parts:?}"
            ));
        }
    }
    for (conn, pool) in t
        .holdings
        .values()
        .filter(|h| h.reserving())
        .map(|h| (h.conn(), &h.pool))
    {
        if !t.pools.contains_key(pool) {
            return Err(format!(
                "a reservation of {conn:?} in pool {pool:?}, which has no books"
            ));
        }
    }
    let limits = &t.config.permits;
    if t.permits_of(None) > limits.max_total {
        return Err("over permits.max_total".into());
    }
    for uid in [0, 1001, 1002] {
        if t.permits_of(Some(uid)) > limits.max_per_uid {
            return Err(format!("uid {uid} over permits.max_per_uid"));
        }
    }
    if t.permits_where(|u| u != 0) > limits.max_total - limits.max_per_uid {
        return Err("the accounts other than root took root's share".into());
    }
    Ok(())
}

fn run(ops: &[Op]) -> Result<(), String> {
    let mut t = Reservations::new(config(
        "[[model]]\nname = \"served\"\nmatch = { comm = \"x\" }\nmax_permits = 3\n\
         users = [\"1001\"]\n[permits]\nqueue = 3\nmax_per_uid = 4\nmax_total = 6\n",
    ));
    let mut now = Duration::ZERO;
    t.tick(now, capacity(4 * GIB));
    let mut clients = Clients::default();
    for op in ops {
        now += Duration::from_millis(1);
        match op.clone() {
            Op::Join(conn) => {
                if clients.joined.insert(conn) {
                    t.join(conn, peer(conn), now);
                }
            }
            Op::Acquire {
                conn,
                gib,
                model,
                timeout_ms,
                ttl_ms,
            } => {
                let id = clients.next_id.entry(conn).or_insert(0);
                *id += 1;
                let id = *id;
                let request = AcquireRequest {
                    id,
                    model: model.then(|| "served".into()),
                    gpu_bytes: Some(gib * GIB),
                    timeout_ms: Some(timeout_ms),
                    ttl_ms: Some(ttl_ms),
                    ..Default::default()
                };
                let joined = clients.joined.contains(&conn);
                clients.pending.insert((conn, id));
                match t.acquire(conn, request, now) {
                    Some(answer) => clients.answered(conn, &answer)?,
                    None if !joined => return Err(format!("conn {conn} not joined, yet waits")),
                    None => {}
                }
                if !joined {
                    clients.held.remove(&conn);
                }
            }
            Op::Release(conn, nth) => {
                let Some(&permit) = clients.held.get(&conn).and_then(|p| p.get(nth)) else {
                    continue;
                };
                match t.release_permit(conn, 99, permit, now) {
                    Response::Released { .. } => {
                        clients.held.get_mut(&conn).unwrap().remove(nth);
                    }
                    other => return Err(format!("release of a held permit: {other:?}")),
                }
            }
            Op::Cancel(conn, nth) => {
                let Some(&(_, id)) = clients
                    .pending
                    .iter()
                    .filter(|(c, id)| *c == conn && *id > 0)
                    .nth(nth)
                else {
                    continue;
                };
                if let Some(answer) = t.cancel(conn, id) {
                    clients.answered(conn, &answer)?;
                }
            }
            Op::Launch(conn, gib) => {
                if !clients.joined.contains(&conn) || clients.pending.contains(&(conn, 0)) {
                    continue;
                }
                let process = Arc::new(FakeProcess::default());
                clients.launched.push(process.clone());
                let request = LaunchRequest {
                    model: format!("l{conn}"),
                    gpu_memory_bytes: Some(gib * GIB),
                    command: vec!["x".into()],
                    ..Default::default()
                };
                clients.pending.insert((conn, 0));
                match t.launch(conn, request, process, now) {
                    Some(Response::Queued { .. }) | None => {}
                    Some(answer) => clients.answered(conn, &answer)?,
                }
            }
            Op::Exit(nth) => {
                if let Some(p) = clients.launched.get(nth) {
                    p.exited.store(true, Ordering::Relaxed);
                }
            }
            Op::Expire(ms) => {
                now += Duration::from_millis(ms);
                t.expire(now);
            }
            Op::Tick(ms, used) => {
                now += Duration::from_millis(ms);
                let mut c = capacity(used * GIB);
                c.gpu_sampled_at = Some(now);
                c.scanned_at = Some(now);
                t.tick(now, c);
            }
            Op::Leave(conn) => {
                t.leave(conn, now);
                // What was decided for it before it left is not delivered.
                t.outbox.retain(|(c, _)| *c != conn);
                clients.joined.remove(&conn);
                clients.pending.retain(|(c, _)| *c != conn);
                clients.held.remove(&conn);
            }
        }
        check(&mut t, &mut clients).map_err(|e| format!("after {op:?}: {e}"))?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_sequence_keeps_the_ledger_consistent(ops in proptest::collection::vec(op(), 1..60)) {
        if let Err(e) = run(&ops) {
            prop_assert!(false, "{e}");
        }
    }
}
