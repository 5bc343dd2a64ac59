//! GPU floors and GPU budgets: the largest holder on the GPU, victims short on two GPUs or two
//! floors at once, users summed on a GPU, unavailable, stale and stuck GPU memory, the brake
//! per GPU.

use super::*;

/// A model whose processes hold memory on two GPUs, both below their floor in one tick (found by
/// `gpuguard replay`): one SIGTERM, not one per GPU, and not another when the second GPU's
/// incident goes on; both incidents escalate to the one SIGKILL-worthy victim together.
#[test]
fn a_victim_short_on_two_gpus_at_once_gets_one_sigterm() {
    let c = config(&format!(
        "[daemon]\ncandidates = \"models\"\n[gpu]\nmin_free = \"12GiB\"\n{}",
        model("srv", "")
    ));
    let s = srv_on_two_gpus;
    let mut state = PolicyState::default();
    let plans = play(
        &c,
        &mut state,
        vec![
            (s(0), "terminate srv[100,101]", "floor_act, floor_act"),
            (s(100), "", ""),
        ],
    );
    assert_eq!(plans[0].actions.len(), 1);
    // Both incidents hold it, as terminated since the same moment.
    let stages: Vec<_> = state
        .incidents
        .values()
        .map(|i| (i.stage, i.stage_since, i.victim.is_some()))
        .collect();
    assert_eq!(
        stages,
        vec![(Stage::Terminated, Duration::ZERO, true); 2],
        "{:#?}",
        state.incidents
    );
}

/// Two GPU floors whose victims overlap without being the same (a user's largest process on
/// GPU 0; on GPU 1 it and another): the second signals only the process the first did not,
/// so sharing a process cannot keep the other from its signal (a hostile review found the
/// first version of the join above let it).
#[test]
fn overlapping_victims_of_two_floors_each_get_one_signal() {
    let c = config("[gpu]\nmin_free = \"2GiB\"\nwarn_free = \"3GiB\"\n");
    let procs = || vec![proc(100, "big", GIB, 1), proc(101, "other", GIB, 1)];
    let s = |at| {
        gsnap(
            at,
            procs(),
            vec![
                gpu(0, GIB, &[(100, Some(8 * GIB))]),
                gpu(1, GIB / 2, &[(100, Some(2 * GIB)), (101, Some(GIB))]),
            ],
        )
    };
    let mut state = PolicyState::default();
    let plan = decide(&c, &s(0), &mut state);
    let victims: Vec<_> = state
        .incidents
        .values()
        .map(|i| (i.stage, i.victim.clone()))
        .collect();
    assert_eq!(
        acts(&plan),
        "terminate [100]; terminate [101]",
        "{victims:#?}"
    );
}

/// On a GPU floor a non-root user is one candidate, ranked by the GPU memory of all its
/// processes outside the models, and gives back its largest processes until they cover what the
/// floor needs (to its warn floor), in one action; root's processes are ranked one by one.
#[test]
fn on_a_gpu_floor_a_user_is_ranked_by_its_sum_and_gives_back_what_the_floor_needs() {
    let c = config(&format!(
        "[daemon]\ncandidates = \"any\"\n[gpu]\nmin_free = \"2GiB\"\nwarn_free = \"3GiB\"\n{}",
        model("server", "")
    ));
    let user = |pid: i32| Process {
        uid: 2000,
        ..proc(pid, "spread", 256 * MIB, 1)
    };
    // GPU 0, 1.5 GiB free (1.5 GiB under the warn floor): the model holds 4 GiB, the user six
    // processes of 1 GiB. Ranked alone, the model would be the largest holder.
    let check = |procs: Vec<Process>, holders: &[(i32, Option<u64>)], want: &str| {
        let s = gsnap(0, procs, vec![gpu(0, 3 * GIB / 2, holders)]);
        let (plan, choice) = once_choosing(&c, &s, Resource::Gpu(0));
        assert_eq!(acts(&plan), want);
        choice
    };
    let mut procs = vec![proc(100, "server", GIB, 1)];
    procs.extend((1000..1006).map(user));
    let mut holders = vec![(100, Some(4 * GIB))];
    holders.extend((1000..1006).map(|pid| (pid, Some(GIB))));
    // Ranked by its sum (6 GiB in 6 processes); its 2 largest (2 GiB) cover the need.
    let (target, used, user_total) =
        victim_of(check(procs.clone(), &holders, "terminate [1000,1001]"));
    assert_eq!(
        (uids(&target), used, user_total),
        (vec![2000, 2000], 2 * GIB, Some((6 * GIB, 6)))
    );
    // Largest first: 2 GiB alone covers the 1.5 needed.
    check(
        procs.clone(),
        &[
            (100, Some(4 * GIB)),
            (1000, Some(GIB)),
            (1001, Some(2 * GIB)),
            (1002, Some(GIB + GIB / 2)),
        ],
        "terminate [1001]",
    );
    // A user that cannot cover the need in all (the rest is memory no listed process holds)
    // loses only its largest holder, as when ranked alone.
    let (target, used, user_total) = victim_of(check(
        procs.clone(),
        &[
            (100, Some(GIB)),
            (1000, Some(GIB / 2)),
            (1001, Some(GIB / 2)),
            (1002, Some(GIB / 4)),
        ],
        "terminate [1000]",
    ));
    assert_eq!(
        (uids(&target), used, user_total),
        (vec![2000], GIB / 2, Some((GIB + GIB / 4, 3)))
    );
    // A user holding less in all than the model is not chosen.
    check(
        procs.clone(),
        &[
            (100, Some(4 * GIB)),
            (1000, Some(GIB)),
            (1001, Some(2 * GIB)),
        ],
        "terminate server[100]",
    );
    // Root's processes are not summed: the model is the largest candidate.
    let rooted: Vec<Process> = procs
        .into_iter()
        .map(|p| if p.comm == "spread" { system(p) } else { p })
        .collect();
    check(rooted, &holders, "terminate server[100]");
}

