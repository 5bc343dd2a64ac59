//! The English an operator reads (events, the reasons of actions), once per family of sentences:
//! each is checked against the typed values it is rendered from. Every other test matches those
//! values (the choice, the reading, kinds, verbs, targets), never the sentences.

use super::*;

/// A reading in words (`Reading::describe`): every floor event says it, and every floor action's
/// reason starts with it. The figure against the floor it is under, what else says act or warn
/// (PSI, swap), Shmem near a floor, and why a reading is unknown.
#[test]
fn a_reading_in_words() {
    let ram = config(&format!(
        "{RAM_FLOORS}psi_some_avg10 = 20.0\nmin_swap_free = \"1GiB\"\n"
    ));
    let trainer = || vec![proc(100, "trainer", 6 * GIB, 1)];
    let host = |available: Option<u64>, f: &dyn Fn(&mut Snapshot)| {
        let mut s = snap(0, available, trainer());
        s.host.swap_total_bytes = Some(8 * GIB);
        s.host.swap_free_bytes = Some(4 * GIB);
        f(&mut s);
        s
    };
    let gpus = config("[gpu]\nmin_free = \"20GiB\"\n");
    let on_gpu = gsnap(0, trainer(), vec![gpu(0, 8 * GIB, &[])]);
    let cases: Vec<(&Config, Snapshot, Resource, EventKind, &str)> = vec![
        (
            &ram,
            host(Some(3 * GIB), &|_| {}),
            Resource::Ram,
            EventKind::FloorAct,
            "RAM available 3.0 GiB < min_available 4.0 GiB",
        ),
        (
            &ram,
            host(Some(6 * GIB), &|s| s.host.shmem_bytes = Some(4 * GIB + GIB / 2)),
            Resource::Ram,
            EventKind::FloorWarn,
            "RAM available 6.0 GiB < warn_available 8.0 GiB; Shmem (tmpfs, shared memory) 4.5 GiB",
        ),
        (
            &ram,
            host(Some(16 * GIB), &|s| s.host.psi_some_avg10 = Some(50.0)),
            Resource::Ram,
            EventKind::FloorWarn,
            "RAM available 16.0 GiB; PSI memory some avg10 50.0% > 20.0%",
        ),
        (
            &ram,
            host(Some(16 * GIB), &|s| s.host.swap_free_bytes = Some(512 * MIB)),
            Resource::Ram,
            EventKind::FloorAct,
            "RAM available 16.0 GiB; swap free 512.0 MiB < min_swap_free 1.0 GiB",
        ),
        (
            &ram,
            host(Some(GIB), &|s| s.host.total_bytes = Some(512 * MIB)),
            Resource::Ram,
            EventKind::ReadingUnknown,
            "RAM available unknown (inconsistent reading: MemAvailable 1.0 GiB > MemTotal 512.0 MiB)",
        ),
        (
            &gpus,
            on_gpu,
            Resource::Gpu(0),
            EventKind::ReadingUnknown,
            "GPU 0 free unknown (min_free 20.0 GiB is at or above the total 16.0 GiB: floor not enforced)",
        ),
    ];
    for (c, s, resource, kind, want) in cases {
        let r = reading(c, &s, resource);
        assert_eq!(r.describe(), want);
        let plan = once(c, &s);
        let e = plan.events.iter().find(|e| e.kind == kind).expect(want);
        assert!(e.message.starts_with(want), "{e:?}");
        if kind == EventKind::ReadingUnknown {
            assert_eq!(
                e.message,
                format!("{want}: not acting on {resource} until it reads again")
            );
        }
    }
}

