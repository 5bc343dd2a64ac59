//! Choosing the next victim of an incident, under the brake and the Shmem rule; and what the
//! floors do between incidents (brakes released, stopped processes held or let go).

use super::*;

/// With `candidates = "models"`, the GPU memory that processes of no model hold (as NVML lists
/// them: not `used` less the models, which a model's own growth would inflate while NVML's
/// per-process figures lag behind it).
pub(in crate::policy) fn outside_models(
    snapshot: &Snapshot,
    state: &PolicyState,
    index: u32,
) -> Option<u64> {
    let gpu = snapshot.gpus.devices.iter().find(|g| g.index == index)?;
    if gpu.untrusted().is_some() {
        return None;
    }
    let in_model = |pid: i32| {
        snapshot
            .processes
            .by_pid(pid)
            .is_some_and(|p| state.attribution.model_of(p.id()).is_some())
    };
    Some(
        gpu.processes
            .iter()
            .filter(|(pid, _)| !in_model(**pid))
            .filter_map(|(_, bytes)| *bytes)
            .sum(),
    )
}

/// Records the GPU's memory outside the models: its baseline when the GPU is above its warn
/// floor, the most it has been since otherwise.
pub(in crate::policy) fn note_outside_models(
    config: &Config,
    snapshot: &Snapshot,
    state: &mut PolicyState,
    reading: &Reading,
    index: u32,
) {
    if config.daemon.candidates != Candidates::Models {
        return;
    }
    let Some(now) = outside_models(snapshot, state, index) else {
        return;
    };
    if reading.above_warn() {
        state.outside_baseline.insert(index, (now, now));
    } else if let Some((_, peak)) = state.outside_baseline.get_mut(&index) {
        *peak = (*peak).max(now);
    }
}

/// The memory outside every model grew by at least the GPU's shortfall since it was last above
/// its warn floor: the models are not what made it short.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::policy) struct OutsideVerdict {
    pub growth: u64,
    pub shortfall: u64,
    pub outside: u64,
    /// The first candidate, left alone: within its budget.
    pub target: Target,
}

/// What choosing the next victim came to, as data: `words` says it (events, the action's
/// reason), `choose_next` applies it.
#[derive(Clone, Debug)]
pub(in crate::policy) enum Choice {
    /// The brake holds; `Some` when it engaged just now (said once).
    Braked(Option<BrakeEngaged>),
    /// Nobody may be acted on: all protected or outside the candidates.
    NoVictim,
    /// The Shmem rule holds the floor back from its first candidate.
    HeldBack(ShmemVerdict),
    /// Memory outside the models made the GPU short: a model within its budget is left alone.
    Outside(OutsideVerdict),
    /// Nothing this tick: no process scan yet (the daemon just started below a floor; the loop
    /// takes one at once), or the GPU's per-process lists are older than its free memory (NVML's
    /// per-process figures lag), and what the models hold is judged on lists read with it.
    Wait,
    /// A victim.
    Victim(Victim),
}

/// The brake engaged: `victims` acted on within `window` did not bring the resource back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::policy) struct BrakeEngaged {
    pub victims: usize,
    pub max_victims: u32,
    pub window: Duration,
    /// Until the oldest of them leaves the window (the least the brake holds).
    pub left: Duration,
    /// RAM's `Shmem`, which no kill gives back.
    pub shmem: Option<u64>,
}

/// The chosen process (or a user's largest processes) and what it holds of the short resource.
#[derive(Clone, Debug)]
pub(in crate::policy) struct Victim {
    pub target: Target,
    pub used: u64,
    /// A user ranked by the sum over its processes: that sum and how many.
    pub user_total: Option<(u64, usize)>,
    /// The Shmem rule's verdict, when it applied.
    pub shmem: Option<ShmemVerdict>,
    /// Chosen while the brake holds: it alone lifts the resource above its act floor and holds
    /// more than any victim the brake counted (the brake is for victims like those that did not
    /// help; an account that keeps a floor short with small processes it lets die cannot spend
    /// it for the hog that causes the shortage).
    pub despite_brake: bool,
}

