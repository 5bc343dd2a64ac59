//! What the policy decided from, kept with the flight recorder's samples so that `gpuguard
//! replay` can run the same policy again with another config (`replay.rs`).
//!
//! A snapshot holds every process on the host; a record keeps the ones a decision can turn on:
//! those on a GPU, those of a model or a launch, the guard and what started it (no model takes
//! them in, `policy::rules`: a replay must know them too), and the largest by RSS (8 on a quiet
//! host, 32 near a floor or a budget). What a process is (its parent, owner, names, cgroup, executable)
//! changes rarely and is written with its first sample and every `DETAIL_EVERY` after, not with
//! each; a reader carries it forward. Command lines are kept with secret-looking values masked
//! (`secrets::masked`: the history is world-readable and outlives the processes). The rest of the snapshot (host memory, the GPUs with their
//! per-process figures, tmpfs owners, the launches) is kept whole. On a quiet host (every floor
//! ok, no model of the config over budget) the input goes with one sample a minute (`QUIET_EVERY`), not with
//! each: nothing is being decided then, and it is most of what a quiet day would write.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::policy::{Attribution, Launches};
use crate::snapshot::{
    Exe, Gpu, GpuSnapshot, GpuStatus, HostMemory, Process, ProcessId, ProcessTable, Snapshot,
};

/// How often a quiet host's samples carry the policy's input.
pub const QUIET_EVERY: Duration = Duration::from_secs(60);
/// How often a process's details are written again (a reader that starts after its first
/// sample, the segment with it dropped by the cap, finds them within this).
pub const DETAIL_EVERY: Duration = Duration::from_secs(600);
/// The largest processes kept on a quiet host, and near a floor or a budget.
const LARGEST_QUIET: usize = 8;
const LARGEST_NEAR: usize = 32;
/// Processes one input keeps at most.
const MAX_KEPT: usize = 256;
/// A command line is kept up to this many bytes (model matchers read the start of it).
const CMDLINE_BYTES: usize = 1024;

/// The policy's input at one tick, as recorded.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct PolicyInput {
    /// The daemon's clock at the tick (milliseconds since it started).
    pub clock_ms: u64,
    pub host: HostMemory,
    /// When the process scan ran (daemon clock, ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scanned_ms: Option<u64>,
    pub processes: Vec<ProcessSample>,
    /// Processes the scan saw that the record leaves out.
    #[serde(default)]
    pub left_out: usize,
    pub gpus: RecordedGpus,
    pub self_pid: i32,
    /// Bytes of tmpfs files per owning uid (a list: a record's maps cannot have number keys).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tmpfs_owners: Vec<(u32, u64)>,
    /// Processes started by `gpuguard launch`, and the model each belongs to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub launched: Vec<(ProcessId, String)>,
    /// Launched models that have no `[[model]]`: their budgets as declared.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub launched_models: Vec<LaunchedModel>,
}

/// One process at one tick. In JSON a row, `[pid, start_time, state, rss_bytes, swap_bytes,
/// pss_bytes, detail]` (a host with many GPU processes keeps hundreds a sample).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(from = "ProcessRow", into = "ProcessRow")]
pub struct ProcessSample {
    pub pid: i32,
    pub start_time: u64,
    pub state: char,
    pub rss_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swap_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pss_bytes: Option<u64>,
    /// What the process is: with its first sample and every `DETAIL_EVERY`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<ProcessDetail>,
}

/// `ProcessSample` as JSON writes it.
#[derive(Serialize, Deserialize)]
struct ProcessRow(
    i32,
    u64,
    char,
    u64,
    Option<u64>,
    Option<u64>,
    #[serde(default)] Option<ProcessDetail>,
);

impl From<ProcessRow> for ProcessSample {
    fn from(
        ProcessRow(pid, start_time, state, rss_bytes, swap_bytes, pss_bytes, detail): ProcessRow,
    ) -> Self {
        ProcessSample {
            pid,
            start_time,
            state,
            rss_bytes,
            swap_bytes,
            pss_bytes,
            detail,
        }
    }
}

impl From<ProcessSample> for ProcessRow {
    fn from(p: ProcessSample) -> Self {
        ProcessRow(
            p.pid,
            p.start_time,
            p.state,
            p.rss_bytes,
            p.swap_bytes,
            p.pss_bytes,
            p.detail,
        )
    }
}

/// What a process is (it rarely changes).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ProcessDetail {
    pub ppid: i32,
    pub uid: u32,
    pub comm: String,
    pub cmdline: String,
    pub cgroup: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exe: Option<Exe>,
}

