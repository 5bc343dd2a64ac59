//! One pool's books (a model, or the host-wide pool of permits that belong to no model): what its
//! outstanding reservations promise, what it used before them, and what its permits turned out
//! to cost.
//!
//! Its holders' and its own memory against their reservations are kept as [`Books`]
//! (`books.rs`, which says the rules); what its permits cost is learned by [`Learner`]
//! (`learner.rs`).

use std::collections::BTreeMap;
use std::time::Duration;

use super::books::{on, Books, PerGpu};
use super::capacity::{Capacity, ModelUse};
pub use super::learner::Learner;
use crate::snapshot::ProcessId;

#[derive(Debug, Default)]
pub struct Account {
    /// What outstanding reservations promise in RAM.
    pub reserved_ram: u64,
    /// The pool as a whole (a model's members), for its budget and what permits cost.
    pool: Books,
    /// The books of each holder whose processes hold GPU memory.
    holders: BTreeMap<ProcessId, Books>,
    /// Reservations of holders whose processes hold no GPU memory (a front end whose model's
    /// memory is in other processes, `gpuguard permit -- CMD` before CMD allocates), together:
    /// set against the model's memory outside every holder's tree. They share reservations, not
    /// allowances: what mixed sizes may strand is each holder's own (`Books::sizes`).
    shared: Books,
    /// The holders in `shared`, with their reservations there.
    shared_holders: BTreeMap<ProcessId, usize>,
    /// The latest use of the model seen (a model pool).
    usage: ModelUse,
    pub learner: Learner,
    pub counts: Counts,
}

/// Totals since the daemon started, for status.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counts {
    pub granted: u64,
    pub granted_after_wait: u64,
    pub refused: u64,
    pub expired: u64,
}

/// Observes `books` of `holder` with what the capacity saw of its processes.
fn observe_holder(books: &mut Books, holder: ProcessId, capacity: &Capacity) {
    let (consistent, at) = (capacity.gpu_consistent, capacity.gpu_sampled_at);
    match capacity.tree(holder) {
        Some(t) => books.observe(&t.gpu_bytes, t.members, consistent && !t.gpu_unknown, at),
        None => books.observe(&PerGpu::new(), 0, consistent, at),
    }
}

impl Account {
    fn idle(&self) -> bool {
        self.reserved_ram == 0 && self.pool.idle()
    }

    /// A new reading after a tick: the use of the pool's model (`None`: the host-wide pool),
    /// what each process tree holds, and whether the GPU figures came from the same NVML pass as
    /// the GPUs' free memory.
    pub fn observe(&mut self, model: Option<&str>, capacity: &Capacity) {
        let usage = model
            .and_then(|m| capacity.models.get(m))
            .cloned()
            .unwrap_or_default();
        let consistent = capacity.gpu_consistent && !usage.gpu_unknown;
        self.pool.observe(
            &usage.gpu_bytes,
            usage.members,
            consistent,
            capacity.gpu_sampled_at,
        );
        for (holder, books) in self.holders.iter_mut() {
            observe_holder(books, *holder, capacity);
        }
        self.holders.retain(|_, b| !b.forgettable());
        // The model's memory outside its holders' trees: what of it each holder's tree holds
        // (the holder is a member, or it started members) is in that holder's books already.
        let (mut outside, mut members) = (usage.gpu_bytes.clone(), usage.members);
        for (holder, books) in &self.holders {
            let of_model = model
                .and_then(|m| capacity.tree(*holder).and_then(|t| t.by_model.get(m)))
                .filter(|b| !b.is_empty());
            if let Some(of_model) = of_model {
                for (g, b) in of_model {
                    if let Some(o) = outside.get_mut(g) {
                        *o = o.saturating_sub(*b);
                    }
                }
                members = members.wrapping_add(books.members.unwrap_or(0));
            }
        }
        self.shared
            .observe(&outside, members, consistent, capacity.gpu_sampled_at);
        self.learner.observe(self.held_beyond_base());
        self.usage = usage;
    }

    /// Memory the pool's holders hold beyond their baselines (the shared books' too).
    fn held_beyond_base(&self) -> Option<u64> {
        self.holders
            .values()
            .chain([&self.shared])
            .map(Books::held_beyond_base)
            .try_fold(0, |sum, b| Some(sum + b?))
    }

    /// Whether `holder`'s reservations are set against its own processes' memory (they hold
    /// GPU memory) or go to the shared books.
    fn own_books(&self, holder: ProcessId, capacity: &Capacity) -> bool {
        if self.shared_holders.contains_key(&holder) {
            return false;
        }
        self.holders.contains_key(&holder)
            || capacity
                .tree(holder)
                .is_some_and(|t| t.gpu_bytes.values().any(|&b| b > 0))
    }

    /// Whether `holder`'s reservations have books here already: its own, or a place in the
    /// shared ones.
    pub fn has_books(&self, holder: ProcessId) -> bool {
        self.holders.contains_key(&holder) || self.shared_holders.contains_key(&holder)
    }

    /// A holder's books, new ones observed at rest from the latest reading.
    fn holder(&mut self, holder: ProcessId, capacity: &Capacity) -> &mut Books {
        self.holders.entry(holder).or_insert_with(|| {
            let mut books = Books::of(holder);
            observe_holder(&mut books, holder, capacity);
            books
        })
    }

    /// A launched server became ready: what it holds now is its own.
    pub fn rebase(&mut self, holder: ProcessId) {
        self.pool.rebase();
        self.shared.rebase();
        if let Some(books) = self.holders.get_mut(&holder) {
            books.rebase();
        }
    }

    pub fn usage(&self) -> &ModelUse {
        &self.usage
    }

    /// What this pool's reservations may still take of GPU `gpu`: never less than nothing (its
    /// holders' caches are theirs alone).
    pub fn gpu_promised(&self, gpu: u32, consistent: bool) -> u64 {
        self.holders
            .values()
            .chain([&self.shared])
            .map(|b| b.promised(gpu, consistent).max(0) as u64)
            .sum()
    }

