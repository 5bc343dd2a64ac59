//! Property tests of the core, in-process (proptest, bounded case counts so `cargo test`
//! stays fast): any config text parses or is refused in one line, and for any snapshot the
//! pure policy, its actions carried out, never chooses a protected process, never takes one
//! (nor pid 1, a kernel thread, the guard) into a model, never acts on an unknown or
//! inconsistent reading, and never plans more than one new victim per incident per tick.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;

use crate::config::{Config, GpuTotal, HostTotals};
use crate::policy::{evaluate, Action, Executed, Launches, Outcome, PolicyState, Verb};
use crate::snapshot::{
    Gpu, GpuSnapshot, GpuStatus, HostMemory, Process, ProcessId, ProcessTable, Snapshot,
};

/// `n` cases, or `PROPTEST_CASES` when set (for a longer run by hand).
fn cases(n: u32) -> ProptestConfig {
    let n = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(n);
    ProptestConfig {
        cases: n,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---- config text ------------------------------------------------------------------------------

/// A value a config key might be given: sizes, shares, durations, numbers, garbage.
fn config_value() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u64..=u64::MAX).prop_map(|n| n.to_string()),
        (0.0f64..1000.0).prop_map(|p| format!("\"{p}%\"")),
        (
            0u64..100_000,
            prop::sample::select(vec!["", "K", "MiB", "GiB", "TB", "G", "x"])
        )
            .prop_map(|(n, u)| format!("\"{n}{u}\"")),
        (
            0u64..100_000,
            prop::sample::select(vec!["ms", "s", "m", "h", "d", ""])
        )
            .prop_map(|(n, u)| format!("\"{n}{u}\"")),
        "\"[^\"\\\\\n]{0,20}\"",
        prop::sample::select(vec!["true", "false", "[]", "{}", "-1", "1e400", "\"\""])
            .prop_map(str::to_string),
    ]
}

fn config_text() -> impl Strategy<Value = String> {
    let keys = prop::sample::select(vec![
        "[daemon]\ninterval",
        "[daemon]\nmin_interval",
        "[daemon]\nstate_dir",
        "[daemon]\nmax_stop",
        "[ram]\nmin_available",
        "[ram]\nwarn_available",
        "[ram]\nmin_swap_free",
        "[ram]\npsi_some_avg10",
        "[gpu]\nmin_free",
        "[gpu]\nwarn_free",
        "[[gpu.device]]\ngpu",
        "[[gpu.device]]\nmin_free",
        "[launch]\nsocket",
        "[launch]\nmax_loading",
        "[alert]\nevent_log_max_size",
        "[[alert.webhook]]\nurl",
        "[[model]]\nname",
        "[[model]]\nram",
        "[[model]]\ngpu_memory",
        "[[model]]\naction",
        "[metrics]\nlisten",
    ]);
    prop_oneof![
        prop::collection::vec((keys, config_value()), 0..8).prop_map(|pairs| {
            pairs
                .into_iter()
                .map(|(k, v)| format!("{k} = {v}\n"))
                .collect::<String>()
        }),
        ".{0,300}",
    ]
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn any_config_text_parses_or_is_refused_in_one_line(text in config_text(), ram in any::<Option<u64>>(), gpu in any::<Option<u64>>()) {
        match Config::parse(&text, Path::new("/etc/gpuguard/config.toml")) {
            Ok(config) => {
                let host = HostTotals {
                    ram_bytes: ram,
                    swap_bytes: ram,
                    gpus: vec![GpuTotal { index: 0, uuid: "GPU-0".into(), total_bytes: gpu }],
                };
                if let Err(e) = config.check_host(&host, Path::new("c.toml")) {
                    prop_assert!(!e.to_string().contains('\n'));
                }
            }
            Err(e) => {
                let e = e.to_string();
                prop_assert!(e.starts_with("config /etc/gpuguard/config.toml: "), "{}", e);
                prop_assert!(!e.contains('\n'), "{}", e);
            }
        }
    }
}

// ---- the policy on arbitrary snapshots -------------------------------------------------------

const GIB: u64 = 1 << 30;
const SELF_PID: i32 = 4242;
const COMMS: &[&str] = &[
    "vllm",
    "trainer",
    "sshd",
    "systemd-journal",
    "gpuguard",
    "python3",
    "kworker/0",
];