/// The GPUs as sampled.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RecordedGpus {
    pub status: GpuStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampled_ms: Option<u64>,
    #[serde(default)]
    pub stale: bool,
    #[serde(default)]
    pub processes_fresh: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<Gpu>,
    /// `GpuSnapshot::absent`: no GPU on this host (no NVML, no driver, GPUs disabled).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub absent: bool,
}

/// A launched model's budgets, as `gpuguard launch` declared them.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct LaunchedModel {
    pub name: String,
    pub owner: u32,
    pub ram_bytes: u64,
    pub gpu_bytes: u64,
}

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

impl PolicyInput {
    /// The record of this tick's input. `near`: the host is near a floor or a model over its
    /// budget (more of the largest processes are kept). `detail_due`: whether a process's
    /// details are to be written with this sample.
    pub fn of_tick(
        snapshot: &Snapshot,
        launches: &Launches,
        attribution: &Attribution,
        near: bool,
        mut detail_due: impl FnMut(ProcessId) -> bool,
    ) -> PolicyInput {
        let table = &snapshot.processes.processes;
        let on_gpu = |pid: i32| {
            snapshot
                .gpus
                .devices
                .iter()
                .any(|g| g.processes.contains_key(&pid))
        };
        let mut keep: Vec<bool> = table
            .iter()
            .map(|p| {
                let id = p.id();
                on_gpu(p.pid)
                    || attribution.model_of(id).is_some()
                    || launches.registered.contains_key(&id)
            })
            .collect();
        // The guard and its ancestors, up to pid 1 (a hand-made table may be out of pid order).
        let index_of = |pid: i32| match table.binary_search_by_key(&pid, |p| p.pid) {
            Ok(i) => Some(i),
            Err(_) => table.iter().position(|p| p.pid == pid),
        };
        let mut at = index_of(snapshot.self_pid).filter(|_| snapshot.self_pid > 1);
        while let Some(i) = at.filter(|&i| !keep[i]) {
            keep[i] = true;
            at = index_of(table[i].ppid).filter(|&j| table[j].pid > 1);
        }
        let mut by_rss: Vec<usize> = (0..table.len()).collect();
        by_rss.sort_by_key(|&i| std::cmp::Reverse(table[i].rss_bytes));
        let largest = if near { LARGEST_NEAR } else { LARGEST_QUIET };
        by_rss
            .iter()
            .filter(|&&i| !table[i].kernel_thread && !table[i].exited())
            .take(largest)
            .for_each(|&i| keep[i] = true);
        // At most `MAX_KEPT`, the largest first: a user with thousands of processes in a model
        // must not make a record too large to keep.
        let mut kept = 0;
        for &i in &by_rss {
            if keep[i] {
                keep[i] = kept < MAX_KEPT;
                kept += 1;
            }
        }
        let processes: Vec<ProcessSample> = table
            .iter()
            .zip(&keep)
            .filter(|(_, &k)| k)
            .map(|(p, _)| ProcessSample {
                pid: p.pid,
                start_time: p.start_time,
                state: p.state,
                rss_bytes: p.rss_bytes,
                swap_bytes: p.swap_bytes,
                pss_bytes: p.pss_bytes,
                detail: detail_due(p.id()).then(|| ProcessDetail {
                    ppid: p.ppid,
                    uid: p.uid,
                    comm: p.comm.clone(),
                    cmdline: crate::secrets::masked(truncated(&p.cmdline, CMDLINE_BYTES)),
                    cgroup: p.cgroup.clone(),
                    exe: p.exe.clone(),
                }),
            })
            .collect();
        let mut launched: Vec<(ProcessId, String)> = launches
            .registered
            .iter()
            .map(|(id, model)| (*id, model.clone()))
            .collect();
        launched.sort();
        let gpus = &snapshot.gpus;
        PolicyInput {
            clock_ms: ms(snapshot.at),
            host: snapshot.host,
            scanned_ms: snapshot.processes.scanned_at.map(ms),
            left_out: table.len() - processes.len(),
            processes,
            gpus: RecordedGpus {
                status: gpus.status.clone(),
                sampled_ms: gpus.sampled_at.map(ms),
                stale: gpus.stale,
                processes_fresh: gpus.processes_fresh,
                devices: gpus.devices.clone(),
                absent: gpus.absent,
            },
            self_pid: snapshot.self_pid,
            tmpfs_owners: snapshot.tmpfs_owners.clone().into_iter().collect(),
            launched,
            launched_models: launches
                .models
                .values()
                .map(|m| LaunchedModel {
                    name: m.name.clone(),
                    owner: m
                        .users
                        .as_ref()
                        .and_then(|u| u.first())
                        .map_or(0, |u| u.uid),
                    ram_bytes: m.ram.and_then(|a| a.resolve(None)).unwrap_or(0),
                    gpu_bytes: m.gpu_memory.and_then(|a| a.resolve(None)).unwrap_or(0),
                })
                .collect(),
        }
    }

