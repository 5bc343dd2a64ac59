//! One pool's books (a model, or the host-wide pool of permits that belong to no model): what its
//! outstanding reservations promise, what it used before them, and what its permits turned out
//! to cost.
//!
//! A pool may grow to its *baseline* (what it holds for itself: weights, a launched server once
//! ready) plus what its reservations promise. What it has not taken yet of that is *promised*:
//! other pools' admissions must leave it free. Three rules keep that estimate on the safe side:
//!
//! - The baseline is only trusted once *settled*: taken from a reading in which the pool held no
//!   reservation and its per-process GPU figures were read in the same NVML pass as the GPU's
//!   free memory. Until then (a new pool, new processes, process lists older than `free`) every
//!   reservation is promised in full, as if nothing of it had been taken yet. So weights that
//!   appear in NVML's lists only after a pool's first permit can never pass for spare memory.
//! - Growth while the pool holds no reservation is its own (weights loaded, an adapter): the
//!   baseline follows it. Growth while it does is its permits'; what remains of it when the last
//!   permit ends is a *cache* (PyTorch's allocator keeps freed memory): the pool may reuse that
//!   much for its next permits instead of free memory, and no more.
//! - Host RAM is read by process scans, never together with MemAvailable: a RAM reservation is
//!   always promised in full.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use super::capacity::ModelUse;

/// Learned per-permit sizes kept (the oldest is dropped).
const SAMPLES: usize = 256;
/// Samples needed before the observed p95 replaces a permit's default size.
pub const SAMPLES_FOR_DEFAULT: usize = 8;

#[derive(Debug, Default)]
pub struct Account {
    /// What outstanding reservations promise, per GPU and in RAM.
    pub reserved_gpu: BTreeMap<u32, u64>,
    pub reserved_ram: u64,
    /// What the pool holds for itself, per GPU (trusted only when `settled`).
    baseline_gpu: BTreeMap<u32, u64>,
    settled: bool,
    /// Memory the pool kept from its permits' work, per GPU: reusable by its next permits.
    cache_gpu: BTreeMap<u32, u64>,
    /// The member set the baseline was taken with.
    members: Option<u64>,
    /// A reservation was out at some point since the last reading.
    busy_since_reading: bool,
    /// The latest use seen, and whether it came with a consistent GPU reading.
    usage: ModelUse,
    consistent: bool,
    pub permits_held: usize,
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

impl Account {
    fn idle(&self) -> bool {
        self.reserved_ram == 0 && self.reserved_gpu.values().all(|&b| b == 0)
    }

    /// A new reading of the pool's use (after a tick); `consistent`: its GPU figures came from
    /// the same NVML pass as the GPUs' free memory.
    pub fn observe(&mut self, usage: Option<&ModelUse>, consistent: bool) {
        let usage = usage.cloned().unwrap_or_default();
        if self.members != Some(usage.members) {
            // New processes: what they hold is not known to be theirs until seen at rest.
            self.members = Some(usage.members);
            self.settled = false;
            self.cache_gpu.clear();
        }
        let quiet = self.idle() && !self.busy_since_reading;
        if quiet && consistent {
            if self.settled {
                self.follow_idle_change(&usage);
            } else {
                self.baseline_gpu = usage.gpu_bytes.clone();
                self.settled = true;
            }
        } else if self.idle() && consistent && self.settled {
            // The first reading after the last reservation ended: what the pool holds beyond
            // its baseline now is what its permits left cached.
            self.cache_gpu = usage
                .gpu_bytes
                .iter()
                .map(|(g, &u)| (*g, u.saturating_sub(self.baseline(*g))))
                .filter(|(_, c)| *c > 0)
                .collect();
        }
        self.busy_since_reading = !self.idle();
        self.learner
            .observe(usage.gpu_total_bytes(), self.permits_held);
        self.usage = usage;
        self.consistent = consistent;
    }

    /// Between two readings at rest: growth is the pool's own (the baseline follows), a fall
    /// gives back cache first, then baseline.
    fn follow_idle_change(&mut self, usage: &ModelUse) {
        let gpus: std::collections::BTreeSet<u32> = usage
            .gpu_bytes
            .keys()
            .chain(self.baseline_gpu.keys())
            .copied()
            .collect();
        for g in gpus {
            let now = usage.gpu_bytes.get(&g).copied().unwrap_or(0);
            let before = self.usage.gpu_bytes.get(&g).copied().unwrap_or(0);
            let baseline = self.baseline_gpu.entry(g).or_default();
            let cache = self.cache_gpu.entry(g).or_default();
            if now >= before {
                *baseline += now - before;
            } else {
                let fall = before - now;
                let from_cache = fall.min(*cache);
                *cache -= from_cache;
                *baseline = baseline.saturating_sub(fall - from_cache);
            }
        }
        self.baseline_gpu.retain(|_, b| *b > 0);
        self.cache_gpu.retain(|_, c| *c > 0);
    }

    fn baseline(&self, gpu: u32) -> u64 {
        self.baseline_gpu.get(&gpu).copied().unwrap_or(0)
    }

