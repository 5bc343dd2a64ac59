//! Drives the scripted fake `libnvidia-ml.so.1` (tests/fake_nvml, built by crates/fake-nvml) through the
//! real `nvml-wrapper` crate, so the fake is known to speak the ABI the wrapper expects.
//!
//! Every test holds the binary's one lock on `FAKE_NVML_STATE` (through `crate::Fake`).

use std::time::{Duration, Instant};

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;

use crate::{lib_path, Fake, GIB};

fn init() -> Result<Nvml, NvmlError> {
    let lib = lib_path();
    Nvml::builder().lib_path(lib.as_os_str()).init()
}

const TWO_GPUS: &str = r#"
# two GPUs, a few processes
driver_version 550.54.15
device 0 name="Fake H100" uuid=GPU-00000000-0000-0000-0000-000000000000 total=85899345920 used=1073741824 util=35 memutil=10 temp=40
device 1 name=FakeL4 uuid=GPU-11111111-1111-1111-1111-111111111111 total=24000000000 used=0 util=0 memutil=0 temp=30

process 0 12345 4294967296            # gpu index, pid, used bytes (compute list)
process 0 12346 NA                    # usedGpuMemory unavailable
process 1 12347 1048576 graphics      # graphics list
"#;

#[test]
fn init_fails_with_driver_not_loaded_without_state() {
    let fake = Fake::new(TWO_GPUS);

    std::env::remove_var("FAKE_NVML_STATE");
    assert!(matches!(init(), Err(NvmlError::DriverNotLoaded)));

    std::env::set_var("FAKE_NVML_STATE", fake.dir.path().join("missing"));
    assert!(matches!(init(), Err(NvmlError::DriverNotLoaded)));

    std::env::set_var("FAKE_NVML_STATE", &fake.state);
    let nvml = init().expect("init with a state file");
    assert_eq!(nvml.device_count().unwrap(), 2);
}

#[test]
fn init_error_injection() {
    let fake = Fake::new("device 0\nerror nvmlInit_v2 18\n");
    assert!(matches!(init(), Err(NvmlError::LibRmVersionMismatch)));
    fake.write("device 0\n");
    assert!(init().is_ok());
}

#[test]
fn devices_memory_utilization_temperature() {
    let _fake = Fake::new(TWO_GPUS);
    let nvml = init().unwrap();

    assert_eq!(nvml.sys_driver_version().unwrap(), "550.54.15");
    assert_eq!(nvml.device_count().unwrap(), 2);

    let d0 = nvml.device_by_index(0).unwrap();
    assert_eq!(d0.index().unwrap(), 0);
    assert_eq!(d0.name().unwrap(), "Fake H100");
    assert_eq!(
        d0.uuid().unwrap(),
        "GPU-00000000-0000-0000-0000-000000000000"
    );
    let mem = d0.memory_info().unwrap();
    assert_eq!(mem.total, 85_899_345_920);
    assert_eq!(mem.used, GIB);
    assert_eq!(mem.free, 85_899_345_920 - GIB);
    assert_eq!(mem.reserved, 0);
    let util = d0.utilization_rates().unwrap();
    assert_eq!((util.gpu, util.memory), (35, 10));
    assert_eq!(d0.temperature(TemperatureSensor::Gpu).unwrap(), 40);
    assert!(d0
        .supported_event_types()
        .unwrap()
        .contains(EventTypes::CRITICAL_XID_ERROR));

    let d1 = nvml
        .device_by_uuid("GPU-11111111-1111-1111-1111-111111111111")
        .unwrap();
    assert_eq!(d1.index().unwrap(), 1);
    assert_eq!(d1.name().unwrap(), "FakeL4");
    let mem = d1.memory_info().unwrap();
    assert_eq!(
        (mem.total, mem.used, mem.free),
        (24_000_000_000, 0, 24_000_000_000)
    );
    assert!(matches!(
        nvml.device_by_uuid("GPU-nope"),
        Err(NvmlError::NotFound)
    ));
    assert!(matches!(
        nvml.device_by_index(2),
        Err(NvmlError::InvalidArg)
    ));
}

