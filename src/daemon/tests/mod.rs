//! Whole ticks of the loop, in process: a fake /proc (host memory and the process table), a fake
//! GPU source (GPU 0 and any more GPUs, memory NVML cannot tell, NVML unavailable), the weights
//! files processes map, and a fake process control that records every signal, with the daemon's
//! clock driven by the test. What the binary tests cannot pin down: the exact signals sent, tick
//! by tick, while processes come, go and exit between the scan and the action. The GPU cases are
//! in `gpu`; `security` plays the host suite's issue #11 attacks that need no real user: uids are
//! data.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::act::{ProcessControl, Sig, SignalError};
use crate::config::Config;
use crate::policy::Resource;
use crate::sample::nvml::{GpuReading, GpuSource};
use crate::sample::procfs::{ReadError, Vitals};
use crate::sample::scan::{ScanRequest, ScanResult};
use crate::sample::{ProcSource, TableSource};
use crate::snapshot::{Gpu, GpuStatus, HostMemory, MappedFile, Process, ProcessId};

use super::{Daemon, Sources};

mod alerts;
mod gpu;
mod probes_and_watch;
mod security;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// The fake host: what /proc and NVML say, and every signal that reached a process.
#[derive(Default)]
struct World {
    host: HostMemory,
    procs: BTreeMap<i32, Process>,
    /// GPU memory per pid on GPU 0 (`None`: no GPU).
    gpu: Option<BTreeMap<i32, u64>>,
    /// GPU 0's size (`None`: 80 GiB).
    gpu_total: Option<u64>,
    /// Signals delivered, in order.
    signals: Vec<(ProcessId, Sig)>,
    /// Pids that exit just before the next signal reaches them (after the scan, before the act).
    exit_before_signal: Vec<i32>,
    /// Pids that exit on SIGTERM (the others ignore it); SIGKILL always ends a process.
    exit_on_term: Vec<i32>,
    /// Proportional set size per pid, and the pids whose PSS was read, in order.
    pss: BTreeMap<i32, u64>,
    pss_reads: Vec<i32>,
    /// Pids NVML lists on GPU 0 with their memory unavailable (`None`).
    gpu_unknown: Vec<i32>,
    /// Memory in use on GPU 0 that NVML lists under no pid.
    gpu_unlisted: u64,
    /// GPUs after GPU 0, as NVML reports them.
    more_gpus: Vec<Gpu>,
    /// What NVML answers instead of a reading (unavailable, and why), while set.
    gpu_status: Option<GpuStatus>,
    /// Xid errors the driver reported that the sampler has not taken yet.
    xids: Vec<crate::sample::nvml::XidEvent>,
    /// The weights files each pid maps (/proc/PID/maps), read for the GPU holders the scan asks.
    maps: BTreeMap<i32, Vec<MappedFile>>,
    /// How long an exited process's memory takes to come back to MemAvailable (its address
    /// space torn down, the vmstat counters folded: up to `vm.stat_interval`, 1 s); zero: at once.
    release_lag: Duration,
    /// Memory of exited processes not back in MemAvailable yet: (when it is, bytes).
    releasing: Vec<(Duration, u64)>,
    /// The harness's clock, as of its last tick.
    now: Duration,
}

type Shared = Arc<Mutex<World>>;

fn world(shared: &Shared) -> MutexGuard<'_, World> {
    shared.lock().unwrap()
}

impl World {
    fn exit(&mut self, pid: i32) {
        if let Some(p) = self.procs.remove(&pid) {
            self.releasing
                .push((self.now + self.release_lag, p.rss_bytes));
            self.fold_released();
        }
        if let Some(gpu) = self.gpu.as_mut() {
            gpu.remove(&pid);
        }
    }

    /// What exited processes gave back by now comes back to MemAvailable.
    fn fold_released(&mut self) {
        let now = self.now;
        let back: u64 = self
            .releasing
            .iter()
            .filter(|(at, _)| *at <= now)
            .map(|(_, bytes)| bytes)
            .sum();
        self.releasing.retain(|(at, _)| *at > now);
        if let Some(a) = self.host.available_bytes.as_mut() {
            *a += back;
        }
    }

    fn spawn(&mut self, pid: i32, comm: &str, rss_bytes: u64) {
        self.procs.insert(pid, process(pid, comm, rss_bytes));
    }
}

fn process(pid: i32, comm: &str, rss_bytes: u64) -> Process {
    Process {
        pid,
        // Start times differ from pids, so a reused pid is a new process.
        start_time: 1000 + pid as u64,
        ppid: 1,
        uid: 0,
        state: 'S',
        comm: comm.into(),
        cmdline: comm.into(),
        cgroup: "/".into(),
        rss_bytes,
        swap_bytes: None,
        kernel_thread: false,
        exe: None,
        pss_bytes: None,
    }
}

struct FakeProc(Shared);

impl ProcSource for FakeProc {
    fn host_memory(&mut self) -> HostMemory {
        let mut w = world(&self.0);
        w.fold_released();
        w.host
    }
    fn host_error(&self) -> Option<&str> {
        None
    }
    fn host_has_swap(&self) -> bool {
        false
    }
    fn vitals(&mut self, pid: i32) -> Result<Vitals, ReadError> {
        let w = world(&self.0);
        let p = w.procs.get(&pid).ok_or(ReadError::Gone)?;
        Ok(Vitals {
            id: p.id(),
            state: p.state,
            ppid: p.ppid,
            rss_bytes: p.rss_bytes,
            swap_bytes: p.swap_bytes,
        })
    }
}

/// Every round reads every process in full: the table becomes the world's.
struct FakeTables(Shared);

impl TableSource for FakeTables {
    fn round(&mut self, request: ScanRequest) -> ScanResult {
        let mut w = world(&self.0);
        // Near the RAM floor, the PSS of the processes that hold enough (as the scan reads it).
        let pss = request.pss_min_rss.map(|min| {
            let big: Vec<_> = w
                .procs
                .values()
                .filter(|p| p.rss_bytes >= min)
                .map(|p| p.id())
                .collect();
            w.pss_reads.extend(big.iter().map(|id| id.pid));
            big.into_iter()
                .filter_map(|id| Some((id, *w.pss.get(&id.pid)?)))
                .collect()
        });
        let mapped_weights = request.maps.as_ref().map(|pids| {
            pids.iter()
                .filter_map(|pid| Some((*pid, w.maps.get(pid)?.clone())))
                .collect()
        });
        ScanResult {
            at: request.at,
            full: request.full,
            live: Some(w.procs.keys().copied().collect()),
            new: w.procs.values().cloned().collect(),
            pss,
            mapped_weights,
            ..ScanResult::default()
        }
    }
}

struct FakeGpu(Shared);

impl GpuSource for FakeGpu {
    fn sample(&mut self, _processes: bool) -> GpuReading {
        let w = world(&self.0);
        let Some(used) = &w.gpu else {
            return GpuReading {
                status: GpuStatus::Unavailable("no GPU".into()),
                ..GpuReading::default()
            };
        };
        if let Some(status) = &w.gpu_status {
            return GpuReading {
                status: status.clone(),
                ..GpuReading::default()
            };
        }
        let total = w.gpu_total.unwrap_or(80 * GIB);
        let used_bytes: u64 = used.values().sum::<u64>() + w.gpu_unlisted;
        let mut processes: BTreeMap<i32, Option<u64>> =
            used.iter().map(|(&pid, &b)| (pid, Some(b))).collect();
        processes.extend(w.gpu_unknown.iter().map(|&pid| (pid, None)));
        GpuReading {
            status: GpuStatus::Ok,
            devices: vec![Gpu {
                index: 0,
                uuid: "GPU-fake".into(),
                name: "Fake".into(),
                total_bytes: Some(total),
                used_bytes: Some(used_bytes),
                free_bytes: Some(total - used_bytes),
                reserved_bytes: Some(0),
                processes,
                processes_known: true,
                processes_steady: true,
                ..Gpu::default()
            }]
            .into_iter()
            .chain(w.more_gpus.iter().cloned())
            .collect(),
            read_processes: true,
            absent: false,
        }
    }

    fn take_xids(&mut self) -> Vec<crate::sample::nvml::XidEvent> {
        std::mem::take(&mut world(&self.0).xids)
    }
}

