//! Victim choice for a floor: models over their budget first (most over first), then lower
//! priority, then the largest user of the memory that is short (for RAM the proportional share,
//! PSS, where the scan read it, else RSS; VmSwap for the swap floor; NVML's per-process figure
//! for a GPU). Protected processes never.
//!
//! On a GPU floor a user is one candidate, like a model: the processes of a non-root uid that
//! belong to no model are ranked by the sum of their GPU memory, and acted on largest first
//! until they hold what the floor needs back (to its warn floor), in one action. Ranked one by
//! one, twenty processes holding 1 GiB each would outrank nobody and send the guard at another
//! user's 8 GiB model, and a kill of one at a time would spend the floor's brake before any
//! relief. A user whose processes together cannot cover that need (the shortfall is memory no
//! listed process accounts for: managed memory NVML under-reports, memory held through IPC, a
//! process NVML lists but /proc does not show) loses only its largest holder, as when ranked
//! one by one: no whole user for memory that is not theirs. For RAM only where PSS was read, and
//! never for swap: RSS and VmSwap count shared and copy-on-write pages in every process that maps
//! them (forked workers, preforked servers), so a sum would pick a user of forked workers before
//! the process that really took the memory. Root's processes stay ranked one by one, so system services are not
//! summed together. A uid is not always one person (containers sharing `USER 1000`, subordinate
//! uids): it is what the kernel lets gpuguard tell apart.

use std::collections::BTreeMap;

use crate::config::{Candidates, Config};
use crate::snapshot::{Process, ProcessId, Snapshot};

use super::{Member, PolicyState, Resource, Target};

/// A possible victim with the keys it is ranked by.
struct Candidate {
    target: Target,
    over_budget_bytes: Option<u64>,
    priority: i32,
    usage_bytes: u64,
}

/// True for processes gpuguard must never signal.
pub(super) fn is_protected(config: &Config, snapshot: &Snapshot, p: &Process) -> bool {
    p.pid <= 1
        || p.kernel_thread
        || p.pid == snapshot.self_pid
        || p.exited()
        || config
            .protect
            .protects(&p.comm, p.uid, &p.cmdline, &p.cgroup, p.exe.as_ref())
}

/// What a floor is short of, and so what its victims are ranked by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Short {
    /// MemAvailable: resident memory (PSS where the scan read it, else RSS).
    Ram,
    /// SwapFree (MemAvailable above its floor): what each process holds in swap (VmSwap).
    Swap,
    Gpu(u32),
}

impl Short {
    fn resource(self) -> Resource {
        match self {
            Short::Ram | Short::Swap => Resource::Ram,
            Short::Gpu(i) => Resource::Gpu(i),
        }
    }
}

/// Known usage of what is short by one process (unknown swap or GPU memory counts as none: it
/// never makes a process a victim).
pub(super) fn usage(snapshot: &Snapshot, p: &Process, short: Short) -> u64 {
    match short {
        Short::Ram => p.ram_bytes(),
        Short::Swap => p.swap_bytes.unwrap_or(0),
        Short::Gpu(index) => snapshot
            .gpus
            .devices
            .iter()
            .find(|g| g.index == index)
            .and_then(|g| g.processes.get(&p.pid).copied().flatten())
            .unwrap_or(0),
    }
}

pub(super) fn member(p: &Process) -> Member {
    Member {
        id: p.id(),
        comm: p.comm.clone(),
        uid: p.uid,
    }
}

/// The model's members that may be signalled.
pub(super) fn model_target(
    config: &Config,
    snapshot: &Snapshot,
    state: &PolicyState,
    model: usize,
) -> Target {
    let usage = &state.attribution.models[model];
    Target {
        model: Some(usage.name.clone()),
        members: usage
            .members
            .iter()
            .filter_map(|&id| snapshot.processes.get(id))
            .filter(|p| !is_protected(config, snapshot, p))
            .map(member)
            .collect(),
    }
}

/// How far a model is over its budget for this resource, if it is.
pub(super) fn over_budget(
    snapshot: &Snapshot,
    state: &PolicyState,
    model: usize,
    resource: Resource,
) -> Option<u64> {
    let usage = &state.attribution.models[model];
    let (ram_budget, gpu_budget) = usage.config.as_ref()?.budget_bytes(
        snapshot.host.total_bytes,
        snapshot.gpus.largest_total_bytes(),
    );
    let (used, budget) = match resource {
        Resource::Ram => (usage.ram_bytes, ram_budget?),
        Resource::Gpu(_) => (usage.gpu_total_bytes(), gpu_budget?),
    };
    used.checked_sub(budget).filter(|&over| over > 0)
}

