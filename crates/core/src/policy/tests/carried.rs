//! What is in force is what was carried out: stages, budget enforcements and shared signals
//! count only once their action succeeded.

use super::*;

/// A budget's enforcement is in force only once its action was carried out: a stop that was
/// skipped (the model already gone under budget at the recheck) leaves nothing in force and is
/// decided again while the model stays over; one carried out is in force and lifted with a
/// resume. One that failed stands as decided (reported once; `apply`).
#[test]
fn a_budget_enforcement_is_in_force_only_once_carried_out() {
    let c = config(&model(
        "trainer",
        "ram = \"1GiB\"\naction = \"stop\"\ngrace = \"1s\"\n",
    ));
    let a = || vec![proc(100, "trainer", 2 * GIB, 1)];
    let none = Launches::default();
    let mut state = PolicyState::default();
    decide(&c, &snap(0, Some(20 * GIB), a()), &mut state);
    let plan = evaluate(&c, &snap(1000, Some(20 * GIB), a()), &none, &mut state);
    assert_eq!(acts(&plan), "stop trainer[100]");
    assert!(state.budgets["trainer"].enforced.is_none());
    state.apply(&carried(
        &plan,
        Outcome::Skipped("target has exited".into()),
    ));
    assert!(state.budgets["trainer"].enforced.is_none());
    // Still over: the stop is decided again and, carried out, is in force.
    let plan = decide(&c, &snap(1100, Some(20 * GIB), a()), &mut state);
    assert_eq!(acts(&plan), "stop trainer[100]");
    let enforced = state.budgets["trainer"].enforced.as_ref().map(|e| e.stage);
    assert_eq!(enforced, Some(Stage::Stopped));
    let under = || vec![proc(100, "trainer", GIB / 2, 1)];
    let plan = decide(&c, &snap(1200, Some(20 * GIB), under()), &mut state);
    assert_eq!(acts(&plan), "resume trainer[100]");
}

/// A budget's SIGKILL that fails (EPERM from a security module) stands as decided: it is
/// reported once, not decided again every tick while the model stays over budget.
#[test]
fn a_budget_kill_that_fails_is_not_decided_again_every_tick() {
    let c = config(&model(
        "trainer",
        "ram = \"1GiB\"\naction = \"kill\"\ngrace = \"1s\"\n",
    ));
    let a = || vec![proc(100, "trainer", 2 * GIB, 1)];
    let none = Launches::default();
    let mut state = PolicyState::default();
    decide(&c, &snap(0, Some(20 * GIB), a()), &mut state);
    assert_eq!(
        acts(&decide(&c, &snap(1000, Some(20 * GIB), a()), &mut state)),
        "terminate trainer[100]"
    );
    // term_grace (5 s) later: SIGKILL, which fails.
    let plan = evaluate(&c, &snap(6000, Some(20 * GIB), a()), &none, &mut state);
    assert_eq!(acts(&plan), "kill trainer[100]");
    state.apply(&carried(&plan, Outcome::Failed("permission denied".into())));
    for at in [6010, 6020, 7000] {
        let plan = decide(&c, &snap(at, Some(20 * GIB), a()), &mut state);
        assert_eq!(acts(&plan), "", "at {at} ms");
    }
}

/// Two GPUs choose the same victim in one tick (a hostile review of the outcome-entered stages):
/// the second takes up the first's SIGTERM. If that SIGTERM is skipped (the recheck found memory
/// back) neither incident is at Terminated, so neither waits out a grace for a signal never sent
/// nor SIGKILLs without one; if it fails, both let the victim go; carried out, both are at it.
#[test]
fn a_signal_two_floors_share_in_one_tick_is_theirs_only_once_carried_out() {
    let c = config(&format!(
        "[daemon]\ncandidates = \"models\"\n[gpu]\nmin_free = \"12GiB\"\n{}",
        model("srv", "")
    ));
    let s = srv_on_two_gpus;
    let none = Launches::default();
    let stages = |state: &PolicyState| {
        state
            .incidents
            .values()
            .map(|i| (i.victim.is_some(), i.stage))
            .collect::<Vec<_>>()
    };
    for (outcome, want) in [
        (
            Outcome::Skipped("recovered".into()),
            (false, Stage::Alerted),
        ),
        (
            Outcome::Failed("permission denied".into()),
            (false, Stage::Alerted),
        ),
        (Outcome::Done, (true, Stage::Terminated)),
    ] {
        let mut state = PolicyState::default();
        let plan = evaluate(&c, &s(0), &none, &mut state);
        assert_eq!(acts(&plan), "terminate srv[100,101]");
        state.apply(&carried(&plan, outcome.clone()));
        assert_eq!(stages(&state), vec![want; 2], "{outcome:?}");
        if matches!(outcome, Outcome::Failed(_)) {
            assert!(state.incidents.values().all(|i| i.excluded.len() == 2));
        }
    }
}

