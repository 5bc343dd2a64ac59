//! Issue #12's seed failure, scaled down, through the real daemon, the fake NVML and the Python
//! client (tests/permits/*.py, run with the test environment's interpreter that `scripts/test`
//! makes, the client installed from clients/python): a "server" on a 16 GiB card with 4 GiB of
//! weights and 3 GiB per request in flight, under bursts of concurrent requests, each taking a
//! permit. Every request is served or refused with backpressure, never an overflow, never more
//! in flight than fit. The same with sizes of 1-4 GiB, on a card that grows to 24 GiB with no
//! config change, with 64 asyncio tasks, and behind the FastAPI example (200s and 503s with
//! Retry-After).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::*;
use serde_json::Value;

/// The test environment's Python (fails, saying how to get it, when `scripts/test` did not run).
pub fn venv_python() -> String {
    let python = std::env::var("GPUGUARD_TEST_PYTHON").unwrap_or_default();
    assert!(
        !python.is_empty() && Path::new(&python).exists(),
        "the permit scenarios need the Python client's test environment: run `scripts/test` \
         (it makes target/pyenv and sets GPUGUARD_TEST_PYTHON)"
    );
    python
}

pub fn scenario(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/permits")
        .join(name)
}

/// A daemon watching model "seed" (the scenario scripts), with a 512 MiB GPU warn floor.
pub struct Setup {
    pub fake: FakeNvml,
    pub daemon: GuardDaemon,
}

/// Model "seed": the scenario scripts' processes.
pub const SEED_MODEL: &str =
    "[[model]]\nname = \"seed\"\nmatch = { cmdline = \"tests/permits/(seed|fastapi)_server\\\\.py\" }\n";

fn setup(card_gib: u64) -> Setup {
    setup_with(card_gib, SEED_MODEL)
}

/// A daemon on one fake card of `card_gib` GiB, in observe mode, with `models` (TOML).
pub fn setup_with(card_gib: u64, models: &str) -> Setup {
    let fake = FakeNvml::new(&format!(
        "device 0 uuid=GPU-seed total={} used=0\n",
        card_gib * GIB
    ));
    let config = format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\ncandidates = \"models\"\nmode = \"observe\"\ninterval = \"200ms\"\nscan_interval = \"200ms\"\n\
         [ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n\
         [gpu]\nnvml_library = \"{}\"\nsample_timeout = \"500ms\"\nwarn_free = \"512MiB\"\n\
         {models}",
        FakeNvml::library()
    );
    let daemon = GuardDaemon::start_with_fake(&config, &fake);
    daemon.wait_gpus_on(None, Duration::from_secs(10));
    Setup { fake, daemon }
}

impl Setup {
    /// Runs seed_server.py with these options and `--model seed`; returns its JSON results.
    fn seed(&self, options: &[&str]) -> Value {
        self.seed_as(Some("seed"), options)
    }

    /// Runs seed_server.py with these options, its permits naming `model` (None: the daemon
    /// finds the model by the process); returns its JSON results. On an overflow, the card's
    /// trace and the daemon's log go to stderr (shown with the failing test).
    pub fn seed_as(&self, model: Option<&str>, options: &[&str]) -> Value {
        let trace = self.fake.dir.path().join("card-trace");
        let out = Command::new(venv_python())
            .arg(scenario("seed_server.py"))
            .arg("--state")
            .arg(&self.fake.state)
            .arg("--socket")
            .arg(self.daemon.socket())
            .args(model.map(|m| ["--model", m]).into_iter().flatten())
            .args(options)
            .env("FAKEGPU_TRACE", &trace)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "seed_server.py: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.daemon.log_text()
        );
        let r: Value = serde_json::from_slice(&out.stdout).unwrap();
        if r["overflows"] != 0 {
            // What the card saw (every change, and who held what at each CUDA OOM) beside the
            // daemon's debug log: printed with the test's failure.
            let trace = std::fs::read_to_string(&trace).unwrap_or_default();
            eprintln!(
                "the card:\n{trace}\nthe daemon:\n{}",
                self.daemon.log_text()
            );
        }
        r
    }
}

/// No overflow; everything served or refused with backpressure (a reason and a Retry-After).
pub fn assert_safe(r: &Value) {
    assert_eq!(r["overflows"], 0, "{r}");
    assert_eq!(r["errors"], 0, "{r}");
    assert_eq!(
        r["served"].as_u64().unwrap() + r["refused"].as_u64().unwrap(),
        r["requests"].as_u64().unwrap(),
        "{r}"
    );
    assert_eq!(r["refused_without_retry_after"], 0, "{r}");
    assert!(r["served"].as_u64().unwrap() > 0, "nothing served: {r}");
}

