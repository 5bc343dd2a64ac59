//! The ledger with plain data: a config, a capacity, requests; answers read from the outbox.

use super::launches::parse_visible_devices;
use super::*;
use crate::reserve::capacity::{GpuCapacity, ModelUse, RamCapacity, TreeUse};

const GIB: u64 = 1 << 30;

fn config(text: &str) -> Config {
    Config::parse(text, std::path::Path::new("t.toml")).unwrap()
}

/// A 16 GiB GPU with 4 GiB used by model "served", a 1 GiB floor.
fn capacity(used: u64) -> Capacity {
    Capacity {
        gpus: vec![GpuCapacity {
            index: 0,
            uuid: "GPU-a".into(),
            total: Some(16 * GIB),
            free: Some(16 * GIB - used),
            floor: GIB,
            usable: true,
        }],
        ram: RamCapacity {
            total: Some(64 * GIB),
            available: Some(32 * GIB),
            floor: GIB,
        },
        models: HashMap::from([(
            "served".to_string(),
            ModelUse {
                gpu_bytes: BTreeMap::from([(0, used)]),
                members: 1,
                ..Default::default()
            },
        )]),
        gpu_consistent: true,
        gpu_sampled_at: Some(Duration::ZERO),
        scanned_at: Some(Duration::ZERO),
        ..Default::default()
    }
}

/// The answers the ledger decided for `conn` since it was last asked (the rest stay in the
/// outbox).
fn mail(t: &mut Reservations, conn: ConnId) -> Vec<Response> {
    let (mine, rest): (Vec<_>, Vec<_>) = t.take_outbox().into_iter().partition(|(c, _)| *c == conn);
    t.outbox = rest;
    mine.into_iter().map(|(_, r)| r).collect()
}

fn table() -> Reservations {
    let mut t = Reservations::new(config(
        "[[model]]\nname = \"served\"\nmatch = { comm = \"x\" }\n",
    ));
    t.tick(Duration::ZERO, capacity(4 * GIB));
    let peer = peer(0, 42);
    t.join(1, peer, Duration::ZERO);
    t
}

fn ask(gpu_gib: u64, id: u64) -> AcquireRequest {
    AcquireRequest {
        id,
        model: Some("served".into()),
        gpu_bytes: Some(gpu_gib * GIB),
        timeout_ms: Some(1000),
        ..Default::default()
    }
}

/// A client's identity as the socket would pin it (start time 1).
fn peer(uid: u32, pid: i32) -> Peer {
    Peer {
        uid,
        pid,
        start_time: 1,
    }
}

/// `table()` with `config_text` and a caller of `uid` on connection 1.
fn table_for(config_text: &str, uid: u32) -> Reservations {
    let mut t = Reservations::new(config(config_text));
    t.tick(Duration::ZERO, capacity(4 * GIB));
    let peer = peer(uid, std::process::id() as i32);
    t.join(1, peer, Duration::ZERO);
    t
}

fn refusal(answer: Option<Response>) -> (RefusalReason, String) {
    match answer {
        Some(Response::Refused {
            reason, message, ..
        }) => (reason, message),
        other => panic!("not refused: {other:?}"),
    }
}

#[test]
fn a_permit_of_a_preallocating_engine_that_names_no_size_is_a_slot() {
    // The model's permits were seen to grow it by 3 GiB each (its warm-up, say)...
    let mut t = table();
    let plain = AcquireRequest {
        id: 1,
        model: Some("served".into()),
        timeout_ms: Some(0),
        ..Default::default()
    };
    let mut at = Duration::ZERO;
    let mut reading = |t: &mut Reservations, used_gib: u64| {
        at += Duration::from_millis(10);
        let mut c = capacity(used_gib * GIB);
        c.gpu_sampled_at = Some(at);
        t.tick(at, c);
        at
    };
    for id in 1..=SAMPLES_FOR_DEFAULT as u64 {
        let now = reading(&mut t, 4);
        reading(&mut t, 4);
        let Some(Response::Granted { permit, .. }) = t.acquire(1, ask(3, id), now) else {
            panic!("not granted");
        };
        reading(&mut t, 7);
        let now = reading(&mut t, 7);
        t.release_permit(1, 100 + id, permit, now);
        reading(&mut t, 4);
    }
    let granted = |answer: Option<Response>| match answer {
        Some(Response::Granted { gpu_bytes, .. }) => gpu_bytes,
        other => panic!("{other:?}"),
    };
    let now = reading(&mut t, 4);
    assert_eq!(
        granted(t.acquire(1, plain.clone(), now)),
        3 * GIB,
        "learned"
    );
    // ...but once its metrics show a preallocated KV cache, a permit is a slot.
    at += Duration::from_millis(10);
    let mut c = capacity(4 * GIB);
    c.gpu_sampled_at = Some(at);
    c.preallocated.insert("served".into());
    t.tick(at, c);
    let again = AcquireRequest { id: 2, ..plain };
    assert_eq!(granted(t.acquire(1, again, at)), 0);
}

#[test]
fn a_caller_the_scan_has_not_seen_yet_waits_for_one_to_find_its_model() {
    // A server of model "served" that started after the latest process scan asks at once,
    // naming no model: its pool is decided by the next scan, not by the host-wide pool.
    let mut t = table_for(
        "[[model]]\nname = \"served\"\nmatch = { comm = \"x\" }\nmax_permits = 1\n\
         users = [\"1001\"]\n",
        1001,
    );
    let connected = Duration::from_millis(5);
    let server = Peer {
        uid: 1001,
        pid: 77,
        start_time: 9,
    };
    t.join(2, server, connected);
    let ask = |id| AcquireRequest {
        id,
        gpu_bytes: Some(GIB),
        timeout_ms: Some(if id == 1 { 0 } else { 5000 }),
        ..Default::default()
    };
    // A uid that may be no model's member is answered at once (no scan is forced for it).
    let stranger = Peer {
        uid: 1002,
        pid: 78,
        start_time: 9,
    };
    t.join(3, stranger, connected);
    assert!(matches!(
        t.acquire(3, ask(9), connected),
        Some(Response::Refused {
            reason: RefusalReason::NotAllowed,
            ..
        })
    ));
    assert!(t.acquire(2, ask(1), connected).is_none(), "it waits");
    assert!(t.acquire(2, ask(2), connected).is_none());
    assert!(t.wants_fresh_scan());
    // Finding its model is not the caller's wait: a timeout of 0 still gets its answer.
    t.expire(connected + Duration::from_millis(100));
    assert!(mail(&mut t, 2).is_empty());
    // A scan older than the connection decides nothing.
    t.tick(connected, capacity(4 * GIB));
    assert!(mail(&mut t, 2).is_empty());
    assert!(t.wants_fresh_scan());
    // The next one has it in "served": one permit (max_permits 1), the other waits there.
    let mut scanned = capacity(4 * GIB);
    scanned.scanned_at = Some(connected);
    scanned.gpu_sampled_at = Some(connected);
    scanned.member_of.insert(server.process(), "served".into());
    t.tick(connected + Duration::from_millis(1), scanned);
    assert!(matches!(
        mail(&mut t, 2).as_slice(),
        [Response::Granted { id: 1, .. }]
    ));
    assert!(!t.wants_fresh_scan());
    let rows = t.rows(connected);
    let served = rows.permits.iter().find(|p| p.model == "served").unwrap();
    assert_eq!((served.held, served.waiting), (1, 1));
    // A caller in no model, once scanned, is refused the host-wide pool it may not use.
    assert!(t
        .acquire(1, ask(3), Duration::ZERO)
        .is_some_and(|r| matches!(
            r,
            Response::Refused {
                reason: RefusalReason::NotAllowed,
                ..
            }
        )));
    assert!(mail(&mut t, 1).is_empty());
}

