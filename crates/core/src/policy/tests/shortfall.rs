//! What the RAM floor's victim is judged by: the brake on a cascade of kills, shared memory
//! and tmpfs files beside the shortfall, memory outside the models, PSS per account.

use super::*;

/// The red-team cascade: memory no process holds (a tmpfs file whose writer has exited) keeps
/// RAM under the floor; each kill lifts it a little (above the act floor, never above the warn
/// floor), the incident closes, the next crossing opens another. The brake counts those victims
/// across incidents: at `max_victims` within `victim_window` it stops acting and says so once
/// (critical, naming Shmem), whatever the re-crossings. It does not release on time alone: not
/// while RAM is short past the window, not when RAM is back above the warn floor within the
/// window, only on a reading above the warn floor once the window has passed (info event).
#[test]
fn the_brake_caps_a_cascade_and_releases_only_above_the_warn_floor_after_the_window() {
    let c = config(&format!(
        "{RAM_FLOORS}max_victims = 2\nvictim_window = \"1m\"\n"
    ));
    let all = [
        proc(100, "a", 800 * MIB, 1),
        proc(200, "b", 600 * MIB, 1),
        proc(300, "c", 400 * MIB, 1),
        proc(400, "d", 200 * MIB, 1),
    ];
    let from =
        |pid: i32| -> Vec<Process> { all.iter().filter(|p| p.pid >= pid).cloned().collect() };
    let low = Some(3 * GIB);
    // Above the act floor (4 GiB), under the warn floor (8 GiB): the kills did not end it.
    let lifted = Some(5 * GIB);
    let ok = Some(9 * GIB);
    // Shmem does not move (written before the daemon looked): only the brake stops the cascade.
    let s = |at, available, procs| with_shmem(snap(at, available, procs), 10 * GIB);
    let mut state = PolicyState::default();
    let plans = play(
        &c,
        &mut state,
        vec![
            (s(0, low, from(100)), "terminate [100]", "floor_act"),
            // Its death lifts RAM above the act floor: the incident is over after one victim...
            (s(100, lifted, from(200)), "", "incident_closed"),
            // ...and the next crossing is a new incident, which may act again: a second victim.
            (s(200, low, from(200)), "terminate [200]", "floor_act"),
            (s(300, lifted, from(300)), "", "incident_closed"),
            // A third crossing within the window: the brake holds, said once.
            (s(400, low, from(300)), "", "floor_act, floor_brake"),
            (s(500, low, from(300)), "", ""),
            // Recovering and crossing again does not reset the count.
            (s(600, lifted, from(300)), "", ""),
            (s(700, low, from(300)), "", "floor_act"),
            // Back above the warn floor within the window: the brake still holds...
            (s(800, ok, from(300)), "", "floor_cleared"),
            (s(900, low, from(300)), "", "floor_act"),
            (s(59_999, low, from(300)), "", ""),
            // ...and so it does past the window while RAM is still short (the tmpfs file is
            // still there: the old brake let the cascade resume here)...
            (s(60_000, low, from(300)), "", ""),
            (s(120_000, low, from(300)), "", ""),
            (s(121_000, lifted, from(300)), "", ""),
            // ...until RAM reads above its warn floor after the window: released.
            (s(122_000, ok, from(300)), "", "floor_brake, floor_cleared"),
            // A new incident starts a fresh count: two victims, then the brake holds anew.
            (s(123_000, low, from(300)), "terminate [300]", "floor_act"),
            (s(123_100, low, from(400)), "", ""),
            (s(124_100, low, from(400)), "terminate [400]", ""),
            (s(124_200, low, vec![]), "", ""),
            (s(125_200, low, vec![]), "", "floor_brake"),
        ],
    );
    assert_eq!(plans[4].events[1].severity, Severity::Critical);
    // What engaged it: the 2 victims within the 1 minute window (the first 400 ms ago), with
    // Shmem at 10 GiB. The same ticks again, up to the choice.
    let mut again = PolicyState::default();
    for (at, available, pids) in [
        (0, low, 100),
        (100, lifted, 200),
        (200, low, 200),
        (300, lifted, 300),
    ] {
        decide(&c, &s(at, available, from(pids)), &mut again);
    }
    match ram_choice(&c, &s(400, low, from(300)), &mut again) {
        floors::Choice::Braked(Some(b)) => assert_eq!(
            (b.victims, b.max_victims, b.window, b.left, b.shmem),
            (
                2,
                2,
                Duration::from_secs(60),
                Duration::from_millis(59_600),
                Some(10 * GIB)
            )
        ),
        other => panic!("{other:?}"),
    }
    // While braked, no rush to rescan for a victim it will not take.
    assert_eq!(plans[5].max_scan_age, NEAR_FLOOR_SCAN_AGE);
    let released = &plans[14].events[0];
    assert_eq!(
        (released.kind, released.severity, released.about.resource),
        (EventKind::FloorBrake, Severity::Info, Some(Resource::Ram))
    );
    assert_eq!(plans[19].events[0].severity, Severity::Critical);
    assert!(state.braked.contains(&Resource::Ram));
}

