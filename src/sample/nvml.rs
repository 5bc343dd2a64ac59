//! GPU sampling through NVML (nvml-wrapper), off the control loop.
//!
//! NVML calls can stall (a driver-wide lock, GPU re-initialisation with persistence mode off), so
//! a worker thread owns the library: the loop asks for a sample with a non-blocking send and reads
//! the latest one, which is stale when it is older than the deadline. NVML is loaded at run time:
//! with no driver the daemon says once why GPU protection is off, guards RAM, and retries.
//!
//! NVML's answers are untrusted input: an implausible device or process count is refused before
//! anything is allocated for it, a GPU that says GPU_IS_LOST or drops out of the device list is
//! reported as lost (with the uuid it had), and a panic while sampling becomes an unavailable
//! reading, never a dead sampler or a poisoned lock.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;
use nvml_wrapper::Nvml;

use crate::snapshot::{printable, Gpu, GpuSnapshot, GpuStatus};
use crate::unattributed::Unattributed;

/// More GPUs than any host has: NVML answering this is not believed (nothing is allocated for it).
pub const MAX_GPUS: u32 = 256;
/// More processes on one GPU than any host runs: the list is not read and counts as unknown.
pub const MAX_GPU_PROCESSES: u32 = 1 << 16;

/// Locks a mutex even if a thread panicked while holding it: what it guards is plain data that
/// is whole between statements, and the guard must go on.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

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
    /// NVML says this host has no GPU for it: its library cannot be loaded, or the NVIDIA
    /// driver is not loaded, and this source never saw a GPU (a driver that goes away under
    /// GPUs seen is a reload or a fault: they are there, unknown) (`GpuSnapshot::absent`).
    pub absent: bool,
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

/// The Xid listener's wait timeout.
const XID_WAIT_MS: u32 = 2000;

/// The real source: NVML loaded at run time.
pub struct NvmlGpuSource {
    library: Option<PathBuf>,
    retry_init: Duration,
    nvml: Option<Arc<Nvml>>,
    last_init: Option<Instant>,
    last_error: String,
    /// `last_error` means there is no NVIDIA driver here (`GpuReading::absent`).
    last_absent: bool,
    /// Per-process lists from the last time they were read, reused between process samples.
    last_processes: BTreeMap<u32, (BTreeMap<i32, Option<u64>>, bool)>,
    /// Every GPU seen healthy, by index: one that goes missing from the list is lost, not gone.
    seen: BTreeMap<u32, Seen>,
    /// Per GPU, the memory used but listed under no process, and when this source started.
    unattributed: BTreeMap<u32, Unattributed>,
    started: Instant,
    xids: Arc<Mutex<Vec<XidEvent>>>,
    quit_events: Arc<AtomicBool>,
    /// The PCI devices (`/sys/bus/pci/devices`): an NVIDIA GPU there is a GPU NVML does not
    /// answer for yet (a driver installed at first boot), never "no GPU here".
    pci_devices: PathBuf,
}

/// The PCI devices as the kernel lists them.
const PCI_DEVICES: &str = "/sys/bus/pci/devices";

impl NvmlGpuSource {
    pub fn new(library: Option<PathBuf>, retry_init: Duration) -> Self {
        NvmlGpuSource {
            pci_devices: PathBuf::from(PCI_DEVICES),
            library,
            retry_init,
            nvml: None,
            last_init: None,
            last_error: String::new(),
            last_absent: false,
            last_processes: BTreeMap::new(),
            seen: BTreeMap::new(),
            unattributed: BTreeMap::new(),
            started: Instant::now(),
            xids: Arc::default(),
            quit_events: Arc::default(),
        }
    }