/// Signals the world's processes: records what reached whom, and plays its effect.
struct FakeControl(Shared);

impl ProcessControl for FakeControl {
    fn send(&self, id: ProcessId, sig: Sig) -> Result<(), SignalError> {
        let mut w = world(&self.0);
        if let Some(i) = w.exit_before_signal.iter().position(|&p| p == id.pid) {
            w.exit_before_signal.remove(i);
            w.exit(id.pid);
        }
        let Some(p) = w.procs.get_mut(&id.pid) else {
            return Err(SignalError::Gone);
        };
        if p.start_time != id.start_time {
            return Err(SignalError::Replaced);
        }
        match sig {
            Sig::Stop => p.state = 'T',
            Sig::Cont => p.state = 'S',
            Sig::Term | Sig::Kill => {}
        }
        w.signals.push((id, sig));
        if sig == Sig::Kill || (sig == Sig::Term && w.exit_on_term.contains(&id.pid)) {
            w.exit(id.pid);
        }
        Ok(())
    }

    fn is_stopped(&self, id: ProcessId) -> bool {
        let w = world(&self.0);
        w.procs
            .get(&id.pid)
            .is_some_and(|p| p.id() == id && p.state == 'T')
    }
}

/// A daemon on the fake world, its state directory, and the clock the test drives.
struct Harness {
    daemon: Daemon,
    world: Shared,
    at: Duration,
    _dir: tempfile::TempDir,
}

impl Harness {
    /// `config` is the config file's text after `[daemon]`'s state directory.
    fn new(world_now: World, config: &str) -> Harness {
        Harness::in_dir(tempfile::tempdir().unwrap(), world_now, config)
    }

    /// The same in `dir` (what an earlier daemon left there included).
    fn in_dir(dir: tempfile::TempDir, world_now: World, config: &str) -> Harness {
        let text = config_text(&dir, config);
        let path = dir.path().join("config.toml");
        let config = Config::parse(&text, &path).unwrap();
        let gpu = world_now.gpu.is_some();
        let shared: Shared = Arc::new(Mutex::new(world_now));
        let tables = shared.clone();
        let sources = Sources {
            procs: Box::new(FakeProc(shared.clone())),
            tables: Box::new(move || Box::new(FakeTables(tables.clone()))),
            gpus: gpu.then(|| Box::new(FakeGpu(shared.clone())) as Box<dyn GpuSource>),
            control: Arc::new(FakeControl(shared.clone())),
            cgroup_root: dir.path().join("cgroup"),
            proc_root: dir.path().join("proc"),
            enforce_lock: dir.path().join("enforce.lock"),
            inline: true,
        };
        let mut daemon = Daemon::with_sources(&path, config, sources).unwrap();
        daemon.start_recording();
        // The fake pids are not the test's own.
        daemon.sampler.snapshot.self_pid = i32::MAX;
        Harness {
            daemon,
            world: shared,
            at: Duration::ZERO,
            _dir: dir,
        }
    }

    /// The daemon dies here (no clean stop: nothing it holds is let go), and a new one starts
    /// on its state directory, on `world_now` with `config`.
    fn restart(self, world_now: World, config: &str) -> Harness {
        let Harness { daemon, _dir, .. } = self;
        drop(daemon);
        Harness::in_dir(_dir, world_now, config)
    }

    /// Writes `config` (after the same state directory header) to the config file and reloads
    /// it, as the daemon does on SIGHUP (the signal's wiring is the host suite's).
    fn reload(&mut self, config: &str) {
        let text = config_text(&self._dir, config);
        std::fs::write(self._dir.path().join("config.toml"), text).unwrap();
        self.daemon.reload();
    }

    /// One tick, `step` after the last.
    fn tick(&mut self, step: Duration) {
        self.at += step;
        self.world().now = self.at;
        let now = self.daemon.started + self.at;
        self.daemon.tick_at(now, step);
    }

    fn ticks(&mut self, n: usize, step: Duration) {
        for _ in 0..n {
            self.tick(step);
        }
    }

    /// Critical events and kills go to a kernel log as on GCE: a file in the test's directory
    /// (its path is returned), named both the DMI product name and `/dev/kmsg`.
    fn kernel_log_as_on_gce(&mut self) -> std::path::PathBuf {
        let kmsg = self._dir.path().join("kmsg");
        std::fs::write(&kmsg, "").unwrap();
        let paths = crate::history::kernel_log::Paths {
            dmi_product_name: &kmsg,
            kmsg: &kmsg,
        };
        self.daemon.reporter.kernel_log =
            crate::history::kernel_log::KernelLog::open(crate::config::OnGce::On, &paths).unwrap();
        kmsg
    }

    fn world(&self) -> MutexGuard<'_, World> {
        world(&self.world)
    }

    /// The signals delivered so far, as (pid, signal).
    fn signals(&self) -> Vec<(i32, Sig)> {
        self.world()
            .signals
            .iter()
            .map(|(id, sig)| (id.pid, *sig))
            .collect()
    }

    /// The recorded actions, as "verb pid...: outcome".
    fn actions(&self) -> Vec<String> {
        self.daemon
            .reporter
            .recent_actions
            .iter()
            .map(|a| format!("{} {}: {}", a.verb, a.target, a.outcome))
            .collect()
    }
}

/// The config file's text: `[daemon]` with the state directory in `dir`, then `config`.
fn config_text(dir: &tempfile::TempDir, config: &str) -> String {
    format!(
        "[daemon]\nstate_dir = \"{}\"\n{config}",
        dir.path().join("state").display()
    )
}

fn host(total: u64, available: u64) -> HostMemory {
    HostMemory {
        total_bytes: Some(total),
        available_bytes: Some(available),
        swap_total_bytes: Some(0),
        swap_free_bytes: Some(0),
        ..HostMemory::default()
    }
}

const MS: Duration = Duration::from_millis(1);

/// (a) RAM below `min_available`: the largest unprotected process gets the configured action
/// (`stop`), and only it; the protected one (sshd, root's) is passed over although it is larger.
#[test]
fn ram_below_the_floor_stops_the_largest_unprotected_process() {
    let mut w = World {
        host: host(64 * GIB, 2 * GIB),
        ..World::default()
    };
    w.spawn(100, "sshd", 20 * GIB);
    w.spawn(200, "hog", 12 * GIB);
    w.spawn(300, "small", 3 * GIB);
    let mut h = Harness::new(
        w,
        "[ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\naction = \"stop\"\n\
         [gpu]\nenabled = false\n",
    );
    h.tick(MS);
    assert_eq!(h.signals(), [(200, Sig::Stop)], "{:?}", h.actions());
    assert_eq!(h.world().procs[&200].state, 'T');
    // One victim per incident: further ticks below the floor do not pick another at once.
    h.ticks(3, 10 * MS);
    assert_eq!(h.signals(), [(200, Sig::Stop)], "{:?}", h.actions());
    // The held process is on record for the next start and for `status`.
    let held: Vec<i32> = h.daemon.executor.held().iter().map(|p| p.pid).collect();
    assert_eq!(held, [200]);
}

/// Round three: near the RAM floor the scan reads the proportional share (PSS) of the
/// processes that hold enough, and the floor ranks an account by their sum: five 700 MiB
/// processes of one account go before another account's single 1.2 GiB one. Away from the
/// floor, nothing is read.
#[test]
fn near_the_ram_floor_accounts_are_ranked_by_the_pss_of_their_processes() {
    let mut w = World {
        host: host(64 * GIB, 16 * GIB),
        ..World::default()
    };
    for pid in 101..=105 {
        w.spawn(pid, "part", 700 * MIB);
        w.procs.get_mut(&pid).unwrap().uid = 1001;
        w.pss.insert(pid, 700 * MIB);
    }
    w.spawn(200, "single", 1228 * MIB);
    w.procs.get_mut(&200).unwrap().uid = 1002;
    w.pss.insert(200, 1228 * MIB);
    w.spawn(300, "tiny", MIB);
    w.procs.get_mut(&300).unwrap().uid = 1002;
    let mut h = Harness::new(
        w,
        "[ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\naction = \"stop\"\n\
         [gpu]\nenabled = false\n",
    );
    h.ticks(3, 10 * MS);
    assert!(h.world().pss_reads.is_empty(), "read away from the floor");
    // Under warn: the scan reads PSS at once (a drop past both floors in one reading is ranked
    // by RSS until it lands).
    h.world().host = host(64 * GIB, 6 * GIB);
    h.ticks(2, 10 * MS);
    h.world().host = host(64 * GIB, 3 * GIB);
    h.ticks(4, 10 * MS);
    let reads = h.world().pss_reads.clone();
    assert!(reads.contains(&101) && reads.contains(&200), "{reads:?}");
    assert!(
        !reads.contains(&300),
        "too small to be worth a read: {reads:?}"
    );
    assert_eq!(h.signals(), [(101, Sig::Stop)], "{:?}", h.actions());
}

