//! Webhook alerts from the real daemon to real HTTP receivers on 127.0.0.1: a signed kill alert,
//! retries after 503 and 429 (Retry-After) delivering once, a real Alertmanager (Debian's
//! `prometheus-alertmanager`, started here on loopback) showing an alert and then its resolution,
//! and a flood of client-caused events not pushing a kill alert out of a slow webhook's queue or
//! the kill's record out of the event and action logs. In process (`daemon::tests`): a webhook
//! that never answers not slowing the guard down, a condition firing once, repeating each
//! `repeat_interval` and resolving, and a launch's notices naming their model, pid and uid
//! (`daemon::tests::alerts`); how long a retry waits (`alert::webhook::tests`).
//!
//! The Alertmanager test needs `prometheus-alertmanager` on the PATH (.ci/run installs it): it
//! fails, not skips, without it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use hmac::{Hmac, KeyInit, Mac};
use serde_json::Value;

/// How the receiver answers its n-th request (from 0).
#[derive(Clone, Copy)]
enum Reply {
    Status(u16),
    /// 429 with `Retry-After: N` seconds.
    TooMany(u64),
    /// 200 after this many milliseconds (a slow endpoint: the sink's queue fills up).
    Slow(u64),
}

#[derive(Clone, Debug)]
struct Received {
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Received {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A plain HTTP receiver on 127.0.0.1: records every request, answers as scripted.
struct Receiver {
    port: u16,
    received: Arc<Mutex<Vec<Received>>>,
}

impl Receiver {
    fn start(script: impl Fn(usize) -> Reply + Send + 'static) -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let received = Arc::new(Mutex::new(Vec::new()));
        let r = received.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let reply = script(r.lock().unwrap().len());
                let Some(request) = read_request(&mut stream) else {
                    continue;
                };
                r.lock().unwrap().push(request);
                let head = match reply {
                    Reply::Status(code) => format!("HTTP/1.1 {code} X\r\n"),
                    Reply::Slow(ms) => {
                        std::thread::sleep(Duration::from_millis(ms));
                        "HTTP/1.1 200 OK\r\n".to_string()
                    }
                    Reply::TooMany(after) => {
                        format!("HTTP/1.1 429 Too Many Requests\r\nRetry-After: {after}\r\n")
                    }
                };
                let _ = stream.write_all(
                    format!("{head}Content-Length: 0\r\nConnection: close\r\n\r\n").as_bytes(),
                );
            }
        });
        Receiver { port, received }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/hook/s3cr3t-path", self.port)
    }

    fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    /// The JSON bodies received so far.
    fn notices(&self) -> Vec<Value> {
        self.received().iter().map(Received::json).collect()
    }
}

fn read_request(stream: &mut TcpStream) -> Option<Received> {
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let mut reader = BufReader::new(stream.try_clone().ok()?);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        reader.read_line(&mut h).ok()?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (k, v) = h.split_once(':')?;
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    let length: usize = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    Some(Received { headers, body })
}

fn base_config(extra: &str) -> String {
    format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\ncandidates = \"models\"\ninterval = \"200ms\"\nmin_interval = \"10ms\"\nscan_interval = \"200ms\"\nterm_grace = \"500ms\"\n\
         [gpu]\nenabled = false\n{extra}\n"
    )
}

