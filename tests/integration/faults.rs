//! Faults and bad values never end in a wrong kill or a frozen process (issue #13): each test
//! injects one fault into the real binary (through the fake libnvidia-ml.so.1, the state
//! directory, the config, a crash, a hung webhook) with real child processes around, and ends by
//! checking that no process got a signal it should not have and none is left stopped (state T).

use std::io::{Read, Write};
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

/// GPU 0 of 16 GiB with `used` bytes in use, its holders as (pid, bytes).
fn gpu0(used: u64, holders: &[(u32, u64)]) -> String {
    let mut s = format!("device 0 uuid=GPU-aaaa total={} used={used}\n", 16 * GIB);
    for (pid, bytes) in holders {
        s.push_str(&format!("process 0 {pid} {bytes}\n"));
    }
    s
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

/// GET /metrics on the port the daemon logged.
fn metrics(daemon: &GuardDaemon) -> String {
    let log = daemon.log_text();
    let url = log
        .split("metrics on http://")
        .nth(1)
        .and_then(|rest| rest.split("/metrics").next())
        .expect("metrics address in the log");
    let mut stream = std::net::TcpStream::connect(url).unwrap();
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: {url}\r\n\r\n").unwrap();
    let mut body = String::new();
    stream.read_to_string(&mut body).unwrap();
    body
}

/// Runs `gpuguard daemon` to its exit (for configs it must refuse); returns (code, stderr).
fn run_to_exit(config: &Path, state_dir: &Path, env: &[(&str, String)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(["daemon", "--config"])
        .arg(config)
        .arg("--state-dir")
        .arg(state_dir)
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

/// A victim stopped for GPU 1's floor, then GPU 1 is lost (`lose` changes the fake): it must be
/// resumed at max_stop, never killed, and the loss must show as an event, in status and metrics.
fn stopped_victim_outlives_a_lost_gpu(name: &str, lost_state: impl Fn(&str) -> String) {
    let t = token(name);
    let mut hog = Hog::idle(&t);
    let pid = hog.pid();
    let two = |used1: u64| {
        format!(
            "{}device 1 uuid=GPU-bbbb total={} used={used1}\nprocess 1 {pid} {}\n",
            gpu0(GIB, &[]),
            16 * GIB,
            6 * GIB
        )
    };
    let fake = FakeNvml::new(&two(8 * GIB));
    let daemon = GuardDaemon::start_with_fake(
        &format!(
            "{}\n[metrics]\nlisten = \"127.0.0.1:0\"\n",
            config(
                "min_free = \"2GiB\"\nwarn_free = \"3GiB\"\naction = \"stop\"",
                "max_stop = \"3s\"\nsettle = \"60s\"",
                &[("m", &t, "")],
            )
        ),
        &fake,
    );
    daemon.wait_gpus_on(Some(2), LONG);
    fake.set(&two(31 * GIB / 2));
    assert!(
        wait_stopped(&[pid], LONG),
        "not stopped for the floor:\n{}",
        daemon.log_text()
    );

    fake.set(&lost_state(&two(31 * GIB / 2)));
    wait_count(&daemon, "gpu_lost", "GPU 1 (GPU-bbbb) lost", 1);
    // The report is published every few hundred ms: wait for one from after the loss.
    assert!(
        wait_until(LONG, || daemon.status()["gpu_protection"]["state"]
            == "degraded"),
        "{:#}",
        daemon.status()
    );
    let status = daemon.status();
    let row = &status["gpus"][1];
    assert_eq!(
        (row["index"].as_u64(), row["lost"].as_bool()),
        (Some(1), Some(true)),
        "{status:#}"
    );
    assert!(wait_until(LONG, || metrics(&daemon)
        .contains("gpuguard_gpu_lost{gpu=\"1\",uuid=\"GPU-bbbb\"} 1")));
    assert!(metrics(&daemon).contains("gpuguard_nvml_state{state=\"degraded\"} 1"));

    // max_stop passes on an unknown reading: resumed, not killed.
    assert!(
        wait_resumed(&[pid], LONG),
        "left stopped:\n{}",
        daemon.log_text()
    );
    wait_count(&daemon, "process_resumed", "max_stop", 1);
    assert_running(&mut hog);
    let killed = count(&daemon, "process_killed", "");
    assert_eq!(killed, 0, "{:#?}", daemon.events());
}

#[test]
fn a_stopped_victim_is_resumed_at_max_stop_when_its_gpu_falls_off_the_bus() {
    stopped_victim_outlives_a_lost_gpu("bus", |state| format!("{state}error * 15 gpu=1\n"));
}

#[test]
fn a_stopped_victim_is_resumed_at_max_stop_when_its_gpu_leaves_the_device_list() {
    // Only GPU 0 is declared: NVML lists one GPU.
    stopped_victim_outlives_a_lost_gpu("vanished", |_| gpu0(GIB, &[]));
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

#[test]
fn floors_that_cannot_be_right_are_refused_by_check_config_at_start_and_on_reload() {
    let t = token("floors");
    let mut hog = Hog::idle(&t);
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(
            &p,
            text.replace("{state_dir}", &path(&dir.path().join("state"))),
        )
        .unwrap();
        p
    };
    let model = [("m", t.as_str(), "")];

    // Wrong on any host: check-config says so.
    for (text, want) in [
        (
            "[ram]\nmin_available = \"100%\"\n",
            "ram.min_available: '100%' is the whole memory",
        ),
        (
            "[[gpu.device]]\ngpu = \"banana\"\nmin_free = \"1GiB\"\n",
            "gpu.device[0].gpu: 'banana' is not a GPU",
        ),
        (
            "[launch]\nsocket = \"\"\n",
            "launch.socket: must not be empty",
        ),
        (
            "[daemon]\nstate_dir = \"\"\n",
            "daemon.state_dir: must not be empty",
        ),
    ] {
        let p = write("bad.toml", text);
        let out = Command::new(BIN)
            .arg("check-config")
            .arg(&p)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text}: {stderr}");
        assert!(stderr.contains(want), "{text}: {stderr}");
    }

    // Wrong on this host only: check-config cannot know, the daemon refuses to start (exit 2).
    let total = std::fs::read_to_string("/proc/meminfo").unwrap();
    let total: u64 = total
        .lines()
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024;
    let fake = FakeNvml::new(&format!(
        "{}device 1 uuid=GPU-bbbb total={} used=0\nprocess 1 {} {}\n",
        gpu0(GIB, &[]),
        80 * GIB,
        hog.pid(),
        GIB
    ));
    let host_cases = [
        (
            config("", "", &model).replace(
                "min_available = \"0%\"",
                &format!("min_available = {}", total + GIB),
            ),
            "ram.min_available: ",
            "is at or above this host's MemTotal",
        ),
        (
            config("", "", &model)
                .replace(
                    "min_available = \"0%\"",
                    &format!("min_available = {}", total / 50),
                )
                .replace("warn_available = \"0%\"", "warn_available = \"1%\""),
            "ram.warn_available: '1%'",
            "is below ram.min_available",
        ),
        (
            config(
                "[[gpu.device]]\ngpu = \"0\"\nmin_free = \"20GiB\"",
                "",
                &model,
            ),
            "gpu.device[0] '0'.min_free: '20.0 GiB'",
            "is at or above GPU 0's total (16.0 GiB)",
        ),
    ];
    for (text, key, why) in host_cases {
        let p = write("host.toml", &text);
        let ok = Command::new(BIN)
            .arg("check-config")
            .arg(&p)
            .output()
            .unwrap();
        assert_eq!(
            ok.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&ok.stderr)
        );
        let (code, stderr) = run_to_exit(&p, &dir.path().join("state"), &fake.env());
        assert_eq!(code, Some(2), "{text}\n{stderr}");
        assert!(stderr.contains(key) && stderr.contains(why), "{stderr}");
    }

    // 20 GiB fits GPU 1 (80 GiB): it runs. A reload that puts 20 GiB on every GPU is refused
    // (GPU 0 has 16) and the running config stays.
    let daemon = GuardDaemon::start_with_fake(
        &config(
            "[[gpu.device]]\ngpu = \"1\"\nmin_free = \"20GiB\"",
            "",
            &model,
        ),
        &fake,
    );
    daemon.wait_gpus_on(Some(2), LONG);
    daemon.rewrite_config(&config("min_free = \"20GiB\"", "", &model));
    daemon.signal(nix::sys::signal::Signal::SIGHUP);
    // The failed reload is an event naming the key, its value and GPU 0's total.
    let failed = daemon.wait_for_event("config_reload_failed", LONG, |_| true);
    assert!(
        failed["summary"].as_str().is_some_and(|s| {
            s.contains("gpu.min_free: '20.0 GiB' (20.0 GiB) is at or above GPU 0's total")
        }),
        "{failed}"
    );
    let status = daemon.status();
    assert_eq!(
        status["gpus"][0]["min_free_bytes"],
        Value::Null,
        "{status:#}"
    );
    assert_eq!(status["gpus"][1]["min_free_bytes"].as_u64(), Some(20 * GIB));
    assert_running(&mut hog);
    assert_no_signal(&daemon);
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
    let (code, stderr) = run_to_exit(&config_path, &state, &fake.env());
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("writable by group or others (mode 0777"),
        "{stderr}"
    );

    if nix::unistd::geteuid().is_root() {
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
        nix::unistd::chown(&state, Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();
        let (code, stderr) = run_to_exit(&config_path, &state, &fake.env());
        assert_eq!(code, Some(1), "{stderr}");
        assert!(stderr.contains("owned by uid 65534"), "{stderr}");
    }
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
        daemon.signal(nix::sys::signal::Signal::SIGHUP);
        assert!(reloads(n), "{}", daemon.log_text());
    }
    assert_eq!(webhook_threads(&daemon), 1);

    // A changed sink, each time with a notice in flight to a hung endpoint: the old worker gives
    // up retrying and ends within one request timeout; workers never pile up.
    for (n, url) in [b.url(), a.url(), b.url(), a.url()].iter().enumerate() {
        daemon.rewrite_config("[ram\n");
        daemon.signal(nix::sys::signal::Signal::SIGHUP);
        wait_count(&daemon, "config_reload_failed", "", n + 1);
        daemon.rewrite_config(&with(url));
        daemon.signal(nix::sys::signal::Signal::SIGHUP);
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

#[test]
fn implausible_nvml_counts_leave_the_guard_and_its_sampler_running() {
    let t = token("counts");
    let mut hog = Hog::idle(&t);
    let pid = hog.pid();
    let healthy = gpu0(8 * GIB, &[(pid, 6 * GIB)]);
    let fake = FakeNvml::new(&format!("{healthy}device_count 4294967295\n"));
    let daemon =
        GuardDaemon::start_with_fake(&config("min_free = \"2GiB\"", "", &[("m", &t, "")]), &fake);
    daemon.wait_for_status(LONG, |r| {
        r["gpu_protection"]["state"] == "unavailable"
            && r["gpu_protection"]["reason"]
                .as_str()
                .is_some_and(|why| why.contains("4294967295 GPUs"))
    });
    // A process list claiming 4294967290 entries: unknown, not read, and the GPU below its floor
    // then has no victim to act on.
    fake.set(&format!(
        "{}process_count 0 4294967290\n",
        gpu0(31 * GIB / 2, &[(pid, 6 * GIB)])
    ));
    wait_count(
        &daemon,
        "no_victim",
        "GPU 0 free 512.0 MiB < min_free 2.0 GiB",
        1,
    );
    assert_running(&mut hog);
    assert_no_signal(&daemon);
    assert!(
        !daemon.log_text().contains("panicked"),
        "{}",
        daemon.log_text()
    );

    // NVML makes sense again: the same sampler reads it (usage shows up again). Memory first,
    // then the lists: a pass that read the old free figure and the new list would be a real
    // shortfall, far below the floor for a second sample, with a victim.
    fake.set(&format!("{healthy}process_count 0 4294967290\n"));
    assert!(
        wait_until(LONG, || daemon.status()["gpus"][0]["free_bytes"].as_u64()
            >= Some(2 * GIB)),
        "{:#}",
        daemon.status()
    );
    fake.set(&healthy);
    assert!(
        wait_until(LONG, || {
            let s = daemon.status();
            s["gpu_protection"]["state"] == "ok"
                && s["models"][0]["gpu_bytes"].as_u64() == Some(6 * GIB)
        }),
        "{:#}",
        daemon.status()
    );
    assert_running(&mut hog);
}
