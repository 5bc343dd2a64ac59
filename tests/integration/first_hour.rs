//! A safe first hour (issue 40), through the real binary beside a real stopped process: one
//! guard per host (a second daemon on the service's state directory is refused, a second one
//! that would enforce too is refused, an observer beside it leaves the service's stop standing),
//! `check-config` refusing what the daemon refuses, with exit 2 from both, and a start that
//! fails cleanly never taken for a crash by the next one. The locks themselves, the executor's
//! refusal to resume what it does not hold, and reloads between the modes run in process
//! (`act::claim`, `act::tests`, `daemon::tests`).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::*;

const LONG: Duration = Duration::from_secs(20);

/// A service-like daemon: enforces a tiny RAM budget on the model `token` matches (stop, no
/// grace), nothing else.
fn service_config(token: &str, mode: &str) -> String {
    format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\nmode = \"{mode}\"\ncandidates = \"models\"\n\
         interval = \"200ms\"\nmin_interval = \"10ms\"\nscan_interval = \"200ms\"\n\
         [gpu]\nenabled = false\n[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n{}",
        model_toml(
            "held",
            token,
            "ram = \"16MiB\"\naction = \"stop\"\ngrace = \"0s\""
        )
    )
}

/// The pids the state directory's `stopped.json` lists.
fn recorded_stopped(state_dir: &Path) -> Vec<u32> {
    let text = std::fs::read_to_string(state_dir.join("stopped.json")).unwrap_or_default();
    let entries: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap_or_default();
    entries
        .iter()
        .filter_map(|e| e["pid"].as_u64())
        .map(|p| p as u32)
        .collect()
}