#[test]
fn kill_alert_reaches_a_signed_webhook() {
    let receiver = Receiver::start(|_| Reply::Status(200));
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "hunter2-key\n").unwrap();
    let t = token("signed");
    let config = base_config(&format!(
        "[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n[alert]\nbackoff = \"100ms\"\n[[alert.webhook]]\nurl = \"{}\"\nsecret_file = \"{}\"\n{}",
        receiver.url(),
        path(&secret),
        model_toml("greedy", &t, "ram = \"32MiB\"\naction = \"kill\"\ngrace = \"0s\"")
    ));
    let daemon = GuardDaemon::start(&config);
    let mut hog = Hog::start(&t, 0, 128, 60);
    let status = hog
        .wait(Duration::from_secs(10))
        .unwrap_or_else(|| panic!("over-budget model not killed:\n{}", daemon.log_text()));
    assert!(matches!(status.signal(), Some(15 | 9)), "{status:?}");

    let kill = wait_for(&receiver, |n| n["event"] == "process_killed").unwrap_or_else(|| {
        panic!(
            "no kill alert: {:?}\n{}",
            receiver.notices(),
            daemon.log_text()
        )
    });
    let n = kill.json();
    // Signed: HMAC-SHA256 of the exact body with the file's key (newline trimmed).
    let mut mac = <Hmac<sha2::Sha256> as KeyInit>::new_from_slice(b"hunter2-key").unwrap();
    mac.update(&kill.body);
    let want: String = mac
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        kill.header("X-Gpuguard-Signature"),
        Some(format!("sha256={want}").as_str())
    );
    assert_eq!(
        kill.header("Content-Type"),
        Some("application/json"),
        "{:?}",
        kill.headers
    );
    // The body: host, event, subject, action, and a Slack-compatible text.
    let host = nix::unistd::gethostname().unwrap();
    assert_eq!(n["host"], host.to_string_lossy().as_ref());
    assert_eq!(n["severity"], "critical");
    assert_eq!(n["status"], "firing");
    assert_eq!(n["version"], 1);
    let s = &n["subject"];
    assert_eq!(s["model"], "greedy");
    assert_eq!(s["pid"], hog.pid());
    assert_eq!(s["uid"], rustix::process::getuid().as_raw());
    // python3, or the shell of a pyenv shim that execs it.
    assert!(s["comm"].as_str().is_some_and(|c| !c.is_empty()), "{s}");
    assert!(s["cmdline"].as_str().unwrap().contains(&t), "{s}");
    assert_eq!(s["budget_bytes"], 32 * MIB);
    assert!(s["usage_bytes"].as_u64().unwrap() > 32 * MIB, "{s}");
    let a = &n["action"];
    assert!(a["verb"] == "terminate" || a["verb"] == "kill", "{a}");
    assert_eq!(a["reason"], "ram_budget");
    assert_eq!(a["outcome"], "done");
    let text = n["text"].as_str().unwrap();
    assert!(
        text.contains("CRITICAL process_killed") && text.contains(&hog.pid().to_string()),
        "{text}"
    );
    // Every request is signed, and the URL's secret path never reaches the log.
    assert!(receiver
        .received()
        .iter()
        .all(|r| r.header("X-Gpuguard-Signature").is_some()));
    let (code, log) = daemon.stop();
    assert_eq!(code, Some(0));
    assert!(
        !log.contains("s3cr3t-path") && !log.contains("hunter2"),
        "{log}"
    );
}

/// Waits for a received notice matching `pred`.
fn wait_for(receiver: &Receiver, pred: impl Fn(&Value) -> bool) -> Option<Received> {
    let mut found = None;
    wait_until(Duration::from_secs(10), || {
        found = receiver
            .received()
            .into_iter()
            .find(|r| serde_json::from_slice(&r.body).is_ok_and(|v| pred(&v)));
        found.is_some()
    });
    found
}

