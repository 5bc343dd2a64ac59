//! Test harness: the real `gpuguard` binary as a child daemon, real child processes to act on.
//! Every test process carries a unique token in its command line, and test configs only match
//! those tokens, so a test daemon never touches a process the test did not start.

#![allow(dead_code)]

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
    _machine: nix::fcntl::Flock<std::fs::File>,
}

pub fn memory_pressure_lock() -> PressureLock {
    let in_process = PRESSURE.lock().unwrap_or_else(|e| e.into_inner());
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open("/tmp/gpuguard-memory-pressure.lock")
        .unwrap();
    let machine = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| e)
        .unwrap();
    PressureLock {
        _in_process: in_process,
        _machine: machine,
    }
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
    pub token: String,
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
        Hog {
            child,
            token: token.to_string(),
        }
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
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
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

impl GuardDaemon {
    /// `config` may use `{state_dir}`; it is replaced with this daemon's own directory.
    pub fn start(config: &str) -> GuardDaemon {
        Self::start_with_env(config, &[])
    }

    pub fn start_with_env(config: &str, env: &[(&str, &str)]) -> GuardDaemon {
        let dir = tempfile::tempdir().unwrap();
        Self::start_in(dir, config, env)
    }

    pub fn start_in(dir: tempfile::TempDir, config: &str, env: &[(&str, &str)]) -> GuardDaemon {
        let config_path = dir.path().join("config.toml");
        let config = with_own_socket(config);
        let log = dir.path().join("daemon.log");
        std::fs::write(
            &config_path,
            config.replace("{state_dir}", &dir.path().join("state").to_string_lossy()),
        )
        .unwrap();
        let mut cmd = Command::new(BIN);
        cmd.args(["daemon", "--config"]).arg(&config_path);
        cmd.env("GPUGUARD_LOG", "debug,gpuguard=debug");
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

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig).unwrap();
    }

    /// SIGTERM and wait for exit; returns the exit code.
    pub fn stop(mut self) -> (Option<i32>, String) {
        self.signal(nix::sys::signal::Signal::SIGTERM);
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
    /// The socket `with_own_socket` gave it (tests that set `[launch] socket` know their own).
    pub fn socket(&self) -> PathBuf {
        self.state_dir().join("gpuguard.sock")
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
        format!("{}/libnvidia-ml.so.1", env!("GPUGUARD_FAKE_NVML_DIR"))
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

const FAMILY_PY: &str = r#"
import subprocess, sys, time
c = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", sys.argv[1] + "-child"])
print(c.pid, flush=True)
time.sleep(600)
"#;

impl Family {
    pub fn start(token: &str) -> Family {
        use std::io::BufRead;
        let mut parent = Command::new(python3())
            .args(["-c", FAMILY_PY, token])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(parent.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        Family {
            parent,
            child_pid: line.trim().parse().unwrap(),
        }
    }
}

impl Drop for Family {
    fn drop(&mut self) {
        for pid in [self.child_pid as i32, self.parent.id() as i32] {
            let pid = nix::unistd::Pid::from_raw(pid);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
        let _ = self.parent.wait();
    }
}
