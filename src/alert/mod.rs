//! Telling people: what the daemon saw and did becomes notices for the webhooks
//! (`[[alert.webhook]]`: JSON, Slack, Alertmanager) and lines in the event log.
//!
//! Two kinds of notice:
//! - *conditions* (a floor crossed, a model over budget, a GPU lost, a kill that did not free
//!   memory): the daemon hands the set of active ones to `Alerter::conditions` every tick; a new
//!   one fires, one that changes severity fires again, one still active repeats every
//!   `repeat_interval`, and one that goes away is resolved. Not one notice per tick. One of a
//!   client's own doing (a model a user launched, over the budget it declared) fires only within
//!   that uid's share of the per-uid rate limit the daemon hands in (`Condition::caused_by`).
//! - *events* (an action taken, a launch admitted or timed out, an Xid, a failed reload, start
//!   and stop): one notice each.
//!
//! One owner per fact: the policy owns what is crossed or over (its levels, incidents and
//! `BudgetState::over`); its events record each transition in the event log, and the daemon's
//! conditions (`daemon/alerts.rs`) are the webhooks' view of the same state, read, not worked out
//! again. So an event kind that a condition reports (`EventKind::is_condition`) goes to the
//! event log only.
//!
//! Nothing here can slow the daemon loop: every sink has its own worker thread fed by a bounded
//! queue that, when full, drops the oldest notice of the lowest severity and never a critical one
//! for a lower one (`queue.rs`); HTTP, retries and file writes happen on those threads.

mod eventlog;
pub mod queue;
pub mod webhook;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::policy::{Event, EventKind, Severity};
use crate::view::Subject;
use queue::Queue;

/// Alertmanager forgets an alert that is not re-posted: active ones are refreshed this often
/// (and posted with an `endsAt` three refreshes ahead).
pub const ALERTMANAGER_REFRESH: Duration = Duration::from_secs(60);
/// On shutdown, how long queued notices (the "stopping" one included) may take to go out.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// The action a notice reports, when it reports one.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ActionInfo {
    /// stop, resume, terminate, kill, throttle, unthrottle.
    pub verb: String,
    /// ram_floor, gpu_floor, ram_budget, gpu_budget, max_stop, cleared.
    pub reason: String,
    pub detail: String,
    /// done, observed, skipped: ..., failed: ...
    pub outcome: String,
    /// Why a SIGKILL followed a SIGTERM: `grew` (the victim grew past `term_max_growth`, it is
    /// not shutting down), `far_below` (the floor far below), `grace_over` (`term_grace` ran
    /// out). Absent on other actions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub after_term: Option<&'static str>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Firing,
    Resolved,
}

/// One notification, as every sink receives it (each formats it its own way).
#[derive(Clone, Debug, Serialize)]
pub struct Notice {
    pub host: String,
    /// The event kind: floor_warn, process_killed, launch_admitted, ...
    pub event: String,
    pub severity: Severity,
    pub status: Status,
    /// "condition" (fires, repeats, resolves) or "event" (one notice).
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// A condition still active, notified again after `repeat_interval`.
    pub repeat: bool,
    /// Identifies the condition across notices: `floor:RAM`, `budget:qwen`, ...
    pub key: String,
    pub summary: String,
    pub subject: Subject,
    pub action: Option<ActionInfo>,
    #[serde(serialize_with = "ser_time")]
    pub at: SystemTime,
    /// When the condition began (for events: `at`).
    #[serde(serialize_with = "ser_time")]
    pub since: SystemTime,
    /// Only for Alertmanager sinks: keeps an active alert alive there (webhooks skip it).
    #[serde(skip)]
    pub refresh: bool,
    /// Ends an Alertmanager alert whose severity changed; webhooks skip it (they get the new one).
    #[serde(skip)]
    pub superseded: bool,
}

fn ser_time<S: serde::Serializer>(t: &SystemTime, ser: S) -> Result<S::Ok, S::Error> {
    ser.serialize_str(&rfc3339_millis(*t))
}