/// The Shmem rule on the first candidate: Shmem grew by `growth.growth` since RAM was last above
/// its warn floor, leaving `unexplained` of the shortfall to processes.
#[derive(Clone, Debug)]
pub(in crate::policy) struct ShmemVerdict {
    pub growth: ShmemGrowth,
    pub unexplained: u64,
    pub target: Target,
    pub used: u64,
    pub judgement: Judgement,
    /// The largest owners of tmpfs files (uid, bytes), for the alert.
    pub owners: Vec<(u32, u64)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::policy) enum Judgement {
    /// All of the shortfall is new Shmem, and the candidate alone lifts RAM above the warn floor.
    LiftsAboveWarn,
    /// All of it is new Shmem, and the candidate does not hold enough to lift RAM above warn.
    TooSmallForWarn,
    /// Part of it is new Shmem; the candidate holds at least the rest and lifts RAM above the act
    /// floor.
    CoversTheRest,
    /// It holds less than the part Shmem does not explain: something else caused it.
    LessThanTheRest,
    /// It holds the rest but not enough to lift RAM above the act floor.
    CannotLift,
    /// Its account owns tmpfs files of at least half of what Shmem grew by: the memory no
    /// process holds is that account's, and what its processes hold is what acting can free.
    OwnsTheFiles,
}

impl Judgement {
    pub fn acts(self) -> bool {
        matches!(
            self,
            Judgement::LiftsAboveWarn | Judgement::CoversTheRest | Judgement::OwnsTheFiles
        )
    }
}

/// Decides who the floor acts on next (the brake's engagement is recorded here): the brake, the
/// candidate, then what memory outside the candidates says of it.
pub(in crate::policy) fn choose(
    config: &Config,
    snapshot: &Snapshot,
    state: &mut PolicyState,
    reading: &Reading,
) -> Choice {
    let resource = reading.resource;
    let brake = brake(config, snapshot.at, state, reading);
    let excluded = state
        .incidents
        .get(&resource)
        .map(|i| i.excluded.clone())
        .unwrap_or_default();
    let chosen = victim::choose(
        config,
        snapshot,
        state,
        reading.short,
        &excluded,
        reading.need(),
    );
    // Under the brake, only a victim unlike those that did not help: one that alone lifts the
    // resource above its act floor and holds more than the largest of them.
    let largest_counted = state
        .floor_victims
        .get(&resource)
        .and_then(|v| v.iter().map(|v| v.used).max())
        .unwrap_or(0);
    let shortfall = reading.shortfall().unwrap_or(u64::MAX);
    let lifts = chosen
        .as_ref()
        .is_some_and(|c| c.used_bytes > shortfall && c.used_bytes > largest_counted);
    if let (Some(engaged), false) = (brake.clone(), lifts) {
        let newly = state.braked.insert(resource);
        return Choice::Braked(engaged.filter(|_| newly));
    }
    let Some(Chosen {
        target,
        used_bytes: used,
        user_total,
        over_budget,
    }) = chosen
    else {
        if snapshot.processes.scanned_at.is_none() {
            return Choice::Wait; // nobody is known yet, so nobody is "no victim" yet
        }
        return Choice::NoVictim;
    };
    if let (Resource::Gpu(index), false) = (resource, over_budget) {
        // Whether memory outside the models made it short is judged on process lists read with
        // the free memory; a crossing seen on older lists waits for them (the loop asks for
        // them at once), at most `[gpu] sample_timeout` into the incident.
        let opened = state
            .incidents
            .get(&resource)
            .map_or(snapshot.at, |i| i.opened_at);
        let waited = snapshot.at.saturating_sub(opened);
        if config.daemon.candidates == Candidates::Models
            && !snapshot.gpus.processes_fresh
            && waited < config.gpu.sample_timeout
        {
            return Choice::Wait;
        }
        if let Some(v) = outside_verdict(snapshot, state, reading, index, &target) {
            return Choice::Outside(v);
        }
    }
    match shmem_verdict(snapshot, state, reading, &target, used) {
        Some(verdict) if !verdict.judgement.acts() => Choice::HeldBack(verdict),
        shmem => Choice::Victim(Victim {
            target,
            used,
            user_total,
            shmem,
            despite_brake: brake.is_some(),
        }),
    }
}

