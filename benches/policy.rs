//! The pure decision's cost: `gpuguard::policy::evaluate` on a synthetic snapshot of 1000
//! processes near a RAM floor. Plain `std::time::Instant`, no bench framework:
//!
//!   cargo bench --bench policy          (or: bench/run-all.sh)
//!
//! Prints the median, p99 and max of many evaluations per case, in microseconds. Target
//! (issue 7): a decision near a floor under 1 ms with 1000 processes.

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

use gpuguard::config::Config;
use gpuguard::policy::{evaluate, Launches, PolicyState};
use gpuguard::snapshot::{HostMemory, Process, ProcessTable, Snapshot};

const GIB: u64 = 1 << 30;
const PROCESSES: usize = 1000;

const CONFIG: &str = r#"
[daemon]
candidates = "any"
state_dir = "/tmp/gpuguard-bench-unused"
[ram]
warn_available = "4GiB"
min_available = "2GiB"
action = "kill"
[gpu]
enabled = false
[[model]]
name = "qwen-32b"
match = { cmdline = "vllm serve .*Qwen2.5-32B" }
ram = "64GiB"
[[model]]
name = "llama-8b"
match = { cmdline = "vllm serve .*Llama-3.1-8B", user = "0" }
ram = "32GiB"
[[model]]
name = "workers"
match = { comm = "python3*", cgroup = "/system.slice/workers.service" }
"#;

fn processes() -> Vec<Process> {
    (0..PROCESSES)
        .map(|i| {
            let pid = 1000 + i as i32;
            let (comm, cmdline, cgroup) = match i % 10 {
                0 => (
                    "python3",
                    format!("python3 -m vllm serve /models/Qwen2.5-32B-Instruct --port {i}"),
                    "/system.slice/vllm.service",
                ),
                1 => (
                    "python3",
                    format!("python3 -m vllm serve /models/Llama-3.1-8B --port {i}"),
                    "/system.slice/vllm.service",
                ),
                2 => (
                    "python3",
                    format!("python3 worker.py --id {i}"),
                    "/system.slice/workers.service",
                ),
                3 => (
                    "sshd",
                    "sshd: root@pts/0".to_string(),
                    "/system.slice/ssh.service",
                ),
                _ => (
                    "sleep",
                    "sleep 100000".to_string(),
                    "/user.slice/user-0.slice/session-1.scope",
                ),
            };
            Process {
                pid,
                start_time: 10_000 + i as u64,
                ppid: if i % 10 == 0 || i < 10 {
                    1
                } else {
                    1000 + (i as i32 / 10) * 10
                },
                uid: 0,
                state: 'S',
                comm: comm.to_string(),
                cmdline,
                cgroup: cgroup.to_string(),
                rss_bytes: (1 + (i as u64 * 7919) % 4096) << 20,
                swap_bytes: Some(0),
                kernel_thread: false,
                exe: None,
                pss_bytes: None,
            }
        })
        .collect()
}

fn snapshot(at: Duration, available: u64, procs: &[Process], scanned_at: Duration) -> Snapshot {
    Snapshot {
        at,
        host: HostMemory {
            total_bytes: Some(24 * GIB),
            available_bytes: Some(available),
            swap_total_bytes: Some(0),
            swap_free_bytes: Some(0),
            ..Default::default()
        },
        processes: ProcessTable {
            pss_read: true,
            scanned_at: Some(scanned_at),
            processes: procs.to_vec(),
        },
        self_pid: 1,
        ..Default::default()
    }
}

fn report(name: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let n = samples.len();
    println!(
        "| {name} | {n} | {:.1} | {:.1} | {:.1} |",
        us(samples[n / 2]),
        us(samples[(n * 99 / 100).min(n - 1)]),
        us(samples[n - 1])
    );
}

fn main() {
    let config = Config::parse(CONFIG, Path::new("bench.toml")).expect("bench config");
    let procs = processes();
    let warn = 3 * GIB; // between min (2 GiB) and warn (4 GiB)
    let act = 3 * GIB / 2; // below min, above min/2 (SIGTERM first)
    let iterations = 2000;
    println!("| case ({PROCESSES} processes) | iterations | median µs | p99 µs | max µs |");
    println!("|---|---|---|---|---|");

    // Near the floor, same process scan as last tick: attribution is cached.
    let mut state = PolicyState::default();
    let snap = snapshot(Duration::from_secs(1), warn, &procs, Duration::from_secs(1));
    evaluate(&config, &snap, &Launches::default(), &mut state);
    let mut samples = Vec::with_capacity(iterations);
    for i in 0..iterations {
        let mut s = snap.clone();
        s.at = Duration::from_secs(1) + Duration::from_millis(10 * i as u64);
        let t = Instant::now();
        black_box(evaluate(
            &config,
            black_box(&s),
            &Launches::default(),
            &mut state,
        ));
        samples.push(t.elapsed());
    }
    report("near floor (warn), no new scan", samples);

    // Near the floor with a fresh scan every tick (the daemon rescans every 100 ms there).
    let mut samples = Vec::with_capacity(iterations);
    for i in 0..iterations {
        let at = Duration::from_secs(1) + Duration::from_millis(10 * i as u64);
        let s = snapshot(at, warn, &procs, at);
        let t = Instant::now();
        black_box(evaluate(
            &config,
            black_box(&s),
            &Launches::default(),
            &mut state,
        ));
        samples.push(t.elapsed());
    }
    report("near floor (warn), fresh scan", samples);

    // The crossing: the tick after a warn tick goes below min_available with a fresh scan and
    // chooses a victim among 1000 processes (a new state each time, warmed by one warn tick).
    let mut samples = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let mut state = PolicyState::default();
        let w = snapshot(Duration::from_secs(1), warn, &procs, Duration::from_secs(1));
        evaluate(&config, &w, &Launches::default(), &mut state);
        let at = Duration::from_millis(1010);
        let s = snapshot(at, act, &procs, at);
        let t = Instant::now();
        let plan = black_box(evaluate(
            &config,
            black_box(&s),
            &Launches::default(),
            &mut state,
        ));
        samples.push(t.elapsed());
        assert_eq!(plan.actions.len(), 1, "one victim at the crossing");
    }
    report("crossing: below min, fresh scan, choose victim", samples);

    // The same from a cold state (first tick ever, match cache empty).
    let mut samples = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let mut state = PolicyState::default();
        let s = snapshot(Duration::from_secs(1), act, &procs, Duration::from_secs(1));
        let t = Instant::now();
        black_box(evaluate(
            &config,
            black_box(&s),
            &Launches::default(),
            &mut state,
        ));
        samples.push(t.elapsed());
    }
    report("crossing from a cold state (empty match cache)", samples);
}
