//! Waste worth a warning: the same weights held more than once on one GPU. Found first by what
//! processes map (two processes holding memory on a GPU that map the same weights file, however
//! they were started: spawn-started workers have command lines of their own), then, for servers
//! that do not keep their weights mapped, by the same command line in unrelated processes.
//! Each group is reported once, while it lasts.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::kinds::EventKind;
use crate::snapshot::{MappedFile, Snapshot};

use super::{bytes, event, About, Event, Plan, PolicyState, Resource, Severity};

pub(super) fn duplicate_loads(snapshot: &Snapshot, state: &mut PolicyState, plan: &mut Plan) {
    let found = duplicates(snapshot);
    let seen: Vec<Reported> = found.iter().map(Duplicate::reported).collect();
    for (duplicate, key) in found.iter().zip(&seen) {
        if state.duplicates_reported.contains(key) {
            continue;
        }
        state.duplicates_reported.push(key.clone());
        plan.events
            .push(duplicate_event(snapshot, state, duplicate));
    }
    state.duplicates_reported.retain(|k| seen.contains(k));
}

/// The same weights held more than once on one GPU, as one rule found it: what `duplicate_event`
/// says (once per group, while it lasts).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Duplicate {
    pub gpu: u32,
    pub rule: Rule,
    /// The group's processes, lowest pid first.
    pub pids: Vec<i32>,
    /// What they hold on the GPU together.
    pub held: u64,
}

/// Which rule found a group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Rule {
    /// They map the same weights files (every file they all map, as the lowest pid maps it).
    SameWeights { files: Vec<MappedFile> },
    /// Unrelated processes (none an ancestor of another) with this command line.
    SameCommand { cmdline: String },
}

impl Duplicate {
    /// What the group is remembered by while it lasts: its GPU and what its processes share.
    fn reported(&self) -> Reported {
        let what = match &self.rule {
            Rule::SameWeights { files } => format!(
                "weights {}",
                files
                    .iter()
                    .map(|f| format!("{}:{}", f.device, f.inode))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            Rule::SameCommand { cmdline } => cmdline.clone(),
        };
        Reported {
            gpu: self.gpu,
            what,
        }
    }
}

/// A group reported as loaded more than once: its GPU and what the processes share (`weights
/// dev:inode,...`, or the command line).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Reported {
    gpu: u32,
    what: String,
}

/// Every group loaded more than once in `snapshot`: by the weights they map first, then by
/// their command line (a group the weights rule found is not found again).
pub(super) fn duplicates(snapshot: &Snapshot) -> Vec<Duplicate> {
    let by_weights = weights_groups(snapshot);
    let mut found: Vec<Duplicate> = by_weights
        .iter()
        .map(|g| {
            let gpu = snapshot.gpus.devices.iter().find(|d| d.index == g.gpu);
            Duplicate {
                gpu: g.gpu,
                rule: Rule::SameWeights {
                    files: g.files.clone(),
                },
                pids: g.pids.iter().copied().collect(),
                held: g
                    .pids
                    .iter()
                    .filter_map(|p| gpu.and_then(|d| d.processes.get(p).copied().flatten()))
                    .sum(),
            }
        })
        .collect();
    found.extend(duplicate_commands(snapshot, &by_weights));
    found
}

/// Processes on one GPU that map the same weights files.
#[derive(Debug)]
struct WeightsGroup {
    gpu: u32,
    pids: BTreeSet<i32>,
    files: Vec<MappedFile>,
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

/// The models (quoted) these processes belong to.
fn models_of(snapshot: &Snapshot, state: &PolicyState, pids: &[i32]) -> Vec<String> {
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
/// into GPU memory and unmap them), but for groups `by_weights` has.
fn duplicate_commands(snapshot: &Snapshot, by_weights: &[WeightsGroup]) -> Vec<Duplicate> {
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
    let mut found = Vec::new();
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
            found.push(Duplicate {
                gpu: gpu.index,
                rule: Rule::SameCommand {
                    cmdline: cmdline.to_string(),
                },
                pids: holders.iter().map(|h| h.0).collect(),
                held: holders.iter().map(|h| h.1).sum(),
            });
        }
    }
    found
}

/// A group in words (warning `duplicate_load`), about its GPU, its first process and, for the
/// weights rule, the first of the models its processes belong to. Nothing here decides.
pub(super) fn duplicate_event(snapshot: &Snapshot, state: &PolicyState, d: &Duplicate) -> Event {
    let (gpu, pids, n) = (d.gpu, &d.pids, d.pids.len());
    let (message, model) = match &d.rule {
        Rule::SameWeights { files } => {
            let models = models_of(snapshot, state, pids);
            let mapped = files.iter().map(|f| f.mapped_bytes).max().unwrap_or(0);
            (
                format!(
                    "GPU {gpu}: {n} processes {pids:?}{} map the same weights ({}{}, {}) and hold {} together: the same weights loaded more than once?",
                    if models.is_empty() { String::new() } else { format!(" of model {}", models.join(", ")) },
                    files[0].path,
                    if files.len() > 1 { format!(" and {} more file(s)", files.len() - 1) } else { String::new() },
                    bytes(mapped),
                    bytes(d.held)
                ),
                models.first().map(|m| m.trim_matches('\'').to_string()),
            )
        }
        Rule::SameCommand { cmdline } => (
            format!(
                "GPU {gpu}: {n} processes {pids:?} run the same command and hold {} together: the same model loaded more than once? ({})",
                bytes(d.held),
                crate::secrets::Shown::of(cmdline)
            ),
            None,
        ),
    };
    event(Severity::Warning, EventKind::DuplicateLoad, message).about(About {
        model,
        pid: pids.first().copied(),
        resource: Some(Resource::Gpu(gpu)),
        ..About::default()
    })
}
