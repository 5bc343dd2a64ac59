//! The pure policy: `evaluate(config, snapshot, state) -> Plan`.
//!
//! No I/O and no clock (time comes in on the snapshot), so every rule is tested with plain data.
//! Floors (host RAM, each GPU) open *incidents* that act on one victim at a time and escalate;
//! budgets watch each model. The plan says what to do, what happened, and when to look again.
//! Each action carries the stage it enters (`Entry`), entered in one place, `PolicyState::apply`,
//! once the executor reports it carried out; what the policy observes (a victim gone, memory
//! stuck, back above a floor or under a budget) changes stages in `evaluate`.

pub mod admission;
mod budgets;
mod floors;
pub mod models;
pub mod rules;
mod victim;
mod waste;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use serde::Serialize;

use crate::config::{Config, ModelConfig};
use crate::snapshot::{ProcessId, Snapshot};
use crate::units::fmt_bytes;

pub use crate::kinds::{EventKind, Level, ReasonKind, Severity};
pub use models::{attribute, Attribution, Launches, MatchCache, ModelUsage, ModelsInForce};

/// The memory a floor or budget is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Resource {
    Ram,
    Gpu(u32),
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Resource::Ram => f.write_str("RAM"),
            Resource::Gpu(i) => write!(f, "GPU {i}"),
        }
    }
}

crate::kinds::named! {
    /// A signal-level step taken against a target.
    pub enum Verb {
        /// Slow the target's growth (cgroup limits or a SIGSTOP/SIGCONT duty cycle).
        Throttle = "throttle",
        Unthrottle = "unthrottle",
        /// SIGSTOP.
        Stop = "stop",
        /// SIGCONT.
        Resume = "resume",
        /// SIGTERM (then SIGCONT, so a stopped process can act on it).
        Terminate = "terminate",
        /// SIGKILL, then reap its memory with process_mrelease.
        Kill = "kill",
    }
}

/// One process of a target, as the policy saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Member {
    pub id: ProcessId,
    pub comm: String,
    pub uid: u32,
}

/// What an action is aimed at: a whole model, or one process that belongs to none.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Target {
    pub model: Option<String>,
    pub members: Vec<Member>,
}

impl Target {
    pub fn ids(&self) -> impl Iterator<Item = ProcessId> + '_ {
        self.members.iter().map(|m| m.id)
    }

    pub fn any_alive(&self, snapshot: &Snapshot) -> bool {
        self.ids().any(|id| snapshot.processes.alive(id))
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pids: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}({})", m.id.pid, m.comm))
            .collect();
        match &self.model {
            Some(model) => write!(f, "model '{model}' pids [{}]", pids.join(", ")),
            None => write!(f, "pid {}", pids.join(", ")),
        }
    }
}

/// Why something was done, for logs, alerts and metrics.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Reason {
    pub kind: ReasonKind,
    /// Self-contained, human: "RAM available 1.2 GiB < min_available 2.0 GiB".
    pub detail: String,
}

/// Before acting, the executor reads this resource again and skips the action if it has recovered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Recheck {
    pub resource: Resource,
    pub below_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Action {
    pub verb: Verb,
    pub target: Target,
    pub reason: Reason,
    pub recheck: Option<Recheck>,
    /// The stages the action puts its incident or budget in (and any other floor's incident
    /// that takes up the same signal in the same tick), entered only once the executor has
    /// carried it out (`PolicyState::apply`).
    #[serde(skip)]
    pub enters: Vec<Entry>,
    /// SIGKILL after SIGTERM: why (`reason` says it in words).
    #[serde(skip)]
    pub after_term: Option<floors::AfterTerm>,
}