/// The full status report, as `status --model` is served.
fn status(h: &Harness) -> crate::status::StatusReport {
    crate::daemon::report::status_report(&h.daemon.view(crate::daemon::view::Detail::Full))
}

/// Forked workers over a RAM budget by RSS (four 512 MiB processes that share 384 MiB) and
/// under it by what they hold between them: the budget reads their proportional figures and
/// holds; `status --model` shows each process with the figure the model's sum counts and its
/// RSS beside it, so the rows add up to the model's RAM (seen on a real cgroup v2 kernel: rows
/// of 517 MiB RSS under a model of 515 MiB).
#[test]
fn a_models_rows_show_the_ram_its_sum_counts_and_their_rss() {
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        ..World::default()
    };
    for pid in [100, 101, 102, 103] {
        w.spawn(pid, "python3", 512 * MIB);
        let p = w.procs.get_mut(&pid).unwrap();
        p.cmdline = "python3 server.py".into();
        p.ppid = if pid == 100 { 1 } else { 100 };
        w.pss.insert(pid, 224 * MIB);
    }
    let mut h = Harness::new(
        w,
        "candidates = \"models\"\n[gpu]\nenabled = false\n\
         [[model]]\nname = \"server\"\nmatch = { cmdline = \"server.py\" }\n\
         ram = \"1GiB\"\naction = \"stop\"\ngrace = \"0s\"\n",
    );
    h.ticks(10, 100 * MS);
    let report = status(&h);
    let m = report.models.iter().find(|m| m.name == "server").unwrap();
    assert_eq!(m.ram_bytes, 4 * 224 * MIB, "{m:#?}");
    assert_eq!(m.processes.len(), 4, "{m:#?}");
    for row in &m.processes {
        assert_eq!(
            (row.ram_bytes, row.rss_bytes),
            (224 * MIB, 512 * MIB),
            "{row:?}"
        );
    }
    assert_eq!(h.signals(), [], "{:?}", h.actions());
}

/// A model's row says the flags its vLLM server runs with (read from the first member whose
/// command line is one: the engine core beside it is not), for `plan --gpu host`; a model
/// without one says none.
#[test]
fn a_models_row_carries_its_vllm_servers_flags() {
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        ..World::default()
    };
    w.spawn(100, "vllm", GIB);
    w.procs.get_mut(&100).unwrap().cmdline =
        "/usr/bin/python3 /usr/local/bin/vllm serve Qwen/Qwen3-8B --max-num-seqs 64 --enforce-eager"
            .into();
    w.spawn(101, "python3", GIB);
    let core = w.procs.get_mut(&101).unwrap();
    core.cmdline = "python3 -c from multiprocessing.spawn import spawn_main".into();
    core.ppid = 100;
    w.spawn(200, "python3", GIB);
    w.procs.get_mut(&200).unwrap().cmdline = "python3 other.py".into();
    let mut h = Harness::new(
        w,
        "candidates = \"models\"\n[gpu]\nenabled = false\n\
         [[model]]\nname = \"qwen\"\nmatch = { cmdline = \"Qwen3-8B\" }\n\
         [[model]]\nname = \"other\"\nmatch = { cmdline = \"other.py\" }\n",
    );
    h.ticks(3, 100 * MS);
    let report = status(&h);
    let flags = |name: &str| {
        report
            .models
            .iter()
            .find(|m| m.name == name)
            .unwrap_or_else(|| panic!("{name}: {report:?}"))
            .engine_flags
    };
    assert_eq!(
        flags("qwen"),
        Some(crate::engine::EngineFlags {
            max_num_batched_tokens: None,
            max_num_seqs: Some(64),
            enforce_eager: true,
        })
    );
    assert_eq!(flags("other"), None);
}

/// Each time RAM comes near the floor, a round reads PSS at once, not only the first time.
#[test]
fn pss_is_read_at_once_each_time_ram_comes_near_the_floor() {
    let mut w = World {
        host: host(64 * GIB, 16 * GIB),
        ..World::default()
    };
    w.spawn(101, "big", GIB);
    let mut h = Harness::new(
        w,
        "[ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\naction = \"stop\"\n\
         [gpu]\nenabled = false\n",
    );
    h.ticks(3, 10 * MS);
    h.world().host = host(64 * GIB, 6 * GIB);
    h.ticks(2, 10 * MS);
    let first = h.world().pss_reads.len();
    assert!(first > 0, "read once near the floor");
    h.world().host = host(64 * GIB, 16 * GIB);
    h.ticks(2, 10 * MS);
    h.world().host = host(64 * GIB, 6 * GIB);
    h.ticks(2, 10 * MS);
    assert!(
        h.world().pss_reads.len() > first,
        "{:?}",
        h.world().pss_reads
    );
}

/// Models are ranked the same way: a server of four forked workers shows 4 GiB of RSS but
/// shares most of it (1 GiB of PSS: what killing it frees); a server holding 1.5 GiB of its
/// own goes first. Root's processes too (the scan reads their PSS off the loop).
#[test]
fn near_the_ram_floor_models_are_ranked_by_what_killing_them_frees() {
    let mut w = World {
        host: host(64 * GIB, 16 * GIB),
        ..World::default()
    };
    for pid in 101..=104 {
        w.spawn(pid, "forked", GIB);
        w.procs.get_mut(&pid).unwrap().ppid = if pid == 101 { 1 } else { 101 };
        w.pss.insert(pid, GIB / 4);
    }
    w.spawn(200, "unique", 3 * GIB / 2);
    w.pss.insert(200, 3 * GIB / 2);
    let mut h = Harness::new(
        w,
        "candidates = \"models\"\n\
         [ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\naction = \"stop\"\n\
         [gpu]\nenabled = false\n\
         [[model]]\nname = \"forked\"\nmatch = { comm = \"forked\" }\n\
         [[model]]\nname = \"unique\"\nmatch = { comm = \"unique\" }\n",
    );
    h.ticks(3, 10 * MS);
    // Between warn and act: the scan reads PSS (root's processes included).
    h.world().host = host(64 * GIB, 6 * GIB);
    h.ticks(2, 10 * MS);
    assert!(
        h.world().pss_reads.contains(&101),
        "{:?}",
        h.world().pss_reads
    );
    assert_eq!(h.signals(), []);
    h.world().host = host(64 * GIB, 3 * GIB);
    h.ticks(3, 10 * MS);
    assert_eq!(h.signals(), [(200, Sig::Stop)], "{:?}", h.actions());
}