/// The user's processes acted on together are one victim: a user that splits its GPU memory
/// over small processes cannot spend the GPU floor's brake one kill at a time.
#[test]
fn a_user_split_over_small_gpu_processes_is_one_victim_and_the_gpu_recovers() {
    let c = config(
        "[daemon]\ncandidates = \"any\"\n[gpu]\nmin_free = \"2GiB\"\nwarn_free = \"3GiB\"\nmax_victims = 1\n",
    );
    let procs: Vec<Process> = (1000..1010)
        .map(|pid| Process {
            uid: 2000,
            // Different commands: not one model loaded ten times (`duplicate_load`).
            cmdline: format!("/usr/bin/spread {pid}"),
            ..proc(pid, "spread", 256 * MIB, 1)
        })
        .collect();
    let holders: Vec<(i32, Option<u64>)> = (1000..1010).map(|pid| (pid, Some(GIB))).collect();
    let mut state = PolicyState::default();
    // 1 GiB free, 2 GiB under the warn floor: two of the ten, in one action.
    let plan = decide(
        &c,
        &gsnap(0, procs.clone(), vec![gpu(0, GIB, &holders)]),
        &mut state,
    );
    assert_eq!(
        (acts(&plan).as_str(), events(&plan).as_str()),
        ("terminate [1000,1001]", "floor_act")
    );
    // They are gone and gave their 2 GiB back: above the warn floor, the victim does not count.
    let plan = decide(
        &c,
        &gsnap(
            500,
            procs[2..].to_vec(),
            vec![gpu(0, 3 * GIB + MIB, &holders[2..])],
        ),
        &mut state,
    );
    assert!(said(&plan, EventKind::FloorCleared), "{}", events(&plan));
    assert!(state.floor_victims[&Resource::Gpu(0)].is_empty());
    assert!(state.braked.is_empty());
}

/// Not on the RAM floor: RSS counts pages shared after fork in every worker, so a user's
/// forked workers (summing to more than they hold) are not chosen before the process that
/// really took the memory.
#[test]
fn on_the_ram_floor_a_users_forked_workers_are_not_summed() {
    let c = config(&format!("{RAM_FLOORS}[daemon]\ncandidates = \"any\"\n"));
    let mut procs: Vec<Process> = (1000..1008)
        .map(|pid| proc(pid, "dataloader", 2 * GIB, 1))
        .collect();
    procs.push(Process {
        uid: 2000,
        ..proc(2000, "leak", 6 * GIB, 1)
    });
    assert_eq!(
        acts(&once(&c, &snap(0, Some(3 * GIB), procs))),
        "terminate [2000]"
    );
}

#[test]
fn gpu_budget_is_summed_over_the_model() {
    let c = config(
        "[[model]]\nname = \"vllm\"\nmatch = { cmdline = \"vllm serve\" }\nusers = [\"1000\"]\ngpu_memory = \"10GiB\"\naction = \"kill\"\ngrace = \"0s\"\n",
    );
    let procs = || {
        vec![
            Process {
                cmdline: "python3 -m vllm serve Qwen".into(),
                ..proc(100, "python3", 2 * GIB, 1)
            },
            Process {
                cmdline: "python3 -c from multiprocessing.spawn import spawn_main".into(),
                ..proc(101, "python3", GIB, 100)
            },
            proc(300, "trainer", GIB, 1),
        ]
    };
    let cases = [
        (
            6 * GIB,
            6 * GIB,
            "terminate vllm[100,101]",
            "budget_exceeded",
        ),
        (6 * GIB, 3 * GIB, "", ""),
    ];
    for (parent, child, want_acts, want_events) in cases {
        let devices = vec![
            gpu(0, 8 * GIB, &[(100, Some(parent)), (300, Some(8 * GIB))]),
            gpu(1, 8 * GIB, &[(101, Some(child))]),
        ];
        let mut state = PolicyState::default();
        let plans = play(
            &c,
            &mut state,
            vec![(gsnap(0, procs(), devices), want_acts, want_events)],
        );
        let usage = &state.attribution.models[0];
        assert_eq!(
            usage
                .gpu_bytes
                .iter()
                .map(|(i, b)| (*i, *b))
                .collect::<Vec<_>>(),
            [(0, parent), (1, child)]
        );
        assert_eq!(usage.gpu_total_bytes(), parent + child);
        for a in &plans[0].actions {
            assert_eq!(a.reason.kind, "gpu_budget");
        }
    }
}