    /// The same, with the PCI devices listed at `path` (tests).
    #[cfg(test)]
    pub fn with_pci_devices(mut self, path: impl Into<PathBuf>) -> Self {
        self.pci_devices = path.into();
        self
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
                self.last_absent = means_no_driver(&e) && !nvidia_gpu_on_pci(&self.pci_devices);
                Err(self.last_error.clone())
            }
        }
    }

    /// Drops the library after an error that needs a fresh init (driver reloaded or upgraded).
    fn reset(&mut self, why: String, absent: bool) {
        self.quit_events.store(true, Ordering::Relaxed);
        self.quit_events = Arc::default();
        self.nvml = None;
        self.last_error = why;
        self.last_absent = absent;
    }

    /// Listens for Xid events on every GPU in a thread of its own (the wait blocks). Returns
    /// once the thread has registered (or given up, or 2 s passed): a driver tells a set only
    /// of the Xids raised after it registered, so one raised right after init is not lost.
    fn start_events(&self, nvml: Arc<Nvml>) {
        let (xids, quit) = (self.xids.clone(), self.quit_events.clone());
        let (registered, wait_registered) = std::sync::mpsc::channel::<()>();
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
                drop(registered);
                // The wait blocks in the driver; its timeout only bounds how long this thread
                // outlives a reset or a reload (it then holds the old library handle).
                while !quit.load(Ordering::Relaxed) {
                    match set.wait(XID_WAIT_MS) {
                        Ok(data) => {
                            let xid = match data.event_data {
                                Some(XidError::Value(v)) => v,
                                _ => continue,
                            };
                            let gpu = data.device.index().ok();
                            lock(&xids).push(XidEvent { gpu, xid });
                        }
                        Err(NvmlError::Timeout) => {}
                        Err(_) => std::thread::sleep(Duration::from_secs(1)),
                    }
                }
            });
        match spawned {
            // Dropping the sender (registered, or given up) ends the wait.
            Ok(_) => _ = wait_registered.recv_timeout(Duration::from_secs(2)),
            Err(e) => tracing::warn!("cannot start the Xid listener: {e}"),
        }
    }
}

impl Drop for NvmlGpuSource {
    fn drop(&mut self) {
        self.quit_events.store(true, Ordering::Relaxed);
    }
}

/// Whether an NVIDIA GPU (vendor 0x10de, a display or 3D controller: class 0x03xxxx) is on the
/// PCI bus, whatever its driver: as the kernel lists it in `devices` (`/sys/bus/pci/devices`).
fn nvidia_gpu_on_pci(devices: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(devices) else {
        return false;
    };
    let read = |dir: &Path, name: &str| std::fs::read_to_string(dir.join(name)).unwrap_or_default();
    entries.flatten().any(|e| {
        let dir = e.path();
        read(&dir, "vendor").trim() == "0x10de" && read(&dir, "class").trim().starts_with("0x03")
    })
}