/// RFC 3339 in UTC to the millisecond: `2026-12-02T02:35:07.123Z`.
pub(crate) fn rfc3339_millis(t: SystemTime) -> String {
    let at = jiff::Timestamp::try_from(t).unwrap_or(jiff::Timestamp::UNIX_EPOCH);
    format!("{at:.3}")
}

impl queue::Weigh for Notice {
    fn weight(&self) -> usize {
        let s = &self.subject;
        let strings = [&s.model, &s.resource, &s.comm]
            .iter()
            .map(|o| o.as_ref().map_or(0, String::len))
            .sum::<usize>()
            + s.cmdline.as_ref().map_or(0, |c| c.as_str().len());
        let action = self.action.as_ref().map_or(0, |a| {
            a.verb.len() + a.reason.len() + a.detail.len() + a.outcome.len()
        });
        std::mem::size_of::<Notice>()
            + self.host.len()
            + self.event.len()
            + self.key.len()
            + self.summary.len()
            + strings
            + s.pids.len() * 4
            + action
    }

    /// A full queue drops info before warning, and never a critical notice for a lower one.
    fn rank(&self) -> u8 {
        match self.severity {
            Severity::Info => 0,
            Severity::Warning => 1,
            Severity::Critical => 2,
        }
    }
}

impl Notice {
    /// The one-line, Slack-compatible text.
    pub fn text(&self) -> String {
        let state = match (self.status, self.repeat) {
            (Status::Resolved, _) => "RESOLVED".to_string(),
            (Status::Firing, true) => format!("{} (still active)", self.severity_upper()),
            (Status::Firing, false) => self.severity_upper(),
        };
        let mut text = format!(
            "[gpuguard {}] {state} {}: {}",
            self.host, self.event, self.summary
        );
        if let Some(a) = &self.action {
            text += &format!(" [{} {}]", a.verb, a.outcome);
        }
        text
    }

    fn severity_upper(&self) -> String {
        self.severity.as_str().to_uppercase()
    }
}

/// A condition the daemon sees as active this tick.
#[derive(Clone, Debug, PartialEq)]
pub struct Condition {
    pub key: String,
    pub event: EventKind,
    pub severity: Severity,
    pub summary: String,
    pub subject: Subject,
    /// The account whose own doing it is (a model it launched over the budget it declared), if
    /// any: its firing counts against that uid's share of the per-uid rate limit.
    pub caused_by: Option<u32>,
}

struct Active {
    condition: Condition,
    since: SystemTime,
    last_sent: Instant,
    last_refresh: Instant,
    /// It fired past its owner's share of the per-uid rate limit: nothing of it has been told.
    muted: bool,
}

/// A sink's end of its queue, on the daemon's side.
struct SinkHandle {
    queue: Arc<Queue<Notice>>,
    /// Alertmanager sinks take refreshes and superseded notices; others skip them.
    alertmanager: bool,
    min_severity: Severity,
    /// What the worker was started with: a reload that gives the same keeps it.
    spec: SinkSpec,
}

#[derive(Clone, PartialEq)]
enum SinkSpec {
    Webhook(webhook::Spec),
    EventLog {
        state_dir: std::path::PathBuf,
        /// `events.jsonl`, or `actions.jsonl` (actions and critical notices only).
        name: &'static str,
        max_bytes: u64,
        queue: usize,
    },
    /// Tests' sinks, never reused.
    #[cfg(test)]
    None,
}

impl Drop for SinkHandle {
    fn drop(&mut self) {
        // The worker finishes what is queued (bounded by its retries) and exits.
        self.queue.close();
    }
}

/// The daemon's handle on alerting. Every method returns at once.
pub struct Alerter {
    host: String,
    repeat_interval: Duration,
    sinks: Vec<SinkHandle>,
    event_log: Option<SinkHandle>,
    /// `actions.jsonl`: what clients cannot cause, so their traffic cannot rotate it away.
    actions_log: Option<SinkHandle>,
    active: BTreeMap<String, Active>,
    metrics: Metrics,
}

