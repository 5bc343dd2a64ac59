//! Throttling: slow a model's growth without stopping it outright.
//!
//! Where the target owns its cgroup (v2), `memory.high` is pinned at the current usage (the kernel
//! then reclaims and slows allocations above it) and `cpu.max` is cut to a fifth of a core; the
//! old values are restored when lifted. Elsewhere a SIGSTOP/SIGCONT duty cycle runs the target a
//! fifth of the time.
//!
//! Neither may outlive gpuguard: cgroup throttles are recorded in the state directory
//! (`throttled.json`, with the old values and the ones gpuguard wrote) and undone at the next start
//! after a crash; duty-cycled processes are in the held record (`held.rs`) and resumed.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::{Deserialize, Serialize};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::snapshot::ProcessId;

use super::{ProcessControl, Sig};

/// The duty cycle: run `RUN` out of every `PERIOD`.
const PERIOD: Duration = Duration::from_millis(100);
const RUN: Duration = Duration::from_millis(20);

/// The record of cgroup throttles in the state directory.
pub const FILE_NAME: &str = "throttled.json";

/// How a target is being throttled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ThrottleKind {
    Cgroup(CgroupThrottle),
    DutyCycle,
}

/// A cgroup's limits as gpuguard found them and as it set them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CgroupThrottle {
    /// The processes throttled (pid + start time).
    pub ids: Vec<ProcessId>,
    pub dir: PathBuf,
    pub old_memory_high: String,
    pub set_memory_high: String,
    pub old_cpu_max: Option<String>,
    /// `None` where the cgroup has no cpu controller (nothing was written).
    pub set_cpu_max: Option<String>,
}

/// The cut `cpu.max`: a fifth of one CPU.
const THROTTLED_CPU_MAX: &str = "20000 100000";

/// Locks even if a thread panicked holding the lock (a plain list: whole between statements).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The throttles in force, by target (its processes): the one record of who is throttled and
/// how. The duty-cycle thread reads it too.
type Table = HashMap<Vec<ProcessId>, ThrottleKind>;