/// Where an action leaves the incident or budget it was decided for. The policy's stages move
/// on what the executor reports (`PolicyState::apply`), never on the decision alone: an action
/// skipped or failed leaves the stage where it was, and the next tick decides afresh.
#[derive(Clone, Debug, PartialEq)]
pub enum Entry {
    /// A floor's incident: `victim` at `stage` from `at`.
    Floor {
        resource: Resource,
        victim: Target,
        stage: Stage,
        at: Duration,
        /// A victim chosen just now, holding this much of the short resource: it counts towards
        /// the floor's brake.
        chosen: Option<u64>,
    },
    /// A model's budget: the enforcement in force from now on.
    Budget {
        model: String,
        enforced: Enforcement,
    },
}

/// Something worth telling an operator that is not itself a signal.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Event {
    pub severity: Severity,
    pub kind: EventKind,
    pub message: String,
    /// Who or what it is about, for alert bodies.
    pub about: About,
    /// The account whose own doing it is (a client's request, a model it launched), if any:
    /// counted against that uid's share of the per-uid rate limit (`reserve::limit`), and never
    /// a reason for the flight recorder to keep a sample. `None`: the host's or the operator's
    /// (floors, `[[model]]` budgets), never held back.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub caused_by: Option<u32>,
}

impl Event {
    pub fn new(severity: Severity, kind: EventKind, message: String) -> Event {
        Event {
            severity,
            kind,
            message,
            about: About::default(),
            caused_by: None,
        }
    }

    pub fn about(mut self, about: About) -> Event {
        self.about = about;
        self
    }

    /// Caused by `uid`'s own doing (see `caused_by`).
    pub fn caused_by(mut self, uid: Option<u32>) -> Event {
        self.caused_by = uid;
        self
    }
}

/// The subject of an event, as far as it has one.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct About {
    pub model: Option<String>,
    pub pid: Option<i32>,
    pub uid: Option<u32>,
    pub resource: Option<Resource>,
}

impl About {
    /// A target's model and first process, on a resource.
    pub fn target(target: &Target, resource: Resource) -> About {
        let first = target.members.first();
        About {
            model: target.model.clone(),
            pid: first.map(|m| m.id.pid),
            uid: first.map(|m| m.uid),
            resource: Some(resource),
        }
    }
}

/// The policy's answer for one tick.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    pub actions: Vec<Action>,
    pub events: Vec<Event>,
    /// Sleep this long before the next tick.
    pub next_interval: Duration,
    /// On the next tick, rescan all processes if the last scan is older than this.
    pub max_scan_age: Duration,
    /// Processes to re-read every tick (victims whose exit we wait for).
    pub watch: Vec<ProcessId>,
}

/// What became of one action (the executor's answer, fed back with `PolicyState::apply`). In
/// words and in JSON (`status`'s `recent_actions[].outcome`): "done", "observed", "skipped: why"
/// or "failed: why".
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Outcome {
    Done,
    /// Observe mode: logged, nothing signalled.
    Observed,
    /// Not needed any more (memory recovered, the target is gone).
    Skipped(String),
    Failed(String),
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Done => f.write_str("done"),
            Outcome::Observed => f.write_str("observed"),
            Outcome::Skipped(why) => write!(f, "skipped: {why}"),
            Outcome::Failed(why) => write!(f, "failed: {why}"),
        }
    }
}

impl From<Outcome> for String {
    fn from(o: Outcome) -> String {
        o.to_string()
    }
}

impl TryFrom<String> for Outcome {
    type Error = String;

    /// The words `Display` writes (every version has written these four).
    fn try_from(text: String) -> Result<Outcome, String> {
        match text.as_str() {
            "done" => Ok(Outcome::Done),
            "observed" => Ok(Outcome::Observed),
            _ => match (
                text.strip_prefix("skipped: "),
                text.strip_prefix("failed: "),
            ) {
                (Some(why), _) => Ok(Outcome::Skipped(why.into())),
                (_, Some(why)) => Ok(Outcome::Failed(why.into())),
                _ => Err(format!("not an action's outcome: {text:?}")),
            },
        }
    }
}

crate::kinds::named! {
    /// Where an enforcement against one target stands.
    pub enum Stage {
        Alerted = "alerted",
        Throttled = "throttled",
        Stopped = "stopped",
        Terminated = "terminated",
        Killed = "killed",
        /// The victim is gone; waiting to see the memory come back.
        Gone = "gone",
        /// The victim is gone but its memory is not (or it survived SIGKILL): no more kills here.
        Stuck = "stuck",
    }
}

