//! Throttling: slow a model's growth without stopping it outright.
//!
//! Where the target owns its cgroup (v2), `memory.high` is pinned at the current usage (the kernel
//! then reclaims and slows allocations above it) and `cpu.max` is cut to a fifth of a core; the
//! old values are restored when lifted. Elsewhere a SIGSTOP/SIGCONT duty cycle runs the target a
//! fifth of the time.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::snapshot::ProcessId;

use super::{ProcessControl, Sig};

/// The duty cycle: run `RUN` out of every `PERIOD`.
const PERIOD: Duration = Duration::from_millis(100);
const RUN: Duration = Duration::from_millis(20);

/// How a target is being throttled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ThrottleKind {
    Cgroup {
        dir: PathBuf,
        old_memory_high: String,
        old_cpu_max: Option<String>,
    },
    DutyCycle,
}

pub struct Throttler {
    control: Arc<dyn ProcessControl>,
    cgroup_root: PathBuf,
    cycled: Arc<Mutex<Vec<ProcessId>>>,
    quit: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Throttler {
    pub fn new(control: Arc<dyn ProcessControl>, cgroup_root: impl Into<PathBuf>) -> Self {
        Throttler {
            control,
            cgroup_root: cgroup_root.into(),
            cycled: Arc::default(),
            quit: Arc::default(),
            thread: None,
        }
    }

    /// Throttles these processes (members of one target, all sharing `cgroup` if it is theirs alone).
    pub fn throttle(&mut self, ids: &[ProcessId], cgroup: Option<&str>) -> ThrottleKind {
        if let Some(kind) = cgroup.and_then(|cg| self.try_cgroup(ids, cg)) {
            return kind;
        }
        let mut cycled = self.cycled.lock().expect("throttle lock");
        for id in ids {
            if !cycled.contains(id) {
                cycled.push(*id);
            }
        }
        drop(cycled);
        self.ensure_thread();
        ThrottleKind::DutyCycle
    }

    /// Lifts a throttle and lets the processes run.
    pub fn unthrottle(&mut self, ids: &[ProcessId], kind: &ThrottleKind) {
        match kind {
            ThrottleKind::Cgroup {
                dir,
                old_memory_high,
                old_cpu_max,
            } => {
                let _ = std::fs::write(dir.join("memory.high"), old_memory_high);
                if let Some(old) = old_cpu_max {
                    let _ = std::fs::write(dir.join("cpu.max"), old);
                }
            }
            ThrottleKind::DutyCycle => {
                let mut cycled = self.cycled.lock().expect("throttle lock");
                cycled.retain(|id| !ids.contains(id));
                for id in ids {
                    let _ = self.control.send(*id, Sig::Cont);
                }
            }
        }
    }

    /// Pins memory.high and cpu.max of a cgroup that holds these processes and nothing else.
    fn try_cgroup(&self, ids: &[ProcessId], cgroup: &str) -> Option<ThrottleKind> {
        if cgroup.is_empty() || cgroup == "/" {
            return None;
        }
        let dir = self.cgroup_root.join(cgroup.trim_start_matches('/'));
        let procs = std::fs::read_to_string(dir.join("cgroup.procs")).ok()?;
        let own = procs
            .lines()
            .filter_map(|l| l.trim().parse::<i32>().ok())
            .all(|pid| ids.iter().any(|id| id.pid == pid));
        if !own {
            return None;
        }
        let old_memory_high = read_trimmed(&dir, "memory.high")?;
        let current = read_trimmed(&dir, "memory.current")?;
        std::fs::write(dir.join("memory.high"), &current).ok()?;
        let old_cpu_max = read_trimmed(&dir, "cpu.max");
        if old_cpu_max.is_some() {
            let _ = std::fs::write(dir.join("cpu.max"), "20000 100000");
        }
        Some(ThrottleKind::Cgroup {
            dir,
            old_memory_high,
            old_cpu_max,
        })
    }

    fn ensure_thread(&mut self) {
        if self.thread.is_some() {
            return;
        }
        let (control, cycled, quit) =
            (self.control.clone(), self.cycled.clone(), self.quit.clone());
        let spawned = std::thread::Builder::new()
            .name("throttle".into())
            .spawn(move || {
                while !quit.load(Ordering::Relaxed) {
                    // Signals go out with the list locked, so an unthrottle (which removes its
                    // pids and SIGCONTs them under the same lock) is never followed by a stale
                    // SIGSTOP from here.
                    let stopped = {
                        let cycled = cycled.lock().expect("throttle lock");
                        for id in cycled.iter() {
                            let _ = control.send(*id, Sig::Stop);
                        }
                        !cycled.is_empty()
                    };
                    if !stopped {
                        std::thread::sleep(PERIOD);
                        continue;
                    }
                    std::thread::sleep(PERIOD - RUN);
                    for id in cycled.lock().expect("throttle lock").iter() {
                        let _ = control.send(*id, Sig::Cont);
                    }
                    std::thread::sleep(RUN);
                }
            });
        match spawned {
            Ok(handle) => self.thread = Some(handle),
            Err(e) => tracing::error!("cannot start the throttle thread: {e}"),
        }
    }

    /// Stops the duty cycle and resumes everything it held.
    pub fn shutdown(&mut self) {
        self.quit.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        for id in std::mem::take(&mut *self.cycled.lock().expect("throttle lock")) {
            let _ = self.control.send(id, Sig::Cont);
        }
    }
}

fn read_trimmed(dir: &Path, file: &str) -> Option<String> {
    std::fs::read_to_string(dir.join(file))
        .ok()
        .map(|s| s.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::act::SignalError;

    /// Records signals instead of sending them.
    #[derive(Default)]
    struct Recorder(Mutex<Vec<(i32, Sig)>>);

    impl ProcessControl for Recorder {
        fn send(&self, id: ProcessId, sig: Sig) -> Result<(), SignalError> {
            self.0.lock().unwrap().push((id.pid, sig));
            Ok(())
        }
        fn is_stopped(&self, _: ProcessId) -> bool {
            false
        }
    }

    fn cgroup(root: &Path, name: &str, procs: &str) -> PathBuf {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cgroup.procs"), procs).unwrap();
        std::fs::write(dir.join("memory.high"), "max\n").unwrap();
        std::fs::write(dir.join("memory.current"), "1073741824\n").unwrap();
        std::fs::write(dir.join("cpu.max"), "max 100000\n").unwrap();
        dir
    }

    fn id(pid: i32) -> ProcessId {
        ProcessId { pid, start_time: 1 }
    }

    #[test]
    fn own_cgroup_gets_memory_high_and_cpu_max_then_restored() {
        let root = tempfile::tempdir().unwrap();
        let dir = cgroup(root.path(), "system.slice/vllm.service", "10\n11\n");
        let recorder = Arc::new(Recorder::default());
        let mut t = Throttler::new(recorder.clone(), root.path());
        let kind = t.throttle(&[id(10), id(11)], Some("/system.slice/vllm.service"));
        assert!(matches!(kind, ThrottleKind::Cgroup { .. }), "{kind:?}");
        assert_eq!(
            std::fs::read_to_string(dir.join("memory.high")).unwrap(),
            "1073741824"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("cpu.max")).unwrap(),
            "20000 100000"
        );
        t.unthrottle(&[id(10), id(11)], &kind);
        assert_eq!(
            std::fs::read_to_string(dir.join("memory.high")).unwrap(),
            "max"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("cpu.max")).unwrap(),
            "max 100000"
        );
        assert!(
            recorder.0.lock().unwrap().is_empty(),
            "no signals for a cgroup throttle"
        );
    }

    #[test]
    fn shared_cgroup_falls_back_to_a_duty_cycle_that_ends_running() {
        let root = tempfile::tempdir().unwrap();
        cgroup(root.path(), "user.slice", "10\n99\n");
        let recorder = Arc::new(Recorder::default());
        let mut t = Throttler::new(recorder.clone(), root.path());
        let kind = t.throttle(&[id(10)], Some("/user.slice"));
        assert_eq!(
            kind,
            ThrottleKind::DutyCycle,
            "pid 99 is not ours: the cgroup is shared"
        );
        std::thread::sleep(PERIOD * 3);
        t.unthrottle(&[id(10)], &kind);
        t.shutdown();
        let sent = recorder.0.lock().unwrap().clone();
        assert!(sent.contains(&(10, Sig::Stop)), "{sent:?}");
        assert_eq!(
            sent.last(),
            Some(&(10, Sig::Cont)),
            "left running: {sent:?}"
        );
        assert!(
            sent.iter().all(|s| s.0 == 10),
            "only the throttled pid: {sent:?}"
        );
    }
}
