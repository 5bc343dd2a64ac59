//! What-if replay: the policy inputs the flight recorder kept (`input.rs`) through the real
//! policy (`policy::evaluate`, the same code the daemon runs) with another config, beside the
//! actions that were really taken, so an operator tunes floors and budgets on last week's data.
//!
//! The world it replays is the recorded one, with one correction: a process the replay would
//! have terminated or killed is gone from the samples after it, and the memory it held then is
//! counted as available (RAM) and free (its GPUs), as if it had come back at once. What the
//! real guard did still shows in the samples (a process it killed is gone from them whatever
//! the new config says), and a process the record left out (`input::LARGEST_*`) cannot be
//! chosen. Every run of the daemon (each `Start`) begins with a fresh policy state, as the
//! daemon did; samples before `since` only warm it up (grace periods, incidents in progress).

use std::collections::{HashMap, HashSet};

use serde::Serialize;

use super::input::{PolicyInput, ProcessDetail};
use super::Record;
use crate::config::Config;
use crate::policy::{self, Executed, Outcome, PolicyState, Verb};
use crate::snapshot::{ProcessId, Snapshot};

/// What a replay found.
#[derive(Debug, Default, Serialize)]
pub struct ReplayReport {
    /// Samples replayed within the range.
    pub samples: usize,
    /// Samples within the range recorded without the policy's input (by a version before
    /// replay existed): not replayed.
    pub samples_without_input: usize,
    /// Runs of the daemon the range touches.
    pub runs: usize,
    /// Process samples left out because what the process is was never read (its details were
    /// in a segment dropped since).
    pub processes_unknown: usize,
    /// The actions the daemon took, with their outcome.
    pub recorded: Vec<Step>,
    /// The actions the policy takes with the new config.
    pub replayed: Vec<Step>,
    /// The policy's events with the new config (floors and budgets crossed, no victim, ...).
    pub events: Vec<ReplayedEvent>,
}

/// One action.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Step {
    pub at_ms: u64,
    pub verb: Verb,
    pub target: String,
    pub reason: String,
    /// What became of it (recorded actions only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
    /// The other side has the same action (verb and target) too.
    pub on_both_sides: bool,
}

/// One event of the replayed policy.
#[derive(Clone, Debug, Serialize)]
pub struct ReplayedEvent {
    pub at_ms: u64,
    pub severity: String,
    pub kind: String,
    pub message: String,
}

/// One run of the daemon, as the replay goes through it.
#[derive(Default)]
struct Run {
    state: PolicyState,
    details: HashMap<ProcessId, ProcessDetail>,
    /// Processes the replay terminated or killed.
    gone: HashSet<ProcessId>,
    lists_read: u64,
    /// A sample of this run fell within the range.
    counted: bool,
}

/// Feeds records, oldest first (`feed`), then `finish`.
pub struct Replay<'c> {
    config: &'c Config,
    since_ms: u64,
    until_ms: u64,
    run: Run,
    report: ReplayReport,
}

