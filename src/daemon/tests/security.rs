//! Issue #11's attacks on whole ticks of the loop, with uids as plain data on the fake world:
//! what the host suite's `security` tests played with throw-away users, moved here where the
//! exact signals can be pinned tick by tick.

use super::*;

/// A user who spreads GPU memory over six processes of 1 GiB, each smaller than root's 4 GiB
/// model server, is still the one acted on, and only on as many of its processes as the floor
/// needs back (the two lowest pids of equals: 1.5 GiB short of the warn floor); back above the
/// warn floor, nothing else is touched. Moved from the host suite
/// (`security::a_user_who_spreads_gpu_memory_over_many_processes_is_ranked_by_its_sum`); the
/// ranking's cases are `policy::tests::on_a_gpu_floor_a_user_is_ranked_by_its_sum_and_gives_
/// back_what_the_floor_needs`.
#[test]
fn a_user_spread_over_small_gpu_processes_gives_back_what_the_floor_needs_and_no_more() {
    let user: Vec<i32> = (1000..1006).collect();
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        gpu: Some(BTreeMap::new()),
        // 4 GiB of root's and 6 of the user's: 1.5 GiB free.
        gpu_total: Some(11 * GIB + GIB / 2),
        ..World::default()
    };
    w.spawn(100, "server", GIB);
    w.gpu.as_mut().unwrap().insert(100, 4 * GIB);
    for &pid in &user {
        w.spawn(pid, "spread", 256 * MIB);
        let p = w.procs.get_mut(&pid).unwrap();
        p.uid = 2000;
        p.cmdline = format!("python3 -c sleep {pid}");
        w.gpu.as_mut().unwrap().insert(pid, GIB);
        w.exit_on_term.push(pid);
    }
    let mut h = Harness::new(
        w,
        "candidates = \"any\"\n\
         [gpu]\nenabled = true\nmin_free = \"2GiB\"\nwarn_free = \"3GiB\"\n\
         [[model]]\nname = \"server\"\nmatch = { comm = \"server\" }\n",
    );
    h.ticks(5, 100 * MS);
    assert_eq!(
        h.signals(),
        [(1000, Sig::Term), (1001, Sig::Term)],
        "{:?}",
        h.actions()
    );
    let killed = logged(&h, "process_killed");
    assert_eq!(killed.len(), 1, "{killed:?}");
    let event: serde_json::Value = serde_json::from_str(&killed[0]).unwrap();
    assert_eq!(event["action"]["reason"], "gpu_floor", "{event}");
    assert_eq!(event["subject"]["uid"], 2000, "{event}");
    assert_eq!(
        event["subject"]["pids"],
        serde_json::json!([1000, 1001]),
        "{event}"
    );
    // The two exited: 3.5 GiB free, above the warn floor. The guard looks again, and again.
    h.ticks(20, 100 * MS);
    assert_eq!(h.signals().len(), 2, "{:?}", h.actions());
    let w = h.world();
    assert!(w.procs.contains_key(&100), "root's server was acted on");
    assert!(
        user[2..].iter().all(|pid| w.procs.contains_key(pid)),
        "more of the user's processes than needed"
    );
}

/// A user's launched models with metrics URLs that accept and never answer made root's model's
/// engine figures stale. The config's URLs and root's launches are scraped on the trusted lane,
/// a user's launch on the other: moved from the host suite
/// (`security::a_users_hung_metrics_urls_do_not_leave_roots_engine_figures_stale`); that a hung
/// untrusted lane does not hold the trusted one up is `sample::engine::tests::urls_that_never_
/// answer_do_not_hold_up_the_trusted_lane`.
#[test]
fn only_the_configs_and_roots_metrics_urls_are_scraped_on_the_trusted_lane() {
    let url = |model: &str| format!("metrics_url = \"http://127.0.0.1:9/{model}\"\n");
    let mut h = Harness::new(
        World {
            host: host(64 * GIB, 40 * GIB),
            ..World::default()
        },
        &format!(
            "[gpu]\nenabled = false\n[[model]]\nname = \"rootm\"\nmatch = {{ comm = \"rootm\" }}\n{}",
            url("rootm")
        ),
    );
    // What the ledger hands the loop for launches of models the config does not know.
    let launched = |name: &str, uid: u32| {
        format!(
            "[[model]]\nname = \"{name}\"\nmatch = {{ comm = \"{name}\" }}\nusers = [\"{uid}\"]\n{}",
            url(name)
        )
    };
    let text = format!(
        "{}{}{}",
        launched("a0", 1001),
        launched("a1", 1001),
        launched("roots", 0)
    );
    let models = Config::parse(&text, std::path::Path::new("launched.toml"))
        .unwrap()
        .models;
    h.daemon.launches = crate::policy::Launches::new(Default::default(), models);
    let trusted: BTreeMap<String, bool> = h
        .daemon
        .engine_targets()
        .into_iter()
        .map(|(name, t)| (name, t.trusted))
        .collect();
    let want: BTreeMap<String, bool> = [
        ("a0", false),
        ("a1", false),
        ("rootm", true),
        ("roots", true),
    ]
    .into_iter()
    .map(|(n, t)| (n.to_string(), t))
    .collect();
    assert_eq!(trusted, want);
}

