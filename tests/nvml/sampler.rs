//! The NVML sampler (`NvmlGpuSource`) in process against the scripted fake library: what it
//! reads, how it judges a reading, what NVML's odd answers become (no library, no driver, a
//! mismatch, NA memory, a lost or vanished GPU, implausible counts: moved here from the host
//! suite, which started a daemon for each), and that any state is sampled without panicking (a
//! property test, moved here from tests/integration/properties.rs: it loads the fake into this
//! process).

use std::path::Path;
use std::time::Duration;

use gpuguard::config::Config;
use gpuguard::policy::{evaluate, Launches, PolicyState};
use gpuguard::sample::nvml::{GpuSource, NvmlGpuSource};
use gpuguard::snapshot::{GpuSnapshot, HostMemory, ProcessTable, Snapshot};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};

use crate::{lib_path, Fake, GIB};

/// Issue #12: the process lists are read around the memory figures, and a change in between
/// (something allocated while NVML was being read) marks the reading unsteady, so permits never
/// set free memory from one moment against per-process figures from another.
#[test]
fn process_lists_that_change_around_the_memory_reading_are_not_steady() {
    let one = |used: u64| {
        format!(
            "device 0 uuid=GPU-a total={} used={}\nprocess 0 4242 {}\n",
            16 * GIB,
            used * GIB,
            used * GIB
        )
    };
    // Holds the binary's lock on FAKE_NVML_STATE, which points at this state file.
    let fake = Fake::new(&one(4));
    fake.log_calls();
    let mut source = NvmlGpuSource::new(Some(lib_path()), Duration::from_secs(60));
    let reading = source.sample(true);
    assert!(reading.devices[0].processes_steady, "{reading:?}");
    // The memory call is held (the lists before it are read by then); the state changes while
    // it waits, and the change lets it go.
    let memory = "nvmlDeviceGetMemoryInfo_v2";
    fake.write(&format!("{}hold {memory}\n", one(7)));
    let called = fake.calls(memory);
    let reading = std::thread::scope(|s| {
        s.spawn(|| {
            fake.wait_for_calls(memory, called + 1);
            fake.write(&one(10));
        });
        source.sample(true)
    });
    let gpu = &reading.devices[0];
    assert_eq!(gpu.used_bytes, Some(10 * GIB), "{gpu:?}");
    assert!(!gpu.processes_steady, "{gpu:?}");
    // Without the lists, nothing is claimed steady.
    let reading = source.sample(false);
    assert!(!reading.devices[0].processes_steady);

    // A-B-A: 7 GiB listed before, 4 GiB in use while the memory figures are read (a request
    // finished), 7 GiB listed after (another started). The lists agree, but they hold more
    // than the card had in use at that moment: not steady either.
    // The memory call held until the 4 GiB state is in, the utilisation call (between it and
    // the lists after) until the 7 GiB one is.
    let utilisation = "nvmlDeviceGetUtilizationRates";
    fake.write(&format!("{}hold {memory}\n", one(7)));
    let called = (fake.calls(memory), fake.calls(utilisation));
    let reading = std::thread::scope(|s| {
        s.spawn(|| {
            fake.wait_for_calls(memory, called.0 + 1);
            fake.write(&format!("{}hold {utilisation}\n", one(4)));
            fake.wait_for_calls(utilisation, called.1 + 1);
            fake.write(&one(7));
        });
        source.sample(true)
    });
    let gpu = &reading.devices[0];
    assert_eq!(gpu.used_bytes, Some(4 * GIB), "{gpu:?}");
    assert_eq!(gpu.processes.get(&4242), Some(&Some(7 * GIB)), "{gpu:?}");
    assert!(!gpu.processes_steady, "{gpu:?}");
}

/// A row that lags `used`: memory NVML counts used but lists under no process moves (a worker
/// allocated, its row does not say so yet). The per-process figures are not set against free
/// memory until the row catches up (`sample::unattributed`); the driver's own few hundred MiB,
/// steady, are no reason to distrust them.
#[test]
fn a_process_row_that_lags_used_makes_the_reading_unsteady_until_it_catches_up() {
    let state = |used_mib: u64, listed_mib: u64| {
        format!(
            "device 0 uuid=GPU-a total={} used={}\nprocess 0 4242 {}\n",
            16 * GIB,
            used_mib << 20,
            listed_mib << 20
        )
    };
    let fake = Fake::new(&state(4096 + 300, 4096));
    let mut source = NvmlGpuSource::new(Some(lib_path()), Duration::from_secs(60));
    assert!(source.sample(true).devices[0].processes_steady);
    fake.write(&state(4096 + 300 + 2048, 4096));
    let gpu = &source.sample(true).devices[0];
    assert!(!gpu.processes_steady, "{gpu:?}");
    fake.write(&state(4096 + 300 + 2048, 4096 + 2048));
    assert!(source.sample(true).devices[0].processes_steady);
}

