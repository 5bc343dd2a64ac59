//! Near the RAM floor, each large process's proportional share of what it holds: PSS where the
//! kernel shows it, else its share of its memory cgroup's anonymous memory (`sample::cgroup`).
//! Read on the scan thread (the kernel walks the page tables), within a time budget per round.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::Scanner;
use crate::sample::cgroup;
use crate::sample::procfs::ProcReader;
use crate::snapshot::ProcessId;

#[derive(Clone, Copy)]
pub(super) struct PssRead {
    pub(super) pss_bytes: u64,
    rss_bytes: u64,
    at: Instant,
}

/// A cgroup charged less than its families must hold by more than this fraction of it
/// (1/8) is not believed.
const BELIEVABLE_SLACK: u64 = 8;
/// A cgroup with more processes than this is not shared out (a `statm` read for each).
const CGROUP_SHARE_MAX_MEMBERS: usize = 1024;
/// Near the RAM floor a process's PSS is read again once its RSS moved by this much...
const PSS_REREAD_BYTES: u64 = 16 << 20;
/// ...or once its last reading is this old (the pages it shares change without its RSS moving).
const PSS_MAX_AGE: Duration = Duration::from_secs(2);
/// A round reads PSS for at most this long (and at least one process).
const PSS_ROUND_BUDGET: Duration = Duration::from_millis(50);

impl Scanner {
    /// Near the RAM floor, the PSS of every process holding at least `min_rss`, so the floor
    /// ranks a model or an account by what killing it would really free (forked workers share
    /// their pages; their RSS counts them once each). Read here, not on the loop: the kernel
    /// walks the page tables (~10 ms per GiB). A figure is due again when the process's RSS moved
    /// by `PSS_REREAD_BYTES`, when it is `PSS_MAX_AGE` old, or when any process exited since (the
    /// pages it shared are now its siblings' alone). Each round reads for at most
    /// `PSS_ROUND_BUDGET` (at least one process): those never read first, largest first, then
    /// the oldest figures; the rest keep the figure they have until a later round, so a host of
    /// many large processes cannot hold up the table the loop waits for. Away from the floor
    /// nothing is read and nothing kept.
    pub(super) fn read_pss(
        &mut self,
        min_rss: Option<u64>,
        now: Instant,
    ) -> Option<Vec<(ProcessId, u64)>> {
        let Some(min_rss) = min_rss else {
            self.entries.values_mut().for_each(|e| e.pss = None);
            return None;
        };
        let stale = std::mem::take(&mut self.exited);
        let mut due = Vec::new();
        for (&pid, e) in self.entries.iter_mut() {
            if e.kernel_thread || e.rss_bytes < min_rss {
                e.pss = None;
                continue;
            }
            let fresh = e.pss.is_some_and(|r| {
                !stale
                    && r.rss_bytes.abs_diff(e.rss_bytes) < PSS_REREAD_BYTES
                    && now.saturating_duration_since(r.at) < PSS_MAX_AGE
            });
            if !fresh {
                // Never read first (the largest first), then the oldest figures.
                let age = e.pss.map(|r| now.saturating_duration_since(r.at));
                due.push((
                    age.is_some(),
                    std::cmp::Reverse(age),
                    std::cmp::Reverse(e.rss_bytes),
                    pid,
                ));
            }
        }
        due.sort_unstable();
        let began = Instant::now();
        let mut unreadable = Vec::new();
        for (i, &(_, _, _, pid)) in due.iter().enumerate() {
            if i > 0 && began.elapsed() >= PSS_ROUND_BUDGET {
                // The rest next round; an exit still makes all of them due.
                self.exited |= stale;
                break;
            }
            if !self.entries.contains_key(&pid) {
                continue;
            }
            match self.reader.pss(pid) {
                Some(pss_bytes) => self.keep(pid, pss_bytes, now),
                None => unreadable.push(pid),
            }
        }
        self.share_cgroups(&unreadable, now);
        let known = self.entries.iter().filter_map(|(&pid, e)| {
            let id = ProcessId {
                pid,
                start_time: e.start_time,
            };
            Some((id, e.pss?.pss_bytes))
        });
        Some(known.collect())
    }