impl Alerter {
    /// Starts a worker per webhook and one for the event log. Fails if a secret file cannot
    /// be read.
    pub fn new(config: &Config, metrics: &Metrics) -> anyhow::Result<Alerter> {
        let mut alerter = Alerter {
            host: nix::unistd::gethostname()
                .map(|h| h.to_string_lossy().into_owned())
                .unwrap_or_else(|_| "unknown".into()),
            repeat_interval: config.alert.repeat_interval,
            sinks: Vec::new(),
            event_log: None,
            actions_log: None,
            active: BTreeMap::new(),
            metrics: metrics.clone(),
        };
        alerter.configure(config)?;
        Ok(alerter)
    }

    /// Applies a (re)loaded config. A sink the new config describes exactly as before keeps its
    /// worker and queue; the others are replaced, and the old ones are abandoned (their queues
    /// dropped, no more retries), so reload after reload never piles up workers stuck behind a
    /// hung endpoint. Active conditions are kept, so a reload does not re-fire them.
    pub fn configure(&mut self, config: &Config) -> anyhow::Result<()> {
        let a = &config.alert;
        let mut wanted = Vec::new();
        for (i, w) in a.webhooks.iter().enumerate() {
            wanted.push((
                SinkSpec::Webhook(webhook::Spec::new(i, w, a)?),
                w.format == crate::config::WebhookFormat::Alertmanager,
                w.min_severity,
            ));
        }
        let log = |name| {
            a.event_log.then(|| SinkSpec::EventLog {
                state_dir: config.daemon.state_dir.clone(),
                name,
                max_bytes: match a.event_log_max_size {
                    crate::units::Amount::Bytes(b) => b,
                    crate::units::Amount::Percent(_) => 16 << 20,
                },
                queue: a.queue,
            })
        };
        let event_log = log(eventlog::FILE_NAME);
        let actions_log = log(eventlog::ACTIONS_FILE_NAME);
        let mut old: Vec<SinkHandle> = std::mem::take(&mut self.sinks);
        old.extend(self.event_log.take());
        old.extend(self.actions_log.take());
        let mut reuse = |spec: &SinkSpec| {
            old.iter()
                .position(|h| h.spec == *spec)
                .map(|i| old.swap_remove(i))
        };
        let mut sinks = Vec::new();
        for (i, (spec, alertmanager, min_severity)) in wanted.into_iter().enumerate() {
            let handle = match reuse(&spec) {
                Some(handle) => handle,
                None => self.start_webhook(i, spec, alertmanager, min_severity, a)?,
            };
            sinks.push(handle);
        }
        let mut logs = Vec::new();
        for spec in [event_log, actions_log] {
            logs.push(match spec {
                Some(spec) => Some(match reuse(&spec) {
                    Some(handle) => handle,
                    None => self.start_event_log(spec)?,
                }),
                None => None,
            });
        }
        for retired in old {
            retired.queue.abandon();
        }
        let actions_log = logs.pop().flatten();
        self.sinks = sinks;
        self.event_log = logs.pop().flatten();
        self.actions_log = actions_log;
        self.repeat_interval = a.repeat_interval;
        Ok(())
    }

    fn start_webhook(
        &self,
        index: usize,
        spec: SinkSpec,
        alertmanager: bool,
        min_severity: Severity,
        a: &crate::config::AlertConfig,
    ) -> anyhow::Result<SinkHandle> {
        let SinkSpec::Webhook(w) = &spec else {
            anyhow::bail!("not a webhook");
        };
        let counters = self.metrics.sink(&index.to_string(), w.format().as_str());
        let queue = Arc::new(Queue::new(a.queue, counters.dropped.clone()));
        webhook::start(w, queue.clone(), counters)?;
        Ok(SinkHandle {
            queue,
            alertmanager,
            min_severity,
            spec,
        })
    }