/// Any state the fake can be given (the daemon's source reads it state after state, as the
/// daemon's does: it re-initialises NVML when an answer calls for it) is sampled without
/// panicking, and the policy takes whatever came of it. 128 cases, or `PROPTEST_CASES`.
#[test]
fn any_nvml_state_is_sampled_without_panicking() {
    let fake = Fake::new("");
    // One source for every case (the runner's closure is `Fn`: the source sits in a Mutex).
    let source = std::sync::Mutex::new(NvmlGpuSource::new(Some(lib_path()), Duration::ZERO));
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(128);
    let mut runner = TestRunner::new(ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let result = runner.run(&prop::collection::vec(nvml_line(), 0..12), |lines| {
        let mut source = source.lock().unwrap_or_else(|e| e.into_inner());
        fake.write(&lines.join("\n"));
        for processes in [true, false] {
            let reading = source.sample(processes);
            prop_assert!(reading.devices.len() <= 256 + 64);
            // And the policy takes whatever came of it, acting on no GPU it cannot trust.
            let snapshot = Snapshot {
                host: HostMemory {
                    total_bytes: Some(64 << 30),
                    available_bytes: Some(32 << 30),
                    ..Default::default()
                },
                gpus: GpuSnapshot {
                    status: reading.status.clone(),
                    sampled_at: Some(Duration::ZERO),
                    stale: false,
                    devices: reading.devices.clone(),
                    process_lists_read: 1,
                    processes_fresh: reading.read_processes,
                    absent: reading.absent,
                },
                processes: ProcessTable {
                    pss_read: true,
                    scanned_at: Some(Duration::ZERO),
                    processes: Vec::new(),
                },
                ..Default::default()
            };
            let config =
                Config::parse("[gpu]\nmin_free = \"1GiB\"\n", Path::new("c.toml")).unwrap();
            evaluate(
                &config,
                &snapshot,
                &Launches::default(),
                &mut PolicyState::default(),
            );
        }
        source.take_xids();
        Ok(())
    });
    result.unwrap();
}

/// A driver tells an event set only of the Xids raised after it registered. The listener
/// registers before init returns, so an Xid raised right after the first reading (the sampler's
/// next reading sees it first) reaches it; registered later, it was lost (the fake numbers an
/// Xid when the library first reads it, as the driver's queue would have it by then).
#[test]
fn an_xid_right_after_init_reaches_the_listener() {
    let gpu = format!("device 0 uuid=GPU-a total={} used={}\n", 16 * GIB, GIB);
    // Registering takes a while (300 ms): long enough for the Xid below to come first, were
    // init to return before the listener registered.
    let fake = Fake::new(&format!("{gpu}delay nvmlDeviceRegisterEvents 300\n"));
    let mut source = NvmlGpuSource::new(Some(lib_path()), Duration::from_secs(60));
    assert_eq!(source.sample(false).devices.len(), 1);
    fake.write(&format!("{gpu}xid 0 79 id=1\n"));
    source.sample(false);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut seen = Vec::new();
    while seen.is_empty() && std::time::Instant::now() < deadline {
        seen = source.take_xids();
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(seen.len(), 1, "the Xid never reached the listener");
    assert_eq!((seen[0].gpu, seen[0].xid), (Some(0), 79));
}

/// A number as a state file might hold one (as `number` in tests/integration/properties.rs).
fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u64..=u64::MAX).prop_map(|n| n.to_string()),
        (0u64..100_000).prop_map(|n| n.to_string()),
        Just("-1".to_string()),
        "[a-z0-9]{0,4}",
    ]
}

