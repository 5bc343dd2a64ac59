//! Which processes make up which model, and what each model uses.
//!
//! A process belongs to the first `[[model]]` whose `match` it satisfies, or to a model that
//! `gpuguard launch` registered for it; otherwise to the model of its nearest ancestor (vLLM keeps
//! its GPU memory in child processes). Usage is summed over all members; GPU memory only from
//! GPUs whose reading can be trusted (anything else leaves the model's GPU usage unknown).
//!
//! Whatever matches, a process belongs to a model only if its uid is one of the model's `users`
//! (root and system accounts by default; a launched model's launcher): names and command lines
//! are chosen by the process itself, uids are not. So no user can join, and thereby steer, a
//! model that is not theirs.
//!
//! And whatever matches, some processes are in no model (`rules::NeverMembers`): pid 1, kernel
//! threads, the guard and its ancestors, `[protect]`ed processes, login sessions. Nothing
//! inherits a model through one of them; below it, only what matches a rule itself belongs.

use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher;

use crate::config::{Config, ModelConfig, Users};
use crate::snapshot::{GpuSnapshot, ProcessId, ProcessTable};

use super::rules::NeverMembers;

/// What `gpuguard launch` registered, as the reservation ledger has it: each launched process
/// with its model, and the launched models that have no `[[model]]` (their budgets from the
/// launch). The loop keeps it and hands it to the policy with each snapshot.
#[derive(Clone, Debug, Default)]
pub struct Launches {
    pub registered: HashMap<ProcessId, String>,
    pub models: BTreeMap<String, ModelConfig>,
}

impl Launches {
    pub fn new(registered: HashMap<ProcessId, String>, models: Vec<ModelConfig>) -> Launches {
        Launches {
            registered,
            models: models.into_iter().map(|m| (m.name.clone(), m)).collect(),
        }
    }

    /// The models in force with `config`.
    pub fn models<'a>(&'a self, config: &'a Config) -> ModelsInForce<'a> {
        ModelsInForce::new(config, &self.models)
    }

    /// Whether `other` puts processes in other models: other launched processes or models.
    pub fn same_members(&self, other: &Launches) -> bool {
        self.registered == other.registered && self.models.keys().eq(other.models.keys())
    }
}

/// The models in force: the `[[model]]`s, then the launched models that have none (their budgets
/// from `gpuguard launch`). The one place the two are merged: the policy, the loop and the
/// reservation table all look models up through it. A launched model that also has a `[[model]]`
/// (kept for the metrics URL it was launched with) is that `[[model]]` everywhere else.
#[derive(Clone, Copy, Debug)]
pub struct ModelsInForce<'a> {
    config: &'a Config,
    launched: &'a BTreeMap<String, ModelConfig>,
}

impl<'a> ModelsInForce<'a> {
    pub fn new(config: &'a Config, launched: &'a BTreeMap<String, ModelConfig>) -> Self {
        ModelsInForce { config, launched }
    }

    /// A model's config: its `[[model]]`, else what `gpuguard launch` registered for it.
    pub fn get(&self, name: &str) -> Option<&'a ModelConfig> {
        self.config.model(name).or_else(|| self.launched.get(name))
    }

    /// Every model in force: the `[[model]]`s in config order, then launched-only ones by name.
    pub fn iter(&self) -> impl Iterator<Item = &'a ModelConfig> + 'a {
        let config = self.config;
        config.models.iter().chain(
            self.launched
                .values()
                .filter(move |m| config.model(&m.name).is_none()),
        )
    }

    /// A model's engine metrics URL: its own, else the one it was launched with.
    pub fn metrics_url(&self, name: &str) -> Option<&'a str> {
        let own = self.get(name).and_then(|m| m.metrics_url.as_deref());
        own.or_else(|| self.launched.get(name)?.metrics_url.as_deref())
    }

    /// The KV cache planned for a model: its own, else the one it was launched with.
    pub fn planned_kv_tokens(&self, name: &str) -> Option<u64> {
        let own = self.get(name).and_then(|m| m.planned_kv_tokens);
        own.or_else(|| self.launched.get(name)?.planned_kv_tokens)
    }
}

