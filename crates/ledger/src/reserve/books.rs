//! The books of a set of processes that hold GPU memory (one holder, or a whole pool): what
//! its outstanding reservations promise against what it holds, and so what others must leave
//! free (`account.rs` keeps a pool's and its holders' books).
//!
//! Every reservation has a *holder*: the process that asked (with its descendants: vLLM's API
//! process asks, its engine core child holds the memory). A holder's GPU memory is set against
//! its own reservations, never against another's: a server's forked workers each keep their own
//! allocator cache, and one worker's cache cannot serve another's request.
//!
//! A holder (and the pool as a whole, for its budget) is kept as [`Books`]: its *baseline* (what it
//! holds for itself: weights, context, a launched server once ready) plus what its reservations
//! promise. What it has not taken yet of that is *promised*: other admissions must leave it free.
//! Memory it holds beyond its baseline and its reservations is *cache* (PyTorch's allocator keeps
//! freed blocks; NVML keeps showing them used): its own next permits may use it before any free
//! memory, up to the most its reservations reached at once since its baseline was taken (growth
//! beyond that is not something permits were granted for). Others never count it as free.
//!
//! - The baseline is only trusted once *settled*: taken from a reading in which the holder held no
//!   reservation, held GPU memory, and its per-process figures were read in the same NVML pass as
//!   the GPU's free memory. Until then every reservation is promised in full, as if nothing of it
//!   had been taken yet. So weights that appear in NVML's lists only after a first permit can never
//!   pass for spare memory; a new child process (the set of processes changed) unsettles it again.
//! - Growth while it holds no reservation is its own (weights loaded, an adapter): the baseline
//!   follows it. A fall below the baseline at rest lowers it.
//! - The holder's allocator may say what it holds for its permits' work (the Python client reads
//!   PyTorch's `memory_reserved` beyond what was allocated with no permit out): its permits are
//!   set against that much too, never more than NVML shows the holder holding, and only while
//!   NVML shows it holding what it held when the report was read (the allocator gives segments
//!   back on its own when a `cudaMalloc` fails).
//! - A reservation larger than the smallest since the baseline may fit none of the holder's cached
//!   segments: for everyone, its own next permits included, it draws on free memory in full
//!   (PyTorch takes a new segment while free memory lasts and keeps its cache).
//! - Sizes are the holder's: what mixed sizes may strand, and which reservations are larger than
//!   the smallest, are reckoned on each holder's own reservations ([`Sizes`]), never across the
//!   holders of shared books (each has its own allocator: one holder's 35 GiB permit strands
//!   nothing in another's). Shared books share reservations, not allowances.
//! - Memory of a reservation that ended stays promised (to the others) until a reading sampled
//!   after the end shows what became of it: a caching allocator keeps it.
//! - Host RAM is read by process scans, never together with MemAvailable: a RAM reservation is
//!   always promised in full.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use crate::snapshot::ProcessId;

/// GPU memory per GPU index.
pub(super) type PerGpu = BTreeMap<u32, u64>;

/// Ended reservations remembered per GPU until a reading follows them (then merged).
const MAX_ENDED: usize = 4096;

pub(super) fn on(map: &PerGpu, gpu: u32) -> u64 {
    map.get(&gpu).copied().unwrap_or(0)
}

