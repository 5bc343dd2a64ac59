//! Issue #22's forked PyTorch workers, in-process and on a driven clock: the ledger against
//! workers whose allocators hold memory as PyTorch's caching allocator does (ported from
//! tests/permits/fakegpu.py's `Caching`), with every step of the real system apart: a cache
//! report read some time before the request reaches the daemon, the `cudaMalloc` some time after
//! the grant, NVML readings sampled at one moment and taken in at a later tick, a `trim` acted on
//! later still. Whatever the order, a request the ledger granted never meets a CUDA OOM: its
//! allocator's own retry (give back its wholly free segments, try once more) must succeed. And
//! once the server stops asking, every request left is served (`World::drain`): no permit
//! starves behind memory another worker caches and would give back. And (`host_pool`) one
//! caching server in no model on the daemon loop's own schedule of readings, at every phase.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;
use crate::unattributed::Unattributed;

const MIB: u64 = 1 << 20;
/// PyTorch rounds large allocations up to 2 MiB and gives each new one a segment of its own.
const ROUND: u64 = 2 * MIB;
/// Each worker's CUDA context and weights, held outside its allocator.
const CONTEXT: u64 = 512 * MIB;
const WEIGHTS: u64 = 4 * GIB;
const FLOOR: u64 = 512 * MIB;

/// A block of a segment: its offset, size, and whether a request uses it.
#[derive(Clone, Debug)]
struct Block {
    offset: u64,
    size: u64,
    in_use: bool,
}

#[derive(Clone, Debug)]
struct Segment {
    id: u64,
    size: u64,
    blocks: Vec<Block>,
}

/// PyTorch's caching allocator in one worker: segments from the driver, split into blocks; freed
/// blocks stay cached until `empty_cache` or a failed `cudaMalloc`'s retry.
#[derive(Debug, Default)]
struct Caching {
    segments: Vec<Segment>,
    next_segment: u64,
    /// Requests served from a cached block.
    from_cache: u64,
}

/// A request's memory: its segment and offset.
type Handle = (u64, u64);

impl Caching {
    /// The request's memory, or `None`: CUDA out of memory even after the cache was given back.
    fn alloc(&mut self, card: &mut Card, pid: i32, size: u64) -> Option<Handle> {
        let size = size.div_ceil(ROUND) * ROUND;
        let best = self
            .segments
            .iter()
            .enumerate()
            .flat_map(|(s, seg)| {
                seg.blocks
                    .iter()
                    .enumerate()
                    .filter(|(_, b)| !b.in_use && b.size >= size)
                    .map(move |(b, block)| (block.size, s, b))
            })
            .min();
        if let Some((_, s, b)) = best {
            let segment = &mut self.segments[s];
            let block = &mut segment.blocks[b];
            if block.size > size {
                let rest = Block {
                    offset: block.offset + size,
                    size: block.size - size,
                    in_use: false,
                };
                block.size = size;
                segment.blocks.insert(b + 1, rest);
            }
            segment.blocks[b].in_use = true;
            self.from_cache += 1;
            return Some((segment.id, segment.blocks[b].offset));
        }
        if !card.malloc(pid, size) {
            self.release_cached(card, pid);
            if !card.malloc(pid, size) {
                return None;
            }
        }
        self.next_segment += 1;
        self.segments.push(Segment {
            id: self.next_segment,
            size,
            blocks: vec![Block {
                offset: 0,
                size,
                in_use: true,
            }],
        });
        Some((self.next_segment, 0))
    }

    fn free(&mut self, (segment, offset): Handle) {
        let segment = self
            .segments
            .iter_mut()
            .find(|s| s.id == segment)
            .expect("a live handle");
        let block = segment
            .blocks
            .iter_mut()
            .find(|b| b.offset == offset)
            .expect("a live handle");
        block.in_use = false;
        let mut merged: Vec<Block> = Vec::new();
        for b in segment.blocks.drain(..) {
            match merged.last_mut() {
                Some(last) if !last.in_use && !b.in_use => last.size += b.size,
                _ => merged.push(b),
            }
        }
        segment.blocks = merged;
    }

    /// Its wholly free segments go back to the driver.
    fn release_cached(&mut self, card: &mut Card, pid: i32) {
        self.segments.retain(|s| {
            let free = s.blocks.iter().all(|b| !b.in_use);
            if free {
                card.free(pid, s.size);
            }
            !free
        });
    }