#[test]
fn the_host_wide_pool_is_for_its_users_only() {
    let host = |id| AcquireRequest {
        id,
        gpu_bytes: Some(GIB),
        timeout_ms: Some(0),
        ..Default::default()
    };
    let mut t = table_for("", 1001);
    let (reason, message) = refusal(t.acquire(1, host(1), Duration::ZERO));
    assert_eq!(reason, RefusalReason::NotAllowed);
    assert!(message.contains("host-wide pool"), "{message}");
    // A system account neither (it may run a model server's downloaded code); root may.
    let mut t = table_for("", 999);
    assert_eq!(
        refusal(t.acquire(1, host(1), Duration::ZERO)).0,
        RefusalReason::NotAllowed
    );
    let mut t = table_for("", 0);
    assert!(matches!(
        t.acquire(1, host(1), Duration::ZERO),
        Some(Response::Granted { .. })
    ));
    let mut t = table_for("[permits]\nusers = [\"1001\"]\n", 1001);
    assert!(matches!(
        t.acquire(1, host(1), Duration::ZERO),
        Some(Response::Granted { .. })
    ));
}

#[test]
fn a_uid_holds_at_most_its_share_reserved_and_root_is_not_capped() {
    // Permits of the host-wide pool (no `[[model]]` names their users): capped.
    let text = "[clients]\nmax_reserved_per_uid = \"50%\"\n[permits]\nusers = [\"1001\"]\n";
    let ask = |id, gib| AcquireRequest {
        id,
        model: None,
        gpu_bytes: Some(gib * GIB),
        timeout_ms: Some(0),
        ..Default::default()
    };
    // Half of the 16 GiB card: 8 GiB.
    let mut t = table_for(text, 1001);
    assert!(matches!(
        t.acquire(1, ask(1, 6), Duration::ZERO),
        Some(Response::Granted { .. })
    ));
    // More than the share would ever allow: refused at once.
    let (reason, message) = refusal(t.acquire(1, ask(3, 9), Duration::ZERO));
    assert_eq!(reason, RefusalReason::TooLarge, "{message}");
    assert!(message.contains("max_reserved_per_uid"), "{message}");
    // Within the share but not beside what it holds: it waits, and times out saying why.
    assert_eq!(t.acquire(1, ask(2, 3), Duration::ZERO), None);
    t.expire(Duration::from_secs(1));
    let (_, message) = refusal(mail(&mut t, 1).into_iter().next());
    assert!(message.contains("max_reserved_per_uid"), "{message}");
    let mut t = table_for(text, 0);
    for id in 1..=2 {
        assert!(matches!(
            t.acquire(1, ask(id, 5), Duration::ZERO),
            Some(Response::Granted { .. })
        ));
    }
}

#[test]
fn a_launched_model_gives_permits_only_out_of_what_it_declared() {
    let mut t = table_for("", 1001);
    let launch = |gpu: Option<u64>| LaunchRequest {
        model: "mine".into(),
        gpu_memory_bytes: gpu,
        command: vec!["x".into()],
        ..Default::default()
    };
    let answer = t.launch(
        1,
        launch(None),
        Arc::new(FakeProcess::default()),
        Duration::ZERO,
    );
    assert!(
        matches!(answer, Some(Response::Admitted { .. })),
        "{answer:?}"
    );
    let ask = AcquireRequest {
        id: 1,
        model: Some("mine".into()),
        gpu_bytes: Some(GIB),
        timeout_ms: Some(0),
        ..Default::default()
    };
    let (reason, message) = refusal(t.acquire(1, ask, Duration::ZERO));
    assert_eq!(reason, RefusalReason::TooLarge, "{message}");
    assert!(message.contains("its launch declared"), "{message}");
}

#[test]
fn a_users_launch_never_holds_back_the_hosts_own() {
    let mut t = table_for("", 1001);
    let join = |t: &mut Reservations, conn: ConnId, uid: u32| {
        let peer = peer(uid, std::process::id() as i32);
        t.join(conn, peer, Duration::ZERO);
    };
    join(&mut t, 2, 999);
    join(&mut t, 3, 0);
    join(&mut t, 4, 0);
    join(&mut t, 5, 1002);
    let launch = |t: &mut Reservations, conn: ConnId, model: &str| {
        let request = LaunchRequest {
            model: model.into(),
            command: vec!["x".into()],
            ..Default::default()
        };
        t.launch(
            conn,
            request,
            Arc::new(FakeProcess::default()),
            Duration::ZERO,
        )
    };
    // A user's launch takes the lock and loads (for hours, say)...
    assert!(matches!(
        launch(&mut t, 1, "mine"),
        Some(Response::Admitted { .. })
    ));
    // ...another account's (a system account is no different) waits for it...
    assert!(matches!(
        launch(&mut t, 2, "theirs"),
        Some(Response::Queued { position: 1, .. })
    ));
    // ...but root's is not held back by it,
    assert!(matches!(
        launch(&mut t, 3, "host"),
        Some(Response::Admitted { .. })
    ));
    // and root's next, waiting for root's first to load, goes ahead of the others.
    assert!(matches!(
        launch(&mut t, 4, "host2"),
        Some(Response::Queued { position: 1, .. })
    ));
    assert_eq!(t.launch_queue[0].peer.uid, 0);
    assert_eq!(t.launch_queue[1].peer.uid, 999);
    // Behind others, a launch says it waits for its turn (not for what the head waits for).
    match launch(&mut t, 5, "late") {
        Some(Response::Queued {
            position,
            waiting_for,
        }) => {
            assert_eq!(position, 3);
            assert!(waiting_for.starts_with("its turn"), "{waiting_for}");
        }
        other => panic!("{other:?}"),
    }
}