/// NVML's answer means this host has no NVIDIA driver (no library to load): no GPU to place
/// anything on, unless an NVIDIA GPU is on the PCI bus (`nvidia_gpu_on_pci`: the driver comes
/// later, as on a Deep Learning VM's first boot). Any other failure leaves the GPUs unknown; a
/// driver not loaded (yet) too: at boot the kernel module may come after gpuguard, and a launch
/// unit refused at once (exit 65, not restarted) would never start.
fn means_no_driver(e: &NvmlError) -> bool {
    matches!(e, NvmlError::LibloadingError(_))
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
        // Garbage from a driver writing another struct layout: no such process can exist.
        if info.pid == 0 || i32::try_from(info.pid).is_err() {
            continue;
        }
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

/// What is remembered of a GPU seen healthy, to name it once it is lost.
#[derive(Clone, Debug)]
struct Seen {
    uuid: String,
    name: String,
    total_bytes: Option<u64>,
}

/// A GPU that NVML no longer answers for (GPU_IS_LOST) or no longer lists.
fn lost_gpu(index: u32, seen: Option<&Seen>, why: String) -> Gpu {
    Gpu {
        index,
        uuid: seen.map(|s| s.uuid.clone()).unwrap_or_default(),
        name: seen.map(|s| s.name.clone()).unwrap_or_default(),
        total_bytes: seen.and_then(|s| s.total_bytes),
        error: Some(why),
        lost: true,
        ..Default::default()
    }
}

impl NvmlGpuSource {
    /// Reads one GPU; `processes`: its process lists too.
    fn read_gpu(&mut self, nvml: &Nvml, index: u32, processes: bool) -> Gpu {
        let device = match nvml.device_by_index(index) {
            Ok(d) => d,
            Err(e) => {
                let lost = matches!(e, NvmlError::GpuLost);
                let mut gpu = lost_gpu(index, self.seen.get(&index), e.to_string());
                gpu.lost = lost;
                return gpu;
            }
        };
        // The driver's strings go into logs and alerts: made printable like process names.
        let text = |s: Result<String, NvmlError>| printable(&s.unwrap_or_default()).into_owned();
        let mut gpu = Gpu {
            index,
            uuid: text(device.uuid()),
            name: text(device.name()),
            ..Default::default()
        };
        // With the process lists, read around the memory figures: if they differ, something
        // allocated or freed in between, and free memory and per-process figures disagree.
        let before = processes.then(|| read_process_lists(&device));
        match device.memory_info() {
            Ok(m) => {
                gpu.total_bytes = Some(m.total);
                gpu.used_bytes = Some(m.used);
                gpu.free_bytes = Some(m.free);
                gpu.reserved_bytes = Some(m.reserved);
            }
            Err(e) => {
                gpu.lost = matches!(e, NvmlError::GpuLost);
                gpu.error = Some(e.to_string());
            }
        }
        gpu.utilization_percent = device.utilization_rates().ok().map(|u| u.gpu);
        if let Some(before) = before {
            let after = read_process_lists(&device);
            // The same lists around the memory figures, and no more memory in them than the
            // card had in use: a process that freed memory and another that took as much in
            // between leave the lists alike (A-B-A) while `used` saw the moment between.
            // And the memory listed under no process where it was (see `Unattributed`).
            let listed: u64 = after.0.values().map(|b| b.unwrap_or(0)).sum();
            let now = self.started.elapsed();
            gpu.processes_steady = after.1
                && after == before
                && gpu.used_bytes.is_some_and(|used| {
                    listed <= used
                        && self
                            .unattributed
                            .entry(index)
                            .or_default()
                            .agrees(used - listed, now)
                });
            self.last_processes.insert(index, after);
        }
        if let Some((list, known)) = self.last_processes.get(&index) {
            gpu.processes = list.clone();
            gpu.processes_known = *known && gpu.error.is_none();
        }
        if gpu.error.is_none() {
            self.seen.insert(
                index,
                Seen {
                    uuid: gpu.uuid.clone(),
                    name: gpu.name.clone(),
                    total_bytes: gpu.total_bytes,
                },
            );
        }
        gpu
    }

    /// GPUs seen before at an index NVML no longer lists (`count` devices now): lost.
    fn missing_gpus(&self, count: u32) -> Vec<Gpu> {
        self.seen
            .range(count..)
            .map(|(&index, seen)| {
                lost_gpu(
                    index,
                    Some(seen),
                    format!(
                        "no longer in NVML's device list ({} GPU(s) listed): fallen off the bus?",
                        count
                    ),
                )
            })
            .collect()
    }
}

/// Both process lists of one GPU, merged, and whether they could be read. A count beyond
/// `MAX_GPU_PROCESSES` is refused before nvml-wrapper allocates for it.
fn read_process_lists(device: &nvml_wrapper::Device) -> (BTreeMap<i32, Option<u64>>, bool) {
    let plausible = |count: Result<u32, NvmlError>| count.is_ok_and(|n| n <= MAX_GPU_PROCESSES);
    if !plausible(device.running_compute_processes_count())
        || !plausible(device.running_graphics_processes_count())
    {
        return (BTreeMap::new(), false);
    }
    let compute = device.running_compute_processes();
    let graphics = device.running_graphics_processes();
    let known = compute.is_ok() && graphics.is_ok();
    let merged = merge_processes(&[
        compute.as_deref().unwrap_or_default(),
        graphics.as_deref().unwrap_or_default(),
    ]);
    (merged, known)
}

impl GpuSource for NvmlGpuSource {
    fn sample(&mut self, processes: bool) -> GpuReading {
        let nvml = match self.init() {
            Ok(nvml) => nvml,
            Err(why) => {
                return GpuReading {
                    status: GpuStatus::Unavailable(why),
                    absent: self.last_absent && self.seen.is_empty(),
                    ..Default::default()
                }
            }
        };
        let count = match nvml.device_count() {
            Ok(n) if n > MAX_GPUS => {
                return GpuReading {
                    status: GpuStatus::Unavailable(format!(
                        "NVML reports {n} GPUs, more than any host has: readings unknown"
                    )),
                    ..Default::default()
                };
            }
            Ok(n) => n,
            Err(e) => {
                let why = format!("NVML device count failed: {e}");
                let absent = means_no_driver(&e)
                    && self.seen.is_empty()
                    && !nvidia_gpu_on_pci(&self.pci_devices);
                if matches!(
                    e,
                    NvmlError::LibRmVersionMismatch
                        | NvmlError::Uninitialized
                        | NvmlError::DriverNotLoaded
                ) {
                    self.reset(why.clone(), absent);
                }
                return GpuReading {
                    status: GpuStatus::Unavailable(why),
                    absent,
                    ..Default::default()
                };
            }
        };
        let mut devices: Vec<Gpu> = (0..count)
            .map(|index| self.read_gpu(&nvml, index, processes))
            .collect();
        devices.extend(self.missing_gpus(count));
        GpuReading {
            status: GpuStatus::Ok,
            devices,
            read_processes: processes,
            absent: false,
        }
    }

    fn take_xids(&mut self) -> Vec<XidEvent> {
        std::mem::take(&mut *lock(&self.xids))
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

/// One sample; a panic inside (nvml-wrapper, or NVML's answers tripping an assertion) becomes an
/// unavailable reading, and the sampler goes on with the next request.
fn sample_or_report_panic(
    source: &mut dyn GpuSource,
    processes: bool,
) -> (GpuReading, Vec<XidEvent>) {
    let sampled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        (source.sample(processes), source.take_xids())
    }));
    sampled.unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        tracing::error!(
            "GPU sampler panicked ({what}); GPU readings unknown until the next sample"
        );
        let reading = GpuReading {
            status: GpuStatus::Unavailable(format!("GPU sampler failed: {what}")),
            ..Default::default()
        };
        (reading, Vec::new())
    })
}

