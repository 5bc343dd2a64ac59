//! Waste worth a warning: the same weights held more than once on one GPU. Found first by what
//! processes map (two processes holding memory on a GPU that map the same weights file, however
//! they were started: spawn-started workers have command lines of their own), then, for servers
//! that do not keep their weights mapped, by the same command line in unrelated processes.
//! Each group is reported once, while it lasts.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::kinds::EventKind;
use crate::snapshot::{MappedFile, Snapshot};

use super::{bytes, event, About, Plan, PolicyState, Resource, Severity};

pub(super) fn duplicate_loads(snapshot: &Snapshot, state: &mut PolicyState, plan: &mut Plan) {
    let mut seen = Vec::new();
    let by_weights = duplicate_weights(snapshot, state, plan, &mut seen);
    duplicate_commands(snapshot, state, plan, &mut seen, &by_weights);
    state.duplicates_reported.retain(|k| seen.contains(k));
}

/// A group reported as loaded more than once: its GPU and what the processes share (`weights
/// dev:inode,...`, or the command line).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Duplicate {
    gpu: u32,
    what: String,
}

/// Processes on one GPU that map the same weights files.
#[derive(Debug)]
struct WeightsGroup {
    gpu: u32,
    pids: BTreeSet<i32>,
    files: Vec<MappedFile>,
}

/// Groups GPU holders by the weights files they map, per GPU; returns the groups found this way
/// so the command-line rule does not report them again.
fn duplicate_weights(
    snapshot: &Snapshot,
    state: &mut PolicyState,
    plan: &mut Plan,
    seen: &mut Vec<Duplicate>,
) -> Vec<WeightsGroup> {
    let groups = weights_groups(snapshot);
    for group in &groups {
        let key = Duplicate {
            gpu: group.gpu,
            what: format!(
                "weights {}",
                group
                    .files
                    .iter()
                    .map(|f| format!("{}:{}", f.device, f.inode))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        };
        seen.push(key.clone());
        if state.duplicates_reported.contains(&key) {
            continue;
        }
        state.duplicates_reported.push(key);
        plan.events.push(weights_event(snapshot, state, group));
    }
    groups
}

/// Per GPU, processes of one uid that map the same weights: a process of another account that
/// maps a model's file (any user may read it) does not make that model "loaded twice".
fn weights_groups(snapshot: &Snapshot) -> Vec<WeightsGroup> {
    let uid_of: HashMap<i32, u32> = snapshot
        .processes
        .processes
        .iter()
        .map(|p| (p.pid, p.uid))
        .collect();
    let mut groups = Vec::new();
    for gpu in &snapshot.gpus.devices {
        // (file, uid) -> the pids of that uid holding memory on this GPU that map it.
        type Key<'a> = ((&'a str, u64), u32);
        let mut holders: BTreeMap<Key, (BTreeSet<i32>, &MappedFile)> = BTreeMap::new();
        for (pid, used) in &gpu.processes {
            let (Some(files), Some(&uid)) = (snapshot.mapped_weights.get(pid), uid_of.get(pid))
            else {
                continue;
            };
            if used.is_some_and(|b| b > 0) {
                for f in files {
                    holders
                        .entry((f.key(), uid))
                        .or_insert((BTreeSet::new(), f))
                        .0
                        .insert(*pid);
                }
            }
        }
        // One group per set of pids, with every file they share.
        let mut by_pids: BTreeMap<BTreeSet<i32>, Vec<MappedFile>> = BTreeMap::new();
        for (pids, file) in holders.into_values().filter(|(p, _)| p.len() > 1) {
            by_pids.entry(pids).or_default().push(file.clone());
        }
        groups.extend(by_pids.into_iter().map(|(pids, files)| WeightsGroup {
            gpu: gpu.index,
            pids,
            files,
        }));
    }
    groups
}