/// A floor crossed to `Act`: one victim at a time.
#[derive(Clone, Debug, Serialize)]
pub struct Incident {
    pub opened_at: Duration,
    pub victim: Option<Target>,
    pub stage: Stage,
    pub stage_since: Duration,
    /// Victims already dealt with in this incident.
    pub victims_done: u32,
    /// Reported that no victim could be chosen (to say it once).
    pub no_victim_reported: bool,
    /// Reported that the reading is stale (to say it once).
    pub stale_reported: bool,
    /// Processes the executor could not act on (not permitted...): not chosen again here.
    pub excluded: Vec<ProcessId>,
    /// When a sample first showed the resource far below its floor (SIGKILL at once needs a
    /// later sample to confirm it); `None` while it is not.
    pub far_below_at: Option<Duration>,
    /// After SIGTERM: the victim's own memory at the first reading after the signal.
    pub term_baseline: Option<TermBaseline>,
    /// RAM floors: the victim and its own memory at the last reading that saw it alive (what
    /// its death can give back at most).
    pub victim_last_seen: Option<(Target, u64)>,
    /// Reported that the shortfall is Shmem growth no process holds (to say it once).
    pub shmem_reported: bool,
}

/// The victim's own memory at the first reading after SIGTERM (a process shutting down does not
/// grow from there).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TermBaseline {
    /// The `stage_since` of the SIGTERM it belongs to.
    pub stage_since: Duration,
    pub bytes: u64,
}

impl Incident {
    /// The act floor just crossed: no victim yet.
    fn open(now: Duration) -> Incident {
        Incident {
            opened_at: now,
            victim: None,
            stage: Stage::Alerted,
            stage_since: now,
            victims_done: 0,
            no_victim_reported: false,
            stale_reported: false,
            excluded: Vec::new(),
            far_below_at: None,
            term_baseline: None,
            victim_last_seen: None,
            shmem_reported: false,
        }
    }

    /// The one way an incident's stage changes: `stage` from `at` (a SIGTERM's growth baseline
    /// is its own: `take_terminating` sets one after entering).
    fn enter(&mut self, stage: Stage, at: Duration) {
        self.stage = stage;
        self.stage_since = at;
        self.term_baseline = None;
    }
}

/// An action of the plan and what the executor made of it (what `PolicyState::apply` learns).
#[derive(Clone, Debug)]
pub struct Executed {
    pub action: Action,
    pub outcome: Outcome,
}

/// A victim a floor acted on (the executor carried out, or in observe mode logged, the first
/// action on it): what the brake on cascades counts, across incidents.
#[derive(Clone, Debug, Serialize)]
pub struct FloorVictim {
    pub at: Duration,
    pub target: Target,
    /// What it held of the short resource when chosen.
    pub used: u64,
}

/// A model's budget state.
#[derive(Clone, Debug, Default, Serialize)]
pub struct BudgetState {
    pub over_since: Option<Duration>,
    /// What is over, as the last evaluation found it (`None` while under budget): the one
    /// answer to "which resource is over" that actions, alerts and status read.
    pub over: Option<Overage>,
    /// The enforcement in force, with the target it was applied to.
    pub enforced: Option<Enforcement>,
    /// Its members' RSS is over its RAM budget: the scan should read their PSS (shared pages
    /// counted once), which decides.
    pub wants_pss: bool,
    /// The account that launched the model, for one with no `[[model]]`
    /// (`ModelConfig::launched_by`): its budget events are that account's doing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub launched_by: Option<u32>,
}

/// A budget's action in force against a model.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Enforcement {
    pub stage: Stage,
    /// When the stage began.
    pub since: Duration,
    pub target: Target,
}

/// The resource a model is over its budget on (RAM first when both are), and by how much.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Overage {
    /// GPU memory (summed over the model's GPUs); else RAM.
    pub gpu: bool,
    pub used_bytes: u64,
    pub budget_bytes: u64,
}