#[test]
fn retries_after_503_and_429_deliver_the_alert_once() {
    // 503, 503, then 429 with Retry-After: 1, then 200.
    let receiver = Receiver::start(|n| match n {
        0 | 1 => Reply::Status(503),
        2 => Reply::TooMany(1),
        _ => Reply::Status(200),
    });
    let config = base_config(&format!(
        "[alert]\nbackoff = \"100ms\"\nretries = 5\n[[alert.webhook]]\nurl = \"{}\"\nmin_severity = \"info\"\n",
        receiver.url()
    ));
    let daemon = GuardDaemon::start(&config);
    assert!(
        wait_until(Duration::from_secs(10), || receiver.received().len() >= 4),
        "{:?}\n{}",
        receiver.notices(),
        daemon.log_text()
    );
    let (code, _) = daemon.stop();
    assert_eq!(code, Some(0));
    let mut got = receiver.received();
    // The last notice is daemon_stopping (so every earlier one went out before it).
    let last = got.pop().map(|r| r.json());
    assert_eq!(
        last.as_ref().map(|n| &n["event"]),
        Some(&Value::from("daemon_stopping")),
        "{last:?}"
    );
    // The same notice four times (the same bytes: a retry, not a new alert), and nothing else.
    assert_eq!(got.len(), 4, "{:?}", receiver.notices());
    assert!(got.iter().all(|r| r.body == got[0].body));
    assert_eq!(got[0].json()["event"], "daemon_started");
    // How long each retry waits (backoff, the 429's Retry-After) is
    // alert::webhook::tests::a_retry_waits_as_long_as_the_server_asks_else_backs_off.
}

/// A child killed when the test ends.
fn am_alerts(port: u16) -> Vec<Value> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(5)))
        .build()
        .into();
    agent
        .get(&format!("http://127.0.0.1:{port}/api/v2/alerts"))
        .call()
        .ok()
        .and_then(|mut r| r.body_mut().read_to_string().ok())
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
}

#[test]
fn a_real_alertmanager_shows_the_alert_then_resolves_it() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = dir.path().join("alertmanager.yml");
    std::fs::write(
        &config,
        "route:\n  receiver: blackhole\n  group_wait: 1s\nreceivers:\n  - name: blackhole\n",
    )
    .unwrap();
    let log_path = dir.path().join("alertmanager.log");
    let _am = KillOnDrop(
        Command::new("prometheus-alertmanager")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--cluster.listen-address=")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log_path).unwrap())
            .spawn()
            .expect("prometheus-alertmanager is needed (apt-get install prometheus-alertmanager)"),
    );
    let am_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        wait_until(Duration::from_secs(30), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
                && ureq::get(&format!("http://127.0.0.1:{port}/-/ready"))
                    .call()
                    .is_ok()
        }),
        "alertmanager never became ready:\n{}",
        am_log()
    );

    let t = token("am");
    let daemon = GuardDaemon::start(&base_config(&format!(
        "[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n[[alert.webhook]]\nurl = \"http://127.0.0.1:{port}\"\nformat = \"alertmanager\"\n{}",
        model_toml("amodel", &t, "ram = \"32MiB\"\naction = \"alert\"\ngrace = \"0s\"")
    )));
    let mut hog = Hog::start(&t, 0, 128, 4);
    let ours = |a: &Value| {
        a["labels"]["alertname"] == "budget_exceeded" && a["labels"]["model"] == "amodel"
    };
    let mut alerts = Vec::new();
    assert!(
        wait_until(Duration::from_secs(10), || {
            alerts = am_alerts(port);
            alerts
                .iter()
                .any(|a| ours(a) && a["status"]["state"] == "active")
        }),
        "alert not shown by Alertmanager: {alerts:?}\n{}\n{}",
        daemon.log_text(),
        am_log()
    );
    let a = alerts.iter().find(|a| ours(a)).unwrap();
    assert_eq!(a["labels"]["severity"], "warning");
    assert!(a["annotations"]["summary"]
        .as_str()
        .unwrap()
        .contains("model 'amodel' over budget"));

    // The model exits: gpuguard posts endsAt, and Alertmanager drops it from the active list
    // (long before the three minutes a firing alert is posted for).
    assert!(hog.wait(Duration::from_secs(20)).is_some());
    assert!(
        wait_until(Duration::from_secs(10), || !am_alerts(port)
            .iter()
            .any(ours)),
        "not resolved: {:?}\n{}",
        am_alerts(port),
        daemon.log_text()
    );
}