    /// A launched server became ready: what it holds now is its own.
    pub fn rebase_to_usage(&mut self) {
        if self.consistent {
            self.baseline_gpu = self.usage.gpu_bytes.clone();
            self.settled = true;
        } else {
            self.settled = false;
        }
        self.cache_gpu.clear();
    }

    pub fn usage(&self) -> &ModelUse {
        &self.usage
    }

    /// What this pool has been promised on GPU `gpu` and not taken yet; negative: cache it may
    /// reuse (see the module doc). `consistent`: the capacity's GPU figures are from one pass.
    pub fn gpu_promised(&self, gpu: u32, consistent: bool) -> i64 {
        let reserved = self.reserved_gpu.get(&gpu).copied().unwrap_or(0) as i64;
        if !(self.settled && consistent && self.consistent) {
            return reserved;
        }
        let used = self.usage.gpu_bytes.get(&gpu).copied().unwrap_or(0) as i64;
        let cache = self.cache_gpu.get(&gpu).copied().unwrap_or(0) as i64;
        (self.baseline(gpu) as i64 + reserved - used).max(-cache)
    }

    /// The same for host RAM: always the whole reservation (see the module doc).
    pub fn ram_promised(&self) -> i64 {
        self.reserved_ram as i64
    }

    /// What the pool counts against its GPU budget: its baseline (its use, until settled) plus
    /// its reservations.
    pub fn gpu_committed(&self) -> u64 {
        let held = if self.settled {
            self.baseline_gpu.values().sum::<u64>()
        } else {
            self.usage.gpu_total_bytes()
        };
        held + self.reserved_gpu.values().sum::<u64>()
    }

    pub fn ram_committed(&self) -> u64 {
        self.usage.ram_bytes + self.reserved_ram
    }

    /// GPUs the pool already uses or has reservations on.
    pub fn on_gpu(&self, gpu: u32) -> bool {
        self.usage.gpu_bytes.get(&gpu).is_some_and(|&b| b > 0)
            || self.reserved_gpu.get(&gpu).is_some_and(|&b| b > 0)
    }

    pub fn reserve(&mut self, gpus: &[u32], gpu_bytes_per_gpu: u64, ram_bytes: u64) {
        for g in gpus {
            *self.reserved_gpu.entry(*g).or_default() += gpu_bytes_per_gpu;
        }
        self.reserved_ram += ram_bytes;
        self.busy_since_reading = true;
    }

    pub fn unreserve(&mut self, gpus: &[u32], gpu_bytes_per_gpu: u64, ram_bytes: u64) {
        for g in gpus {
            if let Some(b) = self.reserved_gpu.get_mut(g) {
                *b = b.saturating_sub(gpu_bytes_per_gpu);
            }
        }
        self.reserved_gpu.retain(|_, b| *b > 0);
        self.reserved_ram = self.reserved_ram.saturating_sub(ram_bytes);
    }

    pub fn permit_granted(&mut self) {
        self.permits_held += 1;
        self.learner
            .permit_granted(self.usage.gpu_total_bytes(), self.permits_held);
    }

    pub fn permit_ended(&mut self, held: Duration) {
        self.permits_held = self.permits_held.saturating_sub(1);
        self.learner.permit_ended(held, self.permits_held);
    }

    /// True while nothing refers to the pool any more (it may be forgotten).
    pub fn unused(&self) -> bool {
        self.idle() && self.permits_held == 0
    }
}

/// Learns what a permit costs: over each busy period (from the first permit granted while none
/// was held to the last one released) the GPU growth of the pool (peak minus the use before)
/// divided by the most permits held at once.
#[derive(Debug, Default)]
pub struct Learner {
    busy: Option<Busy>,
    samples: VecDeque<u64>,
    hold_times: VecDeque<Duration>,
}

#[derive(Debug)]
struct Busy {
    before: u64,
    peak: u64,
    most_permits: usize,
    /// A reading taken while permits were held (else the period says nothing).
    observed: bool,
}

impl Learner {
    fn permit_granted(&mut self, usage: u64, held: usize) {
        let busy = self.busy.get_or_insert(Busy {
            before: usage,
            peak: usage,
            most_permits: 0,
            observed: false,
        });
        busy.most_permits = busy.most_permits.max(held);
    }

    fn observe(&mut self, usage: u64, held: usize) {
        if let Some(busy) = &mut self.busy {
            if held > 0 {
                busy.peak = busy.peak.max(usage);
                busy.most_permits = busy.most_permits.max(held);
                busy.observed = true;
            }
        }
    }

    fn permit_ended(&mut self, held_for: Duration, still_held: usize) {
        if self.hold_times.len() == SAMPLES {
            self.hold_times.pop_front();
        }
        self.hold_times.push_back(held_for);
        if still_held > 0 {
            return;
        }
        if let Some(busy) = self.busy.take() {
            if busy.observed && busy.most_permits > 0 {
                if self.samples.len() == SAMPLES {
                    self.samples.pop_front();
                }
                self.samples
                    .push_back(busy.peak.saturating_sub(busy.before) / busy.most_permits as u64);
            }
        }
    }

