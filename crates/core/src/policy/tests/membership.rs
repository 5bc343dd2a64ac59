//! Which process is which model: matchers, descendants, launched processes, users, execs, and
//! membership by identity rather than by position in the table; the models in force.

use super::*;

#[test]
fn descendants_belong_to_the_model() {
    let c = config(&format!(
        "{RAM_FLOORS}[protect]\nunits = [\"metrics.service\"]\n[[model]]\nname = \"vllm\"\nmatch = {{ cmdline = \"vllm serve\" }}\nusers = [\"1000\"]\n"
    ));
    let procs = vec![
        Process {
            cmdline: "python3 -m vllm serve Qwen".into(),
            ..proc(100, "python3", 2 * GIB, 1)
        },
        Process {
            cmdline: "python3 -c from multiprocessing.spawn import spawn_main".into(),
            ..proc(101, "python3", 3 * GIB, 100)
        },
        proc(102, "pt_main_thread", GIB, 101),
        Process {
            state: 'Z',
            ..proc(103, "python3", 7 * GIB, 100)
        },
        Process {
            cgroup: "/system.slice/metrics.service".into(),
            ..proc(104, "metrics-agent", GIB / 2, 100)
        },
        proc(200, "other", 5 * GIB, 1),
    ];
    let s = snap(0, Some(3 * GIB), procs);
    let mut state = PolicyState::default();
    let plan = decide(&c, &s, &mut state);

    let usage = &state.attribution.models[0];
    // The protected child (in `metrics.service`) is in no model (issue 40): neither counted nor
    // a target.
    assert_eq!(
        rows(&state.attribution, &s.processes),
        [Some(0), Some(0), Some(0), Some(0), None, None]
    );
    // Live members only (the zombie has none of its memory any more), RSS summed over them.
    assert_eq!(member_rows(&usage.members, &s.processes), [0, 1, 2]);
    assert_eq!(usage.rss_bytes, 6 * GIB);
    // The parent alone (2 GiB) is smaller than `other` (5 GiB); with its children (6 GiB) it is not.
    // The target is every live member that may be signalled.
    assert_eq!(acts(&plan), "terminate vllm[100,101,102]");
    let target = &plan.actions[0].target;
    assert_eq!(
        target.members[1],
        Member {
            id: ProcessId {
                pid: 101,
                start_time: 50_101
            },
            comm: "python3".into(),
            uid: 1000
        }
    );
    assert_eq!(plan.watch, target.ids().collect::<Vec<_>>());
}

#[test]
fn launched_processes_belong_to_their_registered_model() {
    let c = config("[[model]]\nname = \"vllm\"\nmatch = { comm = \"vllm\" }\nusers = [\"1000\"]\n");
    let procs = vec![
        proc(100, "vllm", GIB, 1),
        proc(101, "worker", GIB, 100),
        proc(300, "vllm", GIB, 1),
        proc(301, "worker", GIB, 300),
    ];
    let registered = HashMap::from([(procs[2].id(), "launched".to_string())]);
    let table = ProcessTable {
        pss_read: true,
        scanned_at: Some(Duration::ZERO),
        processes: procs,
    };
    // A launched model belongs to its launcher's uid.
    let launched = |owner: &str| {
        let mut m = config(&format!(
            "[[model]]\nname = \"launched\"\nusers = [\"{owner}\"]\n"
        ));
        BTreeMap::from([("launched".to_string(), m.models.remove(0))])
    };
    let a = attribute(
        &c,
        &table,
        &GpuSnapshot::default(),
        &registered,
        &launched("1000"),
        SELF_PID,
        &mut MatchCache::default(),
    );
    let names: Vec<&str> = a.models.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["vllm", "launched"]);
    // Registration beats the config match, and children follow their parent.
    assert_eq!(rows(&a, &table), [Some(0), Some(0), Some(1), Some(1)]);
    // Processes of another uid never join it (issue #11).
    let a = attribute(
        &c,
        &table,
        &GpuSnapshot::default(),
        &registered,
        &launched("0"),
        SELF_PID,
        &mut MatchCache::default(),
    );
    assert_eq!(rows(&a, &table), [Some(0), Some(0), None, None]);
}

#[test]
fn a_model_has_only_processes_of_its_users_whatever_they_are_named() {
    // Issue #11: a user's process named like the system's server does not join its model; nor
    // does a child of the server that runs as another user.
    let c = config("[[model]]\nname = \"vllm\"\nmatch = { cmdline = \"vllm serve\" }\n");
    let server = Process {
        uid: 998,
        cmdline: "python3 -m vllm serve x".into(),
        ..proc(100, "python3", GIB, 1)
    };
    let forged = Process {
        uid: 1001,
        cmdline: "python3 -m vllm serve x".into(),
        ..proc(200, "python3", GIB, 1)
    };
    let sandboxed = Process {
        uid: 1002,
        ..proc(101, "helper", GIB, 100)
    };
    let (table, a) = attributed(&c, vec![server, forged, sandboxed]);
    assert_eq!(rows(&a, &table), [Some(0), None, None]);
}