    /// `memory_reserved`, `memory_allocated` and `inactive_split_bytes`.
    fn figures(&self) -> (u64, u64, u64) {
        let reserved = self.segments.iter().map(|s| s.size).sum();
        let allocated = self
            .segments
            .iter()
            .flat_map(|s| &s.blocks)
            .filter(|b| b.in_use)
            .map(|b| b.size)
            .sum();
        let split = self
            .segments
            .iter()
            .filter(|s| s.blocks.iter().any(|b| b.in_use))
            .flat_map(|s| &s.blocks)
            .filter(|b| !b.in_use)
            .map(|b| b.size)
            .sum();
        (reserved, allocated, split)
    }
}

/// The driver's view of the GPU: what each process holds.
#[derive(Debug)]
struct Card {
    total: u64,
    held: BTreeMap<i32, u64>,
}

impl Card {
    fn used(&self) -> u64 {
        self.held.values().sum()
    }

    fn malloc(&mut self, pid: i32, size: u64) -> bool {
        let fits = self.used() + size <= self.total;
        if fits {
            *self.held.entry(pid).or_default() += size;
        }
        fits
    }

    fn free(&mut self, pid: i32, size: u64) {
        *self.held.get_mut(&pid).expect("a holder") -= size;
    }

    /// An NVML reading taken now (`at`), as the daemon's tick turns it into a capacity, its
    /// per-process figures trusted as `sample::nvml` trusts them (`unattributed`).
    fn reading(&self, at: Duration, unattributed: &mut Unattributed) -> Capacity {
        self.reading_listing(&self.held, at, unattributed)
    }

    /// The same with the per-process figures of `listed` (an earlier moment: they lag `used`).
    fn reading_listing(
        &self,
        listed: &BTreeMap<i32, u64>,
        at: Duration,
        unattributed: &mut Unattributed,
    ) -> Capacity {
        let used = self.used();
        let mut c = capacity(0);
        c.models.get_mut("served").expect("in capacity()").gpu_bytes = BTreeMap::from([(0, used)]);
        c.gpus[0].total = Some(self.total);
        c.gpus[0].free = Some(self.total - used);
        c.gpus[0].floor = FLOOR;
        c.trees = listed
            .iter()
            .map(|(&pid, &bytes)| {
                let tree = TreeUse {
                    gpu_bytes: BTreeMap::from([(0, bytes)]),
                    members: pid as u64,
                    ..Default::default()
                };
                (peer(0, pid).process(), tree)
            })
            .collect();
        c.member_of = listed
            .keys()
            .map(|&pid| (peer(0, pid).process(), "served".to_string()))
            .collect();
        c.models.get_mut("served").expect("in capacity()").members = self.held.len() as u64;
        c.gpu_sampled_at = Some(at);
        c.scanned_at = Some(at);
        let listed = listed.values().sum::<u64>();
        c.gpu_consistent = listed <= used && unattributed.agrees(used - listed, at);
        c
    }
}

/// Where one request of a worker stands.
#[derive(Clone, Copy, Debug)]
enum Request {
    /// Its client read the allocator's cache for the report at `read_at`; not sent yet.
    Reported {
        size: u64,
        cache: u64,
        read_at: Duration,
    },
    /// Sent; no answer yet.
    Waiting {
        id: u64,
        size: u64,
    },
    Granted {
        permit: u64,
        size: u64,
    },
    Working {
        permit: u64,
        handle: Handle,
    },
}

/// One forked worker: its own allocator, client (connection `conn`) and requests.
#[derive(Debug, Default)]
struct Worker {
    pid: i32,
    allocator: Caching,
    /// The Python client's `TorchCache`: what was allocated when it last held no permit.
    idle_allocated: Option<u64>,
    requests: Vec<Request>,
    next_id: u64,
    trim_asked: bool,
    trims: u64,
    /// Requests the ledger refused (a timeout: the client gave up on it).
    refused: u64,
}

impl Worker {
    fn holds_permits(&self) -> bool {
        self.requests
            .iter()
            .any(|r| matches!(r, Request::Granted { .. } | Request::Working { .. }))
    }