/// Runs a `GpuSource` on its own thread; the control loop never waits for it.
pub struct GpuMonitor {
    worker: Worker,
    /// Sticky until the worker takes it, so a request for process lists is never lost.
    want_processes: Arc<AtomicBool>,
    latest: Arc<Mutex<Latest>>,
    sample_timeout: Duration,
    /// Called by the worker after each sample (see `after_each_sample`).
    after_sample: AfterSample,
}

/// Who samples.
enum Worker {
    /// The sampler thread; a wake-up sent while one is pending is merged into it.
    Thread(SyncSender<()>),
    /// The caller, in `snapshot`, when a sample was requested since the last one: whole ticks
    /// driven in process by tests (`src/daemon/tests/`) see the sample they asked for, taken at
    /// the tick's own time.
    Inline {
        source: Mutex<Box<dyn GpuSource>>,
        requested: AtomicBool,
    },
}

type AfterSample = Arc<Mutex<Option<Box<dyn Fn() + Send>>>>;

/// Takes one sample from `source` and makes it the latest, stamped `started`.
fn sample_into(
    source: &mut dyn GpuSource,
    want: &AtomicBool,
    latest: &Mutex<Latest>,
    after: &AfterSample,
    started: Instant,
) {
    let began = Instant::now();
    let (reading, xids) = sample_or_report_panic(source, want.swap(false, Ordering::AcqRel));
    let mut latest = lock(latest);
    latest.process_lists_read += u64::from(reading.read_processes);
    latest.reading = reading;
    // When the reading began: what happened before it is in it.
    latest.sampled_at = Some(started);
    latest.took = began.elapsed();
    latest.xids.extend(xids);
    drop(latest);
    if let Some(after) = lock(after).as_ref() {
        after();
    }
}