/// Why a victim (`words::victim`): what it holds of the short resource (swap, when swap is
/// why), or a user's sum and its largest processes'.
#[test]
fn a_victim_in_words() {
    let c = config(&format!("{RAM_FLOORS}min_swap_free = \"1GiB\"\n"));
    let mut s = snap(
        0,
        Some(16 * GIB),
        vec![
            proc(100, "big-rss", 12 * GIB, 1),
            Process {
                swap_bytes: Some(3 * GIB),
                ..proc(200, "big-swap", GIB, 1)
            },
        ],
    );
    s.host.swap_total_bytes = Some(8 * GIB);
    s.host.swap_free_bytes = Some(512 * MIB);
    let (plan, chosen) = once_choosing(&c, &s, Resource::Ram);
    let (_, used, _) = victim_of(chosen);
    assert_eq!(
        plan.actions[0].reason.detail,
        format!(
            "{}; largest eligible user of swap: {}",
            reading(&c, &s, Resource::Ram).describe(),
            bytes(used)
        )
    );

    let c = config(
        "[daemon]\ncandidates = \"any\"\n[gpu]\nmin_free = \"2GiB\"\nwarn_free = \"3GiB\"\n",
    );
    let user = |pid: i32| Process {
        uid: 2000,
        cmdline: format!("/usr/bin/spread {pid}"),
        ..proc(pid, "spread", 256 * MIB, 1)
    };
    for holders in [
        vec![(1000, Some(GIB)), (1001, Some(GIB)), (1002, Some(GIB))],
        vec![
            (1000, Some(GIB / 2)),
            (1001, Some(GIB / 2)),
            (1002, Some(GIB / 4)),
        ],
    ] {
        let s = gsnap(
            0,
            (1000..1003).map(user).collect(),
            vec![gpu(0, 3 * GIB / 2, &holders)],
        );
        let (plan, chosen) = once_choosing(&c, &s, Resource::Gpu(0));
        let (target, used, user_total) = victim_of(chosen);
        let (total, count) = user_total.expect("ranked by the user's sum");
        let largest = match target.members.len() {
            1 => format!("its largest holds {}", bytes(used)),
            n => format!("its {n} largest hold {}", bytes(used)),
        };
        assert_eq!(
            plan.actions[0].reason.detail,
            format!(
                "{}; largest eligible user of GPU 0: uid 2000, {} in {count} processes; {largest}",
                reading(&c, &s, Resource::Gpu(0)).describe(),
                bytes(total)
            )
        );
    }
}

/// The brake in words: engaged (critical, with the victims, the window, the least it holds and
/// the Shmem no kill gives back) and released (info).
#[test]
fn the_brake_in_words() {
    let c = config(&format!(
        "{RAM_FLOORS}max_victims = 1\nvictim_window = \"1m\"\n"
    ));
    let s = |at, available, procs: &[i32]| {
        let procs = procs.iter().map(|&p| proc(p, "x", GIB, 1)).collect();
        with_shmem(snap(at, Some(available), procs), 10 * GIB)
    };
    let before = |state: &mut PolicyState| {
        decide(&c, &s(0, 3 * GIB, &[100, 200]), state);
        decide(&c, &s(200, 3 * GIB, &[200]), state);
    };
    let braking = s(1200, 3 * GIB, &[200]);
    let mut again = PolicyState::default();
    before(&mut again);
    let floors::Choice::Braked(Some(b)) = ram_choice(&c, &braking, &mut again) else {
        panic!("not braked");
    };
    let mut state = PolicyState::default();
    before(&mut state);
    let plan = decide(&c, &braking, &mut state);
    let engaged = plan.events.iter().find(|e| e.kind == EventKind::FloorBrake);
    assert_eq!(
        engaged.map(|e| (e.severity, e.message.clone())),
        Some((
            Severity::Critical,
            format!(
                "{}; {} victim(s) acted on for RAM within {} did not bring it back above its warn floor: not acting on RAM until it is back above its warn floor, and for at least {} (brake: max_victims {} per victim_window); Shmem is {} (tmpfs files, shared memory: no process holds it and no kill gives it back)",
                reading(&c, &braking, Resource::Ram).describe(),
                b.victims,
                crate::units::fmt_duration(b.window),
                // The least it holds, rounded up to the second.
                crate::units::fmt_duration(Duration::from_secs(b.left.as_secs_f64().ceil() as u64)),
                b.max_victims,
                bytes(b.shmem.unwrap())
            )
        ))
    );
    let ok = s(61_000, 9 * GIB, &[200]);
    let plan = decide(&c, &ok, &mut state);
    let released = plan.events.iter().find(|e| e.kind == EventKind::FloorBrake);
    assert_eq!(
        released.map(|e| (e.severity, e.message.clone())),
        Some((
            Severity::Info,
            format!(
                "RAM: brake released ({}; 0 victim(s) within the last 1m): the floor may act again",
                reading(&c, &ok, Resource::Ram).describe()
            )
        ))
    );
}

