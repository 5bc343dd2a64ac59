//! `gpuguard launch` through the real binary and the daemon's socket: the launch lock, memory
//! admission (with the fake NVML), fail-closed timeouts, peer-credential checks, and a socket that
//! survives garbage.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use crate::common::*;

/// A model loader: records its start (time, pid, CUDA_VISIBLE_DEVICES) in `log`, takes 64 MiB
/// of RAM, registers `gpu_bytes` on its GPU in the fake NVML state and idles.
const LOADER_PY: &str = r#"
import fcntl, os, sys, time
name, state, gpu_bytes, log = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
def note(what):
    with open(log, "a") as f:
        f.write(f"{what} {name} {time.time()} {os.getpid()} {os.environ.get('CUDA_VISIBLE_DEVICES', '-')} {os.environ.get('GPUGUARD_LEASE', '-')}\n")
note("start")
ram = b"\x01" * (64 << 20)
gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
with open(state + ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    text = open(state).read() + f"process {gpu} {os.getpid()} {gpu_bytes}\n"
    tmp = f"{state}.{os.getpid()}"
    open(tmp, "w").write(text)
    os.rename(tmp, state)
note("loaded")
time.sleep(600)
"#;

struct Setup {
    fake: FakeNvml,
    daemon: GuardDaemon,
    log: PathBuf,
    socket: PathBuf,
}

fn gpus(free0_gib: u64, free1_gib: u64) -> String {
    format!(
        "device 0 uuid=GPU-aaaa total={} used={}\ndevice 1 uuid=GPU-bbbb total={} used={}\n",
        16 * GIB,
        (16 - free0_gib) * GIB,
        16 * GIB,
        (16 - free1_gib) * GIB
    )
}

fn setup(launch: &str, state: &str) -> Setup {
    setup_with("{state_dir}/gpuguard.sock", launch, state)
}

fn setup_at(socket: &Path, launch: &str, state: &str) -> Setup {
    setup_with(&path(socket), launch, state)
}

fn setup_with(socket: &str, launch: &str, state: &str) -> Setup {
    let fake = FakeNvml::new(state);
    let config = format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\ncandidates = \"models\"\ninterval = \"200ms\"\nscan_interval = \"200ms\"\n[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n[gpu]\nnvml_library = \"{}\"\nsample_timeout = \"500ms\"\n[launch]\nsocket = \"{socket}\"\n{launch}\n",
        FakeNvml::library()
    );
    let daemon = GuardDaemon::start_with_fake(&config, &fake);
    daemon.wait_gpus_on(None, Duration::from_secs(5));
    let log = fake.dir.path().join("loaders.log");
    let socket = if socket.starts_with("{state_dir}") {
        daemon.socket()
    } else {
        PathBuf::from(socket)
    };
    Setup {
        fake,
        daemon,
        log,
        socket,
    }
}

impl Setup {
    fn launch(&self, model: &str, flags: &[&str], loader: (&str, u64)) -> Child {
        self.launch_with(model, flags, loader, Stdio::inherit())
    }

    /// `launch`, the loader's stdin `stdin` (a listener it then holds, as a server holds the
    /// socket of its ready URL).
    fn launch_with(&self, model: &str, flags: &[&str], loader: (&str, u64), stdin: Stdio) -> Child {
        let (name, gpu_bytes) = loader;
        Command::new(BIN)
            .args(["launch", "--model", model])
            .args(flags)
            .arg("--")
            .args([
                python3(),
                "-c",
                LOADER_PY,
                name,
                &path(&self.fake.state),
                &gpu_bytes.to_string(),
                &path(&self.log),
            ])
            .env("GPUGUARD_SOCKET", &self.socket)
            .env_remove("CUDA_VISIBLE_DEVICES")
            .stdin(stdin)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// Loader log lines of `what` ("start", "loaded") for `name`: (time, pid, cuda, lease).
    fn noted(&self, what: &str, name: &str) -> Option<(f64, u32, String, String)> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f[0] == what && f[1] == name)
            .map(|f| {
                (
                    f[2].parse().unwrap(),
                    f[3].parse().unwrap(),
                    f[4].to_string(),
                    f[5].to_string(),
                )
            })
    }

    /// Waits until the daemon's status has `model` in the launch queue.
    fn wait_queued(&self, model: &str) {
        assert!(
            wait_until(Duration::from_secs(10), || queued(
                &self.daemon.status(),
                model
            )),
            "{model} never queued:\n{}",
            self.daemon.log_text()
        );
    }

    fn wait_noted(&self, what: &str, name: &str, timeout: Duration) -> (f64, u32, String, String) {
        assert!(
            wait_until(timeout, || self.noted(what, name).is_some()),
            "{name} never said {what}:\n{}",
            self.daemon.log_text()
        );
        self.noted(what, name).unwrap()
    }
}