    fn start_event_log(&self, spec: SinkSpec) -> anyhow::Result<SinkHandle> {
        let SinkSpec::EventLog {
            state_dir,
            name,
            max_bytes,
            queue,
        } = &spec
        else {
            anyhow::bail!("not the event log");
        };
        let label = match *name {
            eventlog::ACTIONS_FILE_NAME => "actions_log",
            _ => "event_log",
        };
        let counters = self.metrics.sink(label, "jsonl");
        let queue = Arc::new(Queue::new(*queue, counters.dropped.clone()));
        eventlog::start(state_dir, name, *max_bytes, queue.clone(), counters)?;
        Ok(SinkHandle {
            queue,
            alertmanager: false,
            min_severity: Severity::Info,
            spec,
        })
    }

    fn notice(&self, event: EventKind, severity: Severity, summary: String) -> Notice {
        let now = SystemTime::now();
        Notice {
            host: self.host.clone(),
            event: event.to_string(),
            severity,
            status: Status::Firing,
            kind: "event",
            repeat: false,
            key: event.to_string(),
            summary,
            subject: Subject::default(),
            action: None,
            at: now,
            since: now,
            refresh: false,
            superseded: false,
        }
    }

    /// Hands a notice to the sinks that take it.
    fn send(&self, notice: Notice, to_webhooks: bool) {
        if !notice.refresh && !notice.superseded && !notice.repeat {
            if let Some(log) = &self.event_log {
                log.queue.push(notice.clone());
            }
            if let Some(log) = &self.actions_log {
                if notice.action.is_some() || notice.severity == Severity::Critical {
                    log.queue.push(notice.clone());
                }
            }
        }
        if !to_webhooks {
            return;
        }
        for sink in &self.sinks {
            let wanted = notice.severity >= sink.min_severity
                && (sink.alertmanager || !(notice.refresh || notice.superseded));
            if wanted {
                sink.queue.push(notice.clone());
            }
        }
    }

    /// An event from the policy, the launch queue or the GPU sampler.
    pub fn event(&mut self, e: &Event, subject: Subject) {
        self.metrics.count_event(e.kind, e.severity);
        let mut notice = self.notice(e.kind, e.severity, e.message.clone());
        notice.subject = subject;
        // Conditions report these (with repeats and a resolved notice).
        let to_webhooks = !e.kind.is_condition();
        self.send(notice, to_webhooks);
    }

    /// An action and what became of it.
    pub fn action(
        &mut self,
        event: EventKind,
        severity: Severity,
        summary: String,
        subject: Subject,
        action: ActionInfo,
    ) {
        let outcome = action.outcome.split(':').next().unwrap_or("").to_string();
        self.metrics
            .count_action(&action.verb, &action.reason, &outcome);
        let mut notice = self.notice(event, severity, summary);
        notice.key = match subject.pid {
            Some(pid) => format!("{event}:{pid}"),
            None => event.to_string(),
        };
        notice.subject = subject;
        notice.action = Some(action);
        self.send(notice, true);
    }

    /// The daemon's own life: started, stopping, config reload failed.
    pub fn lifecycle(&mut self, event: EventKind, severity: Severity, summary: String) {
        self.metrics.count_event(event, severity);
        let notice = self.notice(event, severity, summary);
        self.send(notice, true);
    }

