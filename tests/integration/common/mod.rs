//! Test harness: the real `gpuguard` binary as a child daemon, real child processes to act on.
//! Every test process carries a unique token in its command line, and test configs only match
//! those tokens, so a test daemon never touches a process the test did not start. (The one
//! exception, `rules.rs`, matches every root process, in a daemon in observe mode, which never
//! signals.)
//!
//! Tests assert on data: the event log (`events`, `wait_for_event`, `actions_on`, `verbs_on`) and
//! `status --json` (`status`, `wait_for_status`, `wait_gpus_on`), not on the wording of log
//! lines. To assert that nothing happened, a test first waits for proof that the guard looked
//! again (`next_tick_status`: a report from a tick that began after the call), never a sleep.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_gpuguard");
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// Tests that push MemAvailable down run one at a time (their floors are relative to it): one
/// at a time in this test binary (the mutex), and one at a time on this machine (an flock on
/// /tmp/gpuguard-memory-pressure.lock, shared with the benchmarks and other test binaries).
static PRESSURE: Mutex<()> = Mutex::new(());

pub struct PressureLock {
    _in_process: MutexGuard<'static, ()>,
    /// Held by this open file until it is closed.
    _machine: std::fs::File,
}

pub fn memory_pressure_lock() -> PressureLock {
    let in_process = PRESSURE.lock().unwrap_or_else(|e| e.into_inner());
    let file = open_shared_lock(Path::new("/tmp/gpuguard-memory-pressure.lock"));
    rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive).unwrap();
    let machine = file;
    // What the test before gave back may still be coming back to MemAvailable (freed pages of a
    // process that just died, a tmpfs file just deleted): floors taken from it now would be too
    // low, and a crossing the test counts on would come later than it thinks.
    settle_mem_available();
    PressureLock {
        _in_process: in_process,
        _machine: machine,
    }
}

/// Waits (at most 10 s) until MemAvailable holds within 32 MiB over half a second.
fn settle_mem_available() {
    let mut last = mem_available();
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(500));
        let now = mem_available();
        if now.abs_diff(last) < 32 * MIB {
            return;
        }
        last = now;
    }
}

/// Opens (creating if needed) a lock file every user can lock: flock works on a read-only
/// descriptor, and a new file is made world-readable, so root and non-root runs share it.
fn open_shared_lock(path: &Path) -> std::fs::File {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    if let Ok(file) = std::fs::File::open(path) {
        return file;
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o644)
        .open(path)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
    let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644));
    file
}

/// Fails (never skips) a test that needs root, saying how to run it.
pub fn require_root() {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test needs root (it starts processes as other users): run `scripts/test` as root"
    );
}

/// Fails a test that needs a tool, naming the package that has it.
pub fn require_tool(tool: &str, package: &str) {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "{tool} is needed for this test: apt-get install {package} (scripts/test installs it)"
    );
}

/// A token unique to this test process and call, for command lines and configs.
pub fn token(name: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "gpuguard-test-{name}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// MemTotal, in bytes.
pub fn mem_total() -> u64 {
    meminfo_bytes("MemTotal:")
}

fn meminfo_bytes(key: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in /proc/meminfo"));
    kib * 1024
}

pub fn mem_available() -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

/// The state letter of a process from /proc/PID/stat.
pub fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 2..].chars().next()
}

pub fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    cond()
}

/// The real python interpreter (not a pyenv-style shim script, whose `bash` would show up as the
/// process name until it execs python).
pub fn python3() -> &'static str {
    static PYTHON: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PYTHON.get_or_init(|| {
        let out = Command::new("python3")
            .args(["-c", "import sys; print(sys.executable)"])
            .output()
            .expect("python3 is needed for the tests (apt-get install python3)");
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    })
}

/// A python child that allocates `cap_mib` MiB at `rate_mib_s` (0 = as fast as it can) in
/// chunks, prints "full", holds the memory for `hold_s` seconds, then exits 0.
pub struct Hog {
    pub child: Child,
}

