//! Waste worth a warning: the same model (same command line, so the same weights) loaded by
//! several unrelated processes on one GPU, each holding its own copy.

use std::collections::{BTreeMap, HashMap};

use crate::snapshot::Snapshot;

use super::{bytes, event, About, Plan, PolicyState, Resource, Severity};

pub(super) fn duplicate_loads(snapshot: &Snapshot, state: &mut PolicyState, plan: &mut Plan) {
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
    let mut seen = Vec::new();
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
            let key = (gpu.index, cmdline.to_string());
            seen.push(key.clone());
            if state.duplicates_reported.contains(&key) {
                continue;
            }
            state.duplicates_reported.push(key);
            let pids: Vec<i32> = holders.iter().map(|h| h.0).collect();
            let total: u64 = holders.iter().map(|h| h.1).sum();
            plan.events.push(event(
                Severity::Warning,
                "duplicate_load",
                format!(
                    "GPU {}: {} processes {pids:?} run the same command and hold {} together: the same model loaded more than once? ({cmdline})",
                    gpu.index,
                    holders.len(),
                    bytes(total)
                ),
            ).about(About { pid: pids.first().copied(), resource: Some(Resource::Gpu(gpu.index)), ..About::default() }));
        }
    }
    state.duplicates_reported.retain(|k| seen.contains(k));
}