/// Whether `model` waits in the launch queue of a status report.
fn queued(report: &serde_json::Value, model: &str) -> bool {
    report["queue"]
        .as_array()
        .is_some_and(|q| q.iter().any(|row| row["model"] == model))
}

fn kill_all(children: &mut [&mut Child]) {
    for c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// The ready URL is answered on a socket the launched server holds (its stdin here; this test
/// answers on its own copy): only the launched process tree's sockets are asked.
#[test]
fn ready_url_answering_releases_the_lock() {
    let s = setup("settle = \"60s\"\nready_timeout = \"60s\"", &gpus(14, 14));
    let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/health", server.local_addr().unwrap());
    let held = Stdio::from(std::os::fd::OwnedFd::from(server.try_clone().unwrap()));
    let mut first = s.launch_with("first", &["--ready-url", &url], ("first", GIB), held);
    s.wait_noted("loaded", "first", Duration::from_secs(5));
    let mut second = s.launch("second", &[], ("second", GIB));
    // The daemon has the second queued, and still has on a tick that began after that.
    s.wait_queued("second");
    assert!(
        queued(&s.daemon.next_tick_status(), "second"),
        "second left the queue before the ready URL answered"
    );
    assert!(
        s.noted("start", "second").is_none(),
        "second started before the ready URL answered"
    );
    // Answer the poller's next request with 200.
    let (mut conn, _) = server.accept().unwrap();
    let mut buf = [0u8; 1024];
    let _ = conn.read(&mut buf).unwrap();
    conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        .unwrap();
    drop(conn);
    s.wait_noted("start", "second", Duration::from_secs(5));
    let ready = s
        .daemon
        .wait_for_event("launch_ready", Duration::from_secs(10), |_| true);
    assert_eq!(ready["severity"], "info", "{ready}");
    kill_all(&mut [&mut first, &mut second]);
}

#[test]
fn launched_command_keeps_the_pid_and_goes_to_the_gpu_with_room() {
    let s = setup("", &gpus(2, 12));
    let mut child = s.launch("placed", &["--gpu-mem", "8GiB"], ("placed", GIB));
    let (_, pid, cuda, lease) = s.wait_noted("start", "placed", Duration::from_secs(5));
    assert_eq!(pid, child.id(), "exec keeps the launcher's pid");
    assert_eq!(cuda, "1", "GPU 1 has the room");
    assert_eq!(lease, "1");
    let released = Command::new(BIN)
        .args(["release", "1"])
        .env("GPUGUARD_SOCKET", &s.socket)
        .output()
        .unwrap();
    assert_eq!(released.status.code(), Some(0));
    // A caller that sets CUDA_VISIBLE_DEVICES gets those GPUs checked, not replaced.
    let out = Command::new(BIN)
        .args([
            "launch",
            "--model",
            "pinned",
            "--gpu-mem",
            "8GiB",
            "--queue-timeout",
            "500ms",
            "--",
            "true",
        ])
        .env("GPUGUARD_SOCKET", s.daemon.socket())
        .env("CUDA_VISIBLE_DEVICES", "0")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(75));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("GPU 0: room 2.0 GiB"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    kill_all(&mut [&mut child]);
}

/// Issue #10: `--gpus N` without `--gpu-mem` still places the command on N GPUs; a launch that
/// fits the card but not now waits, then exits 75 (that its timeout counts from the request's
/// arrival, never less, is `reserve::tests`'s, on the driven clock); a launch that fits at once
/// is not told it was queued; one that can never fit is refused at once (#16), exit 65 (#40).
#[test]
fn gpus_without_a_budget_are_placed_and_queue_timeouts_are_answered() {
    let s = setup("", &gpus(2, 12));
    let run = |args: &[&str]| {
        Command::new(BIN)
            .arg("launch")
            .args(args)
            .env("GPUGUARD_SOCKET", &s.socket)
            .env_remove("CUDA_VISIBLE_DEVICES")
            .output()
            .unwrap()
    };
    let out = run(&[
        "--model",
        "two",
        "--gpus",
        "2",
        "--",
        "sh",
        "-c",
        "echo $CUDA_VISIBLE_DEVICES $GPUGUARD_GPU_MEMORY_FRACTION",
    ]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "0,1");
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("queued"),
        "admitted at once, never said to wait: {out:?}"
    );
    // Fits the card (16 GiB) but not now: waits its whole queue timeout, then 75.
    let out = run(&[
        "--model",
        "late",
        "--gpu-mem",
        "14GiB",
        "--queue-timeout",
        "2s",
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(75), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("queued at position 1"));
    // Never fits: refused at once, saying so, whatever the queue timeout.
    let out = run(&[
        "--model",
        "huge",
        "--gpu-mem",
        "20GiB",
        "--queue-timeout",
        "1h",
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(65), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("can never fit on this host"),
        "{out:?}"
    );
    // The fraction of its GPU a launch's budget is, for vLLM's --gpu-memory-utilization.
    let out = run(&[
        "--model",
        "frac",
        "--gpu-mem",
        "8GiB",
        "--",
        "sh",
        "-c",
        "echo $GPUGUARD_GPU_MEMORY_FRACTION",
    ]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "0.5000");
}

#[test]
fn daemon_not_running_is_a_clear_error_and_nothing_starts() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran");
    let out = Command::new(BIN)
        .args(["launch", "--model", "m", "--", "touch"])
        .arg(&marker)
        .env("GPUGUARD_SOCKET", dir.path().join("nope.sock"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(69));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot reach the gpuguard daemon")
            && err.contains("model 'm' was not started"),
        "{err}"
    );
    assert!(!marker.exists());
    let status = Command::new(BIN)
        .args(["status"])
        .env("GPUGUARD_SOCKET", dir.path().join("nope.sock"))
        .output()
        .unwrap();
    assert_eq!(status.status.code(), Some(69));
}

/// `gpuguard ARGS` as the unprivileged user nobody.
fn as_nobody(socket: &Path, args: &[&str]) -> Output {
    Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", BIN])
        .args(args)
        .env("GPUGUARD_SOCKET", socket)
        .output()
        .unwrap()
}

#[test]
fn a_non_root_client_cannot_release_someone_elses_lease() {
    require_tool("setpriv", "util-linux");
    require_root();
    // A socket that nobody can reach: in a world-traversable directory.
    let (_shared, socket) = shared_socket_dir("gpuguard-sock");
    let s = setup_at(
        &socket,
        "settle = \"60s\"\nready_timeout = \"60s\"",
        &gpus(14, 14),
    );
    let mut first = s.launch("first", &[], ("first", GIB));
    s.wait_noted("loaded", "first", Duration::from_secs(5));
    let mut second = s.launch("second", &[], ("second", GIB));

    let status = as_nobody(&socket, &["status", "--json"]);
    assert_eq!(
        status.status.code(),
        Some(0),
        "anyone may read the status: {}",
        String::from_utf8_lossy(&status.stderr)
    );
    let refused = as_nobody(&socket, &["release", "1"]);
    assert_eq!(refused.status.code(), Some(77));
    assert!(
        String::from_utf8_lossy(&refused.stderr)
            .contains("lease 1 belongs to uid 0, not to uid 65534"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    // A tick that began after the refusal still has the second waiting for the lock.
    assert!(
        queued(&s.daemon.next_tick_status(), "second"),
        "the lock must still be held"
    );
    assert!(
        s.noted("start", "second").is_none(),
        "the lock must still be held"
    );

    // Its owner (root here) may.
    let released = Command::new(BIN)
        .args(["release", "1"])
        .env("GPUGUARD_SOCKET", &socket)
        .output()
        .unwrap();
    assert_eq!(
        released.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&released.stderr)
    );
    s.wait_noted("start", "second", Duration::from_secs(5));
    kill_all(&mut [&mut first, &mut second]);
}