impl Overage {
    pub fn reason(&self) -> ReasonKind {
        match self.gpu {
            true => ReasonKind::GpuBudget,
            false => ReasonKind::RamBudget,
        }
    }

    /// "RAM" or "GPU memory".
    pub fn resource_name(&self) -> &'static str {
        match self.gpu {
            true => "GPU memory",
            false => "RAM",
        }
    }
}

/// A process gpuguard stopped for a floor whose incident has closed: resumed when that resource is
/// back to `Ok`, killed after `max_stop`.
#[derive(Clone, Debug, Serialize)]
pub struct Held {
    pub target: Target,
    pub resource: Resource,
    pub since: Duration,
}

/// A floor victim that was sent SIGTERM by an incident that has since closed (the floor rose
/// above its act floor while it shut down). Until `term_grace` has passed, a new incident that
/// chooses it again takes up the same SIGTERM (its grace and growth check) instead of sending
/// another: a second SIGTERM tells many servers (uvicorn, vLLM, torchrun) to quit without
/// cleaning up, and a RAM reading that wobbles around the floor would send one each time.
#[derive(Clone, Debug)]
pub struct Terminating {
    pub target: Target,
    pub since: Duration,
    pub term_baseline: Option<TermBaseline>,
}

/// What the policy remembers between ticks.
#[derive(Debug, Default)]
pub struct PolicyState {
    pub levels: BTreeMap<Resource, Level>,
    pub incidents: BTreeMap<Resource, Incident>,
    pub budgets: BTreeMap<String, BudgetState>,
    pub held: Vec<Held>,
    pub terminating: Vec<Terminating>,
    pub match_cache: MatchCache,
    /// The attribution of the latest scan (for status and metrics).
    pub attribution: Attribution,
    /// What the attribution was computed from.
    attributed: Option<AttributionInputs>,
    /// Groups already reported as loaded more than once.
    duplicates_reported: Vec<waste::Reported>,
    /// Per floor, the victims acted on within its `victim_window` since the resource last read
    /// `Ok` outside a brake (the brake on cascades counts them: victims that helped do not).
    pub floor_victims: BTreeMap<Resource, Vec<FloorVictim>>,
    /// Floors whose brake holds (reported once; released when the resource reads `Ok` again and
    /// fewer than `max_victims` of its victims are within the window).
    pub braked: BTreeSet<Resource>,
    /// `Shmem` when RAM was last above its warn floor, and the most it has been since.
    pub shmem_baseline: Option<ShmemBaseline>,
    /// Per GPU, with `candidates = "models"`: the memory held outside every model when the GPU
    /// was last above its warn floor, and the most it has been since (`floors::outside_models`).
    pub outside_baseline: BTreeMap<u32, (u64, u64)>,
}

/// `Shmem` when RAM was last above its warn floor, and the most it has been since: growth
/// (peak - base) that is more than the shortfall is memory no process holds. The peak, not the
/// latest reading, while a tmpfs file is being removed: `Shmem` falls before MemAvailable rises,
/// and that moment must not look like a shortfall of processes. Only that moment: once
/// MemAvailable has risen by half of what `Shmem` gave back, or `SHMEM_FALL_GRACE` after it
/// fell, the peak is what `Shmem` is now (a deleted file must not hide the processes that keep
/// RAM short after it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShmemBaseline {
    pub base: u64,
    pub peak: u64,
    /// MemAvailable when `Shmem` was at its peak.
    pub available_at_peak: Option<u64>,
    /// When `Shmem` was first read below its peak (daemon clock).
    pub fell_at: Option<Duration>,
}

/// How long the peak of `Shmem` outlives a fall that MemAvailable does not show.
pub const SHMEM_FALL_GRACE: Duration = Duration::from_secs(2);