/// Kills after which RAM came back above its warn floor helped: they do not count towards the
/// brake. The red team's brake exhaustion (an attacker's own processes crossing the floor one
/// after another, each kill giving its memory back) uses nothing up, and the next hog is still
/// acted on; with `max_victims = 2`, five such victims in a row are all taken.
#[test]
fn victims_whose_kill_lifted_ram_above_the_warn_floor_do_not_count_towards_the_brake() {
    let c = config(&format!(
        "{RAM_FLOORS}max_victims = 2\nvictim_window = \"1m\"\n"
    ));
    let mut state = PolicyState::default();
    for (i, pid) in [100, 200, 300, 400, 500].into_iter().enumerate() {
        let at = i as u64 * 1000;
        let hog = vec![proc(pid, "sacrifice", 3 * GIB, 1)];
        let plan = decide(&c, &snap(at, Some(3 * GIB), hog), &mut state);
        assert_eq!(
            (acts(&plan), events(&plan)),
            (format!("terminate [{pid}]"), "floor_act".to_string())
        );
        assert_eq!(state.floor_victims[&Resource::Ram].len(), 1);
        // It is gone and gave its 3 GiB back: RAM is above the warn floor.
        let plan = decide(&c, &snap(at + 500, Some(9 * GIB), vec![]), &mut state);
        assert!(said(&plan, EventKind::FloorCleared), "{}", events(&plan));
        assert!(state.floor_victims[&Resource::Ram].is_empty());
    }
    assert!(state.braked.is_empty());
}

/// An action the executor skipped (the victim had gone, RAM recovered) or could not carry out
/// signalled nobody: it does not count towards the brake. One carried out does.
#[test]
fn only_victims_actually_acted_on_count_towards_the_brake() {
    let c = config(&format!("{RAM_FLOORS}max_victims = 1\n"));
    let procs = || vec![proc(100, "a", 800 * MIB, 1), proc(200, "b", 600 * MIB, 1)];
    let mut state = PolicyState::default();
    let none = Launches::default();
    let plan = evaluate(&c, &snap(0, Some(3 * GIB), procs()), &none, &mut state);
    assert_eq!(acts(&plan), "terminate [100]");
    state.apply(&carried(
        &plan,
        Outcome::Skipped("target has exited".into()),
    ));
    assert!(
        !state.floor_victims.contains_key(&Resource::Ram)
            || state.floor_victims[&Resource::Ram].is_empty()
    );
    let plan = evaluate(&c, &snap(100, Some(3 * GIB), procs()), &none, &mut state);
    assert_eq!(
        acts(&plan),
        "terminate [100]",
        "not braked: nothing was signalled"
    );
    state.apply(&carried(&plan, Outcome::Done));
    assert_eq!(state.floor_victims[&Resource::Ram].len(), 1);
    let gone = vec![proc(200, "b", 600 * MIB, 1)];
    decide(&c, &snap(200, Some(3 * GIB), gone.clone()), &mut state);
    let plan = decide(&c, &snap(1200, Some(3 * GIB), gone), &mut state);
    assert_eq!(
        (acts(&plan).as_str(), events(&plan).as_str()),
        ("", "floor_brake")
    );
}