/// Memory a set of processes holds, against what its reservations promise (see the module doc).
#[derive(Debug)]
pub struct Books {
    pub(super) reserved: PerGpu,
    /// The most reserved at once on each GPU since the baseline was taken: the most cache its
    /// own reservations may count on.
    pub(super) peak_reserved: PerGpu,
    /// The sizes of each holder's reservations (see [`Sizes`]): kept while it has some out or
    /// ended unseen, and for good for the holder whose own books these are (`own`: the sizes
    /// describe its cache).
    pub(super) sizes: BTreeMap<ProcessId, Sizes>,
    pub(super) own: Option<ProcessId>,
    /// What it holds for itself, once settled.
    pub(super) base: Option<PerGpu>,
    pub(super) usage: PerGpu,
    /// The processes counted in `usage`; the baseline holds for this set only.
    pub(super) members: Option<u64>,
    /// The latest reading was consistent (one NVML pass, every figure known).
    pub(super) consistent: bool,
    /// When a reservation last began or ended (daemon clock), and how many readings (0, 1, 2)
    /// were sampled after that: only two such readings in a row with nothing reserved show it
    /// at rest (the first may still hold what the last permits left cached).
    pub(super) last_change: Option<Duration>,
    pub(super) quiet_readings: u8,
    /// The sample time of the latest reading.
    pub(super) last_sample: Option<Duration>,
    /// What reservations that ended held, per GPU, with when they ended and whose they were,
    /// until a reading sampled after that shows what became of the memory: a caching allocator
    /// keeps it, so until then it stays promised. Under steady traffic permits end between
    /// every two readings: each one is let go by the first reading after its own end, not after
    /// the last change.
    pub(super) ended: BTreeMap<u32, VecDeque<Ended>>,
    /// What the holder's allocator said it caches, per GPU, with when it was read (daemon
    /// clock): the latest report that a reading sampled after it has come in since. A report
    /// counts memory its permits took since the last reading as held, while that reading's free
    /// figure still counts it free: set against each other, they would count it twice.
    pub(super) report: Option<(Duration, PerGpu)>,
    /// A newer report, with when it was read, until a reading sampled after that.
    pub(super) report_pending: Option<(Duration, PerGpu)>,
    /// Reports read before this are void: the sample time of the first reading that showed
    /// what it holds now, or when it was asked to give its cache back, whichever is later. A
    /// report read before may count memory that is gone: its allocator gave back segments (a
    /// trim, or PyTorch's own release when a `cudaMalloc` fails, which takes a new segment at
    /// once and may leave NVML's figure higher than before). So a report counts only while
    /// NVML shows the holder holding exactly what it held when the report was read.
    pub(super) steady_since: Option<Duration>,
}

/// A reservation that ended: when, what it held, whose it was.
#[derive(Clone, Copy, Debug)]
pub(super) struct Ended {
    pub(super) at: Duration,
    pub(super) bytes: u64,
    pub(super) holder: ProcessId,
}

/// The sizes of one holder's reservations in a set of books since the baseline was taken: what
/// its mixed sizes may strand (`stranded_with`) and which of its reservations are larger than
/// its smallest (`Books::outgrowing`). They describe the segments of the holder's own allocator.
#[derive(Debug, Default)]
pub(super) struct Sizes {
    /// Per GPU: size -> how many are out (slots of size 0 take no block and are not counted).
    pub(super) out: BTreeMap<u32, BTreeMap<u64, u64>>,
    /// The most it had out at once on each GPU.
    pub(super) peak: PerGpu,
    pub(super) largest: PerGpu,
    pub(super) smallest: PerGpu,
}

impl Sizes {
    /// How many reservations are out on `gpu` (slots aside).
    fn count(&self, gpu: u32) -> u64 {
        self.out.get(&gpu).map_or(0, |sizes| sizes.values().sum())
    }

    /// What its reservations out hold on `gpu`.
    fn reserved(&self, gpu: u32) -> u64 {
        self.out.get(&gpu).map_or(0, |sizes| {
            sizes.iter().fold(0u64, |sum, (size, n)| {
                sum.saturating_add(size.saturating_mul(*n))
            })
        })
    }

    fn reserve(&mut self, gpu: u32, size: u64) {
        if size > 0 {
            *self.out.entry(gpu).or_default().entry(size).or_default() += 1;
            self.note(gpu, size);
        }
        let reserved = self.reserved(gpu);
        let peak = self.peak.entry(gpu).or_default();
        *peak = (*peak).max(reserved);
    }

    fn unreserve(&mut self, gpu: u32, size: u64) {
        if let Some(sizes) = self.out.get_mut(&gpu) {
            if let Some(n) = sizes.get_mut(&size) {
                *n -= 1;
            }
            sizes.retain(|_, n| *n > 0);
        }
        self.out.retain(|_, sizes| !sizes.is_empty());
    }

    /// A reservation of `size` on `gpu`: the largest and smallest since the baseline.
    fn note(&mut self, gpu: u32, size: u64) {
        let largest = self.largest.entry(gpu).or_default();
        *largest = (*largest).max(size);
        let smallest = self.smallest.entry(gpu).or_insert(size);
        *smallest = (*smallest).min(size);
    }

    /// Its sizes from a new baseline on: those of its reservations still out and of `ended`
    /// (ended, no reading since) still describe blocks it holds or will hold.
    fn restart(&mut self, ended: impl Iterator<Item = (u32, u64)>) {
        self.largest.clear();
        self.smallest.clear();
        self.peak.clear();
        let out: Vec<(u32, u64)> = self
            .out
            .iter()
            .flat_map(|(g, sizes)| sizes.keys().map(|s| (*g, *s)))
            .collect();
        for (g, size) in out.into_iter().chain(ended).filter(|(_, s)| *s > 0) {
            self.note(g, size);
        }
        let gpus: Vec<u32> = self.out.keys().copied().collect();
        for g in gpus {
            let reserved = self.reserved(g);
            self.peak.insert(g, reserved);
        }
    }

