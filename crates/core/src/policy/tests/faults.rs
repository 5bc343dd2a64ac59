//! Faults and bad values (issue #13): an untrusted reading may alert, never act.

use super::*;

#[test]
fn inconsistent_gpu_readings_are_unknown_and_never_act() {
    let c = config("[gpu]\nmin_free = \"2GiB\"\n");
    let procs = || vec![proc(100, "vllm", GIB, 1)];
    let holds = [(100, Some(8 * GIB))];
    let used_over_total = Gpu {
        used_bytes: Some(20 * GIB),
        free_bytes: Some(0),
        ..gpu(0, 0, &holds)
    };
    let process_over_total = gpu(0, GIB, &[(100, Some(40 * GIB))]);
    let sum_far_from_total = Gpu {
        used_bytes: Some(GIB),
        free_bytes: Some(GIB),
        ..gpu(0, GIB, &holds)
    };
    let free_over_total = Gpu {
        used_bytes: None,
        free_bytes: Some(17 * GIB),
        ..gpu(0, GIB, &holds)
    };
    for (name, bad) in [
        ("used > total", used_over_total),
        ("process > total", process_over_total),
        ("used + free far from total", sum_far_from_total),
        ("free > total", free_over_total),
    ] {
        assert!(bad.inconsistency().is_some(), "{name}");
        let mut state = PolicyState::default();
        for at in [0, 100, 200] {
            let s = gsnap(at, procs(), vec![bad.clone()]);
            let plan = decide(&c, &s, &mut state);
            assert_eq!(acts(&plan), "", "{name}");
            // Unknown because of the inconsistency, said about GPU 0.
            let r = reading(&c, &s, Resource::Gpu(0));
            assert_eq!(
                (r.available, r.error),
                (None, bad.inconsistency()),
                "{name}"
            );
            if at == 0 {
                assert_eq!(events(&plan), "reading_unknown", "{name}");
                assert_eq!(plan.events[0].about.resource, Some(Resource::Gpu(0)));
            }
        }
    }
    // Within the slack (1/64 of the total) a reading is consistent.
    let close = Gpu {
        used_bytes: Some(15 * GIB),
        free_bytes: Some(GIB - 100 * MIB),
        ..gpu(0, GIB, &holds)
    };
    assert_eq!(close.inconsistency(), None);
    // A process above the total also makes the GPU's usage unknown for budgets.
    let c = config(&model(
        "vllm",
        "gpu_memory = \"4GiB\"\naction = \"kill\"\ngrace = \"0s\"\n",
    ));
    let plan = once(
        &c,
        &gsnap(0, procs(), vec![gpu(0, GIB, &[(100, Some(40 * GIB))])]),
    );
    assert_eq!(acts(&plan), "");
}

#[test]
fn mem_available_above_mem_total_is_unknown() {
    let c = config(RAM_FLOORS);
    let mut s = snap(0, Some(GIB), vec![proc(100, "trainer", 6 * GIB, 1)]);
    s.host.total_bytes = Some(512 * MIB);
    let plan = once(&c, &s);
    assert_eq!(
        (acts(&plan).as_str(), events(&plan).as_str()),
        ("", "reading_unknown")
    );
    let r = reading(&c, &s, Resource::Ram);
    assert!(s.host.inconsistency().is_some());
    assert_eq!((r.available, r.error), (None, s.host.inconsistency()));
}

#[test]
fn a_floor_at_or_above_the_total_is_not_enforced() {
    // What the config checks refuse, should it get through (a GPU seen only later).
    let c = config("[gpu]\nmin_free = \"20GiB\"\n");
    let s = gsnap(
        0,
        vec![proc(100, "vllm", GIB, 1)],
        vec![gpu(0, 8 * GIB, &[(100, Some(8 * GIB))])],
    );
    let plan = once(&c, &s);
    assert_eq!(
        (acts(&plan).as_str(), events(&plan).as_str()),
        ("", "reading_unknown")
    );
    // The GPU's reading is fine: the floor, at or above its 16 GiB, is what is unknown.
    assert_eq!(s.gpus.devices[0].untrusted(), None);
    let r = reading(&c, &s, Resource::Gpu(0));
    assert_eq!((r.available, r.min), (None, Some(20 * GIB)));
    assert!(r.error.is_some());
}

/// The floor events follow the floor's level, `unknown` included, not whether a floor is
/// crossed (what the conditions in src/daemon/alerts.rs report): a reading that turns unknown and
/// comes back clears the floor although none was crossed, a crossed floor whose reading turns
/// unknown is not cleared, and easing from act to warn says nothing. (Why the conditions do not
/// write these events: src/daemon/alerts.rs's module doc.)
#[test]
fn floor_events_follow_the_level_unknown_included() {
    let c = config("[gpu]\nmin_free = \"2GiB\"\nwarn_free = \"3GiB\"\n[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n");
    let at = |free| vec![gpu(0, free, &[])];
    let lost = || {
        vec![Gpu {
            error: Some("GPU is lost".into()),
            lost: true,
            ..gpu(0, 8 * GIB, &[])
        }]
    };
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (gsnap(0, vec![], at(8 * GIB)), "", ""),
            (gsnap(1000, vec![], lost()), "", "reading_unknown"),
            (gsnap(2000, vec![], at(8 * GIB)), "", "floor_cleared"),
            (gsnap(3000, vec![], at(GIB)), "", "floor_act, no_victim"),
            (gsnap(4000, vec![], lost()), "", "reading_unknown"),
            (gsnap(5000, vec![], at(5 * GIB / 2)), "", "floor_warn"),
            (gsnap(6000, vec![], at(GIB)), "", "floor_act, no_victim"),
            (gsnap(7000, vec![], at(5 * GIB / 2)), "", ""),
            (gsnap(8000, vec![], at(8 * GIB)), "", "floor_cleared"),
        ],
    );
}

