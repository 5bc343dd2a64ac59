//! Faults and bad values never end in a wrong kill or a frozen process (issue #13): each test
//! injects one fault into the real binary with real child processes around (a SIGKILLed daemon
//! and a half-edited config at its restart, a state directory another user owns, alert sinks
//! replaced by SIGHUP while a notice hangs), and ends by checking that no process got a signal it
//! should not have and none is left stopped (state T). What the guard does on a lost GPU, on
//! implausible NVML counts and with floors no GPU here can hold is tested in process
//! (`daemon::tests::gpu`, `policy::tests`, `config::tests`), how NVML's answers become those
//! readings against the fake library (`tests/nvml/sampler.rs`).

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::common::*;

const LONG: Duration = Duration::from_secs(20);

/// A daemon config: GPU floors (`gpu`), more `[daemon]` keys, models matched by token.
fn config(gpu: &str, daemon: &str, models: &[(&str, &str, &str)]) -> String {
    let mut text = format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\ncandidates = \"models\"\ninterval = \"200ms\"\n\
         min_interval = \"10ms\"\nscan_interval = \"200ms\"\nterm_grace = \"300ms\"\n{daemon}\n\
         [ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n\n\
         [gpu]\nnvml_library = \"{}\"\nsample_timeout = \"300ms\"\nretry_init = \"300ms\"\n{gpu}\n",
        FakeNvml::library()
    );
    text.push_str(&models_toml(models));
    text
}

fn count(daemon: &GuardDaemon, event: &str, summary_has: &str) -> usize {
    daemon
        .events()
        .iter()
        .filter(|e| {
            e["event"] == event && e["summary"].as_str().unwrap_or("").contains(summary_has)
        })
        .count()
}

/// Waits until the event log holds `n` events of this kind whose summary contains the text.
fn wait_count(daemon: &GuardDaemon, event: &str, summary_has: &str, n: usize) {
    if !wait_until(LONG, || count(daemon, event, summary_has) >= n) {
        panic!(
            "never {n} {event:?} events with {summary_has:?}; events:\n{:#?}\nlog:\n{}",
            daemon.events(),
            daemon.log_text()
        );
    }
}

/// No process was stopped, terminated or killed by this daemon.
fn assert_no_signal(daemon: &GuardDaemon) {
    let signalled: Vec<Value> = daemon
        .events()
        .into_iter()
        .filter(|e| {
            let kind = e["event"].as_str().unwrap_or("");
            matches!(
                kind,
                "process_killed" | "process_stopped" | "process_throttled"
            ) && e["action"]["outcome"] == "done"
        })
        .collect();
    assert!(signalled.is_empty(), "wrong signals: {signalled:#?}");
}

/// Alive and not stopped.
fn assert_running(hog: &mut Hog) {
    assert!(
        hog.alive(),
        "pid {} is gone: {:?}",
        hog.pid(),
        hog.child.try_wait()
    );
    assert_ne!(
        proc_state(hog.pid()),
        Some('T'),
        "pid {} left stopped",
        hog.pid()
    );
}