/// Red-team finding 5: one user's request loop made thousands of warning events a second.
/// They are info, at most `limit::PER_UID` per uid and window are kept (so they cannot crowd
/// another user's events out of the table's per-tick cap), the rest are counted and summed up
/// once the window ends.
#[test]
fn one_uids_flood_of_timeouts_is_rate_limited_and_does_not_crowd_out_another_uids_events() {
    use super::limit::{PER_UID, WINDOW};
    let mut t = Reservations::new(config(
        "[[model]]\nname = \"served\"\nmatch = { comm = \"x\" }\nusers = [\"1001\", \"1002\"]\n",
    ));
    t.tick(Duration::ZERO, capacity(4 * GIB));
    for (conn, uid) in [(1, 1001), (2, 1002)] {
        let peer = peer(uid, uid as i32);
        t.join(conn, peer, Duration::ZERO);
    }
    let now = Duration::from_secs(1);
    // 1001: 1000 requests that can never be granted in time, in batches (its waiting cap).
    for batch in 0..10 {
        for id in 0..100 {
            assert_eq!(t.acquire(1, ask(14, batch * 100 + id + 1), now), None);
        }
        t.expire(now + Duration::from_secs(2));
    }
    // 1002: one of its own, which times out too.
    assert_eq!(t.acquire(2, ask(14, 1), now), None);
    t.expire(now + Duration::from_secs(2));
    let report = t.tick(now + Duration::from_secs(2), capacity(4 * GIB));
    let of = |uid| {
        report
            .events
            .iter()
            .filter(move |e| e.about.uid == Some(uid) && e.kind == EventKind::PermitTimedOut)
    };
    assert_eq!(of(1001).count(), PER_UID as usize);
    assert_eq!(of(1002).count(), 1, "the other uid's event is kept");
    assert!(of(1001)
        .chain(of(1002))
        .all(|e| e.severity == Severity::Info));
    assert_eq!(report.events_suppressed, 1000 - PER_UID as u64);
    assert!(report
        .events
        .iter()
        .all(|e| e.kind != EventKind::EventsDropped));
    // The window ends: one summary, for the uid that had events suppressed.
    let report = t.tick(WINDOW + Duration::from_secs(1), capacity(4 * GIB));
    let summaries: Vec<&Event> = report
        .events
        .iter()
        .filter(|e| e.kind == EventKind::EventsSuppressed)
        .collect();
    assert_eq!(summaries.len(), 1, "{summaries:?}");
    assert_eq!(summaries[0].about.uid, Some(1001));
    assert!(
        summaries[0]
            .message
            .contains("980 more events (permit_timed_out)"),
        "{}",
        summaries[0].message
    );
}

#[test]
fn cuda_visible_devices_naming_a_gpu_twice_is_refused_not_half_reserved() {
    let mut two = capacity(0);
    let mut second = two.gpus[0].clone();
    second.index = 1;
    second.uuid = "GPU-b".into();
    two.gpus.push(second);
    assert_eq!(parse_visible_devices("1, 0", &two), Ok(vec![1, 0]));
    assert_eq!(parse_visible_devices("GPU-b,0", &two), Ok(vec![1, 0]));
    let err = parse_visible_devices("0,0", &two).unwrap_err();
    assert!(err.contains("GPU 0 is named twice"), "{err}");
    let err = parse_visible_devices("GPU-a,0", &two).unwrap_err();
    assert!(err.contains("GPU 0 is named twice"), "{err}");
}

#[test]
fn permits_fill_the_room_then_wait_then_time_out_with_what_was_free() {
    let mut t = table();
    let now = Duration::from_secs(1);
    for id in 1..=3 {
        assert!(
            matches!(
                t.acquire(1, ask(3, id), now),
                Some(Response::Granted { .. })
            ),
            "{id}"
        );
    }
    // A tick with the same use keeps the baseline (the permits are not taken yet).
    t.tick(now, capacity(4 * GIB));
    assert_eq!(t.acquire(1, ask(3, 4), now), None, "waits");
    assert!(matches!(
        t.acquire(1, ask(20, 5), now),
        Some(Response::Refused {
            reason: RefusalReason::TooLarge,
            ..
        })
    ));
    t.expire(now + Duration::from_secs(2));
    match mail(&mut t, 1).remove(0) {
        Response::Refused {
            id, reason, free, ..
        } => {
            assert_eq!((id, reason), (Some(4), RefusalReason::Timeout));
            assert_eq!(free.gpu_bytes, Some(2 * GIB));
        }
        other => panic!("{other:?}"),
    }
}

