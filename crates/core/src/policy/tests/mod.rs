//! Table-driven tests of the pure policy: plain snapshots and TOML configs in, the exact verbs,
//! targets and event kinds out. Time moves by building the next snapshot with a later `at`.
//! `security` holds the host suite's issue #11 attacks on the policy, with uids as plain data.

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

#[test]
fn warn_is_said_once_and_cleared_once() {
    let c = config(RAM_FLOORS);
    let procs = || vec![proc(100, "trainer", 6 * GIB, 1)];
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, Some(16 * GIB), procs()), "", ""),
            (snap(1000, Some(6 * GIB), procs()), "", "floor_warn"),
            (snap(2000, Some(5 * GIB), procs()), "", ""),
            (snap(3000, Some(7 * GIB), procs()), "", ""),
            (snap(4000, Some(16 * GIB), procs()), "", "floor_cleared"),
            (snap(5000, Some(16 * GIB), procs()), "", ""),
            (snap(6000, Some(6 * GIB), procs()), "", "floor_warn"),
        ],
    );
}

#[test]
fn protected_processes_are_never_victims() {
    let big = 30 * GIB;
    let cases = [
        ("pid 1", "", proc(1, "bash", big, 0)),
        (
            "kernel thread",
            "",
            Process {
                kernel_thread: true,
                exe: None,
                pss_bytes: None,
                ..proc(2, "kworker/0:1", big, 2)
            },
        ),
        ("gpuguard itself", "", proc(SELF_PID, "agent", big, 1)),
        ("sshd by default", "", system(proc(300, "sshd", big, 1))),
        (
            "systemd* by default",
            "",
            system(proc(301, "systemd-journal", big, 1)),
        ),
        (
            "a zombie",
            "",
            Process {
                state: 'Z',
                ..proc(302, "defunct", big, 1)
            },
        ),
        (
            "[protect] comm prefix",
            "[protect]\ncomm = [\"redis*\"]\n",
            system(proc(303, "redis-server", big, 1)),
        ),
        (
            "[protect] cmdline regex",
            "[protect]\ncmdline = [\"--keep-me\\\\b\"]\n",
            system(Process {
                cmdline: "python3 app.py --keep-me".into(),
                ..proc(304, "python3", big, 1)
            }),
        ),
        (
            "[protect] users",
            "[protect]\nusers = [\"4321\"]\n",
            Process {
                uid: 4321,
                ..proc(305, "postgres", big, 1)
            },
        ),
    ];
    for (what, extra, protected) in cases {
        let c = config(&format!("{RAM_FLOORS}{extra}"));
        let worker = proc(500, "worker", GIB, 1);
        let plan = once(&c, &snap(0, Some(3 * GIB), vec![protected.clone(), worker]));
        assert_eq!(acts(&plan), "terminate [500]", "{what}");

        // Nothing else to choose: say so once (critical: the floor is crossed and nothing will
        // be done about it), act never.
        let plans = play(
            &c,
            &mut PolicyState::default(),
            vec![
                (
                    snap(0, Some(3 * GIB), vec![protected.clone()]),
                    "",
                    "floor_act, no_victim",
                ),
                (snap(1000, Some(3 * GIB), vec![protected.clone()]), "", ""),
                (snap(2000, Some(GIB), vec![protected.clone()]), "", ""),
            ],
        );
        assert_eq!(plans[0].events[1].severity, Severity::Critical, "{what}");
    }

    // The built-in list can be turned off.
    let c = config(&format!("{RAM_FLOORS}[protect]\ndefaults = false\n"));
    let plan = once(
        &c,
        &snap(
            0,
            Some(3 * GIB),
            vec![
                system(proc(300, "sshd", big, 1)),
                proc(500, "worker", GIB, 1),
            ],
        ),
    );
    assert_eq!(acts(&plan), "terminate [300]");

    // Issue #11: a user's hog that calls itself sshd (or matches a cmdline rule) is an ordinary
    // candidate, chosen before the small process next to it; the protection users cannot fake
    // (their uid, a service's cgroup) still holds.
    let c = config(&format!(
        "{RAM_FLOORS}[protect]\ncmdline = [\"keep-me\"]\nunits = [\"db.service\"]\n"
    ));
    for forged in [
        proc(300, "sshd", big, 1),
        Process {
            cmdline: "hog keep-me".into(),
            ..proc(300, "hog", big, 1)
        },
    ] {
        let plan = once(
            &c,
            &snap(0, Some(3 * GIB), vec![forged, proc(500, "worker", GIB, 1)]),
        );
        assert_eq!(acts(&plan), "terminate [300]");
    }
    let service = Process {
        cgroup: "/system.slice/db.service".into(),
        ..proc(300, "postgres", big, 1)
    };
    let plan = once(
        &c,
        &snap(0, Some(3 * GIB), vec![service, proc(500, "worker", GIB, 1)]),
    );
    assert_eq!(acts(&plan), "terminate [500]");
}

#[test]
fn victim_order() {
    let any = "[daemon]\ncandidates = \"any\"\n";
    let models_only = "[daemon]\ncandidates = \"models\"\n";
    let cases = [
        (
            "a model over its RAM budget beats a bigger process",
            format!("{any}{}", model("small", "ram = \"1GiB\"\n")),
            vec![
                proc(100, "small", 2 * GIB, 1),
                proc(300, "big", 10 * GIB, 1),
            ],
            "terminate small[100]",
        ),
        (
            "the most over first",
            format!(
                "{any}{}{}",
                model("a", "ram = \"4GiB\"\n"),
                model("b", "ram = \"1GiB\"\n")
            ),
            vec![
                proc(100, "a", 5 * GIB, 1),
                proc(200, "b", 3 * GIB, 1),
                proc(300, "big", 10 * GIB, 1),
            ],
            "terminate b[200]",
        ),
        (
            "over budget before lower priority",
            format!(
                "{any}{}{}",
                model("a", "priority = -10\n"),
                model("b", "priority = 10\nram = \"1GiB\"\n")
            ),
            vec![proc(100, "a", 8 * GIB, 1), proc(200, "b", 2 * GIB, 1)],
            "terminate b[200]",
        ),
        (
            "lower priority first",
            format!(
                "{any}{}{}",
                model("a", "priority = 10\n"),
                model("b", "priority = 5\n")
            ),
            vec![proc(100, "a", 8 * GIB, 1), proc(200, "b", 2 * GIB, 1)],
            "terminate b[200]",
        ),
        (
            "a process outside every model counts as priority 0",
            format!("{any}{}", model("a", "priority = -5\n")),
            vec![proc(100, "a", GIB, 1), proc(300, "big", 10 * GIB, 1)],
            "terminate a[100]",
        ),
        (
            "then the larger user",
            format!("{any}{}{}", model("a", ""), model("b", "")),
            vec![
                proc(100, "a", 3 * GIB, 1),
                proc(200, "b", 5 * GIB, 1),
                proc(300, "big", 4 * GIB, 1),
            ],
            "terminate b[200]",
        ),
        (
            "the larger user, in a model or not",
            format!("{any}{}", model("a", "")),
            vec![proc(100, "a", 3 * GIB, 1), proc(300, "big", 4 * GIB, 1)],
            "terminate [300]",
        ),
        (
            "candidates = models never picks a process outside a model",
            format!("{models_only}{}", model("a", "")),
            vec![proc(100, "a", GIB, 1), proc(300, "big", 30 * GIB, 1)],
            "terminate a[100]",
        ),
    ];
    for (what, extra, procs, want) in cases {
        let c = config(&format!("{RAM_FLOORS}{extra}"));
        let plan = once(&c, &snap(0, Some(3 * GIB), procs));
        assert_eq!(acts(&plan), want, "{what}");
    }

    let c = config(&format!("{RAM_FLOORS}{models_only}{}", model("a", "")));
    let plan = once(
        &c,
        &snap(0, Some(3 * GIB), vec![proc(300, "big", 30 * GIB, 1)]),
    );
    assert_eq!(
        (acts(&plan).as_str(), events(&plan).as_str()),
        ("", "floor_act, no_victim")
    );
}

#[test]
fn model_membership_by_matcher() {
    let cases = [
        (
            "cmdline regex",
            "match = { cmdline = \"vllm serve\" }",
            Process {
                cmdline: "python3 -m vllm serve Qwen/Qwen2-7B".into(),
                ..proc(100, "python3", GIB, 1)
            },
            Process {
                cmdline: "python3 -m vllm bench".into(),
                ..proc(200, "python3", GIB, 1)
            },
        ),
        (
            "comm",
            "match = { comm = \"vllm*\" }",
            proc(100, "vllm-worker", GIB, 1),
            proc(200, "pvllm", GIB, 1),
        ),
        (
            "user (numeric uid)",
            "match = { user = \"1234\" }",
            Process {
                uid: 1234,
                ..proc(100, "python3", GIB, 1)
            },
            Process {
                uid: 1235,
                ..proc(200, "python3", GIB, 1)
            },
        ),
        (
            "unit (its own cgroup)",
            "match = { unit = \"vllm.service\" }",
            Process {
                cgroup: "/system.slice/vllm.service".into(),
                ..proc(100, "python3", GIB, 1)
            },
            Process {
                cgroup: "/system.slice/vllm.service2".into(),
                ..proc(200, "python3", GIB, 1)
            },
        ),
        (
            "unit: a user's unit of the same name is not the system's (issue #11)",
            "match = { unit = \"vllm.service\" }",
            Process {
                cgroup: "/system.slice/vllm.service/worker".into(),
                ..proc(100, "python3", GIB, 1)
            },
            Process {
                cgroup: "/user.slice/user-1000.slice/user@1000.service/app.slice/vllm.service"
                    .into(),
                ..proc(200, "python3", GIB, 1)
            },
        ),
        (
            "unit in another slice",
            "match = { unit = \"ml.slice/vllm.service\" }",
            Process {
                cgroup: "/ml.slice/vllm.service".into(),
                ..proc(100, "python3", GIB, 1)
            },
            Process {
                cgroup: "/system.slice/vllm.service".into(),
                ..proc(200, "python3", GIB, 1)
            },
        ),
        (
            "cgroup prefix",
            "match = { cgroup = \"/machine.slice/models\" }",
            Process {
                cgroup: "/machine.slice/models/qwen".into(),
                ..proc(100, "python3", GIB, 1)
            },
            Process {
                cgroup: "/machine.slice/models-old/qwen".into(),
                ..proc(200, "python3", GIB, 1)
            },
        ),
        (
            "every given key",
            "match = { comm = \"python3\", user = \"1234\" }",
            Process {
                uid: 1234,
                ..proc(100, "python3", GIB, 1)
            },
            proc(200, "python3", GIB, 1),
        ),
    ];
    for (what, matcher, yes, no) in cases {
        // A model matched by user is that user's; any other is given uid 1000's processes.
        let users = if matcher.contains("user") {
            ""
        } else {
            "users = [\"1000\"]\n"
        };
        let c = config(&format!("[[model]]\nname = \"m\"\n{matcher}\n{users}"));
        let (table, a) = attributed(&c, vec![yes, no]);
        assert_eq!(rows(&a, &table), [Some(0), None], "{what}");
        assert_eq!(member_rows(&a.models[0].members, &table), [0], "{what}");
    }
}

#[test]
fn descendants_belong_to_the_model() {
    let c = config(&format!(
        "{RAM_FLOORS}[protect]\nunits = [\"metrics.service\"]\n[[model]]\nname = \"vllm\"\nmatch = {{ cmdline = \"vllm serve\" }}\nusers = [\"1000\"]\n"
    ));
    let procs = vec![
        Process {
            cmdline: "python3 -m vllm serve Qwen".into(),
            ..proc(100, "python3", 2 * GIB, 1)
        },
        Process {
            cmdline: "python3 -c from multiprocessing.spawn import spawn_main".into(),
            ..proc(101, "python3", 3 * GIB, 100)
        },
        proc(102, "pt_main_thread", GIB, 101),
        Process {
            state: 'Z',
            ..proc(103, "python3", 7 * GIB, 100)
        },
        Process {
            cgroup: "/system.slice/metrics.service".into(),
            ..proc(104, "metrics-agent", GIB / 2, 100)
        },
        proc(200, "other", 5 * GIB, 1),
    ];
    let s = snap(0, Some(3 * GIB), procs);
    let mut state = PolicyState::default();
    let plan = decide(&c, &s, &mut state);

    let usage = &state.attribution.models[0];
    // The protected child (in `metrics.service`) is in no model (issue 40): neither counted nor
    // a target.
    assert_eq!(
        rows(&state.attribution, &s.processes),
        [Some(0), Some(0), Some(0), Some(0), None, None]
    );
    // Live members only (the zombie has none of its memory any more), RSS summed over them.
    assert_eq!(member_rows(&usage.members, &s.processes), [0, 1, 2]);
    assert_eq!(usage.rss_bytes, 6 * GIB);
    // The parent alone (2 GiB) is smaller than `other` (5 GiB); with its children (6 GiB) it is not.
    // The target is every live member that may be signalled.
    assert_eq!(acts(&plan), "terminate vllm[100,101,102]");
    let target = &plan.actions[0].target;
    assert_eq!(
        target.members[1],
        Member {
            id: ProcessId {
                pid: 101,
                start_time: 50_101
            },
            comm: "python3".into(),
            uid: 1000
        }
    );
    assert_eq!(plan.watch, target.ids().collect::<Vec<_>>());
}

#[test]
fn launched_processes_belong_to_their_registered_model() {
    let c = config("[[model]]\nname = \"vllm\"\nmatch = { comm = \"vllm\" }\nusers = [\"1000\"]\n");
    let procs = vec![
        proc(100, "vllm", GIB, 1),
        proc(101, "worker", GIB, 100),
        proc(300, "vllm", GIB, 1),
        proc(301, "worker", GIB, 300),
    ];
    let registered = HashMap::from([(procs[2].id(), "launched".to_string())]);
    let table = ProcessTable {
        pss_read: true,
        scanned_at: Some(Duration::ZERO),
        processes: procs,
    };
    // A launched model belongs to its launcher's uid.
    let launched = |owner: &str| {
        let mut m = config(&format!(
            "[[model]]\nname = \"launched\"\nusers = [\"{owner}\"]\n"
        ));
        BTreeMap::from([("launched".to_string(), m.models.remove(0))])
    };
    let a = attribute(
        &c,
        &table,
        &GpuSnapshot::default(),
        &registered,
        &launched("1000"),
        SELF_PID,
        &mut MatchCache::default(),
    );
    let names: Vec<&str> = a.models.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["vllm", "launched"]);
    // Registration beats the config match, and children follow their parent.
    assert_eq!(rows(&a, &table), [Some(0), Some(0), Some(1), Some(1)]);
    // Processes of another uid never join it (issue #11).
    let a = attribute(
        &c,
        &table,
        &GpuSnapshot::default(),
        &registered,
        &launched("0"),
        SELF_PID,
        &mut MatchCache::default(),
    );
    assert_eq!(rows(&a, &table), [Some(0), Some(0), None, None]);
}

#[test]
fn a_model_has_only_processes_of_its_users_whatever_they_are_named() {
    // Issue #11: a user's process named like the system's server does not join its model; nor
    // does a child of the server that runs as another user.
    let c = config("[[model]]\nname = \"vllm\"\nmatch = { cmdline = \"vllm serve\" }\n");
    let server = Process {
        uid: 998,
        cmdline: "python3 -m vllm serve x".into(),
        ..proc(100, "python3", GIB, 1)
    };
    let forged = Process {
        uid: 1001,
        cmdline: "python3 -m vllm serve x".into(),
        ..proc(200, "python3", GIB, 1)
    };
    let sandboxed = Process {
        uid: 1002,
        ..proc(101, "helper", GIB, 100)
    };
    let (table, a) = attributed(&c, vec![server, forged, sandboxed]);
    assert_eq!(rows(&a, &table), [Some(0), None, None]);
}