#[test]
fn unavailable_gpu_memory_never_makes_a_victim() {
    let c = config("[gpu]\nmin_free = \"2GiB\"\n");
    let procs = || {
        vec![
            proc(100, "mystery", 30 * GIB, 1),
            proc(200, "notebook", GIB, 1),
        ]
    };
    let low = 3 * GIB / 2;
    let plan = once(
        &c,
        &gsnap(
            0,
            procs(),
            vec![gpu(0, low, &[(100, None), (200, Some(GIB))])],
        ),
    );
    assert_eq!(acts(&plan), "terminate [200]");
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (
                gsnap(0, procs(), vec![gpu(0, low, &[(100, None)])]),
                "",
                "floor_act, no_victim",
            ),
            (
                gsnap(500, procs(), vec![gpu(0, low, &[(100, None)])]),
                "",
                "",
            ),
        ],
    );
    // ...and makes a model's GPU figures a lower bound.
    let c = config(&model("mystery", ""));
    let mut state = PolicyState::default();
    decide(
        &c,
        &gsnap(0, procs(), vec![gpu(0, low, &[(100, None)])]),
        &mut state,
    );
    assert!(state.attribution.models[0].gpu_unknown);
    assert_eq!(state.attribution.models[0].gpu_total_bytes(), 0);
}

#[test]
fn stale_gpu_reading_alerts_only() {
    let c = config("[gpu]\nmin_free = \"2GiB\"\n");
    let procs = || vec![proc(100, "vllm", GIB, 1)];
    let low = 3 * GIB / 2;
    let s = |at, stale, holders: &[(i32, Option<u64>)]| {
        let mut s = gsnap(at, procs(), vec![gpu(0, low, holders)]);
        s.gpus.stale = stale;
        s
    };
    let holds = [(100, Some(8 * GIB))];
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (s(0, true, &holds), "", "floor_act, not_acting_stale"),
            (s(500, true, &holds), "", ""),
            (s(1000, false, &holds), "terminate [100]", ""),
        ],
    );
    // Having said "stale" does not silence "no victim" once the reading is fresh.
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (
                s(0, true, &[(100, None)]),
                "",
                "floor_act, not_acting_stale",
            ),
            (s(1000, false, &[(100, None)]), "", "no_victim"),
        ],
    );
}

#[test]
fn stale_gpu_reading_only_delays_a_budget() {
    let c = config(&model(
        "vllm",
        "gpu_memory = \"4GiB\"\naction = \"kill\"\ngrace = \"5s\"\n",
    ));
    let procs = || vec![proc(100, "vllm", GIB, 1)];
    let s = |at, stale| {
        let mut s = gsnap(at, procs(), vec![gpu(0, 8 * GIB, &[(100, Some(6 * GIB))])]);
        s.gpus.stale = stale;
        s
    };
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (s(0, false), "", "budget_exceeded"),
            (s(5000, true), "", ""),
            (s(5500, false), "terminate vllm[100]", ""),
        ],
    );
}

