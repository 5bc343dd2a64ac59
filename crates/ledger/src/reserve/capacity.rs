//! What the reservation table knows of the host: published by the daemon loop after every tick
//! from the snapshot and the policy's attribution, read by every admission in between (the socket
//! thread admits permits without waiting for the loop).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::time::Duration;

use crate::config::Config;
use crate::policy::admission::Ceilings;
use crate::policy::{Level, PolicyState, Resource};
use crate::snapshot::{GpuSnapshot, GpuStatus, ProcessId, Snapshot};

/// The host as admission sees it.
#[derive(Clone, Debug, Default)]
pub struct Capacity {
    pub gpus: Vec<GpuCapacity>,
    /// Why this host has no GPU at all, when its readings say so: GPU support disabled, no
    /// NVIDIA driver, or NVML answering with no device. `None` with no `gpus`: not known yet
    /// (NVML starting, failing, or its reading stale), and a GPU demand waits.
    pub no_gpu: Option<String>,
    pub ram: RamCapacity,
    /// Launches wait while this is set (a warn floor is crossed), and this says why.
    pub launch_pause: Option<String>,
    /// Each model's current use.
    pub models: HashMap<String, ModelUse>,
    /// The model each process belongs to (a permit that names none takes its caller's).
    pub member_of: HashMap<ProcessId, String>,
    /// What each process holds on the GPUs with its descendants, for every process that holds
    /// GPU memory and each of its ancestors: a reservation's holder is set against its tree.
    pub trees: HashMap<ProcessId, TreeUse>,
    /// GPU holders the process scan has not seen yet (a server that started since), by pid:
    /// what each holds itself.
    pub unscanned: HashMap<i32, TreeUse>,
    /// The per-process GPU figures were read in the same NVML pass as `free`: a model's use and
    /// the GPU's free memory can be set against each other (see `Account::gpu_promised`).
    pub gpu_consistent: bool,
    /// The GPU reading did not read the process lists (their figures are an earlier pass's):
    /// while nothing is reserved or waits, most readings do not.
    pub gpu_processes_stale: bool,
    /// When the GPU reading was taken (daemon clock).
    pub gpu_sampled_at: Option<Duration>,
    /// When the process scan behind `member_of` and `trees` ran (daemon clock).
    pub scanned_at: Option<Duration>,
    /// Models whose engine's metrics show a preallocated KV cache (vLLM's
    /// `cache_config_info`): their requests never take GPU memory of their own.
    pub preallocated: BTreeSet<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuCapacity {
    pub index: u32,
    pub uuid: String,
    pub total: Option<u64>,
    pub free: Option<u64>,
    /// The floor admission keeps free: the warn floor, else the act floor, else 0.
    pub floor: u64,
    /// False while the GPU's reading is unknown, stale or inconsistent: nothing is placed on it.
    pub usable: bool,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RamCapacity {
    pub total: Option<u64>,
    pub available: Option<u64>,
    pub floor: u64,
}

/// A model's use as the latest scan and GPU process lists saw it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelUse {
    pub gpu_bytes: BTreeMap<u32, u64>,
    /// Some member's GPU use is unavailable: `gpu_bytes` is a lower bound.
    pub gpu_unknown: bool,
    pub ram_bytes: u64,
    /// Changes whenever the set of member processes changes.
    pub members: u64,
}

/// What a process and its descendants hold on the GPUs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TreeUse {
    pub gpu_bytes: BTreeMap<u32, u64>,
    /// Some process's GPU use is unavailable: `gpu_bytes` is a lower bound.
    pub gpu_unknown: bool,
    /// Changes whenever the set of processes holding GPU memory in the tree changes.
    pub members: u64,
    /// Of `gpu_bytes`, what members of each model hold (a client that started its model's
    /// server has the server in its tree).
    pub by_model: BTreeMap<String, BTreeMap<u32, u64>>,
}

impl ModelUse {
    pub fn gpu_total_bytes(&self) -> u64 {
        self.gpu_bytes.values().sum()
    }
}