/// Issue 41: a user's launched models flapping around the budgets that user declared flooded the
/// webhooks and the event log (their budget events and conditions were outside the per-uid rate
/// limit) and had the flight recorder keep a full sample at each flap (~117x the quiet rate).
/// Now they are that user's doing: everything of uid 1000 (its launches' own events, its models'
/// budget events and conditions) is told within one share of `PER_UID` a minute, summed up in
/// one `events_suppressed`, and the recorder keeps its quiet rate (but for the few samples the
/// GPU's jumping use may add, `history::jumps`). The operator's `[[model]]`
/// flapping the same way keeps every event and a sample at each decision.
#[test]
fn a_users_launched_models_flapping_around_their_budgets_stay_within_its_share() {
    use crate::alert::Notice;
    use crate::history::Record;
    const PER_UID: usize = 20;
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        gpu: Some(BTreeMap::new()),
        ..World::default()
    };
    for pid in [4001, 4002] {
        w.spawn(pid, "x", 64 * MIB);
        w.procs.get_mut(&pid).unwrap().uid = 1000;
        w.gpu.as_mut().unwrap().insert(pid, GIB);
    }
    w.spawn(500, "ops", 64 * MIB);
    w.gpu.as_mut().unwrap().insert(500, GIB);
    let mut h = Harness::new(
        w,
        "[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n\
         [gpu]\nenabled = true\n[launch]\nsettle = \"1s\"\n\
         [[model]]\nname = \"ops\"\nmatch = { comm = \"ops\" }\ngpu_memory = \"2GiB\"\n\
         action = \"alert\"\ngrace = \"60s\"\n",
    );
    let webhook = h.daemon.reporter.alerter.tap(false);
    let event_log = h.daemon.reporter.alerter.tap(true);
    let samples = |h: &Harness| {
        h.daemon.reporter.recorder.as_ref().unwrap().flush();
        let dir = h._dir.path().join("state").join(crate::history::DIR);
        crate::history::read(&dir)
            .unwrap()
            .records
            .iter()
            .filter(|r| matches!(r, Record::Sample { .. }))
            .count()
    };
    h.ticks(2, 100 * MS);
    // Two models of uid 1000, each launched with a 2 GiB GPU budget, one after the other.
    for (conn, pid, model) in [(7, 4001, "m1"), (8, 4002, "m2")] {
        let peer = crate::reserve::Peer {
            uid: 1000,
            pid,
            start_time: 1000 + pid as u64,
        };
        let at = h.at;
        let mut table = h.daemon.shared.table();
        table.join(conn, peer, at);
        let request = crate::protocol::LaunchRequest {
            model: model.into(),
            gpu_memory_bytes: Some(2 * GIB),
            command: vec!["x".into()],
            ..Default::default()
        };
        let loader = Arc::new(crate::reserve::FakeProcess::default());
        let answer = table.launch(conn, request, loader, at);
        assert!(
            matches!(answer, Some(crate::protocol::Response::Admitted { .. })),
            "{answer:?}"
        );
        drop(table);
        h.ticks(15, 100 * MS);
    }
    let before = samples(&h);
    let flap = |h: &mut Harness, pids: &[i32], seconds: u64| {
        for half in 0..seconds * 2 {
            let used = if half % 2 == 0 { 3 * GIB } else { GIB };
            for pid in pids {
                h.world().gpu.as_mut().unwrap().insert(*pid, used);
            }
            h.ticks(5, 100 * MS);
        }
    };
    // 50 s of both flapping each half second: 100 crossings of each budget, inside the rate
    // limit's first window (it began at the first tick, 3 s ago).
    flap(&mut h, &[4001, 4002], 50);
    let users = |notices: &[Notice]| {
        notices
            .iter()
            .filter(|n| n.subject.uid == Some(1000) || n.key.ends_with("@1000"))
            .count()
    };
    let told = drain(&webhook);
    let logged = drain(&event_log);
    let budget = |notices: &[Notice]| {
        notices
            .iter()
            .filter(|n| n.key.ends_with("@1000") && n.event.starts_with("budget_"))
            .count()
    };
    assert!(budget(&told) > 0 && budget(&logged) > 0, "{told:#?}");
    assert!(users(&told) <= PER_UID, "{} webhook notices", users(&told));
    assert!(
        users(&logged) <= PER_UID,
        "{} event log lines",
        users(&logged)
    );
    // The clock's samples, and the GPU's used memory, which anyone's process moves, jumping:
    // at most `jumps::PER_WINDOW` samples a window for that (the models themselves, launched
    // by a user, are no jumps).
    let quiet = samples(&h) - before;
    let most = 50 / 10 + 1 + crate::history::jumps::PER_WINDOW as usize;
    assert!(
        quiet <= most,
        "{quiet} samples in 50 s at a 10 s interval (at most {most})"
    );
    // The window ends: one summary says how many were not told.
    h.ticks(100, 100 * MS);
    let summary: Vec<Notice> = drain(&event_log)
        .into_iter()
        .filter(|n| n.event == "events_suppressed")
        .collect();
    assert_eq!(summary.len(), 1, "{summary:#?}");
    assert!(summary[0].summary.starts_with("uid 1000: "), "{summary:#?}");
    assert!(
        summary[0].summary.contains("budget_exceeded"),
        "{summary:#?}"
    );

    // The operator's model crossing its budget as often: every crossing told, every decision
    // recorded.
    let before = samples(&h);
    flap(&mut h, &[500], 10);
    let ops = drain(&event_log);
    let exceeded = ops
        .iter()
        .filter(|n| n.key == "budget_exceeded" && n.subject.model.as_deref() == Some("ops"))
        .count();
    assert_eq!(exceeded, 10, "{ops:#?}");
    assert!(samples(&h) - before >= 20, "a sample at each decision");
}