impl ShmemBaseline {
    /// Above the warn floor: everything since starts from `shmem`.
    pub fn new(shmem: u64, available: Option<u64>) -> ShmemBaseline {
        ShmemBaseline {
            base: shmem,
            peak: shmem,
            available_at_peak: available,
            fell_at: None,
        }
    }

    /// A reading below the warn floor at `at`.
    pub fn next(self, shmem: u64, available: Option<u64>, at: Duration) -> ShmemBaseline {
        if shmem >= self.peak {
            return ShmemBaseline {
                peak: shmem,
                available_at_peak: available,
                fell_at: None,
                ..self
            };
        }
        let gave_back = self.peak - shmem;
        let shown = matches!(
            (available, self.available_at_peak),
            (Some(a), Some(p)) if a.saturating_sub(p) >= gave_back / 2
        );
        let fell_at = self.fell_at.unwrap_or(at);
        if shown || at.saturating_sub(fell_at) >= SHMEM_FALL_GRACE {
            ShmemBaseline {
                peak: shmem.max(self.base),
                available_at_peak: available,
                fell_at: None,
                ..self
            }
        } else {
            ShmemBaseline {
                fell_at: Some(fell_at),
                ..self
            }
        }
    }
}

/// What an attribution was computed from: it is worked out again only when one changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct AttributionInputs {
    /// The process scan.
    scanned_at: Option<Duration>,
    /// The GPU process lists.
    process_lists_read: u64,
}

