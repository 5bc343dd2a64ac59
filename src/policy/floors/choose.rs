//! Choosing the next victim of an incident, under the brake and the Shmem rule; and what the
//! floors do between incidents (brakes released, stopped processes held or let go).

use super::*;

/// Chooses a victim for an open incident and takes the first step of the floor's action.
pub(in crate::policy) fn choose_next(
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
pub(in crate::policy) struct ShmemGrowth {
    /// How much `Shmem` grew since RAM was last above its warn floor (to its peak since).
    growth: u64,
    /// `min_available` - MemAvailable.
    shortfall: u64,
    /// What a victim must give back to lift RAM above the warn floor (the act floor if none).
    to_warn: u64,
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