/// Everything queued so far, in order.
fn drain(q: &Arc<crate::alert::queue::Queue<crate::alert::Notice>>) -> Vec<crate::alert::Notice> {
    let mut out = Vec::new();
    while !q.is_empty() {
        out.extend(q.pop());
        q.done();
    }
    out
}

/// Round four: `duplicate_load` wrote root's full command lines, `--api-key sk-...` and all, into
/// the world-readable history (and the event log, the alerts and the log), while the same
/// records' process rows masked it. Every command line leaves through `secrets::masked`: no
/// file the daemon writes holds the secret, and the warning still names the command.
#[test]
fn a_command_lines_secret_reaches_no_record_event_or_alert() {
    let secret = "sk-live-0123456789";
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        gpu: Some(BTreeMap::from([(200, 4 * GIB), (201, 4 * GIB)])),
        ..World::default()
    };
    for pid in [200, 201] {
        w.spawn(pid, "vllm", GIB);
        w.procs.get_mut(&pid).unwrap().cmdline =
            format!("vllm serve m --api-key {secret} -H X-Api-Key:{secret} --port 8000");
    }
    let mut h = Harness::new(w, "[gpu]\nenabled = true\n");
    h.ticks(30, 100 * MS);
    h.daemon.reporter.recorder.as_ref().unwrap().flush();
    let said = logged(&h, "duplicate_load");
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(
        said[0].contains("(vllm serve m --api-key *** -H X-Api-Key:*** --port 8000)"),
        "{said:?}"
    );
    let state = h._dir.path().join("state");
    let mut dirs = vec![state.clone()];
    let mut files = 0;
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            files += 1;
            let bytes = std::fs::read(&path).unwrap();
            assert!(
                !bytes.windows(secret.len()).any(|w| w == secret.as_bytes()),
                "{} holds the secret",
                path.display()
            );
        }
    }
    assert!(files >= 2, "the history and the event log were written");
}