#[test]
fn membership_follows_exec() {
    // pid and start time survive exec(): a wrapper scanned before it execs the model server must
    // join the model once it has.
    let c = config("[[model]]\nname = \"vllm\"\nmatch = { comm = \"vllm\" }\nusers = [\"1000\"]\n");
    let mut cache = MatchCache::default();
    let table = |comm: &str| ProcessTable {
        pss_read: true,
        scanned_at: Some(Duration::ZERO),
        processes: vec![proc(100, comm, GIB, 1)],
    };
    let gpus = GpuSnapshot::default();
    let before = attribute(
        &c,
        &table("sh"),
        &gpus,
        &HashMap::new(),
        &BTreeMap::new(),
        SELF_PID,
        &mut cache,
    );
    assert_eq!(rows(&before, &table("sh")), [None]);
    let after = attribute(
        &c,
        &table("vllm"),
        &gpus,
        &HashMap::new(),
        &BTreeMap::new(),
        SELF_PID,
        &mut cache,
    );
    assert_eq!(rows(&after, &table("vllm")), [Some(0)]);
}

#[test]
fn membership_follows_an_exec_that_keeps_the_name_and_a_setuid() {
    let c =
        config("[[model]]\nname = \"vllm\"\nmatch = { cmdline = \"vllm serve\", user = \"0\" }\n");
    let mut cache = MatchCache::default();
    let table = |cmdline: &str, uid: u32| ProcessTable {
        pss_read: true,
        scanned_at: Some(Duration::ZERO),
        processes: vec![Process {
            cmdline: cmdline.to_string(),
            uid,
            ..proc(100, "python3", GIB, 1)
        }],
    };
    let gpus = GpuSnapshot::default();
    let mut model_of = |t: &ProcessTable| {
        let a = attribute(
            &c,
            t,
            &gpus,
            &HashMap::new(),
            &BTreeMap::new(),
            SELF_PID,
            &mut cache,
        );
        rows(&a, t)
    };
    assert_eq!(model_of(&table("python3 launcher.py", 0)), [None]);
    // python3 exec'd python3: the same name, another command line.
    assert_eq!(model_of(&table("python3 -m vllm serve x", 0)), [Some(0)]);
    // The real uid changed (to another system uid, which the model's users allow): it no longer
    // matches `user = "0"`.
    assert_eq!(model_of(&table("python3 -m vllm serve x", 2)), [None]);
}

#[test]
fn one_victim_per_incident_then_the_next() {
    let c = config(RAM_FLOORS);
    let abc = || {
        vec![
            proc(100, "trainer", 6 * GIB, 1),
            proc(200, "loader", 4 * GIB, 1),
            proc(300, "notebook", GIB, 1),
        ]
    };
    let bc = || {
        abc()
            .into_iter()
            .filter(|p| p.pid != 100)
            .collect::<Vec<_>>()
    };
    let c_only = || {
        abc()
            .into_iter()
            .filter(|p| p.pid == 300)
            .collect::<Vec<_>>()
    };
    let low = Some(3 * GIB);
    let plans = play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, low, abc()), "terminate [100]", "floor_act"),
            (snap(500, low, abc()), "", ""),
            (snap(999, low, abc()), "", ""),
            // term_grace (1s) is over and it is still there.
            (snap(1000, low, abc()), "kill [100]", ""),
            // No second victim while the first is alive.
            (snap(1500, low, abc()), "", ""),
            // Gone: its memory may not be back in MemAvailable yet; the next victim waits for
            // a reading RAM_RELEASE (1 s) later.
            (snap(2000, low, bc()), "", ""),
            (snap(3000, low, bc()), "terminate [200]", ""),
            (snap(3100, Some(5 * GIB), c_only()), "", "incident_closed"),
            (snap(3200, Some(16 * GIB), c_only()), "", "floor_cleared"),
        ],
    );
    let pid = |p: &Plan| p.watch.iter().map(|id| id.pid).collect::<Vec<_>>();
    assert_eq!(pid(&plans[0]), [100]);
    assert_eq!(pid(&plans[6]), [200]);
    assert_eq!(pid(&plans[8]), Vec::<i32>::new());
    assert_eq!(
        plans[3].actions[0].recheck,
        Some(Recheck {
            resource: Resource::Ram,
            below_bytes: 4 * GIB
        })
    );
    assert_eq!(
        plans[3].actions[0].after_term,
        Some(floors::AfterTerm::GraceOver)
    );
}

/// Found by the host suite on CI: the hog was terminated and seen gone 13 ms later while
/// MemAvailable did not show its pages back yet, and that reading chose the sentinel. An exited
/// victim's memory comes back some time after it is seen gone: the next victim waits for a
/// reading `RAM_RELEASE` later; memory back by then ends the incident with nobody else signalled.
#[test]
fn the_next_victim_waits_for_the_gone_ones_memory_to_come_back() {
    let c = config(RAM_FLOORS);
    let both = || {
        vec![
            proc(100, "hog", 6 * GIB, 1),
            proc(200, "sentinel", 100 * MIB, 1),
        ]
    };
    let sentinel = || vec![proc(200, "sentinel", 100 * MIB, 1)];
    let low = Some(3 * GIB);
    let start = || (snap(0, low, both()), "terminate [100]", "floor_act");
    // Its memory comes back half a second after it is gone: nobody else.
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            start(),
            (snap(13, low, sentinel()), "", ""),
            (snap(26, low, sentinel()), "", ""),
            (snap(500, low, sentinel()), "", ""),
            (
                snap(600, Some(9 * GIB), sentinel()),
                "",
                "floor_cleared, incident_closed",
            ),
        ],
    );
    // Still short a second after it is gone: that is not its memory, the next one goes.
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            start(),
            (snap(13, low, sentinel()), "", ""),
            (snap(1000, low, sentinel()), "", ""),
            (snap(1013, low, sentinel()), "terminate [200]", ""),
        ],
    );
}

/// The wait for a gone victim's memory is for memory that can lift RAM above its act floor:
/// when all it held (at the last reading that saw it alive) would still leave RAM under it, the
/// next victim is chosen at once, not a second later.
#[test]
fn the_next_victim_does_not_wait_for_memory_too_small_to_lift_the_floor() {
    let c = config(RAM_FLOORS);
    let both = vec![proc(100, "hog", GIB, 1), proc(200, "second", 800 * MIB, 1)];
    let second = || vec![proc(200, "second", 800 * MIB, 1)];
    // 2.5 GiB available, act floor 4 GiB: the hog's 1 GiB back makes 3.5 GiB, still short.
    let low = Some(2 * GIB + 512 * MIB);
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, low, both), "terminate [100]", "floor_act"),
            (snap(13, low, second()), "", ""),
            (snap(26, low, second()), "terminate [200]", ""),
        ],
    );
}

#[test]
fn a_victim_that_exits_on_sigterm_is_not_killed() {
    let c = config(RAM_FLOORS);
    let ab = || {
        vec![
            proc(100, "trainer", 6 * GIB, 1),
            proc(200, "loader", 4 * GIB, 1),
        ]
    };
    let zombie_a = || {
        vec![
            Process {
                state: 'Z',
                ..proc(100, "trainer", 0, 1)
            },
            proc(200, "loader", 4 * GIB, 1),
        ]
    };
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, Some(3 * GIB), ab()), "terminate [100]", "floor_act"),
            (snap(500, Some(3 * GIB), zombie_a()), "", ""),
            (snap(1000, Some(3 * GIB), zombie_a()), "", ""),
            (snap(1500, Some(3 * GIB), zombie_a()), "terminate [200]", ""),
            (
                snap(2000, Some(10 * GIB), zombie_a()),
                "",
                "floor_cleared, incident_closed",
            ),
        ],
    );
}

#[test]
fn far_below_needs_a_second_fresh_sample_before_sigkill() {
    let c = config(RAM_FLOORS);
    let a = || vec![proc(100, "trainer", 6 * GIB, 1)];
    // RAM: each tick reads meminfo afresh. One sample far below: SIGTERM; the next, still far
    // below: SIGKILL without waiting out term_grace.
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, Some(GIB), a()), "terminate [100]", "floor_act"),
            (snap(10, Some(GIB), a()), "kill [100]", ""),
        ],
    );
    // A GPU: the second tick serves the same NVML sample (sampled_at unchanged), which confirms
    // nothing; only a later sample does.
    let c = config(
        "[gpu]\nmin_free = \"2GiB\"\n[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n",
    );
    let g = || vec![gpu(0, 512 * MIB, &[(100, Some(8 * GIB))])];
    let mut first = gsnap(0, a(), g());
    first.gpus.sampled_at = Some(Duration::ZERO);
    let mut same = gsnap(10, a(), g());
    same.gpus.sampled_at = Some(Duration::ZERO);
    let mut fresh = gsnap(20, a(), g());
    fresh.gpus.sampled_at = Some(Duration::from_millis(15));
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (first, "terminate [100]", "floor_act"),
            (same, "", ""),
            (fresh, "kill [100]", ""),
        ],
    );
}

#[test]
fn far_below_skips_sigterm_grace() {
    let c = config(RAM_FLOORS);
    let a = || vec![proc(100, "trainer", 6 * GIB, 1)];
    let plans = play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, Some(3 * GIB), a()), "terminate [100]", "floor_act"),
            // Far below (under half the floor) on one sample: confirmed by the next one.
            (snap(100, Some(GIB), a()), "", ""),
            (snap(200, Some(GIB), a()), "kill [100]", ""),
            (snap(300, Some(GIB), a()), "", ""),
        ],
    );
    assert_eq!(
        plans[2].actions[0].after_term,
        Some(floors::AfterTerm::FarBelow)
    );
}

#[test]
fn survived_kill_is_reported_and_nobody_else_is_killed() {
    let c = config(&format!("[daemon]\nkill_timeout = \"5s\"\n{RAM_FLOORS}"));
    let ab = || {
        vec![
            Process {
                state: 'D',
                ..proc(100, "trainer", 6 * GIB, 1)
            },
            proc(200, "loader", 4 * GIB, 1),
        ]
    };
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, Some(GIB), ab()), "terminate [100]", "floor_act"),
            (snap(10, Some(GIB), ab()), "kill [100]", ""),
            (snap(5009, Some(GIB), ab()), "", ""),
            (snap(5010, Some(GIB), ab()), "", "survived_kill"),
            (snap(6010, Some(GIB), ab()), "", ""),
        ],
    );
}

#[test]
fn stop_then_terminate_after_settle() {
    let c = config(&format!("{RAM_FLOORS}action = \"stop\"\n"));
    let a = || {
        vec![
            proc(100, "trainer", 6 * GIB, 1),
            proc(200, "loader", 4 * GIB, 1),
        ]
    };
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, Some(3 * GIB), a()), "stop [100]", "floor_act"),
            (snap(1999, Some(3 * GIB), a()), "", ""),
            // settle (2s) is over and RAM is still below min: stopping was not enough.
            (snap(2000, Some(3 * GIB), a()), "terminate [100]", ""),
            (snap(3000, Some(3 * GIB), a()), "kill [100]", ""),
        ],
    );
    // Far below after settle: straight to SIGKILL.
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, Some(GIB), a()), "stop [100]", "floor_act"),
            (snap(2000, Some(GIB), a()), "kill [100]", ""),
        ],
    );
}

#[test]
fn stopped_victim_is_held_until_ram_is_back_above_warn() {
    let c = config(&format!(
        "{RAM_FLOORS}action = \"stop\"\n[daemon]\nmax_stop = \"30s\"\n"
    ));
    let a = || {
        vec![
            proc(100, "trainer", 6 * GIB, 1),
            proc(200, "loader", 4 * GIB, 1),
        ]
    };
    let plans = play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, Some(3 * GIB), a()), "stop [100]", "floor_act"),
            // Between min and warn: the incident is over, the victim stays stopped.
            (snap(1000, Some(6 * GIB), a()), "", "incident_closed"),
            (snap(5000, Some(6 * GIB), a()), "", ""),
            (
                snap(6000, Some(16 * GIB), a()),
                "resume [100]",
                "floor_cleared",
            ),
            (snap(7000, Some(16 * GIB), a()), "", ""),
        ],
    );
    assert_eq!(plans[3].actions[0].reason.kind, "cleared");
    assert_eq!(
        plans[2].watch.iter().map(|id| id.pid).collect::<Vec<_>>(),
        [100]
    );

    // Held too long: killed after max_stop (counted from the stop).
    let plans = play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, Some(3 * GIB), a()), "stop [100]", "floor_act"),
            (snap(1000, Some(6 * GIB), a()), "", "incident_closed"),
            (snap(29_999, Some(6 * GIB), a()), "", ""),
            (snap(30_000, Some(6 * GIB), a()), "kill [100]", ""),
            (snap(31_000, Some(16 * GIB), a()), "", "floor_cleared"),
        ],
    );
    assert_eq!(plans[3].actions[0].reason.kind, "max_stop");

    // A held process that exits is forgotten: neither killed nor resumed.
    let b = || a().into_iter().filter(|p| p.pid != 100).collect::<Vec<_>>();
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, Some(3 * GIB), a()), "stop [100]", "floor_act"),
            (snap(1000, Some(6 * GIB), a()), "", "incident_closed"),
            (snap(2000, Some(6 * GIB), b()), "", ""),
            (snap(40_000, Some(6 * GIB), b()), "", ""),
            (snap(41_000, Some(16 * GIB), b()), "", "floor_cleared"),
        ],
    );
}

#[test]
fn observe_mode_acts_once_and_never_escalates() {
    let a = || {
        vec![
            proc(100, "trainer", 6 * GIB, 1),
            proc(200, "loader", 4 * GIB, 1),
        ]
    };
    let c = config(&format!("{RAM_FLOORS}[daemon]\nmode = \"observe\"\n"));
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, Some(3 * GIB), a()), "terminate [100]", "floor_act"),
            (snap(1000, Some(3 * GIB), a()), "", ""),
            (snap(5000, Some(3 * GIB), a()), "", ""),
            (snap(20_000, Some(GIB), a()), "", ""),
        ],
    );
    // A stop that never happened is never "resumed" (the executor runs Resume even in observe).
    let c = config(&format!(
        "{RAM_FLOORS}action = \"stop\"\n[daemon]\nmode = \"observe\"\n"
    ));
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, Some(3 * GIB), a()), "stop [100]", "floor_act"),
            (snap(3000, Some(3 * GIB), a()), "", ""),
            (snap(4000, Some(6 * GIB), a()), "", "incident_closed"),
            (snap(5000, Some(16 * GIB), a()), "", "floor_cleared"),
        ],
    );
}

#[test]
fn alert_action_names_the_victim_without_acting() {
    let c = config(&format!("{RAM_FLOORS}action = \"alert\"\n"));
    let a = || vec![proc(100, "trainer", 6 * GIB, 1)];
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, Some(GIB), a()), "", "floor_act, floor_victim"),
            (snap(5000, Some(GIB), a()), "", ""),
        ],
    );
}

#[test]
fn unknown_ram_reading_never_acts() {
    let c = config(RAM_FLOORS);
    let a = || vec![proc(100, "trainer", 6 * GIB, 1)];
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, None, a()), "", "reading_unknown"),
            (snap(1000, None, a()), "", ""),
            (
                snap(2000, Some(3 * GIB), a()),
                "terminate [100]",
                "floor_act",
            ),
        ],
    );
    // Unknown in the middle of an incident: no escalation while it is unknown.
    let mut state = PolicyState::default();
    play(
        &c,
        &mut state,
        vec![(snap(0, Some(3 * GIB), a()), "terminate [100]", "floor_act")],
    );
    for at in [1000, 2000, 30_000] {
        let plan = decide(&c, &snap(at, None, a()), &mut state);
        assert_eq!(acts(&plan), "", "at {at}");
        assert!(
            at > 1000 || plan.events.iter().any(|e| e.kind == "reading_unknown"),
            "{:?}",
            plan.events
        );
    }
    // A reading that is unknown because the total is (a percentage floor) does not act either.
    let c = config("[ram]\nwarn_available = \"10%\"\nmin_available = \"5%\"\n");
    let mut s = snap(0, Some(MIB), a());
    s.host.total_bytes = None;
    assert_eq!(acts(&once(&c, &s)), "");
}