/// `max_victims = 0` turns the brake off: the cascade runs as before.
#[test]
fn max_victims_zero_turns_the_brake_off() {
    let c = config(&format!("{RAM_FLOORS}max_victims = 0\n"));
    let mut state = PolicyState::default();
    for (i, pid) in [100, 200, 300, 400].into_iter().enumerate() {
        let at = i as u64 * 200;
        let procs: Vec<Process> = [100, 200, 300, 400]
            .into_iter()
            .filter(|&p| p >= pid)
            .map(|p| proc(p, "x", (1000 - p as u64) * MIB, 1))
            .collect();
        let plan = decide(&c, &snap(at, Some(3 * GIB), procs.clone()), &mut state);
        assert_eq!(acts(&plan), format!("terminate [{pid}]"));
        let rest: Vec<Process> = procs.into_iter().filter(|p| p.pid != pid).collect();
        decide(&c, &snap(at + 100, Some(5 * GIB), rest), &mut state);
    }
}

/// RAM falls under the act floor while Shmem grew by more than the shortfall since RAM was last
/// above its warn floor: the missing memory is in tmpfs or shared memory that no process holds.
/// A critical `shmem_shortfall` names it and nobody is killed for it, except a candidate whose
/// own memory alone lifts RAM back above the warn floor. The floor alert says how much is Shmem.
#[test]
fn shmem_growth_beyond_the_shortfall_alerts_and_does_not_kill() {
    let c = config(RAM_FLOORS);
    let small = || vec![proc(100, "a", 800 * MIB, 1), proc(200, "b", 600 * MIB, 1)];
    let mut state = PolicyState::default();
    let plans = play(
        &c,
        &mut state,
        vec![
            // Above the warn floor: Shmem 1 GiB is the baseline.
            (with_shmem(snap(0, Some(16 * GIB), small()), GIB), "", ""),
            // 3.5 GiB written to /dev/shm by a process since gone: 1 GiB short of the act floor.
            (
                with_shmem(snap(100, Some(3 * GIB), small()), 4 * GIB + GIB / 2),
                "",
                "floor_act, shmem_shortfall",
            ),
            (
                with_shmem(snap(200, Some(3 * GIB), small()), 4 * GIB + GIB / 2),
                "",
                "",
            ),
        ],
    );
    assert_eq!(plans[1].events[1].severity, Severity::Critical);
    // What it decided: Shmem grew by 3.5 GiB, more than the 1 GiB shortfall, and the first
    // candidate cannot lift RAM above the warn floor.
    let short = with_shmem(snap(200, Some(3 * GIB), small()), 4 * GIB + GIB / 2);
    let v = shmem_verdict(ram_choice(&c, &short, &mut state));
    assert_eq!(
        (
            v.growth.growth,
            v.growth.shortfall,
            v.unexplained,
            v.judgement
        ),
        (
            3 * GIB + GIB / 2,
            GIB,
            0,
            floors::Judgement::TooSmallForWarn
        )
    );
    // 2 GiB would lift RAM above the act floor (1 GiB short), not above the warn floor (5 GiB
    // short): a tmpfs write still under way would take that back. Not acted on.
    let mut mid = small();
    mid.push(proc(300, "mid", 2 * GIB, 1));
    let plan = decide(
        &c,
        &with_shmem(snap(250, Some(3 * GIB), mid.clone()), 4 * GIB + GIB / 2),
        &mut state,
    );
    assert_eq!((acts(&plan).as_str(), events(&plan).as_str()), ("", ""));
    // The file is being removed: Shmem falls before MemAvailable rises. Still the same
    // shortfall of memory no process held (Shmem's peak counts): nobody is signalled.
    let plan = decide(
        &c,
        &with_shmem(snap(280, Some(3 * GIB), mid.clone()), GIB + GIB / 2),
        &mut state,
    );
    assert_eq!((acts(&plan).as_str(), events(&plan).as_str()), ("", ""));
    // A candidate whose own memory alone lifts RAM above the warn floor may still be acted on.
    let mut big = mid;
    big.push(proc(400, "big", 6 * GIB, 1));
    let s = with_shmem(snap(300, Some(3 * GIB), big), 4 * GIB + GIB / 2);
    let v = shmem_verdict(ram_choice(&c, &s, &mut state));
    assert_eq!(
        (
            v.target.members[0].id.pid,
            v.used,
            v.unexplained,
            v.judgement
        ),
        (400, 6 * GIB, 0, floors::Judgement::LiftsAboveWarn)
    );
    let plan = decide(&c, &s, &mut state);
    assert_eq!(
        (acts(&plan).as_str(), events(&plan).as_str()),
        ("terminate [400]", "")
    );
}