impl PolicyState {
    /// Resources with an incident, a level or a held process: they keep getting a reading.
    fn tracked_resources(&self) -> Vec<Resource> {
        let mut out: Vec<Resource> = self
            .levels
            .keys()
            .chain(self.incidents.keys())
            .copied()
            .chain(self.held.iter().map(|h| h.resource))
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Forget derived data that depends on the config (call after a reload).
    pub fn config_changed(&mut self) {
        self.match_cache.clear();
        self.attributed = None;
    }

    /// Launched processes or models changed (`Launches::same_members`): membership is worked
    /// out again.
    pub fn launches_changed(&mut self) {
        self.attributed = None;
    }

    /// What became of this tick's actions: the only way the policy learns what the executor did,
    /// and the one place where an action's stages are entered. An action carried out (or, in
    /// observe mode, logged) enters the stages it was decided with, in every incident that took
    /// up its signal; one skipped (the target gone, memory recovered) leaves everything as it
    /// was, so the next tick decides afresh. A floor's victim that could not be signalled (not
    /// permitted...) is let go and not chosen again in those incidents (held, if it was stopped,
    /// so it is resumed when the resource recovers); a budget's action that
    /// failed stands as decided (its failure is reported once, not tried again every tick).
    pub fn apply(&mut self, outcomes: &[Executed]) {
        for Executed { action, outcome } in outcomes {
            for entry in &action.enters {
                match (outcome, entry) {
                    (Outcome::Done | Outcome::Observed, _)
                    | (Outcome::Failed(_), Entry::Budget { .. }) => self.enter(entry.clone()),
                    (Outcome::Failed(_), Entry::Floor { resource, .. }) => {
                        if let Some(incident) = self.incidents.get_mut(resource) {
                            incident.excluded.extend(action.target.ids());
                            let victim = incident.victim.take();
                            // Stopped and not signalled further: held, so it is resumed when
                            // the resource recovers (never left frozen).
                            if let (Some(target), Stage::Stopped) = (victim, incident.stage) {
                                self.held.push(Held {
                                    target,
                                    resource: *resource,
                                    since: incident.stage_since,
                                });
                            }
                        }
                    }
                    (Outcome::Skipped(_), _) => {}
                }
            }
        }
    }

    /// An action's entry, carried out.
    fn enter(&mut self, entry: Entry) {
        match entry {
            Entry::Floor {
                resource,
                victim,
                stage,
                at,
                chosen,
            } => {
                let Some(incident) = self.incidents.get_mut(&resource) else {
                    return;
                };
                if let Some(used) = chosen {
                    self.floor_victims
                        .entry(resource)
                        .or_default()
                        .push(FloorVictim {
                            at,
                            target: victim.clone(),
                            used,
                        });
                }
                incident.victim = Some(victim);
                incident.enter(stage, at);
            }
            Entry::Budget { model, enforced } => {
                if let Some(budget) = self.budgets.get_mut(&model) {
                    budget.enforced = Some(enforced);
                }
            }
        }
    }

    /// The floors' victims and their stages as they will be once this tick's actions are carried
    /// out (`plan`'s entries over the incidents'): what the rest of the tick reads, so that two
    /// floors deciding in one tick see each other's step.
    fn steps(&self, plan: &Plan) -> Vec<InForce> {
        let mut steps: BTreeMap<Resource, InForce> = self
            .incidents
            .iter()
            .filter_map(|(r, i)| {
                Some((
                    *r,
                    InForce {
                        resource: *r,
                        victim: i.victim.clone()?,
                        stage: i.stage,
                        since: i.stage_since,
                        pending: None,
                    },
                ))
            })
            .collect();
        for (index, a) in plan.actions.iter().enumerate() {
            for entry in &a.enters {
                if let Entry::Floor {
                    resource,
                    victim,
                    stage,
                    at,
                    ..
                } = entry
                {
                    steps.insert(
                        *resource,
                        InForce {
                            resource: *resource,
                            victim: victim.clone(),
                            stage: *stage,
                            since: *at,
                            pending: Some(index),
                        },
                    );
                }
            }
        }
        steps.into_values().collect()
    }
}

/// A floor's victim and the stage it is at (or enters with this tick's action).
#[derive(Clone, Debug)]
struct InForce {
    resource: Resource,
    victim: Target,
    stage: Stage,
    since: Duration,
    /// Decided this tick, not yet carried out: the index of its action in the plan.
    pending: Option<usize>,
}

/// Assumed worst-case fill rates, to sleep no longer than it takes to go from here to the floor.
const RAM_FILL_BYTES_PER_SEC: f64 = 8.0 * (1u64 << 30) as f64;
const GPU_FILL_BYTES_PER_SEC: f64 = 32.0 * (1u64 << 30) as f64;
/// Near a floor, processes are rescanned at least this often so a victim is ready at the crossing.
const NEAR_FLOOR_SCAN_AGE: Duration = Duration::from_millis(100);

/// Decides what to do about one snapshot, with the launches the reservation ledger has
/// registered.
pub fn evaluate(
    config: &Config,
    snapshot: &Snapshot,
    launches: &Launches,
    state: &mut PolicyState,
) -> Plan {
    let mut plan = Plan {
        next_interval: config.daemon.interval,
        max_scan_age: config.daemon.scan_interval,
        ..Default::default()
    };

    // Membership and usage change only with a new process scan or new GPU process lists.
    let inputs = AttributionInputs {
        scanned_at: snapshot.processes.scanned_at,
        process_lists_read: snapshot.gpus.process_lists_read,
    };
    if state.attributed != Some(inputs) {
        state.attribution = attribute(
            config,
            &snapshot.processes,
            &snapshot.gpus,
            &launches.registered,
            &launches.models,
            snapshot.self_pid,
            &mut state.match_cache,
        );
        state.attributed = Some(inputs);
        waste::duplicate_loads(snapshot, state, &mut plan);
    }
    let readings = floors::readings(config, snapshot, &state.tracked_resources());
    // Before the floors: a floor back above its warn floor forgets the victims that helped, and
    // one whose brake may release may choose a victim this tick.
    floors::release_brakes(config, snapshot, state, &readings, &mut plan);
    for reading in &readings {
        floors::evaluate_floor(config, snapshot, state, reading, &mut plan);
    }
    floors::release_held(config, snapshot, state, &readings, &mut plan);
    budgets::evaluate_budgets(config, snapshot, launches, state, &mut plan);

    // Sleep no longer than a fast hog needs to reach the nearest floor.
    for r in &readings {
        if let (Some(available), Some(min)) = (r.available, r.min) {
            let rate = if r.resource == Resource::Ram {
                RAM_FILL_BYTES_PER_SEC
            } else {
                GPU_FILL_BYTES_PER_SEC
            };
            let headroom = available.saturating_sub(min) as f64;
            plan.next_interval = plan
                .next_interval
                .min(Duration::from_secs_f64(headroom / rate));
        }
        if matches!(
            state.levels.get(&r.resource),
            Some(Level::Warn | Level::Act)
        ) {
            plan.max_scan_age = plan.max_scan_age.min(NEAR_FLOOR_SCAN_AGE);
        }
    }
    let steps = state.steps(&plan);
    let busy = steps.iter().any(|s| s.stage != Stage::Stuck)
        || state.budgets.values().any(|b| b.over_since.is_some());
    let terminating = steps.iter().any(|s| s.stage == Stage::Terminated);
    let watch = watched(state, &steps, &plan);
    if busy {
        plan.next_interval = config.daemon.min_interval;
    }
    let unchosen = |r: &Resource| !steps.iter().any(|s| s.resource == *r);
    if state
        .incidents
        .keys()
        .any(|r| unchosen(r) && !state.braked.contains(r))
    {
        // A floor is crossed and nobody is chosen yet: look at fresh processes next tick. (A
        // floor whose brake holds chooses nobody while it is still short: no rush.)
        plan.max_scan_age = Duration::ZERO;
    }
    if state.budgets.values().any(|b| b.over_since.is_some()) {
        plan.max_scan_age = plan.max_scan_age.min(NEAR_FLOOR_SCAN_AGE);
    }
    plan.next_interval = plan
        .next_interval
        .clamp(config.daemon.min_interval, config.daemon.interval);
    if terminating {
        // A victim that ignores SIGTERM shows by growing: watch it closely until it is gone.
        plan.next_interval = plan.next_interval.min(floors::TERM_WATCH_INTERVAL);
    }
    plan.watch = watch;
    plan
}

/// A model's config: its `[[model]]`, else what `gpuguard launch` registered for it.
pub fn model_config<'a>(
    config: &'a Config,
    launches: &'a Launches,
    name: &str,
) -> Option<&'a ModelConfig> {
    launches.models(config).get(name)
}

