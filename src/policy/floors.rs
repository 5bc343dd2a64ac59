//! Floors: host RAM (MemAvailable, swap, PSI) and each GPU's free memory. Crossing the act floor
//! opens an incident that acts on one victim at a time and escalates; the incident closes when
//! the resource is back above the floor.

use std::time::Duration;

use crate::config::{Config, FloorAction, Mode};
use crate::snapshot::Snapshot;

use super::victim;
use super::{
    action, bytes, event, About, Held, Incident, Level, Plan, PolicyState, Recheck, Resource,
    Severity, Stage, Target, Verb,
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
        text
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

    fn kind(&self) -> &'static str {
        match self.resource {
            Resource::Ram => "ram_floor",
            Resource::Gpu(_) => "gpu_floor",
        }
    }
}

/// The readings of this snapshot, with their floors resolved against the totals.
pub(super) fn readings(config: &Config, snapshot: &Snapshot) -> Vec<Reading> {
    let host = &snapshot.host;
    let ram = &config.ram;
    let mut act_because = None;
    let mut warn_because = None;
    if let (Some(floor), Some(total), Some(free)) = (
        ram.min_swap_free,
        host.swap_total_bytes,
        host.swap_free_bytes,
    ) {
        if let Some(floor) = floor.resolve(Some(total)).filter(|_| total > 0) {
            if free < floor {
                act_because = Some(format!(
                    "swap free {} < min_swap_free {}",
                    bytes(free),
                    bytes(floor)
                ));
            }
        }
    }
    let (warn, min) = ram.floor_bytes(host.total_bytes);
    if let (Some(limit), Some(psi)) = (ram.psi_some_avg10, host.psi_some_avg10) {
        if psi > limit {
            let text = format!("PSI memory some avg10 {psi:.1}% > {limit:.1}%");
            let low = matches!((host.available_bytes, warn), (Some(a), Some(w)) if a < w);
            if low && act_because.is_none() {
                act_because = Some(text);
            } else {
                warn_because = Some(text);
            }
        }
    }
    let mut out = vec![Reading {
        resource: Resource::Ram,
        available: host.available_bytes,
        warn,
        min,
        act_because,
        warn_because,
        error: None,
        may_act: true,
        action: ram.action,
    }];
    for gpu in &snapshot.gpus.devices {
        // No floors configured: no reading (an unknown total only makes the floors unknown).
        if config.gpu.floors_for(gpu.index, &gpu.uuid) == (None, None) {
            continue;
        }
        let (warn, min) = config
            .gpu
            .floor_bytes(gpu.index, &gpu.uuid, gpu.total_bytes);
        out.push(Reading {
            resource: Resource::Gpu(gpu.index),
            available: gpu.free_bytes.filter(|_| gpu.error.is_none()),
            warn,
            min,
            act_because: None,
            warn_because: None,
            error: gpu.error.clone(),
            may_act: !snapshot.gpus.stale,
            action: config.gpu.action,
        });
    }
    out
}