/// The models seen in one process table.
#[derive(Clone, Debug, Default)]
pub struct Attribution {
    /// The model (index into `models`) of each process that belongs to one, live or not.
    pub model_of: HashMap<ProcessId, usize>,
    pub models: Vec<ModelUsage>,
}

impl Attribution {
    /// The model (index into `models`) this process belongs to, if any.
    pub fn model_of(&self, id: ProcessId) -> Option<usize> {
        self.model_of.get(&id).copied()
    }
}

#[derive(Clone, Debug, Default)]
pub struct ModelUsage {
    pub name: String,
    /// Its config when the attribution was made: its `[[model]]`, else what its launch gave.
    pub config: Option<ModelConfig>,
    /// The live members, in pid order.
    pub members: Vec<ProcessId>,
    pub rss_bytes: u64,
    /// What killing its members would free of RAM: their PSS where the scan read it, else
    /// their RSS. Forked workers share pages (the weights a `--preload` master loaded, the
    /// libraries): RSS counts each shared page once per worker.
    pub ram_bytes: u64,
    /// Known GPU memory per GPU index.
    pub gpu_bytes: BTreeMap<u32, u64>,
    /// Some member's GPU memory is unavailable: the sums above are lower bounds.
    pub gpu_unknown: bool,
}

impl ModelUsage {
    pub fn gpu_total_bytes(&self) -> u64 {
        self.gpu_bytes.values().sum()
    }
}

/// Remembers which processes matched which model, so regexes run once per process, not per scan.
/// An entry holds while what the matchers look at (name, uid, command line, cgroup, executable)
/// is unchanged: an exec that keeps the name, or a setuid, is matched again. What they look at is
/// compared by a hash keyed at random per daemon, so a process cannot choose attributes that
/// collide. It holds what depends on the process alone: its own match, and whether `[protect]`
/// protects it (worked out when first needed). Whether it may be a member at all depends on
/// other processes too (its parent, the guard's ancestors) and is worked out at every
/// attribution.
#[derive(Clone, Debug, Default)]
pub struct MatchCache {
    matched: HashMap<ProcessId, Matched>,
    keys: RandomState,
}

#[derive(Clone, Copy, Debug)]
struct Matched {
    hash: u64,
    model: Option<usize>,
    protected: Option<bool>,
}

impl MatchCache {
    pub fn clear(&mut self) {
        self.matched.clear();
    }
}