impl GpuMonitor {
    pub fn start(mut source: Box<dyn GpuSource>, sample_timeout: Duration) -> GpuMonitor {
        let (wake, woken): (SyncSender<()>, Receiver<()>) = sync_channel(1);
        let want_processes = Arc::new(AtomicBool::new(false));
        let latest = Arc::new(Mutex::new(Latest::default()));
        let after_sample: AfterSample = Arc::default();
        let (shared, want, after) = (latest.clone(), want_processes.clone(), after_sample.clone());
        std::thread::Builder::new()
            .name("gpu-sampler".into())
            .spawn(move || {
                while woken.recv().is_ok() {
                    sample_into(source.as_mut(), &want, &shared, &after, Instant::now());
                }
            })
            .expect("spawn the GPU sampler thread");
        GpuMonitor {
            worker: Worker::Thread(wake),
            want_processes,
            latest,
            sample_timeout,
            after_sample,
        }
    }

    /// No thread: a requested sample is taken by the next `snapshot`, stamped with its `now`.
    pub fn inline(source: Box<dyn GpuSource>, sample_timeout: Duration) -> GpuMonitor {
        GpuMonitor {
            worker: Worker::Inline {
                source: Mutex::new(source),
                requested: AtomicBool::new(false),
            },
            want_processes: Arc::default(),
            latest: Arc::default(),
            sample_timeout,
            after_sample: Arc::default(),
        }
    }

    /// `f` runs on the worker after each sample (it must return at once: the daemon uses it to
    /// wake its loop when a request waits for a fresh reading).
    pub fn after_each_sample(&self, f: Box<dyn Fn() + Send>) {
        *lock(&self.after_sample) = Some(f);
    }

    /// Asks for a new sample, with the per-process lists if `processes`. Never blocks: if the
    /// worker is busy, the request is served by its next sample.
    pub fn request(&self, processes: bool) {
        if processes {
            self.want_processes.store(true, Ordering::Release);
        }
        match &self.worker {
            Worker::Thread(wake) => {
                let _ = wake.try_send(());
            }
            Worker::Inline { requested, .. } => requested.store(true, Ordering::Release),
        }
    }