impl Capacity {
    /// The capacity after a tick: floors resolved against totals, each model's use.
    pub fn from_tick(config: &Config, snapshot: &Snapshot, state: &PolicyState) -> Capacity {
        let g = &snapshot.gpus;
        let gpus_usable = g.status == GpuStatus::Ok && !g.stale;
        let gpus = g
            .devices
            .iter()
            .map(|d| {
                let (warn, min) = config.gpu.floor_bytes(d.index, &d.uuid, d.total_bytes);
                GpuCapacity {
                    index: d.index,
                    uuid: d.uuid.clone(),
                    total: d.total_bytes,
                    free: d.free_bytes,
                    floor: warn.or(min).unwrap_or(0),
                    // Lost, failing or inconsistent (used > total...): nothing is placed on it.
                    usable: gpus_usable
                        && d.untrusted().is_none()
                        && d.free_bytes.is_some()
                        && d.total_bytes.is_some(),
                }
            })
            .collect();
        let no_gpu = no_gpu(g);
        let host = &snapshot.host;
        let (warn, min) = config.ram.floor_bytes(host.total_bytes);
        let ram = RamCapacity {
            total: host.total_bytes,
            available: host.available_bytes,
            floor: warn.or(min).unwrap_or(0),
        };
        let launch_pause = state
            .levels
            .iter()
            .find(|(_, l)| matches!(l, Level::Warn | Level::Act))
            .map(|(r, _)| match r {
                Resource::Ram | Resource::Gpu(_) => {
                    format!("{r} is below its warn floor; launches pause until it recovers")
                }
            });
        let mut models = HashMap::new();
        let mut member_of = HashMap::new();
        for usage in &state.attribution.models {
            let mut members = std::collections::hash_map::DefaultHasher::new();
            for &id in &usage.members {
                id.hash(&mut members);
                member_of.insert(id, usage.name.clone());
            }
            models.insert(
                usage.name.clone(),
                ModelUse {
                    gpu_bytes: usage.gpu_bytes.clone(),
                    gpu_unknown: usage.gpu_unknown,
                    ram_bytes: usage.ram_bytes,
                    members: members.finish(),
                },
            );
        }
        let (trees, unscanned) = trees(snapshot, &member_of);
        Capacity {
            gpus,
            no_gpu,
            ram,
            launch_pause,
            models,
            member_of,
            trees,
            unscanned,
            gpu_consistent: g.processes_fresh && g.devices.iter().all(|d| d.processes_steady),
            gpu_processes_stale: !g.processes_fresh,
            gpu_sampled_at: g.sampled_at,
            scanned_at: snapshot.processes.scanned_at,
            preallocated: BTreeSet::new(),
        }
    }

    /// What no reservation changes: each GPU's memory and the RAM, less their floors.
    pub fn ceilings(&self) -> Ceilings {
        Ceilings {
            gpus: self
                .gpus
                .iter()
                .map(|g| (g.index, g.total.map(|t| t.saturating_sub(g.floor))))
                .collect(),
            no_gpu: self.no_gpu.clone(),
            ram: self.ram.total.map(|t| t.saturating_sub(self.ram.floor)),
        }
    }

    /// What `holder` holds on the GPUs with its descendants, if the latest readings tell.
    pub fn tree(&self, holder: ProcessId) -> Option<&TreeUse> {
        self.trees
            .get(&holder)
            .or_else(|| self.unscanned.get(&holder.pid))
    }

    pub fn gpu(&self, index: u32) -> Option<&GpuCapacity> {
        self.gpus.iter().find(|g| g.index == index)
    }

    /// The largest GPU's memory (a `%` GPU size is a share of it).
    pub fn largest_gpu_bytes(&self) -> Option<u64> {
        self.gpus.iter().filter_map(|g| g.total).max()
    }
}