/// One line of a fake NVML state: devices, processes, injected errors, counts, garbage.
fn nvml_line() -> impl Strategy<Value = String> {
    let device_key = prop::sample::select(vec![
        "total", "used", "free", "reserved", "util", "memutil", "temp", "name", "uuid",
    ]);
    let functions = prop::sample::select(vec![
        "*",
        "nvmlInit_v2",
        "nvmlDeviceGetCount_v2",
        "nvmlDeviceGetHandleByIndex_v2",
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetName",
        "nvmlDeviceGetUtilizationRates",
    ]);
    let code = prop::sample::select(vec![1u32, 2, 3, 7, 9, 10, 15, 16, 18, 999]);
    prop_oneof![
        (0u32..6, prop::collection::vec((device_key, number()), 0..6)).prop_map(|(i, kv)| {
            let kv: Vec<String> = kv.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
            format!("device {i} {}", kv.join(" "))
        }),
        (
            0u32..6,
            0u32..=u32::MAX,
            prop_oneof![number(), Just("NA".to_string())],
            prop::sample::select(vec!["", " graphics"])
        )
            .prop_map(|(g, pid, b, kind)| format!("process {g} {pid} {b}{kind}")),
        (functions, code, prop::option::of(0u32..6)).prop_map(|(f, c, g)| match g {
            Some(g) => format!("error {f} {c} gpu={g}"),
            None => format!("error {f} {c}"),
        }),
        (0u32..6, 0u32..=u32::MAX).prop_map(|(g, n)| format!("process_count {g} {n}")),
        (0u32..=u32::MAX).prop_map(|n| format!("device_count {n}")),
        prop_oneof![Just(0u32), Just(70), 0u32..=u32::MAX]
            .prop_map(|n| format!("device_count {n}")),
        ".{0,60}",
    ]
}

/// Two 16 GiB GPUs, GPU-aaaa and GPU-bbbb, with what follows.
fn two_gpus(rest: &str) -> String {
    format!(
        "device 0 uuid=GPU-aaaa total={} used={}\ndevice 1 uuid=GPU-bbbb total={} used={}\n{rest}",
        16 * GIB,
        GIB,
        16 * GIB,
        GIB
    )
}

fn unavailable(reading: &gpuguard::sample::nvml::GpuReading) -> String {
    match &reading.status {
        gpuguard::snapshot::GpuStatus::Unavailable(why) => why.clone(),
        other => panic!("not unavailable: {other:?} {reading:?}"),
    }
}

/// NVML that cannot start says why (no library at all, no driver, a driver/library mismatch),
/// and the source retries init: once the driver answers, the GPUs are read. No library means no
/// GPU here (`absent`: a GPU request is refused at once); a driver not loaded yet (at boot) or a
/// mismatch leaves the GPUs unknown (they may be there). Moved from the host suite
/// (`gpu_guard`), where a daemon was started for each.
#[test]
fn nvml_that_cannot_start_says_why_and_the_retry_picks_the_gpus_up() {
    let mut none = NvmlGpuSource::new(
        Some("/nonexistent/libnvidia-ml.so.1".into()),
        Duration::from_secs(60),
    );
    for _ in 0..2 {
        // Again within `retry_init`: the same answer, from the last attempt.
        let reading = none.sample(true);
        let why = unavailable(&reading);
        assert!(why.contains("NVML library not loadable"), "{why}");
        assert!(reading.absent, "{why}");
    }

    let fake = Fake::new("");
    std::fs::remove_file(&fake.state).unwrap();
    let mut source = NvmlGpuSource::new(Some(lib_path()), Duration::ZERO);
    let reading = source.sample(true);
    let why = unavailable(&reading);
    assert!(why.contains("NVIDIA driver not loaded"), "{why}");
    assert!(!reading.absent, "the module may load later: {why}");
    fake.write(&two_gpus(""));
    let reading = source.sample(true);
    assert_eq!(reading.status, gpuguard::snapshot::GpuStatus::Ok);
    assert_eq!(reading.devices.len(), 2, "{reading:?}");
    assert!(!reading.absent);
    // The driver gone from under GPUs seen (a reload, a fault): they are unknown, not absent.
    fake.write(&two_gpus("error nvmlDeviceGetCount_v2 9\n"));
    let reading = source.sample(true);
    let why = unavailable(&reading);
    assert!(why.contains("device count failed"), "{why}");
    assert!(!reading.absent, "{why}");
    let reading = source.sample(true);
    assert!(!reading.absent, "{:?}", reading.status);

    fake.write(&two_gpus("error nvmlInit_v2 18\n"));
    let mut source = NvmlGpuSource::new(Some(lib_path()), Duration::ZERO);
    let reading = source.sample(true);
    let why = unavailable(&reading);
    assert!(why.contains("NVML/driver version mismatch"), "{why}");
    assert!(!reading.absent, "the GPUs are there, unknown: {why}");
    fake.write(&two_gpus(""));
    let reading = source.sample(true);
    assert_eq!(reading.status, gpuguard::snapshot::GpuStatus::Ok);
    assert_eq!(reading.devices.len(), 2, "{reading:?}");
}