/// An HTTPS receiver on 127.0.0.1 (python's ssl module) whose certificate is signed by a CA made
/// here: prints its port, then one line per POST body.
const HTTPS_RECEIVER_PY: &str = r#"
import http.server, ssl, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        print(body.decode(), flush=True)
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
server = http.server.HTTPServer(("127.0.0.1", 0), H)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(sys.argv[1], sys.argv[2])
server.socket = context.wrap_socket(server.socket, server_side=True)
print(server.server_address[1], flush=True)
server.serve_forever()
"#;

/// A private CA and a certificate for 127.0.0.1 signed by it (openssl CLI).
fn private_ca(dir: &std::path::Path) {
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl is needed for this test (apt-get install openssl)");
        assert!(out.status.success(), "openssl {args:?}: {out:?}");
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=gpuguard test CA",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    ]);
    std::fs::write(dir.join("ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "ext",
    ]);
}

/// Issue #10: a webhook behind a company CA works when the system trusts that CA (here through
/// `SSL_CERT_FILE`, which the platform verifier reads like the system store), and fails when not.
#[test]
fn webhook_behind_a_private_ca_is_trusted_through_the_system_store() {
    let dir = tempfile::tempdir().unwrap();
    private_ca(dir.path());
    let mut receiver = Command::new(python3())
        .args(["-c", HTTPS_RECEIVER_PY])
        .arg(dir.path().join("server.pem"))
        .arg(dir.path().join("server.key"))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(receiver.stdout.take().unwrap()).lines();
    let port: u16 = lines.next().unwrap().unwrap().trim().parse().unwrap();
    let config = base_config(&format!(
        "[[alert.webhook]]\nurl = \"https://127.0.0.1:{port}/hook\"\nmin_severity = \"info\"\n"
    ));
    let ca = path(&dir.path().join("ca.pem"));

    // Trusted: the daemon_started notice arrives over TLS.
    let daemon = GuardDaemon::start_with_env(&config, &[("SSL_CERT_FILE", &ca)]);
    let line = lines.next().expect("a notice over HTTPS").unwrap();
    let notice: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(notice["event"], "daemon_started", "{notice}");
    drop(daemon);

    // Not trusted (the CA is not in the store): the request fails, the failure is counted.
    let untrusted = GuardDaemon::start(&config.replace("[gpu]", "[alert]\nretries = 0\n[gpu]"));
    untrusted.wait_for_log("certificate", Duration::from_secs(20));
    let _ = receiver.kill();
    let _ = receiver.wait();
}