impl<'c> Replay<'c> {
    pub fn new(config: &'c Config, since_ms: u64, until_ms: u64) -> Replay<'c> {
        Replay {
            config,
            since_ms,
            until_ms,
            run: Run::default(),
            report: ReplayReport::default(),
        }
    }

    fn in_range(&self, at_ms: u64) -> bool {
        (self.since_ms..=self.until_ms).contains(&at_ms)
    }

    pub fn feed(&mut self, record: Record) {
        if record.at_ms() > self.until_ms {
            return;
        }
        let in_range = self.in_range(record.at_ms());
        match record {
            Record::Start { .. } => self.run = Run::default(),
            Record::Sample {
                at_ms,
                input: Some(input),
                ..
            } => self.sample(at_ms, &input, in_range),
            Record::Sample { input: None, .. } if in_range => {
                self.report.samples_without_input += 1;
            }
            Record::Action { at_ms, action } if in_range => self.report.recorded.push(Step {
                at_ms,
                verb: action.verb,
                target: action.target,
                reason: action.reason,
                outcome: Some(action.outcome),
                on_both_sides: false,
            }),
            _ => {}
        }
    }

    fn sample(&mut self, at_ms: u64, input: &PolicyInput, in_range: bool) {
        let run = &mut self.run;
        run.lists_read += 1;
        let (mut snapshot, launches, unknown) = input.to_snapshot(&mut run.details, run.lists_read);
        // Only what this input keeps is carried on (the recorder writes details again for a
        // process that comes back), so a long history does not grow this without end.
        run.details.retain(|id, _| {
            input
                .processes
                .iter()
                .any(|p| p.pid == id.pid && p.start_time == id.start_time)
        });
        without(&mut snapshot, &run.gone);
        let plan = policy::evaluate(self.config, &snapshot, &launches, &mut run.state);
        if in_range {
            self.report.samples += 1;
            self.report.processes_unknown += unknown;
            if !run.counted {
                run.counted = true;
                self.report.runs += 1;
            }
            self.report
                .events
                .extend(plan.events.iter().map(|e| ReplayedEvent {
                    at_ms,
                    severity: e.severity.as_str().into(),
                    kind: e.kind.as_str().into(),
                    message: e.message.clone(),
                }));
        }
        let mut outcomes = Vec::with_capacity(plan.actions.len());
        for action in plan.actions {
            if in_range {
                self.report.replayed.push(Step {
                    at_ms,
                    verb: action.verb,
                    target: action.target.to_string(),
                    reason: action.reason.detail.clone(),
                    outcome: None,
                    on_both_sides: false,
                });
            }
            if matches!(action.verb, Verb::Kill | Verb::Terminate) {
                run.gone.extend(action.target.ids());
            }
            outcomes.push(Executed {
                action,
                outcome: Outcome::Done,
            });
        }
        run.state.apply(&outcomes);
    }

    /// The report, each action marked when the other side has it too.
    pub fn finish(mut self) -> ReplayReport {
        let report = &mut self.report;
        for recorded in &mut report.recorded {
            let twin = report.replayed.iter_mut().find(|r| {
                !r.on_both_sides && r.verb == recorded.verb && r.target == recorded.target
            });
            if let Some(twin) = twin {
                twin.on_both_sides = true;
                recorded.on_both_sides = true;
            }
        }
        self.report
    }
}

/// `snapshot` without the processes in `gone`, their memory counted as available and free.
fn without(snapshot: &mut Snapshot, gone: &HashSet<ProcessId>) {
    if gone.is_empty() {
        return;
    }
    let (dead, alive): (Vec<_>, Vec<_>) = std::mem::take(&mut snapshot.processes.processes)
        .into_iter()
        .partition(|p| gone.contains(&p.id()));
    snapshot.processes.processes = alive;
    let host = &mut snapshot.host;
    for p in &dead {
        if let Some(available) = host.available_bytes.as_mut() {
            *available = available
                .saturating_add(p.rss_bytes)
                .min(host.total_bytes.unwrap_or(u64::MAX));
        }
        for gpu in &mut snapshot.gpus.devices {
            if let Some(Some(bytes)) = gpu.processes.remove(&p.pid) {
                gpu.used_bytes = gpu.used_bytes.map(|u| u.saturating_sub(bytes));
                gpu.free_bytes = gpu.free_bytes.map(|f| {
                    f.saturating_add(bytes)
                        .min(gpu.total_bytes.unwrap_or(u64::MAX))
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::Duration;

    use super::*;
    use crate::policy::Launches;
    use crate::snapshot::{HostMemory, Process, ProcessTable};
    use crate::status::{ActionRow, StatusReport};

    const GIB: u64 = 1 << 30;
    /// RAM floors warn 8 GiB and act 4 GiB; model `srv` over its 4 GiB RAM budget is stopped.
    const THEN: &str = "[ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\n\
        [[model]]\nname = \"srv\"\nmatch = { comm = \"srv\" }\nusers = [\"1000\"]\n\
        ram = \"4GiB\"\naction = \"stop\"\ngrace = \"1s\"\n";

    fn config(text: &str) -> Config {
        Config::parse(text, Path::new("replay.toml")).unwrap()
    }

    fn process(pid: i32, comm: &str, rss: u64) -> Process {
        Process {
            pid,
            start_time: 5_000 + pid as u64,
            ppid: 1,
            uid: 1000,
            state: 'S',
            comm: comm.into(),
            cmdline: format!("/usr/bin/{comm}"),
            cgroup: "/user.slice".into(),
            rss_bytes: rss,
            swap_bytes: Some(0),
            ..Process::default()
        }
    }

    /// What the daemon would have recorded over 6 s with `THEN`: a 64 GiB host with 6 GiB
    /// available (between the floors), a 10 GiB hog and the model `srv` at 6 GiB; a sample a
    /// second, each with its input, and the actions the policy took, as the daemon writes them.
    fn recorded() -> Vec<Record> {
        let then = config(THEN);
        let mut state = PolicyState::default();
        let mut records = vec![Record::Start {
            at_ms: 0,
            version: "test".into(),
            boot_id: "b".into(),
        }];
        for second in 1..=6u64 {
            let at = Duration::from_secs(second);
            let snapshot = Snapshot {
                at,
                host: HostMemory {
                    total_bytes: Some(64 * GIB),
                    available_bytes: Some(6 * GIB),
                    swap_total_bytes: Some(0),
                    swap_free_bytes: Some(0),
                    ..HostMemory::default()
                },
                processes: ProcessTable {
                    pss_read: true,
                    scanned_at: Some(at),
                    processes: vec![process(100, "hog", 10 * GIB), process(200, "srv", 6 * GIB)],
                },
                self_pid: 1,
                ..Snapshot::default()
            };
            let launches = Launches::default();
            let plan = policy::evaluate(&then, &snapshot, &launches, &mut state);
            let input =
                PolicyInput::of_tick(&snapshot, &launches, &state.attribution, true, |_| {
                    second == 1
                });
            let at_ms = second * 1000;
            records.push(Record::Sample {
                at_ms,
                status: Box::new(StatusReport::default()),
                input: Some(Box::new(input)),
            });
            let outcomes: Vec<Executed> = plan
                .actions
                .into_iter()
                .map(|action| {
                    records.push(Record::Action {
                        at_ms,
                        action: ActionRow {
                            at_unix: second,
                            verb: action.verb,
                            target: action.target.to_string(),
                            reason_kind: action.reason.kind,
                            reason: action.reason.detail.clone(),
                            outcome: Outcome::Done,
                        },
                    });
                    Executed {
                        action,
                        outcome: Outcome::Done,
                    }
                })
                .collect();
            state.apply(&outcomes);
        }
        // Through JSON, as `gpuguard replay` reads them.
        records
            .iter()
            .map(|r| serde_json::from_str(&serde_json::to_string(r).unwrap()).unwrap())
            .collect()
    }

    fn replay(text: &str) -> ReplayReport {
        let config = config(text);
        let mut replay = Replay::new(&config, 0, u64::MAX);
        recorded().into_iter().for_each(|r| replay.feed(r));
        replay.finish()
    }

    /// Replayed with the config it was recorded with, the policy takes the same actions: the
    /// replay is the daemon's decision, not an imitation of it.
    #[test]
    fn the_recording_config_takes_the_recorded_actions() {
        let report = replay(THEN);
        assert_eq!(report.samples, 6);
        assert_eq!(report.runs, 1);
        assert_eq!(report.recorded.len(), 1, "{report:?}");
        assert_eq!(report.recorded[0].verb, "stop");
        assert!(report.recorded[0].target.starts_with("model 'srv'"));
        assert_eq!(
            report.replayed,
            report
                .recorded
                .iter()
                .map(|s| Step {
                    outcome: None,
                    ..s.clone()
                })
                .collect::<Vec<_>>()
        );
        assert!(report.replayed.iter().all(|s| s.on_both_sides));
    }

    /// A higher floor would have terminated a victim: `srv`, over its budget, goes before the
    /// larger hog, and only it (it is gone afterwards and its memory back, so the floor is not
    /// crossed again); a higher budget would not have stopped `srv`.
    #[test]
    fn a_higher_floor_adds_a_victim_and_a_higher_budget_takes_an_action_away() {
        let floor = replay(&THEN.replace("min_available = \"4GiB\"", "min_available = \"7GiB\""));
        let extra: Vec<&Step> = floor.replayed.iter().filter(|s| !s.on_both_sides).collect();
        assert_eq!(extra.len(), 1, "{floor:?}");
        assert_eq!(
            (extra[0].verb, extra[0].target.as_str()),
            (Verb::Terminate, "model 'srv' pids [200(srv)]")
        );
        assert!(extra[0].reason.contains("min_available"), "{:?}", extra[0]);
        assert!(
            floor
                .events
                .iter()
                .any(|e| e.kind == "floor_act" && e.message.contains("min_available 7.0 GiB")),
            "{:?}",
            floor.events
        );

        let budget = replay(&THEN.replace("ram = \"4GiB\"", "ram = \"16GiB\""));
        assert!(budget.replayed.is_empty(), "{budget:?}");
        assert_eq!(budget.recorded.len(), 1);
        assert!(!budget.recorded[0].on_both_sides);
    }
}