#[test]
fn process_lists() {
    let mut state = String::from(TWO_GPUS);
    state.push_str("device 2 total=1000\n");
    for pid in 0..100u32 {
        state.push_str(&format!("process 2 {} {}\n", 20_000 + pid, pid * 10));
    }
    let _fake = Fake::new(&state);
    let nvml = init().unwrap();

    let d0 = nvml.device_by_index(0).unwrap();
    let procs = d0.running_compute_processes().unwrap();
    let got: Vec<(u32, UsedGpuMemory)> = procs
        .iter()
        .map(|p| (p.pid, p.used_gpu_memory.clone()))
        .collect();
    assert_eq!(
        got,
        vec![
            (12345, UsedGpuMemory::Used(4 * GIB)),
            (12346, UsedGpuMemory::Unavailable)
        ]
    );
    assert_eq!(procs[0].gpu_instance_id, None);
    assert_eq!(procs[0].compute_instance_id, None);
    assert_eq!(d0.running_compute_processes_count().unwrap(), 2);
    assert!(d0.running_graphics_processes().unwrap().is_empty());

    let d1 = nvml.device_by_index(1).unwrap();
    assert!(d1.running_compute_processes().unwrap().is_empty());
    let gfx = d1.running_graphics_processes().unwrap();
    assert_eq!(gfx.len(), 1);
    assert_eq!(gfx[0].pid, 12347);
    assert_eq!(gfx[0].used_gpu_memory, UsedGpuMemory::Used(1_048_576));

    let d2 = nvml.device_by_index(2).unwrap();
    let many = d2.running_compute_processes().unwrap();
    assert_eq!(many.len(), 100);
    assert_eq!(many[99].pid, 20_099);
    assert_eq!(many[99].used_gpu_memory, UsedGpuMemory::Used(990));
}

#[test]
fn per_gpu_error_injection() {
    let fake = Fake::new(&format!(
        "{TWO_GPUS}\nerror nvmlDeviceGetMemoryInfo_v2 15 gpu=1\nerror nvmlDeviceGetComputeRunningProcesses_v3 999\n"
    ));
    let nvml = init().unwrap();
    let d0 = nvml.device_by_index(0).unwrap();
    let d1 = nvml.device_by_index(1).unwrap();

    assert!(matches!(d1.memory_info(), Err(NvmlError::GpuLost)));
    assert_eq!(d0.memory_info().unwrap().used, GIB);
    assert_eq!(d1.name().unwrap(), "FakeL4"); // only the named function fails
    assert!(matches!(
        d0.running_compute_processes(),
        Err(NvmlError::Unknown)
    ));
    assert!(matches!(
        d1.running_compute_processes(),
        Err(NvmlError::Unknown)
    ));
    assert!(d1.running_graphics_processes().is_ok());

    // `*` makes every call about GPU 1 fail: a GPU that fell off the bus.
    fake.write(&format!("{TWO_GPUS}\nerror * 15 gpu=1\n"));
    assert!(matches!(d1.name(), Err(NvmlError::GpuLost)));
    assert!(matches!(d1.utilization_rates(), Err(NvmlError::GpuLost)));
    assert!(matches!(nvml.device_by_index(1), Err(NvmlError::GpuLost)));
    assert!(d0.utilization_rates().is_ok());
    assert_eq!(nvml.device_count().unwrap(), 2);

    fake.write(&format!("{TWO_GPUS}\nerror nvmlDeviceGetCount_v2 16\n"));
    assert!(matches!(nvml.device_count(), Err(NvmlError::ResetRequired)));
}

#[test]
fn state_changes_are_seen_between_calls() {
    let fake = Fake::new("device 0 total=1000 used=100\nprocess 0 42 100\n");
    let nvml = init().unwrap();
    assert_eq!(nvml.device_count().unwrap(), 1);
    let d0 = nvml.device_by_index(0).unwrap();
    assert_eq!(d0.memory_info().unwrap().free, 900);
    assert_eq!(d0.running_compute_processes().unwrap().len(), 1);

    fake.write("device 0 total=1000 used=700\nprocess 0 42 100\nprocess 0 43 600\ndevice 1\n");
    assert_eq!(d0.memory_info().unwrap().free, 300);
    let pids: Vec<u32> = d0
        .running_compute_processes()
        .unwrap()
        .iter()
        .map(|p| p.pid)
        .collect();
    assert_eq!(pids, vec![42, 43]);
    assert_eq!(nvml.device_count().unwrap(), 2);

    // A device that vanished from the file is lost.
    fake.write("device 1\n");
    assert!(matches!(d0.memory_info(), Err(NvmlError::GpuLost)));
}