    /// The conditions active now: fires the new ones, repeats or refreshes the old ones,
    /// resolves those that are gone. A condition of a client's own doing (`caused_by`) fires
    /// only if `admit` lets it (its uid's share of the per-uid rate limit): one it does not is
    /// kept muted (never repeated, refreshed or resolved) and tries again when a repeat is due.
    pub fn conditions(
        &mut self,
        now: Instant,
        current: Vec<Condition>,
        mut admit: impl FnMut(u32, &Condition) -> bool,
    ) {
        let mut told = |c: &Condition| c.caused_by.is_none_or(|uid| admit(uid, c));
        let mut seen = Vec::with_capacity(current.len());
        for c in current {
            seen.push(c.key.clone());
            let repeat_interval = self.repeat_interval;
            match self.active.get_mut(&c.key) {
                None => {
                    let since = SystemTime::now();
                    let muted = !told(&c);
                    if !muted {
                        let notice = self.condition_notice(&c, since, Status::Firing, false);
                        self.send(notice, true);
                    }
                    self.active.insert(
                        c.key.clone(),
                        Active {
                            condition: c,
                            since,
                            last_sent: now,
                            last_refresh: now,
                            muted,
                        },
                    );
                }
                Some(a) if a.muted => {
                    // Nothing of it was told: it fires once its owner's share lets it, at the
                    // earliest when a repeat would be due (or when its state changes).
                    let changed =
                        a.condition.event != c.event || a.condition.severity != c.severity;
                    let due = changed || now.duration_since(a.last_sent) >= repeat_interval;
                    a.condition = c;
                    if due {
                        a.last_sent = now;
                        a.last_refresh = now;
                        a.muted = !told(&a.condition);
                    }
                    if !a.muted {
                        let (condition, since) = (a.condition.clone(), a.since);
                        let notice =
                            self.condition_notice(&condition, since, Status::Firing, false);
                        self.send(notice, true);
                    }
                }
                Some(a) if a.condition.event != c.event || a.condition.severity != c.severity => {
                    // Escalated (warn -> act) or eased: Alertmanager ends the old alert, every
                    // sink hears of the new state.
                    let old = a.condition.clone();
                    let since = a.since;
                    a.condition = c.clone();
                    a.last_sent = now;
                    a.last_refresh = now;
                    let mut ended = self.condition_notice(&old, since, Status::Resolved, false);
                    ended.superseded = true;
                    self.send(ended, true);
                    let notice = self.condition_notice(&c, since, Status::Firing, false);
                    self.send(notice, true);
                }
                Some(a) => {
                    // Same state: keep the latest figures for the next repeat.
                    a.condition = c;
                    let (repeat, refresh) = (
                        now.duration_since(a.last_sent) >= repeat_interval,
                        now.duration_since(a.last_refresh) >= ALERTMANAGER_REFRESH,
                    );
                    if repeat {
                        a.last_sent = now;
                        a.last_refresh = now;
                    } else if refresh {
                        a.last_refresh = now;
                    }
                    let (condition, since) = (a.condition.clone(), a.since);
                    if repeat {
                        let notice = self.condition_notice(&condition, since, Status::Firing, true);
                        self.send(notice, true);
                    } else if refresh {
                        let mut notice =
                            self.condition_notice(&condition, since, Status::Firing, true);
                        notice.refresh = true;
                        self.send(notice, true);
                    }
                }
            }
        }
        let gone: Vec<String> = self
            .active
            .keys()
            .filter(|k| !seen.contains(k))
            .cloned()
            .collect();
        for key in gone {
            match self.active.remove(&key) {
                Some(a) if !a.muted => {
                    let notice =
                        self.condition_notice(&a.condition, a.since, Status::Resolved, false);
                    self.send(notice, true);
                }
                _ => {}
            }
        }
    }

    fn condition_notice(
        &self,
        c: &Condition,
        since: SystemTime,
        status: Status,
        repeat: bool,
    ) -> Notice {
        let mut summary = c.summary.clone();
        if status == Status::Resolved {
            summary = format!(
                "cleared after {}: {summary}",
                crate::units::fmt_duration(Duration::from_secs(
                    since.elapsed().map_or(0, |d| d.as_secs())
                ))
            );
        }
        Notice {
            host: self.host.clone(),
            event: c.event.to_string(),
            severity: c.severity,
            status,
            kind: "condition",
            repeat,
            key: c.key.clone(),
            summary,
            subject: c.subject.clone(),
            action: None,
            at: SystemTime::now(),
            since,
            refresh: false,
            superseded: false,
        }
    }