    /// `cache_bytes` as the Python client reads it (clients/python/src/gpuguard/allocator.py).
    fn cache_report(&mut self) -> u64 {
        let (reserved, allocated, split) = self.allocator.figures();
        if !self.holds_permits() {
            self.idle_allocated = Some(allocated);
        }
        let base = self.idle_allocated.unwrap_or(allocated);
        reserved.saturating_sub(base + split)
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// A worker's client reads its cache for a request of `mib` MiB.
    Ask(usize, u64),
    /// Its `nth` read report goes out with the request.
    Send(usize, usize),
    /// Its `nth` granted request takes its memory.
    Start(usize, usize),
    /// Its `nth` working request frees its memory and releases its permit.
    Finish(usize, usize),
    /// NVML is read now; the next tick takes this reading in.
    Sample,
    /// The same, its per-process figures still those of the sample before.
    SampleLagging,
    /// `ms` pass, and the loop ticks with the latest reading.
    Tick(u64),
    /// A worker asked to give its cache back does (`torch.cuda.empty_cache()`).
    Trim(usize),
    /// A worker empties its cache on its own (servers call `empty_cache()` between batches).
    /// Only where clients send no cache report: a report read after a request took a segment
    /// and before such a release, with no reading between the take and the release (NVML saw
    /// neither), claims cache that is gone and that nothing the daemon sees can tell
    /// (docs/launches-and-permits.md, "One case no reading can catch").
    EmptyCache(usize),
}

fn op(workers: usize) -> impl Strategy<Value = Op> {
    let w = 0..workers;
    prop_oneof![
        3 => (w.clone(), 1024..=4096u64).prop_map(|(w, mib)| Op::Ask(w, mib)),
        3 => (w.clone(), 0..3usize).prop_map(|(w, n)| Op::Send(w, n)),
        3 => (w.clone(), 0..3usize).prop_map(|(w, n)| Op::Start(w, n)),
        3 => (w.clone(), 0..3usize).prop_map(|(w, n)| Op::Finish(w, n)),
        2 => Just(Op::Sample),
        1 => Just(Op::SampleLagging),
        2 => (1..250u64).prop_map(Op::Tick),
        1 => w.clone().prop_map(Op::Trim),
        1 => w.prop_map(Op::EmptyCache),
    ]
}

/// Per worker, the sizes (MiB) of the segments cached before the daemon first sees it: none
/// (cold), or up to two.
fn warm(workers: usize) -> impl Strategy<Value = Vec<Vec<u64>>> {
    proptest::collection::vec(proptest::collection::vec(1024..=4096u64, 0..3), workers)
}

struct World {
    /// The clients report their allocator's cache (`allocator="torch"`).
    reports: bool,
    t: Reservations,
    card: Card,
    workers: Vec<Worker>,
    latest: Capacity,
    /// What each process held at the last sample (a lagging reading's per-process figures).
    listed: BTreeMap<i32, u64>,
    unattributed: Unattributed,
    now: Duration,
}

impl World {
    /// `warm`: per worker, the sizes (MiB) of the segments its cache holds before the daemon
    /// first sees it (the daemon restarted under it, or it served before asking for permits).
    fn new(card_gib: u64, workers: usize, reports: bool, warm: &[Vec<u64>]) -> World {
        let mut card = Card {
            total: card_gib * GIB,
            held: BTreeMap::new(),
        };
        let pids: Vec<i32> = (0..workers).map(|w| 42 + w as i32).collect();
        for &pid in &pids {
            assert!(card.malloc(pid, CONTEXT + WEIGHTS));
        }
        let workers: Vec<Worker> = (0..workers)
            .map(|w| {
                let pid = pids[w];
                let mut worker = Worker {
                    pid,
                    ..Default::default()
                };
                let sizes = warm.get(w).map_or(&[][..], Vec::as_slice);
                let served: Vec<Handle> = sizes
                    .iter()
                    .filter_map(|mib| worker.allocator.alloc(&mut card, pid, mib * MIB))
                    .collect();
                for handle in served {
                    worker.allocator.free(handle);
                }
                worker
            })
            .collect();
        let mut t = Reservations::new(config(
            "[[model]]\nname = \"served\"\nmatch = { comm = \"x\" }\n",
        ));
        let mut unattributed = Unattributed::default();
        let latest = card.reading(Duration::ZERO, &mut unattributed);
        let listed = card.held.clone();
        t.tick(Duration::ZERO, latest.clone());
        for w in &workers {
            t.join(w.pid as ConnId, peer(0, w.pid), Duration::ZERO);
        }
        World {
            reports,
            t,
            card,
            workers,
            latest,
            listed,
            unattributed,
            now: Duration::ZERO,
        }
    }

