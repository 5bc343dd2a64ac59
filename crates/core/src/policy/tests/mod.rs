//! Table-driven tests of the pure policy: plain snapshots and TOML configs in, the exact verbs,
//! targets and event kinds out. Time moves by building the next snapshot with a later `at`.
//! This file is the harness (configs, processes, snapshots, plans in words); the tests are by
//! rule: `ram_floor`, `shortfall` (what a RAM victim is judged by: the brake, shared memory,
//! PSS), `gpu`, `budgets`, `membership`, `duplicates`, `faults` (bad readings never act),
//! `carried` (what is in force is what was carried out), `rules` (what no model takes in),
//! `words` (choices in English), and `security` (the host suite's issue #11 attacks on the
//! policy, with uids as plain data).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Duration;

use crate::config::{Config, Mode};
use crate::snapshot::{
    Gpu, GpuSnapshot, GpuStatus, HostMemory, Process, ProcessId, ProcessTable, Snapshot,
};

use super::*;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// gpuguard's own pid in every snapshot.
const SELF_PID: i32 = 4242;
/// RAM floors of most tests, on a 64 GiB host: warn below 8 GiB available, act below 4 GiB.
const RAM_FLOORS: &str = "[ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\n";

fn config(text: &str) -> Config {
    Config::parse(text, Path::new("test.toml")).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

/// A `[[model]]` matched by its own name as `comm`, run by uid 1000, with more keys in `extra`.
fn model(name: &str, extra: &str) -> String {
    format!("[[model]]\nname = \"{name}\"\nmatch = {{ comm = \"{name}\" }}\nusers = [\"1000\"]\n{extra}")
}

/// The same process run by root (names and command lines protect only system uids).
fn system(p: Process) -> Process {
    Process { uid: 0, ..p }
}

/// An ordinary user process; tests change the other fields with `..proc(...)`.
fn proc(pid: i32, comm: &str, rss: u64, ppid: i32) -> Process {
    Process {
        pid,
        start_time: 50_000 + pid as u64,
        ppid,
        uid: 1000,
        state: 'S',
        comm: comm.to_string(),
        cmdline: format!("/usr/bin/{comm}"),
        cgroup: "/user.slice/user-1000.slice/session-1.scope".to_string(),
        rss_bytes: rss,
        swap_bytes: Some(0),
        kernel_thread: false,
        exe: None,
        pss_bytes: None,
    }
}

/// A 64 GiB host without swap, `available` bytes available, processes scanned at `at_ms`.
fn snap(at_ms: u64, available: Option<u64>, procs: Vec<Process>) -> Snapshot {
    let at = Duration::from_millis(at_ms);
    Snapshot {
        at,
        host: HostMemory {
            total_bytes: Some(64 * GIB),
            available_bytes: available,
            swap_total_bytes: Some(0),
            swap_free_bytes: Some(0),
            psi_some_avg10: None,
            shmem_bytes: None,
        },
        processes: ProcessTable {
            pss_read: true,
            scanned_at: Some(at),
            processes: procs,
        },
        gpus: GpuSnapshot::default(),
        self_pid: SELF_PID,
        mapped_weights: Default::default(),
        tmpfs_owners: Default::default(),
    }
}

/// A 16 GiB GPU with `free` bytes free and the GPU memory NVML lists per pid.
fn gpu(index: u32, free: u64, holders: &[(i32, Option<u64>)]) -> Gpu {
    Gpu {
        index,
        uuid: format!("GPU-{index}"),
        name: "Test GPU".to_string(),
        total_bytes: Some(16 * GIB),
        used_bytes: Some(16 * GIB - free),
        free_bytes: Some(free),
        reserved_bytes: Some(0),
        utilization_percent: Some(50),
        error: None,
        lost: false,
        processes: holders.iter().copied().collect(),
        processes_known: true,
        processes_steady: true,
    }
}

/// Plenty of host RAM, fresh GPU readings.
fn gsnap(at_ms: u64, procs: Vec<Process>, devices: Vec<Gpu>) -> Snapshot {
    let mut s = snap(at_ms, Some(32 * GIB), procs);
    s.gpus = GpuSnapshot {
        status: GpuStatus::Ok,
        sampled_at: Some(s.at),
        stale: false,
        devices,
        process_lists_read: at_ms,
        processes_fresh: true,
        absent: false,
    };
    s
}

/// The plan's actions as `verb model[pid,pid]` (no model name for a lone process), `; `-joined.
fn acts(plan: &Plan) -> String {
    let one = |a: &Action| {
        let pids: Vec<String> = a.target.ids().map(|id| id.pid.to_string()).collect();
        format!(
            "{} {}[{}]",
            a.verb.as_str(),
            a.target.model.as_deref().unwrap_or(""),
            pids.join(",")
        )
    };
    plan.actions.iter().map(one).collect::<Vec<_>>().join("; ")
}

fn events(plan: &Plan) -> String {
    plan.events
        .iter()
        .map(|e| e.kind.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// One tick of the policy with nothing launched, its actions carried out (logged in observe
/// mode) as an executor that succeeds would.
fn decide(config: &Config, snapshot: &Snapshot, state: &mut PolicyState) -> Plan {
    decide_with(config, snapshot, &Launches::default(), state)
}

/// One tick with these launches, its actions carried out (logged in observe mode).
fn decide_with(
    config: &Config,
    snapshot: &Snapshot,
    launches: &Launches,
    state: &mut PolicyState,
) -> Plan {
    let plan = evaluate(config, snapshot, launches, state);
    let outcome = match config.daemon.mode {
        Mode::Observe => Outcome::Observed,
        _ => Outcome::Done,
    };
    state.apply(&carried(&plan, outcome));
    plan
}

/// Every action of `plan`, with the same outcome.
fn carried(plan: &Plan, outcome: Outcome) -> Vec<Executed> {
    plan.actions
        .iter()
        .map(|a| Executed {
            action: a.clone(),
            outcome: outcome.clone(),
        })
        .collect()
}

/// Evaluates the snapshots in order, checking each plan's actions and event kinds.
fn play(config: &Config, state: &mut PolicyState, steps: Vec<(Snapshot, &str, &str)>) -> Vec<Plan> {
    let mut plans = Vec::new();
    for (i, (snapshot, want_acts, want_events)) in steps.into_iter().enumerate() {
        let plan = decide(config, &snapshot, state);
        assert_eq!(
            (acts(&plan).as_str(), events(&plan).as_str()),
            (want_acts, want_events),
            "step {i} at {:?}; events: {:#?}",
            snapshot.at,
            plan.events
        );
        plans.push(plan);
    }
    plans
}

/// One tick from a fresh state.
fn once(config: &Config, snapshot: &Snapshot) -> Plan {
    decide(config, snapshot, &mut PolicyState::default())
}

/// The executor skips an action whose recheck reads at or above `below_bytes`: a recheck must not
/// cancel the very action the current reading calls for.
fn assert_recheck_lets_it_act(plan: &Plan, available: u64) {
    for a in &plan.actions {
        if let Some(r) = a.recheck {
            assert!(
                available < r.below_bytes,
                "{a:?} would be skipped at {available} bytes available"
            );
        }
    }
}

#[test]
fn ram_floor_levels() {
    let c = config(RAM_FLOORS);
    let procs = || {
        vec![
            proc(100, "trainer", 6 * GIB, 1),
            proc(200, "loader", 2 * GIB, 1),
        ]
    };
    let cases = [
        (16 * GIB, "", ""),
        (8 * GIB, "", ""),
        (6 * GIB, "", "floor_warn"),
        (4 * GIB, "", "floor_warn"),
        (3 * GIB, "terminate [100]", "floor_act"),
        // Exactly half of min_available is not under half of it.
        (2 * GIB, "terminate [100]", "floor_act"),
        // Far below, but on one sample only: SIGTERM (SIGKILL needs a second sample).
        (2 * GIB - 1, "terminate [100]", "floor_act"),
        (512 * MIB, "terminate [100]", "floor_act"),
    ];
    for (available, want_acts, want_events) in cases {
        let plan = once(&c, &snap(0, Some(available), procs()));
        assert_eq!(
            (acts(&plan).as_str(), events(&plan).as_str()),
            (want_acts, want_events),
            "{available}"
        );
        for a in &plan.actions {
            assert_eq!(a.reason.kind, "ram_floor");
            // MemAvailable under min_available is why: what the executor reads again.
            assert_eq!(
                a.recheck,
                Some(Recheck {
                    resource: Resource::Ram,
                    below_bytes: 4 * GIB
                })
            );
        }
    }
}

fn verbs(plan: &Plan) -> Vec<&'static str> {
    plan.actions.iter().map(|a| a.verb.as_str()).collect()
}

/// One tick from a fresh state, and the groups loaded more than once in `snapshot` as data
/// (`waste::duplicates`): the tick's `duplicate_load` events are theirs, one each, in order.
fn duplicates_said(c: &Config, snapshot: &Snapshot) -> (Plan, Vec<waste::Duplicate>) {
    let mut state = PolicyState::default();
    let plan = evaluate(c, snapshot, &Launches::default(), &mut state);
    let found = waste::duplicates(snapshot);
    let said: Vec<&Event> = plan
        .events
        .iter()
        .filter(|e| e.kind == EventKind::DuplicateLoad)
        .collect();
    let theirs: Vec<Event> = found
        .iter()
        .map(|d| waste::duplicate_event(snapshot, &state, d))
        .collect();
    assert_eq!(said, theirs.iter().collect::<Vec<_>>());
    (plan, found)
}

/// A victim of 6 GiB (pid 100) whose RSS is `rss`, with a bystander of 4 GiB.
fn term_victims(rss: u64) -> Vec<Process> {
    vec![
        proc(100, "trainer", rss, 1),
        proc(200, "loader", 4 * GIB, 1),
    ]
}

/// Model "srv" (pids 100 and 101) holding 5 GiB on each of two GPUs with 10 GiB free: both
/// under a `min_free` of 12 GiB at once, with the one victim between them.
fn srv_on_two_gpus(at_ms: u64) -> Snapshot {
    gsnap(
        at_ms,
        vec![proc(100, "srv", GIB, 1), proc(101, "srv", GIB, 100)],
        vec![
            gpu(0, 10 * GIB, &[(100, Some(5 * GIB))]),
            gpu(1, 10 * GIB, &[(101, Some(5 * GIB))]),
        ],
    )
}

/// The model of each process of `table`, in the table's order.
fn rows(a: &Attribution, table: &ProcessTable) -> Vec<Option<usize>> {
    table.processes.iter().map(|p| a.model_of(p.id())).collect()
}

/// A scan of `processes` (at time zero) and what `c`'s models hold of it, with nothing
/// registered or launched and a fresh match cache.
fn attributed(c: &Config, processes: Vec<Process>) -> (ProcessTable, Attribution) {
    let table = ProcessTable {
        pss_read: true,
        scanned_at: Some(Duration::ZERO),
        processes,
    };
    let a = attribute(
        c,
        &table,
        &GpuSnapshot::default(),
        &HashMap::new(),
        &BTreeMap::new(),
        SELF_PID,
        &mut MatchCache::default(),
    );
    (table, a)
}

/// Where each member sits in `table`.
fn member_rows(members: &[ProcessId], table: &ProcessTable) -> Vec<usize> {
    members
        .iter()
        .filter_map(|id| table.processes.iter().position(|p| p.id() == *id))
        .collect()
}

/// `resource`'s reading at `snapshot`, as the floors read it (`floors::readings`).
fn reading(c: &Config, snapshot: &Snapshot, resource: Resource) -> floors::Reading {
    floors::readings(c, snapshot, &[resource])
        .into_iter()
        .find(|r| r.resource == resource)
        .unwrap()
}

/// What the floor on `resource` decides at `snapshot` when it chooses (`floors::choose`), as
/// data.
fn choice(
    c: &Config,
    snapshot: &Snapshot,
    state: &mut PolicyState,
    resource: Resource,
) -> floors::Choice {
    floors::choose(c, snapshot, state, &reading(c, snapshot, resource))
}

/// What the RAM floor decides at `snapshot` when it chooses, as data.
fn ram_choice(c: &Config, snapshot: &Snapshot, state: &mut PolicyState) -> floors::Choice {
    choice(c, snapshot, state, Resource::Ram)
}

/// One tick from a fresh state, and the floor on `resource`'s choice in it, as data (asked
/// again after the tick, before its actions are carried out).
fn once_choosing(c: &Config, snapshot: &Snapshot, resource: Resource) -> (Plan, floors::Choice) {
    let mut state = PolicyState::default();
    let plan = evaluate(c, snapshot, &Launches::default(), &mut state);
    let chosen = choice(c, snapshot, &mut state, resource);
    (plan, chosen)
}

/// A chosen victim: the target, what it holds of the short resource, and, for a user ranked by
/// its sum, that sum and how many processes.
fn victim_of(choice: floors::Choice) -> (Target, u64, Option<(u64, usize)>) {
    match choice {
        floors::Choice::Victim(v) => (v.target, v.used, v.user_total),
        other => panic!("no victim: {other:?}"),
    }
}

/// The uid of each process of `target`.
fn uids(target: &Target) -> Vec<u32> {
    target.members.iter().map(|m| m.uid).collect()
}

/// Whether `plan` says an event of `kind`.
fn said(plan: &Plan, kind: EventKind) -> bool {
    plan.events.iter().any(|e| e.kind == kind)
}

/// The Shmem rule's verdict in a choice.
fn shmem_verdict(choice: floors::Choice) -> floors::ShmemVerdict {
    match choice {
        floors::Choice::HeldBack(v) => v,
        floors::Choice::Victim(v) => v.shmem.expect("the Shmem rule applied"),
        other => panic!("{other:?}"),
    }
}

/// `snapshot` with `Shmem` (tmpfs, shared memory) at `shmem` bytes.
fn with_shmem(mut snapshot: Snapshot, shmem: u64) -> Snapshot {
    snapshot.host.shmem_bytes = Some(shmem);
    snapshot
}

/// One GPU floor, RAM floors off, stop as the floor action with a short max_stop.
const GPU_STOP: &str = "[gpu]\nmin_free = \"2GiB\"\nwarn_free = \"3GiB\"\naction = \"stop\"\n[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n[daemon]\nmax_stop = \"10s\"\nsettle = \"60s\"\n";

/// A weights file mapped whole.
fn weights_file(inode: u64) -> crate::snapshot::MappedFile {
    crate::snapshot::MappedFile {
        path: format!("/models/m/model-{inode}.safetensors"),
        device: "fd:01".into(),
        inode,
        mapped_bytes: 4 * GIB,
    }
}

mod budgets;
mod carried;
mod duplicates;
mod faults;
mod gpu;
mod membership;
mod ram_floor;
mod rules;
mod security;
mod shortfall;
mod words;