#[test]
fn membership_follows_exec() {
    // pid and start time survive exec(): a wrapper scanned before it execs the model server must
    // join the model once it has.
    let c = config("[[model]]\nname = \"vllm\"\nmatch = { comm = \"vllm\" }\nusers = [\"1000\"]\n");
    let mut cache = MatchCache::default();
    let table = |comm: &str| ProcessTable {
        pss_read: true,
        scanned_at: Some(Duration::ZERO),
        processes: vec![proc(100, comm, GIB, 1)],
    };
    let gpus = GpuSnapshot::default();
    let before = attribute(
        &c,
        &table("sh"),
        &gpus,
        &HashMap::new(),
        &BTreeMap::new(),
        SELF_PID,
        &mut cache,
    );
    assert_eq!(rows(&before, &table("sh")), [None]);
    let after = attribute(
        &c,
        &table("vllm"),
        &gpus,
        &HashMap::new(),
        &BTreeMap::new(),
        SELF_PID,
        &mut cache,
    );
    assert_eq!(rows(&after, &table("vllm")), [Some(0)]);
}

#[test]
fn membership_follows_an_exec_that_keeps_the_name_and_a_setuid() {
    let c =
        config("[[model]]\nname = \"vllm\"\nmatch = { cmdline = \"vllm serve\", user = \"0\" }\n");
    let mut cache = MatchCache::default();
    let table = |cmdline: &str, uid: u32| ProcessTable {
        pss_read: true,
        scanned_at: Some(Duration::ZERO),
        processes: vec![Process {
            cmdline: cmdline.to_string(),
            uid,
            ..proc(100, "python3", GIB, 1)
        }],
    };
    let gpus = GpuSnapshot::default();
    let mut model_of = |t: &ProcessTable| {
        let a = attribute(
            &c,
            t,
            &gpus,
            &HashMap::new(),
            &BTreeMap::new(),
            SELF_PID,
            &mut cache,
        );
        rows(&a, t)
    };
    assert_eq!(model_of(&table("python3 launcher.py", 0)), [None]);
    // python3 exec'd python3: the same name, another command line.
    assert_eq!(model_of(&table("python3 -m vllm serve x", 0)), [Some(0)]);
    // The real uid changed (to another system uid, which the model's users allow): it no longer
    // matches `user = "0"`.
    assert_eq!(model_of(&table("python3 -m vllm serve x", 2)), [None]);
}

#[test]
fn one_victim_per_incident_then_the_next() {
    let c = config(RAM_FLOORS);
    let abc = || {
        vec![
            proc(100, "trainer", 6 * GIB, 1),
            proc(200, "loader", 4 * GIB, 1),
            proc(300, "notebook", GIB, 1),
        ]
    };
    let bc = || {
        abc()
            .into_iter()
            .filter(|p| p.pid != 100)
            .collect::<Vec<_>>()
    };
    let c_only = || {
        abc()
            .into_iter()
            .filter(|p| p.pid == 300)
            .collect::<Vec<_>>()
    };
    let low = Some(3 * GIB);
    let plans = play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, low, abc()), "terminate [100]", "floor_act"),
            (snap(500, low, abc()), "", ""),
            (snap(999, low, abc()), "", ""),
            // term_grace (1s) is over and it is still there.
            (snap(1000, low, abc()), "kill [100]", ""),
            // No second victim while the first is alive.
            (snap(1500, low, abc()), "", ""),
            // Gone: its memory may not be back in MemAvailable yet; the next victim waits for
            // a reading RAM_RELEASE (1 s) later.
            (snap(2000, low, bc()), "", ""),
            (snap(3000, low, bc()), "terminate [200]", ""),
            (snap(3100, Some(5 * GIB), c_only()), "", "incident_closed"),
            (snap(3200, Some(16 * GIB), c_only()), "", "floor_cleared"),
        ],
    );
    let pid = |p: &Plan| p.watch.iter().map(|id| id.pid).collect::<Vec<_>>();
    assert_eq!(pid(&plans[0]), [100]);
    assert_eq!(pid(&plans[6]), [200]);
    assert_eq!(pid(&plans[8]), Vec::<i32>::new());
    assert_eq!(
        plans[3].actions[0].recheck,
        Some(Recheck {
            resource: Resource::Ram,
            below_bytes: 4 * GIB
        })
    );
    assert_eq!(
        plans[3].actions[0].after_term,
        Some(floors::AfterTerm::GraceOver)
    );
}

