//! GPU sampling through NVML (nvml-wrapper), off the control loop.
//!
//! NVML calls can stall (a driver-wide lock, GPU re-initialisation with persistence mode off), so
//! a worker thread owns the library: the loop asks for a sample with a non-blocking send and reads
//! the latest one, which is stale when it is older than the deadline. NVML is loaded at run time:
//! with no driver the daemon says once why GPU protection is off, guards RAM, and retries.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;
use nvml_wrapper::Nvml;

use crate::snapshot::{Gpu, GpuSnapshot, GpuStatus};

/// Xids that mean the GPU or its memory is in trouble (NVIDIA's Xid catalogue: double-bit ECC,
/// page retirement/row remap failures, fallen off the bus, contained/uncontained errors).
pub const CRITICAL_XIDS: &[u64] = &[48, 63, 64, 74, 79, 92, 94, 95];

/// An Xid error reported by the driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XidEvent {
    pub gpu: Option<u32>,
    pub xid: u64,
}

impl XidEvent {
    pub fn critical(&self) -> bool {
        CRITICAL_XIDS.contains(&self.xid)
    }
}

/// One reading of all GPUs.
#[derive(Clone, Debug, Default)]
pub struct GpuReading {
    pub status: GpuStatus,
    pub devices: Vec<Gpu>,
    /// True if this reading read the per-process lists afresh.
    pub read_processes: bool,
}

/// Where GPU readings come from (NVML, or a fake in tests).
pub trait GpuSource: Send {
    /// Reads every GPU; the per-process lists only when `processes` is true.
    fn sample(&mut self, processes: bool) -> GpuReading;
    /// Xid events since the last call.
    fn take_xids(&mut self) -> Vec<XidEvent> {
        Vec::new()
    }
}

/// The real source: NVML loaded at run time.
pub struct NvmlGpuSource {
    library: Option<PathBuf>,
    retry_init: Duration,
    nvml: Option<Arc<Nvml>>,
    last_init: Option<Instant>,
    last_error: String,
    /// Per-process lists from the last time they were read, reused between process samples.
    last_processes: BTreeMap<u32, (BTreeMap<i32, Option<u64>>, bool)>,
    xids: Arc<Mutex<Vec<XidEvent>>>,
    quit_events: Arc<AtomicBool>,
}

impl NvmlGpuSource {
    pub fn new(library: Option<PathBuf>, retry_init: Duration) -> Self {
        NvmlGpuSource {
            library,
            retry_init,
            nvml: None,
            last_init: None,
            last_error: String::new(),
            last_processes: BTreeMap::new(),
            xids: Arc::default(),
            quit_events: Arc::default(),
        }
    }

    fn init(&mut self) -> Result<Arc<Nvml>, String> {
        if let Some(nvml) = &self.nvml {
            return Ok(nvml.clone());
        }
        if self
            .last_init
            .is_some_and(|t| t.elapsed() < self.retry_init)
        {
            return Err(self.last_error.clone());
        }
        self.last_init = Some(Instant::now());
        let result = match &self.library {
            Some(path) => Nvml::builder().lib_path(path.as_os_str()).init(),
            None => Nvml::init(),
        };
        match result {
            Ok(nvml) => {
                let nvml = Arc::new(nvml);
                self.nvml = Some(nvml.clone());
                self.start_events(nvml.clone());
                Ok(nvml)
            }
            Err(e) => {
                self.last_error = describe_init_error(&e);
                Err(self.last_error.clone())
            }
        }
    }

    /// Drops the library after an error that needs a fresh init (driver reloaded or upgraded).
    fn reset(&mut self, why: String) {
        self.quit_events.store(true, Ordering::Relaxed);
        self.quit_events = Arc::default();
        self.nvml = None;
        self.last_error = why;
    }