#[test]
fn psi_alone_warns_and_acts_with_low_ram() {
    let c = config(&format!("{RAM_FLOORS}psi_some_avg10 = 20.0\n"));
    let cases = [
        (16 * GIB, Some(50.0), "", "floor_warn"),
        (16 * GIB, Some(10.0), "", ""),
        (16 * GIB, None, "", ""),
        (6 * GIB, Some(10.0), "", "floor_warn"),
        (6 * GIB, Some(50.0), "terminate [100]", "floor_act"),
        (3 * GIB, None, "terminate [100]", "floor_act"),
    ];
    for (available, psi, want_acts, want_events) in cases {
        let mut s = snap(0, Some(available), vec![proc(100, "trainer", 6 * GIB, 1)]);
        s.host.psi_some_avg10 = psi;
        let plan = once(&c, &s);
        assert_eq!(
            (acts(&plan).as_str(), events(&plan).as_str()),
            (want_acts, want_events),
            "{available} {psi:?}"
        );
        assert_recheck_lets_it_act(&plan, available);
        // PSI above its limit is why it warns (or, with RAM under its warn floor, acts); an act
        // for PSI has no MemAvailable level that means recovered, so no recheck.
        let r = reading(&c, &s, Resource::Ram);
        let high = psi == Some(50.0);
        assert_eq!(
            (r.act_because.is_some(), r.warn_because.is_some()),
            (high && available < 8 * GIB, high && available >= 8 * GIB),
            "{available} {psi:?}"
        );
        if high && available >= 4 * GIB {
            assert!(plan.actions.iter().all(|a| a.recheck.is_none()), "{plan:?}");
        }
    }
}

#[test]
fn swap_floor_acts_only_with_swap() {
    let cases = [
        ("1GiB", None, None, "", ""),
        ("1GiB", Some(0), Some(0), "", ""),
        ("1GiB", Some(8 * GIB), Some(4 * GIB), "", ""),
        (
            "1GiB",
            Some(8 * GIB),
            Some(512 * MIB),
            "terminate [100]",
            "floor_act",
        ),
        ("10%", Some(8 * GIB), Some(GIB), "", ""),
        (
            "10%",
            Some(8 * GIB),
            Some(512 * MIB),
            "terminate [100]",
            "floor_act",
        ),
    ];
    for (floor, total, free, want_acts, want_events) in cases {
        let c = config(&format!("{RAM_FLOORS}min_swap_free = \"{floor}\"\n"));
        let trainer = Process {
            swap_bytes: Some(2 * GIB),
            ..proc(100, "trainer", 6 * GIB, 1)
        };
        let mut s = snap(0, Some(16 * GIB), vec![trainer]);
        s.host.swap_total_bytes = total;
        s.host.swap_free_bytes = free;
        let plan = once(&c, &s);
        assert_eq!(
            (acts(&plan).as_str(), events(&plan).as_str()),
            (want_acts, want_events),
            "{floor} {total:?} {free:?}"
        );
        assert_recheck_lets_it_act(&plan, 16 * GIB);
    }
}

#[test]
fn swap_floor_ranks_by_swap_held_and_ram_floor_by_rss() {
    let c = config(&format!("{RAM_FLOORS}min_swap_free = \"1GiB\"\n"));
    let procs = || {
        vec![
            Process {
                swap_bytes: Some(64 * MIB),
                ..proc(100, "big-rss", 12 * GIB, 1)
            },
            Process {
                swap_bytes: Some(3 * GIB),
                ..proc(200, "big-swap", GIB, 1)
            },
            Process {
                swap_bytes: None,
                ..proc(300, "unknown-swap", 2 * GIB, 1)
            },
        ]
    };
    let with_swap = |available: u64| {
        let mut s = snap(0, Some(available), procs());
        s.host.swap_total_bytes = Some(8 * GIB);
        s.host.swap_free_bytes = Some(512 * MIB);
        s
    };
    // MemAvailable fine, swap short: the one holding most swap.
    let (plan, choice) = once_choosing(&c, &with_swap(16 * GIB), Resource::Ram);
    assert_eq!(acts(&plan), "terminate [200]");
    assert_eq!(
        reading(&c, &with_swap(16 * GIB), Resource::Ram).short,
        victim::Short::Swap
    );
    let (target, used, user_total) = victim_of(choice);
    assert_eq!(
        (target, used, user_total),
        (plan.actions[0].target.clone(), 3 * GIB, None)
    );
    // MemAvailable short too: resident memory decides.
    assert_eq!(acts(&once(&c, &with_swap(3 * GIB))), "terminate [100]");
    // SwapFree above SwapTotal is not a reading to act on.
    let mut bogus = with_swap(16 * GIB);
    bogus.host.swap_free_bytes = Some(9 * GIB);
    assert_eq!(acts(&once(&c, &bogus)), "");
}

#[test]
fn ram_budget_actions_after_grace() {
    // A 3.5 GiB model (parent + child) over a 2 GiB budget, then back to 1.5 GiB.
    let over = || {
        vec![
            proc(100, "vllm", 3 * GIB, 1),
            proc(101, "worker", GIB / 2, 100),
            proc(300, "other", 8 * GIB, 1),
        ]
    };
    let under = || {
        vec![
            proc(100, "vllm", GIB, 1),
            proc(101, "worker", GIB / 2, 100),
            proc(300, "other", 8 * GIB, 1),
        ]
    };
    let cases = [
        (
            "throttle",
            "throttle vllm[100,101]",
            "",
            "",
            "unthrottle vllm[100,101]",
        ),
        ("stop", "stop vllm[100,101]", "", "", "resume vllm[100,101]"),
        (
            "kill",
            "terminate vllm[100,101]",
            "",
            "kill vllm[100,101]",
            "",
        ),
        ("alert", "", "budget_enforced", "", ""),
    ];
    let ok = Some(32 * GIB);
    for (action, at_grace, grace_events, after, cleared) in cases {
        let c = config(&model(
            "vllm",
            &format!("ram = \"2GiB\"\naction = \"{action}\"\ngrace = \"5s\"\n"),
        ));
        let plans = play(
            &c,
            &mut PolicyState::default(),
            vec![
                (snap(0, ok, over()), "", "budget_exceeded"),
                (snap(4999, ok, over()), "", ""),
                (snap(5000, ok, over()), at_grace, grace_events),
                (snap(6000, ok, over()), after, ""),
                (snap(7000, ok, under()), cleared, "budget_cleared"),
                (snap(8000, ok, under()), "", ""),
            ],
        );
        for a in plans[2].actions.iter().chain(&plans[3].actions) {
            assert_eq!(a.reason.kind, "ram_budget", "{action}");
            assert_eq!(a.recheck, None, "{action}");
        }
        for a in &plans[2].actions {
            assert!(
                a.reason.detail.ends_with("for longer than grace 5s"),
                "{action}: {}",
                a.reason.detail
            );
        }
        for a in &plans[4].actions {
            assert_eq!(a.reason.kind, "cleared", "{action}");
        }
        assert!(
            plans[0].events[0]
                .message
                .contains(&format!("action {action} after grace 5s")),
            "{}",
            plans[0].events[0].message
        );
    }
}

#[test]
fn budget_grace_restarts_when_back_under() {
    let c = config(&model(
        "vllm",
        "ram = \"2GiB\"\naction = \"stop\"\ngrace = \"5s\"\n",
    ));
    let use_ = |rss| vec![proc(100, "vllm", rss, 1)];
    let ok = Some(32 * GIB);
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, ok, use_(3 * GIB)), "", "budget_exceeded"),
            (snap(3000, ok, use_(GIB)), "", "budget_cleared"),
            (snap(6000, ok, use_(3 * GIB)), "", "budget_exceeded"),
            (snap(10_999, ok, use_(3 * GIB)), "", ""),
            (snap(11_000, ok, use_(3 * GIB)), "stop vllm[100]", ""),
        ],
    );
}

#[test]
fn budget_stopped_model_is_killed_after_max_stop() {
    let c = config(&format!(
        "[daemon]\nmax_stop = \"30s\"\n{}",
        model(
            "vllm",
            "ram = \"2GiB\"\naction = \"stop\"\ngrace = \"0s\"\n"
        )
    ));
    let a = || vec![proc(100, "vllm", 3 * GIB, 1), proc(101, "worker", GIB, 100)];
    let ok = Some(32 * GIB);
    let plans = play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, ok, a()), "stop vllm[100,101]", "budget_exceeded"),
            (snap(29_999, ok, a()), "", ""),
            (snap(30_000, ok, a()), "kill vllm[100,101]", ""),
            (snap(31_000, ok, a()), "", ""),
            (snap(32_000, ok, vec![]), "", "budget_cleared"),
        ],
    );
    assert_eq!(plans[2].actions[0].reason.kind, "max_stop");
}

#[test]
fn gpu_floor_picks_the_largest_holder_on_that_gpu() {
    let c = config("[gpu]\nmin_free = \"2GiB\"\n");
    // pid 300 is the biggest everywhere, but only on GPU 1.
    let procs = || {
        vec![
            proc(100, "vllm", GIB, 1),
            proc(200, "notebook", GIB, 1),
            proc(300, "trainer", 20 * GIB, 1),
        ]
    };
    let low = 3 * GIB / 2;
    let ok = 3 * GIB;
    let cases = [
        (low, ok, "terminate [100]", "floor_act"),
        (ok, low, "terminate [300]", "floor_act"),
        (
            low,
            low,
            "terminate [100]; terminate [300]",
            "floor_act, floor_act",
        ),
        (ok, ok, "", ""),
    ];
    for (free0, free1, want_acts, want_events) in cases {
        let s = |at| {
            gsnap(
                at,
                procs(),
                vec![
                    gpu(0, free0, &[(100, Some(8 * GIB)), (200, Some(4 * GIB))]),
                    gpu(1, free1, &[(300, Some(12 * GIB))]),
                ],
            )
        };
        let killed = want_acts.replace("terminate", "kill");
        let plans = play(
            &c,
            &mut PolicyState::default(),
            vec![
                (s(0), want_acts, want_events),
                (s(500), "", ""),
                (s(1000), killed.as_str(), ""),
            ],
        );
        for a in &plans[0].actions {
            assert_eq!(a.reason.kind, "gpu_floor");
            assert_eq!(a.recheck, None);
        }
    }
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

/// A model whose processes hold memory on two GPUs, both below their floor in one tick (found by
/// `gpuguard replay`): one SIGTERM, not one per GPU, and not another when the second GPU's
/// incident goes on; both incidents escalate to the one SIGKILL-worthy victim together.
#[test]
fn a_victim_short_on_two_gpus_at_once_gets_one_sigterm() {
    let c = config(&format!(
        "[daemon]\ncandidates = \"models\"\n[gpu]\nmin_free = \"12GiB\"\n{}",
        model("srv", "")
    ));
    let s = srv_on_two_gpus;
    let mut state = PolicyState::default();
    let plans = play(
        &c,
        &mut state,
        vec![
            (s(0), "terminate srv[100,101]", "floor_act, floor_act"),
            (s(100), "", ""),
        ],
    );
    assert_eq!(plans[0].actions.len(), 1);
    // Both incidents hold it, as terminated since the same moment.
    let stages: Vec<_> = state
        .incidents
        .values()
        .map(|i| (i.stage, i.stage_since, i.victim.is_some()))
        .collect();
    assert_eq!(
        stages,
        vec![(Stage::Terminated, Duration::ZERO, true); 2],
        "{:#?}",
        state.incidents
    );
}

/// Two GPU floors whose victims overlap without being the same (a user's largest process on
/// GPU 0; on GPU 1 it and another): the second signals only the process the first did not,
/// so sharing a process cannot keep the other from its signal (a hostile review found the
/// first version of the join above let it).
#[test]
fn overlapping_victims_of_two_floors_each_get_one_signal() {
    let c = config("[gpu]\nmin_free = \"2GiB\"\nwarn_free = \"3GiB\"\n");
    let procs = || vec![proc(100, "big", GIB, 1), proc(101, "other", GIB, 1)];
    let s = |at| {
        gsnap(
            at,
            procs(),
            vec![
                gpu(0, GIB, &[(100, Some(8 * GIB))]),
                gpu(1, GIB / 2, &[(100, Some(2 * GIB)), (101, Some(GIB))]),
            ],
        )
    };
    let mut state = PolicyState::default();
    let plan = decide(&c, &s(0), &mut state);
    let victims: Vec<_> = state
        .incidents
        .values()
        .map(|i| (i.stage, i.victim.clone()))
        .collect();
    assert_eq!(
        acts(&plan),
        "terminate [100]; terminate [101]",
        "{victims:#?}"
    );
}

/// On a GPU floor a non-root user is one candidate, ranked by the GPU memory of all its
/// processes outside the models, and gives back its largest processes until they cover what the
/// floor needs (to its warn floor), in one action; root's processes are ranked one by one.
#[test]
fn on_a_gpu_floor_a_user_is_ranked_by_its_sum_and_gives_back_what_the_floor_needs() {
    let c = config(&format!(
        "[daemon]\ncandidates = \"any\"\n[gpu]\nmin_free = \"2GiB\"\nwarn_free = \"3GiB\"\n{}",
        model("server", "")
    ));
    let user = |pid: i32| Process {
        uid: 2000,
        ..proc(pid, "spread", 256 * MIB, 1)
    };
    // GPU 0, 1.5 GiB free (1.5 GiB under the warn floor): the model holds 4 GiB, the user six
    // processes of 1 GiB. Ranked alone, the model would be the largest holder.
    let check = |procs: Vec<Process>, holders: &[(i32, Option<u64>)], want: &str| {
        let s = gsnap(0, procs, vec![gpu(0, 3 * GIB / 2, holders)]);
        let (plan, choice) = once_choosing(&c, &s, Resource::Gpu(0));
        assert_eq!(acts(&plan), want);
        choice
    };
    let mut procs = vec![proc(100, "server", GIB, 1)];
    procs.extend((1000..1006).map(user));
    let mut holders = vec![(100, Some(4 * GIB))];
    holders.extend((1000..1006).map(|pid| (pid, Some(GIB))));
    // Ranked by its sum (6 GiB in 6 processes); its 2 largest (2 GiB) cover the need.
    let (target, used, user_total) =
        victim_of(check(procs.clone(), &holders, "terminate [1000,1001]"));
    assert_eq!(
        (uids(&target), used, user_total),
        (vec![2000, 2000], 2 * GIB, Some((6 * GIB, 6)))
    );
    // Largest first: 2 GiB alone covers the 1.5 needed.
    check(
        procs.clone(),
        &[
            (100, Some(4 * GIB)),
            (1000, Some(GIB)),
            (1001, Some(2 * GIB)),
            (1002, Some(GIB + GIB / 2)),
        ],
        "terminate [1001]",
    );
    // A user that cannot cover the need in all (the rest is memory no listed process holds)
    // loses only its largest holder, as when ranked alone.
    let (target, used, user_total) = victim_of(check(
        procs.clone(),
        &[
            (100, Some(GIB)),
            (1000, Some(GIB / 2)),
            (1001, Some(GIB / 2)),
            (1002, Some(GIB / 4)),
        ],
        "terminate [1000]",
    ));
    assert_eq!(
        (uids(&target), used, user_total),
        (vec![2000], GIB / 2, Some((GIB + GIB / 4, 3)))
    );
    // A user holding less in all than the model is not chosen.
    check(
        procs.clone(),
        &[
            (100, Some(4 * GIB)),
            (1000, Some(GIB)),
            (1001, Some(2 * GIB)),
        ],
        "terminate server[100]",
    );
    // Root's processes are not summed: the model is the largest candidate.
    let rooted: Vec<Process> = procs
        .into_iter()
        .map(|p| if p.comm == "spread" { system(p) } else { p })
        .collect();
    check(rooted, &holders, "terminate server[100]");
}

/// The user's processes acted on together are one victim: a user that splits its GPU memory
/// over small processes cannot spend the GPU floor's brake one kill at a time.
#[test]
fn a_user_split_over_small_gpu_processes_is_one_victim_and_the_gpu_recovers() {
    let c = config(
        "[daemon]\ncandidates = \"any\"\n[gpu]\nmin_free = \"2GiB\"\nwarn_free = \"3GiB\"\nmax_victims = 1\n",
    );
    let procs: Vec<Process> = (1000..1010)
        .map(|pid| Process {
            uid: 2000,
            // Different commands: not one model loaded ten times (`duplicate_load`).
            cmdline: format!("/usr/bin/spread {pid}"),
            ..proc(pid, "spread", 256 * MIB, 1)
        })
        .collect();
    let holders: Vec<(i32, Option<u64>)> = (1000..1010).map(|pid| (pid, Some(GIB))).collect();
    let mut state = PolicyState::default();
    // 1 GiB free, 2 GiB under the warn floor: two of the ten, in one action.
    let plan = decide(
        &c,
        &gsnap(0, procs.clone(), vec![gpu(0, GIB, &holders)]),
        &mut state,
    );
    assert_eq!(
        (acts(&plan).as_str(), events(&plan).as_str()),
        ("terminate [1000,1001]", "floor_act")
    );
    // They are gone and gave their 2 GiB back: above the warn floor, the victim does not count.
    let plan = decide(
        &c,
        &gsnap(
            500,
            procs[2..].to_vec(),
            vec![gpu(0, 3 * GIB + MIB, &holders[2..])],
        ),
        &mut state,
    );
    assert!(said(&plan, EventKind::FloorCleared), "{}", events(&plan));
    assert!(state.floor_victims[&Resource::Gpu(0)].is_empty());
    assert!(state.braked.is_empty());
}

/// Not on the RAM floor: RSS counts pages shared after fork in every worker, so a user's
/// forked workers (summing to more than they hold) are not chosen before the process that
/// really took the memory.
#[test]
fn on_the_ram_floor_a_users_forked_workers_are_not_summed() {
    let c = config(&format!("{RAM_FLOORS}[daemon]\ncandidates = \"any\"\n"));
    let mut procs: Vec<Process> = (1000..1008)
        .map(|pid| proc(pid, "dataloader", 2 * GIB, 1))
        .collect();
    procs.push(Process {
        uid: 2000,
        ..proc(2000, "leak", 6 * GIB, 1)
    });
    assert_eq!(
        acts(&once(&c, &snap(0, Some(3 * GIB), procs))),
        "terminate [2000]"
    );
}

#[test]
fn gpu_budget_is_summed_over_the_model() {
    let c = config(
        "[[model]]\nname = \"vllm\"\nmatch = { cmdline = \"vllm serve\" }\nusers = [\"1000\"]\ngpu_memory = \"10GiB\"\naction = \"kill\"\ngrace = \"0s\"\n",
    );
    let procs = || {
        vec![
            Process {
                cmdline: "python3 -m vllm serve Qwen".into(),
                ..proc(100, "python3", 2 * GIB, 1)
            },
            Process {
                cmdline: "python3 -c from multiprocessing.spawn import spawn_main".into(),
                ..proc(101, "python3", GIB, 100)
            },
            proc(300, "trainer", GIB, 1),
        ]
    };
    let cases = [
        (
            6 * GIB,
            6 * GIB,
            "terminate vllm[100,101]",
            "budget_exceeded",
        ),
        (6 * GIB, 3 * GIB, "", ""),
    ];
    for (parent, child, want_acts, want_events) in cases {
        let devices = vec![
            gpu(0, 8 * GIB, &[(100, Some(parent)), (300, Some(8 * GIB))]),
            gpu(1, 8 * GIB, &[(101, Some(child))]),
        ];
        let mut state = PolicyState::default();
        let plans = play(
            &c,
            &mut state,
            vec![(gsnap(0, procs(), devices), want_acts, want_events)],
        );
        let usage = &state.attribution.models[0];
        assert_eq!(
            usage
                .gpu_bytes
                .iter()
                .map(|(i, b)| (*i, *b))
                .collect::<Vec<_>>(),
            [(0, parent), (1, child)]
        );
        assert_eq!(usage.gpu_total_bytes(), parent + child);
        for a in &plans[0].actions {
            assert_eq!(a.reason.kind, "gpu_budget");
        }
    }
}

#[test]
fn unavailable_gpu_memory_never_makes_a_victim() {
    let c = config("[gpu]\nmin_free = \"2GiB\"\n");
    let procs = || {
        vec![
            proc(100, "mystery", 30 * GIB, 1),
            proc(200, "notebook", GIB, 1),
        ]
    };
    let low = 3 * GIB / 2;
    let plan = once(
        &c,
        &gsnap(
            0,
            procs(),
            vec![gpu(0, low, &[(100, None), (200, Some(GIB))])],
        ),
    );
    assert_eq!(acts(&plan), "terminate [200]");
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (
                gsnap(0, procs(), vec![gpu(0, low, &[(100, None)])]),
                "",
                "floor_act, no_victim",
            ),
            (
                gsnap(500, procs(), vec![gpu(0, low, &[(100, None)])]),
                "",
                "",
            ),
        ],
    );
    // ...and makes a model's GPU figures a lower bound.
    let c = config(&model("mystery", ""));
    let mut state = PolicyState::default();
    decide(
        &c,
        &gsnap(0, procs(), vec![gpu(0, low, &[(100, None)])]),
        &mut state,
    );
    assert!(state.attribution.models[0].gpu_unknown);
    assert_eq!(state.attribution.models[0].gpu_total_bytes(), 0);
}

