//! Alerts from whole ticks on the driven clock: what a webhook and the event log are handed
//! (tapped queues in place of HTTP and the file, whose delivery is the host suite's `alerts`).

use std::sync::Arc;

use super::*;
use crate::alert::queue::Queue;
use crate::alert::{Notice, Status};

/// Everything queued so far, in order.
fn drain(q: &Arc<Queue<Notice>>) -> Vec<Notice> {
    let mut out = Vec::new();
    while !q.is_empty() {
        out.extend(q.pop());
        q.done();
    }
    out
}

/// A model over its RAM budget with `action = "alert"` for 3.5 s of ticks, then gone: the webhook
/// hears the condition fire once, repeat once per `repeat_interval` (not once per tick) and
/// resolve once, and the enforcement once; the event log keeps each transition, never a repeat.
/// Moved from the host suite (`alerts`), where the count of repeats was bounded by wall time.
#[test]
fn a_budget_condition_fires_once_repeats_each_interval_and_resolves() {
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        ..World::default()
    };
    w.spawn(300, "fat", 128 * MIB);
    w.spawn(400, "other", 4 * GIB);
    let mut h = Harness::new(
        w,
        "[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n\
         [gpu]\nenabled = false\n\
         [alert]\nrepeat_interval = \"1s\"\n\
         [[model]]\nname = \"fat\"\nmatch = { comm = \"fat\" }\nram = \"32MiB\"\n\
         action = \"alert\"\ngrace = \"0s\"\n",
    );
    let webhook = h.daemon.reporter.alerter.tap(false);
    let event_log = h.daemon.reporter.alerter.tap(true);
    h.ticks(35, 100 * MS);
    h.world().exit(300);
    h.ticks(3, 100 * MS);
    assert_eq!(h.signals(), [], "alert only");

    let notices = drain(&webhook);
    let budget: Vec<&Notice> = notices.iter().filter(|n| n.key == "budget:fat").collect();
    let summary: Vec<(Status, bool)> = budget.iter().map(|n| (n.status, n.repeat)).collect();
    // Over from the first tick to the 35th (3.4 s): repeats at 1, 2 and 3 s.
    assert_eq!(
        summary,
        [
            (Status::Firing, false),
            (Status::Firing, true),
            (Status::Firing, true),
            (Status::Firing, true),
            (Status::Resolved, false),
        ],
        "{budget:#?}"
    );
    let first = budget[0];
    assert_eq!(first.kind, "condition");
    assert_eq!(first.event, "budget_exceeded");
    assert_eq!(first.severity, crate::policy::Severity::Warning);
    assert_eq!(first.subject.model.as_deref(), Some("fat"));
    assert_eq!(first.subject.pid, Some(300));
    assert_eq!(first.subject.budget_bytes, Some(32 * MIB));
    let resolved = budget[4].text();
    assert!(resolved.contains("RESOLVED budget_exceeded"), "{resolved}");
    let enforced = notices
        .iter()
        .filter(|n| n.event == "budget_enforced")
        .count();
    assert_eq!(enforced, 1, "{notices:#?}");

    let logged: Vec<(String, Status)> = drain(&event_log)
        .into_iter()
        .inspect(|n| assert!(!n.repeat, "a repeat in the event log: {n:?}"))
        .filter(|n| n.event.starts_with("budget_"))
        .map(|n| (n.event, n.status))
        .collect();
    for transition in [
        ("budget_exceeded".to_string(), Status::Firing),
        ("budget_enforced".to_string(), Status::Firing),
        ("budget_exceeded".to_string(), Status::Resolved),
        ("budget_cleared".to_string(), Status::Firing),
    ] {
        assert!(logged.contains(&transition), "{transition:?}: {logged:?}");
    }
}

/// A launch's notices name the model, the pid and the uid they are about: admitted, then died
/// while loading. Moved from the host suite (`alerts::launch_events_carry_their_subject`); a
/// launch through the real socket and CLI is `launch`'s, a webhook's delivery `alerts`'.
#[test]
fn launch_notices_name_the_model_the_pid_and_the_uid_they_are_about() {
    let mut h = Harness::new(
        World {
            host: host(64 * GIB, 40 * GIB),
            ..World::default()
        },
        "[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n\
         [gpu]\nenabled = false\n[launch]\nsettle = \"60s\"\n",
    );
    let webhook = h.daemon.reporter.alerter.tap(false);
    let loader = Arc::new(crate::reserve::FakeProcess::default());
    let peer = crate::reserve::Peer {
        uid: 1000,
        pid: 4242,
        start_time: 1,
    };
    {
        let mut table = h.daemon.shared.table();
        table.join(7, peer, Duration::ZERO);
        let request = crate::protocol::LaunchRequest {
            model: "served".into(),
            command: vec!["x".into()],
            ..Default::default()
        };
        let answer = table.launch(7, request, loader.clone(), Duration::ZERO);
        assert!(
            matches!(answer, Some(crate::protocol::Response::Admitted { .. })),
            "{answer:?}"
        );
    }
    h.ticks(2, 100 * MS);
    loader
        .exited
        .store(true, std::sync::atomic::Ordering::Relaxed);
    h.ticks(2, 100 * MS);
    let notices = drain(&webhook);
    let about = |event: &str| {
        let n = notices
            .iter()
            .find(|n| n.event == event)
            .unwrap_or_else(|| panic!("no {event}: {notices:#?}"));
        (
            n.subject.model.clone(),
            n.subject.pid,
            n.subject.uid,
            n.severity,
        )
    };
    // A model the config does not know, launched by uid 1000, is in that uid's namespace.
    let subject = (Some("served@1000".to_string()), Some(4242), Some(1000));
    let info = crate::policy::Severity::Info;
    let admitted = about("launch_admitted");
    assert_eq!((admitted.0, admitted.1, admitted.2), subject.clone());
    assert_eq!(admitted.3, info);
    let died = about("launch_died");
    assert_eq!((died.0, died.1, died.2), subject);
    assert_eq!(died.3, info);
}