fn evaluate_floor_inner(
    config: &Config,
    snapshot: &Snapshot,
    state: &mut PolicyState,
    reading: &Reading,
    plan: &mut Plan,
) {
    let now = snapshot.at;
    let resource = reading.resource;
    let level = reading.level();
    let previous = state.levels.insert(resource, level);
    if previous != Some(level) {
        let text = reading.describe();
        match level {
            Level::Unknown => plan.events.push(event(
                Severity::Warning,
                "reading_unknown",
                format!("{text}: not acting on {resource} until it reads again"),
            )),
            Level::Warn if previous < Some(Level::Warn) => {
                plan.events
                    .push(event(Severity::Warning, "floor_warn", text))
            }
            Level::Act => plan
                .events
                .push(event(Severity::Critical, "floor_act", text)),
            Level::Ok if previous.is_some() => {
                plan.events
                    .push(event(Severity::Info, "floor_cleared", text))
            }
            _ => {}
        }
    }

    // A reading that is missing says nothing about the incident: leave it as it is.
    if level == Level::Unknown {
        return;
    }
    if level != Level::Act {
        if let Some(incident) = state.incidents.remove(&resource) {
            if let (Some(victim), Stage::Stopped) = (&incident.victim, incident.stage) {
                state.held.push(Held {
                    target: victim.clone(),
                    resource,
                    since: incident.stage_since,
                });
            }
            if incident.victim.is_some() {
                plan.events.push(event(
                    Severity::Info,
                    "incident_closed",
                    format!("{resource} back above its act floor ({}); incident over after {} victim(s)", reading.describe(), incident.victims_done + 1),
                ));
            }
        }
        return;
    }

    let incident = state.incidents.entry(resource).or_insert(Incident {
        opened_at: now,
        victim: None,
        stage: Stage::Alerted,
        stage_since: now,
        victims_done: 0,
        no_victim_reported: false,
        stale_reported: false,
        excluded: Vec::new(),
        available_at_stage: None,
    });
    if !reading.may_act {
        if !incident.stale_reported {
            incident.stale_reported = true;
            plan.events.push(event(
                Severity::Warning,
                "not_acting_stale",
                format!(
                    "{}: the reading is stale, alerting only",
                    reading.describe()
                ),
            ));
        }
        return;
    }
    let since = now.saturating_sub(incident.stage_since);
    let recheck = reading.recheck();
    let why = reading.describe();
    let d = &config.daemon;

    let Some(victim) = incident.victim.clone() else {
        choose_next(config, snapshot, state, reading, plan);
        return;
    };
    let alive = victim.any_alive(snapshot);
    match incident.stage {
        Stage::Alerted | Stage::Stuck | Stage::Throttled => {}
        Stage::Stopped | Stage::Terminated | Stage::Killed if !alive => {
            incident.stage = Stage::Gone;
            incident.stage_since = now;
        }
        Stage::Stopped if since >= d.settle => {
            incident.available_at_stage = reading.available;
            let verb = if reading.far_below() {
                Verb::Kill
            } else {
                Verb::Terminate
            };
            incident.stage = if verb == Verb::Kill {
                Stage::Killed
            } else {
                Stage::Terminated
            };
            incident.stage_since = now;
            plan.actions.push(action(
                verb,
                &victim,
                reading.kind(),
                format!(
                    "{why}; still below {} after stopping it",
                    humantime::format_duration(d.settle)
                ),
                recheck,
            ));
        }
        Stage::Terminated
            if reading.far_below() || since >= d.term_grace || kept_falling(reading, incident) =>
        {
            let how = if kept_falling(reading, incident) {
                format!(
                    "memory kept falling by more than {} after SIGTERM",
                    bytes(KEPT_FALLING_BYTES)
                )
            } else {
                "SIGTERM not enough".to_string()
            };
            incident.stage = Stage::Killed;
            incident.stage_since = now;
            plan.actions.push(action(
                Verb::Kill,
                &victim,
                reading.kind(),
                format!("{why}; {how}"),
                recheck,
            ));
        }
        Stage::Killed if since >= d.kill_timeout => {
            incident.stage = Stage::Stuck;
            incident.stage_since = now;
            plan.events.push(event(
                Severity::Critical,
                "survived_kill",
                format!("{victim} is still there {} after SIGKILL (uninterruptible, stuck in the driver?); not killing more for {resource}", humantime::format_duration(since)),
            ));
        }
        Stage::Gone => {
            let stuck: Vec<i32> = match resource {
                Resource::Ram => Vec::new(),
                Resource::Gpu(index) => stuck_pids(snapshot, &victim, index),
            };
            if stuck.is_empty() {
                // The victim is gone and this fresh sample is still below the floor: next one.
                incident.victims_done += 1;
                incident.victim = None;
                choose_next(config, snapshot, state, reading, plan);
            } else if since >= config.gpu.release_timeout {
                incident.stage = Stage::Stuck;
                incident.stage_since = now;
                plan.events.push(event(
                    Severity::Critical,
                    "stuck_memory",
                    format!(
                        "{victim} exited {} ago but {resource} still lists pid(s) {stuck:?} holding memory ({why}): memory stuck in the driver; not killing more for {resource}",
                        humantime::format_duration(since)
                    ),
                ));
            }
        }
        _ => {}
    }
}

/// After SIGTERM a victim that heeds it stops growing at once; one that keeps memory falling
/// by more than this is ignoring it, and gets SIGKILL without waiting out `term_grace`.
const KEPT_FALLING_BYTES: u64 = 64 << 20;

fn kept_falling(reading: &Reading, incident: &Incident) -> bool {
    matches!((reading.available, incident.available_at_stage), (Some(now), Some(then)) if then.saturating_sub(now) > KEPT_FALLING_BYTES)
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
    plan: &mut Plan,
) {
    let resource = reading.resource;
    let excluded = state
        .incidents
        .get(&resource)
        .map(|i| i.excluded.clone())
        .unwrap_or_default();
    let chosen = victim::choose(config, snapshot, state, resource, &excluded);
    let incident = state.incidents.get_mut(&resource).expect("incident exists");
    let why = reading.describe();
    let Some((target, used)) = chosen else {
        if !incident.no_victim_reported {
            incident.no_victim_reported = true;
            plan.events.push(event(
                Severity::Critical,
                "no_victim",
                format!(
                    "{why}; no process may be acted on (all protected or outside the candidates)"
                ),
            ));
        }
        return;
    };
    let detail = format!(
        "{why}; largest eligible user of {resource}: {} ",
        bytes(used)
    );
    let verb = match reading.action {
        FloorAction::Alert => None,
        FloorAction::Stop => Some(Verb::Stop),
        FloorAction::Kill if reading.far_below() => Some(Verb::Kill),
        FloorAction::Kill => Some(Verb::Terminate),
    };
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
            "floor_victim",
            format!("{detail}would act on {target} (action = \"alert\")"),
        )),
    }
}

/// Floor-stopped processes whose incident has closed: resume once the resource is back to `Ok`,
/// kill once they have been stopped for `max_stop`.
pub(super) fn release_held(
    config: &Config,
    snapshot: &Snapshot,
    state: &mut PolicyState,
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
                "cleared",
                format!("{} is back above its warn floor", held.resource),
                None,
            ));
            return false;
        }
        if now.saturating_sub(held.since) >= max_stop {
            plan.actions.push(action(
                Verb::Kill,
                &held.target,
                "max_stop",
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