/// Round three: a tmpfs file written, hogs started, the file deleted. The Shmem rule kept the
/// peak of Shmem and hid the hogs for as long as RAM stayed short. Now the peak outlives a fall
/// of Shmem only until MemAvailable shows what it gave back, or `SHMEM_FALL_GRACE`.
#[test]
fn a_deleted_tmpfs_file_does_not_hide_the_hogs_that_keep_ram_short() {
    let c = config(RAM_FLOORS);
    let hogs = |rss| vec![proc(100, "hog1", rss, 1), proc(200, "hog2", rss + MIB, 1)];
    let at = |ms, avail, shmem, rss| with_shmem(snap(ms, Some(avail), hogs(rss)), shmem);
    // MemAvailable shows the file's 4 GiB given back (still short: the hogs): acted on at once.
    let mut state = PolicyState::default();
    play(
        &c,
        &mut state,
        vec![
            (at(0, 16 * GIB, 0, MIB), "", ""),
            (
                at(100, GIB, 4 * GIB, 1536 * MIB),
                "",
                "floor_act, shmem_shortfall",
            ),
            (at(200, 3 * GIB, 9 * MIB, 1536 * MIB), "terminate [200]", ""),
        ],
    );
    // The hogs grew as the file went (MemAvailable rose by less than half of it): the peak is
    // kept for the moment a removal takes, then the hogs are acted on.
    let mut state = PolicyState::default();
    let grace = crate::policy::SHMEM_FALL_GRACE.as_millis() as u64;
    play(
        &c,
        &mut state,
        vec![
            (at(0, 16 * GIB, 0, MIB), "", ""),
            (
                at(100, GIB, 4 * GIB, 1536 * MIB),
                "",
                "floor_act, shmem_shortfall",
            ),
            (at(200, 2 * GIB + GIB / 2, 9 * MIB, 3 * GIB), "", ""),
            (
                at(200 + grace - 1, 2 * GIB + GIB / 2, 9 * MIB, 3 * GIB),
                "",
                "",
            ),
            (
                at(200 + grace, 2 * GIB + GIB / 2, 9 * MIB, 3 * GIB),
                "terminate [200]",
                "",
            ),
        ],
    );
}

/// Round three: 2.5 GiB in `/dev/shm` plus a 1.2 GiB hog ended in nobody acted on below the act
/// floor. The daemon reads who owns the tmpfs files: when the candidate's account owns them, the
/// memory no process holds is that account's, and its hog is acted on; another account's file
/// still holds the floor back.
#[test]
fn the_account_that_owns_the_tmpfs_files_is_acted_on() {
    let c = config(RAM_FLOORS);
    let hog = || {
        vec![Process {
            uid: 1001,
            ..proc(100, "hog", 1229 * MIB, 1)
        }]
    };
    let at = |ms, avail, shmem, owner: Option<u32>| {
        let mut s = with_shmem(snap(ms, Some(avail), hog()), shmem);
        if let Some(uid) = owner {
            s.tmpfs_owners.insert(uid, shmem);
        }
        s
    };
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (at(0, 16 * GIB, 0, None), "", ""),
            (
                at(100, 3 * GIB, 5 * GIB / 2, Some(1001)),
                "terminate [100]",
                "floor_act, shmem_shortfall",
            ),
        ],
    );
    let mut state = PolicyState::default();
    play(
        &c,
        &mut state,
        vec![
            (at(0, 16 * GIB, 0, None), "", ""),
            (
                at(100, 3 * GIB, 5 * GIB / 2, Some(1002)),
                "",
                "floor_act, shmem_shortfall",
            ),
        ],
    );
    let short = at(200, 3 * GIB, 5 * GIB / 2, Some(1002));
    let v = shmem_verdict(ram_choice(&c, &short, &mut state));
    assert_eq!(v.judgement, floors::Judgement::TooSmallForWarn);
    assert_eq!(v.owners, [(1002, 5 * GIB / 2)]);
}

