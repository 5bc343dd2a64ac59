//! Memory permits through the real daemon and the fake NVML (issue #12): what fits is granted at
//! once, what does not waits its turn or is refused with what was needed and what was free; a
//! holder killed with SIGKILL frees its permit at once, one that hangs loses it at its TTL;
//! `gpuguard permit` wraps a command; GCE notices drain new permits. (The size a model's permits
//! really take, learned; permits and a launch competing for the same GPU; `max_permits` slots:
//! `reserve::tests`.)
//!
//! The scenario scripts in tests/permits/ (the seed failure: bursts of requests on a 16 GiB card)
//! run through the Python client in `tests/integration/permits_python.rs`.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::*;
use gpuguard::protocol::{AcquireRequest, RefusalReason, Response};

/// A 16 GiB GPU whose "server" process holds 4 GiB of weights; a 1 GiB warn floor: 11 GiB room.
struct Card {
    /// Kept for its state file, which the daemon's NVML reads.
    _fake: FakeNvml,
    server: Hog,
    daemon: GuardDaemon,
}

fn card(model_extra: &str, extra: &str) -> Card {
    let t = token("served");
    let server = Hog::start(&t, 0, 0, 600);
    let fake = FakeNvml::new(&state(16, 4, server.pid(), 4));
    let config = format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\ncandidates = \"models\"\ninterval = \"200ms\"\nscan_interval = \"200ms\"\n\
         [ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n\
         [gpu]\nnvml_library = \"{}\"\nsample_timeout = \"500ms\"\nwarn_free = \"1GiB\"\n\
         [launch]\nsocket = \"{{state_dir}}/gpuguard.sock\"\nsettle = \"60s\"\n\
         [[model]]\nname = \"served\"\nmatch = {{ cmdline = \"{t}\" }}\n{model_extra}\n{extra}\n",
        FakeNvml::library()
    );
    let daemon = GuardDaemon::start_with_fake(&config, &fake);
    daemon.wait_gpus_on(None, Duration::from_secs(10));
    // The server is a member of its model, with its weights seen.
    assert!(wait_until(Duration::from_secs(10), || {
        daemon.status()["models"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["name"] == "served" && m["gpu_bytes"] == 4 * GIB)
    }));
    Card {
        _fake: fake,
        server,
        daemon,
    }
}

/// The fake NVML state: one GPU of `total` GiB, `pid` holding `held` GiB (all of `used`).
fn state(total: u64, used: u64, pid: u32, held: u64) -> String {
    format!(
        "device 0 uuid=GPU-aaaa total={} used={}\nprocess 0 {pid} {}\n",
        total * GIB,
        used * GIB,
        held * GIB
    )
}

fn pool<'a>(status: &'a serde_json::Value, model: &str) -> Option<&'a serde_json::Value> {
    status["permits"]
        .as_array()?
        .iter()
        .find(|p| p["model"] == model)
}