/// The package test's index panic: membership read against a table that changed since it was
/// worked out (same scan, processes gone and come) is by identity, so nothing indexes past the
/// table and nobody else is targeted.
#[test]
fn membership_is_by_identity_not_by_position_in_the_table() {
    let c = config(&format!("{RAM_FLOORS}{}", model("vllm", "")));
    let mut state = PolicyState::default();
    let table = vec![
        proc(50, "idle", GIB, 1),
        proc(100, "vllm", 2 * GIB, 1),
        proc(101, "worker", GIB, 100),
    ];
    decide(&c, &snap(0, Some(32 * GIB), table), &mut state);
    // Same scan time (the attribution is kept), fewer and other processes.
    let mut changed = snap(0, Some(GIB), vec![proc(101, "worker", GIB, 100)]);
    changed.at = Duration::from_millis(10);
    let plan = decide(&c, &changed, &mut state);
    assert_eq!(acts(&plan), "terminate vllm[101]");
}

/// A model launched without a `[[model]]` (`gpuguard launch --ram ...`) has the budget its
/// launch gave, through the launches the loop hands the policy with each snapshot; once the
/// ledger no longer has the launch, its processes belong to no model and nothing holds them.
#[test]
fn a_launched_models_budget_comes_with_the_launches_the_policy_is_given() {
    let c = config("");
    let procs = || {
        vec![
            proc(100, "server", 3 * GIB, 1),
            proc(101, "worker", GIB / 2, 100),
        ]
    };
    let mut budget = config(&model(
        "served",
        "ram = \"2GiB\"\naction = \"stop\"\ngrace = \"1s\"\n",
    ));
    let launches = Launches::new(
        HashMap::from([(procs()[0].id(), "served".to_string())]),
        vec![budget.models.remove(0)],
    );
    let mut state = PolicyState::default();
    let ok = Some(32 * GIB);
    let at = |ms| snap(ms, ok, procs());
    let plan = decide_with(&c, &at(0), &launches, &mut state);
    assert_eq!(events(&plan), "budget_exceeded");
    let plan = decide_with(&c, &at(1000), &launches, &mut state);
    assert_eq!(acts(&plan), "stop served[100,101]");
    // The launch is gone from the ledger: nothing launched, nothing over a budget.
    state.launches_changed();
    let plan = decide(&c, &at(2000), &mut state);
    assert_eq!(acts(&plan), "resume served[100,101]");
}

/// The stage an action enters is entered on its outcome, in `apply`: a decision alone moves
/// nothing, an action skipped leaves the stage where it was, one carried out enters it.
#[test]
fn a_stage_is_entered_only_when_its_action_is_carried_out() {
    let c = config(&format!("{RAM_FLOORS}action = \"stop\"\n"));
    let a = || vec![proc(100, "trainer", 6 * GIB, 1)];
    let none = Launches::default();
    let mut state = PolicyState::default();
    let ms = Duration::from_millis;
    let stage = |s: &PolicyState| {
        let i = &s.incidents[&Resource::Ram];
        (i.victim.is_some(), i.stage, i.stage_since)
    };
    // Decided, not yet carried out: no victim, no stage, nothing for the brake.
    let plan = evaluate(&c, &snap(0, Some(3 * GIB), a()), &none, &mut state);
    assert_eq!(acts(&plan), "stop [100]");
    assert_eq!(stage(&state), (false, Stage::Alerted, Duration::ZERO));
    assert!(state.floor_victims.values().all(|v| v.is_empty()));
    // The executor skipped it (the recheck found RAM recovered): still nothing entered, and the
    // next tick below the floor decides afresh.
    state.apply(&carried(&plan, Outcome::Skipped("recovered".into())));
    assert_eq!(stage(&state), (false, Stage::Alerted, Duration::ZERO));
    let plan = evaluate(&c, &snap(100, Some(3 * GIB), a()), &none, &mut state);
    assert_eq!(acts(&plan), "stop [100]");
    // Carried out: stopped from the tick that decided it, and counted for the brake.
    state.apply(&carried(&plan, Outcome::Done));
    assert_eq!(stage(&state), (true, Stage::Stopped, ms(100)));
    assert_eq!(state.floor_victims[&Resource::Ram].len(), 1);
    // settle (2 s) later: SIGTERM decided; skipped, the victim stays stopped and the next tick
    // asks for SIGTERM again (not a fresh stop of a new victim).
    let plan = evaluate(&c, &snap(2100, Some(3 * GIB), a()), &none, &mut state);
    assert_eq!(acts(&plan), "terminate [100]");
    state.apply(&carried(&plan, Outcome::Skipped("recovered".into())));
    assert_eq!(stage(&state), (true, Stage::Stopped, ms(100)));
    let plan = decide(&c, &snap(2200, Some(3 * GIB), a()), &mut state);
    assert_eq!(acts(&plan), "terminate [100]");
    assert_eq!(stage(&state), (true, Stage::Terminated, ms(2200)));
    assert_eq!(
        state.floor_victims[&Resource::Ram].len(),
        1,
        "an escalation is no new victim"
    );
}