    /// The `q` quantile (0..=1) of the learned per-permit GPU growth.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        quantile(self.samples.iter().copied().collect(), q)
    }

    pub fn samples(&self) -> usize {
        self.samples.len()
    }

    /// How long permits are typically held: when to try again after a refusal.
    pub fn typical_hold(&self) -> Option<Duration> {
        quantile(
            self.hold_times
                .iter()
                .map(|d| d.as_micros() as u64)
                .collect(),
            0.5,
        )
        .map(Duration::from_micros)
    }
}

fn quantile(mut values: Vec<u64>, q: f64) -> Option<u64> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable();
    let rank = ((values.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
    Some(values[rank])
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn usage(gpu0: u64, members: u64) -> ModelUse {
        ModelUse {
            gpu_bytes: BTreeMap::from([(0, gpu0)]),
            members,
            ..Default::default()
        }
    }

    /// A pool settled at `weights` GiB.
    fn settled(weights: u64) -> Account {
        let mut a = Account::default();
        a.observe(Some(&usage(weights * GIB, 1)), true);
        a
    }

    #[test]
    fn promises_shrink_as_the_pool_takes_what_it_reserved() {
        let mut a = settled(4);
        a.reserve(&[0], 3 * GIB, 0);
        a.permit_granted();
        assert_eq!(a.gpu_promised(0, true), 3 * GIB as i64);
        a.observe(Some(&usage(6 * GIB, 1)), true); // 2 of the 3 GiB taken
        assert_eq!(a.gpu_promised(0, true), GIB as i64);
        // Figures from different passes: the whole reservation stays promised.
        assert_eq!(a.gpu_promised(0, false), 3 * GIB as i64);
        assert_eq!(a.gpu_committed(), 7 * GIB);
    }

    #[test]
    fn weights_seen_late_never_pass_for_spare_memory() {
        // The pool's first permit comes before NVML's lists show its weights (4 GiB).
        let mut a = Account::default();
        a.observe(Some(&usage(0, 1)), true);
        a.observe(Some(&usage(0, 2)), false); // its processes changed: not settled
        a.reserve(&[0], 3 * GIB, 0);
        a.permit_granted();
        a.observe(Some(&usage(7 * GIB, 2)), true); // weights and the permit's 3 GiB
        assert_eq!(
            a.gpu_promised(0, true),
            3 * GIB as i64,
            "unsettled: all of it"
        );
        a.unreserve(&[0], 3 * GIB, 0);
        a.permit_ended(Duration::from_millis(10));
        a.observe(Some(&usage(4 * GIB, 2)), true);
        assert_eq!(
            a.gpu_promised(0, true),
            0,
            "first quiet reading: no cache credit"
        );
        a.observe(Some(&usage(4 * GIB, 2)), true);
        assert_eq!(a.gpu_promised(0, true), 0, "settled at the weights");
        assert_eq!(a.gpu_committed(), 4 * GIB);
    }

    #[test]
    fn a_cache_kept_after_the_permits_is_reusable_and_no_more() {
        let mut a = settled(4);
        a.reserve(&[0], 3 * GIB, 0);
        a.permit_granted();
        a.observe(Some(&usage(7 * GIB, 1)), true);
        a.unreserve(&[0], 3 * GIB, 0);
        a.permit_ended(Duration::from_millis(10));
        // The allocator kept the 3 GiB: the pool's own to reuse.
        a.observe(Some(&usage(7 * GIB, 1)), true);
        assert_eq!(a.gpu_promised(0, true), -3 * GIB as i64);
        assert_eq!(a.gpu_promised(0, false), 0, "no credit without one pass");
        // A new permit takes from the cache first: nothing more is promised.
        a.reserve(&[0], 2 * GIB, 0);
        assert_eq!(a.gpu_promised(0, true), -(GIB as i64));
        a.unreserve(&[0], 2 * GIB, 0);
        a.observe(Some(&usage(7 * GIB, 1)), true);
        // Memory given back while at rest comes out of the cache first.
        a.observe(Some(&usage(5 * GIB, 1)), true);
        assert_eq!(a.gpu_promised(0, true), -(GIB as i64));
        // Growth at rest is the pool's own (an adapter loaded), not cache.
        a.observe(Some(&usage(8 * GIB, 1)), true);
        assert_eq!(a.gpu_promised(0, true), -(GIB as i64));
        assert_eq!(a.gpu_committed(), 7 * GIB);
    }

    #[test]
    fn learns_growth_per_permit_over_busy_periods() {
        let mut a = settled(4);
        for _ in 0..3 {
            a.permit_granted();
        }
        a.observe(Some(&usage(13 * GIB, 1)), true); // 3 permits, 9 GiB
        for _ in 0..3 {
            a.permit_ended(Duration::from_millis(100));
        }
        assert_eq!(a.learner.quantile(0.5), Some(3 * GIB));
        // A period no reading saw teaches nothing.
        a.permit_granted();
        a.permit_ended(Duration::from_millis(1));
        assert_eq!(a.learner.samples(), 1);
        assert_eq!(a.learner.typical_hold(), Some(Duration::from_millis(100)));
    }
}
