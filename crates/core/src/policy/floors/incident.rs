//! An incident, from the act floor crossed to the resource back above it: one victim at a time,
//! stopped, terminated, killed, and the next once it is gone and the floor is still short.

use super::*;

/// One floor for one tick: the level is recorded (and its change said), then the reading is
/// unknown (nothing decided), above the act floor (the incident closes) or below it (the
/// incident acts).
pub(in crate::policy) fn evaluate_floor_inner(
    config: &Config,
    snapshot: &Snapshot,
    state: &mut PolicyState,
    reading: &Reading,
    plan: &mut Plan,
) {
    let level = note_level(state, reading, plan);
    if let Resource::Gpu(index) = reading.resource {
        note_outside_models(config, snapshot, state, reading, index);
    }
    match level {
        // A reading that is missing says nothing about the incident: leave it as it is, except
        // that nobody stays stopped past max_stop on it.
        Level::Unknown => end_stop_at_max_stop(config, snapshot, state, reading, plan),
        Level::Ok | Level::Warn => close_incident(state, reading, plan),
        Level::Act => act(config, snapshot, state, reading, plan),
    }
}

/// Records the floor's level (and, for RAM, the Shmem baseline) and says when it changed.
pub(in crate::policy) fn note_level(
    state: &mut PolicyState,
    reading: &Reading,
    plan: &mut Plan,
) -> Level {
    let resource = reading.resource;
    let level = reading.level();
    let previous = state.levels.insert(resource, level);
    if resource == Resource::Ram {
        let (available, at) = (reading.available, reading.sampled_at.unwrap_or_default());
        state.shmem_baseline = match (reading.shmem, state.shmem_baseline) {
            (Some(now), _) if reading.above_warn() => Some(ShmemBaseline::new(now, available)),
            (Some(now), Some(b)) => Some(b.next(now, available, at)),
            (None, _) if reading.above_warn() => None,
            (_, kept) => kept,
        };
    }
    if previous == Some(level) {
        return level;
    }
    let text = reading.describe();
    match level {
        Level::Unknown => plan.events.push(event(
            Severity::Warning,
            EventKind::ReadingUnknown,
            format!("{text}: not acting on {resource} until it reads again"),
        )),
        Level::Warn if previous < Some(Level::Warn) => {
            plan.events
                .push(event(Severity::Warning, EventKind::FloorWarn, text))
        }
        Level::Act => plan
            .events
            .push(event(Severity::Critical, EventKind::FloorAct, text)),
        Level::Ok if previous.is_some() => {
            plan.events
                .push(event(Severity::Info, EventKind::FloorCleared, text))
        }
        _ => {}
    }
    level
}

/// Back above the act floor: the incident (if any) is over; a victim it left stopped is held
/// until `release` resumes it.
pub(in crate::policy) fn close_incident(
    state: &mut PolicyState,
    reading: &Reading,
    plan: &mut Plan,
) {
    let resource = reading.resource;
    let Some(incident) = state.incidents.remove(&resource) else {
        return;
    };
    match (&incident.victim, incident.stage) {
        (Some(victim), Stage::Stopped) => state.held.push(Held {
            target: victim.clone(),
            resource,
            since: incident.stage_since,
        }),
        (Some(victim), Stage::Terminated) => state.terminating.push(Terminating {
            target: victim.clone(),
            since: incident.stage_since,
            term_baseline: incident.term_baseline,
        }),
        _ => {}
    }
    if incident.victim.is_some() {
        plan.events.push(event(
            Severity::Info,
            EventKind::IncidentClosed,
            format!(
                "{resource} back above its act floor ({}); incident over after {} victim(s)",
                reading.describe(),
                incident.victims_done + 1
            ),
        ));
    }
}

