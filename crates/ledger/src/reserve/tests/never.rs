//! Issue 40: what can never fit on this host is refused within one round trip, with its typed
//! reason, wherever it is: a request whose caller's model is not known yet, one that turns out
//! never to fit once its model is found, a launch asking for a GPU on a host without one (it
//! holds back no launch behind it). What is only unknown yet (GPUs not read, a reading stale)
//! still waits: it may fit later.

use super::*;

/// The host as `capacity` has it, but with no GPU, for `why` (`None`: none read yet).
fn without_gpus(why: Option<&str>) -> Capacity {
    Capacity {
        gpus: Vec::new(),
        no_gpu: why.map(String::from),
        models: HashMap::new(),
        ..capacity(0)
    }
}

/// A launch of `model` asking `gpu_gib` of GPU memory and 1 GiB of RAM, for up to 30 min.
fn launch_of(model: &str, gpu_gib: Option<u64>) -> LaunchRequest {
    LaunchRequest {
        model: model.into(),
        gpu_memory_bytes: gpu_gib.map(|g| g * GIB),
        ram_bytes: Some(GIB),
        queue_timeout_ms: Some(30 * 60 * 1000),
        command: vec!["x".into()],
        ..Default::default()
    }
}

fn launch(
    t: &mut Reservations,
    conn: ConnId,
    request: LaunchRequest,
    now: Duration,
) -> Option<Response> {
    t.launch(conn, request, Arc::new(FakeProcess::default()), now)
}

/// `gpuguard permit --ram 1TiB -- true` as root: a process the latest scan has not seen, naming
/// no model, on a host with a `[[model]]` root may belong to. Its model is looked for by the
/// next scan, but no pool has a TiB of RAM: refused at once (on main it waited for the scan, and
/// then its whole timeout, as if it might fit).
#[test]
fn a_permit_that_can_never_fit_is_refused_at_once_while_its_callers_model_is_looked_for() {
    let mut t = table();
    let connected = Duration::from_millis(5);
    let fresh = Peer {
        uid: 0,
        pid: 77,
        start_time: 9,
    };
    t.join(2, fresh, connected);
    let ask = |id, gpu_gib: Option<u64>, ram_gib| AcquireRequest {
        id,
        gpu_bytes: gpu_gib.map(|g| g * GIB),
        ram_bytes: Some(ram_gib * GIB),
        timeout_ms: Some(600_000),
        ..Default::default()
    };
    // What fits somewhere waits for the scan, as before.
    assert_eq!(t.acquire(2, ask(1, None, 1), connected), None);
    assert!(t.wants_fresh_scan());
    for (id, gpu_gib, ram_gib, short) in [(2, None, 1024, "RAM"), (3, Some(20), 0, "GPU")] {
        let Some(Response::Refused {
            reason,
            message,
            retry_after_ms,
            needed,
            ..
        }) = t.acquire(2, ask(id, gpu_gib, ram_gib), connected)
        else {
            panic!("request {id} was not refused at once");
        };
        assert_eq!(reason, RefusalReason::TooLarge, "{message}");
        assert!(message.contains("can never fit"), "{message}");
        assert!(message.contains(short), "{message}");
        assert_eq!(retry_after_ms, None, "retrying here is pointless");
        assert_eq!(needed.ram_bytes, ram_gib * GIB);
    }
    let waiting: usize = t.waiting.values().map(VecDeque::len).sum();
    assert_eq!(waiting, 1, "only the one that may fit waits");
}