/// Shmem that did not grow leaves the floor acting as before; so does a Shmem baseline that is
/// unknown (RAM was never seen above its warn floor).
#[test]
fn no_shmem_growth_leaves_the_floor_acting_as_before() {
    let c = config(RAM_FLOORS);
    let procs = || vec![proc(100, "a", 800 * MIB, 1)];
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (with_shmem(snap(0, Some(16 * GIB), procs()), GIB), "", ""),
            (
                with_shmem(snap(100, Some(3 * GIB), procs()), GIB),
                "terminate [100]",
                "floor_act",
            ),
        ],
    );
    play(
        &c,
        &mut PolicyState::default(),
        vec![(
            with_shmem(snap(0, Some(3 * GIB), procs()), 8 * GIB),
            "terminate [100]",
            "floor_act",
        )],
    );
}

/// Servers' own shared memory moves by a few MiB: growth that small does not make the Shmem rule
/// apply, so a hog split over processes each smaller than the shortfall is still acted on.
#[test]
fn shmem_noise_does_not_spare_a_hog_split_over_small_processes() {
    let c = config(RAM_FLOORS);
    // RAM 1 GiB short of the act floor; each piece of the hog holds 800 MiB; Shmem +8 MiB.
    let procs = || vec![proc(100, "a", 800 * MIB, 1), proc(101, "a", 700 * MIB, 1)];
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (with_shmem(snap(0, Some(16 * GIB), procs()), GIB), "", ""),
            (
                with_shmem(snap(100, Some(3 * GIB), procs()), GIB + 8 * MIB),
                "terminate [100]",
                "floor_act",
            ),
        ],
    );
}

/// Shmem growth that explains part of the shortfall: only the rest (shortfall - growth) is
/// judged. A victim acts only if its own memory is at least that rest (it plausibly caused it)
/// and lifts RAM above the act floor; otherwise `shmem_shortfall` and nobody is signalled.
#[test]
fn shmem_growth_explaining_part_of_the_shortfall_judges_only_the_rest() {
    let c = config(RAM_FLOORS);
    // Shmem 1 GiB -> 1.5 GiB, RAM 1 GiB short of the act floor: 512 MiB unexplained.
    let base = |procs| with_shmem(snap(0, Some(16 * GIB), procs), GIB);
    let short = |at, procs| with_shmem(snap(at, Some(3 * GIB), procs), GIB + GIB / 2);
    // 800 MiB covers the unexplained part but would not lift RAM above the act floor.
    let small = || vec![proc(100, "a", 800 * MIB, 1)];
    let mut state = PolicyState::default();
    let plans = play(
        &c,
        &mut state,
        vec![
            (base(small()), "", ""),
            (short(100, small()), "", "floor_act, shmem_shortfall"),
            (short(200, small()), "", ""),
        ],
    );
    assert_eq!(plans[1].events[1].severity, Severity::Critical);
    let v = shmem_verdict(ram_choice(&c, &short(200, small()), &mut state));
    assert_eq!(
        (
            v.growth.growth,
            v.growth.shortfall,
            v.unexplained,
            v.judgement
        ),
        (GIB / 2, GIB, GIB / 2, floors::Judgement::CannotLift)
    );
    // 2 GiB covers it and lifts RAM above the act floor: acted on.
    let mut big = small();
    big.push(proc(300, "big", 2 * GIB, 1));
    let plan = decide(&c, &short(300, big), &mut state);
    assert_eq!(
        (acts(&plan).as_str(), events(&plan).as_str()),
        ("terminate [300]", "")
    );
    let mut big = small();
    big.push(proc(300, "big", 2 * GIB, 1));
    let v = shmem_verdict(ram_choice(&c, &short(300, big), &mut state));
    assert_eq!(v.judgement, floors::Judgement::CoversTheRest);
}