/// The brake: `Some` while it holds (with how it engaged, when that is new). A brake that holds
/// releases only in `release_brakes` (back above the warn floor), never here on time alone.
fn brake(
    config: &Config,
    now: Duration,
    state: &mut PolicyState,
    reading: &Reading,
) -> Option<Option<BrakeEngaged>> {
    let resource = reading.resource;
    let Brake {
        max_victims,
        window,
    } = Brake::of(config, resource);
    if reading.action == FloorAction::Alert || max_victims == 0 {
        return None;
    }
    if state.braked.contains(&resource) {
        return Some(None);
    }
    let recent = state.floor_victims.entry(resource).or_default();
    recent.retain(|v| now.saturating_sub(v.at) < window);
    if recent.len() < max_victims as usize {
        return None;
    }
    let first = recent.iter().map(|v| v.at).min().unwrap_or(now);
    Some(Some(BrakeEngaged {
        victims: recent.len(),
        max_victims,
        window,
        left: (first + window).saturating_sub(now),
        shmem: reading.shmem.filter(|_| resource == Resource::Ram),
    }))
}

/// A GPU whose memory outside the models grew by its shortfall: the verdict on `target`, a
/// model within its budget (left alone).
fn outside_verdict(
    snapshot: &Snapshot,
    state: &PolicyState,
    reading: &Reading,
    index: u32,
    target: &Target,
) -> Option<OutsideVerdict> {
    let (base, peak) = state.outside_baseline.get(&index).copied()?;
    let outside = outside_models(snapshot, state, index)?;
    let shortfall = reading.shortfall().filter(|&s| s > 0)?;
    let growth = peak.saturating_sub(base);
    (growth >= shortfall).then(|| OutsideVerdict {
        growth,
        shortfall,
        outside,
        target: target.clone(),
    })
}

/// The Shmem rule's verdict on `target`, holding `used` of its own, when Shmem grew by enough
/// to matter.
fn shmem_verdict(
    snapshot: &Snapshot,
    state: &PolicyState,
    reading: &Reading,
    target: &Target,
    used: u64,
) -> Option<ShmemVerdict> {
    let growth = shmem_shortfall(reading, state.shmem_baseline)?;
    let unexplained = growth.shortfall.saturating_sub(growth.growth);
    let judgement = if unexplained == 0 {
        // All of the shortfall is new Shmem: no process holds it. Act only on a victim whose own
        // memory alone lifts RAM back above the warn floor: a tmpfs write still under way
        // crosses the act floor by a few bytes first, and killing for that would only buy the
        // next few bytes.
        if used > growth.to_warn {
            Judgement::LiftsAboveWarn
        } else {
            Judgement::TooSmallForWarn
        }
    } else {
        // Part of it is new Shmem, which no kill gives back: judge only the rest. A victim
        // holding less than that rest is not what caused it (something outside the candidates
        // is), and one that cannot lift RAM above the act floor buys nothing.
        match (used >= unexplained, used > growth.shortfall) {
            (true, true) => Judgement::CoversTheRest,
            (false, _) => Judgement::LessThanTheRest,
            (true, false) => Judgement::CannotLift,
        }
    };
    let mut owners: Vec<(u32, u64)> = snapshot
        .tmpfs_owners
        .iter()
        .map(|(u, b)| (*u, *b))
        .collect();
    owners.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    owners.truncate(3);
    // The files' owner is the account that made RAM short: its processes are acted on.
    let owner = target.members.first().map(|m| m.uid);
    let owned = owner.and_then(|u| snapshot.tmpfs_owners.get(&u)).copied();
    let judgement = match owned {
        Some(b) if !judgement.acts() && owner != Some(0) && b >= growth.growth / 2 => {
            Judgement::OwnsTheFiles
        }
        _ => judgement,
    };
    Some(ShmemVerdict {
        growth,
        unexplained,
        target: target.clone(),
        used,
        judgement,
        owners,
    })
}

/// Chooses a victim for an open incident and takes the first step of the floor's action; what
/// is said once per incident is said once.
pub(in crate::policy) fn choose_next(
    config: &Config,
    snapshot: &Snapshot,
    state: &mut PolicyState,
    reading: &Reading,
    far_below: bool,
    plan: &mut Plan,
) {
    let choice = choose(config, snapshot, state, reading);
    let incident = state
        .incidents
        .get_mut(&reading.resource)
        .expect("incident exists");
    if let Choice::Outside(v) = &choice {
        if !incident.shmem_reported {
            incident.shmem_reported = true;
            plan.events.push(words::outside_shortfall(reading, v));
        }
        return;
    }
    let shmem = match &choice {
        Choice::HeldBack(v) => Some(v),
        Choice::Victim(v) => v.shmem.as_ref(),
        _ => None,
    };
    if let Some(verdict) = shmem.filter(|_| !incident.shmem_reported) {
        incident.shmem_reported = true;
        plan.events.push(words::shmem_shortfall(reading, verdict));
    }
    match choice {
        Choice::Braked(Some(engaged)) => plan.events.push(words::braked(reading, &engaged)),
        Choice::NoVictim if !incident.no_victim_reported => {
            incident.no_victim_reported = true;
            plan.events.push(words::no_victim(reading));
        }
        Choice::Victim(victim) => act_on(config, snapshot, state, reading, far_below, victim, plan),
        Choice::Braked(None)
        | Choice::NoVictim
        | Choice::HeldBack(_)
        | Choice::Outside(_)
        | Choice::Wait => {}
    }
}