    /// Of `gpu_promised`, what the reservations of the holders `whose` picks may still take.
    pub fn gpu_promised_by(
        &self,
        gpu: u32,
        consistent: bool,
        whose: &dyn Fn(ProcessId) -> bool,
    ) -> u64 {
        self.holders
            .values()
            .chain([&self.shared])
            .map(|b| b.promised_by(gpu, consistent, whose))
            .sum()
    }

    /// The same, seen by `holder`'s next request: the cache of the books it draws on counts
    /// (may be negative). The ledger's own tests read it.
    #[cfg(test)]
    pub fn gpu_promised_to(
        &self,
        holder: ProcessId,
        capacity: &Capacity,
        gpu: u32,
        consistent: bool,
    ) -> i64 {
        self.gpu_promised_beside(holder, capacity, gpu, consistent, 0)
    }

    /// `gpu_promised_to`, once `holder` has its next reservation of `extra` on `gpu`, less
    /// `extra` itself: what else it leaves promised (what it strands of the cache, with the
    /// cache it is served from taken off). The room for that reservation is free memory less
    /// this, and it fits when the room holds `extra`.
    pub fn gpu_promised_beside(
        &self,
        holder: ProcessId,
        capacity: &Capacity,
        gpu: u32,
        consistent: bool,
        extra: u64,
    ) -> i64 {
        let own = self.own_books(holder, capacity);
        let others: i64 = self
            .holders
            .iter()
            .filter(|(h, _)| !own || **h != holder)
            .map(|(_, b)| b.promised(gpu, consistent).max(0))
            .sum();
        let none = Books::default();
        let (draws_on, shared) = match (own, self.holders.get(&holder)) {
            (true, Some(b)) => (b, &self.shared),
            (true, None) => (&none, &self.shared),
            (false, _) => (&self.shared, &none),
        };
        let mine = draws_on.promised_to_self_with(holder, gpu, consistent, extra) - extra as i64;
        others + mine + shared.promised(gpu, consistent).max(0)
    }

    /// The holders that keep memory on `gpu` cached beyond their reservations, and how much.
    pub fn idle_caches(&self, capacity: &Capacity, gpu: u32) -> Vec<(ProcessId, u64)> {
        self.holders
            .iter()
            .filter_map(|(h, b)| {
                let cached = -b.promised_to_self(*h, gpu, capacity.gpu_consistent);
                (cached > 0).then_some((*h, cached as u64))
            })
            .collect()
    }

    /// Some reservation ended that no reading since shows given back or kept cached: until one
    /// does, its memory stays promised, and a reading taken now may let a waiting request in.
    pub fn ended_unseen(&self) -> bool {
        std::iter::once(&self.pool)
            .chain(std::iter::once(&self.shared))
            .chain(self.holders.values())
            .any(|b| !b.ended.is_empty())
    }

    /// Whether `holder`'s allocator says what it caches (a report in force or waiting for its
    /// reading): its cache is known, not to be guessed at.
    pub fn reports(&self, holder: ProcessId) -> bool {
        self.holders
            .get(&holder)
            .is_some_and(|b| b.report.is_some() || b.report_pending.is_some())
    }

    /// `holder` was asked at `now` to give its cache back: what its allocator said it caches,
    /// or says in a report read before now, is void.
    pub fn forget_report(&mut self, holder: ProcessId, now: Duration) {
        if let Some(books) = self.holders.get_mut(&holder) {
            books.forget_report();
            books.steady_since = books.steady_since.max(Some(now));
        }
    }

    /// Whether a permit of `bytes` for `holder` on `gpu` may fit none of its cached blocks (see
    /// `Books::promised_to_self_with`).
    pub fn outgrows_cache(&self, holder: ProcessId, gpu: u32, bytes: u64) -> bool {
        self.holders
            .get(&holder)
            .is_some_and(|b| b.outgrows(holder, gpu, bytes))
    }

    /// Whether `bytes` more for `holder` on `gpu` come wholly out of its own cache.
    pub fn own_cache_holds(
        &self,
        holder: ProcessId,
        capacity: &Capacity,
        gpu: u32,
        bytes: u64,
    ) -> bool {
        self.own_books(holder, capacity)
            && self.holders.get(&holder).is_some_and(|b| {
                b.promised_to_self_with(holder, gpu, capacity.gpu_consistent, bytes) <= 0
            })
    }

    /// The same for host RAM: always the whole reservation (see the module doc).
    pub fn ram_promised(&self) -> i64 {
        self.reserved_ram as i64
    }

    /// What the pool counts against its GPU budget: its baseline (its use, until settled) plus
    /// its reservations.
    pub fn gpu_committed(&self) -> u64 {
        let held: u64 = match &self.pool.base {
            Some(base) => base.values().sum(),
            None => self.usage.gpu_total_bytes(),
        };
        held + self.pool.reserved.values().sum::<u64>()
    }

    pub fn ram_committed(&self) -> u64 {
        self.usage.ram_bytes + self.reserved_ram
    }

    /// GPUs the pool already uses or has reservations on.
    pub fn on_gpu(&self, gpu: u32) -> bool {
        on(&self.usage.gpu_bytes, gpu) > 0 || on(&self.pool.reserved, gpu) > 0
    }

    pub fn reserve(
        &mut self,
        holder: ProcessId,
        capacity: &Capacity,
        (gpus, per_gpu, ram_bytes): (&[u32], u64, u64),
        now: Duration,
    ) {
        if self.own_books(holder, capacity) {
            self.holder(holder, capacity)
                .reserve(holder, gpus, per_gpu, now);
        } else {
            self.shared.reserve(holder, gpus, per_gpu, now);
            *self.shared_holders.entry(holder).or_default() += 1;
        }
        self.pool.reserve(holder, gpus, per_gpu, now);
        self.reserved_ram += ram_bytes;
    }

    pub fn unreserve(
        &mut self,
        holder: ProcessId,
        (gpus, per_gpu, ram_bytes): (&[u32], u64, u64),
        now: Duration,
    ) {
        if let Some(n) = self.shared_holders.get_mut(&holder) {
            self.shared.unreserve(holder, gpus, per_gpu, now);
            *n -= 1;
            if *n == 0 {
                self.shared_holders.remove(&holder);
            }
        } else if let Some(books) = self.holders.get_mut(&holder) {
            books.unreserve(holder, gpus, per_gpu, now);
        }
        self.pool.unreserve(holder, gpus, per_gpu, now);
        self.reserved_ram = self.reserved_ram.saturating_sub(ram_bytes);
    }