/// The victim chosen for a floor, and how much of the memory that is short it holds (a user's
/// processes: those chosen to cover what the floor needs).
pub(super) struct Chosen {
    pub target: Target,
    pub used_bytes: u64,
    /// A user: what all its candidate processes hold, and how many they are.
    pub user_total: Option<(u64, usize)>,
    /// A model over its budget for the resource.
    pub over_budget: bool,
}

/// Picks the victim for a floor short of `short`, or `None` if nobody may be touched.
/// `excluded`: processes that could not be signalled earlier in this incident. `need`: how much
/// a GPU floor needs back (`None`: every process outside the models is ranked alone).
pub(super) fn choose(
    config: &Config,
    snapshot: &Snapshot,
    state: &PolicyState,
    short: Short,
    excluded: &[ProcessId],
    need: Option<u64>,
) -> Option<Chosen> {
    let resource = short.resource();
    let procs = &snapshot.processes.processes;
    let mut candidates = Vec::new();
    for (m, usage) in state.attribution.models.iter().enumerate() {
        let mut target = model_target(config, snapshot, state, m);
        target
            .members
            .retain(|member| !excluded.contains(&member.id));
        let used: u64 = usage
            .members
            .iter()
            .filter_map(|&id| snapshot.processes.get(id))
            .filter(|p| !is_protected(config, snapshot, p) && !excluded.contains(&p.id()))
            .map(|p| self::usage(snapshot, p, short))
            .sum();
        if target.members.is_empty() || used == 0 {
            continue;
        }
        candidates.push(Candidate {
            target,
            over_budget_bytes: over_budget(snapshot, state, m, resource),
            priority: usage.config.as_ref().map_or(0, |c| c.priority),
            usage_bytes: used,
        });
    }
    // Each user's processes outside the models, largest first (root's: one candidate each).
    let mut users: BTreeMap<u32, Vec<(u64, &Process)>> = BTreeMap::new();
    // Users with a PSS read: their unread processes (under the size worth a read, or not
    // readable) join their sum by RSS, so pages shared with many small helpers cannot dilute a
    // hog's share while the helpers are ranked alone.
    let read: std::collections::BTreeSet<u32> = procs
        .iter()
        .filter(|p| p.pss_bytes.is_some())
        .map(|p| p.uid)
        .collect();
    if config.daemon.candidates == Candidates::Any {
        for p in procs {
            let in_model = state.attribution.model_of(p.id()).is_some();
            if in_model || is_protected(config, snapshot, p) || excluded.contains(&p.id()) {
                continue;
            }
            // A user's processes are ranked together by what killing them would free: GPU
            // memory, or RAM where their proportional share (PSS) was read; else alone.
            let used = usage(snapshot, p, short);
            if used == 0 {
                continue;
            }
            let alone = short == Short::Ram && p.pss_bytes.is_none() && !read.contains(&p.uid);
            if p.uid == 0 || need.is_none() || alone {
                candidates.push(Candidate {
                    target: Target {
                        model: None,
                        members: vec![member(p)],
                    },
                    over_budget_bytes: None,
                    priority: 0,
                    usage_bytes: used,
                });
            } else {
                users.entry(p.uid).or_default().push((used, p));
            }
        }
    }
    // Users first: on a tie, a user's processes go before a model or one of root's processes.
    let mut groups = Vec::with_capacity(users.len());
    for held in users.values_mut() {
        held.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.pid.cmp(&b.1.pid)));
        groups.push(Candidate {
            target: Target {
                model: None,
                members: held.iter().map(|&(_, p)| member(p)).collect(),
            },
            over_budget_bytes: None,
            priority: 0,
            usage_bytes: held.iter().map(|&(used, _)| used).sum(),
        });
    }
    let chosen = groups.into_iter().chain(candidates).min_by(|a, b| {
        // Over budget first, most over first; then lower priority; then larger usage.
        b.over_budget_bytes
            .cmp(&a.over_budget_bytes)
            .then(a.priority.cmp(&b.priority))
            .then(b.usage_bytes.cmp(&a.usage_bytes))
    })?;
    let over_budget = chosen.over_budget_bytes.is_some();
    let mut target = chosen.target;
    let mut used_bytes = chosen.usage_bytes;
    let mut user_total = None;
    if let (None, Some(first)) = (&target.model, target.members.first()) {
        if let Some(held) = users.get(&first.uid) {
            // A user: its largest processes, until they cover what the floor needs; its largest
            // alone if all of them cannot.
            let need = need.filter(|&need| used_bytes >= need).unwrap_or(0);
            let (mut take, mut covered) = (0, 0);
            for &(used, _) in held {
                if take > 0 && covered >= need {
                    break;
                }
                take += 1;
                covered += used;
            }
            user_total = Some((used_bytes, held.len()));
            target.members.truncate(take);
            used_bytes = covered;
        }
    }
    Some(Chosen {
        target,
        used_bytes,
        user_total,
        over_budget,
    })
}