/// `gpuguard ARGS` run to its exit: (exit code, stderr).
fn run_to_exit(args: &[&std::ffi::OsStr], env: &[(&str, &Path)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(args).stdout(Stdio::null()).stderr(Stdio::piped());
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

/// The service stops an over-budget model. Then, on the same host (the same enforce lock):
/// a daemon on the service's state directory (even to observe, even with a broken config) is
/// refused naming the service's pid; one with its own state directory that would enforce is
/// refused naming it too; with `--observe` it runs beside it. Through all of it the model stays
/// stopped and the service's record keeps it. Fails on the main of issue 40: the second daemon
/// resumed the model and emptied the record, and two daemons enforced at once.
#[test]
fn a_second_daemon_never_undoes_the_services_stop() {
    let t = token("held");
    let host = tempfile::tempdir().unwrap();
    let lock = host.path().join("enforce.lock");
    let service = GuardDaemon::start_with_env(
        &service_config(&t, "enforce"),
        &[("GPUGUARD_ENFORCE_LOCK", &path(&lock))],
    );
    let hog = Hog::start(&t, 0, 64, 120);
    assert!(
        wait_stopped(&[hog.pid()], LONG),
        "the service did not stop the model:\n{}",
        service.log_text()
    );
    let state = service.state_dir();
    assert_eq!(recorded_stopped(&state), [hog.pid()]);
    let pid = service.child.id();
    let held_by = format!("is held by gpuguard pid {pid}");

    // The README's first command, run on the service's state directory.
    let other = tempfile::tempdir().unwrap();
    let observe = other.path().join("observe.toml");
    std::fs::write(
        &observe,
        service_config(&t, "observe").replace("{state_dir}", &path(&state)),
    )
    .unwrap();
    let broken = other.path().join("broken.toml");
    std::fs::write(&broken, "[ram]\nmin_available = \"12X\"\n").unwrap();
    let socket = other.path().join("other.sock");
    for (config, code) in [(&observe, 1), (&broken, 2)] {
        let args = [
            "daemon".as_ref(),
            "--observe".as_ref(),
            "--config".as_ref(),
            config.as_os_str(),
            "--state-dir".as_ref(),
            state.as_os_str(),
            "--socket".as_ref(),
            socket.as_os_str(),
        ];
        let (got, stderr) = run_to_exit(&args, &[("GPUGUARD_ENFORCE_LOCK", &lock)]);
        assert_eq!(got, Some(code), "{}: {stderr}", config.display());
        if code == 1 {
            assert!(stderr.contains(&held_by), "{stderr}");
        }
        assert!(!stderr.contains("resumed pid"), "{stderr}");
        assert!(
            is_stopped(hog.pid()),
            "{}: the model was resumed",
            config.display()
        );
        assert_eq!(
            recorded_stopped(&state),
            [hog.pid()],
            "{}",
            config.display()
        );
    }

    // A daemon of its own state directory that would enforce as well: refused.
    let own: PathBuf = other.path().join("own-state");
    let enforce = other.path().join("enforce.toml");
    std::fs::write(
        &enforce,
        service_config(&t, "enforce").replace("{state_dir}", &path(&own)),
    )
    .unwrap();
    let args = [
        "daemon".as_ref(),
        "--config".as_ref(),
        enforce.as_os_str(),
        "--socket".as_ref(),
        socket.as_os_str(),
    ];
    let (got, stderr) = run_to_exit(&args, &[("GPUGUARD_ENFORCE_LOCK", &lock)]);
    assert_eq!(got, Some(1), "{stderr}");
    assert!(
        stderr.contains("the host's enforce lock") && stderr.contains(&held_by),
        "{stderr}"
    );
    assert!(stderr.contains("--observe"), "says what to do: {stderr}");

    // The same config with --observe runs beside the service, and decides on the model too.
    let observer_dir = tempfile::tempdir().unwrap();
    let config = observer_dir.path().join("config.toml");
    std::fs::write(
        &config,
        service_config(&t, "enforce")
            .replace("{state_dir}", &path(&observer_dir.path().join("state"))),
    )
    .unwrap();
    let log = observer_dir.path().join("daemon.log");
    let mut child = KillOnDrop(
        Command::new(BIN)
            .args(["daemon", "--observe", "--config"])
            .arg(&config)
            .arg("--socket")
            .arg(&socket)
            .env("GPUGUARD_ENFORCE_LOCK", &lock)
            .env("GPUGUARD_LOG", "debug")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        wait_until(LONG, || log_text().contains("would stop")),
        "the observer never decided on the model:\n{}",
        log_text()
    );
    assert!(
        log_text().contains("started: mode observe"),
        "{}",
        log_text()
    );
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_raw(child.0.id() as i32).unwrap(),
        rustix::process::Signal::TERM,
    );
    let status = wait_child(&mut child.0, LONG);
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{}", log_text());
    assert!(
        is_stopped(hog.pid()),
        "the observer resumed the model:\n{}",
        log_text()
    );
    assert_eq!(recorded_stopped(&state), [hog.pid()]);
    drop(service);
}

/// The first command of README.md's first code block (`cargo run --release -- ARGS`): its
/// arguments.
fn readme_first_command() -> Vec<String> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let block = readme
        .split("```sh\n")
        .nth(1)
        .expect("README.md has a sh block");
    let line = block
        .lines()
        .find(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        .expect("a command");
    let args = line
        .strip_prefix("cargo run --release -- ")
        .unwrap_or_else(|| {
            panic!("README's first command is not `cargo run --release -- ...`: {line}")
        });
    args.split_whitespace().map(String::from).collect()
}

/// The FastAPI example's command, as clients/python/README.md writes it (its lines joined).
fn fastapi_command() -> String {
    let readme = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/clients/python/README.md"
    ))
    .unwrap();
    let at = readme
        .find("GPUGUARD_MODEL=")
        .expect("the README runs the example");
    readme[at..]
        .lines()
        .take_while(|l| !l.starts_with("```"))
        .collect::<Vec<_>>()
        .join("\n")
        .replace("\\\n", " ")
}