    /// `holder`'s allocator said when it was read, at `read_at`, that it holds `bytes` for its
    /// permits' work, on the one GPU it holds memory on (ignored when it holds memory on
    /// several, or none): it counts from the first reading sampled after `read_at`, while NVML
    /// shows the holder holding what it held then (see `Books::steady_since`).
    pub fn report_cache(
        &mut self,
        holder: ProcessId,
        capacity: &Capacity,
        bytes: u64,
        read_at: Duration,
    ) {
        if !self.own_books(holder, capacity) {
            return;
        }
        let books = self.holder(holder, capacity);
        let mut gpus = books.usage.iter().filter(|(_, &b)| b > 0).map(|(g, _)| *g);
        let report = match (gpus.next(), gpus.next()) {
            (Some(gpu), None) => PerGpu::from([(gpu, bytes)]),
            _ => PerGpu::new(),
        };
        tracing::debug!(
            "pid {}: its allocator reports {bytes} B cached (read at {read_at:?}), taken as {report:?} from the next reading",
            holder.pid,
        );
        books.report_pending = Some((read_at, report));
    }

    /// A holder's books as the debug log shows them (why a permit waits).
    pub fn describe_holder(&self, holder: ProcessId) -> String {
        match (self.holders.get(&holder), self.shared_holders.get(&holder)) {
            (Some(books), _) => format!("own books {books:?}"),
            (None, Some(_)) => format!("shared books {:?}", self.shared),
            (None, None) => "no books yet".into(),
        }
    }

    /// A permit granted; `permits` are held now, with it.
    pub fn permit_granted(&mut self, permits: usize) {
        let held = self.held_beyond_base();
        self.learner.permit_granted(held, permits);
    }

    /// A permit held for `held` ended; `permits` are held now, without it.
    pub fn permit_ended(&mut self, held: Duration, permits: usize) {
        self.learner.permit_ended(held, permits);
    }

    /// True while nothing refers to the pool any more (it may be forgotten).
    pub fn unused(&self) -> bool {
        self.idle() && !self.learner.busy() && self.holders.is_empty()
    }
}

/// What the books say is reserved, for the ledger's own checks (`reserve::tests`).
#[cfg(test)]
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reserved {
    /// Per GPU, over every reservation.
    pub gpu: PerGpu,
    /// Per GPU, how many reservations of a size above 0.
    pub count: BTreeMap<u32, u64>,
    pub ram: u64,
}

