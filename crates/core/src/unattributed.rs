//! GPU memory NVML counts used but lists under no process: the driver's own (steady), processes
//! NVML cannot show (another container's), and memory whose per-process figure lags `used` (a
//! process that allocated or freed before its row says so). The per-process figures of a
//! reading are trusted (a reading "steady" for the reservation ledger) only while this stays
//! what it was: a holder whose row lags would otherwise look idle, its books be let go, and its
//! memory count as its next permit's own once the row catches up. A new level that lasts
//! `RETRUST_AFTER` (a process outside the lists that keeps its memory) is the new normal.

use std::time::Duration;

/// A move of up to this much is the driver's own drift, not a lagging row.
const DRIFT: u64 = 64 << 20;
/// A level that held this long is trusted again.
const RETRUST_AFTER: Duration = Duration::from_secs(60);

#[derive(Debug, Default)]
pub struct Unattributed {
    /// The level of the last trusted reading.
    trusted: Option<u64>,
    /// When readings began to disagree with it (monotonic time), while they do.
    disagrees_since: Option<Duration>,
}

impl Unattributed {
    /// A reading at `now` (any monotonic clock) with `bytes` used but listed under no process:
    /// whether its per-process figures can be set against its free memory.
    pub fn agrees(&mut self, bytes: u64, now: Duration) -> bool {
        let trusted = *self.trusted.get_or_insert(bytes);
        if trusted.abs_diff(bytes) <= DRIFT {
            self.trusted = Some(bytes);
            self.disagrees_since = None;
            return true;
        }
        let since = *self.disagrees_since.get_or_insert(now);
        if now.saturating_sub(since) >= RETRUST_AFTER {
            self.trusted = Some(bytes);
            self.disagrees_since = None;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_row_that_lags_used_is_not_trusted_until_it_catches_up_or_the_level_lasts() {
        let s = Duration::from_secs;
        let mut u = Unattributed::default();
        assert!(
            u.agrees(300 * MIB, s(0)),
            "the driver's own: the first level"
        );
        assert!(u.agrees(320 * MIB, s(1)), "drift");
        // A worker took 2 GiB that its row does not show yet; then its row catches up.
        assert!(!u.agrees(2368 * MIB, s(2)));
        assert!(u.agrees(320 * MIB, s(3)));
        // A row that shows memory already given back (used fell first).
        assert!(!u.agrees(0, s(4)));
        assert!(u.agrees(320 * MIB, s(5)));
        // A process outside the lists (another container) keeps 4 GiB: distrusted for a
        // minute, then its level is the new normal.
        assert!(!u.agrees(4416 * MIB, s(10)));
        assert!(!u.agrees(4416 * MIB, s(69)));
        assert!(u.agrees(4416 * MIB, s(70)));
        assert!(u.agrees(4416 * MIB, s(71)));
    }
}