/// Issue 40: the README's first command observes (it cannot act on a host by surprise), and
/// against it, with the example config, the FastAPI example runs as its README writes it (HTTP
/// 200: its GPUGUARD_MODEL names a model the example config has; on main, `qwen` against
/// `qwen-32b` answered 500). Only what keeps the test to itself is added: a state directory,
/// socket and enforce lock of its own, a fake one-GPU host, and a free port for uvicorn.
#[test]
fn the_readme_commands_run_as_written_against_the_example_config() {
    let args = readme_first_command();
    assert_eq!(
        args,
        ["daemon", "--observe", "--config", "config.example.toml"],
        "README.md's first command changed: this test runs it"
    );
    let python = crate::permits_python::venv_python();
    let fake = FakeNvml::new(&format!(
        "device 0 uuid=GPU-readme total={} used=0\n",
        24 * GIB
    ));
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("gpuguard.sock");
    let log = dir.path().join("daemon.log");
    let _daemon = KillOnDrop(
        Command::new(BIN)
            .args(&args)
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .arg("--socket")
            .arg(&socket)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("GPUGUARD_ENFORCE_LOCK", dir.path().join("enforce.lock"))
            .env("LD_LIBRARY_PATH", gpuguard_fake_nvml::DIR)
            .env("FAKE_NVML_STATE", &fake.state)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
    let gpu_on = || {
        let out = Command::new(BIN)
            .args(["status", "--json", "--socket"])
            .arg(&socket)
            .output()
            .unwrap();
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        report["gpu_protection"]["state"] == "ok" && report["mode"] == "observe"
    };
    assert!(
        wait_until(LONG, gpu_on),
        "GPU protection never on; the daemon: {}",
        log_text()
    );

    let command = fastapi_command();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let command = command.replace("--port 8000", &format!("--port {port}"));
    assert!(command.contains(&format!("--port {port}")), "{command}");
    let bin = Path::new(&python).parent().unwrap();
    let mut server = KillOnDrop(
        Command::new("sh")
            .arg("-c")
            // `exec` after the variable assignments: the server is the child the test kills.
            .arg(command.replacen("uvicorn ", "exec uvicorn ", 1))
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env(
                "PATH",
                format!("{}:{}", bin.display(), std::env::var("PATH").unwrap()),
            )
            .env("GPUGUARD_SOCKET", &socket)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let answer = || {
        use std::io::Write;
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
        let body = r#"{"prompt": "gpuguard"}"#;
        write!(
            stream,
            "POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .ok()?;
        let mut text = String::new();
        stream.read_to_string(&mut text).ok()?;
        Some(text)
    };
    let mut text = None;
    assert!(
        wait_until(LONG, || {
            text = answer();
            text.is_some()
        }),
        "uvicorn never answered"
    );
    let _ = server.0.kill();
    let mut stderr = String::new();
    let _ = server.0.stderr.take().unwrap().read_to_string(&mut stderr);
    let text = text.unwrap();
    assert!(
        text.starts_with("HTTP/1.1 200"),
        "{command}\n{text}\nuvicorn: {stderr}\ndaemon: {}",
        log_text()
    );
    assert!(text.contains(r#""text":"draugupg""#), "{text}");
}

/// A start that fails cleanly (a config that cannot work here: its webhook's secret file is
/// missing) exits 2 before it records anything, so the next start on that state directory
/// reports no `previous_run_unclean`. (On the main of issue 40 it exited 1 after the flight
/// recorder had begun, and the next start called it "killed or crashed".)
#[test]
fn a_start_that_fails_cleanly_is_not_taken_for_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let config = |extra: &str| {
        format!(
            "[daemon]\nstate_dir = \"{{state_dir}}\"\n[gpu]\nenabled = false\n\
             [ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n{extra}"
        )
    };
    let failing = dir.path().join("failing.toml");
    let text = config(&format!(
        "[[alert.webhook]]\nurl = \"http://127.0.0.1:9/hook\"\nsecret_file = \"{}\"\n",
        dir.path().join("no-such-secret").display()
    ));
    std::fs::write(&failing, text.replace("{state_dir}", &path(&state))).unwrap();
    let socket = dir.path().join("failing.sock");
    let lock = dir.path().join("enforce.lock");
    let args = [
        "daemon".as_ref(),
        "--config".as_ref(),
        failing.as_os_str(),
        "--socket".as_ref(),
        socket.as_os_str(),
    ];
    let (code, stderr) = run_to_exit(&args, &[("GPUGUARD_ENFORCE_LOCK", &lock)]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("secret_file"), "{stderr}");
    let daemon = GuardDaemon::start_in(dir, &config(""), &[]);
    daemon.wait_for_event("daemon_started", LONG, |_| true);
    let unclean = daemon.events_of("previous_run_unclean");
    assert!(
        unclean.is_empty(),
        "a clean failure taken for a crash: {unclean:#?}"
    );
}

/// Round five (a hostile review of issue 40): any user who binds the metrics port first (a
/// loopback port anyone may take) made root's daemon exit 2, which systemd never restarts: the
/// guard off for good. Now it starts without its metrics, says so (a critical
/// `metrics_unavailable`), guards, and serves them once the port is free.
#[test]
fn a_metrics_port_someone_else_holds_never_keeps_the_guard_down() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap();
    let daemon = GuardDaemon::start(&format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\n[gpu]\nenabled = false\n\
         [ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n\
         [metrics]\nlisten = \"{port}\"\n"
    ));
    let said = daemon.wait_for_event("metrics_unavailable", LONG, |e| e["severity"] == "critical");
    assert!(
        said["summary"]
            .as_str()
            .unwrap_or("")
            .contains("held by another program"),
        "{said}"
    );
    // It guards meanwhile: its loop publishes.
    daemon.next_tick_status();
    drop(taken);
    let scrape = || {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect(port).ok()?;
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).ok()?;
        text.contains("gpuguard_").then_some(text)
    };
    assert!(
        wait_until(Duration::from_secs(60), || scrape().is_some()),
        "metrics never served once the port was free:\n{}",
        daemon.log_text()
    );
}