    /// Delivers the ledger's answers to the workers' clients.
    fn deliver(&mut self) {
        for (conn, response) in self.t.take_outbox() {
            self.answer(conn as i32, response);
        }
    }

    fn answer(&mut self, pid: i32, response: Response) {
        let w = self
            .workers
            .iter_mut()
            .find(|w| w.pid == pid)
            .expect("a worker");
        match response {
            Response::Granted { id, permit, .. } => {
                for r in &mut w.requests {
                    if let Request::Waiting { id: i, size } = *r {
                        if i == id {
                            *r = Request::Granted { permit, size };
                        }
                    }
                }
            }
            Response::Refused { id, .. } => {
                w.refused += 1;
                w.requests
                    .retain(|r| !matches!(r, Request::Waiting { id: i, .. } if Some(*i) == id));
            }
            Response::Trim { .. } => w.trim_asked = true,
            _ => {}
        }
    }

    fn nth(&self, w: usize, n: usize, which: fn(&Request) -> bool) -> Option<usize> {
        let requests = &self.workers[w].requests;
        let matching: Vec<usize> = (0..requests.len())
            .filter(|&i| which(&requests[i]))
            .collect();
        matching.get(n % matching.len().max(1)).copied()
    }

    fn step(&mut self, op: &Op) -> Result<(), String> {
        self.now += Duration::from_millis(1);
        let now = self.now;
        match *op {
            Op::Ask(w, mib) => {
                let worker = &mut self.workers[w];
                if worker.requests.len() < 6 {
                    let cache = worker.cache_report();
                    worker.requests.push(Request::Reported {
                        size: mib * MIB,
                        cache,
                        read_at: now,
                    });
                }
            }
            Op::Send(w, n) => {
                let Some(i) = self.nth(w, n, |r| matches!(r, Request::Reported { .. })) else {
                    return Ok(());
                };
                let worker = &mut self.workers[w];
                let Request::Reported {
                    size,
                    cache,
                    read_at,
                } = worker.requests[i]
                else {
                    unreachable!()
                };
                worker.next_id += 1;
                let id = worker.next_id;
                worker.requests[i] = Request::Waiting { id, size };
                let request = AcquireRequest {
                    id,
                    gpu_bytes: Some(size),
                    timeout_ms: Some(30_000),
                    ttl_ms: Some(3_600_000),
                    cache_bytes: self.reports.then_some(cache),
                    cache_age: Some(now - read_at),
                    ..Default::default()
                };
                let pid = worker.pid;
                if let Some(answer) = self.t.acquire(pid as ConnId, request, now) {
                    self.answer(pid, answer);
                }
            }
            Op::Start(w, n) => {
                let Some(i) = self.nth(w, n, |r| matches!(r, Request::Granted { .. })) else {
                    return Ok(());
                };
                let worker = &mut self.workers[w];
                let Request::Granted { permit, size } = worker.requests[i] else {
                    unreachable!()
                };
                let Some(handle) = worker.allocator.alloc(&mut self.card, worker.pid, size) else {
                    return Err(format!(
                        "CUDA OOM: worker {} wants {} MiB under permit {permit}; the card holds {:?} of {} MiB, its allocator {:?}",
                        worker.pid,
                        size >> 20,
                        self.card.held.iter().map(|(p, b)| (p, b >> 20)).collect::<Vec<_>>(),
                        self.card.total >> 20,
                        worker.allocator.segments,
                    ));
                };
                worker.requests[i] = Request::Working { permit, handle };
            }
            Op::Finish(w, n) => {
                let Some(i) = self.nth(w, n, |r| matches!(r, Request::Working { .. })) else {
                    return Ok(());
                };
                let worker = &mut self.workers[w];
                let Request::Working { permit, handle } = worker.requests.remove(i) else {
                    unreachable!()
                };
                worker.allocator.free(handle);
                let pid = worker.pid;
                let released = self.t.release_permit(pid as ConnId, 0, permit, now);
                if !matches!(released, Response::Released { .. }) {
                    return Err(format!("release of permit {permit}: {released:?}"));
                }
            }
            Op::Sample => {
                self.latest = self.card.reading(now, &mut self.unattributed);
                self.listed = self.card.held.clone();
            }
            Op::SampleLagging => {
                self.latest = self
                    .card
                    .reading_listing(&self.listed, now, &mut self.unattributed)
            }
            Op::Tick(ms) => {
                self.now += Duration::from_millis(ms);
                self.t.expire(self.now);
                self.t.tick(self.now, self.latest.clone());
            }
            Op::EmptyCache(w) => {
                let worker = &mut self.workers[w];
                if !self.reports {
                    worker.allocator.release_cached(&mut self.card, worker.pid);
                }
            }
            Op::Trim(w) => {
                let worker = &mut self.workers[w];
                if std::mem::take(&mut worker.trim_asked) {
                    worker.allocator.release_cached(&mut self.card, worker.pid);
                    worker.trims += 1;
                }
            }
        }
        self.deliver();
        Ok(())
    }
}

impl World {
    /// What a server does once its requests stop coming: round after round each worker ends
    /// what it runs, starts what was granted, sends what it read and gives its cache back when
    /// asked; NVML is read and the loop ticks 100 ms. The ledger must then serve every request
    /// left, whatever the other workers cache (no permit left waiting for memory that is free or
    /// cached by a process that would give it back): the rounds it took, or what was still
    /// unserved after 20 s (the clients give up at 30 s).
    fn drain(&mut self) -> Result<u32, String> {
        let refused_before: u64 = self.workers.iter().map(|w| w.refused).sum();
        for round in 1..=200 {
            for w in 0..self.workers.len() {
                while self
                    .nth(w, 0, |r| matches!(r, Request::Working { .. }))
                    .is_some()
                {
                    self.step(&Op::Finish(w, 0))?;
                }
                while self
                    .nth(w, 0, |r| matches!(r, Request::Granted { .. }))
                    .is_some()
                {
                    self.step(&Op::Start(w, 0))?;
                }
                while self
                    .nth(w, 0, |r| matches!(r, Request::Reported { .. }))
                    .is_some()
                {
                    self.step(&Op::Send(w, 0))?;
                }
                self.step(&Op::Trim(w))?;
            }
            self.step(&Op::Sample)?;
            self.step(&Op::Tick(100))?;
            let refused: u64 = self.workers.iter().map(|w| w.refused).sum();
            if refused > refused_before {
                return Err(format!(
                    "{} request(s) timed out while every worker gave back what it held",
                    refused - refused_before
                ));
            }
            if self.workers.iter().all(|w| w.requests.is_empty()) {
                return Ok(round);
            }
        }
        Err(format!(
            "unserved after 20 s: {:?}",
            self.workers
                .iter()
                .map(|w| (w.pid, &w.requests))
                .collect::<Vec<_>>()
        ))
    }
}

/// `ops`, then the drain: no request met a CUDA OOM, and every one left was served.
fn run_and_drain(
    card_gib: u64,
    workers: usize,
    reports: bool,
    warm: &[Vec<u64>],
    ops: &[Op],
) -> Result<(), String> {
    run(card_gib, workers, reports, warm, ops)?
        .drain()
        .map(drop)
        .map_err(|e| format!("drain: {e}"))
}

fn run(
    card_gib: u64,
    workers: usize,
    reports: bool,
    warm: &[Vec<u64>],
    ops: &[Op],
) -> Result<World, String> {
    let mut world = World::new(card_gib, workers, reports, warm);
    for (i, op) in ops.iter().enumerate() {
        world
            .step(op)
            .map_err(|e| format!("step {i} {op:?}: {e}"))?;
    }
    Ok(world)
}

#[test]
fn the_simulation_reaches_the_cache_the_allocators_retry_and_trims() {
    // A property that held only because nothing was served from a cache would prove nothing:
    // over a few hundred sequences, requests are served from cached blocks, and workers give
    // their cache back when the ledger asks (`trim`). (The allocator's own release-and-retry,
    // 3 to 5 times a run in the Python scenario before the ledger counted a permit larger than
    // its holder's cached blocks in full, is never needed now.)
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let (mut from_cache, mut trims) = (0, 0);
    for case in 0..300 {
        let ops = proptest::collection::vec(op(3), 150..200)
            .new_tree(&mut runner)
            .expect("a sequence")
            .current();
        let world = run(24, 3, case % 2 == 0, &[], &ops).expect("no CUDA OOM");
        for w in &world.workers {
            from_cache += w.allocator.from_cache;
            trims += w.trims;
        }
    }
    assert!(
        from_cache > 100 && trims > 0,
        "from cache {from_cache}, trims {trims}"
    );
}

// Moved from the host suite (`permits_allocators`): one caching server with mixed sizes on 16
// and 24 GiB (`mixed_sizes_on_a_caching_server_never_overflow_on_16_or_24_gib`), forked
// workers with mixed sizes (`forked_workers_with_mixed_sizes_never_overflow`): never a CUDA
// OOM, and every request served once the server stops asking.
proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn one_worker_on_16_gib_never_meets_a_cuda_oom_and_is_served(
        ops in proptest::collection::vec(op(1), 1..200),
        reports in any::<bool>(),
        warm in warm(1),
    ) {
        if let Err(e) = run_and_drain(16, 1, reports, &warm, &ops) {
            prop_assert!(false, "{e}");
        }
    }