#[test]
fn what_fits_is_granted_at_once_and_what_does_not_waits_or_is_refused_with_needed_and_free() {
    let port = free_port();
    let c = card("", &format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n"));
    let socket = c.daemon.socket();
    let (mut a, answer) = PermitClient::acquire(&socket, acquire("served", 3 * GIB, 1000));
    let mut held = vec![granted(&answer)];
    for _ in 0..2 {
        held.push(granted(&a.acquire_more(acquire("served", 3 * GIB, 1000))));
    }
    // 9 of the 11 GiB promised: 3 more cannot fit now; the refusal says what was needed and free.
    match a.acquire_more(acquire("served", 3 * GIB, 300)) {
        Response::Refused {
            reason,
            message,
            retry_after_ms,
            needed,
            free,
            ..
        } => {
            assert_eq!(reason, RefusalReason::Timeout, "{message}");
            assert_eq!(needed.gpu_bytes, 3 * GIB);
            assert_eq!(free.gpu_bytes, Some(2 * GIB), "{message}");
            assert!(retry_after_ms.is_some_and(|ms| ms >= 100), "{message}");
            assert!(message.contains("needs 3.0 GiB"), "{message}");
        }
        other => panic!("expected a timeout refusal, got {other:?}"),
    }
    // More than the card can ever give: refused at once, not after the timeout.
    match a.acquire_more(acquire("served", 20 * GIB, 60_000)) {
        Response::Refused {
            reason, message, ..
        } => {
            assert_eq!(reason, RefusalReason::TooLarge, "{message}");
            assert!(message.contains("can never fit"), "{message}");
        }
        other => panic!("expected too_large, got {other:?}"),
    }
    let status = c.daemon.status();
    let p = pool(&status, "served").expect("a permits row");
    assert_eq!(p["held"], 3);
    assert_eq!(p["reserved_gpu_bytes"], 9 * GIB);
    assert_eq!(p["refused_total"], 2);
    // The same in the metrics, which pass promtool.
    let metrics_url = format!("http://127.0.0.1:{port}/metrics");
    assert!(wait_until(Duration::from_secs(5), || get(&metrics_url)
        .is_some_and(|m| sample(
            &m,
            "gpuguard_permits_total{model=\"served\",outcome=\"refused\"}"
        ) == Some(2.0))));
    let text = get(&metrics_url).unwrap();
    assert_eq!(
        sample(&text, "gpuguard_permits_held{model=\"served\"}"),
        Some(3.0)
    );
    assert_eq!(
        sample(
            &text,
            "gpuguard_permit_reserved_bytes{model=\"served\",resource=\"gpu\"}"
        ),
        Some((9 * GIB) as f64)
    );
    promtool_check(&text);

    // A request that waits is granted, first come first served, when a permit comes back.
    let socket2 = socket.clone();
    let waiter = std::thread::spawn(move || {
        let (b, answer) = PermitClient::acquire(&socket2, acquire("served", 3 * GIB, 20_000));
        (b, answer)
    });
    assert!(wait_until(Duration::from_secs(10), || {
        pool(&c.daemon.status(), "served").is_some_and(|p| p["waiting"] == 1)
    }));
    assert!(matches!(
        a.release(held.pop().unwrap()),
        Response::Released { .. }
    ));
    let (_b, answer) = waiter.join().unwrap();
    match answer {
        Response::Granted { waited_ms, gpu, .. } => {
            assert!(waited_ms > 0);
            assert_eq!(gpu, Some(0));
        }
        other => panic!("the waiter got {other:?}"),
    }
    c.daemon
        .wait_for_event("permit_granted", Duration::from_secs(5), |e| {
            e["subject"]["model"] == "served"
        });
    drop(c.server);
}

#[test]
fn a_killed_holder_frees_its_permit_at_once_and_a_hung_one_loses_it_at_its_ttl() {
    let c = card("", "");
    let socket = c.daemon.socket();
    // `gpuguard permit` holds 8 GiB around a command that sleeps.
    let t = token("holder");
    let mut holder = Command::new(BIN)
        .args(["permit", "--model", "served", "--gpu-mem", "8GiB", "--"])
        .args([python3(), "-c", "import time; time.sleep(600)", &t])
        .env("GPUGUARD_SOCKET", &socket)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || {
        pool(&c.daemon.status(), "served").is_some_and(|p| p["held"] == 1)
    }));
    let socket2 = socket.clone();
    let waiter = std::thread::spawn(move || {
        PermitClient::acquire(
            &socket2,
            AcquireRequest {
                ttl_ms: Some(1000),
                ..acquire("served", 8 * GIB, 30_000)
            },
        )
    });
    assert!(wait_until(Duration::from_secs(10), || {
        pool(&c.daemon.status(), "served").is_some_and(|p| p["waiting"] == 1)
    }));
    // SIGKILL: no release is ever sent; the kernel closes its socket, the daemon ends its permit.
    let command_pid = children_of(holder.id());
    holder.kill().unwrap();
    holder.wait().unwrap();
    let (mut hung, answer) = waiter.join().unwrap();
    let permit = granted(&answer);
    for pid in command_pid {
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid as i32).unwrap(),
            rustix::process::Signal::KILL,
        );
    }

    // This holder never releases: at its TTL (1 s) the permit is revoked and it is told so.
    let socket3 = socket.clone();
    let next = std::thread::spawn(move || {
        PermitClient::acquire(&socket3, acquire("served", 8 * GIB, 30_000))
    });
    match hung.receive() {
        Response::Expired { permit: p, message } => {
            assert_eq!(p, permit);
            assert!(message.contains("past its TTL"), "{message}");
        }
        other => panic!("expected the permit to expire, got {other:?}"),
    }
    let (_next, answer) = next.join().unwrap();
    granted(&answer);
    c.daemon
        .wait_for_event("permit_expired", Duration::from_secs(5), |e| {
            e["subject"]["model"] == "served"
        });
    let status = c.daemon.status();
    assert_eq!(pool(&status, "served").unwrap()["expired_total"], 1);
}