fn process(pid: i32) -> impl Strategy<Value = Process> {
    (
        prop::sample::select(COMMS),
        prop::sample::select(vec!['S', 'R', 'D', 'T', 'Z', 'X']),
        any::<bool>(),
        0u64..64 * GIB,
        prop::option::of(0u64..8 * GIB),
        prop::sample::select(vec![0u32, 1000]),
        0i32..12,
    )
        .prop_map(
            move |(comm, state, kthread, rss, swap, uid, ppid)| Process {
                pid,
                start_time: 1000 + pid as u64,
                ppid,
                uid,
                state,
                comm: comm.to_string(),
                cmdline: format!("/usr/bin/{comm} --serve"),
                cgroup: "/".into(),
                rss_bytes: rss,
                swap_bytes: swap,
                kernel_thread: kthread && comm.starts_with("kworker"),
                exe: None,
                pss_bytes: None,
            },
        )
}

/// How a GPU reading goes wrong, if it does.
#[derive(Clone, Copy, Debug)]
enum GpuFault {
    None,
    UsedAboveTotal,
    FreeFarOff,
    ProcessAboveTotal,
    Unknown,
    Error,
}

/// A GPU whose reading is consistent, or broken in one of the ways NVML can be; its holders are
/// pids of the snapshot's processes.
fn gpu(index: u32) -> impl Strategy<Value = Gpu> {
    let fault = prop::sample::select(vec![
        GpuFault::None,
        GpuFault::None,
        GpuFault::UsedAboveTotal,
        GpuFault::FreeFarOff,
        GpuFault::ProcessAboveTotal,
        GpuFault::Unknown,
        GpuFault::Error,
    ]);
    (
        1u64..100,
        0u64..=100,
        0u64..512,
        fault,
        prop::collection::btree_map(2i32..12, prop::option::weighted(0.8, 0u64..=100), 0..5),
    )
        .prop_map(move |(total_gib, used_pct, reserved_mib, fault, holders)| {
            let total = total_gib * GIB;
            let reserved = (reserved_mib << 20).min(total);
            let used = (total - reserved) / 100 * used_pct;
            let mut g = Gpu {
                index,
                uuid: format!("GPU-{index}"),
                name: "Fake".into(),
                total_bytes: Some(total),
                used_bytes: Some(used),
                free_bytes: Some(total - reserved - used),
                reserved_bytes: Some(reserved),
                utilization_percent: None,
                error: None,
                lost: false,
                // Each holder holds a share of what is used.
                processes: holders
                    .into_iter()
                    .map(|(pid, pct)| (pid, pct.map(|p| used / 100 * p)))
                    .collect(),
                processes_known: true,
                processes_steady: true,
            };
            match fault {
                GpuFault::None => {}
                GpuFault::UsedAboveTotal => g.used_bytes = Some(total + GIB),
                GpuFault::FreeFarOff => g.free_bytes = Some(total / 2 + GIB),
                GpuFault::ProcessAboveTotal => {
                    g.processes.insert(2, Some(total * 2));
                }
                GpuFault::Unknown => g.free_bytes = None,
                GpuFault::Error => {
                    g.error = Some("GPU is lost".into());
                    g.lost = true;
                }
            }
            g
        })
}

