//! Acting on the plan: signals through pidfds, throttles, and the records (in the state
//! directory) of what is held stopped or throttled. Honours observe mode, and reads memory again
//! just before a floor action. Only the daemon that holds the host's enforce lock signals
//! (`claim.rs`); a daemon resumes only what it holds itself, and lets go of what a previous run
//! left on its state directory only while no other daemon enforces.
//!
//! Who owns what is held: the `HeldRecord` (`stopped.json`) is the one record of the processes
//! gpuguard keeps stopped (SIGSTOP or a duty cycle), written before the signal; the `Throttler`'s
//! table is the one record of the throttles in force (cgroup ones persisted as `throttled.json`).
//! The policy's `PolicyState::held` is not a record of signals: it is the floor's decision about
//! a closed incident's stopped victim (which resource releases it, since when), kept in observe
//! mode too, and it learns whether the stop happened only from outcomes.

pub mod claim;
pub mod held;
pub mod signal;
pub mod throttle;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::{info, warn};

use crate::config::Mode;
use crate::policy::{Action, Resource, Target, Verb};
use crate::snapshot::{printable, ProcessId};
use crate::state_dir::StateDir;
use crate::units::fmt_bytes;

use claim::Holder;
use held::{read_record, write_record, HeldProcess, HeldRecord};
use throttle::{CgroupThrottle, ThrottleKind, Throttler};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sig {
    Stop,
    Cont,
    Term,
    Kill,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SignalError {
    /// The process has exited.
    Gone,
    /// The pid now belongs to another process.
    Replaced,
    /// Not permitted.
    Denied,
    Failed(String),
}

impl fmt::Display for SignalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SignalError::Gone => f.write_str("process has exited"),
            SignalError::Replaced => f.write_str("pid now belongs to another process"),
            SignalError::Denied => f.write_str("permission denied"),
            SignalError::Failed(e) => f.write_str(e),
        }
    }
}

/// Signals processes identified by pid + start time.
pub trait ProcessControl: Send + Sync {
    fn send(&self, id: ProcessId, sig: Sig) -> Result<(), SignalError>;
    /// True if this exact process is in the stopped state.
    fn is_stopped(&self, id: ProcessId) -> bool;
    /// Runs the signal path's checks once on gpuguard itself, signalling nothing, so their
    /// code is resident before an emergency needs it (`daemon/warm.rs`).
    fn warm_up(&self) {}
}

pub use crate::policy::Outcome;

pub struct Executor {
    control: Arc<dyn ProcessControl>,
    dir: Arc<StateDir>,
    /// What is held stopped (SIGSTOP or a duty cycle), written ahead of the signal.
    held: HeldRecord,
    /// What is throttled, and how.
    throttler: Throttler,
    /// The host's enforce lock, while this daemon may act: without it nothing is signalled but
    /// this run's own holds let go (`execute`).
    enforcing: Option<claim::Lock>,
    enforce_lock: PathBuf,
    /// This daemon, as it writes itself into the locks it takes.
    me: Holder,
    /// cgroup throttles a previous run left and this one has not lifted yet: kept in the record.
    inherited_throttles: Vec<CgroupThrottle>,
    cgroup_root: PathBuf,
}

/// What a previous gpuguard run left held, and what became of it.
#[derive(Debug, Default)]
pub struct Leftovers {
    /// Done: processes resumed, cgroup limits restored.
    pub undone: Vec<String>,
    /// Left held on purpose: another daemon enforces on the host, and letting go could undo its
    /// work (the records keep them for the next daemon here that may act).
    pub kept: Vec<String>,
    /// Not done, to be reported loudly: unreadable records (set aside), limits left in place.
    pub problems: Vec<String>,
}

impl Leftovers {
    /// One log line each: what was undone (warn), what could not be (error).
    pub fn log(&self) {
        for line in &self.undone {
            warn!("{line}");
        }
        for line in &self.kept {
            tracing::error!("{line}");
        }
        for line in &self.problems {
            tracing::error!("{line}");
        }
    }
}