/// The Shmem rule in words: the alert (how much Shmem grew, against what shortfall, and the
/// verdict on the first candidate) and the reason of a victim it lets through.
#[test]
fn the_shmem_rule_in_words() {
    let c = config(RAM_FLOORS);
    let procs = |big: bool| {
        let mut p = vec![proc(100, "a", 800 * MIB, 1)];
        if big {
            p.push(proc(400, "big", 6 * GIB, 1));
        }
        p
    };
    for big in [false, true] {
        let mut state = PolicyState::default();
        decide(
            &c,
            &with_shmem(snap(0, Some(16 * GIB), procs(big)), GIB),
            &mut state,
        );
        let short = with_shmem(snap(100, Some(3 * GIB), procs(big)), 4 * GIB + GIB / 2);
        let plan = decide(&c, &short, &mut state);
        let v = shmem_verdict(ram_choice(&c, &short, &mut state));
        let describe = reading(&c, &short, Resource::Ram).describe();
        let alert = plan
            .events
            .iter()
            .find(|e| e.kind == EventKind::ShmemShortfall)
            .expect("alerted");
        let verdict = match v.judgement {
            floors::Judgement::TooSmallForWarn => format!(
                "not acting: the first eligible candidate, {}, holds {} of its own, not enough to lift RAM above the warn floor ({} short of it)",
                v.target,
                bytes(v.used),
                bytes(v.growth.to_warn)
            ),
            floors::Judgement::LiftsAboveWarn => format!(
                "acting on {} only because its own {} alone lifts RAM above the warn floor",
                v.target,
                bytes(v.used)
            ),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            alert.message,
            format!(
                "{describe}; Shmem grew by {} since RAM was last above its warn floor, more than the shortfall of {}: memory in tmpfs files or shared memory that no process holds (look in /dev/shm and other tmpfs mounts); {verdict}",
                bytes(v.growth.growth),
                bytes(v.growth.shortfall)
            )
        );
        if big {
            assert_eq!(
                plan.actions[0].reason.detail,
                format!(
                    "{describe}; largest eligible user of RAM: {} (enough alone to lift RAM above the warn floor; Shmem grew by {})",
                    bytes(v.used),
                    bytes(v.growth.growth)
                )
            );
        }
    }
}

/// SIGKILL after SIGTERM in words (`words::kill_after_term`): the victim's growth since its
/// baseline, or SIGTERM not enough (`term_grace` run out, or far below the floor).
#[test]
fn a_kill_after_sigterm_in_words() {
    let c = config(RAM_FLOORS);
    let at = |ms, available, rss| snap(ms, Some(available), term_victims(rss));
    let mut state = PolicyState::default();
    for (ms, rss) in [(0, 6 * GIB), (2, 6 * GIB)] {
        decide(&c, &at(ms, 3 * GIB, rss), &mut state);
    }
    let baseline = state.incidents[&Resource::Ram].term_baseline.unwrap();
    let grown = at(4, 3 * GIB, 6 * GIB + 20 * MIB);
    let plan = decide(&c, &grown, &mut state);
    let Some(floors::AfterTerm::Grew(growth)) = plan.actions[0].after_term else {
        panic!("{:?}", plan.actions);
    };
    assert_eq!(growth, 6 * GIB + 20 * MIB - baseline.bytes);
    assert_eq!(
        plan.actions[0].reason.detail,
        format!(
            "{}; its memory grew by {} after SIGTERM: it is not shutting down",
            reading(&c, &grown, Resource::Ram).describe(),
            bytes(growth)
        )
    );

    let graced = at(c.daemon.term_grace.as_millis() as u64, 3 * GIB, 6 * GIB);
    let far = |ms| at(ms, GIB, 6 * GIB);
    for (ticks, why) in [
        (
            vec![at(0, 3 * GIB, 6 * GIB), graced],
            floors::AfterTerm::GraceOver,
        ),
        (
            vec![at(0, 3 * GIB, 6 * GIB), far(100), far(200)],
            floors::AfterTerm::FarBelow,
        ),
    ] {
        let mut state = PolicyState::default();
        let last = ticks.last().unwrap().clone();
        let plans: Vec<Plan> = ticks.iter().map(|s| decide(&c, s, &mut state)).collect();
        let kill = &plans.last().unwrap().actions[0];
        assert_eq!(kill.after_term, Some(why));
        assert_eq!(
            kill.reason.detail,
            format!(
                "{}; SIGTERM not enough",
                reading(&c, &last, Resource::Ram).describe()
            )
        );
    }
}