    #[test]
    fn one_worker_on_24_gib_never_meets_a_cuda_oom_and_is_served(
        ops in proptest::collection::vec(op(1), 1..200),
        reports in any::<bool>(),
        warm in warm(1),
    ) {
        if let Err(e) = run_and_drain(24, 1, reports, &warm, &ops) {
            prop_assert!(false, "{e}");
        }
    }

    #[test]
    fn two_workers_on_16_gib_never_meet_a_cuda_oom_and_are_served(
        ops in proptest::collection::vec(op(2), 1..200),
        reports in any::<bool>(),
        warm in warm(2),
    ) {
        if let Err(e) = run_and_drain(16, 2, reports, &warm, &ops) {
            prop_assert!(false, "{e}");
        }
    }

    #[test]
    fn three_workers_on_24_gib_never_meet_a_cuda_oom_and_are_served(
        ops in proptest::collection::vec(op(3), 1..200),
        reports in any::<bool>(),
        warm in warm(3),
    ) {
        if let Err(e) = run_and_drain(24, 3, reports, &warm, &ops) {
            prop_assert!(false, "{e}");
        }
    }
}

/// Issue 41's host-pool caching run, on the daemon's own schedule: one caching server in no
/// model (the host-wide pool, root's), the seed card (16 GiB, 4.5 GiB of weights and context,
/// 3 GiB per request: three fit at once beside the floor), three bursts of 10 requests that
/// each wait up to 5 s for a permit, work 200 ms and release it. The loop ticks every 200 ms and
/// takes in the reading its sampler took 1 ms after the tick before (2 ms long); that reading
/// has the process lists only while a reservation is out or waits, on every other tick while
/// idle (a process scan is due), or when a request waits for a reading (then the loop is woken
/// once it is in). The server connects at `phase` ms, sends its first burst 2 ms later, and
/// takes a granted request's memory `alloc_ms` after the grant; a `cold` one holds nothing
/// until its first request (CUDA initialised lazily: its context comes with that request's
/// memory). It gives its cache back when asked (`trim`), as the Python client has PyTorch do.
mod host_pool {
    use super::*;

