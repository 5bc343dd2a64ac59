//! The NVML sampler (`NvmlGpuSource`) in process against the scripted fake library: what it
//! reads and how it judges a reading. (A test binary of its own: NVML and the fake's state
//! variable are process-wide.)

use std::path::Path;
use std::time::Duration;

const GIB: u64 = 1 << 30;

/// Issue #12: the process lists are read around the memory figures, and a change in between
/// (something allocated while NVML was being read) marks the reading unsteady, so permits never
/// set free memory from one moment against per-process figures from another.
#[test]
fn process_lists_that_change_around_the_memory_reading_are_not_steady() {
    use gpuguard::sample::nvml::{GpuSource, NvmlGpuSource};
    let one = |used: u64| {
        format!(
            "device 0 uuid=GPU-a total={} used={}\nprocess 0 4242 {}\n",
            16 * GIB,
            used * GIB,
            used * GIB
        )
    };
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let write = |text: &str| {
        let tmp = dir.path().join("state.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &state).unwrap();
    };
    write(&one(4));
    // This binary runs this one test: the process-wide variable is its own.
    std::env::set_var("FAKE_NVML_STATE", &state);
    let lib = Path::new(env!("GPUGUARD_FAKE_NVML_DIR")).join("libnvidia-ml.so.1");
    let mut source = NvmlGpuSource::new(Some(lib), Duration::from_secs(60));
    let reading = source.sample(true);
    assert!(reading.devices[0].processes_steady, "{reading:?}");
    // The memory call takes 300 ms; the state changes while it runs.
    write(&format!("{}delay nvmlDeviceGetMemoryInfo_v2 300\n", one(7)));
    let (state2, dir2) = (state.clone(), dir.path().to_path_buf());
    let changer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        let tmp = dir2.join("state.tmp2");
        std::fs::write(
            &tmp,
            format!("{}delay nvmlDeviceGetMemoryInfo_v2 300\n", one(10)),
        )
        .unwrap();
        std::fs::rename(&tmp, &state2).unwrap();
    });
    let reading = source.sample(true);
    changer.join().unwrap();
    let gpu = &reading.devices[0];
    assert!(!gpu.processes_steady, "{gpu:?}");
    // Without the lists, nothing is claimed steady.
    let reading = source.sample(false);
    assert!(!reading.devices[0].processes_steady);

    // A-B-A: 7 GiB listed before, 4 GiB in use while the memory figures are read (a request
    // finished), 7 GiB listed after (another started). The lists agree, but they hold more
    // than the card had in use at that moment: not steady either.
    let slow = "delay nvmlDeviceGetMemoryInfo_v2 300\ndelay nvmlDeviceGetUtilizationRates 300\n";
    write(&format!("{}{slow}", one(7)));
    let (state3, dir3) = (state.clone(), dir.path().to_path_buf());
    let changer = std::thread::spawn(move || {
        for (at_ms, used) in [(150, 4), (300, 7)] {
            std::thread::sleep(Duration::from_millis(at_ms));
            let tmp = dir3.join("state.tmp3");
            std::fs::write(&tmp, format!("{}{slow}", one(used))).unwrap();
            std::fs::rename(&tmp, &state3).unwrap();
        }
    });
    let reading = source.sample(true);
    changer.join().unwrap();
    let gpu = &reading.devices[0];
    assert_eq!(gpu.used_bytes, Some(4 * GIB), "{gpu:?}");
    assert_eq!(gpu.processes.get(&4242), Some(&Some(7 * GIB)), "{gpu:?}");
    assert!(!gpu.processes_steady, "{gpu:?}");
}
