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

use crate::config::{Config, FloorAction, Mode};
use crate::kinds::{EventKind, ReasonKind};
use crate::snapshot::Snapshot;

use super::victim::{self, Chosen, Short};
use super::{
    action, bytes, event, About, FloorVictim, Held, Incident, Level, Plan, PolicyState, Recheck,
    Resource, Severity, ShmemBaseline, Stage, Target, TermBaseline, Terminating, Verb,
};

/// One resource's reading against its floors.
pub(super) struct Reading {
    pub resource: Resource,
    pub available: Option<u64>,
    pub warn: Option<u64>,
    pub min: Option<u64>,
    /// Something other than `available` says act (swap, PSI), and why.
    pub act_because: Option<String>,
    pub warn_because: Option<String>,
    /// Why the reading is unknown, if the source said (e.g. NVML: the GPU fell off the bus).
    pub error: Option<String>,
    /// False when the reading is stale: it may alert, never act.
    pub may_act: bool,
    pub action: FloorAction,
    /// When the figure was sampled (daemon clock): RAM every tick, a GPU when NVML answered.
    pub sampled_at: Option<Duration>,
    /// What victims are ranked by.
    pub short: Short,
    /// RAM: `Shmem` (tmpfs, shared memory), for messages and the unattributable-shortfall rule.
    pub shmem: Option<u64>,
}

impl Reading {
    fn level(&self) -> Level {
        let Some(available) = self.available else {
            return Level::Unknown;
        };
        if self.min.is_some_and(|m| available < m) || self.act_because.is_some() {
            Level::Act
        } else if self.warn.is_some_and(|w| available < w) || self.warn_because.is_some() {
            Level::Warn
        } else {
            Level::Ok
        }
    }

    /// A GPU floor: what a victim must give back for the GPU to recover, up to the warn floor
    /// (where the brake forgets the victim), else the act floor. `None` for RAM and swap, whose
    /// per-process figures count shared and copy-on-write pages in every process that maps them.
    fn need(&self) -> Option<u64> {
        if !matches!(self.short, Short::Gpu(_)) {
            return None;
        }
        let floor = self.warn.or(self.min)?;
        Some(floor.saturating_sub(self.available?))
    }

    /// Far below the floor (under half of it): no time for SIGTERM's grace.
    fn far_below(&self) -> bool {
        matches!((self.available, self.min), (Some(a), Some(m)) if a < m / 2)
    }

    fn describe(&self) -> String {
        let what = match self.resource {
            Resource::Ram => "RAM available".to_string(),
            Resource::Gpu(i) => format!("GPU {i} free"),
        };
        let (warn_key, min_key) = match self.resource {
            Resource::Ram => ("warn_available", "min_available"),
            Resource::Gpu(_) => ("warn_free", "min_free"),
        };
        let mut text = match self.available {
            None => match &self.error {
                Some(e) => format!("{what} unknown ({e})"),
                None => format!("{what} unknown"),
            },
            Some(a) => match (self.min, self.warn) {
                (Some(m), _) if a < m => format!("{what} {} < {min_key} {}", bytes(a), bytes(m)),
                (_, Some(w)) if a < w => format!("{what} {} < {warn_key} {}", bytes(a), bytes(w)),
                _ => format!("{what} {}", bytes(a)),
            },
        };
        for because in [&self.act_because, &self.warn_because]
            .into_iter()
            .flatten()
        {
            text.push_str("; ");
            text.push_str(because);
        }
        if let (Some(shmem), Level::Warn | Level::Act) = (self.shmem, self.level()) {
            text.push_str(&format!("; Shmem (tmpfs, shared memory) {}", bytes(shmem)));
        }
        text
    }

    /// Above the warn floor by MemAvailable (or the act floor where there is no warn floor).
    fn above_warn(&self) -> bool {
        match (self.available, self.warn.or(self.min)) {
            (Some(a), Some(w)) => a >= w,
            (Some(_), None) => true,
            (None, _) => false,
        }
    }