    /// What its reservations out may strand: a caching allocator serves a request from a larger
    /// free block by splitting it, and the rest of that segment can then neither serve a larger
    /// request nor go back to the driver until the request ends (PyTorch's "reserved but
    /// unallocated" in its OOM message). Each segment was made for one earlier request of this
    /// holder, so a reservation strands at most its largest one's size less its own: nothing at
    /// all while every request has the same size. `extra`: as if it had one more reservation of
    /// that size out (none if 0).
    fn stranded_with(&self, gpu: u32, extra: u64) -> u64 {
        let n = self.count(gpu) + u64::from(extra > 0);
        let reserved = self.reserved(gpu).saturating_add(extra);
        // No more than the most its permits ever held at once: a cache is made of their blocks.
        n.saturating_mul(on(&self.largest, gpu).max(extra))
            .saturating_sub(reserved)
            .min(on(&self.peak, gpu).max(reserved))
    }

    /// What its reservations out on `gpu` larger than its smallest since the baseline hold.
    fn larger_than_smallest(&self, gpu: u32) -> u64 {
        let smallest = on(&self.smallest, gpu);
        self.out.get(&gpu).map_or(0, |sizes| {
            sizes
                .range(smallest.saturating_add(1)..)
                .fold(0u64, |sum, (size, n)| {
                    sum.saturating_add(size.saturating_mul(*n))
                })
        })
    }

    fn idle(&self) -> bool {
        self.out.is_empty()
    }
}

impl Default for Books {
    /// Books that never had a reservation: at rest.
    fn default() -> Books {
        Books {
            reserved: PerGpu::new(),
            peak_reserved: PerGpu::new(),
            sizes: BTreeMap::new(),
            own: None,
            base: None,
            usage: PerGpu::new(),
            members: None,
            consistent: false,
            last_change: None,
            quiet_readings: 2,
            last_sample: None,
            ended: BTreeMap::new(),
            report: None,
            report_pending: None,
            steady_since: None,
        }
    }
}

impl Books {
    /// The books of `holder`'s own processes.
    pub(super) fn of(holder: ProcessId) -> Books {
        Books {
            own: Some(holder),
            ..Books::default()
        }
    }

    pub(super) fn idle(&self) -> bool {
        self.reserved.values().all(|&b| b == 0)
    }

    /// A new reading of what the processes hold, sampled at `sampled_at`.
    pub(super) fn observe(
        &mut self,
        usage: &PerGpu,
        members: u64,
        consistent: bool,
        sampled_at: Option<Duration>,
    ) {
        if !consistent {
            // Figures from more than one NVML pass, or a process's unknown: they may leave out
            // what it holds, or one of its processes. Nothing learned from them; until a
            // consistent one, its cache is nobody's to count on (see `promised_for`).
            self.consistent = false;
            return;
        }
        if self.members != Some(members) {
            self.members = Some(members);
            self.base = None;
            self.forget_sizes();
            self.forget_report();
        }
        if *usage != self.usage {
            // (A trim asked after this reading was sampled keeps its later time.)
            self.steady_since = self.steady_since.max(sampled_at);
        }
        // A report read before what NVML shows now may count memory given back since.
        let steady = |read_at: Duration| self.steady_since.is_some_and(|s| read_at >= s);
        if self
            .report
            .as_ref()
            .is_some_and(|(read_at, _)| !steady(*read_at))
        {
            self.report = None;
        }
        if let Some((read_at, _)) = self.report_pending {
            if !steady(read_at) {
                self.report_pending = None;
            } else if sampled_at.is_some_and(|at| at >= read_at) {
                self.report = self.report_pending.take();
            }
        }
        let new_sample = sampled_at.is_some() && sampled_at != self.last_sample;
        if new_sample && sampled_at > self.last_change {
            self.quiet_readings = (self.quiet_readings + 1).min(2);
        }
        if let (true, Some(at)) = (new_sample, sampled_at) {
            for ends in self.ended.values_mut() {
                ends.retain(|e| e.at >= at);
            }
            self.ended.retain(|_, ends| !ends.is_empty());
            // Another holder's sizes go with its last reservation seen ended: in books not its
            // own it holds no cache they describe.
            let ending: BTreeSet<ProcessId> =
                self.ended.values().flatten().map(|e| e.holder).collect();
            let own = self.own;
            self.sizes
                .retain(|h, s| Some(*h) == own || !s.idle() || ending.contains(h));
        }
        self.last_sample = sampled_at;
        let at_rest = self.idle() && self.quiet_readings >= 2 && consistent;
        if at_rest {
            match &mut self.base {
                Some(base) => {
                    // Growth at rest is its own; a fall at rest below the baseline lowers it.
                    let gpus: BTreeSet<u32> = usage.keys().chain(base.keys()).copied().collect();
                    for g in gpus {
                        let (now, before) = (on(usage, g), on(&self.usage, g));
                        let b = base.entry(g).or_default();
                        if now > before {
                            *b += now - before;
                        }
                        *b = (*b).min(now);
                    }
                    base.retain(|_, b| *b > 0);
                }
                None if usage.values().any(|&b| b > 0) => {
                    self.base = Some(usage.clone());
                    self.forget_sizes();
                }
                None => {}
            }
        }
        self.usage = usage.clone();
        self.consistent = consistent;
    }

