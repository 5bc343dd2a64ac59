//! The names of what happens: event kinds, why an action was taken, severities and levels. Each
//! is an enum whose one spelling (written once, in `named!`) is its serde name, its `Display`
//! and its `as_str` (the event log's `event`, the webhooks' `event`, the metrics' labels), so
//! no module writes these names by hand. A name read back (a status report over the socket, a
//! recorded one) is read by the same spelling.

use std::fmt;

/// An enum of unit variants, each with its one name.
macro_rules! named {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(
            Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord,
            ::serde::Serialize, ::serde::Deserialize,
        )]
        pub enum $name {
            $( $(#[$vmeta])* #[serde(rename = $text)] $variant, )*
        }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),*];

            pub const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)*
                }
            }
        }

        impl fmt::Display for $name {
            /// Padded as a `str` is (`{:8}`).
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.pad(self.as_str())
            }
        }

        /// Compares by name (tests and callers that hold the written form).
        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.as_str() == *other
            }
        }
    };
}

pub(crate) use named;

named! {
    /// What an event or a condition is about.
    pub enum EventKind {
        // Floors (the policy).
        FloorWarn = "floor_warn",
        FloorAct = "floor_act",
        FloorCleared = "floor_cleared",
        FloorUnreadable = "floor_unreadable",
        /// A floor action chosen with the action `alert` (a victim named, not signalled).
        FloorVictim = "floor_victim",
        NoVictim = "no_victim",
        IncidentClosed = "incident_closed",
        ReadingUnknown = "reading_unknown",
        StuckMemory = "stuck_memory",
        SurvivedKill = "survived_kill",
        KillIneffective = "kill_ineffective",
        NotActingStale = "not_acting_stale",
        /// A floor acted on `max_victims` victims within `victim_window` and is still short:
        /// it stops acting until the window has passed (info when it releases).
        FloorBrake = "floor_brake",
        /// RAM is short by less than Shmem grew: memory in tmpfs or shared memory that no
        /// process holds, which no kill gives back.
        ShmemShortfall = "shmem_shortfall",
        OutsideShortfall = "outside_shortfall",
        // Budgets (the policy).
        BudgetExceeded = "budget_exceeded",
        BudgetEnforced = "budget_enforced",
        BudgetCleared = "budget_cleared",
        DuplicateLoad = "duplicate_load",
        // GPUs (the daemon).
        Xid = "xid",
        XidCritical = "xid_critical",
        GpuOk = "gpu_ok",
        GpuUnavailable = "gpu_unavailable",
        GpuOff = "gpu_off",
        GpuLost = "gpu_lost",
        GpuRecovered = "gpu_recovered",
        // Actions (the executor's outcomes).
        ProcessKilled = "process_killed",
        ProcessStopped = "process_stopped",
        ProcessThrottled = "process_throttled",
        ProcessResumed = "process_resumed",
        ProcessUnthrottled = "process_unthrottled",
        // Reservations.
        LaunchAdmitted = "launch_admitted",
        LaunchReady = "launch_ready",
        LaunchDied = "launch_died",
        LaunchTimedOut = "launch_timed_out",
        PermitGranted = "permit_granted",
        PermitTimedOut = "permit_timed_out",
        PermitExpired = "permit_expired",
        // The daemon itself.
        DaemonStarted = "daemon_started",
        DaemonStopping = "daemon_stopping",
        ConfigReloadFailed = "config_reload_failed",
        LeftoversUndone = "leftovers_undone",
        /// The host's enforce lock file was removed under the daemon: taken anew (warning), or
        /// another daemon holds it now and this one observes (critical).
        EnforceLockLost = "enforce_lock_lost",
        /// What a previous run left held stays held: another daemon enforces on the host.
        LeftoversKept = "leftovers_kept",
        StateFileCorrupt = "state_file_corrupt",
        /// The run before this one ended without a clean stop (from the flight recorder).
        PreviousRunUnclean = "previous_run_unclean",
        /// The metrics port is held by another program (critical; the guard runs without its
        /// metrics), or served at last (info).
        MetricsUnavailable = "metrics_unavailable",
        /// The flight recorder stopped recording (a nearly full disk, a write error).
        HistoryStopped = "history_stopped",
        /// The flight recorder records again: the disk it stopped on has room again.
        HistoryResumed = "history_resumed",
        // The cloud (GCE's metadata server).
        GceMaintenance = "gce_maintenance",
        GcePreempted = "gce_preempted",
        GceNoticeWithdrawn = "gce_notice_withdrawn",
        /// `upcoming-maintenance`: maintenance scheduled ahead (a warning; no drain until
        /// `maintenance-event` announces it), or no longer planned (info).
        GceUpcomingMaintenance = "gce_upcoming_maintenance",
        /// The metadata server does not answer (notices cannot be seen), or answers again.
        GceWatchFailing = "gce_watch_failing",
        EventsDropped = "events_dropped",
        /// One uid's client-caused events past the per-uid rate limit, summed up once a window.
        EventsSuppressed = "events_suppressed",
    }
}