/// The first step on a chosen victim: the floor's action (SIGKILL at once when far below), or
/// the SIGTERM an earlier incident sent it, taken up again.
fn act_on(
    config: &Config,
    snapshot: &Snapshot,
    state: &mut PolicyState,
    reading: &Reading,
    far_below: bool,
    victim: Victim,
    plan: &mut Plan,
) {
    let (resource, now) = (reading.resource, snapshot.at);
    let detail = words::victim(reading, &victim);
    let target = victim.target;
    let verb = match reading.action {
        FloorAction::Alert => None,
        FloorAction::Stop => Some(Verb::Stop),
        FloorAction::Kill if far_below => Some(Verb::Kill),
        FloorAction::Kill => Some(Verb::Terminate),
    };
    let Some(verb) = verb else {
        // Alert only: the victim is named, nothing is signalled.
        let incident = state.incidents.get_mut(&resource).expect("incident exists");
        incident.victim = Some(target.clone());
        incident.enter(Stage::Alerted, now);
        plan.events.push(words::would_act(&detail, &target));
        return;
    };
    let observe = config.daemon.mode == Mode::Observe;
    if verb == Verb::Terminate && !observe {
        if let Some(earlier) = take_terminating(state, &target, now, config.daemon.term_grace) {
            // Sent SIGTERM by an incident that closed while it shut down: the same SIGTERM goes
            // on (its grace, its growth check), no second one, and it is not a new victim for
            // the brake.
            let incident = state.incidents.get_mut(&resource).expect("incident exists");
            incident.victim = Some(target);
            incident.enter(Stage::Terminated, earlier.since);
            incident.term_baseline = earlier.term_baseline;
            return;
        }
    }
    let steps = state.steps(plan);
    let other = signalled_by_another(&steps, resource, &target, verb).filter(|_| !observe);
    if let Some(other) = other {
        // Another floor's incident has signalled every process of this victim already (a
        // model short on two GPUs at once): this one shares that step, no second signal (a
        // second SIGTERM makes many servers quit without cleaning up), and no second victim
        // for the brake. Decided this tick, the step is this incident's too once its action is
        // carried out (and not if it is skipped or fails); carried out before, it is at once.
        match other.pending {
            Some(index) => plan.actions[index].enters.push(Entry::Floor {
                resource,
                victim: target,
                stage: other.stage,
                at: other.since,
                chosen: None,
            }),
            None => {
                let (stage, since) = (other.stage, other.since);
                let incident = state.incidents.get_mut(&resource).expect("incident exists");
                incident.victim = Some(target);
                incident.enter(stage, since);
            }
        }
        return;
    }
    let stage = match (verb, observe) {
        (_, true) => Stage::Alerted,
        (Verb::Stop, _) => Stage::Stopped,
        (Verb::Kill, _) => Stage::Killed,
        _ => Stage::Terminated,
    };
    // Processes another floor's incident has signalled as strongly already are left out of
    // this signal (the victim here is still all of them).
    let done = signalled_elsewhere(&steps, resource, verb);
    let rest = Target {
        model: target.model.clone(),
        members: target
            .members
            .iter()
            .filter(|m| !done.contains(&m.id))
            .cloned()
            .collect(),
    };
    if rest.members.is_empty() {
        // Each process has had this signal or a stronger one, from other floors' incidents
        // (none of them all): none is sent again, and this incident takes up their step (on
        // the outcome of one decided this tick) without a new victim for the brake.
        let wanted = verb_strength(verb);
        let pending = steps
            .iter()
            .filter(|s| s.resource != resource && strength(s.stage) >= wanted)
            .find_map(|s| s.pending);
        match pending {
            Some(index) => plan.actions[index].enters.push(Entry::Floor {
                resource,
                victim: target,
                stage,
                at: now,
                chosen: None,
            }),
            None => {
                let incident = state.incidents.get_mut(&resource).expect("incident exists");
                incident.victim = Some(target);
                incident.enter(stage, now);
            }
        }
        return;
    }
    let entry = Entry::Floor {
        resource,
        victim: target,
        stage,
        at: now,
        chosen: Some(victim.used),
    };
    plan.actions
        .push(action(verb, &rest, reading.kind(), detail, reading.recheck()).entering(entry));
}

