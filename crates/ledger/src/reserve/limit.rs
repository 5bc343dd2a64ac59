//! A rate limit, per uid, on the events clients cause (a permit that timed out or expired, a
//! launch that timed out or died..., and the budget events and conditions of the models a user
//! launched, which the loop passes through `Reservations::admit_event`): a local user who sends
//! requests in a loop, or keeps its models crossing the budgets it declared, must not flood the
//! event log and the webhooks. Each uid has `PER_UID` events per window; past that its events
//! are counted, not kept, and when the window ends one summary event per uid says how many were
//! suppressed (and of which kinds). Windows are fixed and rolled by the caller's clock (the
//! reservation table's tick), so the limit is at most `PER_UID` per uid per window and at most
//! twice that over any `WINDOW`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::kinds::{EventKind, Severity};
use crate::policy::{About, Event};

/// Events one uid may cause per window.
pub const PER_UID: u32 = 20;
pub const WINDOW: Duration = Duration::from_secs(60);

#[derive(Default)]
pub struct PerUid {
    /// When the current window began (`None`: before the first roll).
    started: Option<Duration>,
    uids: BTreeMap<u32, Count>,
    /// Events suppressed since `take_suppressed` was last called (the metric's increment).
    suppressed: u64,
}

#[derive(Default)]
struct Count {
    kept: u32,
    suppressed: u64,
    kinds: BTreeSet<EventKind>,
    /// The highest severity suppressed: the summary's.
    severity: Option<Severity>,
}

impl PerUid {
    /// True if an event of `uid` may be kept; false (and counted) past its limit.
    pub fn admit(&mut self, uid: u32, kind: EventKind, severity: Severity) -> bool {
        let count = self.uids.entry(uid).or_default();
        if count.kept < PER_UID {
            count.kept += 1;
            return true;
        }
        count.suppressed += 1;
        count.kinds.insert(kind);
        count.severity = count.severity.max(Some(severity));
        self.suppressed += 1;
        false
    }

    /// At `now`: if the window has ended, a summary event for each uid that had events
    /// suppressed in it, and a new window. The first call starts the first window.
    pub fn roll(&mut self, now: Duration) -> Vec<Event> {
        let Some(started) = self.started else {
            self.started = Some(now);
            return Vec::new();
        };
        if now.saturating_sub(started) < WINDOW {
            return Vec::new();
        }
        self.started = Some(now);
        let took =
            crate::units::fmt_duration(Duration::from_secs(now.saturating_sub(started).as_secs()));
        std::mem::take(&mut self.uids)
            .into_iter()
            .filter(|(_, c)| c.suppressed > 0)
            .map(|(uid, c)| {
                let kinds: Vec<&str> = c.kinds.iter().map(|k| k.as_str()).collect();
                Event::new(
                    c.severity.unwrap_or(Severity::Info),
                    EventKind::EventsSuppressed,
                    format!(
                        "uid {uid}: {} more events ({}) suppressed in the last {took}: at most {PER_UID} per uid every {} are kept",
                        c.suppressed,
                        kinds.join(", "),
                        crate::units::fmt_duration(WINDOW)
                    ),
                )
                .about(About {
                    uid: Some(uid),
                    ..About::default()
                })
            })
            .collect()
    }

    /// Events suppressed since the last call.
    pub fn take_suppressed(&mut self) -> u64 {
        std::mem::take(&mut self.suppressed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_uid_keeps_its_share_per_window_then_one_summary_says_how_many_were_suppressed() {
        let mut limit = PerUid::default();
        let t0 = Duration::from_secs(5);
        assert!(
            limit.roll(t0).is_empty(),
            "the first roll starts the window"
        );
        let kept = (0..1000)
            .filter(|_| limit.admit(1001, EventKind::PermitTimedOut, Severity::Info))
            .count();
        assert_eq!(kept, PER_UID as usize);
        assert!(!limit.admit(1001, EventKind::LaunchTimedOut, Severity::Info));
        // Another uid is not held back by the first one's flood.
        assert!((0..PER_UID).all(|_| limit.admit(1002, EventKind::PermitExpired, Severity::Info)));
        assert_eq!(limit.take_suppressed(), 981);
        assert_eq!(limit.take_suppressed(), 0);
        // Not yet the end of the window: no summary.
        assert!(limit
            .roll(t0 + WINDOW - Duration::from_millis(1))
            .is_empty());
        assert!(!limit.admit(1001, EventKind::PermitTimedOut, Severity::Info));
        let summary = limit.roll(t0 + WINDOW);
        assert_eq!(summary.len(), 1, "only the uid that had events suppressed");
        let s = &summary[0];
        assert_eq!(s.kind, EventKind::EventsSuppressed);
        assert_eq!(s.severity, Severity::Info);
        assert_eq!(s.about.uid, Some(1001));
        assert!(
            s.message
                .contains("982 more events (launch_timed_out, permit_timed_out)"),
            "{}",
            s.message
        );
        // A new window: the uid has its share again.
        assert!(limit.admit(1001, EventKind::PermitTimedOut, Severity::Info));
        assert!(limit.roll(t0 + WINDOW * 2).is_empty());
    }

    #[test]
    fn the_summary_has_the_highest_severity_suppressed() {
        let mut limit = PerUid::default();
        limit.roll(Duration::ZERO);
        for _ in 0..PER_UID {
            limit.admit(0, EventKind::PermitGranted, Severity::Info);
        }
        limit.admit(0, EventKind::LaunchReady, Severity::Warning);
        limit.admit(0, EventKind::PermitGranted, Severity::Info);
        let summary = limit.roll(WINDOW);
        assert_eq!(summary[0].severity, Severity::Warning);
    }
}