impl EventKind {
    /// Kinds that conditions already report (fired, repeated, resolved): such events go to the
    /// event log, not a second time to the webhooks.
    pub fn is_condition(self) -> bool {
        use EventKind::*;
        matches!(
            self,
            FloorWarn
                | FloorAct
                | FloorCleared
                | BudgetExceeded
                | BudgetCleared
                | GpuOk
                | GpuUnavailable
                | GpuLost
                | GpuRecovered
        )
    }
}

named! {
    /// Why an action was taken.
    pub enum ReasonKind {
        RamFloor = "ram_floor",
        GpuFloor = "gpu_floor",
        RamBudget = "ram_budget",
        GpuBudget = "gpu_budget",
        MaxStop = "max_stop",
        /// Back under budget, or the floor recovered.
        Cleared = "cleared",
    }
}

named! {
    /// What GPU protection amounts to now (`status`'s `gpu_protection.state`).
    #[derive(Default)]
    pub enum Protection {
        #[default]
        Ok = "ok",
        /// A GPU is lost.
        Degraded = "degraded",
        /// NVML has not answered yet.
        Starting = "starting",
        Unavailable = "unavailable",
        /// Disabled by the config.
        Off = "off",
    }
}

named! {
    /// Where a model server's metrics scrape stands (`status`'s `models[].engine.state`).
    #[derive(Default)]
    pub enum EngineState {
        Ok = "ok",
        /// Unreachable, an HTTP error, no vLLM metrics (the row's `error` says which).
        Error = "error",
        /// Its last answer is older than three scan intervals plus 4 s: its figures are not
        /// current.
        Stale = "stale",
        /// Not scraped yet.
        #[default]
        Pending = "pending",
    }
}

named! {
    /// Where a model comes from (`status`'s `models[].source`).
    #[derive(Default)]
    pub enum ModelSource {
        /// A `[[model]]` of the config.
        #[default]
        Config = "config",
        /// `gpuguard launch` (with no `[[model]]` of that name).
        Launch = "launch",
    }
}

named! {
    /// Where a launch lease stands.
    #[derive(Default)]
    pub enum LeaseState {
        /// Holds the launch lock and its memory reservation.
        #[default]
        Loading = "loading",
        /// Loaded: the model's memory is its own; the lease only keeps its process in the model.
        Ready = "ready",
    }
}

named! {
    pub enum Severity {
        Info = "info",
        Warning = "warning",
        Critical = "critical",
    }
}

named! {
    /// How close a resource is to its floors.
    #[derive(Default)]
    pub enum Level {
        /// The reading is missing (not zero): may alert, never act.
        Unknown = "unknown",
        #[default]
        Ok = "ok",
        Warn = "warn",
        Act = "act",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The serde name, `Display` and `as_str` are one spelling.
    #[test]
    fn every_name_serializes_as_it_displays() {
        fn check<T>(all: &[T])
        where
            T: serde::Serialize
                + serde::de::DeserializeOwned
                + fmt::Display
                + PartialEq
                + fmt::Debug,
        {
            for v in all {
                let json = serde_json::to_string(v).unwrap();
                assert_eq!(json, format!("\"{v}\""));
                assert_eq!(&serde_json::from_str::<T>(&json).unwrap(), v, "read back");
            }
        }
        check(EventKind::ALL);
        check(ReasonKind::ALL);
        check(Severity::ALL);
        check(Level::ALL);
        check(Protection::ALL);
        check(EngineState::ALL);
        check(LeaseState::ALL);
        check(ModelSource::ALL);
        check(crate::policy::Verb::ALL);
        check(crate::policy::Stage::ALL);
    }
}
