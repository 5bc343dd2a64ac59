//! The tests that load the scripted fake `libnvidia-ml.so.1` (tests/fake_nvml, built by
//! crates/fake-nvml) into this process: `abi` (through nvml-wrapper and the raw C ABI), `sampler` (the
//! daemon's `NvmlGpuSource`, and any state sampled without panicking). A test binary of its own:
//! the fake reads its state from `FAKE_NVML_STATE`, a process-wide variable, so every test here
//! holds the one lock (`Fake`) while the variable points at its own state file, and the daemons
//! started by the integration tests (`tests/integration/`) never inherit it.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

mod abi;
mod sampler;

static ENV_LOCK: Mutex<()> = Mutex::new(());

pub const GIB: u64 = 1 << 30;

pub fn lib_path() -> PathBuf {
    PathBuf::from(gpuguard_fake_nvml::LIBRARY)
}

/// One test's fake: holds the env lock, owns a temp dir with the state file.
pub struct Fake {
    pub dir: tempfile::TempDir,
    pub state: PathBuf,
    _guard: MutexGuard<'static, ()>,
}

impl Fake {
    pub fn new(state: &str) -> Fake {
        let guard = ENV_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let fake = Fake {
            state: dir.path().join("state"),
            dir,
            _guard: guard,
        };
        fake.write(state);
        std::env::set_var("FAKE_NVML_STATE", &fake.state);
        fake
    }

    /// From now on the fake logs every call into `calls` in the test's directory
    /// (`FAKE_NVML_LOG`), for `wait_for_calls`.
    pub fn log_calls(&self) {
        std::env::set_var("FAKE_NVML_LOG", self.dir.path().join("calls"));
    }

    /// Waits until `function` has been called `n` times since `log_calls` (a call is logged as
    /// it comes, before a `delay` or `hold` of it): the barrier a test edits the state behind.
    pub fn wait_for_calls(&self, function: &str, n: usize) {
        while self.calls(function) < n {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// How many times `function` has been called since `log_calls`.
    pub fn calls(&self, function: &str) -> usize {
        let calls = std::fs::read_to_string(self.dir.path().join("calls")).unwrap_or_default();
        calls
            .lines()
            .filter(|l| l.split(' ').next() == Some(function))
            .count()
    }

    /// Replaces the state atomically (temp + rename), as a test must while NVML is in use.
    pub fn write(&self, state: &str) {
        let tmp = self.dir.path().join("state.tmp");
        std::fs::write(&tmp, state).unwrap();
        std::fs::rename(&tmp, &self.state).unwrap();
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        std::env::remove_var("FAKE_NVML_STATE");
        std::env::remove_var("FAKE_NVML_LOG");
    }
}