/// Pids of a process's children (from /proc/PID/task/PID/children).
fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

#[test]
fn gpuguard_permit_runs_the_command_with_its_permit_and_exits_75_when_none_comes_in_time() {
    let c = card("", "");
    let run = |args: &[&str]| {
        let out = Command::new(BIN)
            .arg("permit")
            .args(args)
            .env("GPUGUARD_SOCKET", c.daemon.socket())
            .env_remove("CUDA_VISIBLE_DEVICES")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    // The command runs with its permit, and its exit status is the permit's.
    let (code, out, _) = run(&[
        "--model",
        "served",
        "--gpu-mem",
        "3GiB",
        "--",
        "sh",
        "-c",
        "echo gpu=$GPUGUARD_PERMIT_GPU cuda=$CUDA_VISIBLE_DEVICES; exit 7",
    ]);
    assert_eq!(code, Some(7));
    assert_eq!(out.trim(), "gpu=0 cuda=0");
    // Never fits: 65 at once (retrying here is pointless), the command never ran.
    let (code, out, err) = run(&[
        "--model",
        "served",
        "--gpu-mem",
        "20GiB",
        "--",
        "echo",
        "ran",
    ]);
    assert_eq!(code, Some(65), "{err}");
    assert!(out.is_empty());
    assert!(err.contains("can never fit"), "{err}");
    // Does not fit in time: 75 after the timeout, saying what was needed and free.
    let (_hold, answer) =
        PermitClient::acquire(&c.daemon.socket(), acquire("served", 8 * GIB, 1000));
    granted(&answer);
    let (code, out, err) = run(&[
        "--model",
        "served",
        "--gpu-mem",
        "4GiB",
        "--timeout",
        "300ms",
        "--",
        "echo",
        "ran",
    ]);
    assert_eq!(code, Some(75), "{err}");
    assert!(out.is_empty());
    assert!(err.contains("needs GPU 4.0 GiB"), "{err}");
    assert!(err.contains("try again in"), "{err}");
    // A model that does not exist is an invalid request (2).
    let (code, _, err) = run(&["--model", "nope", "--", "true"]);
    assert_eq!(code, Some(2), "{err}");
}

/// A daemon on a host without a GPU (`[gpu] enabled = false`), with a `[[model]]` that root
/// may belong to: a permit of a new process that names no model waits for a scan to find its
/// model.
pub fn no_gpu_daemon() -> GuardDaemon {
    let t = token("nevermodel");
    GuardDaemon::start(&format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\ncandidates = \"models\"\ninterval = \"200ms\"\nscan_interval = \"200ms\"\n\
         [ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n[gpu]\nenabled = false\n\
         [[model]]\nname = \"served\"\nmatch = {{ cmdline = \"{t}\" }}\n"
    ))
}

/// More RAM than this host has: 1 TiB, or twice its RAM on a larger one.
pub fn more_ram_than_here() -> String {
    format!("{}GiB", (2 * mem_total() / GIB).max(1024))
}