#[test]
fn stale_gpu_reading_alerts_only() {
    let c = config("[gpu]\nmin_free = \"2GiB\"\n");
    let procs = || vec![proc(100, "vllm", GIB, 1)];
    let low = 3 * GIB / 2;
    let s = |at, stale, holders: &[(i32, Option<u64>)]| {
        let mut s = gsnap(at, procs(), vec![gpu(0, low, holders)]);
        s.gpus.stale = stale;
        s
    };
    let holds = [(100, Some(8 * GIB))];
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (s(0, true, &holds), "", "floor_act, not_acting_stale"),
            (s(500, true, &holds), "", ""),
            (s(1000, false, &holds), "terminate [100]", ""),
        ],
    );
    // Having said "stale" does not silence "no victim" once the reading is fresh.
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (
                s(0, true, &[(100, None)]),
                "",
                "floor_act, not_acting_stale",
            ),
            (s(1000, false, &[(100, None)]), "", "no_victim"),
        ],
    );
}

#[test]
fn stale_gpu_reading_only_delays_a_budget() {
    let c = config(&model(
        "vllm",
        "gpu_memory = \"4GiB\"\naction = \"kill\"\ngrace = \"5s\"\n",
    ));
    let procs = || vec![proc(100, "vllm", GIB, 1)];
    let s = |at, stale| {
        let mut s = gsnap(at, procs(), vec![gpu(0, 8 * GIB, &[(100, Some(6 * GIB))])]);
        s.gpus.stale = stale;
        s
    };
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (s(0, false), "", "budget_exceeded"),
            (s(5000, true), "", ""),
            (s(5500, false), "terminate vllm[100]", ""),
        ],
    );
}

#[test]
fn stuck_gpu_memory_is_reported_not_killed_around() {
    let c = config("[gpu]\nmin_free = \"2GiB\"\nrelease_timeout = \"5s\"\n");
    let low = 3 * GIB / 2;
    let ab = || vec![proc(100, "vllm", GIB, 1), proc(200, "notebook", GIB, 1)];
    let b = || vec![proc(200, "notebook", GIB, 1)];
    // The victim has exited, but NVML still lists its pid with memory.
    let devices = || vec![gpu(0, low, &[(100, Some(8 * GIB)), (200, Some(2 * GIB))])];
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (gsnap(0, ab(), devices()), "terminate [100]", "floor_act"),
            (gsnap(1000, b(), devices()), "", ""),
            (gsnap(2000, b(), devices()), "", ""),
            (gsnap(5999, b(), devices()), "", ""),
            (gsnap(6000, b(), devices()), "", "stuck_memory"),
            (gsnap(7000, b(), devices()), "", ""),
            (gsnap(60_000, b(), devices()), "", ""),
        ],
    );
    // Round three: the victim's pid reused by a new process that holds GPU memory. That is not
    // the victim's memory stuck: the incident goes on to the next holder (the largest: the new
    // process itself).
    let reused = || {
        let mut new = proc(100, "new", GIB, 1);
        new.start_time += 1;
        vec![new, proc(200, "notebook", GIB, 1)]
    };
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (gsnap(0, ab(), devices()), "terminate [100]", "floor_act"),
            (gsnap(1000, reused(), devices()), "", ""),
            (gsnap(2000, reused(), devices()), "terminate [100]", ""),
        ],
    );
    // Released in time: on to the next holder.
    let released = || vec![gpu(0, low, &[(200, Some(2 * GIB))])];
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (gsnap(0, ab(), devices()), "terminate [100]", "floor_act"),
            (gsnap(1000, b(), devices()), "", ""),
            (gsnap(2000, b(), released()), "terminate [200]", ""),
        ],
    );
}

#[test]
fn sampling_interval_tightens_near_a_floor() {
    let c = config(RAM_FLOORS);
    let ms = Duration::from_millis;
    let protected = vec![system(proc(300, "sshd", 6 * GIB, 1))];
    let victims = vec![proc(100, "trainer", 6 * GIB, 1)];
    let cases = [
        // available, processes, next_interval, max_scan_age
        (60 * GIB, &victims, ms(1000), ms(5000)),
        // 4.5 GiB above min at 8 GiB/s: 562.5 ms.
        (
            8 * GIB + GIB / 2,
            &victims,
            Duration::from_micros(562_500),
            ms(5000),
        ),
        // In the warn band: 2 GiB above min: 250 ms, and scans at least every 100 ms.
        (6 * GIB, &victims, ms(250), ms(100)),
        (4 * GIB + 40 * MIB, &victims, ms(10), ms(100)),
        // Below min: SIGTERM to the trainer, then ticks every 2 ms to watch it.
        (3 * GIB, &victims, ms(2), ms(100)),
        // Below min with nobody chosen yet: rescan at once.
        (3 * GIB, &protected, ms(10), Duration::ZERO),
    ];
    for (available, procs, interval, scan_age) in cases {
        let plan = once(&c, &snap(0, Some(available), procs.clone()));
        assert_eq!(
            (plan.next_interval, plan.max_scan_age),
            (interval, scan_age),
            "{available}"
        );
    }

    // A GPU floor: 8 GiB above min_free at 32 GiB/s.
    let c = config("[gpu]\nmin_free = \"2GiB\"\n");
    let plan = once(&c, &gsnap(0, victims.clone(), vec![gpu(0, 10 * GIB, &[])]));
    assert_eq!((plan.next_interval, plan.max_scan_age), (ms(250), ms(5000)));

    // A model over budget: sampled fast, scanned often.
    let c = config(&model("trainer", "ram = \"1GiB\"\n"));
    let plan = once(&c, &snap(0, Some(60 * GIB), victims.clone()));
    assert_eq!((plan.next_interval, plan.max_scan_age), (ms(10), ms(100)));
}

#[test]
fn a_victim_that_cannot_be_signalled_is_passed_over_for_the_next() {
    let c = config(RAM_FLOORS);
    let procs = || {
        vec![
            proc(100, "trainer", 6 * GIB, 1),
            proc(200, "loader", 4 * GIB, 1),
        ]
    };
    let mut state = PolicyState::default();
    let first = evaluate(
        &c,
        &snap(0, Some(GIB), procs()),
        &Launches::default(),
        &mut state,
    );
    assert_eq!(first.actions[0].target.members[0].id.pid, 100);
    // The executor reports EPERM for pid 100.
    let refused = Outcome::Failed("permission denied".into());
    state.apply(&[Executed {
        action: first.actions[0].clone(),
        outcome: refused,
    }]);
    let second = decide(&c, &snap(10, Some(GIB), procs()), &mut state);
    assert_eq!(second.actions.len(), 1, "{:?}", second.actions);
    assert_eq!(
        second.actions[0].target.members[0].id.pid, 200,
        "the next largest, not the one that failed"
    );
}

#[test]
fn a_model_restarted_after_a_budget_kill_gets_a_new_grace_and_round() {
    let c = config("[[model]]\nname = \"m\"\nmatch = { comm = \"trainer\" }\nusers = [\"1000\"]\nram = \"1GiB\"\naction = \"kill\"\ngrace = \"1s\"\n");
    let mut state = PolicyState::default();
    let old = || vec![proc(100, "trainer", 2 * GIB, 1)];
    let new = || vec![proc(300, "trainer", 2 * GIB, 1)];
    let verbs = |p: &Plan| {
        p.actions
            .iter()
            .map(|a| format!("{} {}", a.verb.as_str(), a.target.members[0].id.pid))
            .collect::<Vec<_>>()
    };
    assert!(verbs(&decide(&c, &snap(0, Some(20 * GIB), old()), &mut state)).is_empty());
    assert_eq!(
        verbs(&decide(&c, &snap(1000, Some(20 * GIB), old()), &mut state)),
        ["terminate 100"]
    );
    // Its supervisor restarted it, still over budget: a new grace, then a new terminate.
    assert!(verbs(&decide(&c, &snap(1500, Some(20 * GIB), new()), &mut state)).is_empty());
    assert!(verbs(&decide(&c, &snap(2000, Some(20 * GIB), new()), &mut state)).is_empty());
    assert_eq!(
        verbs(&decide(&c, &snap(2600, Some(20 * GIB), new()), &mut state)),
        ["terminate 300"]
    );
}

/// A victim of 6 GiB (pid 100) whose RSS is `rss`, with a bystander of 4 GiB.
fn term_victims(rss: u64) -> Vec<Process> {
    vec![
        proc(100, "trainer", rss, 1),
        proc(200, "loader", 4 * GIB, 1),
    ]
}

fn verbs(plan: &Plan) -> Vec<&'static str> {
    plan.actions.iter().map(|a| a.verb.as_str()).collect()
}

#[test]
fn a_victim_that_grows_after_sigterm_is_killed_at_once() {
    let c = config(RAM_FLOORS);
    let mut state = PolicyState::default();
    let at = |ms, rss| snap(ms, Some(3 * GIB), term_victims(rss));
    let first = decide(&c, &at(0, 6 * GIB), &mut state);
    assert_eq!(verbs(&first), ["terminate"]);
    assert_eq!(
        first.next_interval,
        Duration::from_millis(2),
        "watched closely while it has SIGTERM"
    );
    // The first reading after SIGTERM is the baseline: growth before the signal (the table was
    // older than the signal) is not held against it.
    assert!(verbs(&decide(&c, &at(2, 6 * GIB + 512 * MIB), &mut state)).is_empty());
    // A little growth is noise (a process shutting down may still touch some memory)...
    assert!(verbs(&decide(&c, &at(4, 6 * GIB + 516 * MIB), &mut state)).is_empty());
    assert_eq!(
        state.incidents[&Resource::Ram].term_baseline,
        Some(TermBaseline {
            stage_since: Duration::ZERO,
            bytes: 6 * GIB + 512 * MIB
        })
    );
    // ...more than term_max_growth (8 MiB: 20 MiB over the baseline here) is a victim ignoring
    // SIGTERM, long before term_grace, and not far below the floor: its growth is why.
    assert!(c.daemon.term_grace > Duration::from_millis(6));
    assert!(!reading(&c, &at(6, 0), Resource::Ram).far_below());
    let plan = decide(&c, &at(6, 6 * GIB + 532 * MIB), &mut state);
    assert_eq!(acts(&plan), "kill [100]");
    assert_eq!(plan.actions[0].reason.kind, ReasonKind::RamFloor);
    assert_eq!(
        plan.actions[0].after_term,
        Some(floors::AfterTerm::Grew(20 * MIB))
    );
    assert!(verbs(&decide(&c, &at(8, 7 * GIB), &mut state)).is_empty());
}

/// RAM wobbling around the act floor while the victim shuts down (it stopped growing right at
/// the floor): each dip is a new incident, but the victim keeps its one SIGTERM (a second tells
/// many servers to quit without cleaning up) and its grace, and is not a new victim for the
/// brake.
#[test]
fn a_victim_shutting_down_gets_one_sigterm_while_ram_wobbles_around_the_floor() {
    let c = config(&format!("[daemon]\nterm_grace = \"10s\"\n{RAM_FLOORS}"));
    let below = |ms| snap(ms, Some(4 * GIB - MIB), term_victims(6 * GIB));
    let above = |ms| snap(ms, Some(4 * GIB + MIB), term_victims(6 * GIB));
    let mut state = PolicyState::default();
    let plans = play(
        &c,
        &mut state,
        vec![
            (below(0), "terminate [100]", "floor_act"),
            (above(500), "", "incident_closed"),
            (below(1000), "", "floor_act"),
            (above(1500), "", "incident_closed"),
            (below(2000), "", "floor_act"),
            (below(9_999), "", ""),
            // term_grace counts from the one SIGTERM, not from the latest dip.
            (below(10_000), "kill [100]", ""),
        ],
    );
    assert_eq!(
        plans[6].actions[0].after_term,
        Some(floors::AfterTerm::GraceOver)
    );
    assert_eq!(state.floor_victims[&Resource::Ram].len(), 1);
    // Past its grace, a process chosen by a later incident is a new round: SIGTERM again.
    let mut state = PolicyState::default();
    play(
        &c,
        &mut state,
        vec![
            (below(0), "terminate [100]", "floor_act"),
            (above(500), "", "incident_closed"),
            (below(10_000), "terminate [100]", "floor_act"),
        ],
    );
}