pub struct Throttler {
    control: Arc<dyn ProcessControl>,
    cgroup_root: PathBuf,
    throttled: Arc<Mutex<Table>>,
    quit: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Throttler {
    pub fn new(control: Arc<dyn ProcessControl>, cgroup_root: impl Into<PathBuf>) -> Self {
        Throttler {
            control,
            cgroup_root: cgroup_root.into(),
            throttled: Arc::default(),
            quit: Arc::default(),
            thread: None,
        }
    }

    /// Throttles these processes (members of one target, all sharing `cgroup` if it is theirs
    /// alone) and records how.
    pub fn throttle(&mut self, ids: &[ProcessId], cgroup: Option<&str>) -> ThrottleKind {
        let kind = cgroup
            .and_then(|cg| self.try_cgroup(ids, cg))
            .unwrap_or(ThrottleKind::DutyCycle);
        lock(&self.throttled).insert(ids.to_vec(), kind.clone());
        if kind == ThrottleKind::DutyCycle {
            self.ensure_thread();
        }
        kind
    }

    /// Whether this target is throttled.
    pub fn is_throttled(&self, ids: &[ProcessId]) -> bool {
        lock(&self.throttled).contains_key(ids)
    }

    /// The cgroup throttles in force (what `throttled.json` records).
    pub fn cgroup_throttles(&self) -> Vec<CgroupThrottle> {
        lock(&self.throttled)
            .values()
            .filter_map(|k| match k {
                ThrottleKind::Cgroup(c) => Some(c.clone()),
                ThrottleKind::DutyCycle => None,
            })
            .collect()
    }

    /// Lifts a target's throttle and lets its processes run; one not on record is taken for a
    /// duty cycle (SIGCONT). Returns how it was throttled, if it was.
    pub fn unthrottle(&mut self, ids: &[ProcessId]) -> Option<ThrottleKind> {
        // Removed and SIGCONTed under the lock: the thread never sends a stale SIGSTOP after.
        let mut table = lock(&self.throttled);
        let kind = table.remove(ids);
        match &kind {
            Some(ThrottleKind::Cgroup(c)) => {
                drop(table);
                lift_cgroup(c);
            }
            Some(ThrottleKind::DutyCycle) | None => {
                for id in ids {
                    let _ = self.control.send(*id, Sig::Cont);
                }
            }
        }
        kind
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
        let set_cpu_max = old_cpu_max
            .as_ref()
            .filter(|_| std::fs::write(dir.join("cpu.max"), THROTTLED_CPU_MAX).is_ok())
            .map(|_| THROTTLED_CPU_MAX.to_string());
        Some(ThrottleKind::Cgroup(CgroupThrottle {
            ids: ids.to_vec(),
            dir,
            old_memory_high,
            set_memory_high: current,
            old_cpu_max,
            set_cpu_max,
        }))
    }

    fn ensure_thread(&mut self) {
        if self.thread.is_some() {
            return;
        }
        let (control, throttled, quit) = (
            self.control.clone(),
            self.throttled.clone(),
            self.quit.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name("throttle".into())
            .spawn(move || {
                while !quit.load(Ordering::Relaxed) {
                    // Signals go out with the list locked, so an unthrottle (which removes its
                    // pids and SIGCONTs them under the same lock) is never followed by a stale
                    // SIGSTOP from here.
                    let stopped = {
                        let table = lock(&throttled);
                        let cycled = duty_cycled(&table);
                        for id in &cycled {
                            let _ = control.send(*id, Sig::Stop);
                        }
                        !cycled.is_empty()
                    };
                    if !stopped {
                        std::thread::sleep(PERIOD);
                        continue;
                    }
                    std::thread::sleep(PERIOD - RUN);
                    for id in duty_cycled(&lock(&throttled)) {
                        let _ = control.send(id, Sig::Cont);
                    }
                    std::thread::sleep(RUN);
                }
            });
        match spawned {
            Ok(handle) => self.thread = Some(handle),
            Err(e) => tracing::error!("cannot start the throttle thread: {e}"),
        }
    }

    /// Stops the duty cycle and lifts every throttle: duty-cycled processes resumed, cgroup
    /// limits put back.
    /// Lifts every throttle (as `shutdown`), and may throttle again afterwards.
    pub fn lift_all(&mut self) {
        self.shutdown();
        self.quit = Arc::default();
    }

    pub fn shutdown(&mut self) {
        self.quit.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        for (ids, kind) in std::mem::take(&mut *lock(&self.throttled)) {
            match kind {
                ThrottleKind::Cgroup(c) => lift_cgroup(&c),
                ThrottleKind::DutyCycle => {
                    for id in ids {
                        let _ = self.control.send(id, Sig::Cont);
                    }
                }
            }
        }
    }
}

/// The processes of the duty-cycled targets.
fn duty_cycled(table: &Table) -> Vec<ProcessId> {
    let mut ids: Vec<ProcessId> = table
        .iter()
        .filter(|(_, k)| **k == ThrottleKind::DutyCycle)
        .flat_map(|(ids, _)| ids.iter().copied())
        .collect();
    ids.sort();
    ids.dedup();
    ids
}

/// Puts a cgroup's limits back as gpuguard found them.
fn lift_cgroup(c: &CgroupThrottle) {
    let _ = std::fs::write(c.dir.join("memory.high"), &c.old_memory_high);
    if let (Some(old), Some(_)) = (&c.old_cpu_max, &c.set_cpu_max) {
        let _ = std::fs::write(c.dir.join("cpu.max"), old);
    }
}

/// Undoes a cgroup throttle a previous run left (after a crash): each limit goes back to its old
/// value if it still holds what gpuguard set (an operator's later change is left alone). Only
/// directories under `cgroup_root` are touched. Returns what was done, or why not.
pub fn restore_leftover(t: &CgroupThrottle, cgroup_root: &Path) -> Result<String, String> {
    let dir = &t.dir;
    let inside = dir.starts_with(cgroup_root)
        && dir
            .components()
            .all(|c| !matches!(c, Component::ParentDir | Component::CurDir));
    if !inside {
        return Err(format!(
            "{} is not under {}: left alone",
            dir.display(),
            cgroup_root.display()
        ));
    }
    let mut done = Vec::new();
    let limits = [
        (
            "memory.high",
            Some(&t.set_memory_high),
            Some(&t.old_memory_high),
        ),
        ("cpu.max", t.set_cpu_max.as_ref(), t.old_cpu_max.as_ref()),
    ];
    for (file, set, old) in limits {
        let (Some(set), Some(old)) = (set, old) else {
            continue;
        };
        match read_trimmed(dir, file) {
            None => done.push(format!("{file} gone (cgroup removed?)")),
            Some(now) if now == *set => match std::fs::write(dir.join(file), old) {
                Ok(()) => done.push(format!("{file} {set} -> {old}")),
                Err(e) => {
                    return Err(format!(
                        "{}/{file}: cannot restore {old}: {e}",
                        dir.display()
                    ))
                }
            },
            Some(now) => done.push(format!(
                "{file} is {now}, not the {set} gpuguard set: left as is"
            )),
        }
    }
    Ok(format!("cgroup {}: {}", dir.display(), done.join(", ")))
}

fn read_trimmed(dir: &Path, file: &str) -> Option<String> {
    std::fs::read_to_string(dir.join(file))
        .ok()
        .map(|s| s.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::act::Recorder;

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
        assert!(matches!(kind, ThrottleKind::Cgroup(_)), "{kind:?}");
        assert_eq!(
            std::fs::read_to_string(dir.join("memory.high")).unwrap(),
            "1073741824"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("cpu.max")).unwrap(),
            "20000 100000"
        );
        assert_eq!(t.unthrottle(&[id(10), id(11)]), Some(kind));
        assert_eq!(
            std::fs::read_to_string(dir.join("memory.high")).unwrap(),
            "max"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("cpu.max")).unwrap(),
            "max 100000"
        );
        assert!(
            recorder.signals.lock().unwrap().is_empty(),
            "no signals for a cgroup throttle"
        );
    }