const HOG_PY: &str = r#"
import sys, time
token, rate, cap, hold, chunk = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
stop_below = int(sys.argv[6]) if len(sys.argv) > 6 else 0
def available():
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
chunks = []
allocated = 0
while allocated < cap and (stop_below == 0 or available() > stop_below):
    began = time.time()
    chunks.append(b"\x01" * (chunk << 20))
    allocated += chunk
    if rate > 0:
        # Paced per chunk: time spent stopped is not made up afterwards.
        delay = chunk / rate - (time.time() - began)
        if delay > 0:
            time.sleep(delay)
print("full", flush=True)
time.sleep(hold)
"#;

impl Hog {
    pub fn start(token: &str, rate_mib_s: u64, cap_mib: u64, hold_s: u64) -> Hog {
        Self::start_chunked(token, rate_mib_s, cap_mib, hold_s, 16)
    }

    /// A hog that allocates nothing and idles for 10 minutes: a process to match and measure.
    pub fn idle(token: &str) -> Hog {
        Self::start(token, 0, 0, 600)
    }

    pub fn start_chunked(
        token: &str,
        rate_mib_s: u64,
        cap_mib: u64,
        hold_s: u64,
        chunk_mib: u64,
    ) -> Hog {
        Self::spawn(token, [rate_mib_s, cap_mib, hold_s, chunk_mib, 0])
    }

    /// Allocates until MemAvailable is below `stop_below` bytes (or `cap_mib` is reached),
    /// whatever else the machine is doing, then holds for `hold_s` and exits 0.
    pub fn start_until_below(
        token: &str,
        rate_mib_s: u64,
        stop_below: u64,
        cap_mib: u64,
        hold_s: u64,
    ) -> Hog {
        Self::spawn(token, [rate_mib_s, cap_mib, hold_s, 16, stop_below])
    }

