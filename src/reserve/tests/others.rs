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