/// Issue #40: on a host without a GPU (`[gpu] enabled = false`), with a `[[model]]` root may
/// belong to, `gpuguard permit --ram 1TiB` (its caller's model not known yet: on main it waited
/// for a scan, then its whole timeout, and said "try again in 100ms"), a permit asking GPU
/// memory, and `gpuguard launch --gpu-mem 20GiB` (on main it headed the launch queue for its
/// queue timeout) are refused at once as never fitting, exit 65, the command never run. Their
/// own timeouts are long: a wait would hang the test, not pass it.
#[test]
fn what_can_never_fit_here_is_refused_at_once_with_exit_65_from_permit_and_launch() {
    let daemon = no_gpu_daemon();
    let run = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(args)
            .env("GPUGUARD_SOCKET", daemon.socket())
            .env_remove("CUDA_VISIBLE_DEVICES")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let ram = more_ram_than_here();
    let permit = |what: &[&str]| {
        let mut args = vec!["permit", "--timeout", "600s"];
        args.extend(what);
        args.extend(["--", "echo", "ran"]);
        run(&args)
    };
    let (code, out, err) = permit(&["--ram", &ram]);
    assert_eq!(code, Some(65), "{err}");
    assert!(out.is_empty(), "the command ran: {out}");
    assert!(
        err.contains("can never fit") && err.contains("RAM"),
        "{err}"
    );
    assert!(!err.contains("try again"), "{err}");
    let (code, out, err) = permit(&["--gpu-mem", "1GiB"]);
    assert_eq!(code, Some(65), "{err}");
    assert!(out.is_empty(), "the command ran: {out}");
    assert!(err.contains("this host has no GPU"), "{err}");
    let (code, out, err) = run(&[
        "launch",
        "--model",
        "big",
        "--gpu-mem",
        "20GiB",
        "--queue-timeout",
        "600s",
        "--",
        "echo",
        "ran",
    ]);
    assert_eq!(code, Some(65), "{err}");
    assert!(out.is_empty(), "the command ran: {out}");
    assert!(
        err.contains("can never fit on this host") && err.contains("enabled = false"),
        "{err}"
    );
    // Nothing waits, and what fits still runs: a launch and a permit of RAM only.
    let (code, out, err) = run(&["launch", "--model", "small", "--", "echo", "ran"]);
    assert_eq!((code, out.trim()), (Some(0), "ran"), "{err}");
    let (code, out, err) = permit(&["--ram", "1MiB"]);
    assert_eq!((code, out.trim()), (Some(0), "ran"), "{err}");
    let status = daemon.status();
    assert_eq!(status["queue"], serde_json::json!([]), "{status}");
}

/// A metadata server on 127.0.0.1 as Google documents it: a plain read answers a key's value
/// and its ETag; a wait-for-change with the current ETag hangs until the value changes (each
/// connection on a thread of its own, as the daemon watches two keys at once).
struct FakeMetadata {
    port: u16,
    state: MetadataState,
}

/// What the fake metadata server answers, and who waits for a change.
type MetadataState = std::sync::Arc<(std::sync::Mutex<Metadata>, std::sync::Condvar)>;

/// The keys' values (one version for all), and how the server misbehaves.
#[derive(Clone, Default)]
struct Metadata {
    maintenance: String,
    preempted: String,
    /// `upcoming-maintenance`'s JSON; empty: none planned (Google answers 404).
    upcoming: String,
    version: u32,
    /// Every request answered `503 Service Unavailable`.
    failing: bool,
    /// Every answer this late.
    delay: Duration,
}