/// [`Capacity::no_gpu`]: why the GPU readings say this host has none, if they do (a fresh
/// reading of none, or no NVML at all), never on a reading that is stale or unknown.
fn no_gpu(g: &GpuSnapshot) -> Option<String> {
    if g.stale || !g.devices.is_empty() {
        return None;
    }
    match &g.status {
        GpuStatus::Off if g.absent => {
            Some("GPU support is disabled by config ([gpu] enabled = false)".into())
        }
        GpuStatus::Unavailable(why) if g.absent => Some(why.clone()),
        GpuStatus::Ok if g.sampled_at.is_some() => Some("NVML sees no GPU".into()),
        _ => None,
    }
}

/// Longest parent chain followed from a GPU holder (deeper is not a real process tree).
const MAX_TREE_DEPTH: usize = 64;

/// [`Capacity::trees`]: each GPU holder's memory added to itself and every ancestor the process
/// scan knows, up to the first of another (real) uid and never pid 1 (every process descends
/// from it); and [`Capacity::unscanned`].
fn trees(
    snapshot: &Snapshot,
    member_of: &HashMap<ProcessId, String>,
) -> (HashMap<ProcessId, TreeUse>, HashMap<i32, TreeUse>) {
    let by_pid = |pid: i32| snapshot.processes.by_pid(pid);
    let mut trees: HashMap<ProcessId, TreeUse> = HashMap::new();
    let mut unscanned: HashMap<i32, TreeUse> = HashMap::new();
    for gpu in &snapshot.gpus.devices {
        let trusted = gpu.untrusted().is_none();
        for (&pid, &bytes) in &gpu.processes {
            let mut member = std::collections::hash_map::DefaultHasher::new();
            (pid, gpu.index).hash(&mut member);
            let member = member.finish();
            let model = by_pid(pid).and_then(|p| member_of.get(&p.id()));
            let add = |tree: &mut TreeUse| {
                match bytes.filter(|_| trusted) {
                    Some(b) => {
                        *tree.gpu_bytes.entry(gpu.index).or_default() += b;
                        if let Some(m) = model {
                            let of_model = tree.by_model.entry(m.clone()).or_default();
                            *of_model.entry(gpu.index).or_default() += b;
                        }
                    }
                    None => tree.gpu_unknown = true,
                }
                tree.members = tree.members.wrapping_add(member);
            };
            let Some(holder) = by_pid(pid) else {
                add(unscanned.entry(pid).or_default());
                continue;
            };
            let mut at = Some(holder);
            for _ in 0..MAX_TREE_DEPTH {
                let Some(p) = at.filter(|p| p.pid > 1 && p.uid == holder.uid) else {
                    break;
                };
                add(trees.entry(p.id()).or_default());
                at = by_pid(p.ppid).filter(|parent| parent.pid != p.pid);
            }
        }
    }
    (trees, unscanned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::{Gpu, GpuSnapshot, Process, ProcessTable};

    const GIB: u64 = 1 << 30;

    fn process(pid: i32, ppid: i32, uid: u32) -> Process {
        Process {
            pid,
            start_time: 7,
            ppid,
            uid,
            state: 'S',
            ..Default::default()
        }
    }

    fn id(pid: i32) -> ProcessId {
        ProcessId { pid, start_time: 7 }
    }

    /// "No GPU here" only from readings that say so: GPUs disabled, no driver, NVML answering
    /// with no device; never while NVML starts, fails in a way that may pass, or is stale.
    #[test]
    fn no_gpu_is_said_only_when_the_readings_say_so() {
        let config = Config::parse("", std::path::Path::new("t.toml")).unwrap();
        let no_gpu = |gpus: GpuSnapshot| {
            let snapshot = Snapshot {
                gpus,
                ..Default::default()
            };
            Capacity::from_tick(&config, &snapshot, &PolicyState::default()).no_gpu
        };
        let read = |status: GpuStatus, absent: bool| GpuSnapshot {
            status,
            absent,
            sampled_at: Some(Duration::ZERO),
            ..Default::default()
        };
        let no_driver =
            || GpuStatus::Unavailable("NVML library not loadable: no NVIDIA driver?".into());
        // `[gpu] enabled = false`: the sampler has no NVML at all.
        let disabled = GpuSnapshot {
            absent: true,
            ..Default::default()
        };
        assert!(no_gpu(disabled).is_some_and(|why| why.contains("enabled = false")));
        assert_eq!(
            no_gpu(read(no_driver(), true)).as_deref(),
            Some("NVML library not loadable: no NVIDIA driver?")
        );
        assert_eq!(
            no_gpu(read(GpuStatus::Ok, false)).as_deref(),
            Some("NVML sees no GPU")
        );
        // NVML not answered yet (its first reading pending, so stale): unknown.
        let starting = GpuSnapshot {
            stale: true,
            ..Default::default()
        };
        assert_eq!(no_gpu(starting), None);
        assert_eq!(no_gpu(GpuSnapshot::default()), None, "not absent: starting");
        // A failure that may pass (a panic, a version mismatch): unknown.
        let failing = GpuStatus::Unavailable("GPU sampler failed: boom".into());
        assert_eq!(no_gpu(read(failing, false)), None);
        // A stale reading of no driver: unknown.
        let stale = GpuSnapshot {
            stale: true,
            ..read(no_driver(), true)
        };
        assert_eq!(no_gpu(stale), None);
        // A GPU listed, even lost: not "none".
        let lost = GpuSnapshot {
            devices: vec![Gpu {
                lost: true,
                ..Default::default()
            }],
            ..read(GpuStatus::Ok, false)
        };
        assert_eq!(no_gpu(lost), None);
    }

    #[test]
    fn a_holders_tree_is_its_own_uids_descendants_and_new_holders_are_known_by_pid() {
        let used = |holders: &[(i32, u64)]| {
            let sum: u64 = holders.iter().map(|(_, g)| g * GIB).sum();
            Gpu {
                index: 0,
                total_bytes: Some(80 * GIB),
                used_bytes: Some(sum),
                free_bytes: Some(80 * GIB - sum),
                reserved_bytes: Some(0),
                processes: holders.iter().map(|&(p, g)| (p, Some(g * GIB))).collect(),
                processes_known: true,
                processes_steady: true,
                ..Default::default()
            }
        };
        let snapshot = |holders: &[(i32, u64)]| Snapshot {
            processes: ProcessTable {
                pss_read: true,
                scanned_at: Some(Duration::ZERO),
                processes: vec![
                    process(1, 0, 0),
                    process(100, 1, 1000),   // a server
                    process(101, 100, 1000), // its engine core, on the GPU
                    process(102, 100, 0),    // a setuid helper it started, on the GPU
                ],
            },
            gpus: GpuSnapshot {
                devices: vec![used(holders)],
                ..Default::default()
            },
            ..Default::default()
        };
        let (first, unscanned) = trees(&snapshot(&[(101, 5), (102, 3), (300, 1)]), &HashMap::new());
        let on0 = |t: &TreeUse| t.gpu_bytes.get(&0).copied();
        assert_eq!(
            on0(&first[&id(100)]),
            Some(5 * GIB),
            "not the setuid helper's"
        );
        assert_eq!(on0(&first[&id(101)]), Some(5 * GIB));
        assert_eq!(on0(&first[&id(102)]), Some(3 * GIB));
        assert!(!first.contains_key(&id(1)), "nobody counts on pid 1's tree");
        // A process that started after the scan: what it holds itself, by pid.
        assert_eq!(on0(&unscanned[&300]), Some(GIB));
        // A new child holding memory changes the tree's members (its baseline is void).
        let (grown, _) = trees(&snapshot(&[(101, 5), (100, 2)]), &HashMap::new());
        assert_ne!(grown[&id(100)].members, first[&id(100)].members);
        assert_eq!(grown[&id(101)].members, first[&id(101)].members);
    }
}