#[test]
fn a_victim_shutting_down_keeps_its_grace_while_memory_falls_elsewhere() {
    let c = config(&format!(
        "[daemon]\nterm_max_growth = \"1MiB\"\n{RAM_FLOORS}"
    ));
    let mut state = PolicyState::default();
    let at = |ms, avail, rss| snap(ms, Some(avail), term_victims(rss));
    assert_eq!(
        verbs(&decide(&c, &at(0, 3 * GIB, 6 * GIB), &mut state)),
        ["terminate"]
    );
    // Someone else keeps taking memory (still above half the floor) while the victim shrinks:
    // it is shutting down, it keeps its term_grace.
    for (ms, avail, rss) in [
        (2, 3 * GIB - 200 * MIB, 6 * GIB),
        (500, 2 * GIB + 512 * MIB, 5 * GIB),
        (999, 2 * GIB + 100 * MIB, 4 * GIB),
    ] {
        assert!(
            verbs(&decide(&c, &at(ms, avail, rss), &mut state)).is_empty(),
            "{ms} ms"
        );
    }
    // It shrank from its baseline: not its growth, term_grace (1 s) running out is why.
    assert_eq!(
        state.incidents[&Resource::Ram]
            .term_baseline
            .map(|b| b.bytes),
        Some(6 * GIB)
    );
    assert_eq!(c.daemon.term_grace, Duration::from_secs(1));
    let plan = decide(&c, &at(1000, 2 * GIB + 100 * MIB, 4 * GIB), &mut state);
    assert_eq!(acts(&plan), "kill [100]");
    assert_eq!(plan.actions[0].reason.kind, ReasonKind::RamFloor);
    assert_eq!(
        plan.actions[0].after_term,
        Some(floors::AfterTerm::GraceOver)
    );
}

// ---- Faults and bad values (issue #13): an untrusted reading may alert, never act. ----------

/// One GPU floor, RAM floors off, stop as the floor action with a short max_stop.
const GPU_STOP: &str = "[gpu]\nmin_free = \"2GiB\"\nwarn_free = \"3GiB\"\naction = \"stop\"\n[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n[daemon]\nmax_stop = \"10s\"\nsettle = \"60s\"\n";

#[test]
fn inconsistent_gpu_readings_are_unknown_and_never_act() {
    let c = config("[gpu]\nmin_free = \"2GiB\"\n");
    let procs = || vec![proc(100, "vllm", GIB, 1)];
    let holds = [(100, Some(8 * GIB))];
    let used_over_total = Gpu {
        used_bytes: Some(20 * GIB),
        free_bytes: Some(0),
        ..gpu(0, 0, &holds)
    };
    let process_over_total = gpu(0, GIB, &[(100, Some(40 * GIB))]);
    let sum_far_from_total = Gpu {
        used_bytes: Some(GIB),
        free_bytes: Some(GIB),
        ..gpu(0, GIB, &holds)
    };
    let free_over_total = Gpu {
        used_bytes: None,
        free_bytes: Some(17 * GIB),
        ..gpu(0, GIB, &holds)
    };
    for (name, bad) in [
        ("used > total", used_over_total),
        ("process > total", process_over_total),
        ("used + free far from total", sum_far_from_total),
        ("free > total", free_over_total),
    ] {
        assert!(bad.inconsistency().is_some(), "{name}");
        let mut state = PolicyState::default();
        for at in [0, 100, 200] {
            let s = gsnap(at, procs(), vec![bad.clone()]);
            let plan = decide(&c, &s, &mut state);
            assert_eq!(acts(&plan), "", "{name}");
            // Unknown because of the inconsistency, said about GPU 0.
            let r = reading(&c, &s, Resource::Gpu(0));
            assert_eq!(
                (r.available, r.error),
                (None, bad.inconsistency()),
                "{name}"
            );
            if at == 0 {
                assert_eq!(events(&plan), "reading_unknown", "{name}");
                assert_eq!(plan.events[0].about.resource, Some(Resource::Gpu(0)));
            }
        }
    }
    // Within the slack (1/64 of the total) a reading is consistent.
    let close = Gpu {
        used_bytes: Some(15 * GIB),
        free_bytes: Some(GIB - 100 * MIB),
        ..gpu(0, GIB, &holds)
    };
    assert_eq!(close.inconsistency(), None);
    // A process above the total also makes the GPU's usage unknown for budgets.
    let c = config(&model(
        "vllm",
        "gpu_memory = \"4GiB\"\naction = \"kill\"\ngrace = \"0s\"\n",
    ));
    let plan = once(
        &c,
        &gsnap(0, procs(), vec![gpu(0, GIB, &[(100, Some(40 * GIB))])]),
    );
    assert_eq!(acts(&plan), "");
}

#[test]
fn mem_available_above_mem_total_is_unknown() {
    let c = config(RAM_FLOORS);
    let mut s = snap(0, Some(GIB), vec![proc(100, "trainer", 6 * GIB, 1)]);
    s.host.total_bytes = Some(512 * MIB);
    let plan = once(&c, &s);
    assert_eq!(
        (acts(&plan).as_str(), events(&plan).as_str()),
        ("", "reading_unknown")
    );
    let r = reading(&c, &s, Resource::Ram);
    assert!(s.host.inconsistency().is_some());
    assert_eq!((r.available, r.error), (None, s.host.inconsistency()));
}

#[test]
fn a_floor_at_or_above_the_total_is_not_enforced() {
    // What the config checks refuse, should it get through (a GPU seen only later).
    let c = config("[gpu]\nmin_free = \"20GiB\"\n");
    let s = gsnap(
        0,
        vec![proc(100, "vllm", GIB, 1)],
        vec![gpu(0, 8 * GIB, &[(100, Some(8 * GIB))])],
    );
    let plan = once(&c, &s);
    assert_eq!(
        (acts(&plan).as_str(), events(&plan).as_str()),
        ("", "reading_unknown")
    );
    // The GPU's reading is fine: the floor, at or above its 16 GiB, is what is unknown.
    assert_eq!(s.gpus.devices[0].untrusted(), None);
    let r = reading(&c, &s, Resource::Gpu(0));
    assert_eq!((r.available, r.min), (None, Some(20 * GIB)));
    assert!(r.error.is_some());
}

/// The floor events follow the floor's level, `unknown` included, not whether a floor is
/// crossed (what the conditions in src/daemon/alerts.rs report): a reading that turns unknown and
/// comes back clears the floor although none was crossed, a crossed floor whose reading turns
/// unknown is not cleared, and easing from act to warn says nothing. (Why the conditions do not
/// write these events: src/daemon/alerts.rs's module doc.)
#[test]
fn floor_events_follow_the_level_unknown_included() {
    let c = config("[gpu]\nmin_free = \"2GiB\"\nwarn_free = \"3GiB\"\n[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n");
    let at = |free| vec![gpu(0, free, &[])];
    let lost = || {
        vec![Gpu {
            error: Some("GPU is lost".into()),
            lost: true,
            ..gpu(0, 8 * GIB, &[])
        }]
    };
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (gsnap(0, vec![], at(8 * GIB)), "", ""),
            (gsnap(1000, vec![], lost()), "", "reading_unknown"),
            (gsnap(2000, vec![], at(8 * GIB)), "", "floor_cleared"),
            (gsnap(3000, vec![], at(GIB)), "", "floor_act, no_victim"),
            (gsnap(4000, vec![], lost()), "", "reading_unknown"),
            (gsnap(5000, vec![], at(5 * GIB / 2)), "", "floor_warn"),
            (gsnap(6000, vec![], at(GIB)), "", "floor_act, no_victim"),
            (gsnap(7000, vec![], at(5 * GIB / 2)), "", ""),
            (gsnap(8000, vec![], at(8 * GIB)), "", "floor_cleared"),
        ],
    );
}

#[test]
fn below_a_floor_before_the_first_process_scan_waits_for_it_instead_of_saying_no_victim() {
    // Seen on a real H100: the daemon started with the GPU below min_free, and its first tick
    // (no process scan yet) raised a critical `no_victim` 82 ms before it chose the victim.
    let c = config("[gpu]\nmin_free = \"2GiB\"\n");
    let unscanned = |at_ms| Snapshot {
        processes: ProcessTable::default(),
        ..gsnap(at_ms, vec![], vec![gpu(0, GIB, &[(100, Some(4 * GIB))])])
    };
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (unscanned(0), "", "floor_act"),
            (
                gsnap(
                    100,
                    vec![proc(100, "python3", GIB, 1)],
                    vec![gpu(0, GIB, &[(100, Some(4 * GIB))])],
                ),
                "terminate [100]",
                "",
            ),
        ],
    );
}

#[test]
fn a_stopped_victim_is_resumed_at_max_stop_when_its_gpu_is_lost() {
    let c = config(GPU_STOP);
    let procs = || vec![proc(100, "vllm", GIB, 1)];
    let low = || gpu(0, GIB, &[(100, Some(8 * GIB))]);
    let lost = || Gpu {
        error: Some("GPU is lost".into()),
        lost: true,
        ..low()
    };
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (gsnap(0, procs(), vec![low()]), "stop [100]", "floor_act"),
            (gsnap(1000, procs(), vec![lost()]), "", "reading_unknown"),
            (gsnap(9999, procs(), vec![lost()]), "", ""),
            // max_stop: resumed, not killed, although the floor was crossed when it was stopped.
            (gsnap(10000, procs(), vec![lost()]), "resume [100]", ""),
            (gsnap(20000, procs(), vec![lost()]), "", ""),
        ],
    );
    // The GPU vanishes from NVML's list altogether: the same.
    let plans = play(
        &c,
        &mut PolicyState::default(),
        vec![
            (gsnap(0, procs(), vec![low()]), "stop [100]", "floor_act"),
            (gsnap(1000, procs(), vec![]), "", "reading_unknown"),
            (gsnap(10000, procs(), vec![]), "resume [100]", ""),
        ],
    );
    assert_eq!(plans[2].actions[0].reason.kind, "max_stop");
    // What it was resumed on: a GPU 0 reading that may not act (NVML no longer lists it).
    let r = reading(&c, &gsnap(10000, procs(), vec![]), Resource::Gpu(0));
    assert_eq!((r.available, r.may_act), (None, false));
}

#[test]
fn a_stopped_victim_is_resumed_at_max_stop_when_its_gpu_reading_goes_stale() {
    let c = config(GPU_STOP);
    let procs = || vec![proc(100, "vllm", GIB, 1)];
    let s = |at, stale| {
        let mut s = gsnap(at, procs(), vec![gpu(0, GIB, &[(100, Some(8 * GIB))])]);
        s.gpus.stale = stale;
        s
    };
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (s(0, false), "stop [100]", "floor_act"),
            (s(1000, true), "", "not_acting_stale"),
            (s(10000, true), "resume [100]", ""),
        ],
    );
}

#[test]
fn a_held_process_is_resumed_not_killed_at_max_stop_on_an_unknown_reading() {
    let c = config(GPU_STOP);
    let procs = || vec![proc(100, "vllm", GIB, 1)];
    let holds = [(100, Some(8 * GIB))];
    let mut state = PolicyState::default();
    play(
        &c,
        &mut state,
        vec![
            (
                gsnap(0, procs(), vec![gpu(0, GIB, &holds)]),
                "stop [100]",
                "floor_act",
            ),
            // Between the floors: the incident closes, the victim is held.
            (
                gsnap(1000, procs(), vec![gpu(0, 5 * GIB / 2, &holds)]),
                "",
                "incident_closed",
            ),
            (gsnap(2000, procs(), vec![]), "", "reading_unknown"),
            (gsnap(10000, procs(), vec![]), "resume [100]", ""),
        ],
    );
    assert!(state.held.is_empty());
    // With a reading that may act and is still below warn, max_stop kills as before.
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (
                gsnap(0, procs(), vec![gpu(0, GIB, &holds)]),
                "stop [100]",
                "floor_act",
            ),
            (
                gsnap(1000, procs(), vec![gpu(0, 5 * GIB / 2, &holds)]),
                "",
                "incident_closed",
            ),
            (
                gsnap(10000, procs(), vec![gpu(0, 5 * GIB / 2, &holds)]),
                "kill [100]",
                "",
            ),
        ],
    );
}

#[test]
fn a_budget_stop_is_resumed_not_killed_at_max_stop_on_a_stale_gpu_reading() {
    let c = config(&format!(
        "[daemon]\nmax_stop = \"10s\"\n{}",
        model(
            "vllm",
            "gpu_memory = \"4GiB\"\naction = \"stop\"\ngrace = \"0s\"\n"
        )
    ));
    let procs = || vec![proc(100, "vllm", GIB, 1)];
    let s = |at, stale| {
        let mut s = gsnap(at, procs(), vec![gpu(0, 4 * GIB, &[(100, Some(8 * GIB))])]);
        s.gpus.stale = stale;
        s
    };
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (s(0, false), "stop vllm[100]", "budget_exceeded"),
            (s(5000, true), "", ""),
            (s(10000, true), "resume vllm[100]", ""),
            // Still stale: not stopped again.
            (s(11000, true), "", ""),
        ],
    );
}

/// A weights file mapped whole.
fn weights_file(inode: u64) -> crate::snapshot::MappedFile {
    crate::snapshot::MappedFile {
        path: format!("/models/m/model-{inode}.safetensors"),
        device: "fd:01".into(),
        inode,
        mapped_bytes: 4 * GIB,
    }
}

#[test]
fn spawned_workers_mapping_the_same_weights_on_one_gpu_are_reported_once() {
    let c = config(&model("server", ""));
    // A server (matched) and two spawn-started workers: their command lines are the
    // multiprocessing bootstrap, not the server's, and they are its children.
    let spawn = "python3 -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7) --multiprocessing-fork";
    let procs = vec![
        proc(100, "server", GIB, 1),
        Process {
            cmdline: spawn.into(),
            ..proc(101, "python3", GIB, 100)
        },
        Process {
            cmdline: format!("{spawn} x"),
            ..proc(102, "python3", GIB, 100)
        },
    ];
    let mapped = |pids: &[i32]| {
        pids.iter()
            .map(|&p| (p, vec![weights_file(7), weights_file(8)]))
            .collect()
    };
    let step = |at: u64, gpu0: &[(i32, Option<u64>)], gpu1: &[(i32, Option<u64>)]| {
        let mut s = gsnap(
            at,
            procs.clone(),
            vec![gpu(0, 4 * GIB, gpu0), gpu(1, 8 * GIB, gpu1)],
        );
        s.mapped_weights = mapped(&[100, 101, 102]);
        s
    };
    let mut state = PolicyState::default();
    let plans = play(
        &c,
        &mut state,
        vec![
            // 100 and 101 on GPU 0 both map model-7 and model-8: one report, not one per file.
            (
                step(
                    0,
                    &[(100, Some(4 * GIB)), (101, Some(4 * GIB))],
                    &[(102, Some(4 * GIB))],
                ),
                "",
                "duplicate_load",
            ),
            // Still there: not reported again.
            (
                step(
                    100,
                    &[(100, Some(4 * GIB)), (101, Some(4 * GIB))],
                    &[(102, Some(4 * GIB))],
                ),
                "",
                "",
            ),
            // Tensor-parallel-like: one process per GPU mapping the same files is not waste.
            (
                step(200, &[(101, Some(4 * GIB))], &[(102, Some(4 * GIB))]),
                "",
                "",
            ),
            // A process that maps the weights but holds no GPU memory on GPU 0 is not counted.
            (
                step(300, &[(101, Some(4 * GIB)), (100, Some(0))], &[]),
                "",
                "",
            ),
        ],
    );
    // What the first tick reported: the two on GPU 0, by both files, holding 8 GiB together.
    let first = step(
        0,
        &[(100, Some(4 * GIB)), (101, Some(4 * GIB))],
        &[(102, Some(4 * GIB))],
    );
    let (plan, found) = duplicates_said(&c, &first);
    assert_eq!(plan.events, plans[0].events);
    assert_eq!(
        found,
        [waste::Duplicate {
            gpu: 0,
            rule: waste::Rule::SameWeights {
                files: vec![weights_file(7), weights_file(8)]
            },
            pids: vec![100, 101],
            held: 8 * GIB,
        }]
    );
    assert_eq!(plans[0].events[0].about.model.as_deref(), Some("server"));
}