/// Victims whose exit or state we wait for.
fn watched(state: &PolicyState, steps: &[InForce], plan: &Plan) -> Vec<ProcessId> {
    let budgets = state
        .budgets
        .values()
        .filter_map(|b| b.enforced.as_ref())
        .chain(
            plan.actions
                .iter()
                .flat_map(|a| &a.enters)
                .filter_map(|e| match e {
                    Entry::Budget { enforced, .. } => Some(enforced),
                    Entry::Floor { .. } => None,
                }),
        )
        .map(|e| &e.target);
    let mut ids: Vec<ProcessId> = steps
        .iter()
        .map(|s| &s.victim)
        .chain(budgets)
        .chain(state.held.iter().map(|h| &h.target))
        .flat_map(|t| t.ids())
        .collect();
    ids.sort();
    ids.dedup();
    ids
}

fn action(
    verb: Verb,
    target: &Target,
    kind: ReasonKind,
    detail: String,
    recheck: Option<Recheck>,
) -> Action {
    Action {
        verb,
        target: target.clone(),
        reason: Reason { kind, detail },
        recheck,
        enters: Vec::new(),
        after_term: None,
    }
}

impl Entry {
    /// A model's budget: SIGKILL sent at `at`.
    fn killed(model: &str, at: Duration, target: Target) -> Entry {
        Entry::Budget {
            model: model.to_string(),
            enforced: Enforcement {
                stage: Stage::Killed,
                since: at,
                target,
            },
        }
    }
}

impl Action {
    /// The stage this action enters once carried out.
    fn entering(mut self, entry: Entry) -> Action {
        self.enters.push(entry);
        self
    }
}

fn event(severity: Severity, kind: EventKind, message: String) -> Event {
    Event::new(severity, kind, message)
}

fn bytes(b: u64) -> String {
    fmt_bytes(b)
}