#[test]
fn stuck_gpu_memory_is_reported_not_killed_around() {
    let c = config("[gpu]\nmin_free = \"2GiB\"\nrelease_timeout = \"5s\"\n");
    let low = 3 * GIB / 2;
    let ab = || vec![proc(100, "vllm", GIB, 1), proc(200, "notebook", GIB, 1)];
    let b = || vec![proc(200, "notebook", GIB, 1)];
    // The victim has exited, but NVML still lists its pid with memory.
    let devices = || vec![gpu(0, low, &[(100, Some(8 * GIB)), (200, Some(2 * GIB))])];
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (gsnap(0, ab(), devices()), "terminate [100]", "floor_act"),
            (gsnap(1000, b(), devices()), "", ""),
            (gsnap(2000, b(), devices()), "", ""),
            (gsnap(5999, b(), devices()), "", ""),
            (gsnap(6000, b(), devices()), "", "stuck_memory"),
            (gsnap(7000, b(), devices()), "", ""),
            (gsnap(60_000, b(), devices()), "", ""),
        ],
    );
    // Round three: the victim's pid reused by a new process that holds GPU memory. That is not
    // the victim's memory stuck: the incident goes on to the next holder (the largest: the new
    // process itself).
    let reused = || {
        let mut new = proc(100, "new", GIB, 1);
        new.start_time += 1;
        vec![new, proc(200, "notebook", GIB, 1)]
    };
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (gsnap(0, ab(), devices()), "terminate [100]", "floor_act"),
            (gsnap(1000, reused(), devices()), "", ""),
            (gsnap(2000, reused(), devices()), "terminate [100]", ""),
        ],
    );
    // Released in time: on to the next holder.
    let released = || vec![gpu(0, low, &[(200, Some(2 * GIB))])];
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (gsnap(0, ab(), devices()), "terminate [100]", "floor_act"),
            (gsnap(1000, b(), devices()), "", ""),
            (gsnap(2000, b(), released()), "terminate [200]", ""),
        ],
    );
}

#[test]
fn sampling_interval_tightens_near_a_floor() {
    let c = config(RAM_FLOORS);
    let ms = Duration::from_millis;
    let protected = vec![system(proc(300, "sshd", 6 * GIB, 1))];
    let victims = vec![proc(100, "trainer", 6 * GIB, 1)];
    let cases = [
        // available, processes, next_interval, max_scan_age
        (60 * GIB, &victims, ms(1000), ms(5000)),
        // 4.5 GiB above min at 8 GiB/s: 562.5 ms.
        (
            8 * GIB + GIB / 2,
            &victims,
            Duration::from_micros(562_500),
            ms(5000),
        ),
        // In the warn band: 2 GiB above min: 250 ms, and scans at least every 100 ms.
        (6 * GIB, &victims, ms(250), ms(100)),
        (4 * GIB + 40 * MIB, &victims, ms(10), ms(100)),
        // Below min: SIGTERM to the trainer, then ticks every 2 ms to watch it.
        (3 * GIB, &victims, ms(2), ms(100)),
        // Below min with nobody chosen yet: rescan at once.
        (3 * GIB, &protected, ms(10), Duration::ZERO),
    ];
    for (available, procs, interval, scan_age) in cases {
        let plan = once(&c, &snap(0, Some(available), procs.clone()));
        assert_eq!(
            (plan.next_interval, plan.max_scan_age),
            (interval, scan_age),
            "{available}"
        );
    }

    // A GPU floor: 8 GiB above min_free at 32 GiB/s.
    let c = config("[gpu]\nmin_free = \"2GiB\"\n");
    let plan = once(&c, &gsnap(0, victims.clone(), vec![gpu(0, 10 * GIB, &[])]));
    assert_eq!((plan.next_interval, plan.max_scan_age), (ms(250), ms(5000)));

    // A model over budget: sampled fast, scanned often.
    let c = config(&model("trainer", "ram = \"1GiB\"\n"));
    let plan = once(&c, &snap(0, Some(60 * GIB), victims.clone()));
    assert_eq!((plan.next_interval, plan.max_scan_age), (ms(10), ms(100)));
}

/// The models in force: a `[[model]]` wins over a launch of the same name (kept only for the
/// metrics URL it was launched with); launched-only models come after the configured ones.
#[test]
fn models_in_force_merge_config_and_launches_in_one_place() {
    let c = config(&format!(
        "{}{}",
        model("a", "ram = \"1GiB\"\n"),
        model(
            "b",
            "ram = \"2GiB\"\nmetrics_url = \"http://127.0.0.1:9/metrics\"\n"
        )
    ));
    let launched = |name: &str, url: Option<&str>| ModelConfig {
        name: name.to_string(),
        metrics_url: url.map(str::to_string),
        ram: None,
        ..c.models[0].clone()
    };
    let launches = Launches::new(
        HashMap::new(),
        vec![
            launched("a", Some("http://127.0.0.1:1/metrics")),
            launched("z", Some("http://127.0.0.1:2/metrics")),
            launched("m", None),
        ],
    );
    let models = launches.models(&c);
    let names: Vec<&str> = models.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["a", "b", "m", "z"]);
    assert!(models.get("a").unwrap().ram.is_some(), "the [[model]] wins");
    assert_eq!(models.metrics_url("a"), Some("http://127.0.0.1:1/metrics"));
    assert_eq!(models.metrics_url("b"), Some("http://127.0.0.1:9/metrics"));
    assert_eq!(models.metrics_url("z"), Some("http://127.0.0.1:2/metrics"));
    assert_eq!(models.metrics_url("m"), None);
    assert!(models.get("nope").is_none());
    assert_eq!(model_config(&c, &launches, "z").unwrap().name, "z");
}