impl Executor {
    /// Takes over a state directory the caller has claimed (`claim::claim_state_dir`). In
    /// enforce `mode` it takes the host's enforce lock, and refuses if another daemon holds it.
    /// What a previous run (one that crashed, or was killed) left held there is let go of when
    /// this daemon may act on the host: SIGCONT to every recorded process still stopped (same
    /// pid and start time), cgroup limits put back. An observer takes the enforce lock for that
    /// moment only; while another daemon enforces it keeps the leftovers in the records, said
    /// loudly, for the next daemon here that may act.
    pub fn new(
        control: Arc<dyn ProcessControl>,
        dir: Arc<StateDir>,
        cgroup_root: &Path,
        mode: Mode,
        enforce_lock: &Path,
        me: Holder,
    ) -> Result<(Self, Leftovers), claim::ClaimError> {
        let mut leftovers = Leftovers::default();
        let held = HeldRecord::open(dir.clone(), &mut leftovers.problems);
        let inherited_throttles = match read_record::<CgroupThrottle>(&dir, throttle::FILE_NAME) {
            Ok(records) => records,
            Err(problem) => {
                leftovers.problems.push(problem);
                Vec::new()
            }
        };
        let enforcing = match mode {
            Mode::Enforce => Some(claim::take_enforce_lock(enforce_lock, &me)?),
            Mode::Observe => None,
        };
        let throttler = Throttler::new(control.clone(), PathBuf::from(cgroup_root));
        let mut executor = Executor {
            control,
            dir,
            held,
            throttler,
            enforcing,
            enforce_lock: enforce_lock.to_path_buf(),
            me,
            inherited_throttles,
            cgroup_root: cgroup_root.to_path_buf(),
        };
        executor.let_go_of_leftovers(&mut leftovers);
        Ok((executor, leftovers))
    }

    /// Whether this daemon holds the host's enforce lock (and so may signal).
    pub fn enforcing(&self) -> bool {
        self.enforcing.is_some()
    }

    /// A reloaded config's mode: to enforce, the host's enforce lock is taken (refused if another
    /// daemon holds it: the caller keeps the old config) and what a previous run left here is let
    /// go of; to observe, everything this run holds is let go (resumed, throttles lifted), then
    /// the lock.
    pub fn set_mode(&mut self, mode: Mode) -> Result<Leftovers, claim::ClaimError> {
        let mut leftovers = Leftovers::default();
        match mode {
            Mode::Enforce if self.enforcing.is_none() => {
                self.enforcing = Some(claim::take_enforce_lock(&self.enforce_lock, &self.me)?);
                self.let_go_of_leftovers(&mut leftovers);
            }
            Mode::Enforce => {}
            Mode::Observe => {
                // An observer holds nothing: what this run holds is let go before the lock (a
                // process left stopped by an observer would stay so, past max_stop).
                if self.enforcing.is_some() {
                    self.throttler.lift_all();
                    self.save_throttles();
                    for p in self.held.resume_all(self.control.as_ref()) {
                        leftovers.undone.push(format!(
                            "resumed pid {} ({}): this gpuguard observes from now on",
                            p.pid,
                            printable(&p.comm)
                        ));
                    }
                }
                self.enforcing = None;
            }
        }
        Ok(leftovers)
    }

    /// Once a tick, while enforcing: the host's enforce lock still named by its path. A lock file
    /// removed under this daemon (a stopped service's runtime directory removed under a daemon
    /// started by hand) is taken anew; if another daemon holds the new one, this one lets go of
    /// what it holds and observes from now on. Returns what happened, to be said (and whether it
    /// observes now).
    pub fn keep_enforce_lock(&mut self) -> Option<(String, bool)> {
        let lock = self.enforcing.as_ref()?;
        if lock.still_named() {
            return None;
        }
        let path = lock.path().display().to_string();
        match claim::take_enforce_lock(&self.enforce_lock, &self.me) {
            Ok(anew) => {
                self.enforcing = Some(anew);
                Some((
                    format!("the host's enforce lock {path} had been removed: taken anew"),
                    false,
                ))
            }
            Err(e) => {
                let let_go = self.set_mode(Mode::Observe).unwrap_or_default();
                Some((
                    format!(
                        "the host's enforce lock {path} was removed and {e}: this daemon observes \
                         from now on{}",
                        if let_go.undone.is_empty() {
                            String::new()
                        } else {
                            format!(" ({})", let_go.undone.join("; "))
                        }
                    ),
                    true,
                ))
            }
        }
    }