/// The red team's bypass: a 3.5 GiB tmpfs file plus 1 GiB of anonymous memory in a process no
/// model holds (`candidates = "models"`). The shortfall (4 GiB) is more than the Shmem growth,
/// which used to switch the Shmem rule off and kill the models one by one; now only the
/// unexplained 512 MiB is judged, no model holds that much, and nobody is signalled.
#[test]
fn a_small_hog_beside_a_tmpfs_file_does_not_get_models_killed() {
    let models = ["a", "b", "c"]
        .iter()
        .map(|n| model(n, ""))
        .collect::<String>();
    let c = config(&format!(
        "[daemon]\ncandidates = \"models\"\n\
         [ram]\nwarn_available = \"16GiB\"\nmin_available = \"12GiB\"\n{models}"
    ));
    let procs = || {
        vec![
            proc(100, "a", 400 * MIB, 1),
            proc(200, "b", 250 * MIB, 1),
            proc(300, "c", 200 * MIB, 1),
            proc(400, "hog", GIB, 1),
        ]
    };
    let mut state = PolicyState::default();
    play(
        &c,
        &mut state,
        vec![
            (with_shmem(snap(0, Some(20 * GIB), procs()), GIB), "", ""),
            (
                with_shmem(snap(100, Some(8 * GIB), procs()), 4 * GIB + GIB / 2),
                "",
                "floor_act, shmem_shortfall",
            ),
            (
                with_shmem(snap(200, Some(8 * GIB), procs()), 4 * GIB + GIB / 2),
                "",
                "",
            ),
        ],
    );
    let now = with_shmem(snap(200, Some(8 * GIB), procs()), 4 * GIB + GIB / 2);
    let v = shmem_verdict(ram_choice(&c, &now, &mut state));
    assert_eq!(
        (v.unexplained, v.target.model.as_deref(), v.judgement),
        (GIB / 2, Some("a"), floors::Judgement::LessThanTheRest)
    );
}

/// Round three: an account keeps RAM short with small processes it lets die; after
/// `max_victims` of them the brake held, and the account's 3.5 GiB hog then ran below the act
/// floor untouched. The brake holds only against victims like those that did not help: a
/// candidate that alone lifts RAM above the act floor and holds more than any of them is acted
/// on.
#[test]
fn sacrificial_kills_do_not_spend_the_brake_for_the_hog() {
    let c = config(&format!("{RAM_FLOORS}max_victims = 2\n"));
    let user = |p: Process| Process { uid: 1001, ..p };
    let procs = |list: &[(i32, &str, u64)]| {
        let mut v = vec![proc(50, "idle", 10 * MIB, 1)];
        v.extend(
            list.iter()
                .map(|&(pid, name, rss)| user(proc(pid, name, rss, 1))),
        );
        v
    };
    let mut state = PolicyState::default();
    play(
        &c,
        &mut state,
        vec![
            (
                snap(0, Some(3 * GIB), procs(&[(101, "sac1", 600 * MIB)])),
                "terminate [101]",
                "floor_act",
            ),
            // It died (SIGTERM); the account's next one keeps RAM short (chosen once the dead one's
            // memory had RAM_RELEASE to come back).
            (
                snap(500, Some(3 * GIB), procs(&[(102, "sac2", 600 * MIB)])),
                "",
                "",
            ),
            (
                snap(1500, Some(3 * GIB), procs(&[(102, "sac2", 600 * MIB)])),
                "terminate [102]",
                "",
            ),
            (
                snap(2000, Some(3 * GIB), procs(&[(103, "sac3", 600 * MIB)])),
                "",
                "",
            ),
            // Two victims that did not help: the brake holds against the third small one...
            (
                snap(3000, Some(3 * GIB), procs(&[(103, "sac3", 600 * MIB)])),
                "",
                "floor_brake",
            ),
            // ...not against the hog that alone lifts RAM above the act floor.
            (
                snap(3500, Some(3 * GIB), procs(&[(104, "hog", 3584 * MIB)])),
                "terminate [104]",
                "",
            ),
        ],
    );
}