/// Below the act floor: the incident (opened now if it is new) chooses a victim or takes its
/// victim's next step; a stale reading alerts only.
pub(in crate::policy) fn act(
    config: &Config,
    snapshot: &Snapshot,
    state: &mut PolicyState,
    reading: &Reading,
    plan: &mut Plan,
) {
    let now = snapshot.at;
    // This tick's steps of the other floors (read before this incident is borrowed).
    let steps = state.steps(plan);
    let incident = state
        .incidents
        .entry(reading.resource)
        .or_insert_with(|| Incident::open(now));
    if !reading.may_act {
        report_stale(incident, reading, plan);
        end_stop_at_max_stop(config, snapshot, state, reading, plan);
        return;
    }
    let far_below = far_below_confirmed(reading, incident);
    let Some(victim) = incident.victim.clone() else {
        choose_next(config, snapshot, state, reading, far_below, plan);
        return;
    };
    let alive = victim.any_alive(snapshot);
    if let Some(bytes) = alive
        .then(|| victim_bytes(snapshot, &victim, reading.resource))
        .flatten()
    {
        incident.victim_last_seen = Some((victim.clone(), bytes));
    }
    // The most the victim held: when chosen, or at the last reading that saw it alive.
    let when_chosen = state
        .floor_victims
        .get(&reading.resource)
        .and_then(|v| v.iter().rev().find(|f| f.target == victim))
        .map(|f| f.used);
    let last_seen = incident
        .victim_last_seen
        .as_ref()
        .filter(|(seen, _)| *seen == victim)
        .map(|(_, bytes)| *bytes);
    let step = Step {
        config,
        snapshot,
        reading,
        victim: &victim,
        far_below,
        since: now.saturating_sub(incident.stage_since),
        held_at_most: when_chosen.max(last_seen),
    };
    match incident.stage {
        Stage::Alerted | Stage::Stuck | Stage::Throttled => {}
        Stage::Stopped | Stage::Terminated | Stage::Killed if !alive => {
            incident.enter(Stage::Gone, now);
        }
        Stage::Stopped if step.since >= config.daemon.settle => {
            // A victim two floors stopped together gets one SIGTERM: a floor whose step past
            // the stop another floor has taken (this tick, or before) takes it up.
            let verb = if far_below {
                Verb::Kill
            } else {
                Verb::Terminate
            };
            match signalled_by_another(&steps, reading.resource, &victim, verb) {
                Some(other) => match other.pending {
                    Some(index) => plan.actions[index]
                        .enters
                        .push(step.entry(other.stage, other.since)),
                    None => incident.enter(other.stage, other.since),
                },
                None => terminate_after_stop(&step, plan),
            }
        }
        Stage::Terminated => kill_after_term(incident, &step, plan),
        Stage::Killed if step.since >= config.daemon.kill_timeout => {
            survived_kill(incident, &step, plan);
        }
        Stage::Gone => {
            let next = next_after_gone(incident, &step, plan);
            if next {
                choose_next(config, snapshot, state, reading, far_below, plan);
            }
        }
        _ => {}
    }
}

/// What the steps of an incident with a victim need this tick.
pub(in crate::policy) struct Step<'a> {
    config: &'a Config,
    snapshot: &'a Snapshot,
    reading: &'a Reading,
    victim: &'a Target,
    /// Far below the floor, confirmed by an earlier sample (`far_below_confirmed`).
    far_below: bool,
    /// How long the incident has been at its stage.
    since: Duration,
    /// The most the victim held (RAM floors: when chosen, or when last seen alive), if known.
    held_at_most: Option<u64>,
}

impl Step<'_> {
    /// The victim's next stage, from now: what an escalating action enters once carried out.
    fn next(&self, stage: Stage) -> Entry {
        self.entry(stage, self.snapshot.at)
    }

    /// The victim at `stage` from `at` (another floor's step taken up).
    fn entry(&self, stage: Stage, at: Duration) -> Entry {
        Entry::Floor {
            resource: self.reading.resource,
            victim: self.victim.clone(),
            stage,
            at,
            chosen: None,
        }
    }
}

/// The reading is stale: says so once per incident.
pub(in crate::policy) fn report_stale(incident: &mut Incident, reading: &Reading, plan: &mut Plan) {
    if incident.stale_reported {
        return;
    }
    incident.stale_reported = true;
    plan.events.push(event(
        Severity::Warning,
        EventKind::NotActingStale,
        format!(
            "{}: the reading is stale, alerting only",
            reading.describe()
        ),
    ));
}

/// Stopped for `settle` and still below the floor: SIGTERM (SIGKILL when far below).
pub(in crate::policy) fn terminate_after_stop(step: &Step, plan: &mut Plan) {
    let reading = step.reading;
    let (verb, stage) = match step.far_below {
        true => (Verb::Kill, Stage::Killed),
        false => (Verb::Terminate, Stage::Terminated),
    };
    plan.actions.push(
        action(
            verb,
            step.victim,
            reading.kind(),
            format!(
                "{}; still below {} after stopping it",
                reading.describe(),
                crate::units::fmt_duration(step.config.daemon.settle)
            ),
            reading.recheck(),
        )
        .entering(step.next(stage)),
    );
}

/// SIGTERM sent: SIGKILL when far below, after `term_grace`, or as soon as the victim grows
/// by more than `term_max_growth` (it is not shutting down).
pub(in crate::policy) fn kill_after_term(incident: &mut Incident, step: &Step, plan: &mut Plan) {
    let (snapshot, reading) = (step.snapshot, step.reading);
    let limit = step
        .config
        .daemon
        .term_max_growth
        .resolve(snapshot.host.total_bytes);
    let why = match grown_after_term(snapshot, reading.resource, incident, step.victim, limit) {
        Some(grown) => AfterTerm::Grew(grown),
        None if step.far_below => AfterTerm::FarBelow,
        None if step.since >= step.config.daemon.term_grace => AfterTerm::GraceOver,
        None => return,
    };
    let mut kill = action(
        Verb::Kill,
        step.victim,
        reading.kind(),
        words::kill_after_term(reading, why),
        reading.recheck(),
    )
    .entering(step.next(Stage::Killed));
    kill.after_term = Some(why);
    plan.actions.push(kill);
}