fn snapshot() -> impl Strategy<Value = Snapshot> {
    let host = (
        1u64..128,
        0u64..=100,
        prop::sample::select(vec![0u8, 0, 0, 1, 2]),
        prop::option::of((1u64..16, 0u64..=100)),
        prop::option::of(-10.0f64..150.0),
    )
        .prop_map(|(total_gib, available_pct, fault, swap, psi)| {
            let total = total_gib * GIB;
            let (swap_total, swap_free) = match swap {
                Some((t, pct)) => (
                    Some(t * GIB),
                    Some(t * GIB / 100 * pct + u64::from(fault == 2) * 20 * GIB),
                ),
                None => (Some(0), Some(0)),
            };
            HostMemory {
                total_bytes: Some(total),
                available_bytes: match fault {
                    1 => Some(total + GIB),
                    _ => Some(total / 100 * available_pct),
                },
                swap_total_bytes: swap_total,
                swap_free_bytes: swap_free,
                psi_some_avg10: psi,
                shmem_bytes: None,
            }
        });
    (
        host,
        prop::collection::vec(gpu(0), 0..2),
        prop::collection::vec(gpu(1), 0..2),
        prop::bool::weighted(0.2),
        (2i32..12).prop_flat_map(|n| (2..n).map(process).collect::<Vec<_>>()),
    )
        .prop_map(|(host, g0, g1, stale, mut procs)| {
            procs.push(Process {
                comm: "gpuguard".into(),
                ..Process {
                    pid: SELF_PID,
                    start_time: 1,
                    ..Default::default()
                }
            });
            Snapshot {
                at: Duration::ZERO,
                host,
                processes: ProcessTable {
                    pss_read: true,
                    scanned_at: Some(Duration::ZERO),
                    processes: procs,
                },
                gpus: GpuSnapshot {
                    status: GpuStatus::Ok,
                    sampled_at: Some(Duration::ZERO),
                    stale,
                    devices: g0.into_iter().chain(g1).collect(),
                    process_lists_read: 0,
                    processes_fresh: true,
                    absent: false,
                },
                self_pid: SELF_PID,
                mapped_weights: Default::default(),
                tmpfs_owners: Default::default(),
            }
        })
}

fn policy_config() -> impl Strategy<Value = Config> {
    let floor = prop_oneof![
        (0u32..99).prop_map(|p| format!("\"{p}%\"")),
        (0u64..100).prop_map(|g| format!("\"{g}GiB\"")),
    ];
    (
        floor.clone(),
        floor.clone(),
        floor,
        prop::sample::select(vec!["kill", "stop", "alert"]),
        prop::sample::select(vec!["any", "models"]),
        prop::sample::select(vec!["alert", "throttle", "stop", "kill"]),
        prop::option::of(0u64..40),
    )
        .prop_filter_map("a valid config", |(ram, swap, gpu, action, candidates, model_action, budget)| {
            let budget = budget.map_or(String::new(), |g| format!("ram = \"{g}GiB\"\ngpu_memory = \"{g}GiB\"\n"));
            let model_action = if budget.is_empty() { "alert" } else { model_action };
            let text = format!(
                "[daemon]\ncandidates = \"{candidates}\"\nmax_stop = \"3s\"\nsettle = \"1s\"\n\
                 [ram]\nmin_available = {ram}\nwarn_available = \"0%\"\nmin_swap_free = {swap}\naction = \"{action}\"\n\
                 [gpu]\nmin_free = {gpu}\naction = \"{action}\"\n\
                 [[model]]\nname = \"vllm\"\nmatch = {{ comm = \"vllm\" }}\naction = \"{model_action}\"\ngrace = \"1s\"\n{budget}"
            );
            Config::parse(&text, Path::new("c.toml")).ok()
        })
}

/// The resource a floor action's reason names: "RAM available ..." or "GPU i free ...", and for
/// a kill at max_stop "... and RAM is still below" or "... and GPU i is still below".
fn floor_resource(action: &Action) -> Option<String> {
    let detail = &action.reason.detail;
    let text = match action.reason.kind.as_str() {
        "ram_floor" | "gpu_floor" => detail.as_str(),
        "max_stop" => detail.split(" and ").nth(1)?,
        _ => return None,
    };
    if text.starts_with("RAM ") {
        return Some("RAM".into());
    }
    let rest = text.strip_prefix("GPU ")?;
    Some(format!("GPU {}", rest.split(' ').next()?))
}

/// True if nothing may be decided from this resource's reading in this snapshot.
fn untrusted(config: &Config, s: &Snapshot, resource: &str) -> bool {
    if resource == "RAM" {
        let (_, min) = config.ram.floor_bytes(s.host.total_bytes);
        let impossible = matches!((min, s.host.total_bytes), (Some(m), Some(t)) if m >= t);
        return s.host.inconsistency().is_some() || s.host.available_bytes.is_none() || impossible;
    }
    let index: u32 = resource[4..].parse().unwrap();
    match s.gpus.devices.iter().find(|g| g.index == index) {
        None => true,
        Some(g) => {
            let (_, min) = config.gpu.floor_bytes(g.index, &g.uuid, g.total_bytes);
            let impossible = matches!((min, g.total_bytes), (Some(m), Some(t)) if m >= t);
            s.gpus.stale || g.untrusted().is_some() || g.free_bytes.is_none() || impossible
        }
    }
}