    fn spawn(token: &str, numbers: [u64; 5]) -> Hog {
        let child = Command::new(python3())
            .args(["-c", HOG_PY, token])
            .args(numbers.map(|n| n.to_string()))
            .stdout(Stdio::null())
            .spawn()
            .expect("python3 is needed for the tests (apt-get install python3)");
        Hog { child }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the hog to end; returns its status, or None on timeout.
    pub fn wait(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        // Only our own child: SIGCONT first in case a failed test left it stopped.
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32).unwrap();
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::CONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The real gpuguard daemon as a child, with its own state dir, config file and log file.
pub struct GuardDaemon {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub log: PathBuf,
}

/// The packaged unit's capabilities (`CapabilityBoundingSet=CAP_KILL CAP_NET_ADMIN` in
/// systemd/gpuguard.service) for a daemon started as root: a `start_under` wrapper.
pub const UNIT_CAPS: [&str; 4] = [
    "setpriv",
    "--bounding-set=-all,+kill,+net_admin",
    "--inh-caps=-all",
    "--",
];

impl GuardDaemon {
    /// `config` may use `{state_dir}`; it is replaced with this daemon's own directory.
    pub fn start(config: &str) -> GuardDaemon {
        Self::start_with_env(config, &[])
    }

    pub fn start_with_env(config: &str, env: &[(&str, &str)]) -> GuardDaemon {
        let dir = tempfile::tempdir().unwrap();
        Self::start_in(dir, config, env)
    }

    /// A daemon that loads the fake NVML with `fake`'s state (its config names the library).
    pub fn start_with_fake(config: &str, fake: &FakeNvml) -> GuardDaemon {
        Self::start_in_with_fake(tempfile::tempdir().unwrap(), config, fake)
    }

    /// `start_with_fake` in a directory the test prepared (a state dir left by an earlier run).
    pub fn start_in_with_fake(
        dir: tempfile::TempDir,
        config: &str,
        fake: &FakeNvml,
    ) -> GuardDaemon {
        let env = fake.env();
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        Self::start_in(dir, config, &env)
    }

    /// With `GPUGUARD_TEST_UNIT_CAPS` set, every daemon runs with the packaged unit's
    /// capabilities (`UNIT_CAPS`): the whole host suite as the product runs in production.
    pub fn start_in(dir: tempfile::TempDir, config: &str, env: &[(&str, &str)]) -> GuardDaemon {
        let wrapper: &[&str] = if std::env::var_os("GPUGUARD_TEST_UNIT_CAPS").is_some() {
            &UNIT_CAPS
        } else {
            &[]
        };
        Self::start_under(wrapper, dir, config, env)
    }

    /// `start_in`, the daemon run by `wrapper` (a command and its arguments, the daemon's
    /// command line after them: `setpriv` with the packaged unit's capabilities).
    pub fn start_under(
        wrapper: &[&str],
        dir: tempfile::TempDir,
        config: &str,
        env: &[(&str, &str)],
    ) -> GuardDaemon {
        let config_path = dir.path().join("config.toml");
        let config = with_own_socket(config);
        let log = dir.path().join("daemon.log");
        std::fs::write(
            &config_path,
            config.replace("{state_dir}", &dir.path().join("state").to_string_lossy()),
        )
        .unwrap();
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut cmd = Command::new(program);
                cmd.args(args).arg(BIN);
                cmd
            }
            None => Command::new(BIN),
        };
        cmd.args(["daemon", "--config"])
            .arg(&config_path)
            .arg("--state-dir")
            .arg(dir.path().join("state"));
        cmd.env("GPUGUARD_LOG", "debug,gpuguard=debug");
        // Each daemon is its own host as far as enforcing goes (tests run side by side); a test
        // of the host's one enforcer gives two daemons the same lock.
        cmd.env("GPUGUARD_ENFORCE_LOCK", dir.path().join("enforce.lock"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let daemon = GuardDaemon {
            child,
            dir,
            config: config_path,
            log,
        };
        daemon.wait_for_log("started", Duration::from_secs(10));
        daemon
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the log contains `needle`; panics with the log if it never does.
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) {
        if !wait_until(timeout, || self.log_text().contains(needle)) {
            panic!(
                "daemon log never said {needle:?}; log:\n{}",
                self.log_text()
            );
        }
    }

    pub fn rewrite_config(&self, config: &str) {
        let tmp = self.config.with_extension("tmp");
        let mut f = std::fs::File::create(&tmp).unwrap();
        f.write_all(
            with_own_socket(config)
                .replace("{state_dir}", &self.state_dir().to_string_lossy())
                .as_bytes(),
        )
        .unwrap();
        std::fs::rename(tmp, &self.config).unwrap();
    }

    pub fn signal(&self, sig: rustix::process::Signal) {
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(self.child.id() as i32).unwrap(),
            sig,
        )
        .unwrap();
    }

    /// SIGTERM and wait for exit; returns the exit code.
    pub fn stop(mut self) -> (Option<i32>, String) {
        self.signal(rustix::process::Signal::TERM);
        let status = wait_child(&mut self.child, Duration::from_secs(10));
        (status.and_then(|s| s.code()), self.log_text())
    }

    /// SIGKILL (a crash) and wait; returns the state dir so a new daemon can use it.
    pub fn crash(mut self) -> tempfile::TempDir {
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap())
    }
}

/// Each daemon gets its own socket (in its state dir), so tests run in parallel.
fn with_own_socket(config: &str) -> String {
    if config.contains("[launch]") {
        config.to_string()
    } else {
        format!("{config}\n[launch]\nsocket = \"{{state_dir}}/gpuguard.sock\"\n")
    }
}

impl GuardDaemon {
    /// Its socket: `[launch] socket` of its config (`with_own_socket` puts one in its state dir).
    pub fn socket(&self) -> PathBuf {
        let config = std::fs::read_to_string(&self.config).unwrap_or_default();
        config
            .lines()
            .find_map(|l| l.trim().strip_prefix("socket = \""))
            .and_then(|rest| rest.strip_suffix('"'))
            .map_or_else(|| self.state_dir().join("gpuguard.sock"), PathBuf::from)
    }
}