    /// What a previous run left, let go of if this daemon may act on the host now.
    fn let_go_of_leftovers(&mut self, out: &mut Leftovers) {
        if self.held.inherited().is_empty() && self.inherited_throttles.is_empty() {
            return;
        }
        // An observer takes the enforce lock for this moment: no other daemon enforces then, so
        // letting go undoes nobody's work.
        let _moment = match &self.enforcing {
            Some(_) => None,
            None => match claim::take_enforce_lock(&self.enforce_lock, &self.me) {
                Ok(lock) => Some(lock),
                Err(e) => {
                    let pids: Vec<String> = self
                        .held
                        .inherited()
                        .iter()
                        .map(|p| format!("{} ({})", p.pid, printable(&p.comm)))
                        .collect();
                    out.kept.push(format!(
                        "what a previous gpuguard run left held in {} stays held, since letting go \
                         could undo another daemon's work ({e}); still stopped, if they run: pids \
                         {}; cgroup throttles: {}. The next daemon on this state directory that \
                         may act lets go of them",
                        self.dir.path().display(),
                        if pids.is_empty() { "none".into() } else { pids.join(", ") },
                        self.inherited_throttles.len()
                    ));
                    return;
                }
            },
        };
        for p in self.held.take_inherited(self.control.as_ref()) {
            // The record is gpuguard's own, but what it names was chosen by the process.
            out.undone.push(format!(
                "resumed pid {} ({}) left stopped ({}) by a previous gpuguard run",
                p.pid,
                printable(&p.comm),
                printable(&p.why)
            ));
        }
        for r in std::mem::take(&mut self.inherited_throttles) {
            match throttle::restore_leftover(&r, &self.cgroup_root) {
                Ok(done) => out.undone.push(format!(
                    "lifted a throttle left by a previous gpuguard run: {done}"
                )),
                Err(e) => out.problems.push(format!("throttle left in place: {e}")),
            }
        }
        if let Err(e) = self.write_throttles() {
            out.problems.push(format!(
                "{}/{}: cannot write: {e}",
                self.dir.path().display(),
                throttle::FILE_NAME
            ));
        }
    }

    pub fn held(&self) -> &[HeldProcess] {
        self.held.entries()
    }

    /// The cgroup throttles in force and those a previous run left, to the record.
    fn write_throttles(&self) -> std::io::Result<()> {
        let mut cgroups = self.throttler.cgroup_throttles();
        cgroups.extend(self.inherited_throttles.iter().cloned());
        write_record(&self.dir, throttle::FILE_NAME, &cgroups)
    }

    /// Records the cgroup throttles in force, so a crash never leaves one behind.
    fn save_throttles(&self) {
        if let Err(e) = self.write_throttles() {
            tracing::error!(
                "cannot write {}/{}: {e}; a crash now would leave cgroup throttles in place",
                self.dir.path().display(),
                throttle::FILE_NAME
            );
        }
    }