/// Round three: another account's process that maps a model's weights file (any user may read
/// it) on the same GPU made the duplicate warning blame the model, anew each time the attacker
/// restarted. Only processes of one uid are one load twice.
#[test]
fn another_accounts_process_mapping_a_models_weights_is_not_a_duplicate_of_it() {
    let c = config(&model("server", ""));
    let attacker = Process {
        uid: 1001,
        ..proc(200, "python3", GIB, 1)
    };
    let mut s = gsnap(
        0,
        vec![proc(100, "server", GIB, 1), attacker],
        vec![gpu(0, 4 * GIB, &[(100, Some(4 * GIB)), (200, Some(GIB))])],
    );
    s.mapped_weights = [100, 200]
        .into_iter()
        .map(|p| (p, vec![weights_file(7)]))
        .collect();
    let plan = once(&c, &s);
    assert_eq!(events(&plan), "", "{:#?}", plan.events);
}

#[test]
fn identical_commands_already_reported_by_their_weights_are_not_reported_twice() {
    let c = config("");
    // Two unrelated processes with one command line, both mapping the same file.
    let procs = vec![proc(200, "vllm", GIB, 1), proc(201, "vllm", GIB, 1)];
    let mut s = gsnap(
        0,
        procs,
        vec![gpu(
            0,
            4 * GIB,
            &[(200, Some(4 * GIB)), (201, Some(4 * GIB))],
        )],
    );
    let (plan, found) = duplicates_said(&c, &s);
    assert_eq!(events(&plan), "duplicate_load");
    assert_eq!(
        found,
        [waste::Duplicate {
            gpu: 0,
            rule: waste::Rule::SameCommand {
                cmdline: "/usr/bin/vllm".into()
            },
            pids: vec![200, 201],
            held: 8 * GIB,
        }]
    );
    s.mapped_weights = [(200, vec![weights_file(9)]), (201, vec![weights_file(9)])].into();
    let (plan, found) = duplicates_said(&c, &s);
    assert_eq!(events(&plan), "duplicate_load", "{:#?}", plan.events);
    assert_eq!(
        found,
        [waste::Duplicate {
            gpu: 0,
            rule: waste::Rule::SameWeights {
                files: vec![weights_file(9)]
            },
            pids: vec![200, 201],
            held: 8 * GIB,
        }]
    );
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

/// The package test's index panic: membership read against a table that changed since it was
/// worked out (same scan, processes gone and come) is by identity, so nothing indexes past the
/// table and nobody else is targeted.
#[test]
fn membership_is_by_identity_not_by_position_in_the_table() {
    let c = config(&format!("{RAM_FLOORS}{}", model("vllm", "")));
    let mut state = PolicyState::default();
    let table = vec![
        proc(50, "idle", GIB, 1),
        proc(100, "vllm", 2 * GIB, 1),
        proc(101, "worker", GIB, 100),
    ];
    decide(&c, &snap(0, Some(32 * GIB), table), &mut state);
    // Same scan time (the attribution is kept), fewer and other processes.
    let mut changed = snap(0, Some(GIB), vec![proc(101, "worker", GIB, 100)]);
    changed.at = Duration::from_millis(10);
    let plan = decide(&c, &changed, &mut state);
    assert_eq!(acts(&plan), "terminate vllm[101]");
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

/// The red-team cascade: memory no process holds (a tmpfs file whose writer has exited) keeps
/// RAM under the floor; each kill lifts it a little (above the act floor, never above the warn
/// floor), the incident closes, the next crossing opens another. The brake counts those victims
/// across incidents: at `max_victims` within `victim_window` it stops acting and says so once
/// (critical, naming Shmem), whatever the re-crossings. It does not release on time alone: not
/// while RAM is short past the window, not when RAM is back above the warn floor within the
/// window, only on a reading above the warn floor once the window has passed (info event).
#[test]
fn the_brake_caps_a_cascade_and_releases_only_above_the_warn_floor_after_the_window() {
    let c = config(&format!(
        "{RAM_FLOORS}max_victims = 2\nvictim_window = \"1m\"\n"
    ));
    let all = [
        proc(100, "a", 800 * MIB, 1),
        proc(200, "b", 600 * MIB, 1),
        proc(300, "c", 400 * MIB, 1),
        proc(400, "d", 200 * MIB, 1),
    ];
    let from =
        |pid: i32| -> Vec<Process> { all.iter().filter(|p| p.pid >= pid).cloned().collect() };
    let low = Some(3 * GIB);
    // Above the act floor (4 GiB), under the warn floor (8 GiB): the kills did not end it.
    let lifted = Some(5 * GIB);
    let ok = Some(9 * GIB);
    // Shmem does not move (written before the daemon looked): only the brake stops the cascade.
    let s = |at, available, procs| with_shmem(snap(at, available, procs), 10 * GIB);
    let mut state = PolicyState::default();
    let plans = play(
        &c,
        &mut state,
        vec![
            (s(0, low, from(100)), "terminate [100]", "floor_act"),
            // Its death lifts RAM above the act floor: the incident is over after one victim...
            (s(100, lifted, from(200)), "", "incident_closed"),
            // ...and the next crossing is a new incident, which may act again: a second victim.
            (s(200, low, from(200)), "terminate [200]", "floor_act"),
            (s(300, lifted, from(300)), "", "incident_closed"),
            // A third crossing within the window: the brake holds, said once.
            (s(400, low, from(300)), "", "floor_act, floor_brake"),
            (s(500, low, from(300)), "", ""),
            // Recovering and crossing again does not reset the count.
            (s(600, lifted, from(300)), "", ""),
            (s(700, low, from(300)), "", "floor_act"),
            // Back above the warn floor within the window: the brake still holds...
            (s(800, ok, from(300)), "", "floor_cleared"),
            (s(900, low, from(300)), "", "floor_act"),
            (s(59_999, low, from(300)), "", ""),
            // ...and so it does past the window while RAM is still short (the tmpfs file is
            // still there: the old brake let the cascade resume here)...
            (s(60_000, low, from(300)), "", ""),
            (s(120_000, low, from(300)), "", ""),
            (s(121_000, lifted, from(300)), "", ""),
            // ...until RAM reads above its warn floor after the window: released.
            (s(122_000, ok, from(300)), "", "floor_brake, floor_cleared"),
            // A new incident starts a fresh count: two victims, then the brake holds anew.
            (s(123_000, low, from(300)), "terminate [300]", "floor_act"),
            (s(123_100, low, from(400)), "", ""),
            (s(124_100, low, from(400)), "terminate [400]", ""),
            (s(124_200, low, vec![]), "", ""),
            (s(125_200, low, vec![]), "", "floor_brake"),
        ],
    );
    assert_eq!(plans[4].events[1].severity, Severity::Critical);
    // What engaged it: the 2 victims within the 1 minute window (the first 400 ms ago), with
    // Shmem at 10 GiB. The same ticks again, up to the choice.
    let mut again = PolicyState::default();
    for (at, available, pids) in [
        (0, low, 100),
        (100, lifted, 200),
        (200, low, 200),
        (300, lifted, 300),
    ] {
        decide(&c, &s(at, available, from(pids)), &mut again);
    }
    match ram_choice(&c, &s(400, low, from(300)), &mut again) {
        floors::Choice::Braked(Some(b)) => assert_eq!(
            (b.victims, b.max_victims, b.window, b.left, b.shmem),
            (
                2,
                2,
                Duration::from_secs(60),
                Duration::from_millis(59_600),
                Some(10 * GIB)
            )
        ),
        other => panic!("{other:?}"),
    }
    // While braked, no rush to rescan for a victim it will not take.
    assert_eq!(plans[5].max_scan_age, NEAR_FLOOR_SCAN_AGE);
    let released = &plans[14].events[0];
    assert_eq!(
        (released.kind, released.severity, released.about.resource),
        (EventKind::FloorBrake, Severity::Info, Some(Resource::Ram))
    );
    assert_eq!(plans[19].events[0].severity, Severity::Critical);
    assert!(state.braked.contains(&Resource::Ram));
}

/// Kills after which RAM came back above its warn floor helped: they do not count towards the
/// brake. The red team's brake exhaustion (an attacker's own processes crossing the floor one
/// after another, each kill giving its memory back) uses nothing up, and the next hog is still
/// acted on; with `max_victims = 2`, five such victims in a row are all taken.
#[test]
fn victims_whose_kill_lifted_ram_above_the_warn_floor_do_not_count_towards_the_brake() {
    let c = config(&format!(
        "{RAM_FLOORS}max_victims = 2\nvictim_window = \"1m\"\n"
    ));
    let mut state = PolicyState::default();
    for (i, pid) in [100, 200, 300, 400, 500].into_iter().enumerate() {
        let at = i as u64 * 1000;
        let hog = vec![proc(pid, "sacrifice", 3 * GIB, 1)];
        let plan = decide(&c, &snap(at, Some(3 * GIB), hog), &mut state);
        assert_eq!(
            (acts(&plan), events(&plan)),
            (format!("terminate [{pid}]"), "floor_act".to_string())
        );
        assert_eq!(state.floor_victims[&Resource::Ram].len(), 1);
        // It is gone and gave its 3 GiB back: RAM is above the warn floor.
        let plan = decide(&c, &snap(at + 500, Some(9 * GIB), vec![]), &mut state);
        assert!(said(&plan, EventKind::FloorCleared), "{}", events(&plan));
        assert!(state.floor_victims[&Resource::Ram].is_empty());
    }
    assert!(state.braked.is_empty());
}

/// An action the executor skipped (the victim had gone, RAM recovered) or could not carry out
/// signalled nobody: it does not count towards the brake. One carried out does.
#[test]
fn only_victims_actually_acted_on_count_towards_the_brake() {
    let c = config(&format!("{RAM_FLOORS}max_victims = 1\n"));
    let procs = || vec![proc(100, "a", 800 * MIB, 1), proc(200, "b", 600 * MIB, 1)];
    let mut state = PolicyState::default();
    let none = Launches::default();
    let plan = evaluate(&c, &snap(0, Some(3 * GIB), procs()), &none, &mut state);
    assert_eq!(acts(&plan), "terminate [100]");
    state.apply(&carried(
        &plan,
        Outcome::Skipped("target has exited".into()),
    ));
    assert!(
        !state.floor_victims.contains_key(&Resource::Ram)
            || state.floor_victims[&Resource::Ram].is_empty()
    );
    let plan = evaluate(&c, &snap(100, Some(3 * GIB), procs()), &none, &mut state);
    assert_eq!(
        acts(&plan),
        "terminate [100]",
        "not braked: nothing was signalled"
    );
    state.apply(&carried(&plan, Outcome::Done));
    assert_eq!(state.floor_victims[&Resource::Ram].len(), 1);
    let gone = vec![proc(200, "b", 600 * MIB, 1)];
    decide(&c, &snap(200, Some(3 * GIB), gone.clone()), &mut state);
    let plan = decide(&c, &snap(1200, Some(3 * GIB), gone), &mut state);
    assert_eq!(
        (acts(&plan).as_str(), events(&plan).as_str()),
        ("", "floor_brake")
    );
}

/// `max_victims = 0` turns the brake off: the cascade runs as before.
#[test]
fn max_victims_zero_turns_the_brake_off() {
    let c = config(&format!("{RAM_FLOORS}max_victims = 0\n"));
    let mut state = PolicyState::default();
    for (i, pid) in [100, 200, 300, 400].into_iter().enumerate() {
        let at = i as u64 * 200;
        let procs: Vec<Process> = [100, 200, 300, 400]
            .into_iter()
            .filter(|&p| p >= pid)
            .map(|p| proc(p, "x", (1000 - p as u64) * MIB, 1))
            .collect();
        let plan = decide(&c, &snap(at, Some(3 * GIB), procs.clone()), &mut state);
        assert_eq!(acts(&plan), format!("terminate [{pid}]"));
        let rest: Vec<Process> = procs.into_iter().filter(|p| p.pid != pid).collect();
        decide(&c, &snap(at + 100, Some(5 * GIB), rest), &mut state);
    }
}

/// RAM falls under the act floor while Shmem grew by more than the shortfall since RAM was last
/// above its warn floor: the missing memory is in tmpfs or shared memory that no process holds.
/// A critical `shmem_shortfall` names it and nobody is killed for it, except a candidate whose
/// own memory alone lifts RAM back above the warn floor. The floor alert says how much is Shmem.
#[test]
fn shmem_growth_beyond_the_shortfall_alerts_and_does_not_kill() {
    let c = config(RAM_FLOORS);
    let small = || vec![proc(100, "a", 800 * MIB, 1), proc(200, "b", 600 * MIB, 1)];
    let mut state = PolicyState::default();
    let plans = play(
        &c,
        &mut state,
        vec![
            // Above the warn floor: Shmem 1 GiB is the baseline.
            (with_shmem(snap(0, Some(16 * GIB), small()), GIB), "", ""),
            // 3.5 GiB written to /dev/shm by a process since gone: 1 GiB short of the act floor.
            (
                with_shmem(snap(100, Some(3 * GIB), small()), 4 * GIB + GIB / 2),
                "",
                "floor_act, shmem_shortfall",
            ),
            (
                with_shmem(snap(200, Some(3 * GIB), small()), 4 * GIB + GIB / 2),
                "",
                "",
            ),
        ],
    );
    assert_eq!(plans[1].events[1].severity, Severity::Critical);
    // What it decided: Shmem grew by 3.5 GiB, more than the 1 GiB shortfall, and the first
    // candidate cannot lift RAM above the warn floor.
    let short = with_shmem(snap(200, Some(3 * GIB), small()), 4 * GIB + GIB / 2);
    let v = shmem_verdict(ram_choice(&c, &short, &mut state));
    assert_eq!(
        (
            v.growth.growth,
            v.growth.shortfall,
            v.unexplained,
            v.judgement
        ),
        (
            3 * GIB + GIB / 2,
            GIB,
            0,
            floors::Judgement::TooSmallForWarn
        )
    );
    // 2 GiB would lift RAM above the act floor (1 GiB short), not above the warn floor (5 GiB
    // short): a tmpfs write still under way would take that back. Not acted on.
    let mut mid = small();
    mid.push(proc(300, "mid", 2 * GIB, 1));
    let plan = decide(
        &c,
        &with_shmem(snap(250, Some(3 * GIB), mid.clone()), 4 * GIB + GIB / 2),
        &mut state,
    );
    assert_eq!((acts(&plan).as_str(), events(&plan).as_str()), ("", ""));
    // The file is being removed: Shmem falls before MemAvailable rises. Still the same
    // shortfall of memory no process held (Shmem's peak counts): nobody is signalled.
    let plan = decide(
        &c,
        &with_shmem(snap(280, Some(3 * GIB), mid.clone()), GIB + GIB / 2),
        &mut state,
    );
    assert_eq!((acts(&plan).as_str(), events(&plan).as_str()), ("", ""));
    // A candidate whose own memory alone lifts RAM above the warn floor may still be acted on.
    let mut big = mid;
    big.push(proc(400, "big", 6 * GIB, 1));
    let s = with_shmem(snap(300, Some(3 * GIB), big), 4 * GIB + GIB / 2);
    let v = shmem_verdict(ram_choice(&c, &s, &mut state));
    assert_eq!(
        (
            v.target.members[0].id.pid,
            v.used,
            v.unexplained,
            v.judgement
        ),
        (400, 6 * GIB, 0, floors::Judgement::LiftsAboveWarn)
    );
    let plan = decide(&c, &s, &mut state);
    assert_eq!(
        (acts(&plan).as_str(), events(&plan).as_str()),
        ("terminate [400]", "")
    );
}

/// Round three: a tmpfs file written, hogs started, the file deleted. The Shmem rule kept the
/// peak of Shmem and hid the hogs for as long as RAM stayed short. Now the peak outlives a fall
/// of Shmem only until MemAvailable shows what it gave back, or `SHMEM_FALL_GRACE`.
#[test]
fn a_deleted_tmpfs_file_does_not_hide_the_hogs_that_keep_ram_short() {
    let c = config(RAM_FLOORS);
    let hogs = |rss| vec![proc(100, "hog1", rss, 1), proc(200, "hog2", rss + MIB, 1)];
    let at = |ms, avail, shmem, rss| with_shmem(snap(ms, Some(avail), hogs(rss)), shmem);
    // MemAvailable shows the file's 4 GiB given back (still short: the hogs): acted on at once.
    let mut state = PolicyState::default();
    play(
        &c,
        &mut state,
        vec![
            (at(0, 16 * GIB, 0, MIB), "", ""),
            (
                at(100, GIB, 4 * GIB, 1536 * MIB),
                "",
                "floor_act, shmem_shortfall",
            ),
            (at(200, 3 * GIB, 9 * MIB, 1536 * MIB), "terminate [200]", ""),
        ],
    );
    // The hogs grew as the file went (MemAvailable rose by less than half of it): the peak is
    // kept for the moment a removal takes, then the hogs are acted on.
    let mut state = PolicyState::default();
    let grace = crate::policy::SHMEM_FALL_GRACE.as_millis() as u64;
    play(
        &c,
        &mut state,
        vec![
            (at(0, 16 * GIB, 0, MIB), "", ""),
            (
                at(100, GIB, 4 * GIB, 1536 * MIB),
                "",
                "floor_act, shmem_shortfall",
            ),
            (at(200, 2 * GIB + GIB / 2, 9 * MIB, 3 * GIB), "", ""),
            (
                at(200 + grace - 1, 2 * GIB + GIB / 2, 9 * MIB, 3 * GIB),
                "",
                "",
            ),
            (
                at(200 + grace, 2 * GIB + GIB / 2, 9 * MIB, 3 * GIB),
                "terminate [200]",
                "",
            ),
        ],
    );
}

/// Round three: 2.5 GiB in `/dev/shm` plus a 1.2 GiB hog ended in nobody acted on below the act
/// floor. The daemon reads who owns the tmpfs files: when the candidate's account owns them, the
/// memory no process holds is that account's, and its hog is acted on; another account's file
/// still holds the floor back.
#[test]
fn the_account_that_owns_the_tmpfs_files_is_acted_on() {
    let c = config(RAM_FLOORS);
    let hog = || {
        vec![Process {
            uid: 1001,
            ..proc(100, "hog", 1229 * MIB, 1)
        }]
    };
    let at = |ms, avail, shmem, owner: Option<u32>| {
        let mut s = with_shmem(snap(ms, Some(avail), hog()), shmem);
        if let Some(uid) = owner {
            s.tmpfs_owners.insert(uid, shmem);
        }
        s
    };
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (at(0, 16 * GIB, 0, None), "", ""),
            (
                at(100, 3 * GIB, 5 * GIB / 2, Some(1001)),
                "terminate [100]",
                "floor_act, shmem_shortfall",
            ),
        ],
    );
    let mut state = PolicyState::default();
    play(
        &c,
        &mut state,
        vec![
            (at(0, 16 * GIB, 0, None), "", ""),
            (
                at(100, 3 * GIB, 5 * GIB / 2, Some(1002)),
                "",
                "floor_act, shmem_shortfall",
            ),
        ],
    );
    let short = at(200, 3 * GIB, 5 * GIB / 2, Some(1002));
    let v = shmem_verdict(ram_choice(&c, &short, &mut state));
    assert_eq!(v.judgement, floors::Judgement::TooSmallForWarn);
    assert_eq!(v.owners, [(1002, 5 * GIB / 2)]);
}

