//! Issue 41: what other accounts' reservations leave of everyone else's, root's first, with uids
//! as plain data. The mixed-sizes allowance is the holder's own, never its pool's other members';
//! reservations that no memory backs are bounded for all accounts other than root together.

use super::*;

const ALICE: u32 = 1001;
const BOB: u32 = 1002;

/// One 80 GiB card with 1 GiB used (by nobody who asks), a 10 GiB warn floor; no process of the
/// callers holds GPU memory (each `gpuguard permit -- CMD` before CMD allocates).
fn card_80() -> Capacity {
    let mut c = capacity(GIB);
    c.models.clear();
    c.gpus[0].total = Some(80 * GIB);
    c.gpus[0].free = Some(79 * GIB);
    c.gpus[0].floor = 10 * GIB;
    c
}

/// `config_text`'s ledger on `card_80`, with a caller of each of `uids` on connections 1, 2...
/// (pids 100, 101...).
fn ledger(config_text: &str, uids: &[u32]) -> Reservations {
    let mut t = Reservations::new(config(config_text));
    t.tick(Duration::ZERO, card_80());
    for (i, &uid) in uids.iter().enumerate() {
        t.join(i as ConnId + 1, peer(uid, 100 + i as i32), Duration::ZERO);
    }
    t
}

fn permit(model: Option<&str>, gib: u64, id: u64) -> AcquireRequest {
    AcquireRequest {
        id,
        model: model.map(String::from),
        gpu_bytes: Some(gib * GIB),
        timeout_ms: Some(0),
        ..Default::default()
    }
}

/// `request` on `conn`, refused: at once, or when its (zero) wait runs out.
fn refused(t: &mut Reservations, conn: ConnId, request: AcquireRequest) -> String {
    let answer = t.acquire(conn, request, Duration::ZERO).or_else(|| {
        t.expire(Duration::from_millis(1));
        mail(t, conn).pop()
    });
    refusal(answer).1
}

fn granted(answer: Option<Response>) -> u64 {
    match answer {
        Some(Response::Granted { permit, .. }) => permit,
        other => panic!("not granted: {other:?}"),
    }
}

#[test]
fn one_holders_large_permit_strands_nothing_for_the_other_holders_of_its_pool() {
    // The review: alice held a 35 GiB permit of the host-wide pool (within her cap); root's
    // 1 GiB permit was then refused, "room 0 B (free 79.0 GiB - floor 10.0 GiB - promised
    // 69.0 GiB)", while 35 GiB was reserved: alice's size counted as if root's 1 GiB might
    // split one of her 35 GiB segments.
    let mut t = ledger(
        "[permits]\nusers = [\"1001\", \"1002\"]\n",
        &[ALICE, 0, BOB, 0],
    );
    granted(t.acquire(1, permit(None, 35, 1), Duration::ZERO));
    granted(t.acquire(2, permit(None, 1, 1), Duration::ZERO));
    granted(t.acquire(3, permit(None, 1, 1), Duration::ZERO));
    // What is left, 79 - 10 - 37 = 32 GiB, goes to anyone, all of it.
    granted(t.acquire(4, permit(None, 32, 1), Duration::ZERO));
    let message = refused(&mut t, 3, permit(None, 1, 2));
    assert!(message.contains("room 0 B"), "{message}");
    assert!(message.contains("promised 69.0 GiB"), "{message}");
}

#[test]
fn one_users_large_permit_in_a_shared_model_leaves_the_others_what_is_free() {
    // The same in a [[model]] two users share: alice's 60 GiB permit, then bob's 1 GiB was
    // refused with "promised 119.0 GiB" where the room was 9 GiB.
    let shared = "[[model]]\nname = \"shared\"\nusers = [\"1001\", \"1002\"]\n\
                  match = { comm = \"x\" }\n";
    let mut t = ledger(shared, &[ALICE, BOB]);
    granted(t.acquire(1, permit(Some("shared"), 60, 1), Duration::ZERO));
    granted(t.acquire(2, permit(Some("shared"), 9, 1), Duration::ZERO));
}

#[test]
fn a_holders_own_mixed_sizes_still_keep_room_for_what_they_may_strand() {
    // The allowance stays with the holder that took both sizes: its 1 GiB request may split a
    // 35 GiB segment of its own, and 34 GiB of it is then neither free nor usable. Root's
    // 1 GiB beside it strands nothing.
    let mut t = ledger("[permits]\nusers = [\"1001\"]\n", &[ALICE, 0]);
    granted(t.acquire(1, permit(None, 35, 1), Duration::ZERO));
    let message = refused(&mut t, 1, permit(None, 1, 2));
    assert!(message.contains("promised 69.0 GiB"), "{message}");
    granted(t.acquire(2, permit(None, 1, 1), Duration::ZERO));
}