    /// Carries out one action. `cgroup` gives the target's cgroup when it has one of its own;
    /// `read_available` re-reads a resource for the last check before acting.
    pub fn execute(
        &mut self,
        mode: Mode,
        action: &Action,
        cgroup: Option<&str>,
        read_available: &mut dyn FnMut(Resource) -> Option<u64>,
    ) -> Outcome {
        let verb = action.verb.as_str();
        let target = &action.target;
        let why = &action.reason.detail;
        // Without the host's enforce lock nothing is signalled (another daemon may enforce);
        // what this run holds itself is still let go.
        let mode = if self.enforcing() {
            mode
        } else {
            Mode::Observe
        };
        let ids: Vec<ProcessId> = target.ids().collect();
        if matches!(action.verb, Verb::Resume | Verb::Unthrottle)
            && !ids.iter().any(|&id| self.held.holds(id))
            && !self.throttler.is_throttled(&ids)
        {
            // Never another daemon's stop, nor one an observer only decided on.
            info!(
                verb,
                "not going to {verb} {target}: this gpuguard does not hold it"
            );
            return match mode {
                Mode::Observe => Outcome::Observed,
                Mode::Enforce => Outcome::Skipped("not held by this gpuguard".into()),
            };
        }
        if mode == Mode::Observe && !matches!(action.verb, Verb::Resume | Verb::Unthrottle) {
            info!(
                verb,
                reason = action.reason.kind.as_str(),
                "observe mode: would {verb} {target}: {why}"
            );
            return Outcome::Observed;
        }
        if let Some(recheck) = action.recheck {
            if let Some(now) = read_available(recheck.resource) {
                if now >= recheck.below_bytes {
                    let text = format!(
                        "{} recovered to {} while choosing a victim",
                        recheck.resource,
                        fmt_bytes(now)
                    );
                    info!(verb, "not going to {verb} {target}: {text}");
                    return Outcome::Skipped(text);
                }
            }
        }
        let outcome = match action.verb {
            Verb::Throttle => {
                let kind = self.throttler.throttle(&ids, cgroup);
                if kind == ThrottleKind::DutyCycle {
                    self.hold(target, "throttle");
                }
                if matches!(kind, ThrottleKind::Cgroup(_)) {
                    self.save_throttles();
                }
                Outcome::Done
            }
            Verb::Unthrottle => {
                if let Some(ThrottleKind::Cgroup(_)) = self.throttler.unthrottle(&ids) {
                    self.save_throttles();
                }
                ids.iter().for_each(|id| self.held.remove(*id));
                Outcome::Done
            }
            Verb::Stop => {
                // Recorded before the signal (write-ahead): a crash between the two must not
                // leave a stopped process that no record lets the next start resume.
                self.hold(target, "stop");
                let outcome = self.signal_all(target, Sig::Stop);
                if outcome != Outcome::Done {
                    ids.iter().for_each(|id| self.held.remove(*id));
                }
                outcome
            }
            Verb::Resume => self.signal_all(target, Sig::Cont),
            Verb::Terminate => self.signal_all(target, Sig::Term),
            Verb::Kill => self.signal_all(target, Sig::Kill),
        };
        // A signal that failed leaves the process as it was: one held stopped stays in the
        // record, so shutdown and the next start still resume it.
        let failed = matches!(outcome, Outcome::Failed(_));
        match action.verb {
            Verb::Resume | Verb::Terminate | Verb::Kill if !failed => {
                if self.throttler.is_throttled(&ids) {
                    if let Some(ThrottleKind::Cgroup(_)) = self.throttler.unthrottle(&ids) {
                        self.save_throttles();
                    }
                }
                ids.iter().for_each(|id| self.held.remove(*id));
            }
            _ => {}
        }
        match &outcome {
            Outcome::Done => info!(
                verb,
                reason = action.reason.kind.as_str(),
                "{verb} {target}: {why}"
            ),
            Outcome::Failed(e) => warn!(
                verb,
                reason = action.reason.kind.as_str(),
                "failed to {verb} {target}: {e} (wanted because: {why})"
            ),
            Outcome::Skipped(e) => info!(verb, "not going to {verb} {target}: {e}"),
            Outcome::Observed => {}
        }
        outcome
    }

    fn signal_all(&mut self, target: &Target, sig: Sig) -> Outcome {
        let mut done = 0;
        let mut errors = Vec::new();
        for id in target.ids() {
            match self.control.send(id, sig) {
                Ok(()) => done += 1,
                Err(SignalError::Gone | SignalError::Replaced) => {}
                Err(e) => errors.push(format!("pid {}: {e}", id.pid)),
            }
        }
        match (done, errors.is_empty()) {
            (0, true) => Outcome::Skipped("target has exited".into()),
            (0, false) => Outcome::Failed(errors.join("; ")),
            _ => Outcome::Done,
        }
    }

    fn hold(&mut self, target: &Target, why: &str) {
        let since_unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        for m in &target.members {
            self.held.add(HeldProcess {
                pid: m.id.pid,
                start_time: m.id.start_time,
                comm: m.comm.clone(),
                why: why.into(),
                since_unix,
            });
        }
    }

    /// Lets everything go: ends throttles and resumes every process held stopped.
    pub fn shutdown(&mut self) {
        self.throttler.shutdown();
        self.save_throttles();
        for p in self.held.resume_all(self.control.as_ref()) {
            info!(
                pid = p.pid,
                "resumed pid {} ({}) on shutdown", p.pid, p.comm
            );
        }
    }
}