    /// The snapshot and launches this input stands for. `details` carries what each process is
    /// from the samples before (a process whose details were never seen is left out: counted
    /// in the second value). `lists_read`: counts the GPU process lists for the policy.
    pub fn to_snapshot(
        &self,
        details: &mut HashMap<ProcessId, ProcessDetail>,
        lists_read: u64,
    ) -> (Snapshot, Launches, usize) {
        let mut unknown = 0;
        let mut processes = Vec::with_capacity(self.processes.len());
        for s in &self.processes {
            let id = ProcessId {
                pid: s.pid,
                start_time: s.start_time,
            };
            if let Some(d) = &s.detail {
                details.insert(id, d.clone());
            }
            let Some(d) = details.get(&id) else {
                unknown += 1;
                continue;
            };
            processes.push(Process {
                pid: s.pid,
                start_time: s.start_time,
                ppid: d.ppid,
                uid: d.uid,
                state: s.state,
                comm: d.comm.clone(),
                cmdline: d.cmdline.clone(),
                cgroup: d.cgroup.clone(),
                rss_bytes: s.rss_bytes,
                swap_bytes: s.swap_bytes,
                kernel_thread: false,
                exe: d.exe.clone(),
                pss_bytes: s.pss_bytes,
            });
        }
        processes.sort_by_key(|p| p.pid);
        let at = |ms: u64| Duration::from_millis(ms);
        let snapshot = Snapshot {
            at: at(self.clock_ms),
            host: self.host,
            processes: ProcessTable {
                scanned_at: self.scanned_ms.map(at),
                processes,
                // What was recorded is all there is: RSS stands in where no PSS was read (a
                // replay cannot ask the scan for more).
                pss_read: true,
            },
            gpus: GpuSnapshot {
                status: self.gpus.status.clone(),
                sampled_at: self.gpus.sampled_ms.map(at),
                stale: self.gpus.stale,
                devices: self.gpus.devices.clone(),
                process_lists_read: lists_read,
                processes_fresh: self.gpus.processes_fresh,
                absent: self.gpus.absent,
            },
            self_pid: self.self_pid,
            mapped_weights: BTreeMap::new(),
            tmpfs_owners: self.tmpfs_owners.iter().copied().collect(),
        };
        let launches = Launches::new(
            self.launched.iter().cloned().collect(),
            self.launched_models
                .iter()
                .map(|m| ModelConfig::launched(&m.name, m.owner, m.ram_bytes, m.gpu_bytes))
                .collect(),
        );
        (snapshot, launches, unknown)
    }
}