    #[test]
    fn a_leftover_cgroup_throttle_is_restored_unless_changed_since() {
        let root = tempfile::tempdir().unwrap();
        let dir = cgroup(root.path(), "system.slice/vllm.service", "10\n");
        let mut t = Throttler::new(Arc::new(Recorder::default()), root.path());
        let ThrottleKind::Cgroup(record) =
            t.throttle(&[id(10)], Some("/system.slice/vllm.service"))
        else {
            panic!("a cgroup of its own is throttled through the cgroup");
        };
        // gpuguard crashes here: nothing lifts the throttle until the next start.
        let done = restore_leftover(&record, root.path()).unwrap();
        assert!(done.contains("memory.high 1073741824 -> max"), "{done}");
        assert_eq!(read_trimmed(&dir, "memory.high").as_deref(), Some("max"));
        assert_eq!(read_trimmed(&dir, "cpu.max").as_deref(), Some("max 100000"));

        // An operator set other limits since: left as they are.
        std::fs::write(dir.join("memory.high"), "2147483648\n").unwrap();
        let done = restore_leftover(&record, root.path()).unwrap();
        assert!(
            done.contains("memory.high is 2147483648, not the 1073741824 gpuguard set"),
            "{done}"
        );
        assert_eq!(
            read_trimmed(&dir, "memory.high").as_deref(),
            Some("2147483648")
        );

        // A record pointing outside the cgroup tree is never written to.
        let outside = CgroupThrottle {
            dir: root.path().join("system.slice/../../etc"),
            ..record
        };
        assert!(restore_leftover(&outside, root.path()).is_err());
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
        // Until the duty cycle has stopped it once (however long the scheduler takes).
        while !recorder.signals.lock().unwrap().contains(&(10, Sig::Stop)) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(t.unthrottle(&[id(10)]), Some(kind));
        t.shutdown();
        let sent = recorder.signals.lock().unwrap().clone();
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