/// A victim stopped by a floor whose SIGTERM then fails (not permitted) is not left frozen: the
/// incident lets it go to the next victim, and it is held, to be resumed once RAM is back.
#[test]
fn a_stopped_victim_whose_sigterm_fails_is_held_and_resumed_when_ram_is_back() {
    let c = config(&format!("{RAM_FLOORS}action = \"stop\"\n"));
    let a = || {
        vec![
            proc(100, "trainer", 6 * GIB, 1),
            proc(200, "loader", 4 * GIB, 1),
        ]
    };
    let none = Launches::default();
    let mut state = PolicyState::default();
    assert_eq!(
        acts(&decide(&c, &snap(0, Some(3 * GIB), a()), &mut state)),
        "stop [100]"
    );
    let plan = evaluate(&c, &snap(2000, Some(3 * GIB), a()), &none, &mut state);
    assert_eq!(acts(&plan), "terminate [100]");
    state.apply(&carried(&plan, Outcome::Failed("permission denied".into())));
    assert_eq!(state.held.len(), 1);
    assert_eq!(state.held[0].target.members[0].id.pid, 100);
    // Still short: the next victim, not 100 again.
    let plan = decide(&c, &snap(2100, Some(3 * GIB), a()), &mut state);
    assert_eq!(acts(&plan), "stop [200]");
    // RAM back above warn: both resumed.
    let plan = decide(&c, &snap(3000, Some(20 * GIB), a()), &mut state);
    let mut resumed: Vec<(Verb, Vec<i32>)> = plan
        .actions
        .iter()
        .map(|a| (a.verb, a.target.ids().map(|id| id.pid).collect()))
        .collect();
    resumed.sort();
    assert_eq!(
        resumed,
        [(Verb::Resume, vec![100]), (Verb::Resume, vec![200])],
        "{}",
        acts(&plan)
    );
}

/// A victim two GPU floors stopped together gets one SIGTERM when `settle` runs out, not one per
/// floor (a second SIGTERM makes many servers quit without cleaning up): the second floor takes
/// up the first's step, and both are at Terminated once it is carried out.
#[test]
fn a_victim_two_floors_stopped_gets_one_sigterm_after_settle() {
    let c = config(&format!(
        "[daemon]\ncandidates = \"models\"\n[gpu]\nmin_free = \"12GiB\"\naction = \"stop\"\n{}",
        model("srv", "")
    ));
    let s = srv_on_two_gpus;
    let mut state = PolicyState::default();
    play(
        &c,
        &mut state,
        vec![
            (s(0), "stop srv[100,101]", "floor_act, floor_act"),
            (s(1000), "", ""),
            (s(2000), "terminate srv[100,101]", ""),
        ],
    );
    let stages: Vec<_> = state
        .incidents
        .values()
        .map(|i| (i.stage, i.stage_since))
        .collect();
    assert_eq!(
        stages,
        vec![(Stage::Terminated, Duration::from_millis(2000)); 2]
    );
}

/// Three GPU floors in one tick: a user's process 100 short on GPU 0, 101 on GPU 1, and both on
/// GPU 2. GPU 2's victim is covered by the other two signals together (not by either alone): no
/// empty action (it was skipped every tick, as "target has exited"), and GPU 2's incident takes
/// up their step once carried out.
#[test]
fn a_victim_covered_by_two_other_floors_together_gets_no_empty_action() {
    let c = config("[gpu]\nmin_free = \"2GiB\"\nwarn_free = \"3GiB\"\n");
    let procs = || vec![proc(100, "big", GIB, 1), proc(101, "other", GIB, 1)];
    let s = gsnap(
        0,
        procs(),
        vec![
            gpu(0, GIB, &[(100, Some(8 * GIB))]),
            gpu(1, GIB, &[(101, Some(8 * GIB))]),
            gpu(2, GIB / 2, &[(100, Some(2 * GIB)), (101, Some(GIB))]),
        ],
    );
    let mut state = PolicyState::default();
    let plan = decide(&c, &s, &mut state);
    assert_eq!(acts(&plan), "terminate [100]; terminate [101]");
    let gpu2 = &state.incidents[&Resource::Gpu(2)];
    assert_eq!(gpu2.stage, Stage::Terminated);
    assert_eq!(gpu2.victim.as_ref().map(|v| v.ids().count()), Some(2));
}