/// (b) A model over its GPU budget: SIGSTOP after `grace`, SIGKILL at `max_stop`, to the model's
/// processes only, each step once.
#[test]
fn a_model_over_its_gpu_budget_is_stopped_then_killed() {
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        gpu: Some(BTreeMap::new()),
        ..World::default()
    };
    w.spawn(100, "other", 4 * GIB);
    w.spawn(200, "vllm", 2 * GIB);
    w.spawn(201, "vllm-worker", GIB);
    w.procs.get_mut(&201).unwrap().ppid = 200;
    let gpu = w.gpu.as_mut().unwrap();
    gpu.insert(100, 10 * GIB);
    gpu.insert(201, 30 * GIB);
    let mut h = Harness::new(
        w,
        "max_stop = \"2s\"\n\
         [gpu]\nenabled = true\n\
         [[model]]\nname = \"llm\"\nmatch = { comm = \"vllm\" }\ngpu_memory = \"20GiB\"\n\
         action = \"stop\"\ngrace = \"1s\"\n",
    );
    // The GPU is sampled from the second tick on; the budget's grace starts there.
    h.ticks(3, 100 * MS);
    assert_eq!(h.signals(), []);
    h.ticks(10, 100 * MS);
    let stopped = [(200, Sig::Stop), (201, Sig::Stop)];
    assert_eq!(h.signals(), stopped, "{:?}", h.actions());
    // The alert condition reads what the policy found over (GPU, not RAM: no RAM budget).
    let conditions = super::alerts::conditions(&h.daemon.view(super::view::Detail::Conditions));
    let budget = conditions.iter().find(|c| c.key == "budget:llm").unwrap();
    assert_eq!(
        budget.summary,
        "model 'llm' over budget: GPU memory 30.0 GiB > budget 20.0 GiB"
    );
    assert_eq!(budget.subject.pids, [200, 201]);
    // Still over (a stopped process keeps its GPU memory): killed at max_stop, not before.
    h.ticks(15, 100 * MS);
    assert_eq!(h.signals(), stopped, "{:?}", h.actions());
    h.ticks(10, 100 * MS);
    let killed = [
        (200, Sig::Stop),
        (201, Sig::Stop),
        (200, Sig::Kill),
        (201, Sig::Kill),
    ];
    assert_eq!(h.signals(), killed, "{:?}", h.actions());
    assert!(
        h.world().procs.contains_key(&100),
        "the other process stays"
    );
    h.ticks(5, 100 * MS);
    assert_eq!(h.signals(), killed, "nothing more once the model is gone");
}

/// (c) The victim exits between the scan that chose it and the signal: no panic, nothing sent
/// to anyone else that tick, the action is recorded as skipped, and the next tick goes on from
/// a consistent state: the victim is known gone and the next largest process is chosen.
#[test]
fn a_victim_that_exits_before_the_signal_is_skipped_and_the_next_one_chosen() {
    let mut w = World {
        host: host(64 * GIB, 2 * GIB),
        ..World::default()
    };
    w.spawn(200, "hog", 12 * GIB);
    w.spawn(300, "second", 6 * GIB);
    w.spawn(400, "small", GIB);
    w.exit_before_signal.push(200);
    let mut h = Harness::new(
        w,
        "term_grace = \"1s\"\n\
         [ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\naction = \"kill\"\n\
         [gpu]\nenabled = false\n",
    );
    h.tick(MS);
    assert_eq!(h.signals(), [], "{:?}", h.actions());
    assert_eq!(
        h.actions(),
        ["terminate pid 200(hog): skipped: target has exited"]
    );
    // The host is still short (something else took what the victim gave back).
    h.world().host.available_bytes = Some(2 * GIB);
    h.tick(MS);
    assert_eq!(h.signals(), [(300, Sig::Term)], "{:?}", h.actions());
    // SIGTERM ignored: SIGKILL after term_grace, to the same process.
    h.ticks(12, 100 * MS);
    assert_eq!(
        h.signals(),
        [(300, Sig::Term), (300, Sig::Kill)],
        "{:?}",
        h.actions()
    );
    assert!(!h.world().procs.contains_key(&200));
}

/// (d) Processes vanish and appear between ticks (shifting every index in the process table):
/// the victim being escalated and the model being stopped stay who they were.
#[test]
fn a_changing_process_table_does_not_shift_who_is_targeted() {
    let mut w = World {
        host: host(64 * GIB, 2 * GIB),
        ..World::default()
    };
    for pid in [10, 20, 30] {
        w.spawn(pid, "idle", 10 * MIB);
    }
    w.spawn(500, "hog", 12 * GIB);
    w.spawn(600, "llm", 400 * MIB);
    w.spawn(700, "other", 2 * GIB);
    let mut h = Harness::new(
        w,
        "term_grace = \"1s\"\n\
         [ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\naction = \"kill\"\n\
         [gpu]\nenabled = false\n\
         [[model]]\nname = \"llm\"\nmatch = { comm = \"llm\" }\nram = \"512MiB\"\n\
         action = \"stop\"\ngrace = \"500ms\"\n",
    );
    h.tick(MS);
    assert_eq!(h.signals(), [(500, Sig::Term)], "{:?}", h.actions());
    // Lower pids go, new ones come (larger than the victim, too): every index moves.
    {
        let mut w = h.world();
        for pid in [10, 20, 30] {
            w.exit(pid);
        }
        w.spawn(5, "new", 20 * MIB);
        w.spawn(550, "bigger", 16 * GIB);
        w.spawn(650, "llm", 400 * MIB);
        // MemAvailable moved (a new table is read once it has), not far below the floor.
        w.host.available_bytes = Some(2 * GIB + 128 * MIB);
    }
    h.ticks(6, 100 * MS);
    {
        let mut w = h.world();
        w.exit(5);
        w.spawn(1, "init", MIB);
        w.spawn(2, "kthreadd", 0);
        w.host.available_bytes = Some(2 * GIB);
    }
    // The model went over its budget when its second process came (grace 500 ms): stopped. The
    // victim ignored SIGTERM: SIGKILL after term_grace, which gives its memory back and ends
    // the incident.
    h.ticks(6, 100 * MS);
    assert_eq!(
        h.actions(),
        [
            "terminate pid 500(hog): done",
            "stop model 'llm' pids [600(llm), 650(llm)]: done",
            "kill pid 500(hog): done",
        ]
    );
    assert_eq!(
        h.signals(),
        [
            (500, Sig::Term),
            (600, Sig::Stop),
            (650, Sig::Stop),
            (500, Sig::Kill)
        ]
    );
}

/// An exited victim's memory comes back to MemAvailable some time after the process is gone
/// (the kernel tears its address space down, then folds the counters, up to a vmstat interval
/// later; CI saw 13 ms): the next victim is not chosen on the readings in between. The world
/// gives the hog's 12 GiB back 300 ms after it exits on SIGTERM; the second process, under
/// the act floor on every reading until then, is never signalled, and the incident ends when
/// the memory is back.
#[test]
fn a_victims_memory_that_comes_back_late_spares_the_next_process() {
    let mut w = World {
        host: host(64 * GIB, 2 * GIB),
        release_lag: 300 * MS,
        ..World::default()
    };
    w.spawn(200, "hog", 12 * GIB);
    w.spawn(300, "second", 6 * GIB);
    w.exit_on_term.push(200);
    let mut h = Harness::new(
        w,
        "term_grace = \"1s\"\n\
         [ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\naction = \"kill\"\n\
         [gpu]\nenabled = false\n",
    );
    h.tick(MS);
    assert_eq!(h.signals(), [(200, Sig::Term)], "{:?}", h.actions());
    // Gone at once, its memory not back yet: readings under the act floor for 300 ms.
    h.tick(100 * MS);
    assert!(!h.world().procs.contains_key(&200));
    let available = |h: &Harness| {
        let status = super::report::status_report(&h.daemon.view(super::view::Detail::Full));
        (status.memory.host.available_bytes, status.memory.level)
    };
    assert_eq!(available(&h), (Some(2 * GIB), crate::kinds::Level::Act));
    h.ticks(10, 100 * MS);
    assert_eq!(h.signals(), [(200, Sig::Term)], "{:?}", h.actions());
    assert_eq!(available(&h), (Some(14 * GIB), crate::kinds::Level::Ok));
    assert!(h.world().procs.contains_key(&300));
}

/// The event log's lines that contain `kind`, read once the log has written all that was told.
fn logged(h: &Harness, kind: &str) -> Vec<String> {
    h.daemon.reporter.alerter.written();
    let log = h._dir.path().join("state").join("events.jsonl");
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    text.lines()
        .filter(|l| l.contains(kind))
        .map(String::from)
        .collect()
}

/// The pids `stopped.json` at `path` holds.
fn stopped_pids(path: &std::path::Path) -> Vec<i32> {
    let text = std::fs::read_to_string(path).unwrap();
    let held: Vec<crate::act::held::HeldProcess> = serde_json::from_str(&text).unwrap();
    held.iter().map(|p| p.pid).collect()
}