/// How strong a signal a stage has sent (0: none that counts).
fn strength(stage: Stage) -> u8 {
    match stage {
        Stage::Stopped => 1,
        Stage::Terminated => 2,
        Stage::Killed => 3,
        Stage::Alerted | Stage::Throttled | Stage::Gone | Stage::Stuck => 0,
    }
}

/// How strong a signal `verb` is (0: not one the floors send to a victim).
fn verb_strength(verb: Verb) -> u8 {
    match verb {
        Verb::Stop => 1,
        Verb::Terminate => 2,
        Verb::Kill => 3,
        _ => 0,
    }
}

/// The step of another floor's incident that has sent `verb` or a stronger signal to every
/// process of `target` already (this tick's steps included). A target with a process that
/// incident did not signal is not covered (that process gets its signal), and an incident whose
/// victim is gone or stuck covers nothing.
pub(in crate::policy) fn signalled_by_another<'a>(
    steps: &'a [InForce],
    resource: Resource,
    target: &Target,
    verb: Verb,
) -> Option<&'a InForce> {
    let wanted = verb_strength(verb);
    steps.iter().find(|s| {
        let covered = target.ids().all(|c| s.victim.ids().any(|id| id == c));
        wanted > 0 && s.resource != resource && covered && strength(s.stage) >= wanted
    })
}

/// The processes other floors' incidents have sent `verb` or a stronger signal (this tick's
/// steps included).
fn signalled_elsewhere(steps: &[InForce], resource: Resource, verb: Verb) -> Vec<ProcessId> {
    let wanted = verb_strength(verb);
    steps
        .iter()
        .filter(|s| wanted > 0 && s.resource != resource && strength(s.stage) >= wanted)
        .flat_map(|s| s.victim.ids())
        .collect()
}

/// The earlier SIGTERM of a process chosen again, if it is still within `term_grace` (taken out of
/// the list: the incident holds it now). Entries past their grace or whose processes are gone
/// are dropped on the way.
pub(in crate::policy) fn take_terminating(
    state: &mut PolicyState,
    target: &Target,
    now: Duration,
    term_grace: Duration,
) -> Option<Terminating> {
    state
        .terminating
        .retain(|t| now.saturating_sub(t.since) < term_grace);
    let at = state.terminating.iter().position(|t| {
        t.target
            .ids()
            .any(|id| target.ids().any(|chosen| chosen == id))
    })?;
    Some(state.terminating.remove(at))
}

/// The brake of a floor: at most `max_victims` victims within `window` (0: no brake).
pub(in crate::policy) struct Brake {
    max_victims: u32,
    window: Duration,
}

impl Brake {
    pub(in crate::policy) fn of(config: &Config, resource: Resource) -> Brake {
        let (max_victims, window) = match resource {
            Resource::Ram => (config.ram.max_victims, config.ram.victim_window),
            Resource::Gpu(_) => (config.gpu.max_victims, config.gpu.victim_window),
        };
        Brake {
            max_victims,
            window,
        }
    }
}

pub(in crate::policy) fn round_secs(d: Duration) -> Duration {
    Duration::from_secs(d.as_secs() + u64::from(d.subsec_nanos() > 0))
}

/// RAM short of its act floor while `Shmem` grew: memory no process holds explains some of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::policy) struct ShmemGrowth {
    /// How much `Shmem` grew since RAM was last above its warn floor (to its peak since).
    pub growth: u64,
    /// `min_available` - MemAvailable.
    pub shortfall: u64,
    /// What a victim must give back to lift RAM above the warn floor (the act floor if none).
    pub to_warn: u64,
}