    /// For processes whose PSS the kernel would not show (another account's, without
    /// CAP_SYS_PTRACE): what they hold of their memory cgroup's anonymous memory
    /// (`sample::cgroup`). Only processes that forked without `exec` share anonymous pages (an
    /// exec replaces the address space), so the cgroup's processes are grouped into families
    /// of a process and the children that still run its command line (same name, same
    /// arguments). A process alone in its family holds its own resident anonymous memory; the
    /// rest of the cgroup's is shared out among the families' members in proportion to theirs,
    /// never more than their own nor less than their own over their family's size. So forked
    /// workers count once between them, and a hog in the same cgroup (a login session) keeps
    /// its whole figure. Where the cgroup is charged less than its families must hold (each at
    /// least its largest member's pages) by more than an eighth (processes moved in after they
    /// touched their pages, which stay charged where they were), each process counts its own. Kept as their figure
    /// like a PSS read. None where the cgroup says nothing (cgroup v1).
    fn share_cgroups(&mut self, pids: &[i32], now: Instant) {
        let Some(cgroups) = &self.cgroups else {
            return;
        };
        let mut by_cgroup: BTreeMap<String, Vec<i32>> = BTreeMap::new();
        for &pid in pids {
            if let Ok(path) = self.reader.cgroup(pid) {
                by_cgroup.entry(path).or_default().push(pid);
            }
        }
        let mut shares = Vec::with_capacity(pids.len());
        for (path, pids) in by_cgroup {
            let Some((cgroup_anon, members)) = cgroups.anon_and_procs(&path) else {
                continue;
            };
            if members.len() > CGROUP_SHARE_MAX_MEMBERS {
                continue; // a statm read each: the round stays short, they keep RSS
            }
            let anon: BTreeMap<i32, u64> = members
                .iter()
                .filter_map(|&m| Some((m, self.reader.anon_bytes(m).ok()?)))
                .collect();
            let family = families(&mut self.reader, &anon);
            let mut sizes: BTreeMap<i32, u64> = BTreeMap::new();
            for &eldest in family.values() {
                *sizes.entry(eldest).or_default() += 1;
            }
            let size = |pid: i32| sizes[&family[&pid]];
            let (mut alone, mut shared) = (0u64, 0u64);
            let mut largest: BTreeMap<i32, u64> = BTreeMap::new();
            for (&pid, &own) in &anon {
                if size(pid) == 1 {
                    alone += own;
                } else {
                    shared += own;
                    let most = largest.entry(family[&pid]).or_default();
                    *most = (*most).max(own);
                }
            }
            let shared_anon = cgroup_anon.saturating_sub(alone);
            // A family holds at least the pages of its largest member. A cgroup charged much
            // less than that was not charged for its processes' pages (they were moved in after
            // they touched them): its figure says nothing, and each counts its own. A little
            // less is a process moved in after its start-up (an interpreter's first MiBs).
            let needed: u64 = largest.values().sum();
            let believable = shared_anon.saturating_add(needed / BELIEVABLE_SLACK) >= needed;
            for pid in pids {
                let Some(&own) = anon.get(&pid) else {
                    continue; // moved to another cgroup since
                };
                let n = size(pid);
                let figure = if n == 1 || !believable {
                    own
                } else {
                    cgroup::share(own, shared, shared_anon).max(own / n)
                };
                shares.push((pid, figure));
            }
        }
        for (pid, share) in shares {
            self.keep(pid, share, now);
        }
    }

    /// Keeps `pss_bytes`, read by pid, as the figure of the process the table knows by that
    /// pid, if it still is that process (not a pid reused since).
    fn keep(&mut self, pid: i32, pss_bytes: u64, now: Instant) {
        let Some(start_time) = self.entries.get(&pid).map(|e| e.start_time) else {
            return;
        };
        if !matches!(self.reader.proc_stat(pid), Ok(s) if s.stat.start_time == start_time) {
            return;
        }
        if let Some(e) = self.entries.get_mut(&pid) {
            e.pss = Some(PssRead {
                pss_bytes,
                rss_bytes: e.rss_bytes,
                at: now,
            });
        }
    }
}

/// Each of a cgroup's processes (`anon`'s keys) by the family it belongs to, named by its
/// eldest: a process whose parent is in the cgroup with the same name and command line
/// forked without `exec` and is of its parent's family.
fn families(reader: &mut ProcReader, anon: &BTreeMap<i32, u64>) -> BTreeMap<i32, i32> {
    let mut parent: BTreeMap<i32, i32> = BTreeMap::new();
    let mut comm: BTreeMap<i32, String> = BTreeMap::new();
    for &pid in anon.keys() {
        if let Ok(s) = reader.proc_stat(pid) {
            parent.insert(pid, s.stat.ppid);
            comm.insert(pid, s.stat.comm);
        }
    }
    let mut cmdline: BTreeMap<i32, Option<String>> = BTreeMap::new();
    let mut forked_from = BTreeMap::new();
    for (&pid, &ppid) in &parent {
        if comm.get(&ppid).is_none_or(|c| *c != comm[&pid]) {
            continue;
        }
        let mut read = |p: i32| {
            cmdline
                .entry(p)
                .or_insert_with(|| reader.cmdline(p, None).ok())
                .clone()
        };
        let (own, theirs) = (read(pid), read(ppid));
        if own.is_some() && own == theirs {
            forked_from.insert(pid, ppid);
        }
    }
    anon.keys()
        .map(|&pid| {
            let mut eldest = pid;
            // Bounded: a pid read twice cannot make a cycle of more than the cgroup.
            for _ in 0..anon.len() {
                match forked_from.get(&eldest) {
                    Some(&p) => eldest = p,
                    None => break,
                }
            }
            (pid, eldest)
        })
        .collect()
}