    /// A reservation began or ended at `now`.
    pub(super) fn changed(&mut self, now: Duration) {
        self.last_change = Some(now);
        self.quiet_readings = 0;
    }

    /// A new baseline: the sizes seen before it no longer describe its cache, but those of the
    /// reservations still out (and of those ended that no reading has followed yet) still
    /// describe blocks it holds or will hold.
    pub(super) fn forget_sizes(&mut self) {
        self.peak_reserved = self.reserved.clone();
        let ended = &self.ended;
        for (holder, sizes) in self.sizes.iter_mut() {
            let its_ends = ended.iter().flat_map(|(g, ends)| {
                ends.iter()
                    .filter(|e| e.holder == *holder)
                    .map(|e| (*g, e.bytes))
            });
            sizes.restart(its_ends);
        }
    }

    /// `holder` reserved `per_gpu` on each of `gpus` at `now`.
    pub(super) fn reserve(&mut self, holder: ProcessId, gpus: &[u32], per_gpu: u64, now: Duration) {
        self.changed(now);
        let sizes = self.sizes.entry(holder).or_default();
        for g in gpus {
            let r = self.reserved.entry(*g).or_default();
            *r += per_gpu;
            let peak = self.peak_reserved.entry(*g).or_default();
            *peak = (*peak).max(*r);
            sizes.reserve(*g, per_gpu);
        }
    }

    /// A reservation of `holder`'s ended at `now`.
    pub(super) fn unreserve(
        &mut self,
        holder: ProcessId,
        gpus: &[u32],
        per_gpu: u64,
        now: Duration,
    ) {
        self.changed(now);
        for g in gpus {
            let ends = self.ended.entry(*g).or_default();
            if ends.len() >= MAX_ENDED {
                // No reading for long (the GPU sampler is stuck): merged, kept the longer.
                let first = ends.pop_front().expect("not empty");
                if let Some(next) = ends.front_mut() {
                    next.bytes = next.bytes.saturating_add(first.bytes);
                }
            }
            ends.push_back(Ended {
                at: now,
                bytes: per_gpu,
                holder,
            });
            if let Some(b) = self.reserved.get_mut(g) {
                *b = b.saturating_sub(per_gpu);
            }
            if let Some(sizes) = self.sizes.get_mut(&holder) {
                sizes.unreserve(*g, per_gpu);
            }
        }
        self.reserved.retain(|_, b| *b > 0);
    }

    /// What the reservations out may strand, each holder's of its own segments
    /// ([`Sizes::stranded_with`]); `next`: as if that holder had one more of that size out.
    /// Counted as promised, as the allocator may need it from free memory between two readings.
    pub(super) fn stranded_with(&self, gpu: u32, next: Option<(ProcessId, u64)>) -> u64 {
        self.sizes
            .iter()
            .map(|(h, s)| {
                let extra = next.filter(|(n, _)| n == h).map_or(0, |(_, e)| e);
                s.stranded_with(gpu, extra)
            })
            .fold(0u64, u64::saturating_add)
    }