    const TICK_MS: u64 = 200;
    const WORK_MS: u64 = 200;
    const TIMEOUT_MS: u64 = 5_000;
    const BURSTS: usize = 3;
    const BURST: u64 = 10;
    const REQUEST: u64 = 3 * GIB;
    const PID: i32 = 42;

    enum Job {
        Waiting(u64),
        Granted {
            permit: u64,
            at: u64,
        },
        Working {
            permit: u64,
            handle: Handle,
            at: u64,
        },
    }

    /// What the server saw: requests served, refused, and the most at work at once.
    #[derive(Debug, PartialEq, Eq)]
    pub(super) struct Served {
        pub served: u64,
        pub refused: u64,
        pub max_in_flight: usize,
    }

    struct Run {
        t: Reservations,
        cold: bool,
        card: Card,
        server: Caching,
        unattributed: Unattributed,
        latest: Capacity,
        /// What each process held when the lists were last read.
        listed: BTreeMap<i32, u64>,
        ticks: u64,
        next_tick: u64,
        /// The sample asked for: when it starts, and whether it reads the lists.
        sample: Option<(u64, bool)>,
        /// A request waits for a reading: the loop is woken once the next one is in.
        wake_on_sample: bool,
        jobs: Vec<Job>,
        next_id: u64,
        served: Served,
    }