/// Works out model membership and usage. `registered` maps launched processes to model names;
/// `self_pid` is the guard's own pid (`Snapshot::self_pid`).
pub fn attribute(
    config: &Config,
    table: &ProcessTable,
    gpus: &GpuSnapshot,
    registered: &HashMap<ProcessId, String>,
    launched: &BTreeMap<String, ModelConfig>,
    self_pid: i32,
    cache: &mut MatchCache,
) -> Attribution {
    let procs = &table.processes;
    // Model names: configured ones first (in config order), then launched-only ones.
    let mut names: Vec<String> = config.models.iter().map(|m| m.name.clone()).collect();
    for name in registered.values() {
        if !names.contains(name) {
            names.push(name.clone());
        }
    }
    let index_of = |name: &str| names.iter().position(|n| n == name);
    // Who may be a member of each model, by index.
    let users: Vec<Users> = names
        .iter()
        .map(|n| {
            ModelsInForce::new(config, launched)
                .get(n)
                .map_or(Users::System, ModelConfig::allowed_users)
        })
        .collect();

    // Own match of each process (registration beats config match).
    let own: Vec<Option<usize>> = procs
        .iter()
        .map(|p| {
            if let Some(name) = registered.get(&p.id()) {
                return index_of(name);
            }
            if p.kernel_thread {
                return None;
            }
            let seen = cache
                .keys
                .hash_one((&p.comm, p.uid, &p.cmdline, &p.cgroup, &p.exe));
            match cache.matched.get(&p.id()) {
                Some(m) if m.hash == seen => m.model,
                _ => {
                    let model = config.models.iter().position(|m| {
                        m.matcher.matches(&p.comm, p.uid, &p.cmdline, &p.cgroup)
                            && m.allowed_users().member(p.uid)
                    });
                    let entry = Matched {
                        hash: seen,
                        model,
                        protected: None,
                    };
                    cache.matched.insert(p.id(), entry);
                    model
                }
            }
        })
        .collect();
    // The daemon's table is kept in pid order (`scan::apply`): pids are found by binary search
    // there, without building maps of the whole table at every new scan.
    let sorted = procs.is_sorted_by_key(|p| p.pid);
    let by_pid: HashMap<i32, usize> = if sorted {
        HashMap::new()
    } else {
        procs.iter().enumerate().map(|(i, p)| (p.pid, i)).collect()
    };
    let index_of_pid = |pid: i32| -> Option<usize> {
        if sorted {
            procs.binary_search_by_key(&pid, |p| p.pid).ok()
        } else {
            by_pid.get(&pid).copied()
        }
    };
    cache
        .matched
        .retain(|id, _| index_of_pid(id.pid).is_some_and(|i| procs[i].id() == *id));

    // Inherit from the nearest matched ancestor, never through a process no model may take in.
    let never = NeverMembers::new(config, table, gpus, self_pid);
    let mut model_of: Vec<Option<Option<usize>>> = vec![None; procs.len()];
    for start in 0..procs.len() {
        let mut chain = Vec::new();
        let mut at = Some(start);
        let mut found = None;
        while let Some(i) = at {
            if let Some(known) = model_of[i] {
                found = known;
                break;
            }
            chain.push(i);
            if own[i].is_some() {
                found = own[i];
                break;
            }
            // pid 0/1 and unknown parents end the walk; a cycle cannot happen but is bounded anyway.
            at = index_of_pid(procs[i].ppid).filter(|&j| j != i && chain.len() < 4096);
        }
        // From the top down: a process that may not be a member is in no model, and those below
        // it on the chain (none matched a rule itself, or the walk had ended there) inherit
        // nothing. Only chains that reach a model are looked at.
        for &i in chain.iter().rev() {
            let p = &procs[i];
            if found.is_some_and(|_| {
                let launched = registered.contains_key(&p.id());
                // What `[protect]` says of a process is remembered with its match.
                let protected = || match cache.matched.get_mut(&p.id()) {
                    Some(m) => *m.protected.get_or_insert_with(|| never.protected(p)),
                    None => never.protected(p),
                };
                never.why_with(p, launched, protected).is_some()
            }) {
                found = None;
            }
            model_of[i] = Some(found);
        }
    }
    let model_of: Vec<Option<usize>> = model_of.into_iter().map(Option::flatten).collect();

    let mut models: Vec<ModelUsage> = names
        .iter()
        .map(|n| ModelUsage {
            name: n.clone(),
            config: ModelsInForce::new(config, launched).get(n).cloned(),
            ..Default::default()
        })
        .collect();
    let mut member_by_pid = HashMap::new();
    // A descendant of another uid (a sandboxed worker, a setuid helper) is not the model's.
    let model_of: HashMap<ProcessId, usize> = model_of
        .into_iter()
        .zip(procs)
        .filter_map(|(m, p)| m.filter(|&m| users[m].member(p.uid)).map(|m| (p.id(), m)))
        .collect();
    for p in procs {
        let Some(&m) = model_of.get(&p.id()) else {
            continue;
        };
        if p.exited() {
            continue;
        }
        models[m].members.push(p.id());
        models[m].rss_bytes += p.rss_bytes;
        models[m].ram_bytes += p.ram_bytes();
        member_by_pid.insert(p.pid, m);
    }
    for m in &mut models {
        m.members.sort_unstable();
    }
    for gpu in &gpus.devices {
        // A GPU whose figures contradict themselves (or that is lost) tells nothing about usage.
        let trusted = gpu.untrusted().is_none();
        for (pid, bytes) in &gpu.processes {
            let Some(&m) = member_by_pid.get(pid) else {
                continue;
            };
            match bytes.filter(|_| trusted) {
                Some(b) => *models[m].gpu_bytes.entry(gpu.index).or_default() += b,
                None => models[m].gpu_unknown = true,
            }
        }
    }
    Attribution { model_of, models }
}