#[test]
fn xid_event_delivered_once_to_every_set_registered_for_it() {
    // An Xid raised before a set registered is not that set's news, as with a driver.
    let fake = Fake::new(&format!("{TWO_GPUS}\nxid 1 31 id=1\n"));
    let nvml = init().unwrap();
    let d0 = nvml.device_by_index(0).unwrap();
    let d1 = nvml.device_by_index(1).unwrap();

    let set0 = d0
        .register_events(
            EventTypes::CRITICAL_XID_ERROR,
            nvml.create_event_set().unwrap(),
        )
        .unwrap();
    let set = d1
        .register_events(
            EventTypes::CRITICAL_XID_ERROR | EventTypes::PSTATE_CHANGE,
            nvml.create_event_set().unwrap(),
        )
        .unwrap();
    // A second listener on the same GPU (another thread or process of the driver's).
    let other = d1
        .register_events(
            EventTypes::CRITICAL_XID_ERROR,
            nvml.create_event_set().unwrap(),
        )
        .unwrap();
    assert!(matches!(set.wait(20), Err(NvmlError::Timeout)));

    fake.write(&format!("{TWO_GPUS}\nxid 1 31 id=1\nxid 1 79 id=2\n"));
    let ev = set.wait(1000).unwrap();
    assert_eq!(ev.event_type, EventTypes::CRITICAL_XID_ERROR);
    assert_eq!(ev.event_data, Some(XidError::Value(79)));
    assert_eq!(ev.device.index().unwrap(), 1);
    assert_eq!(
        ev.device.uuid().unwrap(),
        "GPU-11111111-1111-1111-1111-111111111111"
    );
    // The other set has its own queue: taking the event from one leaves it in the other.
    assert_eq!(
        other.wait(1000).unwrap().event_data,
        Some(XidError::Value(79))
    );
    // Registered for GPU 0 only: the Xid on GPU 1 is not delivered to this set.
    assert!(matches!(set0.wait(50), Err(NvmlError::Timeout)));

    let start = Instant::now();
    assert!(matches!(set.wait(100), Err(NvmlError::Timeout)));
    assert!(start.elapsed() >= Duration::from_millis(100));

    // A new id is a new event, even for the same GPU and Xid; the old one stays delivered.
    fake.write(&format!(
        "{TWO_GPUS}\nxid 1 31 id=1\nxid 1 79 id=2\nxid 1 79 id=3\n"
    ));
    assert_eq!(
        set.wait(1000).unwrap().event_data,
        Some(XidError::Value(79))
    );
    assert!(matches!(set.wait(20), Err(NvmlError::Timeout)));
    set.release_events().unwrap();
    drop((set0, other));
}

#[test]
fn xid_written_while_waiting_is_delivered_to_each_waiter() {
    let fake = Fake::new(TWO_GPUS);
    let nvml = init().unwrap();
    let d0 = nvml.device_by_index(0).unwrap();
    let register = || {
        d0.register_events(
            EventTypes::CRITICAL_XID_ERROR,
            nvml.create_event_set().unwrap(),
        )
        .unwrap()
    };
    // Two waiters at once, as when an earlier listener (a sampler being dropped) still waits.
    let (set, earlier) = (register(), register());

    fake.log_calls();
    let (ev, earlier_ev) = std::thread::scope(|s| {
        let earlier = s.spawn(move || earlier.wait(60_000).map(|e| e.event_data));
        s.spawn(|| {
            // Both waiters are in the wait (each logged as it came) before the Xid is written.
            fake.wait_for_calls("nvmlEventSetWait_v2", 2);
            fake.write(&format!("{TWO_GPUS}\nxid 0 48 id=7\n"));
        });
        (set.wait(60_000), earlier.join().unwrap())
    });
    assert_eq!(ev.unwrap().event_data, Some(XidError::Value(48)));
    assert_eq!(earlier_ev.unwrap(), Some(XidError::Value(48)));
}

#[test]
fn delay_injection_slows_the_call() {
    let fake = Fake::new(&format!(
        "{TWO_GPUS}\ndelay nvmlDeviceGetMemoryInfo_v2 300 gpu=0\n"
    ));
    let nvml = init().unwrap();
    let d0 = nvml.device_by_index(0).unwrap();
    let d1 = nvml.device_by_index(1).unwrap();

    let start = Instant::now();
    assert_eq!(d0.memory_info().unwrap().used, GIB);
    assert!(start.elapsed() >= Duration::from_millis(300));

    // GPU 1's figures come as written (its delay, none, is not measured here).
    assert_eq!(d1.memory_info().unwrap().used, 0);

    // The process list is two calls: each one sleeps.
    fake.write(&format!(
        "{TWO_GPUS}\ndelay nvmlDeviceGetComputeRunningProcesses_v3 200\n"
    ));
    let start = Instant::now();
    assert_eq!(d0.running_compute_processes().unwrap().len(), 2);
    assert!(start.elapsed() >= Duration::from_millis(400));
}