/// Shmem that did not grow leaves the floor acting as before; so does a Shmem baseline that is
/// unknown (RAM was never seen above its warn floor).
#[test]
fn no_shmem_growth_leaves_the_floor_acting_as_before() {
    let c = config(RAM_FLOORS);
    let procs = || vec![proc(100, "a", 800 * MIB, 1)];
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (with_shmem(snap(0, Some(16 * GIB), procs()), GIB), "", ""),
            (
                with_shmem(snap(100, Some(3 * GIB), procs()), GIB),
                "terminate [100]",
                "floor_act",
            ),
        ],
    );
    play(
        &c,
        &mut PolicyState::default(),
        vec![(
            with_shmem(snap(0, Some(3 * GIB), procs()), 8 * GIB),
            "terminate [100]",
            "floor_act",
        )],
    );
}

/// Servers' own shared memory moves by a few MiB: growth that small does not make the Shmem rule
/// apply, so a hog split over processes each smaller than the shortfall is still acted on.
#[test]
fn shmem_noise_does_not_spare_a_hog_split_over_small_processes() {
    let c = config(RAM_FLOORS);
    // RAM 1 GiB short of the act floor; each piece of the hog holds 800 MiB; Shmem +8 MiB.
    let procs = || vec![proc(100, "a", 800 * MIB, 1), proc(101, "a", 700 * MIB, 1)];
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (with_shmem(snap(0, Some(16 * GIB), procs()), GIB), "", ""),
            (
                with_shmem(snap(100, Some(3 * GIB), procs()), GIB + 8 * MIB),
                "terminate [100]",
                "floor_act",
            ),
        ],
    );
}

/// Shmem growth that explains part of the shortfall: only the rest (shortfall - growth) is
/// judged. A victim acts only if its own memory is at least that rest (it plausibly caused it)
/// and lifts RAM above the act floor; otherwise `shmem_shortfall` and nobody is signalled.
#[test]
fn shmem_growth_explaining_part_of_the_shortfall_judges_only_the_rest() {
    let c = config(RAM_FLOORS);
    // Shmem 1 GiB -> 1.5 GiB, RAM 1 GiB short of the act floor: 512 MiB unexplained.
    let base = |procs| with_shmem(snap(0, Some(16 * GIB), procs), GIB);
    let short = |at, procs| with_shmem(snap(at, Some(3 * GIB), procs), GIB + GIB / 2);
    // 800 MiB covers the unexplained part but would not lift RAM above the act floor.
    let small = || vec![proc(100, "a", 800 * MIB, 1)];
    let mut state = PolicyState::default();
    let plans = play(
        &c,
        &mut state,
        vec![
            (base(small()), "", ""),
            (short(100, small()), "", "floor_act, shmem_shortfall"),
            (short(200, small()), "", ""),
        ],
    );
    assert_eq!(plans[1].events[1].severity, Severity::Critical);
    let v = shmem_verdict(ram_choice(&c, &short(200, small()), &mut state));
    assert_eq!(
        (
            v.growth.growth,
            v.growth.shortfall,
            v.unexplained,
            v.judgement
        ),
        (GIB / 2, GIB, GIB / 2, floors::Judgement::CannotLift)
    );
    // 2 GiB covers it and lifts RAM above the act floor: acted on.
    let mut big = small();
    big.push(proc(300, "big", 2 * GIB, 1));
    let plan = decide(&c, &short(300, big), &mut state);
    assert_eq!(
        (acts(&plan).as_str(), events(&plan).as_str()),
        ("terminate [300]", "")
    );
    let mut big = small();
    big.push(proc(300, "big", 2 * GIB, 1));
    let v = shmem_verdict(ram_choice(&c, &short(300, big), &mut state));
    assert_eq!(v.judgement, floors::Judgement::CoversTheRest);
}

/// The red team's bypass: a 3.5 GiB tmpfs file plus 1 GiB of anonymous memory in a process no
/// model holds (`candidates = "models"`). The shortfall (4 GiB) is more than the Shmem growth,
/// which used to switch the Shmem rule off and kill the models one by one; now only the
/// unexplained 512 MiB is judged, no model holds that much, and nobody is signalled.
#[test]
fn a_small_hog_beside_a_tmpfs_file_does_not_get_models_killed() {
    let models = ["a", "b", "c"]
        .iter()
        .map(|n| model(n, ""))
        .collect::<String>();
    let c = config(&format!(
        "[daemon]\ncandidates = \"models\"\n\
         [ram]\nwarn_available = \"16GiB\"\nmin_available = \"12GiB\"\n{models}"
    ));
    let procs = || {
        vec![
            proc(100, "a", 400 * MIB, 1),
            proc(200, "b", 250 * MIB, 1),
            proc(300, "c", 200 * MIB, 1),
            proc(400, "hog", GIB, 1),
        ]
    };
    let mut state = PolicyState::default();
    play(
        &c,
        &mut state,
        vec![
            (with_shmem(snap(0, Some(20 * GIB), procs()), GIB), "", ""),
            (
                with_shmem(snap(100, Some(8 * GIB), procs()), 4 * GIB + GIB / 2),
                "",
                "floor_act, shmem_shortfall",
            ),
            (
                with_shmem(snap(200, Some(8 * GIB), procs()), 4 * GIB + GIB / 2),
                "",
                "",
            ),
        ],
    );
    let now = with_shmem(snap(200, Some(8 * GIB), procs()), 4 * GIB + GIB / 2);
    let v = shmem_verdict(ram_choice(&c, &now, &mut state));
    assert_eq!(
        (v.unexplained, v.target.model.as_deref(), v.judgement),
        (GIB / 2, Some("a"), floors::Judgement::LessThanTheRest)
    );
}

/// Round three: an account keeps RAM short with small processes it lets die; after
/// `max_victims` of them the brake held, and the account's 3.5 GiB hog then ran below the act
/// floor untouched. The brake holds only against victims like those that did not help: a
/// candidate that alone lifts RAM above the act floor and holds more than any of them is acted
/// on.
#[test]
fn sacrificial_kills_do_not_spend_the_brake_for_the_hog() {
    let c = config(&format!("{RAM_FLOORS}max_victims = 2\n"));
    let user = |p: Process| Process { uid: 1001, ..p };
    let procs = |list: &[(i32, &str, u64)]| {
        let mut v = vec![proc(50, "idle", 10 * MIB, 1)];
        v.extend(
            list.iter()
                .map(|&(pid, name, rss)| user(proc(pid, name, rss, 1))),
        );
        v
    };
    let mut state = PolicyState::default();
    play(
        &c,
        &mut state,
        vec![
            (
                snap(0, Some(3 * GIB), procs(&[(101, "sac1", 600 * MIB)])),
                "terminate [101]",
                "floor_act",
            ),
            // It died (SIGTERM); the account's next one keeps RAM short (chosen once the dead one's
            // memory had RAM_RELEASE to come back).
            (
                snap(500, Some(3 * GIB), procs(&[(102, "sac2", 600 * MIB)])),
                "",
                "",
            ),
            (
                snap(1500, Some(3 * GIB), procs(&[(102, "sac2", 600 * MIB)])),
                "terminate [102]",
                "",
            ),
            (
                snap(2000, Some(3 * GIB), procs(&[(103, "sac3", 600 * MIB)])),
                "",
                "",
            ),
            // Two victims that did not help: the brake holds against the third small one...
            (
                snap(3000, Some(3 * GIB), procs(&[(103, "sac3", 600 * MIB)])),
                "",
                "floor_brake",
            ),
            // ...not against the hog that alone lifts RAM above the act floor.
            (
                snap(3500, Some(3 * GIB), procs(&[(104, "hog", 3584 * MIB)])),
                "terminate [104]",
                "",
            ),
        ],
    );
}

/// Round three: with `candidates = "models"`, memory held outside every model (67 GiB on the
/// GPU) made a model within its budget the victim. When what processes of no model hold grew by
/// the shortfall since the GPU was last above its warn floor, a model within its budget is left
/// alone (a critical `outside_shortfall` says why); one over its budget is still acted on, and a
/// model that grows itself is acted on as before.
#[test]
fn memory_outside_the_models_does_not_make_a_model_within_its_budget_the_victim() {
    let c = |budget: &str| {
        config(&format!(
            "[daemon]\ncandidates = \"models\"\n[gpu]\nmin_free = \"2GiB\"\nwarn_free = \"3GiB\"\n{}",
            model("vict", &format!("gpu_memory = \"{budget}\"\n"))
        ))
    };
    let procs = || vec![proc(100, "vict", GIB, 1), proc(300, "notebook", GIB, 1)];
    // GPU 0 (16 GiB): the model holds 5 GiB; the notebook, no model's, 4 GiB then 10 GiB.
    let at = |ms, vict: u64, notebook: u64| {
        let free = 16 * GIB - vict - notebook;
        gsnap(
            ms,
            procs(),
            vec![gpu(0, free, &[(100, Some(vict)), (300, Some(notebook))])],
        )
    };
    play(
        &c("8GiB"),
        &mut PolicyState::default(),
        vec![
            (at(0, 5 * GIB, 4 * GIB), "", ""),
            (
                at(100, 5 * GIB, 10 * GIB),
                "",
                "floor_act, outside_shortfall",
            ),
            (at(200, 5 * GIB, 10 * GIB), "", ""),
        ],
    );
    // Over its budget, the model is still the victim.
    play(
        &c("4GiB"),
        &mut PolicyState::default(),
        vec![
            (at(0, 5 * GIB, 4 * GIB), "", "budget_exceeded"),
            (
                at(100, 5 * GIB, 10 * GIB),
                "terminate vict[100]",
                "floor_act",
            ),
        ],
    );
    // NVML's per-process lists lag its free memory: a crossing seen on lists older than it waits
    // for fresh ones (which show the notebook grew) ...
    let stale = |ms, vict, notebook| {
        let mut s = at(ms, vict, notebook);
        s.gpus.processes_fresh = false;
        s.gpus.devices[0].processes = [(100, Some(vict)), (300, Some(4 * GIB))].into();
        s
    };
    play(
        &c("8GiB"),
        &mut PolicyState::default(),
        vec![
            (at(0, 5 * GIB, 4 * GIB), "", ""),
            (stale(100, 5 * GIB, 10 * GIB), "", "floor_act"),
            (at(200, 5 * GIB, 10 * GIB), "", "outside_shortfall"),
        ],
    );
    // ... but not for longer than `[gpu] sample_timeout` (then as before).
    play(
        &c("8GiB"),
        &mut PolicyState::default(),
        vec![
            (at(0, 5 * GIB, 4 * GIB), "", ""),
            (stale(100, 5 * GIB, 10 * GIB), "", "floor_act"),
            (stale(599, 5 * GIB, 10 * GIB), "", ""),
            (stale(600, 5 * GIB, 10 * GIB), "terminate vict[100]", ""),
        ],
    );
    // The model itself grew into the shortfall: acted on as before.
    play(
        &c("16GiB"),
        &mut PolicyState::default(),
        vec![
            (at(0, 5 * GIB, 4 * GIB), "", ""),
            (
                at(100, 11 * GIB, 4 * GIB),
                "terminate vict[100]",
                "floor_act",
            ),
        ],
    );
}

/// Round three: five 700 MiB processes of one account against another account's single 1.2 GiB
/// process, and the RAM floor ranked per process: the other account's went. Near the floor the
/// daemon reads each account's processes' proportional share (PSS): an account is ranked by the
/// sum, which forked workers' shared pages do not inflate.
#[test]
fn on_the_ram_floor_an_account_is_ranked_by_the_pss_of_its_processes() {
    let c = config(RAM_FLOORS);
    let with_pss = |p: Process, uid: u32, pss: u64| Process {
        uid,
        pss_bytes: Some(pss),
        ..p
    };
    let mut procs: Vec<Process> = (101..=105)
        .map(|pid| with_pss(proc(pid, "part", 700 * MIB, 1), 1001, 700 * MIB))
        .collect();
    procs.push(with_pss(
        proc(200, "single", 1228 * MIB, 1),
        1002,
        1228 * MIB,
    ));
    let plan = once(&c, &snap(0, Some(3 * GIB), procs.clone()));
    // (All five cannot lift RAM to its warn floor: the largest first, one victim at a time.)
    assert_eq!(acts(&plan), "terminate [101]");
    // Forked workers: 1 GiB of RSS each, mostly the same pages: 200 MiB of PSS each.
    for p in procs.iter_mut().filter(|p| p.uid == 1001) {
        p.rss_bytes = GIB;
        p.pss_bytes = Some(200 * MIB);
    }
    let plan = once(&c, &snap(0, Some(3 * GIB), procs));
    assert_eq!(acts(&plan), "terminate [200]");
}

