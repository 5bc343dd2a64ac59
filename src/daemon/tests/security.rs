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