fn weights_event(snapshot: &Snapshot, state: &PolicyState, g: &WeightsGroup) -> super::Event {
    let gpu = snapshot.gpus.devices.iter().find(|d| d.index == g.gpu);
    let held: u64 = g
        .pids
        .iter()
        .filter_map(|p| gpu.and_then(|d| d.processes.get(p).copied().flatten()))
        .sum();
    let models = models_of(snapshot, state, &g.pids);
    let mapped = g.files.iter().map(|f| f.mapped_bytes).max().unwrap_or(0);
    let pids: Vec<i32> = g.pids.iter().copied().collect();
    event(
        Severity::Warning,
        EventKind::DuplicateLoad,
        format!(
            "GPU {}: {} processes {pids:?}{} map the same weights ({}{}, {}) and hold {} together: the same weights loaded more than once?",
            g.gpu,
            pids.len(),
            if models.is_empty() { String::new() } else { format!(" of model {}", models.join(", ")) },
            g.files[0].path,
            if g.files.len() > 1 { format!(" and {} more file(s)", g.files.len() - 1) } else { String::new() },
            bytes(mapped),
            bytes(held)
        ),
    )
    .about(About {
        model: models.first().map(|m| m.trim_matches('\'').to_string()),
        pid: pids.first().copied(),
        resource: Some(Resource::Gpu(g.gpu)),
        ..About::default()
    })
}

/// The models (quoted) these processes belong to.
fn models_of(snapshot: &Snapshot, state: &PolicyState, pids: &BTreeSet<i32>) -> Vec<String> {
    let a = &state.attribution;
    let mut names: Vec<String> = snapshot
        .processes
        .processes
        .iter()
        .filter(|p| pids.contains(&p.pid))
        .filter_map(|p| a.model_of(p.id()))
        .filter_map(|m| a.models.get(m).map(|m| format!("'{}'", m.name)))
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Unrelated processes on one GPU with the same command line (servers that read their weights
/// into GPU memory and unmap them).
fn duplicate_commands(
    snapshot: &Snapshot,
    state: &mut PolicyState,
    plan: &mut Plan,
    seen: &mut Vec<Duplicate>,
    by_weights: &[WeightsGroup],
) {
    let procs = &snapshot.processes.processes;
    let by_pid: HashMap<i32, usize> = procs.iter().enumerate().map(|(i, p)| (p.pid, i)).collect();
    let is_ancestor = |ancestor: i32, mut pid: i32| {
        for _ in 0..4096 {
            let Some(&i) = by_pid.get(&pid) else {
                return false;
            };
            pid = procs[i].ppid;
            if pid == ancestor {
                return true;
            }
            if pid <= 1 {
                return false;
            }
        }
        false
    };
    for gpu in &snapshot.gpus.devices {
        let mut groups: BTreeMap<&str, Vec<(i32, u64)>> = BTreeMap::new();
        for (pid, used) in &gpu.processes {
            let (Some(&i), Some(used)) = (by_pid.get(pid), used) else {
                continue;
            };
            if *used > 0 && !procs[i].cmdline.is_empty() {
                groups
                    .entry(procs[i].cmdline.as_str())
                    .or_default()
                    .push((*pid, *used));
            }
        }
        for (cmdline, holders) in groups {
            let unrelated = holders.iter().all(|(a, _)| {
                holders
                    .iter()
                    .all(|(b, _)| a == b || (!is_ancestor(*a, *b) && !is_ancestor(*b, *a)))
            });
            if holders.len() < 2 || !unrelated {
                continue;
            }
            let already = by_weights
                .iter()
                .any(|g| g.gpu == gpu.index && holders.iter().all(|(p, _)| g.pids.contains(p)));
            if already {
                continue;
            }
            let key = Duplicate {
                gpu: gpu.index,
                what: cmdline.to_string(),
            };
            seen.push(key.clone());
            if state.duplicates_reported.contains(&key) {
                continue;
            }
            state.duplicates_reported.push(key);
            let pids: Vec<i32> = holders.iter().map(|h| h.0).collect();
            let total: u64 = holders.iter().map(|h| h.1).sum();
            plan.events.push(event(
                Severity::Warning,
                EventKind::DuplicateLoad,
                format!(
                    "GPU {}: {} processes {pids:?} run the same command and hold {} together: the same model loaded more than once? ({cmdline})",
                    gpu.index,
                    holders.len(),
                    bytes(total)
                ),
            ).about(About { pid: pids.first().copied(), resource: Some(Resource::Gpu(gpu.index)), ..About::default() }));
        }
    }
}
