//! Acting on the plan: signals through pidfds, throttles, and the record of what is held stopped.
//! Honours observe mode, and reads memory again just before a floor action.

pub mod held;
pub mod signal;
pub mod throttle;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::{info, warn};

use crate::config::Mode;
use crate::policy::{Action, Resource, Target, Verb};
use crate::snapshot::ProcessId;
use crate::units::fmt_bytes;

use held::{HeldProcess, HeldRecord};
use throttle::{ThrottleKind, Throttler};

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
}

/// What became of one action.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Done,
    /// Observe mode: logged, nothing signalled.
    Observed,
    /// Not needed any more (memory recovered, the target is gone).
    Skipped(String),
    Failed(String),
}

pub struct Executor {
    control: Arc<dyn ProcessControl>,
    held: HeldRecord,
    throttler: Throttler,
    throttled: HashMap<Vec<ProcessId>, ThrottleKind>,
}

impl Executor {
    pub fn new(control: Arc<dyn ProcessControl>, held: HeldRecord, cgroup_root: &str) -> Self {
        let throttler = Throttler::new(control.clone(), cgroup_root);
        Executor {
            control,
            held,
            throttler,
            throttled: HashMap::new(),
        }
    }

    pub fn held(&self) -> &[HeldProcess] {
        self.held.entries()
    }

    /// Resumes whatever a previous run left stopped (after a crash) and says so.
    pub fn resume_leftovers(&mut self) {
        for p in self.held.resume_all(self.control.as_ref()) {
            warn!(pid = p.pid, comm = %p.comm, "resumed pid {} ({}) left stopped ({}) by a previous gpuguard run", p.pid, p.comm, p.why);
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
        if mode == Mode::Observe && !matches!(action.verb, Verb::Resume | Verb::Unthrottle) {
            info!(
                verb,
                reason = action.reason.kind,
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
        let ids: Vec<ProcessId> = target.ids().collect();
        let outcome = match action.verb {
            Verb::Throttle => {
                let kind = self.throttler.throttle(&ids, cgroup);
                if kind == ThrottleKind::DutyCycle {
                    self.hold(target, "throttle");
                }
                self.throttled.insert(ids.clone(), kind);
                Outcome::Done
            }
            Verb::Unthrottle => {
                let kind = self
                    .throttled
                    .remove(&ids)
                    .unwrap_or(ThrottleKind::DutyCycle);
                self.throttler.unthrottle(&ids, &kind);
                ids.iter().for_each(|id| self.held.remove(*id));
                Outcome::Done
            }
            Verb::Stop => self.signal_all(target, Sig::Stop),
            Verb::Resume => self.signal_all(target, Sig::Cont),
            Verb::Terminate => self.signal_all(target, Sig::Term),
            Verb::Kill => self.signal_all(target, Sig::Kill),
        };
        match action.verb {
            Verb::Stop if outcome == Outcome::Done => self.hold(target, "stop"),
            Verb::Resume | Verb::Terminate | Verb::Kill => {
                if let Some(kind) = self.throttled.remove(&ids) {
                    self.throttler.unthrottle(&ids, &kind);
                }
                ids.iter().for_each(|id| self.held.remove(*id));
            }
            _ => {}
        }
        match &outcome {
            Outcome::Done => info!(verb, reason = action.reason.kind, "{verb} {target}: {why}"),
            Outcome::Failed(e) => warn!(
                verb,
                reason = action.reason.kind,
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
        for (ids, kind) in std::mem::take(&mut self.throttled) {
            self.throttler.unthrottle(&ids, &kind);
        }
        for p in self.held.resume_all(self.control.as_ref()) {
            info!(
                pid = p.pid,
                "resumed pid {} ({}) on shutdown", p.pid, p.comm
            );
        }
    }
}