/// A group loaded more than once in words (`waste::duplicate_event`): by the weights they map
/// (the models they belong to, the first file and how many more, the most one maps, what they
/// hold together), or by their command line.
#[test]
fn a_duplicate_load_in_words() {
    let c = config(&model("server", ""));
    let worker = |pid: i32| Process {
        cmdline: format!("/usr/bin/server --worker {pid}"),
        ..proc(pid, "server", GIB, 1)
    };
    let holders = [(100, Some(3 * GIB)), (101, Some(5 * GIB))];
    let mut s = gsnap(
        0,
        vec![worker(100), worker(101)],
        vec![gpu(0, GIB, &holders)],
    );
    let small = crate::snapshot::MappedFile {
        mapped_bytes: GIB,
        ..weights_file(7)
    };
    s.mapped_weights = [
        (100, vec![small.clone(), weights_file(8)]),
        (101, vec![small, weights_file(8)]),
    ]
    .into();
    let (plan, found) = duplicates_said(&c, &s);
    let waste::Rule::SameWeights { files } = &found[0].rule else {
        panic!("{found:?}");
    };
    let d = &found[0];
    assert_eq!(
        plan.events[0].message,
        format!(
            "GPU {}: 2 processes {:?} of model 'server' map the same weights ({} and 1 more file(s), {}) and hold {} together: the same weights loaded more than once?",
            d.gpu,
            d.pids,
            files[0].path,
            bytes(files.iter().map(|f| f.mapped_bytes).max().unwrap()),
            bytes(d.held)
        )
    );
    assert_eq!(
        plan.events[0].message,
        "GPU 0: 2 processes [100, 101] of model 'server' map the same weights (/models/m/model-7.safetensors and 1 more file(s), 4.0 GiB) and hold 8.0 GiB together: the same weights loaded more than once?"
    );

    // Of no model, one file.
    let c = config("");
    let (plan, found) = duplicates_said(&c, &s);
    let d = &found[0];
    let waste::Rule::SameWeights { files } = &d.rule else {
        panic!("{found:?}");
    };
    assert_eq!(
        plan.events[0].message,
        format!(
            "GPU 0: 2 processes {:?} map the same weights ({} and 1 more file(s), {}) and hold {} together: the same weights loaded more than once?",
            d.pids,
            files[0].path,
            bytes(4 * GIB),
            bytes(d.held)
        )
    );

    // The same command, no weights mapped.
    let vllm = |pid| proc(pid, "vllm", GIB, 1);
    let s = gsnap(
        0,
        vec![vllm(200), vllm(201)],
        vec![gpu(0, GIB, &holders.map(|(p, b)| (p + 100, b)))],
    );
    let (plan, found) = duplicates_said(&c, &s);
    let d = &found[0];
    let waste::Rule::SameCommand { cmdline } = &d.rule else {
        panic!("{found:?}");
    };
    assert_eq!(
        plan.events[0].message,
        format!(
            "GPU 0: 2 processes {:?} run the same command and hold {} together: the same model loaded more than once? ({cmdline})",
            d.pids,
            bytes(d.held)
        )
    );
    assert_eq!(
        plan.events[0].message,
        "GPU 0: 2 processes [200, 201] run the same command and hold 8.0 GiB together: the same model loaded more than once? (/usr/bin/vllm)"
    );
}

/// A floor-stopped process resumed at `max_stop` on a reading that cannot be trusted: why.
#[test]
fn a_resume_at_max_stop_in_words() {
    let c = config(GPU_STOP);
    let procs = || vec![proc(100, "vllm", GIB, 1)];
    let low = gsnap(0, procs(), vec![gpu(0, GIB, &[(100, Some(8 * GIB))])]);
    let mut state = PolicyState::default();
    decide(&c, &low, &mut state);
    decide(&c, &gsnap(1000, procs(), vec![]), &mut state);
    let gone = gsnap(10_000, procs(), vec![]);
    let plan = decide(&c, &gone, &mut state);
    let why = reading(&c, &gone, Resource::Gpu(0)).error.unwrap();
    assert_eq!(
        plan.actions[0].reason.detail,
        format!("stopped for 10s (max_stop) while GPU 0 reading is unknown ({why}): resumed, never killed on a reading that cannot be trusted")
    );
}

/// A budget in words: the model's name as configured (words in it are not keywords), what is
/// over, and what follows after the grace.
#[test]
fn a_budget_in_words() {
    let c = config(&model(
        "AlertStopKill",
        "ram = \"2GiB\"\naction = \"throttle\"\n",
    ));
    let plan = once(
        &c,
        &snap(
            0,
            Some(32 * GIB),
            vec![proc(100, "AlertStopKill", 3 * GIB, 1)],
        ),
    );
    let e = &plan.events[0];
    assert_eq!(
        (e.kind, e.about.model.as_deref()),
        (EventKind::BudgetExceeded, Some("AlertStopKill"))
    );
    assert_eq!(
        e.message,
        "model 'AlertStopKill' over budget: RAM 3.0 GiB > budget 2.0 GiB; action throttle after grace 10s"
    );
}