/// A request whose model the scan finds only after it arrived, and which can never fit that
/// model (above its budget, or a model of no permits), is refused when it is found, not at its
/// timeout: on main it waited there as if it might.
#[test]
fn a_request_that_can_never_fit_its_model_once_found_is_refused_when_it_is_found() {
    let mut t = table_for(
        "[[model]]\nname = \"served\"\nmatch = { comm = \"x\" }\ngpu_memory = \"8GiB\"\n\
         users = [\"1001\"]\n\
         [[model]]\nname = \"none\"\nmatch = { comm = \"y\" }\nmax_permits = 0\n\
         users = [\"1001\"]\n",
        1001,
    );
    let connected = Duration::from_millis(5);
    let server = Peer {
        uid: 1001,
        pid: 77,
        start_time: 9,
    };
    let other = Peer { pid: 78, ..server };
    t.join(2, server, connected);
    t.join(3, other, connected);
    let ask = |id, gib| AcquireRequest {
        id,
        gpu_bytes: Some(gib * GIB),
        timeout_ms: Some(600_000),
        ..Default::default()
    };
    // 10 GiB fits the 16 GiB card, so it waits for its model; 5 GiB of "none" may too.
    assert_eq!(t.acquire(2, ask(1, 10), connected), None);
    assert_eq!(t.acquire(3, ask(1, 5), connected), None);
    let mut scanned = capacity(4 * GIB);
    scanned.scanned_at = Some(connected);
    scanned.gpu_sampled_at = Some(connected);
    scanned.member_of.insert(server.process(), "served".into());
    scanned.member_of.insert(other.process(), "none".into());
    t.tick(connected + Duration::from_millis(1), scanned);
    let (reason, message) = refusal(mail(&mut t, 2).into_iter().next());
    assert_eq!(reason, RefusalReason::TooLarge, "{message}");
    assert!(
        message.contains("served: can never fit") && message.contains("budget 8.0 GiB"),
        "{message}"
    );
    let (reason, message) = refusal(mail(&mut t, 3).into_iter().next());
    assert_eq!(reason, RefusalReason::TooLarge, "{message}");
    assert!(message.contains("max_permits is 0"), "{message}");
    assert!(t.waiting.is_empty(), "nothing is left waiting");
}

/// A request that waits while what it needs is there, and that the host then says it can never
/// have (NVML said no driver after it arrived; a config reload lowered a budget), leaves its
/// queue at once, wherever it stood in it: it does not head a queue until its timeout.
#[test]
fn a_waiting_request_that_turns_never_fit_leaves_its_queue_at_once() {
    let mut t = table();
    let now = Duration::from_millis(1);
    t.tick(now, without_gpus(None));
    t.join(2, peer(0, 43), Duration::ZERO);
    let served = |id, gpu_gib, ram_gib| AcquireRequest {
        ram_bytes: Some(ram_gib * GIB),
        timeout_ms: Some(600_000),
        ..ask(gpu_gib, id)
    };
    // The GPUs are not read yet: a GPU request waits, a RAM request behind it too (its turn).
    assert_eq!(t.acquire(1, served(1, 3, 0), now), None);
    assert_eq!(t.acquire(2, served(1, 0, 1), now), None);
    t.tick(
        now,
        without_gpus(Some("NVML library not loadable: no NVIDIA driver?")),
    );
    let (reason, message) = refusal(mail(&mut t, 1).into_iter().next());
    assert_eq!(reason, RefusalReason::TooLarge, "{message}");
    assert!(
        message.contains("NVML library not loadable: no NVIDIA driver?"),
        "{message}"
    );
    assert!(
        matches!(
            mail(&mut t, 2).as_slice(),
            [Response::Granted { id: 1, .. }]
        ),
        "the request behind it is let in"
    );
}

/// `gpuguard launch --gpu-mem 20GiB` on a host without a GPU: refused at once, and a launch
/// queued behind one that turns out never to fit is admitted (on main the first headed the
/// queue for its 30 min and every launch behind it waited).
#[test]
fn a_launch_asking_for_a_gpu_on_a_host_without_one_is_refused_at_once_and_blocks_no_one() {
    let mut t = table();
    let now = Duration::from_millis(1);
    t.tick(now, without_gpus(Some("GPU support is disabled by config")));
    t.join(2, peer(0, 43), Duration::ZERO);
    let (reason, message) = refusal(launch(&mut t, 1, launch_of("big", Some(20)), now));
    assert_eq!(reason, RefusalReason::TooLarge, "{message}");
    assert!(
        message.contains("can never fit") && message.contains("no GPU"),
        "{message}"
    );
    assert!(t.launch_queue.is_empty());

    // While NVML has not answered, the GPUs are unknown: the launch waits, and so does a launch
    // that needs no GPU behind it.
    let mut t = table();
    t.tick(now, without_gpus(None));
    t.join(2, peer(0, 43), Duration::ZERO);
    let first = launch(&mut t, 1, launch_of("big", Some(20)), now);
    assert!(matches!(first, Some(Response::Queued { .. })), "{first:?}");
    let second = launch(&mut t, 2, launch_of("small", None), now);
    assert!(
        matches!(second, Some(Response::Queued { position: 2, .. })),
        "{second:?}"
    );
    // NVML then says there is no driver: the first is refused at once and the second let in.
    let later = now + Duration::from_millis(200);
    t.tick(
        later,
        without_gpus(Some("NVML library not loadable: no NVIDIA driver?")),
    );
    let (reason, message) = refusal(mail(&mut t, 1).into_iter().next());
    assert_eq!(reason, RefusalReason::TooLarge, "{message}");
    assert!(
        message.contains("NVML library not loadable: no NVIDIA driver?"),
        "{message}"
    );
    assert!(
        matches!(mail(&mut t, 2).as_slice(), [Response::Admitted { .. }]),
        "the launch behind it is not held back"
    );
    assert!(t.launch_queue.is_empty());
}

