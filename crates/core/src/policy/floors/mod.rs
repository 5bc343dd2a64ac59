//! Floors: host RAM (MemAvailable, swap, PSI) and each GPU's free memory. Crossing the act floor
//! opens an incident that acts on one victim at a time and escalates; the incident closes when
//! the resource is back above the floor.
//!
//! Two rules keep a floor from killing everything for memory no process holds (a tmpfs file
//! whose writer has exited: each kill lifts RAM a little, the incident closes, the next crossing
//! opens another).
//!
//! The brake: a floor acts on at most `max_victims` victims per `victim_window`, counted across
//! incidents (`PolicyState::floor_victims`), then stops and says so once (critical
//! `floor_brake`). Only victims that did not help count: the resource reading `Ok` (above its
//! warn floor, nothing else saying warn) while the brake does not hold forgets the victims before
//! it, so kills that gave memory back (a hog's, or an attacker's own sacrificial processes) never
//! use the brake up, while kills that free nothing useful (the tmpfs cascade) do. Once it holds,
//! it releases (info `floor_brake`) only when the resource reads `Ok` again (the incident really
//! ended) *and* fewer than `max_victims` of its victims are within the window: never on time
//! alone while the resource is still short.
//!
//! The Shmem rule: RAM short while `Shmem` grew since RAM was last above its warn floor
//! (`PolicyState::shmem_baseline`) is alerted (`shmem_shortfall`), and the floor acts only on a
//! victim that could plausibly fix it. Growth that explains the whole shortfall: only a victim
//! whose own memory alone lifts RAM back above its warn floor. Growth that explains part of it:
//! only a victim whose own memory is at least the part it does not explain (shortfall - growth)
//! and lifts RAM back above its act floor. No growth, or growth too small to matter (under
//! 64 MiB or a quarter of the shortfall: servers' own shared memory moves by that much): the floor
//! acts as usual.

use std::time::Duration;

use crate::config::{Candidates, Config, FloorAction, Mode};
use crate::kinds::{EventKind, ReasonKind};
use crate::policy::Event;
use crate::snapshot::{ProcessId, Snapshot};

use super::victim::{self, Chosen, Short};
use super::{
    action, bytes, event, About, Entry, Held, InForce, Incident, Level, Plan, PolicyState, Recheck,
    Resource, Severity, ShmemBaseline, Stage, Target, TermBaseline, Terminating, Verb,
};

mod choose;
mod incident;
mod readings;
mod words;

use choose::*;
#[cfg(test)]
pub(in crate::policy) use choose::{choose, Choice, Judgement, ShmemVerdict};
pub(in crate::policy) use choose::{release_brakes, release_held};
pub(in crate::policy) use incident::{evaluate_floor, AfterTerm, TERM_WATCH_INTERVAL};
use readings::*;
pub(in crate::policy) use readings::{readings, Reading};