pub fn wait_child(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for GuardDaemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Path helper for readability.
pub fn path(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// A scripted fake libnvidia-ml.so.1 (tests/fake_nvml) with its own state file.
pub struct FakeNvml {
    pub dir: tempfile::TempDir,
    pub state: PathBuf,
}

impl FakeNvml {
    pub fn new(state: &str) -> FakeNvml {
        let dir = tempfile::tempdir().unwrap();
        let fake = FakeNvml {
            state: dir.path().join("nvml-state"),
            dir,
        };
        fake.set(state);
        fake
    }

    /// Replaces the state atomically (the fake re-reads it on every call).
    pub fn set(&self, state: &str) {
        let tmp = self.state.with_extension("tmp");
        std::fs::write(&tmp, state).unwrap();
        std::fs::rename(tmp, &self.state).unwrap();
    }

    pub fn library() -> String {
        gpuguard_fake_nvml::LIBRARY.to_string()
    }

    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![("FAKE_NVML_STATE", path(&self.state))]
    }
}

/// A python parent that starts one python child; both idle. The child's pid is read back.
pub struct Family {
    pub parent: Child,
    pub child_pid: u32,
}

/// The first line `child` prints (its stdout piped; taken from it): the "ready" line of the
/// helper scripts, with what they want the test to know.
pub fn first_line(child: &mut Child) -> String {
    use std::io::BufRead;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout piped"))
        .read_line(&mut line)
        .unwrap();
    line
}

const FAMILY_PY: &str = r#"
import subprocess, sys, time
c = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", sys.argv[1] + "-child"])
print(c.pid, flush=True)
time.sleep(600)
"#;

impl Family {
    pub fn start(token: &str) -> Family {
        let mut parent = Command::new(python3())
            .args(["-c", FAMILY_PY, token])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let line = first_line(&mut parent);
        Family {
            parent,
            child_pid: line.trim().parse().unwrap(),
        }
    }
}

impl Drop for Family {
    fn drop(&mut self) {
        for pid in [self.child_pid as i32, self.parent.id() as i32] {
            let Some(pid) = rustix::process::Pid::from_raw(pid) else {
                continue;
            };
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::CONT);
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
        let _ = self.parent.wait();
    }
}

impl GuardDaemon {
    /// Every notice in the daemon's event log (`state_dir/events.jsonl`), oldest first.
    pub fn events(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.state_dir().join("events.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Waits for an event of `kind` that `pred` accepts; panics with the log if none comes.
    pub fn wait_for_event(
        &self,
        kind: &str,
        timeout: Duration,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let mut found = None;
        let ok = wait_until(timeout, || {
            found = self
                .events()
                .into_iter()
                .find(|e| e["event"] == kind && pred(e));
            found.is_some()
        });
        assert!(ok, "no {kind} event; log:\n{}", self.log_text());
        found.unwrap()
    }

    /// The events of `kind` in the event log, oldest first.
    pub fn events_of(&self, kind: &str) -> Vec<serde_json::Value> {
        self.events()
            .into_iter()
            .filter(|e| e["event"] == kind)
            .collect()
    }

    /// The verbs of the actions done (or, in observe mode, observed) on model `model`, in order:
    /// `["terminate", "kill"]`.
    pub fn verbs_on(&self, model: &str) -> Vec<String> {
        verbs_on(&self.events(), model)
    }

    /// A status report from a tick that began after this call: the report's `uptime_seconds`
    /// (set by the loop as it publishes) has moved on twice since the call. The first report
    /// after the one current at the call was published after it; the next one comes from a
    /// tick that began after that. Proves the guard looked again before a test asserts that
    /// nothing happened.
    pub fn next_tick_status(&self) -> serde_json::Value {
        let mut last = self.status()["uptime_seconds"].as_f64().unwrap_or(0.0);
        let mut report = serde_json::Value::Null;
        for _ in 0..2 {
            let moved = wait_until(Duration::from_secs(20), || {
                report = self.status();
                report["uptime_seconds"].as_f64().is_some_and(|u| u > last)
            });
            assert!(
                moved,
                "the loop published no new status; log:\n{}",
                self.log_text()
            );
            last = report["uptime_seconds"].as_f64().unwrap_or(last);
        }
        report
    }

    /// Waits for a status report that `pred` accepts; returns it (panics with the log if none
    /// comes).
    pub fn wait_for_status(
        &self,
        timeout: Duration,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let mut report = serde_json::Value::Null;
        let ok = wait_until(timeout, || {
            report = self.status();
            pred(&report)
        });
        assert!(ok, "no such status: {report}\nlog:\n{}", self.log_text());
        report
    }

    /// Waits until GPU protection is on (status `gpu_protection.state` "ok": NVML sampled), with
    /// `gpus` GPUs when given.
    pub fn wait_gpus_on(&self, gpus: Option<usize>, timeout: Duration) -> serde_json::Value {
        self.wait_for_status(timeout, |r| {
            r["gpu_protection"]["state"] == "ok"
                && r["gpus"]
                    .as_array()
                    .is_some_and(|g| gpus.is_none_or(|n| g.len() == n))
        })
    }

    /// SIGTERM and wait for exit; returns the exit code, the log and the event log as left.
    pub fn stop_with_events(mut self) -> (Option<i32>, String, Vec<serde_json::Value>) {
        self.signal(rustix::process::Signal::TERM);
        let status = wait_child(&mut self.child, Duration::from_secs(10));
        (
            status.and_then(|s| s.code()),
            self.log_text(),
            self.events(),
        )
    }

    /// `gpuguard status --json` from this daemon.
    pub fn status(&self) -> serde_json::Value {
        let out = Command::new(BIN)
            .args(["status", "--json", "--socket"])
            .arg(self.socket())
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

/// A permit client on the daemon's socket, speaking the protocol as the Python client does.
pub struct PermitClient {
    conn: gpuguard::ipc::client::Connection,
    next_id: u64,
}

impl PermitClient {
    /// A connection that has sent nothing yet is idle: the first acquire opens it.
    pub fn acquire(
        socket: &Path,
        request: gpuguard::protocol::AcquireRequest,
    ) -> (PermitClient, gpuguard::protocol::Response) {
        let id = request.id;
        let conn = gpuguard::ipc::client::Connection::open(
            socket,
            gpuguard::protocol::Request::Acquire(request),
        )
        .unwrap();
        let mut client = PermitClient {
            conn,
            next_id: id + 1,
        };
        let answer = client.receive();
        (client, answer)
    }

    /// Another acquire on the same connection; returns its answer.
    pub fn acquire_more(
        &mut self,
        mut request: gpuguard::protocol::AcquireRequest,
    ) -> gpuguard::protocol::Response {
        request.id = self.next_id;
        self.next_id += 1;
        self.conn
            .send(gpuguard::protocol::Request::Acquire(request))
            .unwrap();
        self.receive()
    }

    pub fn release(&mut self, permit: u64) -> gpuguard::protocol::Response {
        let id = self.next_id;
        self.next_id += 1;
        self.conn
            .send(gpuguard::protocol::Request::ReleasePermit { id, permit })
            .unwrap();
        self.receive()
    }

    pub fn receive(&mut self) -> gpuguard::protocol::Response {
        self.conn.receive().expect("an answer from the daemon")
    }
}

/// An acquire request for `gpu_bytes` on behalf of `model`, waiting at most `timeout_ms`.
pub fn acquire(model: &str, gpu_bytes: u64, timeout_ms: u64) -> gpuguard::protocol::AcquireRequest {
    gpuguard::protocol::AcquireRequest {
        id: 1,
        model: Some(model.to_string()),
        gpu_bytes: Some(gpu_bytes),
        timeout_ms: Some(timeout_ms),
        ..Default::default()
    }
}

/// The permit number of a `granted` answer; panics with the answer otherwise.
pub fn granted(answer: &gpuguard::protocol::Response) -> u64 {
    match answer {
        gpuguard::protocol::Response::Granted { permit, .. } => *permit,
        other => panic!("expected a permit, got {other:?}"),
    }
}

/// A TCP port free on 127.0.0.1 right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The body of a GET, or None.
pub fn get(url: &str) -> Option<String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(5)))
        .build()
        .into();
    agent.get(url).call().ok()?.body_mut().read_to_string().ok()
}

/// `promtool check metrics` on a scrape: it must pass without a word.
pub fn promtool_check(text: &str) {
    require_tool("promtool", "prometheus");
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = promtool.wait_with_output().unwrap();
    assert!(
        out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One sample of a scrape: `series` is the name with its labels as the exporter writes them.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

// ---- what the tests set up the same way ----------------------------------------------------

/// A `[[model]]` section matching the test's own processes by their token, then `rest` (more keys).
pub fn model_toml(name: &str, token: &str, rest: &str) -> String {
    format!("\n[[model]]\nname = \"{name}\"\nmatch = {{ cmdline = \"{token}\" }}\n{rest}\n")
}

/// One `model_toml` section for each (name, token, rest).
pub fn models_toml(models: &[(&str, &str, &str)]) -> String {
    models
        .iter()
        .map(|(name, token, rest)| model_toml(name, token, rest))
        .collect()
}

/// A daemon guarding the fake NVML's GPUs with fast intervals, no RAM floor, `candidates`
/// (`"models"`, or `"any"` where only this test's processes hold GPU memory), the `[gpu]` keys
/// in `gpu` and the models.
pub fn gpu_daemon_config(candidates: &str, gpu: &str, models: &[(&str, &str, &str)]) -> String {
    let mut text = format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\ncandidates = \"{candidates}\"\ninterval = \"200ms\"\nmin_interval = \"10ms\"\nscan_interval = \"200ms\"\nterm_grace = \"300ms\"\n\n[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n\n[gpu]\nnvml_library = \"{}\"\nsample_timeout = \"300ms\"\nretry_init = \"300ms\"\nrelease_timeout = \"1s\"\n{gpu}\n",
        FakeNvml::library()
    );
    text.push_str(&models_toml(models));
    text
}

/// RAM floors about 1 GiB below what is available now: `min_available` and the `[ram]` keys.
pub fn floors_below_now() -> (u64, String) {
    let min = mem_available() - GIB;
    (
        min,
        format!(
            "min_available = {min}\nwarn_available = {}\n",
            min + 256 * MIB
        ),
    )
}

/// Stopped (state T in /proc).
pub fn is_stopped(pid: u32) -> bool {
    proc_state(pid) == Some('T')
}

/// Waits until every one of `pids` is stopped (state T); false on timeout.
pub fn wait_stopped(pids: &[u32], timeout: Duration) -> bool {
    wait_until(timeout, || pids.iter().all(|&pid| is_stopped(pid)))
}

/// A child process killed (and reaped) when the test lets go of it: servers, launches, victims.
/// A server whose workers forked after it loaded: after a line on stdin (or its end: a test may
/// move it into a cgroup meanwhile), it touches argv[2] MiB, forks argv[3] workers that share
/// those pages and sleep, says "forked" and sleeps. Each process shows the whole of it as RSS;
/// between them they hold it once (PSS: a share each).
pub const FORKED_PY: &str = r#"
import os, sys, time
sys.stdin.readline()
data = b"\x01" * (int(sys.argv[2]) << 20)
for _ in range(int(sys.argv[3])):
    if os.fork() == 0:
        time.sleep(600)
        os._exit(0)
print("forked", flush=True)
time.sleep(600)
"#;

pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A directory in /tmp that every user can traverse, and a socket path in it: a daemon socket
/// that an unprivileged client (setpriv) can reach. The directory goes with the `TempDir`.
pub fn shared_socket_dir(prefix: &str) -> (tempfile::TempDir, PathBuf) {
    let shared = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::set_permissions(
        shared.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let socket = shared.path().join("gpuguard.sock");
    (shared, socket)
}

/// The row of model `name` in a status report.
pub fn model_row<'a>(report: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    report["models"]
        .as_array()?
        .iter()
        .find(|m| m["name"] == name)
}

/// The actions in `events` (notices with an `action`) on the processes of model `model`.
pub fn actions_on(events: &[serde_json::Value], model: &str) -> Vec<serde_json::Value> {
    events
        .iter()
        .filter(|e| e["action"].is_object() && e["subject"]["model"] == model)
        .cloned()
        .collect()
}

/// The verbs of the actions in `events` done (or observed) on model `model`, in order.
pub fn verbs_on(events: &[serde_json::Value], model: &str) -> Vec<String> {
    actions_on(events, model)
        .iter()
        .filter(|e| matches!(e["action"]["outcome"].as_str(), Some("done" | "observed")))
        .filter_map(|e| e["action"]["verb"].as_str().map(String::from))
        .collect()
}
