//! Issue #11's bounds on what one account may ask of the ledger, with uids as plain data: moved
//! from the host suite's `security` tests, which keep what crosses the real socket (a flood of
//! oversized lines against the daemon's real memory, connections that stop reading).

use super::*;

/// A user (uid 1001) the host-wide permit pool admits, under the caps of the host test.
const CAPS: &str = "[launch]\nmax_ready_timeout = \"1h\"\n\
    [clients]\nmax_launches_per_uid = 2\nmax_leases_per_uid = 2\n\
    [permits]\nmax_per_uid = 3\nusers = [\"1001\"]\n";

fn user() -> Peer {
    peer(1001, std::process::id() as i32)
}

fn launch(t: &mut Reservations, request: LaunchRequest) -> Option<Response> {
    t.launch(1, request, Arc::new(FakeProcess::default()), Duration::ZERO)
}

fn named(model: &str) -> LaunchRequest {
    LaunchRequest {
        model: model.into(),
        command: vec!["x".into()],
        ..Default::default()
    }
}

/// The lease of `model` (the user's: `model@1001`).
fn lease(t: &Reservations, model: &str) -> crate::status::LeaseRow {
    let name = format!("{model}@1001");
    t.rows(Duration::ZERO)
        .leases
        .into_iter()
        .find(|l| l.model == name)
        .unwrap_or_else(|| panic!("no lease of {name}"))
}

/// What one account sends is bounded: a model name past 128 characters, a launch of 8 EiB or of
/// more RAM than the host has, are refused at once; a ready timeout of `u64::MAX` is capped by
/// the config. Moved from the host suite
/// (`security::what_a_user_sends_is_bounded_and_the_daemon_stays_small_and_answers`).
#[test]
fn a_users_oversized_requests_are_refused_or_capped() {
    let mut t = table_for(CAPS, 1001);
    let (reason, message) = refusal(launch(&mut t, named(&"m".repeat(200))));
    assert_eq!(reason, RefusalReason::Invalid, "{message}");
    assert!(message.contains("1 to 128 characters"), "{message}");
    for (bytes, want) in [
        (9223372036854775807u64, RefusalReason::Invalid),
        (1u64 << 40, RefusalReason::TooLarge),
    ] {
        let request = LaunchRequest {
            ram_bytes: Some(bytes),
            ..named("huge")
        };
        let (reason, message) = refusal(launch(&mut t, request));
        assert_eq!(reason, want, "{bytes}: {message}");
    }
    let capped = LaunchRequest {
        ready_timeout_ms: Some(u64::MAX),
        ..named("capped")
    };
    let answer = launch(&mut t, capped);
    assert!(
        matches!(answer, Some(Response::Admitted { .. })),
        "{answer:?}"
    );
    assert_eq!(lease(&t, "capped").ready_timeout_seconds, 3600.0);
}

/// A ready URL nobody answers is polled while its launch loads, and no longer once the lease
/// is released; the models released keep running and count: two launched models of one account
/// still running, its third is refused (`max_leases_per_uid`); two launches waiting or loading,
/// its third is refused (`max_launches_per_uid`); its fourth permit is refused (`max_per_uid`
/// 3). Moved from the host suite
/// (`security::what_a_user_sends_is_bounded_and_the_daemon_stays_small_and_answers`; the exit
/// code 75 of a `queue_full` refusal is the CLI's mapping).
#[test]
fn one_accounts_launches_leases_and_permits_stop_at_its_caps() {
    let mut t = table_for(CAPS, 1001);
    let release = |t: &mut Reservations, model: &str| {
        let id = lease(t, model).lease;
        let answer = t.release_lease(user(), id, Duration::ZERO);
        assert!(
            !matches!(answer, Response::Error { .. } | Response::Refused { .. }),
            "{answer:?}"
        );
    };
    let admitted = launch(&mut t, named("capped"));
    assert!(
        matches!(admitted, Some(Response::Admitted { .. })),
        "{admitted:?}"
    );
    // The launch lock is one: "polled" waits for "capped".
    let polled = LaunchRequest {
        ready_url: Some("http://127.0.0.1:9/health".into()),
        ..named("polled")
    };
    let queued = launch(&mut t, polled);
    assert!(
        matches!(queued, Some(Response::Queued { .. })),
        "{queued:?}"
    );
    // Two launches of the account waiting or loading: the third is refused.
    let (reason, message) = refusal(launch(&mut t, named("third")));
    assert_eq!(reason, RefusalReason::QueueFull, "{message}");
    assert!(message.contains("max_launches_per_uid"), "{message}");
    release(&mut t, "capped");
    t.tick(Duration::ZERO, capacity(4 * GIB));
    let l = lease(&t, "polled");
    assert!(l.polling_ready_url && l.state == "loading", "{l:?}");
    release(&mut t, "polled");
    let l = lease(&t, "polled");
    assert!(!l.polling_ready_url && l.state == "ready", "{l:?}");
    // Both still run: a third launched model is refused while they do.
    let (reason, message) = refusal(launch(&mut t, named("third")));
    assert_eq!(reason, RefusalReason::QueueFull, "{message}");
    assert!(message.contains("max_leases_per_uid"), "{message}");
    // Permits of the host-wide pool: the fourth at once is refused.
    let answers: Vec<Option<Response>> = (1..=4)
        .map(|id| {
            let ask = AcquireRequest {
                id,
                gpu_bytes: Some(0),
                timeout_ms: Some(0),
                ..Default::default()
            };
            t.acquire(1, ask, Duration::ZERO)
        })
        .collect();
    assert!(
        answers[..3]
            .iter()
            .all(|a| matches!(a, Some(Response::Granted { .. }))),
        "{answers:?}"
    );
    let (reason, message) = refusal(answers[3].clone());
    assert_eq!(reason, RefusalReason::QueueFull, "{message}");
}

/// Round four: a user's metrics URL with a bidirectional override reached root's terminal
/// through `status --model`. A URL a client gives is printable ASCII, or the launch is refused
/// saying which character.
#[test]
fn a_users_url_with_a_bidi_override_is_refused_saying_so() {
    for (ready, metrics) in [
        (Some("http://127.0.0.1:9/\u{202e}htlaeh"), None),
        (None, Some("http://127.0.0.1:9/\u{202e}scirtem")),
    ] {
        let mut t = table_for("", 1001);
        let request = LaunchRequest {
            ready_url: ready.map(String::from),
            metrics_url: metrics.map(String::from),
            ..named("bidi")
        };
        let (reason, message) = refusal(launch(&mut t, request));
        assert_eq!(reason, RefusalReason::Invalid, "{message}");
        assert!(
            message.contains("'\\u{202e}' is not printable ASCII"),
            "{message}"
        );
    }
}

/// A user's ready URL off this host (a documentation address no interface has) is refused,
/// saying so. Moved from the host suite
/// (`security::connections_that_stop_reading_stay_counted_and_are_closed`, its tail; a permit
/// of the host-wide pool for an account it does not name is `the_host_wide_pool_is_for_its_
/// users_only`).
#[test]
fn a_users_ready_url_off_this_host_is_refused_saying_so() {
    let mut t = table_for("", 1001);
    let request = LaunchRequest {
        ready_url: Some("http://192.0.2.7/health".into()),
        ..named("far")
    };
    let (reason, message) = refusal(launch(&mut t, request));
    assert_eq!(reason, RefusalReason::Invalid, "{message}");
    assert!(
        message.contains("is not an address of this host"),
        "{message}"
    );
}
