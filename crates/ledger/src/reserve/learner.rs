//! What a permit costs, learned from the busy periods of a pool's permits (the default size of
//! a permit that names none, once enough are seen), and how long permits are held.

use std::collections::VecDeque;
use std::time::Duration;

/// Learned per-permit sizes kept (the oldest is dropped).
const SAMPLES: usize = 256;
/// Samples needed before the observed p95 replaces a permit's default size.
pub const SAMPLES_FOR_DEFAULT: usize = 8;

/// Learns what a permit costs: over each busy period (from the first permit granted while none
/// was held to the last one released) in which the holders' memory grew, the most they held
/// beyond their baselines divided by the most permits held at once. A period that did not grow
/// says nothing of what a permit costs: a warm cache served it (it must not teach that permits
/// are free), or the engine preallocated (its permits are slots: `permit_gpu_memory` or 0).
#[derive(Debug, Default)]
pub struct Learner {
    busy: Option<Busy>,
    samples: VecDeque<u64>,
    hold_times: VecDeque<Duration>,
}

#[derive(Debug)]
struct Busy {
    /// Held beyond the baseline when the period began (None: not known).
    before: Option<u64>,
    peak: Option<u64>,
    most_permits: usize,
    /// A reading taken while permits were held (else the period says nothing).
    observed: bool,
}

impl Learner {
    pub(super) fn permit_granted(&mut self, held: Option<u64>, permits: usize) {
        let busy = self.busy.get_or_insert(Busy {
            before: held,
            peak: None,
            most_permits: 0,
            observed: false,
        });
        busy.most_permits = busy.most_permits.max(permits);
    }

    /// A reading while permits are held (a busy period: from the first permit granted to the
    /// last one ended).
    pub(super) fn observe(&mut self, held: Option<u64>) {
        if let Some(busy) = &mut self.busy {
            busy.peak = busy.peak.max(held);
            busy.observed = true;
        }
    }

    pub(super) fn permit_ended(&mut self, held_for: Duration, still_held: usize) {
        if self.hold_times.len() == SAMPLES {
            self.hold_times.pop_front();
        }
        self.hold_times.push_back(held_for);
        if still_held > 0 {
            return;
        }
        let Some(busy) = self.busy.take() else {
            return;
        };
        let (Some(before), Some(peak)) = (busy.before, busy.peak) else {
            return;
        };
        if busy.observed && busy.most_permits > 0 && peak > before {
            if self.samples.len() == SAMPLES {
                self.samples.pop_front();
            }
            let sample = peak / busy.most_permits as u64;
            tracing::debug!(
                before,
                peak,
                permits = busy.most_permits,
                sample,
                "a busy period of permits taught what one costs"
            );
            self.samples.push_back(sample);
        }
    }

    /// The `q` quantile (0..=1) of the learned per-permit GPU growth.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        quantile(self.samples.iter().copied().collect(), q)
    }

    /// Permits are held, or a busy period has not ended yet.
    pub(super) fn busy(&self) -> bool {
        self.busy.is_some()
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