    /// Waits until the worker has answered once (or `timeout` passes); true if it has.
    pub fn wait_first(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if lock(&self.latest).sampled_at.is_some() {
                return true;
            }
            if let Worker::Inline { requested, .. } = &self.worker {
                // The next `snapshot` takes it.
                return requested.load(Ordering::Acquire);
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The latest reading as seen at `now` (daemon clock `at`), with any Xid events since the last
    /// call. `expected_age` is how old a healthy sample may be (the time since the last request).
    pub fn snapshot(
        &self,
        now: Instant,
        at: Duration,
        expected_age: Duration,
    ) -> (GpuSnapshot, Vec<XidEvent>, Duration) {
        if let Worker::Inline { source, requested } = &self.worker {
            if requested.swap(false, Ordering::AcqRel) {
                let mut source = lock(source);
                let (want, after) = (&self.want_processes, &self.after_sample);
                sample_into(source.as_mut(), want, &self.latest, after, now);
            }
        }
        let mut latest = lock(&self.latest);
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
            processes_fresh: latest.reading.read_processes,
            absent: latest.reading.absent,
        };
        (snapshot, xids, latest.took)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Round five (a hostile review of issue 40): with no NVML library a GPU request was refused
    /// as never fitting (exit 65, not retried) although a GPU is on the bus and its driver comes
    /// later (a Deep Learning VM installs it at first boot). No library means no GPU only while
    /// no NVIDIA GPU is on the PCI bus.
    #[test]
    fn no_library_is_no_gpu_only_without_an_nvidia_gpu_on_the_bus() {
        let bus = tempfile::tempdir().unwrap();
        let device = |slot: &str, vendor: &str, class: &str| {
            let dir = bus.path().join(slot);
            std::fs::create_dir(&dir).unwrap();
            std::fs::write(dir.join("vendor"), format!("{vendor}\n")).unwrap();
            std::fs::write(dir.join("class"), format!("{class}\n")).unwrap();
        };
        // A virtio NIC and an NVIDIA audio function: no GPU.
        device("0000:00:04.0", "0x1af4", "0x020000");
        device("0000:00:05.1", "0x10de", "0x040300");
        let mut source = NvmlGpuSource::new(
            Some("/nonexistent/libnvidia-ml.so.1".into()),
            Duration::ZERO,
        )
        .with_pci_devices(bus.path());
        assert!(source.sample(false).absent, "no NVIDIA GPU on the bus");
        device("0000:00:05.0", "0x10de", "0x030200");
        assert!(
            !source.sample(false).absent,
            "an H100's 3D controller is a GPU"
        );
    }

    /// Panics on its first sample, then answers with one GPU.
    struct PanicsOnce {
        calls: u32,
    }

    impl GpuSource for PanicsOnce {
        fn sample(&mut self, _processes: bool) -> GpuReading {
            self.calls += 1;
            if self.calls == 1 {
                panic!("boom in the sampler");
            }
            GpuReading {
                status: GpuStatus::Ok,
                devices: vec![Gpu::default()],
                read_processes: false,
                absent: false,
            }
        }
    }

    #[test]
    fn a_panic_while_sampling_is_an_unavailable_reading_and_the_sampler_goes_on() {
        let monitor = GpuMonitor::start(Box::new(PanicsOnce { calls: 0 }), Duration::from_secs(5));
        // The status after the next sample: one request, then wait for a newer reading.
        let next = |m: &GpuMonitor| {
            let read = || lock(&m.latest).sampled_at;
            let before = read();
            m.request(false);
            let deadline = Instant::now() + Duration::from_secs(10);
            while read() == before && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            let at = Duration::from_secs(3600);
            m.snapshot(Instant::now(), at, at).0.status
        };
        assert_eq!(
            next(&monitor),
            GpuStatus::Unavailable("GPU sampler failed: boom in the sampler".into())
        );
        assert_eq!(next(&monitor), GpuStatus::Ok, "the sampler lives on");
    }

    #[test]
    fn a_poisoned_lock_still_opens() {
        let shared = Arc::new(Mutex::new(1));
        let held = shared.clone();
        let _ = std::thread::spawn(move || {
            let _guard = held.lock().unwrap();
            panic!("poisons the lock");
        })
        .join();
        assert!(shared.is_poisoned());
        *lock(&shared) += 1;
        assert_eq!(*lock(&shared), 2);
    }

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
            info(0, UsedGpuMemory::Used(9)),
            info(u32::MAX, UsedGpuMemory::Used(9)),
        ];
        let merged = merge_processes(&[&compute, &graphics]);
        assert_eq!(merged.get(&1), Some(&Some(100)));
        assert_eq!(
            merged.get(&2),
            Some(&None),
            "unavailable is unknown, not zero"
        );
        assert_eq!(merged.get(&3), Some(&Some(7)));
        assert_eq!(
            merged.len(),
            3,
            "pids 0 and above i32::MAX are garbage: {merged:?}"
        );
    }
}