#[test]
fn below_a_floor_before_the_first_process_scan_waits_for_it_instead_of_saying_no_victim() {
    // Seen on a real H100: the daemon started with the GPU below min_free, and its first tick
    // (no process scan yet) raised a critical `no_victim` 82 ms before it chose the victim.
    let c = config("[gpu]\nmin_free = \"2GiB\"\n");
    let unscanned = |at_ms| Snapshot {
        processes: ProcessTable::default(),
        ..gsnap(at_ms, vec![], vec![gpu(0, GIB, &[(100, Some(4 * GIB))])])
    };
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (unscanned(0), "", "floor_act"),
            (
                gsnap(
                    100,
                    vec![proc(100, "python3", GIB, 1)],
                    vec![gpu(0, GIB, &[(100, Some(4 * GIB))])],
                ),
                "terminate [100]",
                "",
            ),
        ],
    );
}

#[test]
fn a_stopped_victim_is_resumed_at_max_stop_when_its_gpu_is_lost() {
    let c = config(GPU_STOP);
    let procs = || vec![proc(100, "vllm", GIB, 1)];
    let low = || gpu(0, GIB, &[(100, Some(8 * GIB))]);
    let lost = || Gpu {
        error: Some("GPU is lost".into()),
        lost: true,
        ..low()
    };
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (gsnap(0, procs(), vec![low()]), "stop [100]", "floor_act"),
            (gsnap(1000, procs(), vec![lost()]), "", "reading_unknown"),
            (gsnap(9999, procs(), vec![lost()]), "", ""),
            // max_stop: resumed, not killed, although the floor was crossed when it was stopped.
            (gsnap(10000, procs(), vec![lost()]), "resume [100]", ""),
            (gsnap(20000, procs(), vec![lost()]), "", ""),
        ],
    );
    // The GPU vanishes from NVML's list altogether: the same.
    let plans = play(
        &c,
        &mut PolicyState::default(),
        vec![
            (gsnap(0, procs(), vec![low()]), "stop [100]", "floor_act"),
            (gsnap(1000, procs(), vec![]), "", "reading_unknown"),
            (gsnap(10000, procs(), vec![]), "resume [100]", ""),
        ],
    );
    assert_eq!(plans[2].actions[0].reason.kind, "max_stop");
    // What it was resumed on: a GPU 0 reading that may not act (NVML no longer lists it).
    let r = reading(&c, &gsnap(10000, procs(), vec![]), Resource::Gpu(0));
    assert_eq!((r.available, r.may_act), (None, false));
}

#[test]
fn a_stopped_victim_is_resumed_at_max_stop_when_its_gpu_reading_goes_stale() {
    let c = config(GPU_STOP);
    let procs = || vec![proc(100, "vllm", GIB, 1)];
    let s = |at, stale| {
        let mut s = gsnap(at, procs(), vec![gpu(0, GIB, &[(100, Some(8 * GIB))])]);
        s.gpus.stale = stale;
        s
    };
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (s(0, false), "stop [100]", "floor_act"),
            (s(1000, true), "", "not_acting_stale"),
            (s(10000, true), "resume [100]", ""),
        ],
    );
}

#[test]
fn a_held_process_is_resumed_not_killed_at_max_stop_on_an_unknown_reading() {
    let c = config(GPU_STOP);
    let procs = || vec![proc(100, "vllm", GIB, 1)];
    let holds = [(100, Some(8 * GIB))];
    let mut state = PolicyState::default();
    play(
        &c,
        &mut state,
        vec![
            (
                gsnap(0, procs(), vec![gpu(0, GIB, &holds)]),
                "stop [100]",
                "floor_act",
            ),
            // Between the floors: the incident closes, the victim is held.
            (
                gsnap(1000, procs(), vec![gpu(0, 5 * GIB / 2, &holds)]),
                "",
                "incident_closed",
            ),
            (gsnap(2000, procs(), vec![]), "", "reading_unknown"),
            (gsnap(10000, procs(), vec![]), "resume [100]", ""),
        ],
    );
    assert!(state.held.is_empty());
    // With a reading that may act and is still below warn, max_stop kills as before.
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (
                gsnap(0, procs(), vec![gpu(0, GIB, &holds)]),
                "stop [100]",
                "floor_act",
            ),
            (
                gsnap(1000, procs(), vec![gpu(0, 5 * GIB / 2, &holds)]),
                "",
                "incident_closed",
            ),
            (
                gsnap(10000, procs(), vec![gpu(0, 5 * GIB / 2, &holds)]),
                "kill [100]",
                "",
            ),
        ],
    );
}

#[test]
fn a_budget_stop_is_resumed_not_killed_at_max_stop_on_a_stale_gpu_reading() {
    let c = config(&format!(
        "[daemon]\nmax_stop = \"10s\"\n{}",
        model(
            "vllm",
            "gpu_memory = \"4GiB\"\naction = \"stop\"\ngrace = \"0s\"\n"
        )
    ));
    let procs = || vec![proc(100, "vllm", GIB, 1)];
    let s = |at, stale| {
        let mut s = gsnap(at, procs(), vec![gpu(0, 4 * GIB, &[(100, Some(8 * GIB))])]);
        s.gpus.stale = stale;
        s
    };
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (s(0, false), "stop vllm[100]", "budget_exceeded"),
            (s(5000, true), "", ""),
            (s(10000, true), "resume vllm[100]", ""),
            // Still stale: not stopped again.
            (s(11000, true), "", ""),
        ],
    );
}