    /// Tests: a webhook that takes every notice (`event_log` false) or the event log in place
    /// of the file (`event_log` true), as a queue the test drains.
    #[cfg(test)]
    pub(crate) fn tap(&mut self, event_log: bool) -> Arc<Queue<Notice>> {
        let queue = Arc::new(Queue::new(10_000, Default::default()));
        let handle = SinkHandle {
            queue: queue.clone(),
            alertmanager: false,
            min_severity: Severity::Info,
            spec: SinkSpec::None,
        };
        if event_log {
            self.event_log = Some(handle);
        } else {
            self.sinks.push(handle);
        }
        queue
    }

    /// Waits until the event and action logs have written every notice queued so far (tests
    /// read them after a tick: what is not there then was never told).
    #[cfg(test)]
    pub fn written(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        for sink in self.event_log.iter().chain(&self.actions_log) {
            assert!(sink.queue.drain(deadline), "the event log did not keep up");
        }
    }

    /// Gives the queued notices (the "stopping" one too) a short while to go out.
    pub fn shutdown(self) {
        let deadline = Instant::now() + SHUTDOWN_GRACE;
        for sink in self
            .sinks
            .iter()
            .chain(&self.event_log)
            .chain(&self.actions_log)
        {
            sink.queue.close();
            sink.queue.drain(deadline);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alerter(repeat: Duration) -> (Alerter, Arc<Queue<Notice>>) {
        let mut a = Alerter {
            host: "h".into(),
            repeat_interval: repeat,
            sinks: Vec::new(),
            event_log: None,
            actions_log: None,
            active: BTreeMap::new(),
            metrics: Metrics::new(),
        };
        let queue = a.tap(false);
        (a, queue)
    }

    fn floor(severity: Severity, event: EventKind) -> Condition {
        Condition {
            key: "floor:RAM".into(),
            event,
            severity,
            summary: "RAM low".into(),
            subject: Subject::default(),
            caused_by: None,
        }
    }

    fn drain(q: &Queue<Notice>) -> Vec<(String, Status, bool)> {
        let mut out = Vec::new();
        while !q.is_empty() {
            let n = q.pop().unwrap();
            q.done();
            out.push((n.event, n.status, n.repeat));
        }
        out
    }

    #[test]
    fn conditions_fire_once_repeat_escalate_and_resolve() {
        let (mut a, q) = alerter(Duration::from_secs(10));
        let t0 = Instant::now();
        let warn = floor(Severity::Warning, EventKind::FloorWarn);
        a.conditions(t0, vec![warn.clone()], |_, _| true);
        a.conditions(t0 + Duration::from_secs(1), vec![warn.clone()], |_, _| true);
        assert_eq!(
            drain(&q),
            vec![("floor_warn".into(), Status::Firing, false)]
        );
        a.conditions(t0 + Duration::from_secs(11), vec![warn.clone()], |_, _| {
            true
        });
        assert_eq!(drain(&q), vec![("floor_warn".into(), Status::Firing, true)]);
        a.conditions(
            t0 + Duration::from_secs(12),
            vec![floor(Severity::Critical, EventKind::FloorAct)],
            |_, _| true,
        );
        // The superseded end goes to Alertmanager sinks only.
        assert_eq!(drain(&q), vec![("floor_act".into(), Status::Firing, false)]);
        a.conditions(t0 + Duration::from_secs(13), vec![], |_, _| true);
        assert_eq!(
            drain(&q),
            vec![("floor_act".into(), Status::Resolved, false)]
        );
        a.conditions(t0 + Duration::from_secs(14), vec![], |_, _| true);
        assert!(drain(&q).is_empty());
    }

    /// A condition of a client's own doing (a model it launched over its declared budget) fires
    /// only within its uid's share of the rate limit: past it, nothing of it is told (no fire,
    /// repeat or resolve) until a repeat is due and the share lets it fire. The operator's
    /// conditions are never held back.
    #[test]
    fn a_clients_condition_past_its_share_is_muted_until_a_repeat_is_due() {
        let (mut a, q) = alerter(Duration::from_secs(10));
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut theirs = floor(Severity::Warning, EventKind::BudgetExceeded);
        theirs.key = "budget:m@1000".into();
        theirs.caused_by = Some(1000);
        let ours = floor(Severity::Warning, EventKind::FloorWarn);
        let both = || vec![theirs.clone(), ours.clone()];
        let never = |_: u32, c: &Condition| -> bool { panic!("asked about {}", c.key) };
        let mut asked = Vec::new();
        a.conditions(at(0), both(), |uid, c| {
            asked.push((uid, c.key.clone()));
            false
        });
        assert_eq!(asked, [(1000, "budget:m@1000".to_string())]);
        let firing = |e: &str| (e.to_string(), Status::Firing, false);
        assert_eq!(drain(&q), [firing("floor_warn")]);
        // Muted: not asked again before a repeat is due, and never resolved.
        a.conditions(at(1), both(), never);
        a.conditions(at(2), vec![ours.clone()], never);
        assert!(drain(&q).is_empty());
        // Back within the share: it fires and resolves as any condition does.
        a.conditions(at(3), both(), |_, _| true);
        a.conditions(at(4), vec![ours.clone()], never);
        let resolved = |e: &str| (e.to_string(), Status::Resolved, false);
        assert_eq!(
            drain(&q),
            [firing("budget_exceeded"), resolved("budget_exceeded")]
        );
        // Past the share again, and still active when a repeat is due: it fires then.
        a.conditions(at(5), both(), |_, _| false);
        a.conditions(at(14), both(), never);
        let repeat = |e: &str| (e.to_string(), Status::Firing, true);
        assert_eq!(drain(&q), [repeat("floor_warn")]);
        a.conditions(at(15), both(), |_, _| true);
        assert_eq!(drain(&q), [firing("budget_exceeded")]);
    }

    /// Red-team finding 5: client traffic rotated the record of a kill out of events.jsonl.
    /// actions.jsonl takes only what clients cannot cause: actions and critical notices.
    #[test]
    fn the_actions_log_takes_actions_and_critical_notices_only() {
        let (mut a, _) = alerter(Duration::from_secs(10));
        let log = || {
            let queue = Arc::new(Queue::new(100, Default::default()));
            let handle = SinkHandle {
                queue: queue.clone(),
                alertmanager: false,
                min_severity: Severity::Info,
                spec: SinkSpec::None,
            };
            (queue, handle)
        };
        let (events, handle) = log();
        a.event_log = Some(handle);
        let (actions, handle) = log();
        a.actions_log = Some(handle);
        let e = |severity, kind| Event::new(severity, kind, "m".into());
        a.event(
            &e(Severity::Info, EventKind::PermitTimedOut),
            Subject::default(),
        );
        a.event(&e(Severity::Warning, EventKind::Xid), Subject::default());
        a.event(
            &e(Severity::Critical, EventKind::XidCritical),
            Subject::default(),
        );
        a.action(
            EventKind::ProcessResumed,
            Severity::Info,
            "resumed".into(),
            Subject::default(),
            ActionInfo {
                verb: "resume".into(),
                reason: "cleared".into(),
                detail: String::new(),
                outcome: "done".into(),
                after_term: None,
            },
        );
        a.conditions(
            Instant::now(),
            vec![floor(Severity::Critical, EventKind::FloorAct)],
            |_, _| true,
        );
        let firing = |e: &str| (e.to_string(), Status::Firing, false);
        assert_eq!(
            drain(&actions),
            vec![
                firing("xid_critical"),
                firing("process_resumed"),
                firing("floor_act")
            ]
        );
        assert_eq!(
            drain(&events),
            vec![
                firing("permit_timed_out"),
                firing("xid"),
                firing("xid_critical"),
                firing("process_resumed"),
                firing("floor_act")
            ]
        );
    }

    #[test]
    fn condition_kind_events_are_not_sent_twice() {
        let (mut a, q) = alerter(Duration::from_secs(10));
        let e = |kind| Event::new(Severity::Warning, kind, "m".into());
        a.event(&e(EventKind::FloorWarn), Subject::default());
        a.event(&e(EventKind::Xid), Subject::default());
        assert_eq!(drain(&q), vec![("xid".into(), Status::Firing, false)]);
    }
}