/// A hostile review of the PSS ranking: an account shares its hog's pages with many helpers
/// each under the 32 MiB the scan reads PSS from (mapping a window of it, or forked before it
/// grew), so the hog's PSS is a fraction of what it holds, and the helpers, unread, were ranked
/// alone: another account's 1.2 GiB process went instead. An account with any PSS read has its
/// unread processes counted in its sum by RSS.
#[test]
fn an_account_cannot_dilute_its_pss_over_small_helpers() {
    let c = config(RAM_FLOORS);
    let mut procs = vec![Process {
        uid: 1001,
        pss_bytes: Some(512 * MIB),
        ..proc(101, "hog", 2 * GIB, 1)
    }];
    procs.extend((110..158).map(|pid| Process {
        uid: 1001,
        ..proc(pid, "helper", 31 * MIB, 1)
    }));
    procs.push(Process {
        uid: 1002,
        pss_bytes: Some(1228 * MIB),
        ..proc(200, "single", 1228 * MIB, 1)
    });
    let plan = once(&c, &snap(0, Some(3 * GIB), procs));
    assert!(acts(&plan).starts_with("terminate [101"), "{}", acts(&plan));
}

/// The GPU floor shares the brake (`[gpu] max_victims`, per GPU): with 1, a second victim on
/// the same GPU within the window is not taken; another GPU has its own count.
#[test]
fn the_gpu_floor_has_the_same_brake_per_gpu() {
    let c = config("[gpu]\nmin_free = \"2GiB\"\nmax_victims = 1\n");
    let low = 3 * GIB / 2;
    let ok = 3 * GIB;
    let s = |at, free0, holders: &[(i32, Option<u64>)], free1| {
        let procs = [100, 200, 300]
            .into_iter()
            .filter(|&p| p == 300 || holders.iter().any(|h| h.0 == p))
            .map(|p| proc(p, &format!("p{p}"), GIB, 1))
            .collect();
        gsnap(
            at,
            procs,
            vec![
                gpu(0, free0, holders),
                gpu(1, free1, &[(300, Some(8 * GIB))]),
            ],
        )
    };
    let both = [(100, Some(8 * GIB)), (200, Some(4 * GIB))];
    let second = [(200, Some(4 * GIB))];
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (s(0, low, &both, ok), "terminate [100]", "floor_act"),
            (s(100, low, &second, ok), "", ""),
            (
                s(200, low, &second, low),
                "terminate [300]",
                "floor_brake, floor_act",
            ),
        ],
    );
}

/// The models in force: a `[[model]]` wins over a launch of the same name (kept only for the
/// metrics URL it was launched with); launched-only models come after the configured ones.
#[test]
fn models_in_force_merge_config_and_launches_in_one_place() {
    let c = config(&format!(
        "{}{}",
        model("a", "ram = \"1GiB\"\n"),
        model(
            "b",
            "ram = \"2GiB\"\nmetrics_url = \"http://127.0.0.1:9/metrics\"\n"
        )
    ));
    let launched = |name: &str, url: Option<&str>| ModelConfig {
        name: name.to_string(),
        metrics_url: url.map(str::to_string),
        ram: None,
        ..c.models[0].clone()
    };
    let launches = Launches::new(
        HashMap::new(),
        vec![
            launched("a", Some("http://127.0.0.1:1/metrics")),
            launched("z", Some("http://127.0.0.1:2/metrics")),
            launched("m", None),
        ],
    );
    let models = launches.models(&c);
    let names: Vec<&str> = models.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["a", "b", "m", "z"]);
    assert!(models.get("a").unwrap().ram.is_some(), "the [[model]] wins");
    assert_eq!(models.metrics_url("a"), Some("http://127.0.0.1:1/metrics"));
    assert_eq!(models.metrics_url("b"), Some("http://127.0.0.1:9/metrics"));
    assert_eq!(models.metrics_url("z"), Some("http://127.0.0.1:2/metrics"));
    assert_eq!(models.metrics_url("m"), None);
    assert!(models.get("nope").is_none());
    assert_eq!(model_config(&c, &launches, "z").unwrap().name, "z");
}

/// A model launched without a `[[model]]` (`gpuguard launch --ram ...`) has the budget its
/// launch gave, through the launches the loop hands the policy with each snapshot; once the
/// ledger no longer has the launch, its processes belong to no model and nothing holds them.
#[test]
fn a_launched_models_budget_comes_with_the_launches_the_policy_is_given() {
    let c = config("");
    let procs = || {
        vec![
            proc(100, "server", 3 * GIB, 1),
            proc(101, "worker", GIB / 2, 100),
        ]
    };
    let mut budget = config(&model(
        "served",
        "ram = \"2GiB\"\naction = \"stop\"\ngrace = \"1s\"\n",
    ));
    let launches = Launches::new(
        HashMap::from([(procs()[0].id(), "served".to_string())]),
        vec![budget.models.remove(0)],
    );
    let mut state = PolicyState::default();
    let ok = Some(32 * GIB);
    let at = |ms| snap(ms, ok, procs());
    let plan = decide_with(&c, &at(0), &launches, &mut state);
    assert_eq!(events(&plan), "budget_exceeded");
    let plan = decide_with(&c, &at(1000), &launches, &mut state);
    assert_eq!(acts(&plan), "stop served[100,101]");
    // The launch is gone from the ledger: nothing launched, nothing over a budget.
    state.launches_changed();
    let plan = decide(&c, &at(2000), &mut state);
    assert_eq!(acts(&plan), "resume served[100,101]");
}

/// The stage an action enters is entered on its outcome, in `apply`: a decision alone moves
/// nothing, an action skipped leaves the stage where it was, one carried out enters it.
#[test]
fn a_stage_is_entered_only_when_its_action_is_carried_out() {
    let c = config(&format!("{RAM_FLOORS}action = \"stop\"\n"));
    let a = || vec![proc(100, "trainer", 6 * GIB, 1)];
    let none = Launches::default();
    let mut state = PolicyState::default();
    let ms = Duration::from_millis;
    let stage = |s: &PolicyState| {
        let i = &s.incidents[&Resource::Ram];
        (i.victim.is_some(), i.stage, i.stage_since)
    };
    // Decided, not yet carried out: no victim, no stage, nothing for the brake.
    let plan = evaluate(&c, &snap(0, Some(3 * GIB), a()), &none, &mut state);
    assert_eq!(acts(&plan), "stop [100]");
    assert_eq!(stage(&state), (false, Stage::Alerted, Duration::ZERO));
    assert!(state.floor_victims.values().all(|v| v.is_empty()));
    // The executor skipped it (the recheck found RAM recovered): still nothing entered, and the
    // next tick below the floor decides afresh.
    state.apply(&carried(&plan, Outcome::Skipped("recovered".into())));
    assert_eq!(stage(&state), (false, Stage::Alerted, Duration::ZERO));
    let plan = evaluate(&c, &snap(100, Some(3 * GIB), a()), &none, &mut state);
    assert_eq!(acts(&plan), "stop [100]");
    // Carried out: stopped from the tick that decided it, and counted for the brake.
    state.apply(&carried(&plan, Outcome::Done));
    assert_eq!(stage(&state), (true, Stage::Stopped, ms(100)));
    assert_eq!(state.floor_victims[&Resource::Ram].len(), 1);
    // settle (2 s) later: SIGTERM decided; skipped, the victim stays stopped and the next tick
    // asks for SIGTERM again (not a fresh stop of a new victim).
    let plan = evaluate(&c, &snap(2100, Some(3 * GIB), a()), &none, &mut state);
    assert_eq!(acts(&plan), "terminate [100]");
    state.apply(&carried(&plan, Outcome::Skipped("recovered".into())));
    assert_eq!(stage(&state), (true, Stage::Stopped, ms(100)));
    let plan = decide(&c, &snap(2200, Some(3 * GIB), a()), &mut state);
    assert_eq!(acts(&plan), "terminate [100]");
    assert_eq!(stage(&state), (true, Stage::Terminated, ms(2200)));
    assert_eq!(
        state.floor_victims[&Resource::Ram].len(),
        1,
        "an escalation is no new victim"
    );
}

/// A budget's enforcement is in force only once its action was carried out: a stop that was
/// skipped (the model already gone under budget at the recheck) leaves nothing in force and is
/// decided again while the model stays over; one carried out is in force and lifted with a
/// resume. One that failed stands as decided (reported once; `apply`).
#[test]
fn a_budget_enforcement_is_in_force_only_once_carried_out() {
    let c = config(&model(
        "trainer",
        "ram = \"1GiB\"\naction = \"stop\"\ngrace = \"1s\"\n",
    ));
    let a = || vec![proc(100, "trainer", 2 * GIB, 1)];
    let none = Launches::default();
    let mut state = PolicyState::default();
    decide(&c, &snap(0, Some(20 * GIB), a()), &mut state);
    let plan = evaluate(&c, &snap(1000, Some(20 * GIB), a()), &none, &mut state);
    assert_eq!(acts(&plan), "stop trainer[100]");
    assert!(state.budgets["trainer"].enforced.is_none());
    state.apply(&carried(
        &plan,
        Outcome::Skipped("target has exited".into()),
    ));
    assert!(state.budgets["trainer"].enforced.is_none());
    // Still over: the stop is decided again and, carried out, is in force.
    let plan = decide(&c, &snap(1100, Some(20 * GIB), a()), &mut state);
    assert_eq!(acts(&plan), "stop trainer[100]");
    let enforced = state.budgets["trainer"].enforced.as_ref().map(|e| e.stage);
    assert_eq!(enforced, Some(Stage::Stopped));
    let under = || vec![proc(100, "trainer", GIB / 2, 1)];
    let plan = decide(&c, &snap(1200, Some(20 * GIB), under()), &mut state);
    assert_eq!(acts(&plan), "resume trainer[100]");
}

/// A budget's SIGKILL that fails (EPERM from a security module) stands as decided: it is
/// reported once, not decided again every tick while the model stays over budget.
#[test]
fn a_budget_kill_that_fails_is_not_decided_again_every_tick() {
    let c = config(&model(
        "trainer",
        "ram = \"1GiB\"\naction = \"kill\"\ngrace = \"1s\"\n",
    ));
    let a = || vec![proc(100, "trainer", 2 * GIB, 1)];
    let none = Launches::default();
    let mut state = PolicyState::default();
    decide(&c, &snap(0, Some(20 * GIB), a()), &mut state);
    assert_eq!(
        acts(&decide(&c, &snap(1000, Some(20 * GIB), a()), &mut state)),
        "terminate trainer[100]"
    );
    // term_grace (5 s) later: SIGKILL, which fails.
    let plan = evaluate(&c, &snap(6000, Some(20 * GIB), a()), &none, &mut state);
    assert_eq!(acts(&plan), "kill trainer[100]");
    state.apply(&carried(&plan, Outcome::Failed("permission denied".into())));
    for at in [6010, 6020, 7000] {
        let plan = decide(&c, &snap(at, Some(20 * GIB), a()), &mut state);
        assert_eq!(acts(&plan), "", "at {at} ms");
    }
}

/// Two GPUs choose the same victim in one tick (a hostile review of the outcome-entered stages):
/// the second takes up the first's SIGTERM. If that SIGTERM is skipped (the recheck found memory
/// back) neither incident is at Terminated, so neither waits out a grace for a signal never sent
/// nor SIGKILLs without one; if it fails, both let the victim go; carried out, both are at it.
#[test]
fn a_signal_two_floors_share_in_one_tick_is_theirs_only_once_carried_out() {
    let c = config(&format!(
        "[daemon]\ncandidates = \"models\"\n[gpu]\nmin_free = \"12GiB\"\n{}",
        model("srv", "")
    ));
    let s = srv_on_two_gpus;
    let none = Launches::default();
    let stages = |state: &PolicyState| {
        state
            .incidents
            .values()
            .map(|i| (i.victim.is_some(), i.stage))
            .collect::<Vec<_>>()
    };
    for (outcome, want) in [
        (
            Outcome::Skipped("recovered".into()),
            (false, Stage::Alerted),
        ),
        (
            Outcome::Failed("permission denied".into()),
            (false, Stage::Alerted),
        ),
        (Outcome::Done, (true, Stage::Terminated)),
    ] {
        let mut state = PolicyState::default();
        let plan = evaluate(&c, &s(0), &none, &mut state);
        assert_eq!(acts(&plan), "terminate srv[100,101]");
        state.apply(&carried(&plan, outcome.clone()));
        assert_eq!(stages(&state), vec![want; 2], "{outcome:?}");
        if matches!(outcome, Outcome::Failed(_)) {
            assert!(state.incidents.values().all(|i| i.excluded.len() == 2));
        }
    }
}

/// A victim stopped by a floor whose SIGTERM then fails (not permitted) is not left frozen: the
/// incident lets it go to the next victim, and it is held, to be resumed once RAM is back.
#[test]
fn a_stopped_victim_whose_sigterm_fails_is_held_and_resumed_when_ram_is_back() {
    let c = config(&format!("{RAM_FLOORS}action = \"stop\"\n"));
    let a = || {
        vec![
            proc(100, "trainer", 6 * GIB, 1),
            proc(200, "loader", 4 * GIB, 1),
        ]
    };
    let none = Launches::default();
    let mut state = PolicyState::default();
    assert_eq!(
        acts(&decide(&c, &snap(0, Some(3 * GIB), a()), &mut state)),
        "stop [100]"
    );
    let plan = evaluate(&c, &snap(2000, Some(3 * GIB), a()), &none, &mut state);
    assert_eq!(acts(&plan), "terminate [100]");
    state.apply(&carried(&plan, Outcome::Failed("permission denied".into())));
    assert_eq!(state.held.len(), 1);
    assert_eq!(state.held[0].target.members[0].id.pid, 100);
    // Still short: the next victim, not 100 again.
    let plan = decide(&c, &snap(2100, Some(3 * GIB), a()), &mut state);
    assert_eq!(acts(&plan), "stop [200]");
    // RAM back above warn: both resumed.
    let plan = decide(&c, &snap(3000, Some(20 * GIB), a()), &mut state);
    let mut resumed: Vec<(Verb, Vec<i32>)> = plan
        .actions
        .iter()
        .map(|a| (a.verb, a.target.ids().map(|id| id.pid).collect()))
        .collect();
    resumed.sort();
    assert_eq!(
        resumed,
        [(Verb::Resume, vec![100]), (Verb::Resume, vec![200])],
        "{}",
        acts(&plan)
    );
}

/// A victim two GPU floors stopped together gets one SIGTERM when `settle` runs out, not one per
/// floor (a second SIGTERM makes many servers quit without cleaning up): the second floor takes
/// up the first's step, and both are at Terminated once it is carried out.
#[test]
fn a_victim_two_floors_stopped_gets_one_sigterm_after_settle() {
    let c = config(&format!(
        "[daemon]\ncandidates = \"models\"\n[gpu]\nmin_free = \"12GiB\"\naction = \"stop\"\n{}",
        model("srv", "")
    ));
    let s = srv_on_two_gpus;
    let mut state = PolicyState::default();
    play(
        &c,
        &mut state,
        vec![
            (s(0), "stop srv[100,101]", "floor_act, floor_act"),
            (s(1000), "", ""),
            (s(2000), "terminate srv[100,101]", ""),
        ],
    );
    let stages: Vec<_> = state
        .incidents
        .values()
        .map(|i| (i.stage, i.stage_since))
        .collect();
    assert_eq!(
        stages,
        vec![(Stage::Terminated, Duration::from_millis(2000)); 2]
    );
}

/// Three GPU floors in one tick: a user's process 100 short on GPU 0, 101 on GPU 1, and both on
/// GPU 2. GPU 2's victim is covered by the other two signals together (not by either alone): no
/// empty action (it was skipped every tick, as "target has exited"), and GPU 2's incident takes
/// up their step once carried out.
#[test]
fn a_victim_covered_by_two_other_floors_together_gets_no_empty_action() {
    let c = config("[gpu]\nmin_free = \"2GiB\"\nwarn_free = \"3GiB\"\n");
    let procs = || vec![proc(100, "big", GIB, 1), proc(101, "other", GIB, 1)];
    let s = gsnap(
        0,
        procs(),
        vec![
            gpu(0, GIB, &[(100, Some(8 * GIB))]),
            gpu(1, GIB, &[(101, Some(8 * GIB))]),
            gpu(2, GIB / 2, &[(100, Some(2 * GIB)), (101, Some(GIB))]),
        ],
    );
    let mut state = PolicyState::default();
    let plan = decide(&c, &s, &mut state);
    assert_eq!(acts(&plan), "terminate [100]; terminate [101]");
    let gpu2 = &state.incidents[&Resource::Gpu(2)];
    assert_eq!(gpu2.stage, Stage::Terminated);
    assert_eq!(gpu2.victim.as_ref().map(|v| v.ids().count()), Some(2));
}

mod rules;
mod security;
mod words;