/// A process of the action's target that is protected now, leaving out those signalled before.
fn protected(
    config: &Config,
    s: &Snapshot,
    action: &Action,
    before: &[ProcessId],
) -> Option<String> {
    action
        .target
        .ids()
        .filter(|id| !before.contains(id))
        .find_map(|id| {
            let p = s.processes.get(id)?;
            let bad = p.pid <= 1
                || p.kernel_thread
                || p.pid == s.self_pid
                || config
                    .protect
                    .protects(&p.comm, p.uid, &p.cmdline, &p.cgroup, p.exe.as_ref());
            bad.then(|| format!("pid {} ({})", p.pid, p.comm))
        })
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn the_policy_never_touches_the_protected_nor_acts_on_untrusted_readings(
        config in policy_config(),
        ticks in prop::collection::vec((snapshot(), 1u64..2000), 1..6),
    ) {
        let mut state = PolicyState::default();
        let mut at = Duration::ZERO;
        // Processes acted on in earlier ticks: escalating on them (SIGKILL after SIGTERM) is not
        // a new choice, even if the process has renamed itself since (a process picks its own
        // name: renaming itself "sshd" after SIGTERM must not buy it protection). By process,
        // not by target: a model's SIGKILL names all the members its SIGTERM went to, some of
        // which another floor had signalled (so the SIGTERM named only the rest).
        let mut chosen_before: Vec<ProcessId> = Vec::new();
        for (i, (mut s, step_ms)) in ticks.into_iter().enumerate() {
            at += Duration::from_millis(step_ms);
            s.at = at;
            s.processes.scanned_at = Some(at);
            s.gpus.sampled_at = Some(at);
            s.gpus.process_lists_read = i as u64;
            let plan = evaluate(&config, &s, &Launches::default(), &mut state);
            // Issue 40: whatever the models match, none takes in pid 1, a process with no
            // parent, a kernel thread, the guard or a protected process.
            for m in &state.attribution.models {
                for &id in &m.members {
                    let p = s.processes.get(id).expect("a member is in the table");
                    let never = p.pid <= 1 || p.ppid == 0 || p.kernel_thread || p.pid == s.self_pid
                        || config.protect.protects(&p.comm, p.uid, &p.cmdline, &p.cgroup, p.exe.as_ref());
                    prop_assert!(!never, "pid {} ({}) is in model {}", p.pid, p.comm, m.name);
                }
            }
            // Carried out, as an executor that succeeds would: the next tick escalates.
            let done = plan.actions.iter().map(|a| Executed { action: a.clone(), outcome: Outcome::Done });
            state.apply(&done.collect::<Vec<_>>());
            let mut victims: BTreeMap<String, Vec<_>> = BTreeMap::new();
            for a in &plan.actions {
                if matches!(a.verb, Verb::Resume | Verb::Unthrottle) {
                    continue;
                }
                let protected = protected(&config, &s, a, &chosen_before);
                prop_assert!(protected.is_none(), "{:?} on a protected process: {protected:?}", a.verb);
                if let Some(resource) = floor_resource(a) {
                    prop_assert!(!untrusted(&config, &s, &resource), "{:?} on an untrusted {resource} reading: {}", a.verb, a.reason.detail);
                    if a.reason.detail.contains("swap free") {
                        prop_assert!(s.host.trusted_swap_free_bytes().is_some(), "acted on SwapFree above SwapTotal");
                    }
                    if a.reason.kind != "max_stop" {
                        victims.entry(resource).or_default().push(a.target.clone());
                    }
                }
                if a.reason.kind == "gpu_budget" {
                    prop_assert!(!s.gpus.stale, "gpu budget enforced on a stale reading");
                    prop_assert!(s.gpus.devices.iter().any(|g| g.untrusted().is_none()), "gpu budget enforced with no trusted GPU");
                }
            }
            chosen_before.extend(plan.actions.iter().flat_map(|a| a.target.ids()));
            for (resource, targets) in victims {
                let mut distinct = targets.clone();
                distinct.dedup();
                prop_assert!(distinct.len() <= 1, "{resource}: more than one victim in one tick: {targets:?}");
            }
        }
    }
}