/// Why SIGKILL follows SIGTERM (`words::kill_after_term` says it), first reason first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterTerm {
    /// The victim grew by this much since its first reading after SIGTERM, more than
    /// `term_max_growth`: it is not shutting down.
    Grew(u64),
    /// Far below the floor, confirmed by an earlier sample.
    FarBelow,
    /// `term_grace` ran out.
    GraceOver,
}

impl AfterTerm {
    /// Its name in alerts (`action.after_term`).
    pub fn as_str(self) -> &'static str {
        match self {
            AfterTerm::Grew(_) => "grew",
            AfterTerm::FarBelow => "far_below",
            AfterTerm::GraceOver => "grace_over",
        }
    }
}

/// Still there `kill_timeout` after SIGKILL: stuck; no more kills for this floor.
pub(in crate::policy) fn survived_kill(incident: &mut Incident, step: &Step, plan: &mut Plan) {
    let resource = step.reading.resource;
    incident.enter(Stage::Stuck, step.snapshot.at);
    plan.events.push(event(
        Severity::Critical,
        EventKind::SurvivedKill,
        format!("{} is still there {} after SIGKILL (uninterruptible, stuck in the driver?); not killing more for {resource}", step.victim, crate::units::fmt_duration(step.since)),
    ));
}

/// The victim is gone and this fresh sample is still below the floor. True when the next
/// victim is to be chosen; a GPU that still lists the victim's pids past `release_timeout` is
/// stuck instead (no more kills for it).
pub(in crate::policy) fn next_after_gone(
    incident: &mut Incident,
    step: &Step,
    plan: &mut Plan,
) -> bool {
    let resource = step.reading.resource;
    let stuck: Vec<i32> = match resource {
        // An exited victim's pages come back to MemAvailable some time after it is seen gone
        // (its address space torn down, the counters folded): a reading taken before that shows
        // the shortfall it is giving back, and the next victim would be chosen for nothing;
        // unless all it held, back, would still leave RAM under its act floor.
        Resource::Ram if step.since < RAM_RELEASE && !short_even_with_it_back(step) => {
            return false
        }
        Resource::Ram => Vec::new(),
        Resource::Gpu(index) => stuck_pids(step.snapshot, step.victim, index),
    };
    if stuck.is_empty() {
        incident.victims_done += 1;
        incident.victim = None;
        return true;
    }
    if step.since >= step.config.gpu.release_timeout {
        incident.enter(Stage::Stuck, step.snapshot.at);
        plan.events.push(event(
            Severity::Critical,
            EventKind::StuckMemory,
            format!(
                "{} exited {} ago but {resource} still lists pid(s) {stuck:?} holding memory ({}): memory stuck in the driver; not killing more for {resource}",
                step.victim,
                crate::units::fmt_duration(step.since),
                step.reading.describe()
            ),
        ));
    }
    false
}

/// Whether MemAvailable stays under the act floor even once all the gone victim held is back
/// (the most it held, when chosen or when last seen alive: an upper bound of what its death
/// gives back). Unknown (no figure, or short of something else than MemAvailable: swap, PSI):
/// no.
fn short_even_with_it_back(step: &Step) -> bool {
    let reading = step.reading;
    let Some(held) = step.held_at_most else {
        return false;
    };
    reading.act_because.is_none()
        && matches!((reading.available, reading.min), (Some(a), Some(min)) if a.saturating_add(held) < min)
}

/// How long after a victim is seen gone the RAM floor waits before it chooses the next one: the
/// kernel's vmstat interval (`vm.stat_interval`, 1 s), over which /proc/meminfo's counters are
/// folded; long enough for the 13 ms lag seen on CI, not derived from a measured bound.
pub(in crate::policy) const RAM_RELEASE: Duration = Duration::from_secs(1);

/// Far below the floor on this sample and on an earlier one: one sample alone (a glitch, a
/// reading caught mid-update) never earns SIGKILL without SIGTERM's grace.
pub(in crate::policy) fn far_below_confirmed(reading: &Reading, incident: &mut Incident) -> bool {
    if !reading.far_below() {
        incident.far_below_at = None;
        return false;
    }
    match (incident.far_below_at, reading.sampled_at) {
        (Some(first), Some(now)) => now > first,
        (None, now) => {
            incident.far_below_at = now;
            false
        }
        (Some(_), None) => false,
    }
}