/// Round three: with `candidates = "models"`, memory held outside every model (67 GiB on the
/// GPU) made a model within its budget the victim. When what processes of no model hold grew by
/// the shortfall since the GPU was last above its warn floor, a model within its budget is left
/// alone (a critical `outside_shortfall` says why); one over its budget is still acted on, and a
/// model that grows itself is acted on as before.
#[test]
fn memory_outside_the_models_does_not_make_a_model_within_its_budget_the_victim() {
    let c = |budget: &str| {
        config(&format!(
            "[daemon]\ncandidates = \"models\"\n[gpu]\nmin_free = \"2GiB\"\nwarn_free = \"3GiB\"\n{}",
            model("vict", &format!("gpu_memory = \"{budget}\"\n"))
        ))
    };
    let procs = || vec![proc(100, "vict", GIB, 1), proc(300, "notebook", GIB, 1)];
    // GPU 0 (16 GiB): the model holds 5 GiB; the notebook, no model's, 4 GiB then 10 GiB.
    let at = |ms, vict: u64, notebook: u64| {
        let free = 16 * GIB - vict - notebook;
        gsnap(
            ms,
            procs(),
            vec![gpu(0, free, &[(100, Some(vict)), (300, Some(notebook))])],
        )
    };
    play(
        &c("8GiB"),
        &mut PolicyState::default(),
        vec![
            (at(0, 5 * GIB, 4 * GIB), "", ""),
            (
                at(100, 5 * GIB, 10 * GIB),
                "",
                "floor_act, outside_shortfall",
            ),
            (at(200, 5 * GIB, 10 * GIB), "", ""),
        ],
    );
    // Over its budget, the model is still the victim.
    play(
        &c("4GiB"),
        &mut PolicyState::default(),
        vec![
            (at(0, 5 * GIB, 4 * GIB), "", "budget_exceeded"),
            (
                at(100, 5 * GIB, 10 * GIB),
                "terminate vict[100]",
                "floor_act",
            ),
        ],
    );
    // NVML's per-process lists lag its free memory: a crossing seen on lists older than it waits
    // for fresh ones (which show the notebook grew) ...
    let stale = |ms, vict, notebook| {
        let mut s = at(ms, vict, notebook);
        s.gpus.processes_fresh = false;
        s.gpus.devices[0].processes = [(100, Some(vict)), (300, Some(4 * GIB))].into();
        s
    };
    play(
        &c("8GiB"),
        &mut PolicyState::default(),
        vec![
            (at(0, 5 * GIB, 4 * GIB), "", ""),
            (stale(100, 5 * GIB, 10 * GIB), "", "floor_act"),
            (at(200, 5 * GIB, 10 * GIB), "", "outside_shortfall"),
        ],
    );
    // ... but not for longer than `[gpu] sample_timeout` (then as before).
    play(
        &c("8GiB"),
        &mut PolicyState::default(),
        vec![
            (at(0, 5 * GIB, 4 * GIB), "", ""),
            (stale(100, 5 * GIB, 10 * GIB), "", "floor_act"),
            (stale(599, 5 * GIB, 10 * GIB), "", ""),
            (stale(600, 5 * GIB, 10 * GIB), "terminate vict[100]", ""),
        ],
    );
    // The model itself grew into the shortfall: acted on as before.
    play(
        &c("16GiB"),
        &mut PolicyState::default(),
        vec![
            (at(0, 5 * GIB, 4 * GIB), "", ""),
            (
                at(100, 11 * GIB, 4 * GIB),
                "terminate vict[100]",
                "floor_act",
            ),
        ],
    );
}