#[test]
fn malformed_lines_are_ignored_and_defaults_apply() {
    let long = "x".repeat(5000);
    let state = format!(
        r#"
garbage line
device
device 99999 total=1
device 0 total=12abc
device 0 name="unterminated
device 0 frobnicate=1
process 0
process 0 1 -5
process 0 2 3 sideways
error nvmlDeviceGetName
error nvmlDeviceGetName banana
xid 0
delay nvmlDeviceGetName 9999999999
{long}
device 0 total=2000 used=500 reserved=100    # the only good device line for GPU 0
device 2 name="Third # not a comment"
process 0 77 5
"#
    );
    let _fake = Fake::new(&state);
    let nvml = init().unwrap();

    assert_eq!(nvml.sys_driver_version().unwrap(), "550.54.15"); // the default
    assert_eq!(nvml.device_count().unwrap(), 3); // highest index + 1
    let d0 = nvml.device_by_index(0).unwrap();
    assert_eq!(d0.name().unwrap(), "Fake GPU 0");
    assert_eq!(
        d0.uuid().unwrap(),
        "GPU-00000000-0000-0000-0000-000000000000"
    );
    let mem = d0.memory_info().unwrap();
    assert_eq!(
        (mem.total, mem.reserved, mem.used, mem.free),
        (2000, 100, 500, 1400)
    );
    let util = d0.utilization_rates().unwrap();
    assert_eq!((util.gpu, util.memory), (0, 0));
    let procs = d0.running_compute_processes().unwrap();
    assert_eq!(procs.len(), 1);
    assert_eq!(procs[0].pid, 77);

    // A gap in the indices is a lost GPU.
    assert!(matches!(nvml.device_by_index(1), Err(NvmlError::GpuLost)));
    let d2 = nvml.device_by_index(2).unwrap();
    assert_eq!(d2.name().unwrap(), "Third # not a comment");
    assert_eq!(
        d2.uuid().unwrap(),
        "GPU-00000000-0000-0000-0000-000000000002"
    );
}

#[test]
fn call_log() {
    let fake = Fake::new(TWO_GPUS);
    let log = fake.dir.path().join("calls.log");
    std::env::set_var("FAKE_NVML_LOG", &log);
    let result = std::panic::catch_unwind(|| {
        let nvml = init().unwrap();
        let d1 = nvml.device_by_index(1).unwrap();
        d1.running_compute_processes().unwrap();
    });
    std::env::remove_var("FAKE_NVML_LOG");
    result.unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines,
        vec![
            "nvmlInit_v2 -",
            "nvmlSystemGetDriverVersion -",
            "nvmlDeviceGetHandleByIndex_v2 1",
            "nvmlDeviceGetComputeRunningProcesses_v3 1", // count: none, so one call
            "nvmlShutdown -",
        ]
    );
}

/// The raw C ABI, below the wrapper: the two-call protocol's edge cases and the struct version.
mod raw {
    use super::*;
    use std::ffi::{c_char, c_uint, c_void, CString};

    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct ProcessInfo {
        pid: c_uint,
        used_gpu_memory: u64,
        gpu_instance_id: c_uint,
        compute_instance_id: c_uint,
    }

    #[repr(C)]
    #[derive(Default)]
    struct MemoryV2 {
        version: c_uint,
        total: u64,
        reserved: u64,
        free: u64,
        used: u64,
    }

    type Device = *mut c_void;
    type InitFn = unsafe extern "C" fn() -> i32;
    type HandleFn = unsafe extern "C" fn(c_uint, *mut Device) -> i32;
    type ProcsFn = unsafe extern "C" fn(Device, *mut c_uint, *mut ProcessInfo) -> i32;
    type MemFn = unsafe extern "C" fn(Device, *mut MemoryV2) -> i32;
    type NameFn = unsafe extern "C" fn(Device, *mut c_char, c_uint) -> i32;

    struct Lib(*mut c_void);

    impl Lib {
        fn open() -> Lib {
            let path = CString::new(lib_path().into_os_string().into_encoded_bytes()).unwrap();
            // SAFETY: plain dlopen of our own fixture.
            let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            assert!(!handle.is_null(), "dlopen {}", lib_path().display());
            Lib(handle)
        }

        /// # Safety
        /// `T` must be the symbol's function pointer type.
        unsafe fn sym<T: Copy>(&self, name: &str) -> T {
            let cname = CString::new(name).unwrap();
            let p = libc::dlsym(self.0, cname.as_ptr());
            assert!(!p.is_null(), "missing symbol {name}");
            std::mem::transmute_copy(&p)
        }
    }

