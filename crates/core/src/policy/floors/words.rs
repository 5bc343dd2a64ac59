//! The floors' decisions in English: what `choose` decided (`Choice`) becomes the events and the
//! action's reason that logs, the event log and webhooks carry. Nothing here decides.

use super::*;

/// The brake engaged (critical `floor_brake`).
pub(in crate::policy) fn braked(reading: &Reading, b: &BrakeEngaged) -> Event {
    let resource = reading.resource;
    let shmem = match b.shmem {
        Some(s) => format!(
            "; Shmem is {} (tmpfs files, shared memory: no process holds it and no kill gives it back)",
            bytes(s)
        ),
        None => String::new(),
    };
    event(
        Severity::Critical,
        EventKind::FloorBrake,
        format!(
            "{}; {} victim(s) acted on for {resource} within {} did not bring it back above its warn floor: not acting on {resource} until it is back above its warn floor, and for at least {} (brake: max_victims {} per victim_window){shmem}",
            reading.describe(),
            b.victims,
            crate::units::fmt_duration(b.window),
            crate::units::fmt_duration(round_secs(b.left)),
            b.max_victims,
        ),
    )
}

/// Nobody may be acted on (critical `no_victim`).
pub(in crate::policy) fn no_victim(reading: &Reading) -> Event {
    event(
        Severity::Critical,
        EventKind::NoVictim,
        format!(
            "{}; no process may be acted on (all protected or outside the candidates)",
            reading.describe()
        ),
    )
}

/// The Shmem rule applied (critical `shmem_shortfall`): how much Shmem explains, and the verdict
/// on the first candidate.
pub(in crate::policy) fn shmem_shortfall(reading: &Reading, v: &ShmemVerdict) -> Event {
    let ShmemGrowth {
        growth,
        shortfall,
        to_warn,
    } = v.growth;
    let (target, used, unexplained) = (&v.target, bytes(v.used), bytes(v.unexplained));
    let explains = if v.unexplained == 0 {
        format!("more than the shortfall of {}", bytes(shortfall))
    } else {
        format!(
            "explaining that much of the shortfall of {} ({unexplained} unexplained)",
            bytes(shortfall)
        )
    };
    let verdict = match v.judgement {
        Judgement::LiftsAboveWarn => format!(
            "acting on {target} only because its own {used} alone lifts RAM above the warn floor"
        ),
        Judgement::TooSmallForWarn => format!(
            "not acting: the first eligible candidate, {target}, holds {used} of its own, not enough to lift RAM above the warn floor ({} short of it)",
            bytes(to_warn)
        ),
        Judgement::CoversTheRest => format!(
            "acting on {target} only because its own {used} is at least the {unexplained} Shmem does not explain and lifts RAM above the act floor"
        ),
        Judgement::LessThanTheRest => format!(
            "not acting: the first eligible candidate, {target}, holds {used} of its own, less than the {unexplained} Shmem growth does not explain (the rest is held outside the candidates, or by nobody)"
        ),
        Judgement::CannotLift => format!(
            "not acting: the first eligible candidate, {target}, holds {used} of its own, not enough to lift RAM above the act floor ({} short of it)",
            bytes(shortfall)
        ),
        Judgement::OwnsTheFiles => format!(
            "acting on {target} (its own {used}): its account owns the tmpfs files that made RAM short"
        ),
    };
    let owners = if v.owners.is_empty() {
        String::new()
    } else {
        let list: Vec<String> = v
            .owners
            .iter()
            .map(|(uid, b)| format!("uid {uid} {}", bytes(*b)))
            .collect();
        format!("; tmpfs files by owner: {}", list.join(", "))
    };
    event(
        Severity::Critical,
        EventKind::ShmemShortfall,
        format!(
            "{}; Shmem grew by {} since RAM was last above its warn floor, {explains}: memory in tmpfs files or shared memory that no process holds (look in /dev/shm and other tmpfs mounts){owners}; {verdict}",
            reading.describe(),
            bytes(growth),
        ),
    )
}

/// Memory outside every model made the GPU short (critical `outside_shortfall`): the models
/// within their budgets are left alone.
pub(in crate::policy) fn outside_shortfall(reading: &Reading, v: &OutsideVerdict) -> Event {
    event(
        Severity::Critical,
        EventKind::OutsideShortfall,
        format!(
            "{}; memory held outside every model grew by {} since {} was last above its warn floor ({} now), at least the shortfall of {}: not acting on {}, within its budget (candidates = \"models\"; look at the GPU's processes outside the models)",
            reading.describe(),
            bytes(v.growth),
            reading.resource,
            bytes(v.outside),
            bytes(v.shortfall),
            v.target
        ),
    )
}

/// Why the victim: the reading, what it (or its user) holds, and the Shmem rule's reason.
pub(in crate::policy) fn victim(reading: &Reading, v: &Victim) -> String {
    let what = match reading.short {
        Short::Swap => "swap".to_string(),
        _ => reading.resource.to_string(),
    };
    let why = reading.describe();
    let mut detail = match (v.user_total, v.target.members.first()) {
        (Some((total, count)), Some(first)) if count > 1 => format!(
            "{why}; largest eligible user of {what}: uid {}, {} in {count} processes; {}",
            first.uid,
            bytes(total),
            match v.target.members.len() {
                1 => format!("its largest holds {}", bytes(v.used)),
                n => format!("its {n} largest hold {}", bytes(v.used)),
            }
        ),
        _ => format!("{why}; largest eligible user of {what}: {}", bytes(v.used)),
    };
    match &v.shmem {
        Some(s) if s.judgement == Judgement::OwnsTheFiles => detail.push_str(&format!(
            " (its account owns the tmpfs files Shmem grew by {})",
            bytes(s.growth.growth)
        )),
        Some(s) if s.unexplained == 0 => detail.push_str(&format!(
            " (enough alone to lift RAM above the warn floor; Shmem grew by {})",
            bytes(s.growth.growth)
        )),
        Some(s) => detail.push_str(&format!(
            " (at least the {} Shmem growth of {} does not explain, and enough to lift RAM above the act floor)",
            bytes(s.unexplained),
            bytes(s.growth.growth)
        )),
        None => {}
    }
    if v.despite_brake {
        detail.push_str(
            " (the brake holds, but this victim alone lifts it above its act floor: the brake is only for victims that cannot)",
        );
    }
    detail
}

/// Why SIGKILL after SIGTERM: the reading, and the victim's growth or SIGTERM not being enough.
pub(in crate::policy) fn kill_after_term(reading: &Reading, why: AfterTerm) -> String {
    let how = match why {
        AfterTerm::Grew(grown) => format!(
            "its memory grew by {} after SIGTERM: it is not shutting down",
            bytes(grown)
        ),
        AfterTerm::FarBelow | AfterTerm::GraceOver => "SIGTERM not enough".to_string(),
    };
    format!("{}; {how}", reading.describe())
}

/// `action = "alert"`: the victim it would act on (critical `floor_victim`).
pub(in crate::policy) fn would_act(detail: &str, target: &Target) -> Event {
    event(
        Severity::Critical,
        EventKind::FloorVictim,
        format!("{detail} would act on {target} (action = \"alert\")"),
    )
}