/// Unknown is not never: with the GPUs not read yet (NVML starting), or a GPU whose reading is
/// unknown, a GPU request waits; it is decided once the GPUs are read. A stale reading of a GPU
/// (its free memory unknown) still knows its size: what fits it waits.
#[test]
fn a_gpu_request_waits_while_the_gpus_are_unknown_or_stale() {
    let mut t = table();
    let now = Duration::from_millis(1);
    t.tick(now, without_gpus(None));
    assert_eq!(t.acquire(1, ask(20, 1), now), None, "no GPU read yet");
    let queued = launch(&mut t, 1, launch_of("big", Some(20)), now);
    assert!(
        matches!(queued, Some(Response::Queued { .. })),
        "{queued:?}"
    );
    // A second GPU that NVML cannot read (lost, failing): it may be large.
    let mut unknown = capacity(4 * GIB);
    unknown.gpus.push(GpuCapacity {
        index: 1,
        uuid: "GPU-b".into(),
        total: None,
        free: None,
        floor: GIB,
        usable: false,
    });
    t.tick(now, unknown);
    assert_eq!(t.acquire(1, ask(20, 2), now), None, "GPU 1 may be large");
    assert!(mail(&mut t, 1).is_empty(), "nothing was refused");
    assert_eq!(t.launch_queue.len(), 1);
    // Once the GPUs are read, 20 GiB can never fit on the 16 GiB card: every such request is
    // refused.
    t.tick(now, capacity(4 * GIB));
    let refused: Vec<(Option<u64>, RefusalReason)> = mail(&mut t, 1)
        .into_iter()
        .filter_map(|r| match r {
            Response::Refused { id, reason, .. } => Some((id, reason)),
            _ => None,
        })
        .collect();
    assert_eq!(
        refused,
        [
            (Some(1), RefusalReason::TooLarge),
            (Some(2), RefusalReason::TooLarge),
            (None, RefusalReason::TooLarge)
        ]
    );

    let mut t = table();
    let mut stale = capacity(4 * GIB);
    stale.gpus[0].usable = false;
    t.tick(now, stale);
    assert_eq!(t.acquire(1, ask(3, 1), now), None, "a stale reading waits");
    t.tick(now, capacity(4 * GIB));
    assert!(matches!(
        mail(&mut t, 1).as_slice(),
        [Response::Granted { id: 1, .. }]
    ));
}

/// The reason a full queue gives comes from what the request was short of, not from its words:
/// a model whose name says "max_permits" is refused for its queue, and one whose slots are
/// taken for them (on main the first was called `max_permits`, read out of its message).
#[test]
fn a_full_queue_refuses_for_what_was_short_not_for_what_the_message_says() {
    let mut t = table_for(
        "[permits]\nqueue = 1\n\
         [[model]]\nname = \"max_permits\"\nmatch = { comm = \"x\" }\ngpu_memory = \"12GiB\"\n\
         [[model]]\nname = \"slots\"\nmatch = { comm = \"y\" }\nmax_permits = 1\n",
        0,
    );
    let now = Duration::from_secs(1);
    let ask = |id, model: &str, gib| AcquireRequest {
        id,
        model: Some(model.into()),
        gpu_bytes: Some(gib * GIB),
        timeout_ms: Some(60_000),
        ..Default::default()
    };
    // "max_permits"'s budget is short (its message names the model): one waits, the next
    // finds the queue full.
    assert!(matches!(
        t.acquire(1, ask(1, "max_permits", 10), now),
        Some(Response::Granted { .. })
    ));
    assert_eq!(t.acquire(1, ask(2, "max_permits", 10), now), None);
    let (reason, message) = refusal(t.acquire(1, ask(3, "max_permits", 10), now));
    assert_eq!(reason, RefusalReason::QueueFull, "{message}");
    // The slots of "slots" are taken: the one past its queue is refused for them.
    assert!(matches!(
        t.acquire(1, ask(4, "slots", 0), now),
        Some(Response::Granted { .. })
    ));
    assert_eq!(t.acquire(1, ask(5, "slots", 0), now), None);
    let (reason, message) = refusal(t.acquire(1, ask(6, "slots", 0), now));
    assert_eq!(reason, RefusalReason::MaxPermits, "{message}");
}