/// (e) The red-team cascade, tick by tick: RAM is under the act floor for memory no process
/// holds (a tmpfs file whose writer exited), each victim gives back a little, and the floor
/// would take every process in turn. With the default brake (3 victims per 5 minutes) exactly
/// three get SIGTERM, then a critical `floor_brake` that names Shmem, and nobody else.
#[test]
fn a_tmpfs_shortfall_kills_at_most_max_victims_then_the_brake_holds() {
    let mut w = World {
        host: HostMemory {
            shmem_bytes: Some(20 * GIB),
            ..host(64 * GIB, 2 * GIB)
        },
        ..World::default()
    };
    for (i, pid) in [100, 200, 300, 400, 500].into_iter().enumerate() {
        w.spawn(pid, "server", (500 - 50 * i as u64) * MIB);
        w.exit_on_term.push(pid);
    }
    let mut h = Harness::new(
        w,
        "[ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\naction = \"kill\"\n\
         [gpu]\nenabled = false\n",
    );
    // Each next victim waits RAM_RELEASE (1 s) after the last is gone.
    h.ticks(400, 10 * MS);
    assert_eq!(
        h.signals(),
        [(100, Sig::Term), (200, Sig::Term), (300, Sig::Term)],
        "{:?}",
        h.actions()
    );
    assert!(h.daemon.state.braked.contains(&Resource::Ram));
    let brake = logged(&h, "floor_brake");
    assert_eq!(brake.len(), 1, "{brake:?}");
    let brake: serde_json::Value = serde_json::from_str(&brake[0]).unwrap();
    assert_eq!(
        (
            &brake["event"],
            &brake["severity"],
            &brake["subject"]["resource"]
        ),
        (&"floor_brake".into(), &"critical".into(), &"RAM".into()),
        "{brake}"
    );
    // The policy read the Shmem no kill gives back, which the brake names
    // (`policy::tests::words` says it in words).
    assert_eq!(h.daemon.sampler.snapshot.host.shmem_bytes, Some(20 * GIB));
    // Still short a minute later: still braked, nobody else signalled.
    h.ticks(60, Duration::from_secs(1));
    assert_eq!(h.signals().len(), 3, "{:?}", h.actions());
    assert!(h.world().procs.contains_key(&400) && h.world().procs.contains_key(&500));
}

/// (f) RAM was above its warn floor; then 3.5 GiB appear in Shmem and RAM falls 1 GiB under
/// the act floor: a `shmem_shortfall` alert, and no process is signalled (none of them alone
/// holds enough to lift RAM above the floor).
#[test]
fn shmem_growth_past_the_floor_alerts_and_signals_nobody() {
    let mut w = World {
        host: HostMemory {
            shmem_bytes: Some(GIB),
            ..host(64 * GIB, 16 * GIB)
        },
        ..World::default()
    };
    w.spawn(100, "server", 800 * MIB);
    w.spawn(200, "worker", 600 * MIB);
    let mut h = Harness::new(
        w,
        "[ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\naction = \"kill\"\n\
         [gpu]\nenabled = false\n",
    );
    h.ticks(3, 10 * MS);
    {
        let mut w = h.world();
        w.host.shmem_bytes = Some(4 * GIB + GIB / 2);
        w.host.available_bytes = Some(3 * GIB);
    }
    h.ticks(20, 10 * MS);
    assert_eq!(h.signals(), [], "{:?}", h.actions());
    let lines = logged(&h, "shmem_shortfall");
    assert_eq!(lines.len(), 1, "{lines:?}");
    let line: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
    assert_eq!(
        (&line["severity"], &line["subject"]["resource"]),
        (&"critical".into(), &"RAM".into()),
        "{line}"
    );
    // Shmem grew by 3.5 GiB since RAM was last above its warn floor.
    let baseline = h.daemon.state.shmem_baseline.unwrap();
    assert_eq!(
        (baseline.base, baseline.peak),
        (GIB, 4 * GIB + GIB / 2),
        "{baseline:?}"
    );
    let status = super::report::status_report(&h.daemon.view(super::view::Detail::Full));
    assert_eq!(status.memory.host.shmem_bytes, Some(4 * GIB + GIB / 2));
}

#[test]
fn a_wake_up_ticks_at_once_but_never_sooner_than_the_gap_after_the_last_tick() {
    use super::{woken, MIN_WAKE_GAP};
    let last = std::time::Instant::now();
    let due = last + Duration::from_millis(200);
    // Right after a tick, a wake-up waits out the gap (a client looping requests cannot make
    // the loop spin).
    assert_eq!(woken(due, last, last), last + MIN_WAKE_GAP);
    // Later, it ticks at once.
    let later = last + Duration::from_millis(50);
    assert_eq!(woken(due, last, later), later);
    // And never postpones a tick already due sooner.
    let soon = last + Duration::from_millis(1);
    assert_eq!(woken(soon, last, last), soon);
}

/// Issue 25: the flight recorder keeps what the daemon saw and did. An incident (RAM below the
/// floor, a hog stopped) is in the history as it happened: the status at that moment with RAM
/// at the act floor, the action, the events. The daemon is then killed (no clean stop): the
/// next start writes a post-mortem event that names the last action and the RAM it last saw.
#[test]
fn the_history_keeps_an_incident_and_the_next_start_writes_its_post_mortem() {
    let config = "[ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\naction = \"stop\"\n\
                  [gpu]\nenabled = false\n";
    let mut w = World {
        host: host(64 * GIB, 2 * GIB),
        ..World::default()
    };
    w.spawn(200, "hog", 12 * GIB);
    let mut h = Harness::new(w, config);
    let kmsg = h.kernel_log_as_on_gce();
    h.ticks(4, 100 * MS);
    assert_eq!(h.signals(), [(200, Sig::Stop)]);
    let kernel_log = std::fs::read_to_string(&kmsg).unwrap();
    assert!(
        kernel_log.starts_with("<2>gpuguard: floor_act: "),
        "the critical event: {kernel_log}"
    );
    h.daemon.reporter.recorder.as_ref().unwrap().flush();
    let dir = h._dir.path().join("state").join(crate::history::DIR);
    let history = crate::history::read(&dir).unwrap();
    assert!(history.warnings.is_empty(), "{:?}", history.warnings);
    assert!(matches!(
        history.records[0],
        crate::history::Record::Start { .. }
    ));
    let action = history
        .records
        .iter()
        .find_map(|r| match r {
            crate::history::Record::Action { at_ms, action } => Some((*at_ms, action)),
            _ => None,
        })
        .expect("the action is recorded");
    assert_eq!(
        (action.1.verb.as_str(), action.1.target.as_str()),
        ("stop", "pid 200(hog)")
    );
    let (_, status) = history
        .status_at(crate::history::now_ms())
        .expect("a sample");
    assert_eq!(status.memory.level, "act");
    assert_eq!(status.memory.host.available_bytes, Some(2 * GIB));
    assert_eq!(status.held.len(), 1, "{:?}", status.held);
    assert!(history.records.iter().any(|r| matches!(r,
        crate::history::Record::Event { kind, .. } if kind == "floor_act")));
    // What the daemon recorded is enough to decide again: replayed with the same config, the
    // policy stops the hog too; with the act floor under what was available, it does not.
    let replay = |text: &str| {
        let config = Config::parse(text, std::path::Path::new("new.toml")).unwrap();
        let mut replay = crate::history::replay::Replay::new(&config, 0, u64::MAX);
        history.records.iter().cloned().for_each(|r| replay.feed(r));
        replay.finish()
    };
    let same = replay(config);
    assert_eq!(same.recorded.len(), 1);
    assert!(same.recorded[0].on_both_sides, "{same:?}");
    assert_eq!(same.replayed.len(), 1, "{same:?}");
    let lower = replay(&config.replace("min_available = \"4GiB\"", "min_available = \"1GiB\""));
    assert!(lower.replayed.is_empty(), "{lower:?}");
    assert!(!lower.recorded[0].on_both_sides);

    // Killed: no clean stop. The next daemon on the same state directory says how it ended.
    let w = World {
        host: host(64 * GIB, 40 * GIB),
        ..World::default()
    };
    let h = h.restart(w, config);
    h.daemon.reporter.recorder.as_ref().unwrap().flush();
    let history = crate::history::read(&dir).unwrap();
    let post_mortem = history
        .records
        .iter()
        .find_map(|r| match r {
            crate::history::Record::Event { kind, message, .. }
                if kind == "previous_run_unclean" =>
            {
                Some(message.clone())
            }
            _ => None,
        })
        .expect("a post-mortem event");
    assert!(
        post_mortem.contains("ended without a clean stop"),
        "{post_mortem}"
    );
    assert!(
        post_mortem.contains("RAM 2.0 GiB available (act)"),
        "{post_mortem}"
    );
    assert!(post_mortem.contains("stop pid 200(hog)"), "{post_mortem}");
    // The history runs on: the first run, then this one.
    assert_eq!(history.runs(), 2);

    // A clean stop leaves no post-mortem for the start after it.
    let Harness {
        mut daemon, _dir, ..
    } = h;
    daemon.reporter.stop_recording();
    drop(daemon);
    let h = Harness::in_dir(_dir, World::default(), config);
    h.daemon.reporter.recorder.as_ref().unwrap().flush();
    let history = crate::history::read(&dir).unwrap();
    let post_mortems = history
        .records
        .iter()
        .filter(|r| {
            matches!(r,
            crate::history::Record::Event { kind, .. } if kind == "previous_run_unclean")
        })
        .count();
    assert_eq!(post_mortems, 1, "only the one after the kill");
}