    impl Drop for Lib {
        fn drop(&mut self) {
            // SAFETY: handle from dlopen, closed once.
            unsafe { libc::dlclose(self.0) };
        }
    }

    #[test]
    fn layouts_match_nvml_notes() {
        assert_eq!(std::mem::size_of::<ProcessInfo>(), 24);
        assert_eq!(std::mem::size_of::<MemoryV2>(), 40);
    }

    #[test]
    fn two_call_protocol_and_struct_version() {
        let _fake = Fake::new(TWO_GPUS);
        let lib = Lib::open();
        // SAFETY: signatures as in NVML-NOTES.md; buffers sized as passed.
        unsafe {
            let init: InitFn = lib.sym("nvmlInit_v2");
            let shutdown: InitFn = lib.sym("nvmlShutdown");
            let handle: HandleFn = lib.sym("nvmlDeviceGetHandleByIndex_v2");
            let procs: ProcsFn = lib.sym("nvmlDeviceGetComputeRunningProcesses_v3");
            let mem: MemFn = lib.sym("nvmlDeviceGetMemoryInfo_v2");
            let name: NameFn = lib.sym("nvmlDeviceGetName");

            let mut dev: Device = std::ptr::null_mut();
            assert_eq!(handle(0, &mut dev), 1, "UNINITIALIZED before init");
            assert_eq!(init(), 0);
            assert_eq!(handle(0, &mut dev), 0);

            let mut count: c_uint = 0;
            assert_eq!(procs(dev, &mut count, std::ptr::null_mut()), 7);
            assert_eq!(count, 2);
            let mut buf = [ProcessInfo::default(); 4];
            count = 1;
            assert_eq!(procs(dev, &mut count, buf.as_mut_ptr()), 7, "too small");
            assert_eq!(count, 2);
            count = 4;
            assert_eq!(procs(dev, &mut count, buf.as_mut_ptr()), 0);
            assert_eq!(count, 2);
            assert_eq!((buf[0].pid, buf[0].used_gpu_memory), (12345, 4 * GIB));
            assert_eq!((buf[1].pid, buf[1].used_gpu_memory), (12346, u64::MAX));
            assert_eq!(buf[1].gpu_instance_id, u32::MAX);

            let mut d1: Device = std::ptr::null_mut();
            assert_eq!(handle(1, &mut d1), 0);
            count = 0;
            assert_eq!(procs(d1, &mut count, std::ptr::null_mut()), 0, "none");
            assert_eq!(count, 0);

            let mut m = MemoryV2::default();
            assert_eq!(mem(dev, &mut m), 25, "version 0 is a version mismatch");
            m.version = 40 | (2 << 24);
            assert_eq!(mem(dev, &mut m), 0);
            assert_eq!(
                (m.total, m.used, m.free),
                (85_899_345_920, GIB, 85_899_345_920 - GIB)
            );

            let mut small = [0 as c_char; 4];
            assert_eq!(name(dev, small.as_mut_ptr(), 4), 7);
            assert_eq!(mem(0x1234 as Device, &mut m), 2, "bad handle");

            assert_eq!(shutdown(), 0);
        }
    }
}

#[test]
fn fault_injection_free_override_device_count_and_claimed_process_count() {
    let fake = Fake::new(
        "device 0 total=1000 used=900 free=800\nprocess 0 7 10\nprocess_count 0 4294967290\ndevice_count 3\n",
    );
    let nvml = init().unwrap();
    // `device_count` claims 3 GPUs; only GPU 0 is declared: 1 and 2 have fallen off the bus.
    assert_eq!(nvml.device_count().unwrap(), 3);
    assert!(matches!(nvml.device_by_index(1), Err(NvmlError::GpuLost)));
    assert!(matches!(
        nvml.device_by_index(3),
        Err(NvmlError::InvalidArg)
    ));
    let gpu = nvml.device_by_index(0).unwrap();
    // `free=` is reported as given, even when it contradicts used and total.
    let m = gpu.memory_info().unwrap();
    assert_eq!((m.total, m.used, m.free), (1000, 900, 800));
    // The size query claims what `process_count` says; the graphics list is untouched.
    assert_eq!(gpu.running_compute_processes_count().unwrap(), 4294967290);
    assert_eq!(gpu.running_graphics_processes_count().unwrap(), 0);
    fake.write("device 0 total=1000 used=900\nprocess 0 7 10\n");
    assert_eq!(gpu.running_compute_processes().unwrap().len(), 1);
    assert_eq!(gpu.memory_info().unwrap().free, 100);
}