/// A victim stopped for a floor whose reading is now unknown or stale: at `max_stop` it is
/// resumed (never killed: nothing is decided on a reading that cannot be trusted), and the
/// incident waits for a reading to choose again.
pub(in crate::policy) fn end_stop_at_max_stop(
    config: &Config,
    snapshot: &Snapshot,
    state: &mut PolicyState,
    reading: &Reading,
    plan: &mut Plan,
) {
    let max_stop = config.daemon.max_stop;
    let Some(incident) = state.incidents.get_mut(&reading.resource) else {
        return;
    };
    let Some(victim) = incident.victim.clone() else {
        return;
    };
    if incident.stage != Stage::Stopped
        || snapshot.at.saturating_sub(incident.stage_since) < max_stop
    {
        return;
    }
    // Letting go, not a signal's stage: the incident waits for a reading it can trust.
    incident.victim = None;
    incident.enter(Stage::Alerted, snapshot.at);
    plan.actions.push(action(
        Verb::Resume,
        &victim,
        ReasonKind::MaxStop,
        format!(
            "stopped for {} (max_stop) while {}: resumed, never killed on a reading that cannot be trusted",
            crate::units::fmt_duration(max_stop),
            untrusted(reading)
        ),
        None,
    ));
}

/// While a victim has SIGTERM, the loop ticks at least this often: a victim that ignores SIGTERM
/// shows by growing, and every millisecond of growth is memory the host does not have.
pub(in crate::policy) const TERM_WATCH_INTERVAL: Duration = Duration::from_millis(2);

/// The victim's own memory now (RAM floors: RSS summed over its live processes; the daemon
/// re-reads watched victims every tick). GPU memory is sampled too seldom to watch this way.
pub(in crate::policy) fn victim_bytes(
    snapshot: &Snapshot,
    victim: &Target,
    resource: Resource,
) -> Option<u64> {
    if resource != Resource::Ram {
        return None;
    }
    let live: Vec<u64> = victim
        .ids()
        .filter_map(|id| snapshot.processes.get(id))
        .filter(|p| !p.exited())
        .map(|p| p.rss_bytes)
        .collect();
    (!live.is_empty()).then(|| live.iter().sum())
}

/// After SIGTERM, how much the victim has grown since the first reading taken after the signal,
/// if by more than `limit` bytes: a process shutting down does not grow, so one that does is
/// ignoring SIGTERM. Records that first reading.
pub(in crate::policy) fn grown_after_term(
    snapshot: &Snapshot,
    resource: Resource,
    incident: &mut Incident,
    victim: &Target,
    limit: Option<u64>,
) -> Option<u64> {
    let now = victim_bytes(snapshot, victim, resource)?;
    match incident.term_baseline {
        Some(TermBaseline { stage_since, bytes }) if stage_since == incident.stage_since => {
            let grown = now.saturating_sub(bytes);
            limit.is_some_and(|l| grown > l).then_some(grown)
        }
        // The tick that sent SIGTERM read the victim before sending it; any later tick read it
        // after (the daemon re-reads watched victims first thing).
        _ if snapshot.at > incident.stage_since => {
            incident.term_baseline = Some(TermBaseline {
                stage_since: incident.stage_since,
                bytes: now,
            });
            None
        }
        _ => None,
    }
}

/// One floor for one tick; every event it raises is about that resource (and its victim, if any).
pub(in crate::policy) fn evaluate_floor(
    config: &Config,
    snapshot: &Snapshot,
    state: &mut PolicyState,
    reading: &Reading,
    plan: &mut Plan,
) {
    let first = plan.events.len();
    evaluate_floor_inner(config, snapshot, state, reading, plan);
    let resource = reading.resource;
    let steps = state.steps(plan);
    let about = match steps.iter().find(|s| s.resource == resource) {
        Some(step) => About::target(&step.victim, resource),
        None => About {
            resource: Some(resource),
            ..About::default()
        },
    };
    for e in &mut plan.events[first..] {
        e.about = about.clone();
    }
}

/// Pids of an exited victim that NVML still reports as holding memory on GPU `index`.
pub(in crate::policy) fn stuck_pids(snapshot: &Snapshot, victim: &Target, index: u32) -> Vec<i32> {
    let Some(gpu) = snapshot.gpus.devices.iter().find(|g| g.index == index) else {
        return Vec::new();
    };
    // NVML lists pids only: a pid the process scan now shows as another process (reused after
    // the victim exited) holds that process's memory, not the victim's.
    let reused = |id: ProcessId| {
        snapshot
            .processes
            .by_pid(id.pid)
            .is_some_and(|p| p.id() != id)
    };
    victim
        .members
        .iter()
        .filter(|m| !reused(m.id))
        .map(|m| m.id.pid)
        .filter(|pid| matches!(gpu.processes.get(pid), Some(Some(b)) if *b > 0))
        .collect()
}