impl FakeMetadata {
    fn start() -> FakeMetadata {
        use std::io::{BufRead, BufReader, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = std::sync::Arc::new((
            std::sync::Mutex::new(Metadata {
                maintenance: "NONE".into(),
                preempted: "FALSE".into(),
                ..Metadata::default()
            }),
            std::sync::Condvar::new(),
        ));
        let shared = state.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let shared = shared.clone();
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(stream.try_clone().unwrap());
                    let mut head = String::new();
                    let mut line = String::new();
                    while reader.read_line(&mut line).unwrap_or(0) > 2 {
                        head.push_str(&line);
                        line.clear();
                    }
                    let path = head.split_whitespace().nth(1).unwrap_or("").to_string();
                    if !head
                        .to_ascii_lowercase()
                        .contains("metadata-flavor: google")
                    {
                        let _ = write!(stream, "HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                        return;
                    }
                    let (lock, changed) = &*shared;
                    let mut s = lock.lock().unwrap();
                    if path.contains("wait_for_change=true")
                        && path.contains(&format!("last_etag=e{}", s.version))
                    {
                        let version = s.version;
                        s = changed
                            .wait_timeout_while(s, Duration::from_secs(60), |s| {
                                s.version == version
                            })
                            .unwrap()
                            .0;
                    }
                    let now = s.clone();
                    drop(s);
                    std::thread::sleep(now.delay);
                    let etag = format!("e{}", now.version);
                    let (status, body) = if now.failing {
                        ("503 Service Unavailable", String::new())
                    } else if path.contains("/instance/preempted") {
                        ("200 OK", now.preempted)
                    } else if path.contains("/instance/upcoming-maintenance") {
                        if now.upcoming.is_empty() {
                            ("404 Not Found", String::new())
                        } else {
                            ("200 OK", now.upcoming)
                        }
                    } else {
                        ("200 OK", now.maintenance)
                    };
                    let _ = write!(
                        stream,
                        "HTTP/1.1 {status}\r\nMetadata-Flavor: Google\r\nETag: {etag}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                });
            }
        });
        FakeMetadata { port, state }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/computeMetadata/v1", self.port)
    }

    /// Changes what the server answers; every wait on any key answers with it.
    fn change(&self, how: impl FnOnce(&mut Metadata)) {
        let (lock, changed) = &*self.state;
        let mut s = lock.lock().unwrap();
        how(&mut s);
        s.version += 1;
        changed.notify_all();
    }

    /// Sets `maintenance-event` and `preempted`.
    fn set(&self, maintenance: &str, preempted: &str) {
        self.change(|s| {
            s.maintenance = maintenance.into();
            s.preempted = preempted.into();
        });
    }
}