fn launch(t: &mut Reservations, conn: ConnId, model: &str, gib: u64) -> Option<Response> {
    let request = LaunchRequest {
        model: model.into(),
        gpu_memory_bytes: Some(gib * GIB),
        command: vec!["serve".into()],
        ..Default::default()
    };
    t.launch(
        conn,
        request,
        Arc::new(FakeProcess::default()),
        Duration::ZERO,
    )
}

#[test]
fn accounts_other_than_root_never_reserve_roots_share_with_memory_they_do_not_use() {
    // The review: bob launched a model declaring 34 GiB, released it, and kept renewing a
    // 34 GiB permit of it; alice launched one declaring 34 GiB that never loads. Each within
    // its own cap (half the card), together 68 of the 69 GiB above the floor with 1 GiB used:
    // root's 10 GiB launch and root's permit waited out their timeouts (exit 75).
    let mut t = ledger("", &[BOB, ALICE, 0, 0]);
    let lease = match launch(&mut t, 1, "m", 34) {
        Some(Response::Admitted { lease, .. }) => lease,
        other => panic!("bob's launch: {other:?}"),
    };
    t.release_lease(peer(BOB, 100), lease, Duration::ZERO);
    let mut later = card_80();
    later.gpu_sampled_at = Some(Duration::from_millis(1));
    t.tick(Duration::from_millis(1), later);
    granted(t.acquire(1, permit(Some("m"), 34, 1), Duration::ZERO));
    match launch(&mut t, 2, "never", 34) {
        Some(Response::Queued { waiting_for, .. }) => assert!(
            waiting_for.contains("34.0 GiB reserved and not in use + 34.0 GiB asked > 40.0 GiB")
                && waiting_for.contains("clients.max_reserved"),
            "{waiting_for}"
        ),
        other => panic!("alice's launch: {other:?}"),
    }
    // Root's launch and root's permit find the memory the others' cap leaves them.
    let admitted = launch(&mut t, 3, "roots", 10);
    assert!(
        matches!(admitted, Some(Response::Admitted { .. })),
        "{admitted:?}"
    );
    granted(t.acquire(4, permit(None, 10, 1), Duration::ZERO));
}

#[test]
fn one_users_subordinate_uids_share_the_others_cap() {
    // Two uids of one person (or two accounts) each within their own cap: together they may
    // not promise more than the others' share.
    let mut t = ledger(
        "[permits]\nusers = [\"1001\", \"1003\"]\n",
        &[ALICE, 1003, 0],
    );
    granted(t.acquire(1, permit(None, 30, 1), Duration::ZERO));
    let message = refused(&mut t, 2, permit(None, 30, 1));
    assert!(message.contains("(clients.max_reserved)"), "{message}");
    granted(t.acquire(3, permit(None, 30, 1), Duration::ZERO));
}

#[test]
fn memory_their_processes_took_no_longer_counts_against_the_others_share() {
    // Alice's process holds 4 GiB of weights and grows into its 30 GiB permit: what it took
    // backs the permit, and bob's 30 GiB fits the others' share beside it.
    let mut t = ledger("[permits]\nusers = [\"1001\", \"1002\"]\n", &[ALICE, BOB]);
    let alice = |held_gib: u64, at_ms: u64| {
        let mut c = card_80();
        c.gpus[0].free = Some((79 - held_gib) * GIB);
        let tree = TreeUse {
            gpu_bytes: BTreeMap::from([(0, held_gib * GIB)]),
            members: 1,
            ..Default::default()
        };
        c.trees.insert(peer(ALICE, 100).process(), tree);
        c.gpu_sampled_at = Some(Duration::from_millis(at_ms));
        c
    };
    t.tick(Duration::from_millis(1), alice(4, 1));
    let now = Duration::from_millis(2);
    granted(t.acquire(1, permit(None, 30, 1), now));
    let message = refused(&mut t, 2, permit(None, 30, 1));
    assert!(message.contains("(clients.max_reserved)"), "{message}");
    t.tick(Duration::from_millis(3), alice(34, 3));
    granted(t.acquire(2, permit(None, 30, 2), Duration::from_millis(3)));
}