/// Runs `gpuguard daemon` to its exit (for configs it must refuse); returns (code, stderr).
fn run_to_exit(config: &Path, state_dir: &Path, env: &[(&str, String)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(["daemon", "--config"])
        .arg(config)
        .arg("--state-dir")
        .arg(state_dir)
        .env(
            "GPUGUARD_ENFORCE_LOCK",
            state_dir.with_file_name("enforce.lock"),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let status = wait_child(&mut child, LONG);
    if status.is_none() {
        let _ = child.kill();
    }
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    (status.and_then(|s| s.code()), stderr)
}

#[test]
fn a_daemon_killed_while_holding_processes_resumes_them_before_reading_a_broken_config() {
    let (ts, tt) = (token("crash-stop"), token("crash-throttle"));
    let fake = FakeNvml::new("");
    let over = "ram = \"64MiB\"\ngrace = \"0s\"";
    let daemon = GuardDaemon::start_with_fake(
        &config(
            "",
            "",
            &[
                ("stopped", &ts, &format!("{over}\naction = \"stop\"")),
                ("throttled", &tt, &format!("{over}\naction = \"throttle\"")),
            ],
        ),
        &fake,
    );
    let mut stopped = Hog::start(&ts, 0, 128, 600);
    let mut throttled = Hog::start(&tt, 0, 128, 600);
    let both_stopped = || is_stopped(stopped.pid()) && is_stopped(throttled.pid());
    // The duty cycle holds the throttled one stopped 80 % of the time: crash the daemon then.
    assert!(wait_until(LONG, both_stopped), "{}", daemon.log_text());
    // crash() has reaped the daemon: nothing is left to resume them.
    let dir = daemon.crash();
    assert!(both_stopped(), "a SIGKILLed daemon resumes nothing itself");

    // Half-edited meanwhile: the restart must refuse the config (exit 2) and still resume both.
    let config_path = dir.path().join("config.toml");
    std::fs::write(&config_path, "[ram\nmin_available = ").unwrap();
    let (code, stderr) = run_to_exit(&config_path, &dir.path().join("state"), &fake.env());
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("TOML syntax error"), "{stderr}");
    for (hog, why) in [(&stopped, "stop"), (&throttled, "throttle")] {
        assert!(
            stderr.contains(&format!(
                "resumed pid {} (python3) left stopped ({why})",
                hog.pid()
            )),
            "{stderr}"
        );
    }
    assert_running(&mut stopped);
    assert_running(&mut throttled);
}

/// A state directory with a stop in it: a model over its RAM budget with action stop.
fn stop_config(token: &str) -> String {
    config(
        "",
        "",
        &[(
            "m",
            token,
            "ram = \"64MiB\"\naction = \"stop\"\ngrace = \"0s\"",
        )],
    )
}

#[test]
fn a_state_directory_that_is_not_gpuguards_own_is_refused() {
    let t = token("insecure");
    let mut hog = Hog::idle(&t);
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let config_path = dir.path().join("config.toml");
    std::fs::write(
        &config_path,
        stop_config(&t).replace("{state_dir}", &path(&state)),
    )
    .unwrap();
    let fake = FakeNvml::new("");

    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o777)).unwrap();
    // A config that cannot work on this host: exit 2, which systemd does not restart.
    let (code, stderr) = run_to_exit(&config_path, &state, &fake.env());
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("writable by group or others (mode 0777"),
        "{stderr}"
    );

    // A directory of another account (chown needs root: fails, never skips, without it).
    require_root();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
    rustix::fs::chown(&state, Some(rustix::fs::Uid::from_raw(65534)), None).unwrap();
    let (code, stderr) = run_to_exit(&config_path, &state, &fake.env());
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("owned by uid 65534"), "{stderr}");
    assert_running(&mut hog);
}

/// A webhook endpoint on 127.0.0.1 that accepts and never answers.
struct Hung {
    port: u16,
}

impl Hung {
    fn start() -> Hung {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for stream in listener.incoming().flatten() {
                held.push(stream);
            }
        });
        Hung { port }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/hook", self.port)
    }
}

/// How many webhook worker threads the daemon has.
fn webhook_threads(daemon: &GuardDaemon) -> usize {
    let tasks = format!("/proc/{}/task", daemon.child.id());
    std::fs::read_dir(tasks)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.starts_with("webhook-"))
        })
        .count()
}

#[test]
fn reloads_replace_alert_sinks_without_leaking_workers() {
    let t = token("sinks");
    let mut hog = Hog::idle(&t);
    let (a, b) = (Hung::start(), Hung::start());
    let fake = FakeNvml::new("");
    let with = |url: &str| {
        format!(
            "{}\n[alert]\ntimeout = \"1s\"\nretries = 5\nbackoff = \"1s\"\n[[alert.webhook]]\nurl = \"{url}\"\nmin_severity = \"info\"\n",
            config("", "", &[("m", &t, "")])
        )
    };
    let daemon = GuardDaemon::start_with_fake(&with(&a.url()), &fake);
    let reloads =
        |n: usize| wait_until(LONG, || daemon.log_text().matches("reloaded").count() >= n);
    // The same sink reload after reload: the same worker (stuck behind the hung endpoint).
    for n in 1..=4 {
        daemon.signal(rustix::process::Signal::HUP);
        assert!(reloads(n), "{}", daemon.log_text());
    }
    assert_eq!(webhook_threads(&daemon), 1);

    // A changed sink, each time with a notice in flight to a hung endpoint: the old worker gives
    // up retrying and ends within one request timeout; workers never pile up.
    for (n, url) in [b.url(), a.url(), b.url(), a.url()].iter().enumerate() {
        daemon.rewrite_config("[ram\n");
        daemon.signal(rustix::process::Signal::HUP);
        wait_count(&daemon, "config_reload_failed", "", n + 1);
        daemon.rewrite_config(&with(url));
        daemon.signal(rustix::process::Signal::HUP);
        assert!(reloads(5 + n), "{}", daemon.log_text());
    }
    assert!(
        wait_until(Duration::from_secs(10), || webhook_threads(&daemon) == 1),
        "{} webhook workers after 4 sink changes",
        webhook_threads(&daemon)
    );
    assert_running(&mut hog);
    assert_no_signal(&daemon);
}