/// The flight recorder keeps a sample when a model's figures jump, not only by the clock: a
/// quiet host keeps one every 10 s, but a model that grows by 4 GiB between two of them is
/// recorded on the tick it is seen; and a figure that flaps every tick for two minutes adds at
/// most `PER_WINDOW` samples a window (on the driven clock).
#[test]
fn the_history_keeps_a_sample_when_a_models_figures_jump_and_a_flapping_one_cannot_flood_it() {
    use crate::history::jumps::PER_WINDOW;
    let config = "scan_interval = \"1s\"\n[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n[gpu]\nenabled = false\n\
                  [[model]]\nname = \"srv\"\nmatch = { comm = \"srv\" }\nram = \"1TiB\"\n";
    let mut w = World {
        host: host(256 * GIB, 200 * GIB),
        ..World::default()
    };
    w.spawn(200, "srv", GIB);
    let mut h = Harness::new(w, config);
    let samples = |h: &Harness| {
        h.daemon.reporter.recorder.as_ref().unwrap().flush();
        let dir = h._dir.path().join("state").join(crate::history::DIR);
        let history = crate::history::read(&dir).unwrap();
        history
            .records
            .iter()
            .filter_map(|r| match r {
                crate::history::Record::Sample { status, .. } => {
                    Some(status.models.iter().map(|m| m.ram_bytes).sum::<u64>())
                }
                _ => None,
            })
            .collect::<Vec<u64>>()
    };
    h.ticks(20, 100 * MS);
    let quiet = samples(&h);
    assert!(!quiet.is_empty() && quiet.len() <= 2, "{quiet:?}");
    // It loads 4 GiB: within a scan or two it is in the history, 8 s before the clock's sample.
    h.world().procs.get_mut(&200).unwrap().rss_bytes = 5 * GIB;
    h.ticks(20, 100 * MS);
    let loaded = samples(&h);
    assert_eq!(loaded.len(), quiet.len() + 1, "{loaded:?}");
    assert_eq!(loaded.last(), Some(&(5 * GIB)));
    // Flapping between 1 and 5 GiB, every scan (each second) seeing the other figure, for two
    // minutes: the clock's 12 samples, and at most PER_WINDOW a window for the jumps (three
    // windows touch these two minutes, the one the load opened included).
    for tick in 0..1200 {
        let rss = if tick / 10 % 2 == 0 { GIB } else { 5 * GIB };
        h.world().procs.get_mut(&200).unwrap().rss_bytes = rss;
        h.tick(100 * MS);
    }
    let flapped = samples(&h).len() - loaded.len();
    let (least, most) = (12 + PER_WINDOW as usize, 13 + 3 * PER_WINDOW as usize);
    assert!(
        (least..=most).contains(&flapped),
        "{flapped} samples in two minutes (from {least} to {most})"
    );
}

/// On GCE the kernel log gets every kill (SIGTERM or SIGKILL) too, besides critical events:
/// the serial console keeps what the guard did when the disk lost its last writes.
#[test]
fn a_kill_goes_to_the_kernel_log_as_well() {
    let mut w = World {
        host: host(64 * GIB, 2 * GIB),
        ..World::default()
    };
    w.spawn(200, "hog", 12 * GIB);
    w.exit_on_term.push(200);
    let mut h = Harness::new(
        w,
        "[ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\naction = \"kill\"\n\
         [gpu]\nenabled = false\n[history]\nenabled = false\n",
    );
    let kmsg = h.kernel_log_as_on_gce();
    h.ticks(3, 100 * MS);
    assert_eq!(h.signals(), [(200, Sig::Term)], "{:?}", h.actions());
    let kernel_log = std::fs::read_to_string(&kmsg).unwrap();
    assert!(
        kernel_log
            .lines()
            .any(|l| l.starts_with("<2>gpuguard: terminate pid 200(hog): ")),
        "{kernel_log}"
    );
}

/// Observe mode through the daemon: a hog under the act floor gets a decision (a terminate,
/// logged as observed, naming it) and no signal, then or later (no escalation past
/// `term_grace`). Moved from the host suite (`ram_guard`): the real signal path is the host's.
#[test]
fn observe_mode_decides_but_signals_nothing() {
    let mut w = World {
        host: host(64 * GIB, 2 * GIB),
        ..World::default()
    };
    w.spawn(200, "hog", 12 * GIB);
    let mut h = Harness::new(
        w,
        "mode = \"observe\"\nterm_grace = \"1s\"\n\
         [ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\naction = \"kill\"\n\
         [gpu]\nenabled = false\n",
    );
    h.tick(MS);
    assert_eq!(h.actions(), ["terminate pid 200(hog): observed"]);
    h.ticks(30, 100 * MS);
    assert_eq!(h.signals(), []);
    assert_eq!(h.actions().len(), 1, "{:?}", h.actions());
    let observed = logged(&h, "process_killed");
    assert_eq!(observed.len(), 1, "{observed:?}");
    let observed: serde_json::Value = serde_json::from_str(&observed[0]).unwrap();
    assert_eq!(
        (&observed["action"]["verb"], &observed["action"]["outcome"]),
        (&"terminate".into(), &"observed".into()),
        "{observed}"
    );
    assert_eq!(observed["subject"]["pid"], 200, "{observed}");
}

/// A victim that ignores SIGTERM and keeps growing is SIGKILLed on its growth, long before a
/// 10-minute `term_grace`: the first reading after SIGTERM is its baseline, and growth past
/// `term_max_growth` (8 MiB) is the sign it is not shutting down. Moved from the host suite
/// (`sigterm`): there it held memory pressure for up to two minutes.
#[test]
fn a_victim_that_ignores_sigterm_and_grows_is_killed_without_waiting_for_term_grace() {
    let mut w = World {
        host: host(64 * GIB, 2 * GIB),
        ..World::default()
    };
    w.spawn(200, "hog", 6 * GIB);
    let mut h = Harness::new(
        w,
        "term_grace = \"10m\"\n\
         [ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\naction = \"kill\"\n\
         [gpu]\nenabled = false\n",
    );
    h.tick(MS);
    assert_eq!(h.signals(), [(200, Sig::Term)]);
    for _ in 0..10 {
        if let Some(p) = h.world().procs.get_mut(&200) {
            p.rss_bytes += 4 * MIB;
        }
        h.tick(2 * MS);
    }
    assert_eq!(h.signals(), [(200, Sig::Term), (200, Sig::Kill)]);
    let escalations: Vec<serde_json::Value> = logged(&h, "process_killed")
        .iter()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["action"].clone())
        .filter(|a| a["verb"] == "kill")
        .collect();
    assert_eq!(escalations.len(), 1, "{escalations:?}");
    assert_eq!(escalations[0]["after_term"], "grew", "{escalations:?}");
}

/// A webhook endpoint on 127.0.0.1 that accepts every connection and never answers: it keeps
/// them open, unanswered, until the test process ends.
struct HungWebhook {
    port: u16,
    accepted: Arc<Mutex<Vec<std::net::TcpStream>>>,
}