    /// Listens for Xid events on every GPU in a thread of its own (the wait blocks).
    fn start_events(&self, nvml: Arc<Nvml>) {
        let (xids, quit) = (self.xids.clone(), self.quit_events.clone());
        let spawned = std::thread::Builder::new()
            .name("nvml-events".into())
            .spawn(move || {
                let Ok(mut set) = nvml.create_event_set() else {
                    return;
                };
                for index in 0..nvml.device_count().unwrap_or(0) {
                    let Ok(device) = nvml.device_by_index(index) else {
                        continue;
                    };
                    match device.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
                        Ok(s) => set = s,
                        Err(e) => {
                            tracing::warn!(
                                "GPU {index}: cannot listen for Xid events: {}",
                                e.error
                            );
                            return;
                        }
                    }
                }
                while !quit.load(Ordering::Relaxed) {
                    match set.wait(500) {
                        Ok(data) => {
                            let xid = match data.event_data {
                                Some(XidError::Value(v)) => v,
                                _ => continue,
                            };
                            let gpu = data.device.index().ok();
                            xids.lock().expect("xid lock").push(XidEvent { gpu, xid });
                        }
                        Err(NvmlError::Timeout) => {}
                        Err(_) => std::thread::sleep(Duration::from_secs(1)),
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot start the Xid listener: {e}");
        }
    }
}

impl Drop for NvmlGpuSource {
    fn drop(&mut self) {
        self.quit_events.store(true, Ordering::Relaxed);
    }
}

fn describe_init_error(e: &NvmlError) -> String {
    match e {
        NvmlError::LibloadingError(e) => {
            format!("NVML library not loadable ({e}): no NVIDIA driver?")
        }
        NvmlError::DriverNotLoaded => "NVIDIA driver not loaded".into(),
        NvmlError::LibRmVersionMismatch => {
            "NVML/driver version mismatch (driver upgraded without reboot?)".into()
        }
        NvmlError::NoPermission => "no permission to use NVML".into(),
        other => format!("NVML init failed: {other}"),
    }
}

/// Compute and graphics lists merged per pid; NVML's "not available" stays unknown, never zero.
fn merge_processes(lists: &[&[ProcessInfo]]) -> BTreeMap<i32, Option<u64>> {
    let mut out: BTreeMap<i32, Option<u64>> = BTreeMap::new();
    for info in lists.iter().flat_map(|l| l.iter()) {
        let bytes = match info.used_gpu_memory {
            UsedGpuMemory::Used(b) => Some(b),
            UsedGpuMemory::Unavailable => None,
        };
        let entry = out.entry(info.pid as i32).or_insert(bytes);
        // A pid in both lists holds one allocation, seen by both contexts: keep the larger.
        *entry = match (*entry, bytes) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
    out
}

impl GpuSource for NvmlGpuSource {
    fn sample(&mut self, processes: bool) -> GpuReading {
        let nvml = match self.init() {
            Ok(nvml) => nvml,
            Err(why) => {
                return GpuReading {
                    status: GpuStatus::Unavailable(why),
                    ..Default::default()
                }
            }
        };
        let count = match nvml.device_count() {
            Ok(n) => n,
            Err(e) => {
                let why = format!("NVML device count failed: {e}");
                if matches!(
                    e,
                    NvmlError::LibRmVersionMismatch
                        | NvmlError::Uninitialized
                        | NvmlError::DriverNotLoaded
                ) {
                    self.reset(why.clone());
                }
                return GpuReading {
                    status: GpuStatus::Unavailable(why),
                    ..Default::default()
                };
            }
        };
        let mut devices = Vec::with_capacity(count as usize);
        for index in 0..count {
            let mut gpu = Gpu {
                index,
                ..Default::default()
            };
            let device = match nvml.device_by_index(index) {
                Ok(d) => d,
                Err(e) => {
                    gpu.error = Some(e.to_string());
                    devices.push(gpu);
                    continue;
                }
            };
            gpu.uuid = device.uuid().unwrap_or_default();
            gpu.name = device.name().unwrap_or_default();
            match device.memory_info() {
                Ok(m) => {
                    gpu.total_bytes = Some(m.total);
                    gpu.used_bytes = Some(m.used);
                    gpu.free_bytes = Some(m.free);
                }
                Err(e) => gpu.error = Some(e.to_string()),
            }
            gpu.utilization_percent = device.utilization_rates().ok().map(|u| u.gpu);
            if processes {
                let compute = device.running_compute_processes();
                let graphics = device.running_graphics_processes();
                let known = compute.is_ok() && graphics.is_ok();
                let merged = merge_processes(&[
                    compute.as_deref().unwrap_or_default(),
                    graphics.as_deref().unwrap_or_default(),
                ]);
                self.last_processes.insert(index, (merged, known));
            }
            if let Some((list, known)) = self.last_processes.get(&index) {
                gpu.processes = list.clone();
                gpu.processes_known = *known && gpu.error.is_none();
            }
            devices.push(gpu);
        }
        GpuReading {
            status: GpuStatus::Ok,
            devices,
            read_processes: processes,
        }
    }

    fn take_xids(&mut self) -> Vec<XidEvent> {
        std::mem::take(&mut *self.xids.lock().expect("xid lock"))
    }
}

/// What the worker shares with the loop.
#[derive(Default)]
struct Latest {
    reading: GpuReading,
    sampled_at: Option<Instant>,
    /// How long the last sample took.
    took: Duration,
    xids: Vec<XidEvent>,
    process_lists_read: u64,
}

/// Runs a `GpuSource` on its own thread; the control loop never waits for it.
pub struct GpuMonitor {
    /// Wakes the worker; a wake-up sent while one is pending is merged into it.
    wake: SyncSender<()>,
    /// Sticky until the worker takes it, so a request for process lists is never lost.
    want_processes: Arc<AtomicBool>,
    latest: Arc<Mutex<Latest>>,
    sample_timeout: Duration,
}

impl GpuMonitor {
    pub fn start(mut source: Box<dyn GpuSource>, sample_timeout: Duration) -> GpuMonitor {
        let (wake, woken): (SyncSender<()>, Receiver<()>) = sync_channel(1);
        let want_processes = Arc::new(AtomicBool::new(false));
        let latest = Arc::new(Mutex::new(Latest::default()));
        let (shared, want) = (latest.clone(), want_processes.clone());
        std::thread::Builder::new()
            .name("gpu-sampler".into())
            .spawn(move || {
                while woken.recv().is_ok() {
                    let started = Instant::now();
                    let reading = source.sample(want.swap(false, Ordering::AcqRel));
                    let xids = source.take_xids();
                    let mut latest = shared.lock().expect("gpu lock");
                    latest.process_lists_read += u64::from(reading.read_processes);
                    latest.reading = reading;
                    latest.sampled_at = Some(Instant::now());
                    latest.took = started.elapsed();
                    latest.xids.extend(xids);
                }
            })
            .expect("spawn the GPU sampler thread");
        GpuMonitor {
            wake,
            want_processes,
            latest,
            sample_timeout,
        }
    }

    /// Asks for a new sample, with the per-process lists if `processes`. Never blocks: if the
    /// worker is busy, the request is served by its next sample.
    pub fn request(&self, processes: bool) {
        if processes {
            self.want_processes.store(true, Ordering::Release);
        }
        let _ = self.wake.try_send(());
    }

    /// The latest reading as seen at `now` (daemon clock `at`), with any Xid events since the last
    /// call. `expected_age` is how old a healthy sample may be (the time since the last request).
    pub fn snapshot(
        &self,
        now: Instant,
        at: Duration,
        expected_age: Duration,
    ) -> (GpuSnapshot, Vec<XidEvent>, Duration) {
        let mut latest = self.latest.lock().expect("gpu lock");
        let xids = std::mem::take(&mut latest.xids);
        let age = latest.sampled_at.map(|t| now.saturating_duration_since(t));
        let snapshot = GpuSnapshot {
            status: latest.reading.status.clone(),
            sampled_at: age.map(|a| at.saturating_sub(a)),
            // Late (the sample itself took too long) or old (no answer since): alerts only.
            stale: latest.took > self.sample_timeout
                || age.is_none_or(|a| a > expected_age + self.sample_timeout),
            devices: latest.reading.devices.clone(),
            process_lists_read: latest.process_lists_read,
        };
        (snapshot, xids, latest.took)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_compute_and_graphics_keeping_unknown() {
        let info = |pid, mem| ProcessInfo {
            pid,
            used_gpu_memory: mem,
            gpu_instance_id: None,
            compute_instance_id: None,
        };
        let compute = [
            info(1, UsedGpuMemory::Used(100)),
            info(2, UsedGpuMemory::Unavailable),
        ];
        let graphics = [
            info(1, UsedGpuMemory::Used(50)),
            info(3, UsedGpuMemory::Used(7)),
        ];
        let merged = merge_processes(&[&compute, &graphics]);
        assert_eq!(merged.get(&1), Some(&Some(100)));
        assert_eq!(
            merged.get(&2),
            Some(&None),
            "unavailable is unknown, not zero"
        );
        assert_eq!(merged.get(&3), Some(&Some(7)));
    }
}