/// Records signals instead of sending them (tests); says `stopped` of every process.
#[cfg(test)]
#[derive(Default)]
pub(crate) struct Recorder {
    pub signals: std::sync::Mutex<Vec<(i32, Sig)>>,
    pub stopped: bool,
}

#[cfg(test)]
impl ProcessControl for Recorder {
    fn send(&self, id: ProcessId, sig: Sig) -> Result<(), SignalError> {
        self.signals.lock().unwrap().push((id.pid, sig));
        Ok(())
    }
    fn is_stopped(&self, _: ProcessId) -> bool {
        self.stopped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Member, Reason};
    use std::sync::Mutex;

    fn action(verb: Verb, pid: i32) -> Action {
        Action {
            verb,
            target: Target {
                model: Some("m".into()),
                members: vec![Member {
                    id: ProcessId { pid, start_time: 7 },
                    comm: "vllm".into(),
                    uid: 1000,
                }],
            },
            reason: Reason {
                kind: crate::policy::ReasonKind::RamBudget,
                detail: "over".into(),
            },
            recheck: None,
            enters: Vec::new(),
            after_term: None,
        }
    }

    /// The enforce lock of the tests' host: beside the state directory.
    fn lock_path(dir: &StateDir) -> PathBuf {
        dir.path().with_file_name("enforce.lock")
    }

    fn start(
        control: Arc<dyn ProcessControl>,
        dir: &Arc<StateDir>,
        cgroups: &Path,
        mode: Mode,
    ) -> Result<(Executor, Leftovers), claim::ClaimError> {
        let me = Holder::me(Path::new("/test/config.toml"), dir.path());
        Executor::new(control, dir.clone(), cgroups, mode, &lock_path(dir), me)
    }

    fn enforcer(
        control: Arc<dyn ProcessControl>,
        dir: &Arc<StateDir>,
        cgroups: &Path,
    ) -> (Executor, Leftovers) {
        start(control, dir, cgroups, Mode::Enforce).unwrap()
    }

    /// Issue 40: a second daemon (an observer with a state directory of its own, the README's
    /// first command beside the service) must not undo what the enforcing one does. It takes no
    /// enforce lock, signals nothing, and never resumes a process it does not hold itself, even
    /// when its policy decides to: the service's stop stands.
    #[test]
    fn an_observer_beside_an_enforcer_never_resumes_what_the_enforcer_stopped() {
        let root = tempfile::tempdir().unwrap();
        let service_dir = Arc::new(StateDir::create(&root.path().join("service")).unwrap());
        let other_dir = Arc::new(StateDir::create(&root.path().join("other")).unwrap());
        let control = Arc::new(Recorder {
            stopped: true,
            ..Recorder::default()
        });
        let (mut service, _) = enforcer(control.clone(), &service_dir, root.path());
        let mut no_read = |_| None;
        let stop = service.execute(Mode::Enforce, &action(Verb::Stop, 20), None, &mut no_read);
        assert_eq!(stop, Outcome::Done);
        // An enforcing second daemon is refused, naming the service.
        let refused = start(control.clone(), &other_dir, root.path(), Mode::Enforce);
        let e = refused.err().expect("a second enforcer is refused");
        assert_eq!(e.holder().map(|h| h.pid), Some(std::process::id() as i32));
        // An observer starts; nothing it is asked to do reaches a process.
        let (mut observer, _) = start(control.clone(), &other_dir, root.path(), Mode::Observe)
            .expect("an observer runs beside an enforcer");
        assert!(!observer.enforcing());
        let signals = || control.signals.lock().unwrap().clone();
        let before = signals();
        for verb in [Verb::Resume, Verb::Stop, Verb::Kill, Verb::Unthrottle] {
            let outcome = observer.execute(Mode::Enforce, &action(verb, 20), None, &mut no_read);
            assert_eq!(outcome, Outcome::Observed, "{verb:?}");
        }
        observer.shutdown();
        assert_eq!(signals(), before, "the observer signalled");
        // Nor does the enforcer resume what it does not hold.
        let other = service.execute(Mode::Enforce, &action(Verb::Resume, 21), None, &mut no_read);
        assert!(matches!(other, Outcome::Skipped(_)), "{other:?}");
        assert_eq!(signals(), before);
        let record = std::fs::read_to_string(service_dir.path().join(held::FILE_NAME)).unwrap();
        assert!(record.contains("\"pid\": 20"), "{record}");
    }