impl HungWebhook {
    fn start() -> HungWebhook {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(Mutex::new(Vec::new()));
        let keep = accepted.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                keep.lock().unwrap().push(stream);
            }
        });
        HungWebhook { port, accepted }
    }

    /// The first connection the daemon made, waited for.
    fn first(&self) -> std::net::TcpStream {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(s) = self.accepted.lock().unwrap().first() {
                return s.try_clone().unwrap();
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the webhook was never called"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Whether the client still holds `stream` open: its request read (nothing is answered), no
/// end of stream. A client that gave up (its timeout) has closed it.
fn still_open(stream: &std::net::TcpStream) -> bool {
    use std::io::Read;
    stream.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match (&*stream).read(&mut buf) {
            Ok(0) => return false,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
            Err(_) => return false,
        }
    }
}

/// A webhook that accepts and never answers (60 s timeout) does not hold the guard: the tick
/// sends SIGTERM, and SIGKILL follows at term_grace on the daemon clock, while the webhook's
/// first request still hangs (its connection still open: a guard that waited for the webhook
/// would have returned only once the client gave that request up). Moved from the host suite
/// (`alerts`), where it put the machine under memory pressure.
#[test]
fn a_webhook_that_never_answers_does_not_slow_the_guard() {
    let hook = HungWebhook::start();
    let mut w = World {
        host: host(64 * GIB, 2 * GIB),
        ..World::default()
    };
    w.spawn(200, "hog", 12 * GIB);
    let mut h = Harness::new(
        w,
        &format!(
            "term_grace = \"1s\"\n\
             [alert]\ntimeout = \"60s\"\nqueue = 4\n\
             [[alert.webhook]]\nurl = \"http://127.0.0.1:{}/hook\"\nmin_severity = \"info\"\n\
             [ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\naction = \"kill\"\n\
             [gpu]\nenabled = false\n",
            hook.port
        ),
    );
    h.tick(MS);
    assert_eq!(h.signals(), [(200, Sig::Term)], "{:?}", h.actions());
    h.ticks(12, 100 * MS);
    assert_eq!(
        h.signals(),
        [(200, Sig::Term), (200, Sig::Kill)],
        "{:?}",
        h.actions()
    );
    let first = hook.first();
    assert!(
        still_open(&first),
        "the webhook's first request was given up before the kill"
    );
}

/// A reload whose config does not parse is refused with an event that names the key and the
/// value, and the old config keeps acting: a process over the old budget is stopped. Moved from
/// the host suite (`ram_guard`); SIGHUP's wiring to the reload stays with the host tests.
#[test]
fn a_bad_reload_keeps_the_old_config_running() {
    let good = "[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n[gpu]\nenabled = false\n\
                [[model]]\nname = \"m\"\nmatch = { comm = \"hog\" }\nram = \"64MiB\"\n\
                action = \"stop\"\ngrace = \"0s\"\n";
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        ..World::default()
    };
    w.spawn(200, "hog", 32 * MIB);
    let mut h = Harness::new(w, good);
    h.tick(MS);
    h.reload(&good.replace("ram = \"64MiB\"", "ram = \"64 parsecs\""));
    let failed = logged(&h, "config_reload_failed");
    assert_eq!(failed.len(), 1, "{failed:?}");
    // The config's own error, whole (its words are `config::tests`'), on the key refused.
    let error = Config::load(&h.daemon.config_path).unwrap_err();
    assert_eq!(error.key, "model[0] 'm'.ram");
    let failed: serde_json::Value = serde_json::from_str(&failed[0]).unwrap();
    assert!(
        failed["summary"]
            .as_str()
            .is_some_and(|s| s.ends_with(&error.to_string())),
        "{failed} {error}"
    );
    assert_eq!(h.signals(), []);
    // Over the old budget (64 MiB): stopped, once the next scan has seen it.
    h.world().procs.get_mut(&200).unwrap().rss_bytes = 128 * MIB;
    h.ticks(60, 100 * MS);
    assert_eq!(h.signals(), [(200, Sig::Stop)], "{:?}", h.actions());
}

/// A model over its RAM budget is stopped (and recorded in `stopped.json`, for the next start);
/// a reload that raises the budget resumes it: SIGCONT, the record emptied, `budget_cleared`.
/// Moved from the host suite (`ram_guard`); SIGHUP's wiring and a real SIGCONT stay with the
/// host tests (`sigterm_resumes_stopped_processes_before_exit`).
#[test]
fn a_model_over_its_ram_budget_is_stopped_then_resumed_when_a_reload_raises_it() {
    let model = |budget: &str| {
        format!(
            "[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n[gpu]\nenabled = false\n\
             [[model]]\nname = \"greedy\"\nmatch = {{ comm = \"hog\" }}\nram = \"{budget}\"\n\
             action = \"stop\"\ngrace = \"300ms\"\n"
        )
    };
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        ..World::default()
    };
    w.spawn(200, "hog", 256 * MIB);
    let mut h = Harness::new(w, &model("100MiB"));
    h.ticks(10, 100 * MS);
    assert_eq!(h.signals(), [(200, Sig::Stop)], "{:?}", h.actions());
    let record = h._dir.path().join("state").join("stopped.json");
    assert_eq!(stopped_pids(&record), [200]);
    let exceeded: serde_json::Value =
        serde_json::from_str(&logged(&h, "budget_exceeded")[0]).unwrap();
    assert_eq!(exceeded["subject"]["model"], "greedy", "{exceeded}");
    assert_eq!(exceeded["subject"]["budget_bytes"], 100 * MIB, "{exceeded}");

    h.reload(&model("4GiB"));
    h.ticks(3, 100 * MS);
    assert_eq!(
        h.signals(),
        [(200, Sig::Stop), (200, Sig::Cont)],
        "{:?}",
        h.actions()
    );
    assert_eq!(h.world().procs[&200].state, 'S');
    assert!(h.daemon.executor.held().is_empty());
    assert_eq!(stopped_pids(&record), [0; 0]);
    let cleared: serde_json::Value =
        serde_json::from_str(&logged(&h, "budget_cleared")[0]).unwrap();
    assert_eq!(cleared["subject"]["model"], "greedy", "{cleared}");
}

/// Forked workers share pages (the weights a `--preload` master loaded before forking, the
/// libraries): four workers of 3 GiB RSS each hold 1 GiB of their own. Their RSS (12 GiB) is
/// over the model's 8 GiB RAM budget; what they really hold (PSS, 4 GiB) is not: the scan is asked
/// for PSS at once, nothing is said or done before it lands, and the budget holds. Once one
/// worker's own memory grows past the budget (PSS 9 GiB in all), the model is stopped.
#[test]
fn forked_workers_are_held_to_their_ram_budget_by_what_they_hold_not_by_shared_pages() {
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        ..World::default()
    };
    for pid in 101..=104 {
        w.spawn(pid, "worker", 3 * GIB);
        w.procs.get_mut(&pid).unwrap().ppid = if pid == 101 { 1 } else { 101 };
        w.pss.insert(pid, GIB);
    }
    let mut h = Harness::new(
        w,
        "scan_interval = \"200ms\"\n\
         [ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n[gpu]\nenabled = false\n\
         [[model]]\nname = \"forked\"\nmatch = { comm = \"worker\" }\nram = \"8GiB\"\n\
         action = \"stop\"\ngrace = \"300ms\"\n",
    );
    h.ticks(10, 100 * MS);
    assert!(
        h.world().pss_reads.contains(&101),
        "{:?}",
        h.world().pss_reads
    );
    assert_eq!(h.signals(), [], "{:?}", h.actions());
    assert!(logged(&h, "budget_exceeded").is_empty());
    // One worker's own memory grows by 5 GiB: 9 GiB held in all.
    h.world().procs.get_mut(&102).unwrap().rss_bytes = 8 * GIB;
    h.world().pss.insert(102, 6 * GIB);
    h.ticks(10, 100 * MS);
    let stopped: Vec<i32> = h.signals().iter().map(|(pid, _)| *pid).collect();
    assert_eq!(stopped, [101, 102, 103, 104], "{:?}", h.actions());
    let exceeded: serde_json::Value =
        serde_json::from_str(&logged(&h, "budget_exceeded")[0]).unwrap();
    assert_eq!(exceeded["subject"]["usage_bytes"], 9 * GIB, "{exceeded}");
}