/// A process whose memory NVML reports as NA is listed with its memory unknown (`None`), not
/// as 0. Moved from the host suite (`gpu_guard::unavailable_gpu_memory_never_leads_to_a_kill`).
#[test]
fn na_process_memory_is_unknown_not_zero() {
    let _fake = Fake::new(&two_gpus("process 0 4242 NA\nprocess 1 4343 1073741824\n"));
    let mut source = NvmlGpuSource::new(Some(lib_path()), Duration::ZERO);
    let reading = source.sample(true);
    assert_eq!(
        reading.devices[0].processes.get(&4242),
        Some(&None),
        "{reading:?}"
    );
    assert_eq!(reading.devices[1].processes.get(&4343), Some(&Some(GIB)));
    assert!(reading.devices[0].processes_known);
}

/// A GPU that answers GPU_IS_LOST, or that leaves NVML's device list, is reported lost under the
/// uuid it had; back, it is read again. Moved from the host suite (`faults`: a stopped victim
/// outlives its lost GPU, both ways).
#[test]
fn a_gpu_that_is_lost_or_leaves_the_list_is_reported_lost_with_its_uuid() {
    let fake = Fake::new(&two_gpus(""));
    let mut source = NvmlGpuSource::new(Some(lib_path()), Duration::ZERO);
    assert!(source.sample(true).devices.iter().all(|g| !g.lost));
    for lose in [
        two_gpus("error * 15 gpu=1\n"),
        format!("device 0 uuid=GPU-aaaa total={} used={}\n", 16 * GIB, GIB),
    ] {
        fake.write(&lose);
        let reading = source.sample(true);
        assert_eq!(reading.status, gpuguard::snapshot::GpuStatus::Ok);
        assert_eq!(reading.devices.len(), 2, "{lose}: {reading:?}");
        let gpu = &reading.devices[1];
        assert!(gpu.lost, "{lose}: {gpu:?}");
        assert_eq!((gpu.index, gpu.uuid.as_str()), (1, "GPU-bbbb"), "{lose}");
        assert_eq!(gpu.free_bytes, None, "{lose}: {gpu:?}");
        assert!(!reading.devices[0].lost);
        fake.write(&two_gpus(""));
        assert!(source.sample(true).devices.iter().all(|g| !g.lost));
    }
}

/// Counts no host has (4294967295 GPUs, 4294967290 processes on one GPU) are not believed: the
/// readings are unavailable, the list unknown (not an empty list); the same source reads NVML
/// again once it makes sense. Moved from the host suite (`faults`).
#[test]
fn implausible_nvml_counts_are_unknown_and_the_same_source_reads_sense_again() {
    let healthy = format!(
        "device 0 uuid=GPU-aaaa total={} used={}\nprocess 0 4242 {}\n",
        16 * GIB,
        8 * GIB,
        6 * GIB
    );
    let fake = Fake::new(&format!("{healthy}device_count 4294967295\n"));
    let mut source = NvmlGpuSource::new(Some(lib_path()), Duration::ZERO);
    let reading = source.sample(true);
    let why = unavailable(&reading);
    assert!(why.contains("4294967295 GPUs"), "{why}");
    assert!(reading.devices.is_empty());

    fake.write(&format!("{healthy}process_count 0 4294967290\n"));
    let gpu = source.sample(true).devices[0].clone();
    assert!(!gpu.processes_known, "{gpu:?}");
    assert!(gpu.processes.is_empty(), "{gpu:?}");
    assert_eq!(gpu.free_bytes, Some(8 * GIB));

    fake.write(&healthy);
    let reading = source.sample(true);
    assert_eq!(reading.status, gpuguard::snapshot::GpuStatus::Ok);
    let gpu = &reading.devices[0];
    assert!(gpu.processes_known, "{gpu:?}");
    assert_eq!(gpu.processes.get(&4242), Some(&Some(6 * GIB)));
}