/// A launch that does not fit waits its whole queue timeout, on the daemon clock, then is told
/// it timed out; it is never admitted.
#[test]
fn a_launch_that_does_not_fit_waits_its_queue_timeout_then_times_out() {
    let mut t = table();
    let request = LaunchRequest {
        model: "big".into(),
        gpu_memory_bytes: Some(14 * GIB),
        queue_timeout_ms: Some(2000),
        command: vec!["x".into()],
        ..Default::default()
    };
    let start = Duration::from_secs(1);
    let answer = t.launch(1, request, Arc::new(FakeProcess::default()), start);
    assert!(
        matches!(answer, Some(Response::Queued { position: 1, .. })),
        "{answer:?}"
    );
    t.expire(start + Duration::from_millis(1999));
    assert!(mail(&mut t, 1).is_empty());
    assert_eq!(t.launch_queue.len(), 1);
    t.expire(start + Duration::from_millis(2000));
    match mail(&mut t, 1).as_slice() {
        [Response::TimedOut { message }] => {
            assert!(message.contains("queue timeout of 2s"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert!(t.launch_queue.is_empty());
    assert!(t.holdings.is_empty());
}

/// Round three: accounts other than root filled permits.max_total with slots of their own model
/// (size 0: they always fit) and root's requests were refused. Root keeps its share.
#[test]
fn accounts_other_than_root_never_take_roots_share_of_permits() {
    let mut t = Reservations::new(config(
        "[[model]]\nname = \"served\"\nmatch = { comm = \"x\" }\nusers = [\"1001\", \"1002\", \"1003\"]\n\
         [permits]\nmax_per_uid = 2\nmax_total = 6\n",
    ));
    t.tick(Duration::ZERO, capacity(4 * GIB));
    for (conn, uid) in [(1, 1001), (2, 1002), (3, 1003), (4, 0)] {
        let peer = peer(uid, 100 + uid as i32);
        t.join(conn, peer, Duration::ZERO);
    }
    let slot = |id| AcquireRequest {
        id,
        model: Some("served".into()),
        gpu_bytes: Some(0),
        timeout_ms: Some(0),
        ..Default::default()
    };
    let mut granted = 0;
    for conn in 1..=3 {
        for id in 1..=2 {
            match t.acquire(conn, slot(id), Duration::ZERO) {
                Some(Response::Granted { .. }) => granted += 1,
                Some(Response::Refused { reason, .. }) => {
                    assert_eq!(reason, RefusalReason::QueueFull)
                }
                other => panic!("{other:?}"),
            }
        }
    }
    assert_eq!(granted, 4, "the others share 6 less root's 2");
    for id in 1..=2 {
        assert!(matches!(
            t.acquire(4, slot(id), Duration::ZERO),
            Some(Response::Granted { .. })
        ));
    }
}

/// Round three: on the default config, a user launched a model the config does not know with
/// most of the GPU declared (`--gpu-mem 65GiB`, a process that never touches the GPU) and held
/// root's launches back until its ready timeout. Half of the memory is all one account may hold
/// reserved by default; root, and a `[[model]]`'s users for that model, are not capped.
#[test]
fn by_default_one_account_cannot_declare_most_of_the_gpu_for_a_model_the_config_does_not_know() {
    let mut t = Reservations::new(config(
        "[[model]]\nname = \"served\"\nmatch = { comm = \"x\" }\nusers = [\"1001\"]\n",
    ));
    t.tick(Duration::ZERO, capacity(GIB));
    for (conn, uid) in [(1, 1001), (2, 0), (3, 1001)] {
        let peer = peer(uid, 100 + conn as i32);
        t.join(conn, peer, Duration::ZERO);
    }
    let launch = |t: &mut Reservations, conn, model: &str, gib| {
        let request = LaunchRequest {
            model: model.into(),
            gpu_memory_bytes: Some(gib * GIB),
            command: vec!["x".into()],
            ..Default::default()
        };
        t.launch(
            conn,
            request,
            Arc::new(FakeProcess::default()),
            Duration::ZERO,
        )
    };
    // 9 GiB of the 16 GiB card for an ad-hoc model: more than half, refused at once.
    let (reason, message) = refusal(launch(&mut t, 1, "mine", 9));
    assert_eq!(reason, RefusalReason::TooLarge, "{message}");
    assert!(message.contains("max_reserved_per_uid"), "{message}");
    // Root's launch of the same size is admitted.
    assert!(matches!(
        launch(&mut t, 2, "host", 9),
        Some(Response::Admitted { .. })
    ));
    // A user the config names for its model is bounded by the model's budget, not the cap.
    let mut t2 = Reservations::new(config(
        "[[model]]\nname = \"served\"\nmatch = { comm = \"x\" }\nusers = [\"1001\"]\n",
    ));
    t2.tick(Duration::ZERO, capacity(GIB));
    t2.join(3, peer(1001, 103), Duration::ZERO);
    assert!(matches!(
        launch(&mut t2, 3, "served", 9),
        Some(Response::Admitted { .. })
    ));
}

/// Round three: with no `[[model]]` for a name, the first launcher's declaration won while its
/// process lived: root's later launch of that name was refused, or admitted into the user's
/// model (the user's budget, pids and metrics URL). Another account's launched models are in
/// its own namespace: root's launch of the name is root's model.
#[test]
fn a_user_cannot_take_the_name_of_a_model_root_launches() {
    let mut t = table_for("", 1001);
    t.join(2, peer(0, 7), Duration::ZERO);
    let launch = |t: &mut Reservations, conn, gib| {
        let request = LaunchRequest {
            model: "llama".into(),
            gpu_memory_bytes: Some(gib * GIB),
            metrics_url: (conn == 1).then(|| "http://127.0.0.1:9/metrics".into()),
            command: vec!["x".into()],
            ..Default::default()
        };
        t.launch(
            conn,
            request,
            Arc::new(FakeProcess::default()),
            Duration::ZERO,
        )
    };
    let user = launch(&mut t, 1, 2);
    assert!(matches!(user, Some(Response::Admitted { .. })), "{user:?}");
    // Root's launch of the same name, bigger than the user declared, loads too (root's launch
    // lock is its own): as root's model, not the user's.
    let root = launch(&mut t, 2, 6);
    assert!(matches!(root, Some(Response::Admitted { .. })), "{root:?}");
    let mut models: Vec<String> = t
        .rows(Duration::ZERO)
        .leases
        .into_iter()
        .map(|l| l.model)
        .collect();
    models.sort();
    assert_eq!(models, ["llama", "llama@1001"]);
    let launched = &t.launched;
    assert_eq!(
        launched["llama@1001"].metrics_url.as_deref(),
        Some("http://127.0.0.1:9/metrics")
    );
    let owners = |name: &str| -> Vec<u32> {
        launched[name]
            .users
            .iter()
            .flatten()
            .map(|u| u.uid)
            .collect()
    };
    assert_eq!(
        (owners("llama"), owners("llama@1001")),
        (vec![0], vec![1001])
    );
    assert_eq!(launched["llama"].metrics_url, None);
    // The user's permits naming its model go to its own.
    let ask = AcquireRequest {
        id: 1,
        model: Some("llama".into()),
        gpu_bytes: Some(0),
        timeout_ms: Some(0),
        ..Default::default()
    };
    let answer = t.acquire(1, ask, Duration::ZERO);
    assert!(
        matches!(answer, Some(Response::Granted { .. })),
        "{answer:?}"
    );
    assert!(t
        .rows(Duration::ZERO)
        .permits
        .iter()
        .any(|p| p.model == "llama@1001" && p.held == 1));
}

/// Two workers of model "served" (pids 42 and 43, 2 GiB of weights each) on a 16 GiB GPU with a
/// 1 GiB floor, holding `a` and `b` GiB in all, in a reading sampled at `sampled_at`.
fn workers(a: u64, b: u64, sampled_at: Duration) -> Capacity {
    let mut c = capacity(a * GIB + b * GIB);
    let tree = |gib: u64, pid: i32| TreeUse {
        gpu_bytes: BTreeMap::from([(0, gib * GIB)]),
        members: pid as u64,
        ..Default::default()
    };
    c.trees = HashMap::from([
        (peer(0, 42).process(), tree(a, 42)),
        (peer(0, 43).process(), tree(b, 43)),
    ]);
    c.member_of = HashMap::from([
        (peer(0, 42).process(), "served".to_string()),
        (peer(0, 43).process(), "served".to_string()),
    ]);
    c.models.get_mut("served").expect("in capacity()").members = 2;
    c.gpu_sampled_at = Some(sampled_at);
    c.scanned_at = Some(sampled_at);
    c
}

/// Issue #22, forked workers with PyTorch's cache: a worker's permit ended while requests
/// waited, and nothing looked at the GPU again before the loop's next tick (200 ms while permits
/// are out): whether the ended permit's memory stayed cached for its worker or went back to the
/// driver decides the waiting requests, and until a reading says which, it stays promised. The
/// workers then took turns by ticks instead of by requests (1.0 s median where a per-worker
/// semaphore had 0.61 s). A permit that ends while others wait has a reading taken at once.
#[test]
fn a_permit_that_ends_while_others_wait_has_a_gpu_reading_taken_at_once() {
    let ms = Duration::from_millis;
    let mut t = table();
    t.join(2, peer(0, 43), Duration::ZERO);
    t.tick(ms(1), workers(2, 2, ms(1)));
    t.tick(ms(2), workers(2, 2, ms(2)));
    // Worker 42 takes two permits of 5 GiB (room: 16 - 4 - 1 = 11 GiB); worker 43 waits.
    let mut permits = Vec::new();
    for id in [1, 2] {
        match t.acquire(1, ask(5, id), ms(3)) {
            Some(Response::Granted { permit, .. }) => permits.push(permit),
            other => panic!("permit {id}: {other:?}"),
        }
    }
    assert_eq!(t.acquire(2, ask(5, 3), ms(3)), None, "no room left");
    t.tick(ms(10), workers(12, 2, ms(10)));
    assert!(
        !t.wants_fresh_gpu(),
        "nothing ended: the latest reading is as good as any"
    );

    // One of worker 42's permits ends; its 5 GiB are its cache now, or free: a reading says.
    let _ = t.release_permit(1, 1, permits[0], ms(20));
    assert!(t.wants_fresh_gpu(), "a permit ended while one waits");
    t.tick(ms(21), workers(12, 2, ms(15)));
    assert!(
        t.wants_fresh_gpu(),
        "a reading from before the end does not say"
    );
    // The reading after the end shows it cached (PyTorch keeps freed blocks): worker 42's
    // next request is served from it at once; worker 43's still waits (for a trim).
    t.tick(ms(22), workers(12, 2, ms(21)));
    assert!(!t.wants_fresh_gpu(), "the reading after the end is in");
    assert!(matches!(
        t.acquire(1, ask(5, 4), ms(23)),
        Some(Response::Granted { .. })
    ));
    assert!(!mail(&mut t, 2)
        .iter()
        .any(|r| matches!(r, Response::Granted { .. })));

    // Nobody waits: a permit that ends asks for nothing.
    let mut alone = table();
    alone.tick(ms(1), workers(2, 2, ms(1)));
    alone.tick(ms(2), workers(2, 2, ms(2)));
    let Some(Response::Granted { permit, .. }) = alone.acquire(1, ask(5, 1), ms(3)) else {
        panic!("granted");
    };
    let _ = alone.release_permit(1, 1, permit, ms(4));
    assert!(!alone.wants_fresh_gpu());
}

/// Seen on a real H200 with two forked workers: worker 43's books were let go while it held
/// nothing, its new baseline took its cache for weights (NVML cannot tell them apart), and no
/// hint went to it while worker 42 waited 10 s for the memory it kept. A process of the model
/// with nothing reserved is asked too: it keeps nothing a permit needs.
#[test]
fn a_starved_request_asks_idle_workers_to_give_back_what_they_may_cache() {
    let ms = Duration::from_millis;
    let mut t = table();
    t.join(2, peer(0, 43), Duration::ZERO);
    t.tick(ms(1), workers(2, 9, ms(1)));
    t.tick(ms(2), workers(2, 9, ms(2)));
    // Worker 43's permit is served from a cache NVML counts in its 9 GiB baseline.
    let Some(Response::Granted { permit, .. }) = t.acquire(2, ask(1, 7), ms(3)) else {
        panic!("granted");
    };
    t.tick(ms(4), workers(2, 9, ms(4)));
    let _ = t.release_permit(2, 7, permit, ms(5));
    t.tick(ms(6), workers(2, 9, ms(6)));
    t.tick(ms(7), workers(2, 9, ms(7)));
    let _ = mail(&mut t, 2);
    assert_eq!(
        t.acquire(1, ask(5, 1), ms(8)),
        None,
        "room: 16 - 11 - 1 = 4 GiB"
    );
    t.tick(ms(9), workers(2, 9, ms(9)));
    assert!(
        mail(&mut t, 2).is_empty(),
        "not at once: a report may be on its way"
    );
    t.tick(ms(1008), workers(2, 9, ms(1008)));
    let hints = mail(&mut t, 2);
    assert!(
        hints
            .iter()
            .any(|r| matches!(r, Response::Trim { gpu: 0, .. })),
        "{hints:?}"
    );
}

/// A server whose cache was warm before the daemon first saw it (a restart of either): NVML
/// shows it all as the server's own, and its requests waited for memory it kept itself (0/30
/// served, every one refused with backpressure). With nothing reserved, it is asked too.
#[test]
fn a_starved_request_with_nothing_reserved_asks_its_own_process_too() {
    let ms = Duration::from_millis;
    let mut t = table();
    t.tick(ms(1), workers(13, 0, ms(1)));
    t.tick(ms(2), workers(13, 0, ms(2)));
    let patient = AcquireRequest {
        timeout_ms: Some(5000),
        ..ask(3, 1)
    };
    assert_eq!(
        t.acquire(1, patient, ms(3)),
        None,
        "room: 16 - 13 - 1 = 2 GiB"
    );
    t.tick(ms(200), workers(13, 0, ms(200)));
    assert!(
        !mail(&mut t, 1)
            .iter()
            .any(|r| matches!(r, Response::Trim { .. })),
        "not within the first readings: most waits end there"
    );
    t.tick(ms(253), workers(13, 0, ms(253)));
    let hints = mail(&mut t, 1);
    assert!(
        hints
            .iter()
            .any(|r| matches!(r, Response::Trim { gpu: 0, .. })),
        "asked once it has waited BLIND_TRIM_AFTER: {hints:?}"
    );
    // It gave 9 GiB back: its baseline falls with it, and the request fits.
    t.tick(ms(255), workers(4, 0, ms(255)));
    assert!(mail(&mut t, 1)
        .iter()
        .any(|r| matches!(r, Response::Granted { id: 1, .. })));
}

/// A process whose allocator reports its cache is not asked blind (for "whatever you may
/// cache"): what it caches is known. A cache warm before its baseline is made of blocks of sizes
/// nobody saw, so its own request may fit none of them: it is asked to give back what it
/// reported (0.5 GiB), by name.
#[test]
fn a_process_that_reports_its_cache_is_asked_only_for_what_it_reported() {
    let ms = Duration::from_millis;
    let mut t = table();
    t.tick(ms(1), workers(13, 0, ms(1)));
    t.tick(ms(2), workers(13, 0, ms(2)));
    let reported = AcquireRequest {
        timeout_ms: Some(5000),
        cache_bytes: Some(GIB / 2),
        ..ask(3, 1)
    };
    assert_eq!(
        t.acquire(1, reported, ms(3)),
        None,
        "room: 16 - 13 - 1 = 2 GiB, and 0.5 GiB of its cache once a reading takes the report in"
    );
    t.tick(ms(1003), workers(13, 0, ms(1003)));
    let trims: Vec<u64> = mail(&mut t, 1)
        .iter()
        .filter_map(|r| match r {
            Response::Trim { bytes, .. } => Some(*bytes),
            _ => None,
        })
        .collect();
    assert_eq!(trims, [GIB / 2]);
}

/// Round three: an acquire with `timeout_ms: 0` that needs GPU memory was always refused: it
/// waits for a GPU reading newer than itself, which the protocol says a timeout of 0 still gets
/// ("only for what the daemon needs to decide, a few ms").
#[test]
fn a_timeout_of_zero_still_waits_for_the_gpu_reading_the_daemon_needs() {
    let mut t = table();
    let connected = Duration::from_millis(5);
    t.join(2, peer(0, 43), connected);
    let ask = AcquireRequest {
        timeout_ms: Some(0),
        ..ask(1, 1)
    };
    assert_eq!(
        t.acquire(2, ask, connected),
        None,
        "waits for a fresh reading"
    );
    assert!(t.wants_fresh_gpu());
    t.expire(connected + Duration::from_millis(100));
    assert!(
        mail(&mut t, 2).is_empty(),
        "not refused for the daemon's own wait"
    );
    let mut fresh = capacity(4 * GIB);
    fresh.gpu_sampled_at = Some(connected + Duration::from_millis(50));
    t.tick(connected + Duration::from_millis(120), fresh);
    assert!(matches!(
        mail(&mut t, 2).as_slice(),
        [Response::Granted { id: 1, .. }]
    ));
}

/// Round three: a user's launch had root poll a ready URL on the host's own non-loopback address
/// every 250 ms at a path of the user's choosing. An account other than root may name loopback
/// ready URLs only; root may name the host's addresses.
#[test]
fn only_root_may_have_a_ready_url_off_loopback_polled() {
    /// A host with 10.1.2.3 beside loopback.
    struct TestHost;
    impl gpuguard_core::host::HostFacts for TestHost {
        fn uid_of(&self, _: &str) -> Option<u32> {
            None
        }
        fn local_addresses(&self) -> Vec<std::net::IpAddr> {
            vec![[127, 0, 0, 1].into(), [10, 1, 2, 3].into()]
        }
    }
    gpuguard_core::host::install(Box::new(TestHost));
    let ip = std::net::IpAddr::from([10, 1, 2, 3]);
    let mut t = table_for("", 1001);
    t.join(2, peer(0, 7), Duration::ZERO);
    let launch = |t: &mut Reservations, conn, model: &str, url: String| {
        let request = LaunchRequest {
            model: model.into(),
            ready_url: Some(url),
            command: vec!["x".into()],
            ..Default::default()
        };
        t.launch(
            conn,
            request,
            Arc::new(FakeProcess::default()),
            Duration::ZERO,
        )
    };
    let off = format!("http://{ip}:8080/admin");
    let (reason, message) = refusal(launch(&mut t, 1, "mine", off.clone()));
    assert_eq!(reason, RefusalReason::Invalid, "{message}");
    assert!(message.contains("only a loopback address"), "{message}");
    let ok = launch(&mut t, 1, "mine", "http://127.0.0.1:8000/health".into());
    assert!(matches!(ok, Some(Response::Admitted { .. })), "{ok:?}");
    let root = launch(&mut t, 2, "host", off);
    assert!(matches!(root, Some(Response::Admitted { .. })), "{root:?}");
}

mod caching_workers;
mod never;
mod others;
mod properties;
mod security;

/// Issue 25: the host drains on a maintenance or preemption notice. A new request is refused at
/// once with the reason and a retry hint, one that waited is refused when the drain begins, and
/// a permit held stays held (and can be given back). A notice withdrawn lifts the drain.
#[test]
fn a_draining_host_refuses_new_and_waiting_requests_and_leaves_held_permits_alone() {
    let mut t = table();
    let Some(Response::Granted { permit, .. }) = t.acquire(1, ask(8, 1), Duration::ZERO) else {
        panic!("8 of 11 GiB of room");
    };
    assert_eq!(
        t.acquire(1, ask(8, 2), Duration::ZERO),
        None,
        "waits: 3 GiB of room"
    );
    t.drain(Some(Drain {
        reason: RefusalReason::HostMaintenance,
        message: "GCE: TERMINATE_ON_HOST_MAINTENANCE".into(),
        retry_after: Duration::from_secs(60),
    }));
    let waited = mail(&mut t, 1);
    assert!(
        matches!(
            &waited[..],
            [Response::Refused {
                id: Some(2),
                reason: RefusalReason::HostMaintenance,
                retry_after_ms: Some(60_000),
                ..
            }]
        ),
        "{waited:?}"
    );
    let now = t.acquire(1, ask(1, 3), Duration::ZERO);
    assert!(
        matches!(
            now,
            Some(Response::Refused {
                id: Some(3),
                reason: RefusalReason::HostMaintenance,
                retry_after_ms: Some(60_000),
                ..
            })
        ),
        "{now:?}"
    );
    // The held permit is untouched, and given back as usual.
    assert!(matches!(
        t.release_permit(1, 4, permit, Duration::ZERO),
        Response::Released { .. }
    ));
    // A launch is refused the same way.
    let launch = LaunchRequest {
        model: "big".into(),
        gpu_memory_bytes: Some(GIB),
        command: vec!["x".into()],
        ..Default::default()
    };
    let answer = t.launch(1, launch, Arc::new(FakeProcess::default()), Duration::ZERO);
    assert!(
        matches!(
            answer,
            Some(Response::Refused {
                reason: RefusalReason::HostMaintenance,
                ..
            })
        ),
        "{answer:?}"
    );
    t.drain(None);
    assert!(matches!(
        t.acquire(1, ask(8, 5), Duration::ZERO),
        Some(Response::Granted { .. })
    ));
}

/// Root's model (a `[[model]]` that names no users: root's and the system accounts') is not
/// another account's to steer: its launch is refused `NotAllowed`, saying so, whatever the
/// command, and so are its permits. Moved from the host suite
/// (`security::a_user_cannot_steer_the_guard_at_root_s_server`, its launch and permit half; its
/// forged command line half is `policy::tests::a_model_has_only_processes_of_its_users_whatever_
/// they_are_named`, the exit code 77 of a refusal the host's `permits` tests').
#[test]
fn another_account_may_neither_launch_nor_take_permits_of_roots_model() {
    let mut t = table_for(
        "[[model]]\nname = \"rootmodel\"\nmatch = { comm = \"x\" }\nram = \"1GiB\"\n\
         action = \"stop\"\n",
        1001,
    );
    let launch = LaunchRequest {
        model: "rootmodel".into(),
        command: vec!["/bin/true".into()],
        ..Default::default()
    };
    let (reason, message) =
        refusal(t.launch(1, launch, Arc::new(FakeProcess::default()), Duration::ZERO));
    assert_eq!(reason, RefusalReason::NotAllowed, "{message}");
    assert!(
        message.contains("uid 1001 may not launch model 'rootmodel'"),
        "{message}"
    );
    let permit = AcquireRequest {
        model: Some("rootmodel".into()),
        timeout_ms: Some(0),
        ..ask(1, 1)
    };
    let (reason, message) = refusal(t.acquire(1, permit, Duration::ZERO));
    assert_eq!(reason, RefusalReason::NotAllowed, "{message}");
    assert!(t.holdings.is_empty() && t.launch_queue.is_empty());
}

/// On the default config one account may hold at most half of the host's RAM reserved (the
/// RAM branch of `clients.max_reserved_per_uid`): a user's launch of a model the config does
/// not know, declaring 40 of 64 GiB, is refused at once, and root's launch is admitted. Moved
/// from the host suite (`security::a_users_declared_memory_cannot_hold_roots_launch_back`).
#[test]
fn one_account_cannot_declare_most_of_the_ram_and_roots_launch_goes_ahead() {
    let mut t = table_for("", 1001);
    t.join(2, peer(0, 7), Duration::ZERO);
    let launch = |t: &mut Reservations, conn, model: &str, gib| {
        let request = LaunchRequest {
            model: model.into(),
            ram_bytes: Some(gib * GIB),
            command: vec!["/bin/sleep".into(), "60".into()],
            ..Default::default()
        };
        t.launch(
            conn,
            request,
            Arc::new(FakeProcess::default()),
            Duration::ZERO,
        )
    };
    let (reason, message) = refusal(launch(&mut t, 1, "greedy", 40));
    assert_eq!(reason, RefusalReason::TooLarge, "{message}");
    assert!(
        message.contains("RAM") && message.contains("max_reserved_per_uid"),
        "{message}"
    );
    let root = launch(&mut t, 2, "roots", 12);
    assert!(matches!(root, Some(Response::Admitted { .. })), "{root:?}");
}

/// `capacity(4 GiB)` sampled at `at`, as the host suite's daemon saw it: the client on
/// connection 1 (pid 42) started the server, so its process tree holds the server's 4 GiB and
/// its permits are set against its own books (forgotten once at rest: two readings after its
/// last permit ended, with nothing of it kept).
fn started_the_server(at: Duration) -> Capacity {
    let mut c = capacity(4 * GIB);
    let tree = TreeUse {
        gpu_bytes: BTreeMap::from([(0, 4 * GIB)]),
        members: 1,
        by_model: BTreeMap::from([("served".to_string(), BTreeMap::from([(0, 4 * GIB)]))]),
        ..Default::default()
    };
    c.trees = HashMap::from([(peer(0, 42).process(), tree)]);
    c.gpu_sampled_at = Some(at);
    c.scanned_at = Some(at);
    c
}

/// Permits and a launch draw on the same room: beside an 8 GiB permit (11 GiB of room) a 6 GiB
/// launch waits, saying what the GPU has; the permit's end admits it, and its 6 GiB stay
/// reserved while it loads, which permits may not take (6 GiB times out with 5 GiB free; 5 GiB
/// is granted). Moved from the host suite (`permits`).
#[test]
fn permits_and_a_launch_compete_for_the_same_gpu() {
    let ms = Duration::from_millis;
    let mut t = table();
    t.tick(ms(1), started_the_server(ms(1)));
    t.join(2, peer(0, 43), ms(1));
    let Some(Response::Granted { permit, .. }) = t.acquire(1, ask(8, 1), ms(2)) else {
        panic!("8 of 11 GiB of room");
    };
    let launch = LaunchRequest {
        model: "other".into(),
        gpu_memory_bytes: Some(6 * GIB),
        queue_timeout_ms: Some(30_000),
        command: vec!["x".into()],
        ..Default::default()
    };
    match t.launch(2, launch, Arc::new(FakeProcess::default()), ms(2)) {
        Some(Response::Queued { waiting_for, .. }) => {
            assert!(waiting_for.contains("GPU 0: room 3.0 GiB"), "{waiting_for}")
        }
        other => panic!("{other:?}"),
    }
    let _ = t.release_permit(1, 2, permit, ms(3));
    // The loop's next readings (it ticks every 100 ms while a launch loads): the permit's 8 GiB
    // were never taken.
    for at in [ms(4), ms(5)] {
        t.tick(at, started_the_server(at));
    }
    let admitted = mail(&mut t, 2);
    assert!(
        matches!(admitted.as_slice(), [Response::Admitted { .. }]),
        "{admitted:?}"
    );
    let leases = t.rows(ms(4)).leases;
    assert!(
        matches!(leases.as_slice(), [l] if l.model == "other" && l.state == "loading"),
        "{leases:?}"
    );
    // Loading, the launch keeps its 6 GiB: a 6 GiB permit waits and times out.
    let six = AcquireRequest {
        timeout_ms: Some(300),
        ..ask(6, 3)
    };
    assert_eq!(t.acquire(1, six, ms(6)), None);
    t.expire(ms(306));
    match mail(&mut t, 1).as_slice() {
        [Response::Refused {
            reason,
            free,
            message,
            ..
        }] => {
            assert_eq!(*reason, RefusalReason::Timeout);
            assert_eq!(free.gpu_bytes, Some(5 * GIB), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        t.acquire(1, ask(5, 4), ms(307)),
        Some(Response::Granted { .. })
    ));
}

/// A model's `max_permits` bounds its permits however small (slots of size 0): the third waits
/// and times out saying so; a waiter is let in when one is given back; status shows the bound.
/// Moved from the host suite (`permits`).
#[test]
fn max_permits_limits_slots_and_releasing_one_lets_the_next_in() {
    let mut t = table_for(
        "[[model]]\nname = \"served\"\nmatch = { comm = \"x\" }\nmax_permits = 2\n",
        0,
    );
    t.join(2, peer(0, 43), Duration::ZERO);
    let slot = |id, timeout| AcquireRequest {
        id,
        model: Some("served".into()),
        gpu_bytes: Some(0),
        timeout_ms: Some(timeout),
        ..Default::default()
    };
    let now = Duration::from_secs(1);
    let Some(Response::Granted { permit: first, .. }) = t.acquire(1, slot(1, 1000), now) else {
        panic!("the first slot");
    };
    assert!(matches!(
        t.acquire(1, slot(2, 1000), now),
        Some(Response::Granted { .. })
    ));
    assert_eq!(t.acquire(1, slot(3, 200), now), None, "waits");
    t.expire(now + Duration::from_millis(200));
    let (reason, message) = refusal(mail(&mut t, 1).into_iter().next());
    assert_eq!(reason, RefusalReason::Timeout, "{message}");
    assert!(message.contains("max_permits 2"), "{message}");
    // Another client waits; a slot given back is its.
    assert_eq!(t.acquire(2, slot(1, 20_000), now), None);
    let rows = t.rows(now);
    let served = rows.permits.iter().find(|p| p.model == "served").unwrap();
    assert_eq!((served.held, served.waiting), (2, 1));
    t.release_permit(1, 4, first, now + Duration::from_millis(300));
    assert!(matches!(
        mail(&mut t, 2).as_slice(),
        [Response::Granted { id: 1, .. }]
    ));
    let rows = t.rows(now);
    let served = rows.permits.iter().find(|p| p.model == "served").unwrap();
    assert_eq!((served.held, served.waiting), (2, 0));
    assert_eq!(served.max_permits, Some(2));
}

/// A 16 GiB GPU as `capacity()`, with launched model "first" holding `first_gib` GiB of it, in
/// a reading sampled at `at`.
fn with_first(first_gib: u64, at: Duration) -> Capacity {
    let mut c = capacity(4 * GIB);
    c.gpus[0].free = Some((12 - first_gib) * GIB);
    c.models.insert(
        "first".into(),
        ModelUse {
            gpu_bytes: BTreeMap::from([(0, first_gib * GIB)]),
            members: 1,
            ..Default::default()
        },
    );
    c.gpu_sampled_at = Some(at);
    c.scanned_at = Some(at);
    c
}

fn launch_of(model: &str) -> LaunchRequest {
    LaunchRequest {
        model: model.into(),
        gpu_memory_bytes: Some(2 * GIB),
        command: vec!["x".into()],
        ..Default::default()
    }
}

/// The launch lock: a second launch waits for "the launch lock" while the first loads, and is
/// admitted once the first's GPU memory has grown and stayed flat for `settle` (1 s), not
/// sooner; the first's `launch_ready` is info. Moved from the host suite (`launch`); the
/// client's wording of `queued` stays with `launch::gpus_without_a_budget_are_placed_and_
/// queue_timeouts_are_answered`.
#[test]
fn second_launch_starts_only_after_the_first_is_ready() {
    let ms = Duration::from_millis;
    let mut t = table_for("[launch]\nsettle = \"1s\"\nready_timeout = \"60s\"\n", 0);
    t.join(2, peer(0, 43), Duration::ZERO);
    let first = t.launch(
        1,
        launch_of("first"),
        Arc::new(FakeProcess::default()),
        Duration::ZERO,
    );
    assert!(
        matches!(first, Some(Response::Admitted { .. })),
        "{first:?}"
    );
    match t.launch(
        2,
        launch_of("second"),
        Arc::new(FakeProcess::default()),
        Duration::ZERO,
    ) {
        Some(Response::Queued {
            position,
            waiting_for,
        }) => {
            assert_eq!(position, 1);
            assert!(waiting_for.starts_with("the launch lock"), "{waiting_for}");
        }
        other => panic!("{other:?}"),
    }
    // The first loads: nothing yet, then its 2 GiB at 500 ms, flat from there.
    let mut ready = Vec::new();
    for (at, gib) in [(100, 0), (500, 2), (1000, 2), (1499, 2)] {
        let report = t.tick(ms(at), with_first(gib, ms(at)));
        ready.extend(
            report
                .events
                .into_iter()
                .filter(|e| e.kind == EventKind::LaunchReady),
        );
        assert!(mail(&mut t, 2).is_empty(), "admitted at {at} ms");
    }
    assert!(ready.is_empty(), "{ready:?}");
    let report = t.tick(ms(1500), with_first(2, ms(1500)));
    assert!(matches!(
        mail(&mut t, 2).as_slice(),
        [Response::Admitted { .. }]
    ));
    let ready: Vec<&Event> = report
        .events
        .iter()
        .filter(|e| e.kind == EventKind::LaunchReady)
        .collect();
    assert_eq!(ready.len(), 1, "{ready:?}");
    assert_eq!(ready[0].severity, Severity::Info);
    assert_eq!(ready[0].about.pid, Some(std::process::id() as i32));
    assert!(
        ready[0].message.contains("stayed flat for 1s"),
        "{}",
        ready[0].message
    );
}

/// A loader that dies lets the next launch in at once, in the same tick: not at the end of its
/// 30 s settle or its ready timeout. `launch_died` comes before the second's admission, and the
/// first is never `launch_ready`. Moved from the host suite (`launch`); the real exit seen
/// through a pidfd is `ipc::peer::a_pidfd_reports_the_exit_of_its_process`.
#[test]
fn first_loader_crashing_lets_the_second_start_at_once() {
    let ms = Duration::from_millis;
    let mut t = table_for("[launch]\nsettle = \"30s\"\nready_timeout = \"60s\"\n", 0);
    t.join(2, peer(0, 43), Duration::ZERO);
    let loader = Arc::new(FakeProcess::default());
    let first = t.launch(1, launch_of("first"), loader.clone(), Duration::ZERO);
    assert!(
        matches!(first, Some(Response::Admitted { .. })),
        "{first:?}"
    );
    let second = t.launch(
        2,
        launch_of("second"),
        Arc::new(FakeProcess::default()),
        Duration::ZERO,
    );
    assert!(
        matches!(second, Some(Response::Queued { position: 1, .. })),
        "{second:?}"
    );
    let report = t.tick(ms(5), with_first(0, ms(5)));
    assert!(mail(&mut t, 2).is_empty(), "{:?}", report.events);
    loader
        .exited
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let report = t.tick(ms(10), with_first(0, ms(10)));
    assert!(matches!(
        mail(&mut t, 2).as_slice(),
        [Response::Admitted { .. }]
    ));
    let kinds: Vec<EventKind> = report.events.iter().map(|e| e.kind).collect();
    let died = kinds.iter().position(|k| *k == EventKind::LaunchDied);
    let admitted = report
        .events
        .iter()
        .position(|e| e.kind == EventKind::LaunchAdmitted && e.message.contains("'second'"));
    assert!(
        matches!((died, admitted), (Some(d), Some(a)) if d < a),
        "{:?}",
        report.events
    );
    assert!(!kinds.contains(&EventKind::LaunchReady), "{kinds:?}");
}

/// A launch carries the KV cache `gpuguard plan` planned (issue 27: a launched model had no
/// `[[model]]` to say it, so `status --model` could not set the engine's beside it): kept with
/// the launched model, also for a configured model whose block gives none; an impossible count
/// is refused naming the flag and the value.
#[test]
fn a_launch_carries_its_planned_kv_cache() {
    let mut t = table_for("[[model]]\nname = \"configured\"\n", 0);
    let launch = |t: &mut Reservations, planned| {
        let request = LaunchRequest {
            model: "configured".into(),
            gpu_memory_bytes: Some(GIB),
            planned_kv_tokens: planned,
            command: vec!["x".into()],
            ..Default::default()
        };
        t.launch(1, request, Arc::new(FakeProcess::default()), Duration::ZERO)
    };
    let (reason, message) = refusal(launch(&mut t, Some(0)));
    assert_eq!(reason, RefusalReason::Invalid);
    assert_eq!(
        message,
        "--planned-kv-tokens '0' must be between 1 and 2^40 tokens"
    );
    assert_eq!(
        ModelsInForce::new(&t.config, &t.launched).planned_kv_tokens("configured"),
        None
    );
    let admitted = launch(&mut t, Some(432_000));
    assert!(
        matches!(admitted, Some(Response::Admitted { .. })),
        "{admitted:?}"
    );
    let models = ModelsInForce::new(&t.config, &t.launched);
    assert_eq!(models.planned_kv_tokens("configured"), Some(432_000));
}