    impl Run {
        fn new(cold: bool) -> Run {
            let mut card = Card {
                total: 16 * GIB,
                held: BTreeMap::new(),
            };
            if !cold {
                assert!(card.malloc(PID, CONTEXT + WEIGHTS));
            }
            let mut unattributed = Unattributed::default();
            let latest = host_reading(&card, &card.held, true, 0, &mut unattributed);
            let mut t = Reservations::new(config(""));
            t.tick(Duration::ZERO, latest.clone());
            Run {
                t,
                cold,
                listed: card.held.clone(),
                card,
                server: Caching::default(),
                unattributed,
                latest,
                ticks: 0,
                next_tick: TICK_MS,
                sample: Some((1, true)),
                wake_on_sample: false,
                jobs: Vec::new(),
                next_id: 0,
                served: Served {
                    served: 0,
                    refused: 0,
                    max_in_flight: 0,
                },
            }
        }

        /// The loop is woken (a request waits, or a permit ended while others wait).
        fn wake(&mut self, ms: u64) {
            self.next_tick = self.next_tick.min(ms + 1);
        }

        fn answer(&mut self, response: Response, ms: u64) {
            match response {
                Response::Granted { id, permit, .. } => {
                    for job in &mut self.jobs {
                        if matches!(job, Job::Waiting(i) if *i == id) {
                            *job = Job::Granted { permit, at: ms };
                        }
                    }
                }
                Response::Refused { id, .. } => {
                    self.served.refused += 1;
                    self.jobs
                        .retain(|j| !matches!(j, Job::Waiting(i) if Some(*i) == id));
                }
                Response::Trim { .. } => self.server.release_cached(&mut self.card, PID),
                _ => {}
            }
        }

        fn deliver(&mut self, ms: u64) {
            for (_, response) in self.t.take_outbox() {
                self.answer(response, ms);
            }
        }

        /// The daemon at `ms`: its tick, its sampler.
        fn daemon(&mut self, ms: u64) {
            let now = Duration::from_millis(ms);
            if ms == self.next_tick {
                self.t.expire(now);
                self.t.tick(now, self.latest.clone());
                self.deliver(ms);
                self.ticks += 1;
                let fresh = self.t.wants_fresh_gpu();
                let lists = self.t.busy() || fresh || self.ticks % 2 == 0;
                self.sample = Some((ms + 1, lists));
                self.wake_on_sample |= fresh;
                self.next_tick = ms + TICK_MS;
            }
            if let Some((at, lists)) = self.sample {
                // Taken at `at`, in 2 ms later.
                if ms == at + 2 {
                    let held = self.card.held.clone();
                    if lists {
                        self.listed = held.clone();
                    }
                    let listed = self.listed.clone();
                    self.latest =
                        host_reading(&self.card, &listed, lists, at, &mut self.unattributed);
                    self.sample = None;
                    if std::mem::take(&mut self.wake_on_sample) {
                        self.wake(ms);
                    }
                }
            }
        }

        /// The server at `ms`: takes granted requests' memory, ends finished ones.
        fn server(&mut self, ms: u64, alloc_ms: u64) -> Result<(), String> {
            let now = Duration::from_millis(ms);
            let conn = PID as ConnId;
            for i in 0..self.jobs.len() {
                match self.jobs[i] {
                    Job::Granted { permit, at } if ms >= at + alloc_ms => {
                        if self.cold && !self.card.held.contains_key(&PID) {
                            assert!(self.card.malloc(PID, CONTEXT), "the context fits");
                        }
                        let Some(handle) = self.server.alloc(&mut self.card, PID, REQUEST) else {
                            return Err(format!("CUDA OOM under permit {permit} at {ms} ms"));
                        };
                        self.jobs[i] = Job::Working {
                            permit,
                            handle,
                            at: ms,
                        };
                    }
                    Job::Working { permit, handle, at } if ms >= at + WORK_MS => {
                        self.server.free(handle);
                        let released = self.t.release_permit(conn, 0, permit, now);
                        if !matches!(released, Response::Released { .. }) {
                            return Err(format!("release of permit {permit}: {released:?}"));
                        }
                        self.served.served += 1;
                        self.jobs[i] = Job::Waiting(0);
                        if self.t.wants_fresh_gpu() {
                            self.wake(ms);
                        }
                    }
                    _ => {}
                }
            }
            self.jobs.retain(|j| !matches!(j, Job::Waiting(0)));
            self.deliver(ms);
            let working = self
                .jobs
                .iter()
                .filter(|j| matches!(j, Job::Working { .. }))
                .count();
            self.served.max_in_flight = self.served.max_in_flight.max(working);
            Ok(())
        }