    /// What the executor reads again just before acting: MemAvailable, when it being below
    /// `min_available` is why this acts. An act for swap or PSI has no MemAvailable level that
    /// means "recovered" (it is above the floor already), so it gets no recheck.
    fn recheck(&self) -> Option<Recheck> {
        match (self.resource, self.available, self.min) {
            (Resource::Ram, Some(a), Some(m)) if a < m => Some(Recheck {
                resource: Resource::Ram,
                below_bytes: m,
            }),
            _ => None,
        }
    }

    fn kind(&self) -> ReasonKind {
        match self.resource {
            Resource::Ram => ReasonKind::RamFloor,
            Resource::Gpu(_) => ReasonKind::GpuFloor,
        }
    }
}

/// The readings of this snapshot, with their floors resolved against the totals. A reading that
/// is missing, inconsistent or against a floor that cannot be right is unknown (`available` is
/// `None`, `error` says why). `tracked`: resources the policy holds state for (an incident, a
/// level, a held process), which get a reading even with no floor or no GPU left.
pub(super) fn readings(config: &Config, snapshot: &Snapshot, tracked: &[Resource]) -> Vec<Reading> {
    let mut out = vec![ram_reading(config, snapshot)];
    for gpu in &snapshot.gpus.devices {
        let resource = Resource::Gpu(gpu.index);
        // No floors configured: no reading (an unknown total only makes the floors unknown).
        if config.gpu.floors_for(gpu.index, &gpu.uuid) == (None, None)
            && !tracked.contains(&resource)
        {
            continue;
        }
        let (warn, min) = config
            .gpu
            .floor_bytes(gpu.index, &gpu.uuid, gpu.total_bytes);
        let error = gpu
            .untrusted()
            .or_else(|| impossible_floor("min_free", min, gpu.total_bytes));
        out.push(Reading {
            resource,
            available: gpu.free_bytes.filter(|_| error.is_none()),
            warn,
            min,
            act_because: None,
            warn_because: None,
            error,
            may_act: !snapshot.gpus.stale,
            action: config.gpu.action,
            sampled_at: snapshot.gpus.sampled_at,
            short: Short::Gpu(gpu.index),
            shmem: None,
        });
    }
    // A GPU the policy was watching that NVML no longer lists: unknown, never "fine".
    for &resource in tracked {
        let Resource::Gpu(index) = resource else {
            continue;
        };
        if snapshot.gpus.devices.iter().all(|g| g.index != index) {
            out.push(Reading {
                resource,
                available: None,
                warn: None,
                min: None,
                act_because: None,
                warn_because: None,
                error: Some("no longer reported by NVML".into()),
                may_act: false,
                action: config.gpu.action,
                sampled_at: None,
                short: Short::Gpu(index),
                shmem: None,
            });
        }
    }
    out
}

/// Host RAM against its floors: MemAvailable, and swap and PSI where configured.
fn ram_reading(config: &Config, snapshot: &Snapshot) -> Reading {
    let host = &snapshot.host;
    let ram = &config.ram;
    let mut act_because = None;
    let mut warn_because = None;
    let (warn, min) = ram.floor_bytes(host.total_bytes);
    let error = host
        .inconsistency()
        .or_else(|| impossible_floor("min_available", min, host.total_bytes));
    let available = host.available_bytes.filter(|_| error.is_none());
    let mut swap_short = false;
    if let (Some(floor), Some(total), Some(free)) = (
        ram.min_swap_free,
        host.swap_total_bytes,
        host.trusted_swap_free_bytes(),
    ) {
        if let Some(floor) = floor
            .resolve(Some(total))
            .filter(|&f| total > 0 && f < total)
        {
            if free < floor {
                swap_short = true;
                act_because = Some(format!(
                    "swap free {} < min_swap_free {}",
                    bytes(free),
                    bytes(floor)
                ));
            }
        }
    }
    let psi = host
        .psi_some_avg10
        .filter(|p| p.is_finite() && (0.0..=100.0).contains(p));
    if let (Some(limit), Some(psi)) = (ram.psi_some_avg10, psi) {
        if psi > limit {
            let text = format!("PSI memory some avg10 {psi:.1}% > {limit:.1}%");
            let low = matches!((available, warn), (Some(a), Some(w)) if a < w);
            if low && act_because.is_none() {
                act_because = Some(text);
            } else {
                warn_because = Some(text);
            }
        }
    }
    let ram_short = matches!((available, min), (Some(a), Some(m)) if a < m);
    Reading {
        resource: Resource::Ram,
        available,
        warn,
        min,
        act_because,
        warn_because,
        error,
        may_act: true,
        action: ram.action,
        sampled_at: Some(snapshot.at),
        short: if swap_short && !ram_short {
            Short::Swap
        } else {
            Short::Ram
        },
        shmem: host.shmem_bytes,
    }
}