    /// Round five (a hostile review of issue 40): a daemon reloaded to observe kept its stopped
    /// process stopped past max_stop (an observer only "would" act) and let go of the enforce
    /// lock, so a second enforcer stopped the same pid and the first resumed it at its exit.
    /// Now it lets go of all it holds, then of the lock.
    #[test]
    fn turning_to_observe_lets_go_of_what_it_holds_before_the_lock() {
        let root = tempfile::tempdir().unwrap();
        let dir = Arc::new(StateDir::create(&root.path().join("state")).unwrap());
        let control = Arc::new(Recorder {
            stopped: true,
            ..Recorder::default()
        });
        let (mut executor, _) = enforcer(control.clone(), &dir, root.path());
        let mut no_read = |_| None;
        let stop = executor.execute(Mode::Enforce, &action(Verb::Stop, 20), None, &mut no_read);
        assert_eq!(stop, Outcome::Done);
        let done = executor.set_mode(Mode::Observe).unwrap();
        assert!(
            done.undone.join("\n").contains("resumed pid 20 (vllm)"),
            "{done:?}"
        );
        assert_eq!(
            control.signals.lock().unwrap().last(),
            Some(&(20, Sig::Cont))
        );
        assert!(executor.held().is_empty());
        let record = std::fs::read_to_string(dir.path().join(held::FILE_NAME)).unwrap();
        assert!(!record.contains("\"pid\": 20"), "{record}");
        // The lock is free for another daemon only now, and this one's exit resumes nothing.
        let other = Arc::new(StateDir::create(&root.path().join("other")).unwrap());
        let (_second, _) = enforcer(control.clone(), &other, root.path());
        let before = control.signals.lock().unwrap().len();
        executor.shutdown();
        assert_eq!(control.signals.lock().unwrap().len(), before);
    }

    /// Round five: the lock file removed under an enforcer (a service's runtime directory) must
    /// not let a second daemon enforce beside it: the first takes the path anew, or observes once
    /// another holds it, letting go of what it holds.
    #[test]
    fn an_enforcer_whose_lock_file_is_removed_takes_it_anew_or_observes() {
        let root = tempfile::tempdir().unwrap();
        let dir = Arc::new(StateDir::create(&root.path().join("state")).unwrap());
        let control = Arc::new(Recorder {
            stopped: true,
            ..Recorder::default()
        });
        let (mut first, _) = enforcer(control.clone(), &dir, root.path());
        assert_eq!(first.keep_enforce_lock(), None);
        std::fs::remove_file(lock_path(&dir)).unwrap();
        let (said, observes) = first.keep_enforce_lock().unwrap();
        assert!(said.contains("taken anew") && !observes, "{said}");
        assert!(first.enforcing());
        let mut no_read = |_| None;
        first.execute(Mode::Enforce, &action(Verb::Stop, 20), None, &mut no_read);
        // Removed again, and another daemon takes the new file first.
        std::fs::remove_file(lock_path(&dir)).unwrap();
        let other = Arc::new(StateDir::create(&root.path().join("other")).unwrap());
        let (_second, _) = enforcer(control.clone(), &other, root.path());
        let (said, observes) = first.keep_enforce_lock().unwrap();
        assert!(observes && said.contains("observes from now on"), "{said}");
        assert!(said.contains("resumed pid 20"), "{said}");
        assert!(!first.enforcing());
        let stop = first.execute(Mode::Enforce, &action(Verb::Stop, 21), None, &mut no_read);
        assert_eq!(stop, Outcome::Observed);
    }