        fn burst(&mut self, ms: u64) {
            let now = Duration::from_millis(ms);
            for _ in 0..BURST {
                self.next_id += 1;
                let id = self.next_id;
                self.jobs.push(Job::Waiting(id));
                let request = AcquireRequest {
                    id,
                    gpu_bytes: Some(REQUEST),
                    timeout_ms: Some(TIMEOUT_MS),
                    ttl_ms: Some(60_000),
                    ..Default::default()
                };
                match self.t.acquire(PID as ConnId, request, now) {
                    Some(answer) => self.answer(answer, ms),
                    None => self.wake(ms),
                }
            }
        }
    }

    /// A reading sampled at `at` ms: free memory from the card, the per-process figures from
    /// `listed`, read in this pass (`lists`) or left from an earlier one.
    fn host_reading(
        card: &Card,
        listed: &BTreeMap<i32, u64>,
        lists: bool,
        at: u64,
        unattributed: &mut Unattributed,
    ) -> Capacity {
        let mut c = card.reading_listing(listed, Duration::from_millis(at), unattributed);
        c.models.clear();
        c.member_of.clear();
        c.gpu_consistent &= lists;
        c.gpu_processes_stale = !lists;
        c
    }

    pub(super) fn run(phase: u64, alloc_ms: u64, cold: bool) -> Result<Served, String> {
        let mut run = Run::new(cold);
        let conn = PID as ConnId;
        let mut next_burst = Some(phase + 2);
        let mut bursts = 0;
        let mut ms = 1;
        while ms < 60_000 {
            if ms == phase {
                run.t.join(conn, peer(0, PID), Duration::from_millis(ms));
            }
            run.daemon(ms);
            if next_burst == Some(ms) {
                run.burst(ms);
                bursts += 1;
                next_burst = None;
            }
            run.server(ms, alloc_ms)?;
            if next_burst.is_none() && run.jobs.is_empty() {
                if bursts == BURSTS {
                    return Ok(run.served);
                }
                next_burst = Some(ms + 1_000);
            }
            // On to the next moment anything happens.
            let jobs = run.jobs.iter().filter_map(|j| match *j {
                Job::Granted { at, .. } => Some(at + alloc_ms),
                Job::Working { at, .. } => Some(at + WORK_MS),
                Job::Waiting(_) => None,
            });
            ms = [
                Some(run.next_tick),
                run.sample.map(|(at, _)| at + 2),
                next_burst,
            ]
            .into_iter()
            .flatten()
            .chain((ms < phase).then_some(phase))
            .chain(jobs)
            .filter(|&t| t > ms)
            .min()
            .unwrap_or(ms + 1);
        }
        Err(format!("not over after 60 s: {:?}", run.served))
    }
}

#[test]
fn a_caching_server_in_no_model_is_served_from_its_own_cache_whatever_the_sampling_phase() {
    // Issue 41: the seed bursts against a caching server in no model were served 30/30 in 17
    // runs of 19, and 3/30 in the other two: the first three granted, and every later one timed
    // out beside the server's own cache. Every phase of its first request against the loop's
    // two-tick cycle, at 1 ms, each with another delay between a grant and its `cudaMalloc`.
    let mut failed = Vec::new();
    for phase in 1..=2 * 200 {
        let alloc_ms = [0, 1, 5, 60][phase as usize % 4];
        let served = host_pool::run(phase, alloc_ms, false);
        let all = host_pool::Served {
            served: 30,
            refused: 0,
            max_in_flight: 3,
        };
        if served.as_ref() != Ok(&all) {
            failed.push((phase, alloc_ms, served));
        }
    }
    assert!(failed.is_empty(), "(phase, alloc_ms, served): {failed:?}");
}

#[test]
fn a_caching_server_in_no_model_that_held_nothing_at_its_first_request_gets_its_cache_back() {
    // A server that initialises CUDA with its first request: its first permits are set against
    // free memory in full (it held nothing of its own), and once they end everything it holds,
    // their cache included, is its baseline (NVML cannot tell them apart). Asked to give back
    // what it may cache, as a model's server is, it is served again; in no model it never was.
    let mut failed = Vec::new();
    for phase in (1..=2 * 200).step_by(7) {
        let served = host_pool::run(phase, 1, true);
        if !served
            .as_ref()
            .is_ok_and(|s| s.served == 30 && s.refused == 0)
        {
            failed.push((phase, served));
        }
    }
    assert!(failed.is_empty(), "(phase, served): {failed:?}");
}