/// Round three: five 700 MiB processes of one account against another account's single 1.2 GiB
/// process, and the RAM floor ranked per process: the other account's went. Near the floor the
/// daemon reads each account's processes' proportional share (PSS): an account is ranked by the
/// sum, which forked workers' shared pages do not inflate.
#[test]
fn on_the_ram_floor_an_account_is_ranked_by_the_pss_of_its_processes() {
    let c = config(RAM_FLOORS);
    let with_pss = |p: Process, uid: u32, pss: u64| Process {
        uid,
        pss_bytes: Some(pss),
        ..p
    };
    let mut procs: Vec<Process> = (101..=105)
        .map(|pid| with_pss(proc(pid, "part", 700 * MIB, 1), 1001, 700 * MIB))
        .collect();
    procs.push(with_pss(
        proc(200, "single", 1228 * MIB, 1),
        1002,
        1228 * MIB,
    ));
    let plan = once(&c, &snap(0, Some(3 * GIB), procs.clone()));
    // (All five cannot lift RAM to its warn floor: the largest first, one victim at a time.)
    assert_eq!(acts(&plan), "terminate [101]");
    // Forked workers: 1 GiB of RSS each, mostly the same pages: 200 MiB of PSS each.
    for p in procs.iter_mut().filter(|p| p.uid == 1001) {
        p.rss_bytes = GIB;
        p.pss_bytes = Some(200 * MIB);
    }
    let plan = once(&c, &snap(0, Some(3 * GIB), procs));
    assert_eq!(acts(&plan), "terminate [200]");
}

/// A hostile review of the PSS ranking: an account shares its hog's pages with many helpers
/// each under the 32 MiB the scan reads PSS from (mapping a window of it, or forked before it
/// grew), so the hog's PSS is a fraction of what it holds, and the helpers, unread, were ranked
/// alone: another account's 1.2 GiB process went instead. An account with any PSS read has its
/// unread processes counted in its sum by RSS.
#[test]
fn an_account_cannot_dilute_its_pss_over_small_helpers() {
    let c = config(RAM_FLOORS);
    let mut procs = vec![Process {
        uid: 1001,
        pss_bytes: Some(512 * MIB),
        ..proc(101, "hog", 2 * GIB, 1)
    }];
    procs.extend((110..158).map(|pid| Process {
        uid: 1001,
        ..proc(pid, "helper", 31 * MIB, 1)
    }));
    procs.push(Process {
        uid: 1002,
        pss_bytes: Some(1228 * MIB),
        ..proc(200, "single", 1228 * MIB, 1)
    });
    let plan = once(&c, &snap(0, Some(3 * GIB), procs));
    assert!(acts(&plan).starts_with("terminate [101"), "{}", acts(&plan));
}

/// The GPU floor shares the brake (`[gpu] max_victims`, per GPU): with 1, a second victim on
/// the same GPU within the window is not taken; another GPU has its own count.
#[test]
fn the_gpu_floor_has_the_same_brake_per_gpu() {
    let c = config("[gpu]\nmin_free = \"2GiB\"\nmax_victims = 1\n");
    let low = 3 * GIB / 2;
    let ok = 3 * GIB;
    let s = |at, free0, holders: &[(i32, Option<u64>)], free1| {
        let procs = [100, 200, 300]
            .into_iter()
            .filter(|&p| p == 300 || holders.iter().any(|h| h.0 == p))
            .map(|p| proc(p, &format!("p{p}"), GIB, 1))
            .collect();
        gsnap(
            at,
            procs,
            vec![
                gpu(0, free0, holders),
                gpu(1, free1, &[(300, Some(8 * GIB))]),
            ],
        )
    };
    let both = [(100, Some(8 * GIB)), (200, Some(4 * GIB))];
    let second = [(200, Some(4 * GIB))];
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (s(0, low, &both, ok), "terminate [100]", "floor_act"),
            (s(100, low, &second, ok), "", ""),
            (
                s(200, low, &second, low),
                "terminate [300]",
                "floor_brake, floor_act",
            ),
        ],
    );
}