    /// What a crashed run left on a state directory is let go of only by a daemon that may act:
    /// not while another daemon enforces (the leftovers stay in the record, said loudly, and the
    /// observer's own shutdown does not resume them), then by the next one that may.
    #[test]
    fn leftovers_wait_while_another_daemon_enforces_and_go_once_none_does() {
        let root = tempfile::tempdir().unwrap();
        let dir = Arc::new(StateDir::create(&root.path().join("state")).unwrap());
        let control = Arc::new(Recorder {
            stopped: true,
            ..Recorder::default()
        });
        let (mut crashed, _) = enforcer(control.clone(), &dir, root.path());
        let mut no_read = |_| None;
        crashed.execute(Mode::Enforce, &action(Verb::Stop, 20), None, &mut no_read);
        drop(crashed);
        // Another daemon (its own state directory) enforces meanwhile.
        let elsewhere = Arc::new(StateDir::create(&root.path().join("elsewhere")).unwrap());
        let (enforcing, _) = {
            let me = Holder::me(Path::new("/other.toml"), elsewhere.path());
            Executor::new(
                control.clone(),
                elsewhere.clone(),
                root.path(),
                Mode::Enforce,
                &lock_path(&dir),
                me,
            )
            .unwrap()
        };
        let signals = || control.signals.lock().unwrap().clone();
        let before = signals();
        let (mut observer, leftovers) =
            start(control.clone(), &dir, root.path(), Mode::Observe).unwrap();
        assert!(leftovers.undone.is_empty(), "{leftovers:?}");
        let problem = leftovers.kept.join("\n");
        assert!(
            problem.contains("stays held") && problem.contains("pids 20 (vllm)"),
            "{problem}"
        );
        observer.shutdown();
        drop(observer);
        assert_eq!(
            signals(),
            before,
            "leftovers resumed while another daemon enforces"
        );
        let record = std::fs::read_to_string(dir.path().join(held::FILE_NAME)).unwrap();
        assert!(
            record.contains("\"pid\": 20"),
            "the record lost them: {record}"
        );
        // The other daemon stops; an observer on this directory now lets go of them.
        drop(enforcing);
        let (observer, leftovers) =
            start(control.clone(), &dir, root.path(), Mode::Observe).unwrap();
        assert!(!observer.enforcing(), "the lock was for that moment only");
        assert!(
            leftovers
                .undone
                .join("\n")
                .contains("resumed pid 20 (vllm)"),
            "{leftovers:?}"
        );
        assert_eq!(signals().last(), Some(&(20, Sig::Cont)));
    }

    #[test]
    fn a_crash_leaves_nothing_held_for_the_next_start() {
        let root = tempfile::tempdir().unwrap();
        let cgroups = root.path().join("cgroup");
        let unit = cgroups.join("system.slice/vllm.service");
        std::fs::create_dir_all(&unit).unwrap();
        for (file, text) in [
            ("cgroup.procs", "10\n"),
            ("memory.high", "max\n"),
            ("memory.current", "4096\n"),
            ("cpu.max", "max 100000\n"),
        ] {
            std::fs::write(unit.join(file), text).unwrap();
        }
        let dir = Arc::new(StateDir::create(&root.path().join("state")).unwrap());
        let control = Arc::new(Recorder {
            stopped: true,
            ..Recorder::default()
        });
        let (mut executor, leftovers) = enforcer(control.clone(), &dir, &cgroups);
        assert!(leftovers.undone.is_empty() && leftovers.problems.is_empty());
        let mut no_read = |_| None;
        let cgroup = Some("/system.slice/vllm.service");
        let done = executor.execute(
            Mode::Enforce,
            &action(Verb::Throttle, 10),
            cgroup,
            &mut no_read,
        );
        assert_eq!(done, Outcome::Done);
        let stop = executor.execute(Mode::Enforce, &action(Verb::Stop, 20), None, &mut no_read);
        assert_eq!(stop, Outcome::Done);
        assert_eq!(
            std::fs::read_to_string(unit.join("memory.high")).unwrap(),
            "4096"
        );
        // gpuguard dies here, without shutdown: the next start lets go of both.
        drop(executor);
        let (_, leftovers) = enforcer(control.clone(), &dir, &cgroups);
        assert!(leftovers.problems.is_empty(), "{leftovers:?}");
        assert_eq!(
            std::fs::read_to_string(unit.join("memory.high")).unwrap(),
            "max"
        );
        assert_eq!(
            std::fs::read_to_string(unit.join("cpu.max")).unwrap(),
            "max 100000"
        );
        let undone = leftovers.undone.join("\n");
        assert!(
            undone.contains("resumed pid 20 (vllm) left stopped (stop)"),
            "{undone}"
        );
        assert!(undone.contains("memory.high 4096 -> max"), "{undone}");
        assert_eq!(
            control.signals.lock().unwrap().last(),
            Some(&(20, Sig::Cont))
        );
    }