#[test]
fn the_seed_failure_without_permits_overflows_and_with_them_never_does() {
    let s = setup(16);
    // The failure as the seed users saw it: bursts of 10 requests of 3 GiB beside 4 GiB.
    let without = s.seed(&["--no-permits", "--bursts", "1"]);
    assert!(without["overflows"].as_u64().unwrap() > 0, "{without}");
    for client in ["thread", "async"] {
        let with = s.seed(&["--client", client, "--pause", "1", "--permit-timeout", "5"]);
        assert_safe(&with);
        assert_eq!(with["requests"], 30);
        // 4 requests fit beside the weights: never more in flight (the warn floor leaves 3).
        assert!(with["max_in_flight"].as_u64().unwrap() <= 4, "{with}");
        assert!(with["served"].as_u64().unwrap() >= 20, "{with}");
    }
    // The permits were the daemon's: their outcomes are in status.
    let status = s.daemon.status();
    let pool = status["permits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["model"] == "seed")
        .cloned()
        .unwrap();
    assert!(pool["granted_total"].as_u64().unwrap() >= 40, "{pool}");
}

#[test]
fn concurrency_follows_the_free_memory_whatever_the_sizes_and_the_card() {
    // 1-4 GiB per request: still no overflow.
    let s = setup(16);
    let mixed = s.seed(&["--request-size", "1GiB-4GiB", "--seed", "7", "--pause", "1"]);
    assert_safe(&mixed);
    let on_16 = s.seed(&["--pause", "1"]);
    assert_safe(&on_16);
    drop(s);
    // The same config on a 24 GiB card: more requests at once, still never too many.
    let s = setup(24);
    let on_24 = s.seed(&["--card-total", "24GiB", "--pause", "1"]);
    assert_safe(&on_24);
    assert!(
        on_24["max_in_flight"].as_u64() > on_16["max_in_flight"].as_u64(),
        "16 GiB: {on_16}\n24 GiB: {on_24}"
    );
    assert!(on_24["max_in_flight"].as_u64().unwrap() <= 6, "{on_24}");
}

#[test]
fn sixty_four_asyncio_tasks_share_one_connection_safely() {
    let s = setup(16);
    let r = s.seed(&[
        "--client",
        "async",
        "--burst",
        "64",
        "--bursts",
        "1",
        "--request-size",
        "1GiB",
        "--work",
        "0.1",
        "--permit-timeout",
        "10",
    ]);
    assert_safe(&r);
    assert_eq!(r["requests"], 64);
    assert!(r["max_in_flight"].as_u64().unwrap() <= 12, "{r}");
}

#[test]
fn the_fastapi_example_answers_200_or_503_with_retry_after_and_never_overflows() {
    let s = setup(16);
    let port_file = s.fake.dir.path().join("port");
    let mut server = Command::new(venv_python())
        .arg(scenario("fastapi_server.py"))
        .arg("--state")
        .arg(&s.fake.state)
        .arg("--socket")
        .arg(s.daemon.socket())
        .args([
            "--model",
            "seed",
            "--permit-timeout",
            "0.5",
            "--work",
            "0.3",
        ])
        .arg("--port-file")
        .arg(&port_file)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = Command::new(venv_python())
        .arg(scenario("http_burst.py"))
        .arg("--port-file")
        .arg(&port_file)
        .args(["--burst", "12", "--bursts", "2", "--pause", "1"])
        .output()
        .unwrap();
    let _ = server.kill();
    let _ = server.wait();
    assert!(out.status.success(), "{out:?}");
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["errors"], 0, "{r}");
    assert_eq!(r["other_status"], serde_json::json!({}), "{r}");
    let (ok, unavailable) = (
        r["ok"].as_u64().unwrap(),
        r["unavailable"].as_u64().unwrap(),
    );
    assert_eq!(ok + unavailable, 24, "{r}");
    assert!(ok > 0, "{r}");
    assert!(
        unavailable > 0,
        "a burst of 12 cannot all fit in 0.5 s: {r}"
    );
    assert_eq!(r["unavailable_with_retry_after"], unavailable, "{r}");
    assert_eq!(r["server"]["overflows"], 0, "{r}");
}

/// Issue #40: the Python client, a new process naming no model, on a host without a GPU: a
/// permit of more RAM than the host has and one of GPU memory are refused at once with
/// `too_large`, not transient, no retry hint, though each may wait 600 s (a wait would hang the
/// test). The daemon decides; the client checks nothing itself.
#[test]
fn the_python_client_is_refused_at_once_what_can_never_fit_here() {
    let daemon = crate::permits::no_gpu_daemon();
    let script = r#"
import sys, gpuguard
client = gpuguard.Client(sys.argv[1])
for asked in ({"ram_bytes": sys.argv[2]}, {"gpu_bytes": "1GiB"}):
    try:
        client.acquire(timeout=600, **asked)
        print("granted")
    except gpuguard.PermitRefused as refused:
        print(refused.reason, refused.transient, refused.retry_after, refused.message)
"#;
    let out = Command::new(venv_python())
        .args(["-c", script])
        .arg(daemon.socket())
        .arg(crate::permits::more_ram_than_here())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    assert!(
        lines[0].starts_with("too_large False None ") && lines[0].contains("RAM"),
        "{stdout}"
    );
    assert!(
        lines[1].starts_with("too_large False None ") && lines[1].contains("this host has no GPU"),
        "{stdout}"
    );
}