/// The first `max` bytes of `text`, cut at a character boundary.
fn truncated(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model of 300 processes on a GPU: the input keeps the 256 with the most RSS and counts
    /// the rest as left out, so no user can make a record too large to keep.
    #[test]
    fn an_input_keeps_at_most_the_largest_processes() {
        let mut snapshot = Snapshot::default();
        snapshot.processes.processes = (1..=300).map(|pid| process(pid, pid as u64, "w")).collect();
        snapshot.gpus.devices.push(Gpu {
            processes: (1..=300).map(|pid| (pid, Some(1 << 20))).collect(),
            ..Gpu::default()
        });
        let input = PolicyInput::of_tick(
            &snapshot,
            &Launches::default(),
            &Attribution::default(),
            true,
            |_| true,
        );
        assert_eq!(input.processes.len(), MAX_KEPT);
        assert_eq!(input.left_out, 300 - MAX_KEPT);
        let smallest = input.processes.iter().map(|p| p.pid).min().unwrap();
        assert_eq!(
            smallest as usize,
            300 - MAX_KEPT + 1,
            "the largest are kept"
        );
    }

    /// The guard and what started it are kept, small as they are: no model takes them in, and
    /// a replay must leave them out as the loop did.
    #[test]
    fn an_input_keeps_the_guard_and_what_started_it() {
        let mut snapshot = Snapshot {
            self_pid: 40,
            ..Snapshot::default()
        };
        let small = |pid: i32, ppid: i32| Process {
            ppid,
            ..process(pid, 1, "p")
        };
        // Ten larger ones fill the 8 places of the largest on a quiet host.
        snapshot.processes.processes = vec![small(1, 0), small(10, 1), small(20, 10), small(30, 1)];
        snapshot.processes.processes.push(small(40, 20));
        snapshot
            .processes
            .processes
            .extend((100..110).map(|pid| process(pid, 100, "big")));
        let input = PolicyInput::of_tick(
            &snapshot,
            &Launches::default(),
            &Attribution::default(),
            false,
            |_| true,
        );
        let small_kept: Vec<i32> = input
            .processes
            .iter()
            .map(|p| p.pid)
            .filter(|&pid| pid < 100)
            .collect();
        assert_eq!(small_kept, [10, 20, 40]);
    }

    fn process(pid: i32, rss_mib: u64, cmdline: &str) -> Process {
        Process {
            pid,
            start_time: 1000 + pid as u64,
            ppid: 1,
            uid: 1000,
            state: 'S',
            comm: "python3".into(),
            cmdline: cmdline.into(),
            cgroup: "/user.slice".into(),
            rss_bytes: rss_mib << 20,
            ..Process::default()
        }
    }

    /// A recorded input gives back the snapshot it was made from (for the processes it keeps),
    /// through the JSON of a record; a process whose details come only with its first sample is still whole in
    /// the next; a small process on no GPU and in no model is left out and counted.
    #[test]
    fn an_input_round_trips_through_json_and_details_carry_forward() {
        let mut snapshot = Snapshot {
            at: Duration::from_millis(12_345),
            self_pid: 7,
            ..Snapshot::default()
        };
        snapshot.host.available_bytes = Some(3 << 30);
        snapshot.processes.scanned_at = Some(Duration::from_millis(12_000));
        snapshot.processes.processes = (1..=20)
            .map(|pid| process(pid, pid as u64 * 100, &"x".repeat(2000)))
            .collect();
        snapshot.tmpfs_owners.insert(1000, 2 << 30);
        snapshot.gpus.status = GpuStatus::Ok;
        snapshot.gpus.devices.push(Gpu {
            index: 0,
            total_bytes: Some(16 << 30),
            free_bytes: Some(4 << 30),
            processes: BTreeMap::from([(2, Some(8 << 30))]),
            processes_known: true,
            ..Gpu::default()
        });
        let launches = Launches::default();
        let attribution = Attribution::default();
        let mut first = true;
        let input = PolicyInput::of_tick(&snapshot, &launches, &attribution, false, |_| first);
        // The 8 largest (13..=20), the GPU holder (2) and the guard (7).
        let pids: Vec<i32> = input.processes.iter().map(|p| p.pid).collect();
        assert_eq!(pids, [2, 7, 13, 14, 15, 16, 17, 18, 19, 20]);
        assert_eq!(input.left_out, 10);
        let cmdline = &input.processes[0].detail.as_ref().unwrap().cmdline;
        assert_eq!(cmdline.len(), CMDLINE_BYTES);

        let record = super::super::Record::Sample {
            at_ms: 1,
            status: Box::default(),
            input: Some(Box::new(input.clone())),
        };
        let json = serde_json::to_string(&record).unwrap();
        let back = match serde_json::from_str(&json).unwrap() {
            super::super::Record::Sample { input, .. } => *input.unwrap(),
            other => panic!("{other:?}"),
        };
        assert_eq!(back, input);
        let mut details = HashMap::new();
        let (snap, _, unknown) = back.to_snapshot(&mut details, 1);
        assert_eq!(unknown, 0);
        assert_eq!(snap.at, snapshot.at);
        assert_eq!(snap.host.available_bytes, Some(3 << 30));
        assert_eq!(snap.gpus.devices[0].processes[&2], Some(8 << 30));
        assert_eq!(snap.tmpfs_owners[&1000], 2 << 30);
        assert_eq!(
            snap.processes
                .get(snapshot.processes.processes[19].id())
                .unwrap()
                .rss_bytes,
            2000 << 20
        );

        first = false;
        let later = PolicyInput::of_tick(&snapshot, &launches, &attribution, false, |_| first);
        assert!(later.processes.iter().all(|p| p.detail.is_none()));
        assert!(json.len() > 2 * serde_json::to_string(&later).unwrap().len());
        let later: PolicyInput =
            serde_json::from_str(&serde_json::to_string(&later).unwrap()).unwrap();
        let (snap, _, unknown) = later.to_snapshot(&mut details, 2);
        assert_eq!(unknown, 0);
        assert_eq!(snap.processes.by_pid(20).unwrap().uid, 1000);
        // A reader that never saw the details leaves the processes out.
        let (snap, _, unknown) = later.to_snapshot(&mut HashMap::new(), 3);
        assert_eq!((snap.processes.processes.len(), unknown), (0, 10));
    }
}