    /// Reads the record on disk at the moment each signal is sent.
    struct SeesRecord(std::path::PathBuf, Mutex<Vec<(Sig, String)>>);

    impl ProcessControl for SeesRecord {
        fn send(&self, _: ProcessId, sig: Sig) -> Result<(), SignalError> {
            let record = std::fs::read_to_string(self.0.join(held::FILE_NAME)).unwrap_or_default();
            self.1.lock().unwrap().push((sig, record));
            if sig == Sig::Stop && self.1.lock().unwrap().len() > 1 {
                return Err(SignalError::Gone);
            }
            Ok(())
        }
        fn is_stopped(&self, _: ProcessId) -> bool {
            false
        }
    }

    /// Fails every SIGTERM and SIGKILL (a security module saying no).
    struct RefusesToKill;

    impl ProcessControl for RefusesToKill {
        fn send(&self, _: ProcessId, sig: Sig) -> Result<(), SignalError> {
            match sig {
                Sig::Term | Sig::Kill => Err(SignalError::Denied),
                _ => Ok(()),
            }
        }
        fn is_stopped(&self, _: ProcessId) -> bool {
            true
        }
    }

    /// A stopped process whose SIGTERM or SIGKILL fails is still stopped: it stays in the record,
    /// so shutdown and the next start resume it (it was taken out whatever the outcome).
    #[test]
    fn a_stopped_process_whose_kill_fails_stays_in_the_record() {
        let root = tempfile::tempdir().unwrap();
        let dir = Arc::new(StateDir::create(&root.path().join("state")).unwrap());
        let (mut executor, _) = enforcer(Arc::new(RefusesToKill), &dir, root.path());
        let mut no_read = |_| None;
        let stop = executor.execute(Mode::Enforce, &action(Verb::Stop, 20), None, &mut no_read);
        assert_eq!(stop, Outcome::Done);
        for verb in [Verb::Terminate, Verb::Kill] {
            let outcome = executor.execute(Mode::Enforce, &action(verb, 20), None, &mut no_read);
            assert!(matches!(outcome, Outcome::Failed(_)), "{outcome:?}");
            let record = std::fs::read_to_string(dir.path().join(held::FILE_NAME)).unwrap();
            assert!(record.contains("\"pid\": 20"), "{verb:?}: {record}");
        }
    }

    /// A crash right after SIGSTOP must not leave a stopped process no record names: the record
    /// is written first, and taken back if the signal did nothing.
    #[test]
    fn a_stop_is_recorded_before_the_signal_and_undone_when_it_fails() {
        let root = tempfile::tempdir().unwrap();
        let dir = Arc::new(StateDir::create(&root.path().join("state")).unwrap());
        let control = Arc::new(SeesRecord(dir.path().to_path_buf(), Mutex::default()));
        let (mut executor, _) = enforcer(control.clone(), &dir, root.path());
        let mut no_read = |_| None;
        let stop = executor.execute(Mode::Enforce, &action(Verb::Stop, 20), None, &mut no_read);
        assert_eq!(stop, Outcome::Done);
        let seen = control.1.lock().unwrap()[0].1.clone();
        assert!(
            seen.contains("\"pid\": 20"),
            "record when SIGSTOP was sent: {seen:?}"
        );
        // The second stop finds the process gone: nothing stays recorded for it.
        let gone = executor.execute(Mode::Enforce, &action(Verb::Stop, 21), None, &mut no_read);
        assert!(matches!(gone, Outcome::Skipped(_)), "{gone:?}");
        let record = std::fs::read_to_string(dir.path().join(held::FILE_NAME)).unwrap();
        assert!(
            record.contains("\"pid\": 20") && !record.contains("\"pid\": 21"),
            "{record}"
        );
    }
}