/// Issue 25: GCE announces host maintenance (its metadata server, played on 127.0.0.1). A
/// critical event says so, `[gce] on_notice` runs with the notice, new permits are refused at
/// once with `host_maintenance` and a retry hint while one held keeps running; the notice
/// withdrawn, permits are granted again. Then the VM is preempted: the same, as `preempted`.
/// Before that the server fails (a warning, no drain), plans maintenance days ahead (a warning
/// with the window, no drain), and answers slowly (the notice comes all the same).
#[test]
fn gce_maintenance_and_preemption_notices_drain_new_permits_and_leave_held_ones() {
    let metadata = FakeMetadata::start();
    let notes = tempfile::tempdir().unwrap();
    let noticed = notes.path().join("notice");
    let port = free_port();
    let c = card(
        "",
        &format!(
            "[gce]\nwatch = \"on\"\nmetadata_url = \"{}\"\non_notice = \"echo $GPUGUARD_NOTICE > {}\"\n\
             [metrics]\nlisten = \"127.0.0.1:{port}\"\n",
            metadata.url(),
            noticed.display()
        ),
    );
    let metrics_url = format!("http://127.0.0.1:{port}/metrics");
    let notice_gauge = |state: &str| {
        get(&metrics_url)
            .and_then(|m| sample(&m, &format!("gpuguard_cloud_notice{{state=\"{state}\"}}")))
    };
    // `[gce] on_notice` ran with GPUGUARD_NOTICE = `notice`.
    let on_notice_ran = |notice: &str| {
        wait_until(Duration::from_secs(10), || {
            std::fs::read_to_string(&noticed).is_ok_and(|n| n.trim() == notice)
        })
    };
    assert!(wait_until(Duration::from_secs(5), || notice_gauge(
        "host_maintenance"
    ) == Some(0.0)));
    let socket = c.daemon.socket();
    let (mut holder, answer) = PermitClient::acquire(&socket, acquire("served", 2 * GIB, 5000));
    let permit = granted(&answer);

    // The metadata server failing is said (a notice could be missed), and drains nothing.
    metadata.change(|s| s.failing = true);
    let failing = c
        .daemon
        .wait_for_event("gce_watch_failing", Duration::from_secs(15), |e| {
            e["severity"] == "warning"
        });
    assert!(
        failing["summary"].as_str().unwrap().contains("HTTP 503"),
        "{failing}"
    );
    // (Granted; released as its connection closes.)
    granted(&PermitClient::acquire(&socket, acquire("served", GIB, 5000)).1);
    metadata.change(|s| s.failing = false);
    c.daemon
        .wait_for_event("gce_watch_failing", Duration::from_secs(30), |e| {
            e["severity"] == "info"
        });
    // Scheduled maintenance days ahead: a warning with its window, no drain yet.
    metadata.change(|s| {
        s.upcoming = r#"{"can_reschedule":false,"latest_window_start_time":"2026-12-03T10:00:00Z","maintenance_status":"PENDING","type":"SCHEDULED","window_end_time":"2026-12-01T18:00:00Z","window_start_time":"2026-12-01T10:00:00Z"}"#.into();
    });
    let upcoming =
        c.daemon
            .wait_for_event("gce_upcoming_maintenance", Duration::from_secs(15), |_| {
                true
            });
    assert_eq!(upcoming["severity"], "warning", "{upcoming}");
    assert!(
        upcoming["summary"].as_str().unwrap().contains(
            "SCHEDULED maintenance PENDING, window 2026-12-01T10:00:00Z to 2026-12-01T18:00:00Z"
        ),
        "{upcoming}"
    );
    granted(&PermitClient::acquire(&socket, acquire("served", GIB, 5000)).1);

    // Slow answers (3 s each) delay a notice, they do not lose it.
    metadata.change(|s| s.delay = Duration::from_secs(3));
    metadata.set("TERMINATE_ON_HOST_MAINTENANCE", "FALSE");
    let notice = c
        .daemon
        .wait_for_event("gce_maintenance", Duration::from_secs(15), |_| true);
    assert_eq!(notice["severity"], "critical", "{notice}");
    let (_, refused) = PermitClient::acquire(&socket, acquire("served", GIB, 5000));
    match &refused {
        Response::Refused {
            reason: RefusalReason::HostMaintenance,
            retry_after_ms: Some(60_000),
            message,
            ..
        } => assert!(
            message.contains("TERMINATE_ON_HOST_MAINTENANCE"),
            "{message}"
        ),
        other => panic!("{other:?}"),
    }
    assert!(
        pool(&c.daemon.status(), "served").is_some_and(|p| p["held"] == 1),
        "the held permit is left alone"
    );
    assert!(
        on_notice_ran("TERMINATE_ON_HOST_MAINTENANCE"),
        "on_notice did not run"
    );
    assert!(wait_until(Duration::from_secs(5), || notice_gauge(
        "host_maintenance"
    ) == Some(1.0)));
    assert_eq!(notice_gauge("preempted"), Some(0.0));

    metadata.change(|s| s.delay = Duration::ZERO);
    metadata.set("NONE", "FALSE");
    c.daemon
        .wait_for_event("gce_notice_withdrawn", Duration::from_secs(15), |_| true);
    let (_, again) = PermitClient::acquire(&socket, acquire("served", GIB, 5000));
    granted(&again);
    assert!(matches!(holder.release(permit), Response::Released { .. }));

    // A Spot VM preempted: about 30 s left, the same drain with its own reason.
    metadata.set("NONE", "TRUE");
    let preempted = c
        .daemon
        .wait_for_event("gce_preempted", Duration::from_secs(15), |_| true);
    assert_eq!(preempted["severity"], "critical", "{preempted}");
    let (_, refused) = PermitClient::acquire(&socket, acquire("served", GIB, 5000));
    assert!(
        matches!(
            refused,
            Response::Refused {
                reason: RefusalReason::Preempted,
                retry_after_ms: Some(60_000),
                ..
            }
        ),
        "{refused:?}"
    );
    assert!(wait_until(Duration::from_secs(5), || notice_gauge(
        "preempted"
    ) == Some(1.0)));
    assert!(
        on_notice_ran("PREEMPTED"),
        "on_notice did not run for the preemption"
    );
}