    /// Of what these books promise on `gpu`, the part that reservations of the holders `whose`
    /// picks may still take: no more than what those reservations hold, may strand and held
    /// when they ended unseen.
    pub(super) fn promised_by(
        &self,
        gpu: u32,
        consistent: bool,
        whose: impl Fn(ProcessId) -> bool,
    ) -> u64 {
        let theirs = self
            .sizes
            .iter()
            .filter(|(h, _)| whose(**h))
            .map(|(_, s)| s.reserved(gpu).saturating_add(s.stranded_with(gpu, 0)))
            .chain(
                self.ended
                    .get(&gpu)
                    .into_iter()
                    .flatten()
                    .filter(|e| whose(e.holder))
                    .map(|e| e.bytes),
            )
            .fold(0u64, u64::saturating_add);
        (self.promised(gpu, consistent).max(0) as u64).min(theirs)
    }

    /// `holder`'s smallest reservation on `gpu` since the baseline (0: none).
    fn smallest_of(&self, holder: ProcessId, gpu: u32) -> u64 {
        self.sizes.get(&holder).map_or(0, |s| on(&s.smallest, gpu))
    }

    /// What it may still take of free memory on `gpu` for its reservations: their part not yet
    /// seen held (all of it until settled), and what they may strand of its cache. Negative:
    /// memory held beyond baseline and reservations (cache). `consistent`: the capacity's GPU
    /// figures are from one pass.
    pub(super) fn promised(&self, gpu: u32, consistent: bool) -> i64 {
        self.promised_for(gpu, consistent, self.ended_on(gpu), None)
            .max(self.outgrowing(gpu).min(i64::MAX as u64) as i64)
    }

    /// What reservations larger than their holder's smallest one since the baseline may take of
    /// free memory however much the holder caches: every cached segment was made for an earlier
    /// request, so one no larger than the smallest fits any of them, but a larger one may fit
    /// none, and the allocator then takes a new segment from the driver and keeps its cache
    /// (PyTorch gives its cache back only when its own `cudaMalloc` fails: another process
    /// short of memory gets a CUDA OOM). For everyone else they count in full while they are
    /// out, and once ended until a reading sampled after their end shows what they took.
    pub(super) fn outgrowing(&self, gpu: u32) -> u64 {
        let out = self
            .sizes
            .values()
            .map(|s| s.larger_than_smallest(gpu))
            .fold(0u64, u64::saturating_add);
        let ended = self.ended.get(&gpu).map_or(0, |ends| {
            ends.iter()
                .filter(|e| e.bytes > self.smallest_of(e.holder, gpu))
                .fold(0u64, |sum, e| sum.saturating_add(e.bytes))
        });
        out.saturating_add(ended)
    }

    /// What the reservations that ended on `gpu` held, while no reading since their end says
    /// what became of it.
    pub(super) fn ended_on(&self, gpu: u32) -> u64 {
        self.ended.get(&gpu).map_or(0, |ends| {
            ends.iter().fold(0u64, |sum, e| sum.saturating_add(e.bytes))
        })
    }

    /// `promised`, with `ended` of the reservations that ended not yet seen given back, had
    /// `next`'s holder one more reservation of its size out.
    pub(super) fn promised_for(
        &self,
        gpu: u32,
        consistent: bool,
        ended: u64,
        next: Option<(ProcessId, u64)>,
    ) -> i64 {
        let extra = next.map_or(0, |(_, e)| e);
        let reserved = on(&self.reserved, gpu)
            .saturating_add(extra)
            .saturating_add(ended)
            .saturating_add(self.stranded_with(gpu, next))
            .min(i64::MAX as u64) as i64;
        match &self.base {
            Some(base) if consistent && self.consistent => {
                on(base, gpu) as i64 + reserved - on(&self.usage, gpu) as i64
            }
            _ => reserved,
        }
    }

    /// Whether a reservation of `extra` on `gpu` for `holder` may fit none of its cached
    /// segments: it is larger than the holder's smallest since the baseline, or its allocator
    /// reports more cache than NVML showed it take since the baseline (a cache warm before the
    /// baseline was taken, made of segments of sizes nobody saw).
    pub(super) fn outgrows(&self, holder: ProcessId, gpu: u32, extra: u64) -> bool {
        let smallest = self.smallest_of(holder, gpu);
        let seen_since_base = match &self.base {
            Some(base) => on(&self.usage, gpu).saturating_sub(on(base, gpu)),
            None => 0,
        };
        let warm = self
            .reported_cache()
            .get(&gpu)
            .is_some_and(|&c| c > seen_since_base);
        extra > 0 && (extra > smallest && smallest > 0 || warm)
    }