/// A daemon killed while it held a process stopped: the next one, whose config no longer
/// budgets that model, resumes it at start (SIGCONT, same pid and start time) and says so.
/// Moved from the host suite (`ram_guard`); the real SIGKILLed binary and real stopped
/// processes stay with `faults::a_daemon_killed_while_holding_processes_resumes_them_before_
/// reading_a_broken_config`.
#[test]
fn a_daemon_killed_while_holding_a_process_resumes_it_on_restart() {
    let floors = "[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n[gpu]\nenabled = false\n";
    let budget = "[[model]]\nname = \"m\"\nmatch = { comm = \"hog\" }\nram = \"64MiB\"\n\
                  action = \"stop\"\ngrace = \"0s\"\n";
    let world = || {
        let mut w = World {
            host: host(64 * GIB, 40 * GIB),
            ..World::default()
        };
        w.spawn(200, "hog", 128 * MIB);
        w
    };
    let mut h = Harness::new(world(), &format!("{floors}{budget}"));
    h.ticks(3, 100 * MS);
    assert_eq!(h.signals(), [(200, Sig::Stop)], "{:?}", h.actions());
    // The process is still stopped when the next daemon starts (nobody resumed it).
    let mut w = world();
    w.procs.get_mut(&200).unwrap().state = 'T';
    let h = h.restart(w, floors);
    assert_eq!(h.signals(), [(200, Sig::Cont)]);
    assert_eq!(h.world().procs[&200].state, 'S');
    // Said once (what it resumed, in words, is `act::tests`').
    let undone = logged(&h, "leftovers_undone");
    assert_eq!(undone.len(), 1, "{undone:?}");
}

/// A stop record that cannot be read (half written, say) is kept aside as it was, reported as
/// a critical `state_file_corrupt`, and nobody is signalled for it. Moved from the host suite
/// (`faults`).
#[test]
fn a_garbage_stop_record_is_kept_aside_and_reported() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::write(state.join("stopped.json"), "{ half a rec").unwrap();
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        ..World::default()
    };
    w.spawn(200, "idle", 32 * MIB);
    w.procs.get_mut(&200).unwrap().state = 'T';
    let mut h = Harness::in_dir(dir, w, "[gpu]\nenabled = false\n");
    let corrupt = logged(&h, "state_file_corrupt");
    assert_eq!(corrupt.len(), 1, "{corrupt:?}");
    let corrupt: serde_json::Value = serde_json::from_str(&corrupt[0]).unwrap();
    assert_eq!(corrupt["severity"], "critical", "{corrupt}");
    assert!(
        corrupt["summary"]
            .as_str()
            .is_some_and(|s| s.contains("stopped.json is unreadable")),
        "{corrupt}"
    );
    let kept: Vec<std::path::PathBuf> = std::fs::read_dir(&state)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("stopped.json.corrupt-"))
        })
        .collect();
    assert_eq!(kept.len(), 1, "kept aside, not replaced: {kept:?}");
    assert_eq!(std::fs::read_to_string(&kept[0]).unwrap(), "{ half a rec");
    h.ticks(5, 100 * MS);
    assert_eq!(h.signals(), [], "{:?}", h.actions());
}

/// Issue 40: a daemon that observes reloads a config that enforces while another daemon
/// enforces on the host: the reload is refused (`config_reload_failed` names the other daemon)
/// and it keeps observing, signalling nothing although a process is over the floor; once the
/// other lets go, the same reload takes and it acts at the next crossing.
#[test]
fn a_reload_to_enforce_while_another_daemon_enforces_is_refused_and_nothing_is_signalled() {
    let mut w = World {
        host: host(64 * GIB, 2 * GIB),
        ..World::default()
    };
    w.spawn(200, "hog", 12 * GIB);
    let floors = "[ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\naction = \"stop\"\n\
                  [gpu]\nenabled = false\n";
    let mut h = Harness::new(w, &format!("mode = \"observe\"\n{floors}"));
    let lock = h._dir.path().join("enforce.lock");
    let other = crate::act::claim::Holder {
        pid: 4242,
        config: "/etc/gpuguard/config.toml".into(),
        state_dir: "/var/lib/gpuguard".into(),
    };
    let held = crate::act::claim::take_enforce_lock(&lock, &other).unwrap();
    h.ticks(3, 10 * MS);
    h.reload(floors);
    let failed = logged(&h, "config_reload_failed");
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(
        failed[0].contains("daemon.mode 'enforce'") && failed[0].contains("gpuguard pid 4242"),
        "{failed:?}"
    );
    assert_eq!(h.daemon.config.daemon.mode, crate::config::Mode::Observe);
    h.ticks(5, 10 * MS);
    assert_eq!(h.signals(), [], "{:?}", h.actions());
    drop(held);
    h.reload(floors);
    assert_eq!(h.daemon.config.daemon.mode, crate::config::Mode::Enforce);
    h.world().host = host(64 * GIB, 40 * GIB);
    h.ticks(5, 100 * MS);
    h.world().host = host(64 * GIB, 2 * GIB);
    h.ticks(5, 10 * MS);
    assert_eq!(h.signals(), [(200, Sig::Stop)], "{:?}", h.actions());
}

/// Issue 40: a second daemon on a state directory one holds is refused before it reads or
/// writes anything there, naming the first; the first's record is untouched.
#[test]
fn a_second_daemon_on_the_same_state_directory_is_refused_naming_the_first() {
    let world = || {
        let mut w = World {
            host: host(64 * GIB, 2 * GIB),
            ..World::default()
        };
        w.spawn(200, "hog", 12 * GIB);
        w
    };
    let config = "[ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\naction = \"stop\"\n\
                  [gpu]\nenabled = false\n";
    let mut h = Harness::new(world(), config);
    h.tick(MS);
    assert_eq!(h.signals(), [(200, Sig::Stop)]);
    let record = h._dir.path().join("state").join("stopped.json");
    assert_eq!(stopped_pids(&record), [200]);
    let path = h._dir.path().join("config.toml");
    let parsed = Config::parse(&config_text(&h._dir, config), &path).unwrap();
    let shared: Shared = Arc::new(Mutex::new(world()));
    let tables = shared.clone();
    let sources = Sources {
        procs: Box::new(FakeProc(shared.clone())),
        tables: Box::new(move || Box::new(FakeTables(tables.clone()))),
        gpus: None,
        control: Arc::new(FakeControl(shared.clone())),
        cgroup_root: h._dir.path().join("cgroup"),
        proc_root: h._dir.path().join("proc"),
        enforce_lock: h._dir.path().join("other-host.lock"),
        inline: true,
    };
    let e = Daemon::with_sources(&path, parsed, sources)
        .err()
        .expect("refused");
    assert!(matches!(e, super::StartError::Claimed(_)), "{e}");
    let me = std::process::id();
    assert!(
        e.to_string()
            .contains(&format!("is held by gpuguard pid {me}")),
        "{e}"
    );
    assert!(
        shared.lock().unwrap().signals.is_empty(),
        "the second daemon signalled"
    );
    assert_eq!(stopped_pids(&record), [200]);
}

/// Issue 40: what the command line set (`--observe`, `--state-dir`, `--socket`) holds across
/// reloads: a reloaded file that says enforce, elsewhere, does not make `--observe` act.
#[test]
fn command_line_overrides_hold_across_reloads() {
    let mut w = World {
        host: host(64 * GIB, 2 * GIB),
        ..World::default()
    };
    w.spawn(200, "hog", 12 * GIB);
    let floors = "[ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\naction = \"stop\"\n\
                  [gpu]\nenabled = false\n";
    let mut h = Harness::new(w, &format!("mode = \"observe\"\n{floors}"));
    let socket = h._dir.path().join("cli.sock");
    h.daemon.keep_overrides(crate::config::Overrides {
        state_dir: None,
        socket: Some(socket.clone()),
        observe: true,
    });
    h.reload(&format!(
        "mode = \"enforce\"\n{floors}[launch]\nsocket = \"/elsewhere.sock\"\n"
    ));
    assert_eq!(h.daemon.config.daemon.mode, crate::config::Mode::Observe);
    assert!(!h.daemon.executor.enforcing());
    h.ticks(5, 10 * MS);
    assert_eq!(h.signals(), [], "{:?}", h.actions());
}