/// Red-team finding 5: a client's request loop (permits that time out, thousands a second) made
/// warning events that pushed the critical kill alert out of a slow webhook's full queue and
/// rotated the kill's record out of events.jsonl. Now those events are info, at most 20 per uid
/// per minute are kept (the rest are counted), a full queue drops info before anything critical,
/// and actions.jsonl keeps the actions and critical notices that clients cannot cause.
#[test]
fn a_flood_of_timed_out_permits_does_not_push_a_kill_alert_out() {
    use gpuguard::ipc::client::Connection;
    use gpuguard::protocol::{AcquireRequest, RefusalReason, Request, Response};
    let receiver = Receiver::start(|_| Reply::Slow(300));
    let port = free_port();
    let t = token("flooded");
    let config = base_config(&format!(
        "[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n[launch]\nsocket = \"{{state_dir}}/gpuguard.sock\"\n\
         [metrics]\nlisten = \"127.0.0.1:{port}\"\n\
         [alert]\nqueue = 4\n[[alert.webhook]]\nurl = \"{}\"\nmin_severity = \"info\"\n{}",
        receiver.url(),
        model_toml("greedy", &t, "ram = \"32MiB\"\naction = \"kill\"\ngrace = \"0s\"")
    ));
    let mut daemon = GuardDaemon::start(&config);
    // More RAM than is free, less than the host has: each request waits, then times out.
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let total_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    let request = |id| AcquireRequest {
        id,
        ram_bytes: Some(total_kib * 1024 - 16 * MIB),
        gpu_bytes: Some(0),
        timeout_ms: Some(1),
        ..Default::default()
    };
    let mut conn = Connection::open(&daemon.socket(), Request::Acquire(request(0))).unwrap();
    let mut timed_out = 0u64;
    let mut pending = 1u64;
    let mut next = 1u64;
    let mut hog = None;
    // 600 timeouts answered (thousands of permit_timed_out events), a real incident after the
    // first 100.
    while timed_out < 600 {
        // Batches of 16 requests in flight on the one connection.
        while pending < 16 {
            conn.send(Request::Acquire(request(next))).unwrap();
            next += 1;
            pending += 1;
        }
        match conn.receive().expect("an answer") {
            Response::Refused {
                reason, message, ..
            } => {
                assert_eq!(reason, RefusalReason::Timeout, "{message}");
                timed_out += 1;
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        pending -= 1;
        // Into the flood, a real incident: a model over its budget, killed.
        if hog.is_none() && timed_out >= 100 {
            hog = Some(Hog::start(&t, 0, 128, 60));
        }
    }
    let mut hog = hog.unwrap();
    hog.wait(Duration::from_secs(10))
        .unwrap_or_else(|| panic!("over-budget model not killed:\n{}", daemon.log_text()));
    let kill = wait_for(&receiver, |n| n["event"] == "process_killed").unwrap_or_else(|| {
        panic!(
            "the kill alert was pushed out: {:?}\n{}",
            receiver
                .notices()
                .iter()
                .map(|n| n["event"].to_string())
                .collect::<Vec<_>>(),
            daemon.log_text()
        )
    });
    assert_eq!(kill.json()["severity"], "critical");
    let state_dir = daemon.state_dir();
    let lines = |name: &str| -> Vec<Value> {
        std::fs::read_to_string(state_dir.join(name))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    assert!(wait_until(Duration::from_secs(5), || lines(
        "actions.jsonl"
    )
    .iter()
    .any(|n| n["event"] == "process_killed")));
    // The rest were counted (the metric takes the count at the loop's next tick).
    let suppressed = || {
        get(&format!("http://127.0.0.1:{port}/metrics"))
            .and_then(|metrics| sample(&metrics, "gpuguard_events_suppressed_total"))
            .unwrap_or(0.0)
    };
    assert!(
        wait_until(Duration::from_secs(5), || suppressed()
            >= (timed_out - 20) as f64),
        "{} suppressed of {timed_out}",
        suppressed()
    );
    // What went out is counted once the daemon has stopped: it sends what it queued before it
    // exits, so no later notice or line can be missed.
    drop(conn);
    daemon.signal(rustix::process::Signal::TERM);
    let status = wait_child(&mut daemon.child, Duration::from_secs(10));
    assert_eq!(status.and_then(|s| s.code()), Some(0));
    let flood: Vec<Value> = receiver
        .notices()
        .into_iter()
        .filter(|n| n["event"] == "permit_timed_out")
        .collect();
    assert!(
        flood.len() <= 20,
        "{} permit_timed_out notices",
        flood.len()
    );
    assert!(flood.iter().all(|n| n["severity"] == "info"), "{flood:?}");
    // The event log has at most the uid's share of the flood, and the kill; actions.jsonl has the
    // kill and none of the flood.
    assert!(lines("actions.jsonl")
        .iter()
        .all(|n| n["event"] != "permit_timed_out"));
    let events = lines("events.jsonl");
    let logged = events
        .iter()
        .filter(|n| n["event"] == "permit_timed_out")
        .count();
    assert!(
        (1..=20).contains(&logged),
        "{logged} permit_timed_out lines in events.jsonl"
    );
    assert!(events.iter().any(|n| n["event"] == "process_killed"));
}