#[cfg(test)]
impl Account {
    /// The pool's books, and the holders' and shared books summed: both must say the same.
    pub fn reserved(&self) -> (Reserved, Reserved) {
        let pool = Reserved {
            gpu: self.pool.reserved.clone(),
            count: self.pool.counts(),
            ram: self.reserved_ram,
        };
        let mut parts = Reserved {
            ram: self.reserved_ram,
            ..Reserved::default()
        };
        for books in self.holders.values().chain([&self.shared]) {
            for (g, b) in &books.reserved {
                *parts.gpu.entry(*g).or_default() += b;
            }
            for (g, n) in books.counts() {
                *parts.count.entry(g).or_default() += n;
            }
        }
        parts.gpu.retain(|_, b| *b > 0);
        (pool, parts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reserve::capacity::TreeUse;
    use crate::reserve::learner::SAMPLES_FOR_DEFAULT;

    const GIB: u64 = 1 << 30;
    const A: ProcessId = ProcessId {
        pid: 100,
        start_time: 1,
    };
    const B: ProcessId = ProcessId {
        pid: 200,
        start_time: 1,
    };

    /// The test's clock: every call is later than the one before.
    fn tick() -> Duration {
        use std::sync::atomic::{AtomicU64, Ordering};
        static CLOCK: AtomicU64 = AtomicU64::new(1);
        Duration::from_millis(CLOCK.fetch_add(1, Ordering::Relaxed))
    }

    /// A reading sampled now in which each holder holds `gib` GiB on GPU 0, from one NVML pass
    /// or not.
    fn reading(holders: &[(ProcessId, u64)], consistent: bool) -> Capacity {
        let trees = holders
            .iter()
            .filter(|(_, gib)| *gib > 0)
            .map(|&(id, gib)| {
                let tree = TreeUse {
                    gpu_bytes: BTreeMap::from([(0, gib * GIB)]),
                    members: id.pid as u64,
                    ..Default::default()
                };
                (id, tree)
            })
            .collect();
        Capacity {
            trees,
            gpu_consistent: consistent,
            gpu_sampled_at: Some(tick()),
            ..Default::default()
        }
    }

    /// A reading that shows no process (for questions about holders already known).
    fn nothing() -> Capacity {
        reading(&[], true)
    }

    /// The host-wide pool with holder A settled at `weights` GiB.
    fn settled(weights: u64) -> (Account, Capacity) {
        let mut a = fresh();
        let at_rest = reading(&[(A, weights)], true);
        a.observe(None, &at_rest);
        (a, at_rest)
    }

    /// `settled(4)` after one 3 GiB permit of A's ended, its memory cached: the reading that
    /// shows A holding 7 GiB.
    fn cached_one() -> (Account, Capacity) {
        let (mut a, c) = settled(4);
        take(&mut a, &c, A, 3);
        a.observe(None, &reading(&[(A, 7)], true));
        give_back(&mut a, A, 3);
        let cached = reading(&[(A, 7)], true);
        a.observe(None, &cached);
        (a, cached)
    }

    thread_local! {
        /// Permits held in the test's account (the ledger counts its holdings).
        static HELD: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    fn fresh() -> Account {
        HELD.set(0);
        Account::default()
    }

    fn take(a: &mut Account, c: &Capacity, who: ProcessId, gib: u64) {
        a.reserve(who, c, (&[0], gib * GIB, 0), tick());
        HELD.set(HELD.get() + 1);
        a.permit_granted(HELD.get());
    }

    fn give_back(a: &mut Account, who: ProcessId, gib: u64) {
        a.unreserve(who, (&[0], gib * GIB, 0), tick());
        HELD.set(HELD.get() - 1);
        a.permit_ended(Duration::from_millis(100), HELD.get());
    }

    /// A's allocator reports `gib` GiB held for work, and a reading like `c` sampled after the
    /// report comes in (a report counts from the first reading after it).
    fn report(a: &mut Account, c: &Capacity, gib: u64) -> Capacity {
        a.report_cache(A, c, gib * GIB, tick());
        let after = Capacity {
            gpu_sampled_at: Some(tick()),
            ..c.clone()
        };
        a.observe(None, &after);
        after
    }

    #[test]
    fn promises_shrink_as_the_holder_takes_what_it_reserved() {
        let (mut a, c) = settled(4);
        take(&mut a, &c, A, 3);
        assert_eq!(a.gpu_promised(0, true), 3 * GIB);
        a.observe(None, &reading(&[(A, 6)], true)); // 2 of the 3 GiB taken
        assert_eq!(a.gpu_promised(0, true), GIB);
        // Figures from different passes: the whole reservation stays promised.
        a.observe(None, &reading(&[(A, 6)], false));
        assert_eq!(a.gpu_promised(0, true), 3 * GIB);
    }

    #[test]
    fn weights_seen_late_never_pass_for_spare_memory() {
        // The first permit comes before NVML's lists show the holder's weights (4 GiB).
        let mut a = fresh();
        take(&mut a, &reading(&[], true), A, 3);
        a.observe(None, &reading(&[(A, 7)], true)); // weights and the permit's 3 GiB
        assert_eq!(a.gpu_promised(0, true), 3 * GIB, "unsettled: all of it");
        assert_eq!(
            a.gpu_promised_to(A, &nothing(), 0, true),
            3 * GIB as i64,
            "no cache credit"
        );
        give_back(&mut a, A, 3);
        a.observe(None, &reading(&[(A, 4)], true));
        assert_eq!(
            a.gpu_promised_to(A, &nothing(), 0, true),
            0,
            "first quiet reading: none"
        );
        a.observe(None, &reading(&[(A, 4)], true));
        assert_eq!(
            a.gpu_promised_to(A, &nothing(), 0, true),
            0,
            "settled at the weights"
        );
        take(&mut a, &reading(&[(A, 4)], true), A, 3);
        a.observe(None, &reading(&[(A, 5)], true));
        assert_eq!(a.gpu_promised(0, true), 2 * GIB, "settled: 1 of 3 taken");
    }

    #[test]
    fn a_holders_cache_serves_its_own_next_permits_and_nobody_elses() {
        let (mut a, c) = settled(4);
        for _ in 0..3 {
            take(&mut a, &c, A, 3);
        }
        a.observe(None, &reading(&[(A, 13)], true));
        // A burst: the three end and three more start before the next reading. The cache is
        // theirs: nothing more is promised, and nothing more is offered.
        for _ in 0..3 {
            give_back(&mut a, A, 3);
            take(&mut a, &c, A, 3);
        }
        assert_eq!(a.gpu_promised_to(A, &nothing(), 0, true), 0);
        a.observe(None, &reading(&[(A, 13)], true));
        assert_eq!(a.gpu_promised_to(A, &nothing(), 0, true), 0);
        for _ in 0..3 {
            give_back(&mut a, A, 3);
        }
        // PyTorch kept the 9 GiB: A's next permits take from it first...
        a.observe(None, &reading(&[(A, 13)], true));
        assert_eq!(a.gpu_promised_to(A, &nothing(), 0, true), -9 * GIB as i64);
        take(&mut a, &c, A, 3);
        assert_eq!(a.gpu_promised_to(A, &nothing(), 0, true), -6 * GIB as i64);
        // ...while for everyone else it is neither free nor promised memory.
        assert_eq!(a.gpu_promised(0, true), 0);
        assert_eq!(a.gpu_promised_to(B, &nothing(), 0, true), 0);
        // Another process of the pool (a forked worker) has a cache of its own only.
        let worker = reading(&[(A, 13), (B, 4)], true);
        take(&mut a, &worker, B, 3);
        assert_eq!(a.gpu_promised_to(B, &worker, 0, true), 3 * GIB as i64);
        // Not one pass: no credit at all.
        assert_eq!(a.gpu_promised_to(A, &nothing(), 0, false), 6 * GIB as i64);
    }

    #[test]
    fn cache_credit_stops_at_the_most_its_permits_held_at_once() {
        let (mut a, c) = settled(4);
        for _ in 0..2 {
            take(&mut a, &c, A, 3);
        }
        // 6 GiB of permits, and the process grew by 9 GiB meanwhile (an adapter, fragments).
        a.observe(None, &reading(&[(A, 13)], true));
        for _ in 0..2 {
            give_back(&mut a, A, 3);
        }
        a.observe(None, &reading(&[(A, 13)], true));
        assert_eq!(a.gpu_promised_to(A, &nothing(), 0, true), -6 * GIB as i64);
        // Growth at rest is the holder's own (weights of an adapter), never cache.
        a.observe(None, &reading(&[(A, 16)], true));
        assert_eq!(a.gpu_promised_to(A, &nothing(), 0, true), -6 * GIB as i64);
        // `empty_cache()`: the fall comes out of the cache, the baseline stays.
        let emptied = reading(&[(A, 7)], true);
        a.observe(None, &emptied);
        assert_eq!(a.gpu_promised_to(A, &nothing(), 0, true), 0);
        take(&mut a, &emptied, A, 3);
        assert_eq!(a.gpu_promised_to(A, &nothing(), 0, true), 3 * GIB as i64);
    }

    #[test]
    fn slots_strand_nothing_and_what_may_be_stranded_is_bounded() {
        // Red-team finding: one large permit, then slots (size 0) or many small permits.
        let (mut a, c) = settled(0);
        take(&mut a, &c, A, 40);
        give_back(&mut a, A, 40);
        a.observe(None, &reading(&[(A, 0)], true));
        a.observe(None, &reading(&[(A, 0)], true));
        for _ in 0..16 {
            take(&mut a, &c, A, 0);
        }
        assert_eq!(a.gpu_promised(0, true), 0, "slots promise nothing");
        for _ in 0..20 {
            take(&mut a, &c, A, 1);
        }
        assert!(
            a.gpu_promised(0, true) <= 60 * GIB,
            "{}",
            a.gpu_promised(0, true)
        );
    }

    #[test]
    fn under_steady_traffic_each_ended_permit_is_let_go_by_the_first_reading_after_it() {
        // Permits end between every two readings: none is promised for longer than one reading.
        let (mut a, c) = settled(4);
        take(&mut a, &c, A, 3);
        for _ in 0..50 {
            let sampled = reading(&[(A, 7)], true); // NVML read while the permit is out
            give_back(&mut a, A, 3);
            take(&mut a, &c, A, 3); // the next request, before the reading reaches the books
            a.observe(None, &sampled);
            assert_eq!(
                a.gpu_promised(0, true),
                3 * GIB,
                "only the permit that ended after the sample stays promised"
            );
        }
    }

    #[test]
    fn mixed_sizes_keep_room_for_what_splitting_a_cached_block_strands() {
        // A 4 GiB block cached, then a 1 GiB request served from it: the 3 GiB left in that
        // segment can serve no 4 GiB request and cannot go back to the driver.
        let (mut a, c) = settled(4);
        take(&mut a, &c, A, 4);
        give_back(&mut a, A, 4);
        assert_eq!(a.gpu_promised(0, true), 4 * GIB, "not seen given back yet");
        a.observe(None, &reading(&[(A, 8)], true)); // kept cached
        take(&mut a, &c, A, 1);
        assert_eq!(a.gpu_promised(0, true), 0, "the cached block holds it");
        take(&mut a, &c, A, 4);
        assert_eq!(
            a.gpu_promised(0, true),
            4 * GIB,
            "the split block cannot hold the second 4 GiB"
        );
        // Same-size requests strand nothing.
        let (mut b, c) = settled(4);
        for _ in 0..3 {
            take(&mut b, &c, A, 3);
        }
        assert_eq!(b.gpu_promised(0, true), 9 * GIB);
    }

    #[test]
    fn a_reported_cache_still_keeps_room_for_what_splitting_it_strands() {
        // Seen on a real H100 with PyTorch 2.11 (bench/gpu/real-permits.sh): the client
        // reported its cache (4 GiB and 4 GiB blocks), a 1 GiB permit split one of them and a
        // 4 GiB permit then needed a new segment from the driver: CUDA OOM. The report says how
        // much is cached, not in what blocks, so stranding counts as it does for NVML's figure.
        let (mut a, c) = settled(4);
        take(&mut a, &c, A, 4);
        take(&mut a, &c, A, 4);
        give_back(&mut a, A, 4);
        give_back(&mut a, A, 4);
        a.observe(None, &reading(&[(A, 12)], true));
        let cached = reading(&[(A, 12)], true);
        a.observe(None, &cached);
        report(&mut a, &cached, 8);
        take(&mut a, &c, A, 4); // served from one cached block
        take(&mut a, &c, A, 1); // split the other: 3 GiB of it stranded
        let held = reading(&[(A, 12)], true);
        a.observe(None, &held);
        let held = report(&mut a, &held, 8);
        assert_eq!(
            a.gpu_promised_to(A, &held, 0, true),
            0,
            "a next 4 GiB permit needs 4 GiB of free memory, not the 3 GiB left in the split block"
        );
    }

    #[test]
    fn a_report_newer_than_the_reading_does_not_count_what_that_reading_calls_free() {
        // Seen with two forked workers (bench/allocators.sh's fake, CUDA OOM): A had 3 GiB
        // cached; a burst gave it two 3 GiB permits (one from the cache, one from the driver);
        // its next request reported 6 GiB held for work, before any reading showed the second
        // 3 GiB taken. Set against that reading's free memory, the report made A's permits look
        // wholly held, and two more were granted on memory that was not there.
        let (mut a, cached) = cached_one();
        take(&mut a, &cached, A, 3);
        take(&mut a, &cached, A, 3);
        a.report_cache(A, &cached, 6 * GIB, tick());
        assert_eq!(
            a.gpu_promised_to(A, &cached, 0, true),
            3 * GIB as i64,
            "the 3 GiB the reading has not seen taken stay promised"
        );
        // The reading after the report shows them held: nothing more is promised.
        let held = reading(&[(A, 10)], true);
        a.observe(None, &held);
        assert_eq!(a.gpu_promised_to(A, &held, 0, true), 0);
    }

    #[test]
    fn a_permit_larger_than_every_cached_block_counts_in_full_for_the_others() {
        // Seen with two forked workers and mixed sizes (bench/allocators.sh's fake, CUDA OOM):
        // worker A cached 2.5 GiB and took a 3.2 GiB permit. No cached block held it, so its
        // allocator took 3.2 GiB from the driver and kept the cache; the daemon had set the
        // cache against the permit, and worker B's next permits overflowed the card.
        let (mut a, c) = settled(4);
        take(&mut a, &c, A, 1); // 1 GiB, from the driver
        a.observe(None, &reading(&[(A, 5)], true));
        give_back(&mut a, A, 1);
        take(&mut a, &c, A, 2); // 2 GiB: the 1 GiB block does not hold it
        a.observe(None, &reading(&[(A, 7)], true));
        give_back(&mut a, A, 2);
        let cached = reading(&[(A, 7)], true); // 3 GiB cached, as blocks of 1 and 2 GiB
        a.observe(None, &cached);
        take(&mut a, &cached, A, 3);
        assert_eq!(
            a.gpu_promised_to(B, &cached, 0, true),
            3 * GIB as i64,
            "A's 3 GiB may all come from the driver"
        );
        // Once it ended, until a reading after its end shows what it took.
        give_back(&mut a, A, 3);
        assert_eq!(a.gpu_promised_to(B, &cached, 0, true), 3 * GIB as i64);
        let grown = reading(&[(A, 10)], true);
        a.observe(None, &grown);
        assert_eq!(
            a.gpu_promised_to(B, &grown, 0, true),
            0,
            "seen: its cache now"
        );
        // Requests no larger than the smallest ever taken fit any cached segment: the cache
        // serves them, for everyone's books.
        let (mut a, cached) = cached_one();
        take(&mut a, &cached, A, 3);
        assert_eq!(a.gpu_promised_to(B, &cached, 0, true), 0);
    }

    #[test]
    fn a_permit_is_let_in_only_with_room_for_what_it_strands_itself() {
        // Seen with forked workers and mixed sizes (bench/allocators.sh's fake, CUDA OOM): a
        // worker held a 3.9 GiB permit and asked for 2.3 GiB; the room was checked against what
        // was promised before it (3.9 GiB), not against what its own split of a 3.9 GiB cached
        // block would strand once granted (2 x 3.9 - 6.2 = 1.6 GiB more).
        let (mut a, c) = settled(4);
        take(&mut a, &c, A, 4);
        assert_eq!(a.gpu_promised_to(A, &c, 0, true), 4 * GIB as i64);
        assert_eq!(
            a.gpu_promised_beside(A, &c, 0, true, 2 * GIB),
            (4 + 2) * GIB as i64,
            "beside a 2 GiB permit: 4 GiB out and 2 GiB it may strand"
        );
        // A fixed size strands nothing.
        assert_eq!(
            a.gpu_promised_beside(A, &c, 0, true, 4 * GIB),
            4 * GIB as i64
        );
    }

    #[test]
    fn a_reading_from_more_than_one_nvml_pass_never_voids_what_was_learned() {
        // Seen on a real H200: a worker's tree was missing from one inconsistent reading; its
        // books started over, the next baseline took its cache for weights, and its cache was
        // then nobody's (no credit, no trim hint): two workers' requests waited 10 s for each
        // other's invisible caches.
        let (mut a, c) = cached_one();
        a.observe(None, &reading(&[(A, 7)], true));
        assert_eq!(
            a.gpu_promised_to(A, &c, 0, true),
            -3 * GIB as i64,
            "3 GiB cached"
        );
        a.observe(None, &reading(&[], false));
        for _ in 0..3 {
            a.observe(None, &reading(&[(A, 7)], true));
        }
        assert_eq!(
            a.gpu_promised_to(A, &c, 0, true),
            -3 * GIB as i64,
            "still its cache"
        );
    }

    #[test]
    fn a_report_waiting_for_its_reading_keeps_idle_books() {
        // The daemon restarted under a busy server (9 GiB cached, taken for weights): idle books
        // with nothing seen beyond their baseline are let go at each reading, and a report that
        // came after that reading's sample went with them, every time: 0/30 served in one run.
        let mut a = fresh();
        for _ in 0..3 {
            a.observe(None, &reading(&[(A, 13)], true));
        }
        let before = reading(&[(A, 13)], true);
        a.report_cache(A, &before, 9 * GIB, tick());
        a.observe(None, &before);
        let after = reading(&[(A, 13)], true);
        a.observe(None, &after);
        assert_eq!(a.gpu_promised_to(A, &after, 0, true), -9 * GIB as i64);
    }

    #[test]
    fn a_report_holds_only_while_the_process_holds_what_it_held_then() {
        // Seen on a real H200: PyTorch gave 9 GiB of its cache back on its own (a cudaMalloc
        // failed), and its last report (11 GiB held for work) still counted, up to all the
        // process held: permits were let in on memory that was gone, and one overflowed.
        let warm = reading(&[(A, 13)], true);
        let mut a = fresh();
        take(&mut a, &warm, A, 3);
        report(&mut a, &warm, 9);
        assert_eq!(a.gpu_promised_to(A, &nothing(), 0, true), -6 * GIB as i64);
        let gave_back = reading(&[(A, 7)], true);
        a.observe(None, &gave_back);
        assert_eq!(
            a.gpu_promised_to(A, &nothing(), 0, true),
            9 * GIB as i64,
            "the report is void: NVML alone, against the baseline it had"
        );
        // A report still waiting for its reading when the process gave memory back may have
        // been made before: it is dropped, not taken in.
        let warm = reading(&[(A, 13)], true);
        let mut a = fresh();
        take(&mut a, &warm, A, 3);
        a.report_cache(A, &warm, 9 * GIB, tick());
        let gave_back = reading(&[(A, 7)], true);
        a.observe(None, &gave_back);
        assert_eq!(a.gpu_promised_to(A, &nothing(), 0, true), 9 * GIB as i64);
    }

    /// A holds 13 GiB with a 3 GiB permit out, and its allocator reads 9 GiB held for work;
    /// then `between` happens (and returns the reading it leaves), the report arrives, and a
    /// reading like that one follows. What A's next permit may count on, with the report and
    /// without it.
    fn with_and_without_a_report_read_before(
        between: impl Fn(&mut Account) -> Capacity,
    ) -> (i64, i64) {
        let run = |report: bool| {
            let warm = reading(&[(A, 13)], true);
            let mut a = fresh();
            take(&mut a, &warm, A, 3);
            a.observe(None, &reading(&[(A, 13)], true));
            let read_at = tick();
            let now = between(&mut a);
            if report {
                a.report_cache(A, &now, 9 * GIB, read_at);
            }
            let after = Capacity {
                gpu_sampled_at: Some(tick()),
                ..now
            };
            a.observe(None, &after);
            a.gpu_promised_to(A, &nothing(), 0, true)
        };
        (run(true), run(false))
    }

    #[test]
    fn a_report_read_before_nvml_showed_a_change_is_void_even_when_the_figure_rose() {
        // Found by `reserve::tests::caching_workers` and seen as a rare CUDA OOM in CI (three
        // forked workers, a loaded machine): a worker's client read 9 GiB held for work; before
        // the request reached the daemon, another of its requests missed the cache, the
        // allocator gave 2 GiB of cached segments back and took a 3 GiB segment (NVML: 13 ->
        // 14 GiB, a rise). The report, taken in at the next reading, counted the 2 GiB gone.
        let (with, without) = with_and_without_a_report_read_before(|a| {
            let changed = reading(&[(A, 14)], true);
            a.observe(None, &changed);
            changed
        });
        assert_eq!(with, without, "NVML alone");
        // Read after that reading, the same report counts.
        let warm = reading(&[(A, 13)], true);
        let mut a = fresh();
        take(&mut a, &warm, A, 3);
        let changed = reading(&[(A, 14)], true);
        a.observe(None, &changed);
        report(&mut a, &changed, 9);
        assert_eq!(a.gpu_promised_to(A, &nothing(), 0, true), -6 * GIB as i64);
    }

    #[test]
    fn a_report_read_before_a_trim_was_asked_never_counts() {
        // The daemon asked A to give its cache back; a report A read before that arrives
        // later, and a reading taken before the trim was done shows nothing changed yet.
        let (with, without) = with_and_without_a_report_read_before(|a| {
            a.forget_report(A, tick());
            reading(&[(A, 13)], true)
        });
        assert_eq!(with, without, "NVML alone");
    }

    #[test]
    fn a_cache_warm_before_the_baseline_serves_its_own_permits_by_no_size() {
        // Found by `reserve::tests::caching_workers` with workers warm before the daemon saw
        // them: A's baseline took 13 GiB with its cache in it; its allocator reports 5 GiB
        // cached, in blocks of sizes nobody saw. A 2 GiB permit may fit none of them (a 1.9 GiB
        // block): it draws on free memory in full, and A is asked to give its cache back.
        let warm = reading(&[(A, 13)], true);
        let mut a = fresh();
        a.observe(None, &warm);
        let warm = report(&mut a, &warm, 5);
        assert!(a.outgrows_cache(A, 0, 2 * GIB));
        assert_eq!(a.gpu_promised_beside(A, &warm, 0, true, 2 * GIB), 0);
        assert_eq!(a.idle_caches(&warm, 0), [(A, 5 * GIB)]);
    }

    #[test]
    fn its_own_permit_larger_than_its_cached_blocks_draws_on_free_memory_in_full() {
        // Found by `reserve::tests::caching_workers`: worker A cached a 1 GiB block and asked
        // for 2 GiB. The block does not hold it: PyTorch took 2 GiB from the driver while free
        // memory lasted (promised to worker B) and kept the block, and B's permit overflowed.
        let (mut a, c) = settled(4);
        take(&mut a, &c, A, 1);
        a.observe(None, &reading(&[(A, 5)], true));
        give_back(&mut a, A, 1);
        let cached = reading(&[(A, 5)], true);
        a.observe(None, &cached);
        assert_eq!(
            a.gpu_promised_beside(A, &cached, 0, true, GIB),
            -(GIB as i64),
            "a 1 GiB permit is served from the cached block"
        );
        assert_eq!(
            a.gpu_promised_beside(A, &cached, 0, true, 2 * GIB),
            0,
            "a 2 GiB permit takes 2 GiB of free memory: the cached block serves none of it"
        );
    }

    #[test]
    fn memory_of_ended_permits_stays_promised_until_a_reading_shows_it_given_back() {
        // Two workers: A's permits end between two readings. A caching allocator keeps their
        // memory; until a reading sampled after the end says so, B may not count on it.
        let (mut a, c) = settled(4);
        take(&mut a, &c, A, 3);
        give_back(&mut a, A, 3);
        assert_eq!(a.gpu_promised_to(B, &nothing(), 0, true), 3 * GIB as i64);
        // A itself may: its cache or the free memory, either is there for it.
        assert_eq!(a.gpu_promised_to(A, &nothing(), 0, true), 0);
        // The reading after: it kept 3 GiB (held, not promised) or gave it back (free).
        a.observe(None, &reading(&[(A, 7)], true));
        assert_eq!(a.gpu_promised(0, true), 0);
        // Its cache is not taken for its own growth at rest by that first reading.
        a.observe(None, &reading(&[(A, 7)], true));
        assert_eq!(a.gpu_promised_to(A, &nothing(), 0, true), -3 * GIB as i64);
    }

    #[test]
    fn a_new_process_in_the_holders_tree_unsettles_it() {
        let (mut a, c) = settled(4);
        take(&mut a, &c, A, 3);
        give_back(&mut a, A, 3);
        a.observe(None, &reading(&[(A, 7)], true));
        assert_eq!(a.gpu_promised_to(A, &nothing(), 0, true), -3 * GIB as i64);
        // A child appears holding 5 GiB (an engine core loading): not cache.
        let mut grown = reading(&[(A, 12)], true);
        grown.trees.get_mut(&A).unwrap().members += 1;
        a.observe(None, &grown);
        assert_eq!(a.gpu_promised_to(A, &nothing(), 0, true), 0);
    }

    /// A client that started its model's server has the server in its process tree: the growth
    /// is in the client's books, and must not be counted again as the model's memory outside
    /// them. A reading taken while NVML's process lists moved (not consistent) is not "at rest"
    /// for the books outside every holder: there it counted a second time (CI saw the learner
    /// take 6 GiB per permit for 3).
    #[test]
    fn a_client_that_started_its_models_server_is_counted_once() {
        let client = A;
        let model = |gib: u64, consistent: bool| {
            let mut c = reading(&[(client, gib)], consistent);
            let bytes = BTreeMap::from([(0, gib * GIB)]);
            c.models.insert(
                "m".into(),
                ModelUse {
                    gpu_bytes: bytes.clone(),
                    members: 7,
                    ..Default::default()
                },
            );
            let tree = c.trees.get_mut(&client).unwrap();
            tree.by_model.insert("m".into(), bytes);
            c
        };
        let mut a = fresh();
        for _ in 0..3 {
            a.observe(Some("m"), &model(4, true));
        }
        for _ in 0..SAMPLES_FOR_DEFAULT {
            take(&mut a, &model(4, true), client, 1);
            a.observe(Some("m"), &model(7, false));
            a.observe(Some("m"), &model(7, true));
            give_back(&mut a, client, 1);
            for _ in 0..3 {
                a.observe(Some("m"), &model(4, true));
            }
        }
        assert_eq!(a.learner.quantile(0.95), Some(3 * GIB));
    }

    #[test]
    fn a_front_end_that_holds_no_gpu_memory_draws_on_the_memory_of_its_model() {
        // Model "m": a worker process holds the GPU memory, a front end takes the permits.
        let (worker, front) = (A, B);
        let model = |gib: u64| {
            let mut c = reading(&[(worker, gib)], true);
            c.models.insert(
                "m".into(),
                ModelUse {
                    gpu_bytes: BTreeMap::from([(0, gib * GIB)]),
                    members: 7,
                    ..Default::default()
                },
            );
            c.member_of.insert(worker, "m".into());
            c.member_of.insert(front, "m".into());
            c
        };
        let mut a = fresh();
        a.observe(Some("m"), &model(4));
        take(&mut a, &model(4), front, 3);
        assert_eq!(a.gpu_promised(0, true), 3 * GIB);
        a.observe(Some("m"), &model(7)); // the worker took it
        assert_eq!(a.gpu_promised(0, true), 0);
        give_back(&mut a, front, 3);
        a.observe(Some("m"), &model(7)); // and kept it cached
        assert_eq!(
            a.gpu_promised_to(front, &model(7), 0, true),
            -3 * GIB as i64
        );
        assert_eq!(a.gpu_promised(0, true), 0, "nobody else's");
        assert_eq!(a.gpu_committed(), 4 * GIB, "the budget counts the weights");
    }

    #[test]
    fn what_the_allocator_reports_caching_counts_up_to_what_nvml_shows_held() {
        // The daemon first saw A with its cache already warm (restarted under a busy server).
        let warm = reading(&[(A, 13)], true);
        let mut a = fresh();
        take(&mut a, &warm, A, 3);
        assert_eq!(
            a.gpu_promised_to(A, &nothing(), 0, true),
            3 * GIB as i64,
            "NVML alone: 13 GiB of its own"
        );
        a.report_cache(A, &warm, 9 * GIB, tick());
        assert_eq!(
            a.gpu_promised_to(A, &nothing(), 0, true),
            3 * GIB as i64,
            "not before a reading sampled after the report"
        );
        report(&mut a, &warm, 9);
        assert_eq!(a.gpu_promised_to(A, &nothing(), 0, true), -6 * GIB as i64);
        // A claim beyond what the process holds counts only what it holds.
        report(&mut a, &warm, 40);
        assert_eq!(a.gpu_promised_to(A, &nothing(), 0, true), -10 * GIB as i64);
        // For everyone else A's permit stays promised in full: a report frees nothing for them.
        assert_eq!(a.gpu_promised_to(B, &nothing(), 0, true), 3 * GIB as i64);
    }

    #[test]
    fn learns_growth_per_permit_and_a_warm_cache_does_not_teach_that_permits_are_free() {
        let (mut a, c) = settled(4);
        for _ in 0..3 {
            take(&mut a, &c, A, 3);
        }
        a.observe(None, &reading(&[(A, 13)], true)); // 3 permits, 9 GiB
        for _ in 0..3 {
            give_back(&mut a, A, 3);
        }
        assert_eq!(a.learner.quantile(0.5), Some(3 * GIB));
        // The cache is warm: the next periods grow nothing and teach nothing.
        for _ in 0..20 {
            a.observe(None, &reading(&[(A, 13)], true));
            for _ in 0..3 {
                take(&mut a, &c, A, 3);
            }
            a.observe(None, &reading(&[(A, 13)], true));
            for _ in 0..3 {
                give_back(&mut a, A, 3);
            }
        }
        assert_eq!(a.learner.samples(), 1);
        assert_eq!(a.learner.quantile(0.95), Some(3 * GIB));
        // A period that outgrows the cache: what is held beyond the weights, per permit.
        a.observe(None, &reading(&[(A, 13)], true));
        for _ in 0..4 {
            take(&mut a, &c, A, 3);
        }
        a.observe(None, &reading(&[(A, 16)], true));
        for _ in 0..4 {
            give_back(&mut a, A, 3);
        }
        assert_eq!(a.learner.samples(), 2);
        assert_eq!(a.learner.quantile(1.0), Some(3 * GIB));
        // A period no reading saw teaches nothing.
        take(&mut a, &c, A, 3);
        give_back(&mut a, A, 3);
        assert_eq!(a.learner.samples(), 2);
        assert_eq!(a.learner.typical_hold(), Some(Duration::from_millis(100)));
    }

    #[test]
    fn where_the_allocator_says_what_it_holds_for_work_that_is_what_is_learned() {
        // First seen with 9 GiB already cached (the daemon restarted under a busy server): NVML
        // takes it all for weights. A burst of 4 then grows the cache to 12 GiB.
        let learn = |with_report: bool| {
            let warm = reading(&[(A, 13)], true);
            let mut a = fresh();
            for _ in 0..4 {
                take(&mut a, &warm, A, 3);
                if with_report {
                    report(&mut a, &warm, 9);
                }
            }
            let grown = reading(&[(A, 16)], true);
            a.observe(None, &grown);
            if with_report {
                report(&mut a, &grown, 12);
            }
            for _ in 0..4 {
                give_back(&mut a, A, 3);
            }
            a.learner.quantile(0.5)
        };
        // NVML alone: 3 GiB of growth over 4 permits, far too small.
        assert_eq!(learn(false), Some(3 * GIB / 4));
        // The allocator's figure: 12 GiB for the work of 4 permits.
        assert_eq!(learn(true), Some(3 * GIB));
    }

    #[test]
    fn a_preallocating_engine_teaches_nothing() {
        // vLLM took 90 % of the card at start; its requests never touch the driver.
        let (mut a, c) = settled(14);
        for _ in 0..4 {
            take(&mut a, &c, A, 0);
        }
        a.observe(None, &reading(&[(A, 14)], true));
        for _ in 0..4 {
            give_back(&mut a, A, 0);
        }
        assert_eq!(a.learner.samples(), 0);
    }
}