/// An act floor at or above the total would make every process a victim, always: the config
/// checks refuse it, and should one get through (a GPU seen only later), it is not enforced.
fn impossible_floor(key: &str, min: Option<u64>, total: Option<u64>) -> Option<String> {
    match (min, total) {
        (Some(m), Some(t)) if m >= t => Some(format!(
            "{key} {} is at or above the total {}: floor not enforced",
            bytes(m),
            bytes(t)
        )),
        _ => None,
    }
}

/// One floor for one tick: the level is recorded (and its change said), then the reading is
/// unknown (nothing decided), above the act floor (the incident closes) or below it (the
/// incident acts).
fn evaluate_floor_inner(
    config: &Config,
    snapshot: &Snapshot,
    state: &mut PolicyState,
    reading: &Reading,
    plan: &mut Plan,
) {
    let level = note_level(state, reading, plan);
    match level {
        // A reading that is missing says nothing about the incident: leave it as it is, except
        // that nobody stays stopped past max_stop on it.
        Level::Unknown => end_stop_at_max_stop(config, snapshot, state, reading, plan),
        Level::Ok | Level::Warn => close_incident(state, reading, plan),
        Level::Act => act(config, snapshot, state, reading, plan),
    }
}

/// Records the floor's level (and, for RAM, the Shmem baseline) and says when it changed.
fn note_level(state: &mut PolicyState, reading: &Reading, plan: &mut Plan) -> Level {
    let resource = reading.resource;
    let level = reading.level();
    let previous = state.levels.insert(resource, level);
    if resource == Resource::Ram {
        state.shmem_baseline = match (reading.shmem, state.shmem_baseline) {
            (Some(now), _) if reading.above_warn() => Some(ShmemBaseline {
                base: now,
                peak: now,
            }),
            (Some(now), Some(ShmemBaseline { base, peak })) => Some(ShmemBaseline {
                base,
                peak: peak.max(now),
            }),
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
fn close_incident(state: &mut PolicyState, reading: &Reading, plan: &mut Plan) {
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
fn act(
    config: &Config,
    snapshot: &Snapshot,
    state: &mut PolicyState,
    reading: &Reading,
    plan: &mut Plan,
) {
    let now = snapshot.at;
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
    let step = Step {
        config,
        snapshot,
        reading,
        victim: &victim,
        far_below,
        since: now.saturating_sub(incident.stage_since),
    };
    let alive = victim.any_alive(snapshot);
    match incident.stage {
        Stage::Alerted | Stage::Stuck | Stage::Throttled => {}
        Stage::Stopped | Stage::Terminated | Stage::Killed if !alive => {
            incident.stage = Stage::Gone;
            incident.stage_since = now;
        }
        Stage::Stopped if step.since >= config.daemon.settle => {
            terminate_after_stop(incident, &step, plan);
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
struct Step<'a> {
    config: &'a Config,
    snapshot: &'a Snapshot,
    reading: &'a Reading,
    victim: &'a Target,
    /// Far below the floor, confirmed by an earlier sample (`far_below_confirmed`).
    far_below: bool,
    /// How long the incident has been at its stage.
    since: Duration,
}

/// The reading is stale: says so once per incident.
fn report_stale(incident: &mut Incident, reading: &Reading, plan: &mut Plan) {
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
fn terminate_after_stop(incident: &mut Incident, step: &Step, plan: &mut Plan) {
    let reading = step.reading;
    incident.available_at_stage = reading.available;
    let verb = if step.far_below {
        Verb::Kill
    } else {
        Verb::Terminate
    };
    incident.stage = if verb == Verb::Kill {
        Stage::Killed
    } else {
        Stage::Terminated
    };
    incident.stage_since = step.snapshot.at;
    plan.actions.push(action(
        verb,
        step.victim,
        reading.kind(),
        format!(
            "{}; still below {} after stopping it",
            reading.describe(),
            humantime::format_duration(step.config.daemon.settle)
        ),
        reading.recheck(),
    ));
}

/// SIGTERM sent: SIGKILL when far below, after `term_grace`, or as soon as the victim grows
/// by more than `term_max_growth` (it is not shutting down).
fn kill_after_term(incident: &mut Incident, step: &Step, plan: &mut Plan) {
    let (snapshot, reading) = (step.snapshot, step.reading);
    let limit = step
        .config
        .daemon
        .term_max_growth
        .resolve(snapshot.host.total_bytes);
    let grown = grown_after_term(snapshot, reading.resource, incident, step.victim, limit);
    if !(step.far_below || step.since >= step.config.daemon.term_grace || grown.is_some()) {
        return;
    }
    let how = match grown {
        Some(grown) => format!(
            "its memory grew by {} after SIGTERM: it is not shutting down",
            bytes(grown)
        ),
        None => "SIGTERM not enough".to_string(),
    };
    incident.stage = Stage::Killed;
    incident.stage_since = snapshot.at;
    plan.actions.push(action(
        Verb::Kill,
        step.victim,
        reading.kind(),
        format!("{}; {how}", reading.describe()),
        reading.recheck(),
    ));
}

/// Still there `kill_timeout` after SIGKILL: stuck; no more kills for this floor.
fn survived_kill(incident: &mut Incident, step: &Step, plan: &mut Plan) {
    let resource = step.reading.resource;
    incident.stage = Stage::Stuck;
    incident.stage_since = step.snapshot.at;
    plan.events.push(event(
        Severity::Critical,
        EventKind::SurvivedKill,
        format!("{} is still there {} after SIGKILL (uninterruptible, stuck in the driver?); not killing more for {resource}", step.victim, humantime::format_duration(step.since)),
    ));
}

/// The victim is gone and this fresh sample is still below the floor. True when the next
/// victim is to be chosen; a GPU that still lists the victim's pids past `release_timeout` is
/// stuck instead (no more kills for it).
fn next_after_gone(incident: &mut Incident, step: &Step, plan: &mut Plan) -> bool {
    let resource = step.reading.resource;
    let stuck: Vec<i32> = match resource {
        Resource::Ram => Vec::new(),
        Resource::Gpu(index) => stuck_pids(step.snapshot, step.victim, index),
    };
    if stuck.is_empty() {
        incident.victims_done += 1;
        incident.victim = None;
        return true;
    }
    if step.since >= step.config.gpu.release_timeout {
        incident.stage = Stage::Stuck;
        incident.stage_since = step.snapshot.at;
        plan.events.push(event(
            Severity::Critical,
            EventKind::StuckMemory,
            format!(
                "{} exited {} ago but {resource} still lists pid(s) {stuck:?} holding memory ({}): memory stuck in the driver; not killing more for {resource}",
                step.victim,
                humantime::format_duration(step.since),
                step.reading.describe()
            ),
        ));
    }
    false
}

/// Far below the floor on this sample and on an earlier one: one sample alone (a glitch, a
/// reading caught mid-update) never earns SIGKILL without SIGTERM's grace.
fn far_below_confirmed(reading: &Reading, incident: &mut Incident) -> bool {
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
fn end_stop_at_max_stop(
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
    incident.victim = None;
    incident.stage = Stage::Alerted;
    incident.stage_since = snapshot.at;
    plan.actions.push(action(
        Verb::Resume,
        &victim,
        ReasonKind::MaxStop,
        format!(
            "stopped for {} (max_stop) while {}: resumed, never killed on a reading that cannot be trusted",
            humantime::format_duration(max_stop),
            untrusted(reading)
        ),
        None,
    ));
}

/// Why a reading may not be acted on, for messages.
fn untrusted(reading: &Reading) -> String {
    match (&reading.error, reading.may_act) {
        (Some(e), _) => format!("{} reading is unknown ({e})", reading.resource),
        (None, false) => format!("{} reading is stale", reading.resource),
        (None, true) => format!("{} reading is unknown", reading.resource),
    }
}

/// While a victim has SIGTERM, the loop ticks at least this often: a victim that ignores SIGTERM
/// shows by growing, and every millisecond of growth is memory the host does not have.
pub(super) const TERM_WATCH_INTERVAL: Duration = Duration::from_millis(2);

/// The victim's own memory now (RAM floors: RSS summed over its live processes; the daemon
/// re-reads watched victims every tick). GPU memory is sampled too seldom to watch this way.
fn victim_bytes(snapshot: &Snapshot, victim: &Target, resource: Resource) -> Option<u64> {
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
fn grown_after_term(
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
pub(super) fn evaluate_floor(
    config: &Config,
    snapshot: &Snapshot,
    state: &mut PolicyState,
    reading: &Reading,
    plan: &mut Plan,
) {
    let first = plan.events.len();
    evaluate_floor_inner(config, snapshot, state, reading, plan);
    let resource = reading.resource;
    let about = match state
        .incidents
        .get(&resource)
        .and_then(|i| i.victim.as_ref())
    {
        Some(victim) => About::target(victim, resource),
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
fn stuck_pids(snapshot: &Snapshot, victim: &Target, index: u32) -> Vec<i32> {
    let Some(gpu) = snapshot.gpus.devices.iter().find(|g| g.index == index) else {
        return Vec::new();
    };
    victim
        .members
        .iter()
        .map(|m| m.id.pid)
        .filter(|pid| matches!(gpu.processes.get(pid), Some(Some(b)) if *b > 0))
        .collect()
}

/// Chooses a victim for an open incident and takes the first step of the floor's action.
fn choose_next(
    config: &Config,
    snapshot: &Snapshot,
    state: &mut PolicyState,
    reading: &Reading,
    far_below: bool,
    plan: &mut Plan,
) {
    let resource = reading.resource;
    let now = snapshot.at;
    let why = reading.describe();
    let Brake {
        max_victims,
        window,
    } = Brake::of(config, resource);
    let signals = reading.action != FloorAction::Alert;
    // A brake that holds releases only in `release_brakes` (back above the warn floor), never
    // here on time alone.
    if signals && max_victims > 0 && state.braked.contains(&resource) {
        return;
    }
    if signals && max_victims > 0 {
        let recent = state.floor_victims.entry(resource).or_default();
        recent.retain(|v| now.saturating_sub(v.at) < window);
        if recent.len() >= max_victims as usize {
            if state.braked.insert(resource) {
                let first = recent.iter().map(|v| v.at).min().unwrap_or(now);
                let left = (first + window).saturating_sub(now);
                let shmem = match reading.shmem {
                    Some(b) if resource == Resource::Ram => format!(
                        "; Shmem is {} (tmpfs files, shared memory: no process holds it and no kill gives it back)",
                        bytes(b)
                    ),
                    _ => String::new(),
                };
                plan.events.push(event(
                    Severity::Critical,
                    EventKind::FloorBrake,
                    format!(
                        "{why}; {} victim(s) acted on for {resource} within {} did not bring it back above its warn floor: not acting on {resource} until it is back above its warn floor, and for at least {} (brake: max_victims {} per victim_window){shmem}",
                        recent.len(),
                        humantime::format_duration(window),
                        humantime::format_duration(round_secs(left)),
                        max_victims,
                    ),
                ));
            }
            return;
        }
    }
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
    let shmem_growth = shmem_shortfall(reading, state.shmem_baseline);
    let incident = state.incidents.get_mut(&resource).expect("incident exists");
    let Some(Chosen {
        target,
        used_bytes: used,
        user_total,
    }) = chosen
    else {
        if !incident.no_victim_reported {
            incident.no_victim_reported = true;
            plan.events.push(event(
                Severity::Critical,
                EventKind::NoVictim,
                format!(
                    "{why}; no process may be acted on (all protected or outside the candidates)"
                ),
            ));
        }
        return;
    };
    let what = match reading.short {
        Short::Swap => "swap".to_string(),
        _ => resource.to_string(),
    };
    let mut detail = match (user_total, target.members.first()) {
        (Some((total, count)), Some(first)) if count > 1 => format!(
            "{why}; largest eligible user of {what}: uid {}, {} in {count} processes; {} ",
            first.uid,
            bytes(total),
            match target.members.len() {
                1 => format!("its largest holds {}", bytes(used)),
                n => format!("its {n} largest hold {}", bytes(used)),
            }
        ),
        _ => format!("{why}; largest eligible user of {what}: {} ", bytes(used)),
    };
    if let Some(ShmemGrowth {
        growth,
        shortfall,
        to_warn,
    }) = shmem_growth
    {
        let unexplained = shortfall.saturating_sub(growth);
        let (enough, verdict) = if unexplained == 0 {
            // All of the shortfall is new Shmem: no process holds it. Act only on a victim whose
            // own memory alone lifts RAM back above the warn floor: a tmpfs write still under
            // way crosses the act floor by a few bytes first, and killing for that would only
            // buy the next few bytes.
            let enough = used > to_warn;
            let verdict = if enough {
                format!("acting on {target} only because its own {} alone lifts RAM above the warn floor", bytes(used))
            } else {
                format!("not acting: the first eligible candidate, {target}, holds {} of its own, not enough to lift RAM above the warn floor ({} short of it)", bytes(used), bytes(to_warn))
            };
            (enough, verdict)
        } else {
            // Part of it is new Shmem, which no kill gives back: judge only the rest. A victim
            // holding less than that rest is not what caused it (something outside the
            // candidates is), and one that cannot lift RAM above the act floor buys nothing.
            let covers = used >= unexplained;
            let lifts = used > shortfall;
            let verdict = match (covers, lifts) {
                (true, true) => format!("acting on {target} only because its own {} is at least the {} Shmem does not explain and lifts RAM above the act floor", bytes(used), bytes(unexplained)),
                (false, _) => format!("not acting: the first eligible candidate, {target}, holds {} of its own, less than the {} Shmem growth does not explain (the rest is held outside the candidates, or by nobody)", bytes(used), bytes(unexplained)),
                (true, false) => format!("not acting: the first eligible candidate, {target}, holds {} of its own, not enough to lift RAM above the act floor ({} short of it)", bytes(used), bytes(shortfall)),
            };
            (covers && lifts, verdict)
        };
        if !incident.shmem_reported {
            incident.shmem_reported = true;
            let explains = if unexplained == 0 {
                format!("more than the shortfall of {}", bytes(shortfall))
            } else {
                format!(
                    "explaining that much of the shortfall of {} ({} unexplained)",
                    bytes(shortfall),
                    bytes(unexplained)
                )
            };
            plan.events.push(event(
                Severity::Critical,
                EventKind::ShmemShortfall,
                format!(
                    "{why}; Shmem grew by {} since RAM was last above its warn floor, {explains}: memory in tmpfs files or shared memory that no process holds (look in /dev/shm and other tmpfs mounts); {verdict}",
                    bytes(growth),
                ),
            ));
        }
        if !enough {
            return;
        }
        if unexplained == 0 {
            detail.push_str(&format!(
                "(enough alone to lift RAM above the warn floor; Shmem grew by {}) ",
                bytes(growth)
            ));
        } else {
            detail.push_str(&format!(
                "(at least the {} Shmem growth of {} does not explain, and enough to lift RAM above the act floor) ",
                bytes(unexplained),
                bytes(growth)
            ));
        }
    }
    let verb = match reading.action {
        FloorAction::Alert => None,
        FloorAction::Stop => Some(Verb::Stop),
        FloorAction::Kill if far_below => Some(Verb::Kill),
        FloorAction::Kill => Some(Verb::Terminate),
    };
    if verb == Some(Verb::Terminate) && config.daemon.mode != Mode::Observe {
        if let Some(earlier) = take_terminating(state, &target, now, config.daemon.term_grace) {
            // Sent SIGTERM by an incident that closed while it shut down: the same SIGTERM goes
            // on (its grace, its growth check), no second one, and it is not a new victim for
            // the brake.
            let incident = state.incidents.get_mut(&resource).expect("incident exists");
            incident.stage = Stage::Terminated;
            incident.stage_since = earlier.since;
            incident.term_baseline = earlier.term_baseline;
            incident.available_at_stage = reading.available;
            incident.victim = Some(target);
            return;
        }
    }
    let incident = state.incidents.get_mut(&resource).expect("incident exists");
    incident.stage = match (verb, config.daemon.mode) {
        (None, _) | (_, Mode::Observe) => Stage::Alerted,
        (Some(Verb::Stop), _) => Stage::Stopped,
        (Some(Verb::Kill), _) => Stage::Killed,
        _ => Stage::Terminated,
    };
    incident.stage_since = snapshot.at;
    incident.available_at_stage = reading.available;
    incident.victim = Some(target.clone());
    let recheck = reading.recheck();
    if verb.is_some() {
        state
            .floor_victims
            .entry(resource)
            .or_default()
            .push(FloorVictim {
                at: now,
                target: target.clone(),
                done: false,
            });
    }
    match verb {
        Some(verb) => plan.actions.push(action(
            verb,
            &target,
            reading.kind(),
            detail.trim_end().to_string(),
            recheck,
        )),
        None => plan.events.push(event(
            Severity::Critical,
            EventKind::FloorVictim,
            format!("{detail}would act on {target} (action = \"alert\")"),
        )),
    }
}

/// The earlier SIGTERM of a process chosen again, if it is still within `term_grace` (taken out of
/// the list: the incident holds it now). Entries past their grace or whose processes are gone
/// are dropped on the way.
fn take_terminating(
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
struct Brake {
    max_victims: u32,
    window: Duration,
}

impl Brake {
    fn of(config: &Config, resource: Resource) -> Brake {
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

fn round_secs(d: Duration) -> Duration {
    Duration::from_secs(d.as_secs() + u64::from(d.subsec_nanos() > 0))
}

/// RAM short of its act floor while `Shmem` grew: memory no process holds explains some of it.
struct ShmemGrowth {
    /// How much `Shmem` grew since RAM was last above its warn floor (to its peak since).
    growth: u64,
    /// `min_available` - MemAvailable.
    shortfall: u64,
    /// What a victim must give back to lift RAM above the warn floor (the act floor if none).
    to_warn: u64,
}

/// RAM below its act floor by MemAvailable, and `Shmem` grown since RAM was last above its warn
/// floor (to its highest since then).
fn shmem_shortfall(reading: &Reading, baseline: Option<ShmemBaseline>) -> Option<ShmemGrowth> {
    if reading.resource != Resource::Ram || reading.short != Short::Ram {
        return None;
    }
    let (Some(available), Some(min), Some(ShmemBaseline { base, peak })) =
        (reading.available, reading.min, baseline)
    else {
        return None;
    };
    let shortfall = min.checked_sub(available).filter(|&s| s > 0)?;
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
const SHMEM_GROWTH_MIN: u64 = 64 << 20;

/// The brake's bookkeeping, before the floors choose: a resource that reads `Ok` (back above its
/// warn floor) forgets the victims before it (they helped: they do not count), and a brake that
/// holds is released (said once, as info) only on an `Ok` reading with fewer than `max_victims`
/// victims left within the window (or with the brake turned off).
pub(super) fn release_brakes(
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
                        humantime::format_duration(window)
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
pub(super) fn release_held(
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
                    humantime::format_duration(max_stop),
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
                    humantime::format_duration(max_stop),
                    held.resource
                ),
                None,
            ));
            return false;
        }
        true
    });
}