/// RAM below its act floor by MemAvailable, and `Shmem` grown since RAM was last above its warn
/// floor (to its highest since then).
pub(in crate::policy) fn shmem_shortfall(
    reading: &Reading,
    baseline: Option<ShmemBaseline>,
) -> Option<ShmemGrowth> {
    if reading.resource != Resource::Ram || reading.short != Short::Ram {
        return None;
    }
    let (Some(available), Some(min), Some(ShmemBaseline { base, peak, .. })) =
        (reading.available, reading.min, baseline)
    else {
        return None;
    };
    let shortfall = reading.shortfall().filter(|&s| s > 0)?;
    let growth = peak.saturating_sub(base);
    let to_warn = reading
        .warn
        .unwrap_or(min)
        .max(min)
        .saturating_sub(available);
    // Model servers' own shared memory moves by a few MiB all the time: only growth that could
    // matter (at least SHMEM_GROWTH_MIN and a quarter of the shortfall) makes the rule apply, so
    // a hog split over processes smaller than the shortfall is still acted on.
    (growth >= SHMEM_GROWTH_MIN && growth >= shortfall / 4).then_some(ShmemGrowth {
        growth,
        shortfall,
        to_warn,
    })
}

/// The least `Shmem` growth the Shmem rule takes for a cause of a RAM shortfall.
pub(in crate::policy) const SHMEM_GROWTH_MIN: u64 = 64 << 20;

/// The brake's bookkeeping, before the floors choose: a resource that reads `Ok` (back above its
/// warn floor) forgets the victims before it (they helped: they do not count), and a brake that
/// holds is released (said once, as info) only on an `Ok` reading with fewer than `max_victims`
/// victims left within the window (or with the brake turned off).
pub(in crate::policy) fn release_brakes(
    config: &Config,
    snapshot: &Snapshot,
    state: &mut PolicyState,
    readings: &[Reading],
    plan: &mut Plan,
) {
    let now = snapshot.at;
    for reading in readings {
        let resource = reading.resource;
        let Brake {
            max_victims,
            window,
        } = Brake::of(config, resource);
        let ok = reading.level() == Level::Ok;
        let recent = state.floor_victims.entry(resource).or_default();
        recent.retain(|v| now.saturating_sub(v.at) < window);
        if state.braked.contains(&resource) {
            if max_victims > 0 && (!ok || recent.len() >= max_victims as usize) {
                continue;
            }
            state.braked.remove(&resource);
            plan.events.push(
                event(
                    Severity::Info,
                    EventKind::FloorBrake,
                    format!(
                        "{resource}: brake released ({}; {} victim(s) within the last {}): the floor may act again",
                        reading.describe(),
                        recent.len(),
                        crate::units::fmt_duration(window)
                    ),
                )
                .about(About {
                    resource: Some(resource),
                    ..About::default()
                }),
            );
        }
        if ok {
            recent.clear();
        }
    }
}

/// Floor-stopped processes whose incident has closed: resume once the resource is back to `Ok`;
/// at `max_stop`, kill if a reading that may act still says the resource is below its warn
/// floor, else resume (an unknown or stale reading never kills).
pub(in crate::policy) fn release_held(
    config: &Config,
    snapshot: &Snapshot,
    state: &mut PolicyState,
    readings: &[Reading],
    plan: &mut Plan,
) {
    let now = snapshot.at;
    let max_stop: Duration = config.daemon.max_stop;
    let levels = state.levels.clone();
    state.held.retain(|held| {
        if snapshot.processes.scanned_at.is_some() && !held.target.any_alive(snapshot) {
            return false;
        }
        if levels.get(&held.resource) == Some(&Level::Ok) {
            plan.actions.push(action(
                Verb::Resume,
                &held.target,
                ReasonKind::Cleared,
                format!("{} is back above its warn floor", held.resource),
                None,
            ));
            return false;
        }
        let trusted = readings
            .iter()
            .find(|r| r.resource == held.resource)
            .filter(|r| r.may_act && r.available.is_some());
        if now.saturating_sub(held.since) >= max_stop && trusted.is_none() {
            let why = readings
                .iter()
                .find(|r| r.resource == held.resource)
                .map_or(format!("{} has no reading", held.resource), untrusted);
            plan.actions.push(action(
                Verb::Resume,
                &held.target,
                ReasonKind::MaxStop,
                format!(
                    "stopped for {} (max_stop) while {why}: resumed, never killed on a reading that cannot be trusted",
                    crate::units::fmt_duration(max_stop),
                ),
                None,
            ));
            return false;
        }
        if now.saturating_sub(held.since) >= max_stop {
            plan.actions.push(action(
                Verb::Kill,
                &held.target,
                ReasonKind::MaxStop,
                format!(
                    "stopped for {} (max_stop) and {} is still below its warn floor",
                    crate::units::fmt_duration(max_stop),
                    held.resource
                ),
                None,
            ));
            return false;
        }
        true
    });
}