    /// The same for its own next reservation: its cache counts, up to the most its reservations
    /// reached at once (from NVML), or what its allocator reports caching without the blocks
    /// stranded in segments in use (never more than NVML shows it holding); whichever says more.
    pub(super) fn promised_to_self(&self, holder: ProcessId, gpu: u32, consistent: bool) -> i64 {
        self.promised_to_self_with(holder, gpu, consistent, 0)
    }

    /// `promised_to_self`, had `holder` one more reservation of `extra` out (counted in): what
    /// its next reservation would leave promised, what it strands included.
    ///
    /// One larger than the smallest since the baseline may fit none of its cached segments:
    /// PyTorch then takes a new segment from the driver while free memory lasts and keeps its
    /// cache, so it takes free memory promised to others (it gives its cache back only when its
    /// own `cudaMalloc` fails). Such a reservation draws on free memory in full, beside what its
    /// books promise as everyone else sees them.
    pub(super) fn promised_to_self_with(
        &self,
        holder: ProcessId,
        gpu: u32,
        consistent: bool,
        extra: u64,
    ) -> i64 {
        if self.outgrows(holder, gpu, extra) {
            let promised = self.promised(gpu, consistent).max(0);
            return promised.saturating_add(extra.min(i64::MAX as u64) as i64);
        }
        let next = Some((holder, extra));
        let reserved = on(&self.reserved, gpu).saturating_add(extra) as i64;
        let stranded = self.stranded_with(gpu, next) as i64;
        let peak = on(&self.peak_reserved, gpu).max(reserved as u64) as i64;
        // Its own ended permits' memory is its cache or free again: either serves it.
        let seen = self
            .promised_for(gpu, consistent, 0, next)
            .max(stranded - peak);
        match self.reported_cache().get(&gpu) {
            // The report says how much is cached, not in what blocks: what serving the
            // reservations from it may strand counts as it does for NVML's figure.
            Some(&cache) if consistent && self.consistent => {
                seen.min(reserved + stranded - cache.min(on(&self.usage, gpu)) as i64)
            }
            _ => seen,
        }
    }

    /// Memory held beyond the baseline, all GPUs (None until settled, unless it holds none).
    ///
    /// NVML's figure beyond the baseline, or the allocator's own where it says more (what it
    /// holds for work beyond its idle moment, up to what NVML shows): NVML takes a cache that
    /// was warm before the baseline for weights, while a report is as old as the last request.
    pub(super) fn held_beyond_base(&self) -> Option<u64> {
        let mut held = 0;
        for (g, &used) in &self.usage {
            let reported = self.reported_cache().get(g).map(|&r| r.min(used));
            let seen = match &self.base {
                _ if used == 0 => Some(0),
                Some(base) => Some(used.saturating_sub(on(base, *g))),
                None => None,
            };
            held += match (seen, reported) {
                (Some(s), Some(r)) => s.max(r),
                (Some(s), None) => s,
                (None, Some(r)) => r,
                (None, None) => return None,
            };
        }
        Some(held)
    }

    /// Its baseline is what it holds now (a launched server became ready).
    pub(super) fn rebase(&mut self) {
        self.base =
            (self.consistent && self.usage.values().any(|&b| b > 0)).then(|| self.usage.clone());
        self.forget_sizes();
        self.forget_report();
    }

    pub(super) fn forget_report(&mut self) {
        self.report = None;
        self.report_pending = None;
    }

    /// What the report in force says it caches, per GPU (nothing without one).
    pub(super) fn reported_cache(&self) -> &PerGpu {
        static NONE: PerGpu = PerGpu::new();
        self.report.as_ref().map_or(&NONE, |(_, cache)| cache)
    }

    /// Nothing worth remembering: no reservation and nothing held beyond the baseline.
    pub(super) fn forgettable(&self) -> bool {
        self.idle()
            && self.quiet_readings >= 2
            && self.report_pending.is_none()
            && self.held_beyond_base().is_none_or(|b| b == 0)
    }
}

#[cfg(test)]
impl Books {
    /// How many reservations are out, per GPU.
    pub(super) fn counts(&self) -> BTreeMap<u32, u64> {
        let gpus: BTreeSet<u32> = self
            .sizes
            .values()
            .flat_map(|s| s.out.keys())
            .copied()
            .collect();
        let count = |g: u32| self.sizes.values().map(|s| s.count(g)).sum();
        gpus.into_iter().map(|g| (g, count(g))).collect()
    }
}
