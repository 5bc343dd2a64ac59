//! What the `[[model]]` and `[protect]` rules catch on a process table, and the processes no
//! model may take in whatever its `match` (issue 40: "rules that cannot swallow the host").
//!
//! Never a model's member (`LeftOut`): pid 1 and processes with no parent in this pid namespace
//! (ppid 0), kernel threads, the guard itself (`Snapshot::self_pid`), `[protect]`ed processes
//! (the rules victim choice trusts), the guard's ancestors (what started it in the foreground:
//! a test harness, cargo, its shell, sudo, tmux, sshd... up to pid 1), and the login sessions.
//! Nothing inherits a model *through* such a process: below it, only a process that matches a
//! rule itself belongs to one (`models::attribute`).
//!
//! A login session is told apart by what a user cannot fake. Its sshd: a process named `sshd`,
//! `sshd-session` or `sshd-auth` that is root's (root's names are trusted, as by `[protect]`),
//! or whose parent is root's and so named: the unprivileged half of a session, which only root's
//! sshd forks (a process cannot make itself the child of another account's process, and sshd
//! makes itself untraceable). Root's `login` (a console login) is one too. Then the shells such a
//! process starts itself (`bash`, `sh`, `dash`, `zsh`, `fish`, `ksh`, `tcsh`, `csh`, also as
//! `-bash`). Not a session: a user's process named `sshd` under their own shell or their own
//! sshd (its parent is not root's sshd); anything below the session's shell; a command ssh runs
//! without a shell (`ssh host python serve.py` execs python in place of the shell), which stays
//! matchable. A shell is known by its name (`exe` is not readable for other accounts under the
//! packaged unit), which its user chooses: so it is left out only while it is what a shell is,
//! small (`SESSION_SHELL_MAX_RSS`) and holding no GPU memory. A server named `bash` is in its
//! model and under its budget; what a user can still keep out is one small process per session. A process `gpuguard launch` registered
//! is its model's even as a session's shell (`ssh host gpuguard launch -- bash -c ...`): its
//! owner named it, through the socket's peer credentials; everything else above applies to it.
//!
//! `survey` is what `gpuguard check-config` says about a config on this host's processes (as a
//! table with `--matches`) and what the daemon logs at start and on reload: what each rule takes
//! in, what its match catches that is left out and why, and the warnings (a rule that takes in
//! more processes than `daemon.warn_model_processes`, one whose match catches processes no model
//! may take in, a process caught by two models' rules).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

use crate::config::Config;
use crate::snapshot::{GpuSnapshot, Process, ProcessTable};

use super::models::{attribute, MatchCache};

/// Why no model may take a process in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LeftOut {
    /// pid 1 (or 0).
    Init,
    /// Its parent is not in this pid namespace (ppid 0): kthreadd, a process entered from
    /// outside a container's namespace.
    NoParent,
    KernelThread,
    /// The guard itself.
    Guard,
    /// Protected by `[protect]` (the built-in list included).
    Protected,
    /// The guard's parent, its parent's parent, and so on.
    GuardAncestor,
    /// A login session's sshd (or `login`), or the shell it started.
    LoginSession,
}

impl LeftOut {
    pub fn as_str(self) -> &'static str {
        match self {
            LeftOut::Init => "pid 1",
            LeftOut::NoParent => "no parent (ppid 0)",
            LeftOut::KernelThread => "kernel thread",
            LeftOut::Guard => "gpuguard itself",
            LeftOut::Protected => "[protect]",
            LeftOut::GuardAncestor => "started gpuguard",
            LeftOut::LoginSession => "login session",
        }
    }
}

impl fmt::Display for LeftOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Names of sshd's processes: the listener, a session's halves (`sshd-session` since OpenSSH
/// 9.8), its authentication helper (10.0).
const SSHD: &[&str] = &["sshd", "sshd-session", "sshd-auth"];
/// Login shells, as `comm` has them (a login shell's `-bash` is its argv[0]; either is taken).
const SHELLS: &[&str] = &["bash", "sh", "dash", "zsh", "fish", "ksh", "tcsh", "csh"];

fn is_shell(comm: &str) -> bool {
    SHELLS.contains(&comm.strip_prefix('-').unwrap_or(comm))
}

/// Tells which processes of one table no model may take in (`why`). Built per attribution: the
/// guard's ancestors and a session's parents are read from this table, never remembered.
pub struct NeverMembers<'a> {
    config: &'a Config,
    table: &'a ProcessTable,
    guard: i32,
    /// The pids above the guard, up to (not including) pid 1.
    ancestors: HashSet<i32>,
    /// The pids that hold GPU memory (by the GPUs' process lists): never a session's shell.
    gpu_holders: HashSet<i32>,
}

/// A login session's shell is left out of the models only while it is what a shell is: small,
/// and holding no GPU memory. A process that calls itself `bash` is left out by its name
/// alone, which its user chooses (`exec -a bash`, a copy of python named so): with more than
/// this, it is an ordinary process, in its model and under its budget.
pub const SESSION_SHELL_MAX_RSS: u64 = 64 << 20;

impl<'a> NeverMembers<'a> {
    /// `guard`: the guard's own pid (0 for none: `check-config`); `gpus`: the GPUs' process
    /// lists (none for `check-config`, which does not read them).
    pub fn new(
        config: &'a Config,
        table: &'a ProcessTable,
        gpus: &GpuSnapshot,
        guard: i32,
    ) -> Self {
        let gpu_holders = gpus
            .devices
            .iter()
            .flat_map(|g| g.processes.iter())
            .filter(|(_, bytes)| bytes.is_none_or(|b| b > 0))
            .map(|(&pid, _)| pid)
            .collect();
        let mut ancestors = HashSet::new();
        let mut at = (guard > 1).then(|| table.by_pid(guard)).flatten();
        // A cycle cannot happen in /proc but is bounded anyway (`insert` is false the second time).
        while let Some(p) = at {
            if p.ppid <= 1 || !ancestors.insert(p.ppid) {
                break;
            }
            at = table.by_pid(p.ppid);
        }
        NeverMembers {
            config,
            table,
            guard,
            ancestors,
            gpu_holders,
        }
    }

    /// Why no model may take `p` in, if none may. `launched`: `gpuguard launch` registered it,
    /// so a login session's shell is its model's.
    pub fn why(&self, p: &Process, launched: bool) -> Option<LeftOut> {
        self.why_with(p, launched, || self.protected(p))
    }

    /// Whether `[protect]` protects `p` (the rules victim choice trusts).
    pub fn protected(&self, p: &Process) -> bool {
        self.config
            .protect
            .protects(&p.comm, p.uid, &p.cmdline, &p.cgroup, p.exe.as_ref())
    }

    /// `why`, with what `[protect]` says of `p` (`protected`) asked only if it matters.
    pub fn why_with(
        &self,
        p: &Process,
        launched: bool,
        protected: impl FnOnce() -> bool,
    ) -> Option<LeftOut> {
        Some(if p.pid <= 1 {
            LeftOut::Init
        } else if p.ppid == 0 {
            LeftOut::NoParent
        } else if p.kernel_thread {
            LeftOut::KernelThread
        } else if p.pid == self.guard {
            LeftOut::Guard
        } else if protected() {
            LeftOut::Protected
        } else if self.ancestors.contains(&p.pid) {
            LeftOut::GuardAncestor
        } else if !launched && self.login_session(p) {
            LeftOut::LoginSession
        } else {
            return None;
        })
    }

    fn login_session(&self, p: &Process) -> bool {
        self.session_leader(p)
            || (is_shell(&p.comm)
                && p.rss_bytes <= SESSION_SHELL_MAX_RSS
                && !self.gpu_holders.contains(&p.pid)
                && self.parent(p).is_some_and(|q| self.session_leader(q)))
    }

    /// sshd serving a login (root's, or a child of root's), or root's `login`.
    fn session_leader(&self, p: &Process) -> bool {
        let root_sshd = |q: &Process| q.uid == 0 && !q.kernel_thread && SSHD.contains(&&*q.comm);
        match p.comm.as_str() {
            _ if p.kernel_thread => false,
            "login" => p.uid == 0,
            comm if SSHD.contains(&comm) => p.uid == 0 || self.parent(p).is_some_and(root_sshd),
            _ => false,
        }
    }

    fn parent(&self, p: &Process) -> Option<&'a Process> {
        if p.ppid <= 0 || p.ppid == p.pid {
            return None;
        }
        self.table.by_pid(p.ppid)
    }
}

/// A process as the survey names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    pub pid: i32,
    pub comm: String,
    pub uid: u32,
}

impl Seen {
    fn of(p: &Process) -> Seen {
        Seen {
            pid: p.pid,
            comm: p.comm.clone(),
            uid: p.uid,
        }
    }
}

impl fmt::Display for Seen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid {} ({})", self.pid, self.comm)
    }
}

/// Why a rule's match caught a process the rule does not take in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Why {
    /// No model may take it in.
    Never(LeftOut),
    /// Its uid is not one of the model's `users`.
    NotItsUser,
    /// An earlier `[[model]]` (this one, by its key) caught it: it is that one's.
    Earlier(String),
    /// `[protect]`: named like a protected process by a `comm` or `cmdline` rule, but not a
    /// process whose name is trusted (not root's, nor a system account's system executable).
    Untrusted,
}

impl fmt::Display for Why {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Why::Never(left_out) => left_out.fmt(f),
            Why::NotItsUser => f.write_str("not its users"),
            Why::Earlier(rule) => write!(f, "in {rule}"),
            Why::Untrusted => f.write_str("name not trusted"),
        }
    }
}

/// One rule and what it catches.
#[derive(Clone, Debug, PartialEq)]
pub struct RuleCatch {
    /// `model[0] 'qwen'`, or `[protect]`.
    pub rule: String,
    /// What it takes in, in pid order: a model's members (the processes its match catches and
    /// their descendants); the processes `[protect]` protects.
    pub caught: Vec<Seen>,
    /// What its match catches that it does not take in, in pid order.
    pub left_out: Vec<(Seen, Why)>,
}

/// What is allowed but probably not meant, on this table.
#[derive(Clone, Debug, PartialEq)]
pub enum RuleWarning {
    /// A model takes in more processes than `daemon.warn_model_processes`.
    TooMany {
        rule: String,
        count: usize,
        limit: usize,
    },
    /// A model's match catches processes no model may take in.
    CatchesNeverMembers {
        rule: String,
        left_out: Vec<(Seen, LeftOut)>,
    },
    /// A model's match catches processes an earlier model's caught first.
    Overlap {
        rule: String,
        first: String,
        caught: Vec<Seen>,
    },
}

/// At most this many processes are named in a warning.
const NAMED: usize = 5;

fn named<T>(items: &[T], one: impl Fn(&T) -> String) -> String {
    let mut text: Vec<String> = items.iter().take(NAMED).map(one).collect();
    if items.len() > NAMED {
        text.push(format!("and {} more", items.len() - NAMED));
    }
    text.join(", ")
}

impl fmt::Display for RuleWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RuleWarning::TooMany { rule, count, limit } => write!(
                f,
                "{rule} takes in {count} processes, more than daemon.warn_model_processes \
                 ({limit}): is its match too loose? (gpuguard check-config --matches lists them)"
            ),
            RuleWarning::CatchesNeverMembers { rule, left_out } => write!(
                f,
                "{rule}: its match catches {} process(es) that no model takes in, left out: {}",
                left_out.len(),
                named(left_out, |(p, why)| format!("{p}: {why}"))
            ),
            RuleWarning::Overlap {
                rule,
                first,
                caught,
            } => write!(
                f,
                "{rule}: its match catches {} process(es) that {first} caught first, so they \
                 belong to that one (a process is the first matching [[model]]'s): {}",
                caught.len(),
                named(caught, |p| p.to_string())
            ),
        }
    }
}

/// Every rule's catch and the warnings, for a config on a process table.
#[derive(Clone, Debug, PartialEq)]
pub struct Survey {
    /// The `[[model]]`s in config order, then `[protect]`.
    pub rules: Vec<RuleCatch>,
    pub warnings: Vec<RuleWarning>,
}

/// What each rule of `config` catches in `table`, with `guard` the guard's pid (0: none, as for
/// `check-config`, whose own ancestors are not the daemon's). Membership as the policy has it
/// (`attribute`), before any `gpuguard launch`. Exited processes and kernel threads are left
/// out of the lists: they hold nothing and no rule ever matched a kernel thread.
pub fn survey(config: &Config, table: &ProcessTable, guard: i32) -> Survey {
    let attribution = attribute(
        config,
        table,
        &GpuSnapshot::default(),
        &HashMap::new(),
        &BTreeMap::new(),
        guard,
        &mut MatchCache::default(),
    );
    let never = NeverMembers::new(config, table, &GpuSnapshot::default(), guard);
    let mut live: Vec<&Process> = table
        .processes
        .iter()
        .filter(|p| !p.exited() && !p.kernel_thread)
        .collect();
    live.sort_by_key(|p| p.pid);
    let key = |i: usize| format!("model[{i}] '{}'", config.models[i].name);
    let mut rules = Vec::new();
    let mut warnings = Vec::new();
    for (i, m) in config.models.iter().enumerate() {
        let caught: Vec<Seen> = live
            .iter()
            .filter(|p| attribution.model_of(p.id()) == Some(i))
            .map(|p| Seen::of(p))
            .collect();
        let users = m.allowed_users();
        let mut left_out = Vec::new();
        // What earlier models caught first, by model, in config order.
        let mut earlier: BTreeMap<usize, Vec<Seen>> = BTreeMap::new();
        for p in &live {
            if !m.matcher.matches(&p.comm, p.uid, &p.cmdline, &p.cgroup) {
                continue;
            }
            let why = if !users.member(p.uid) {
                Why::NotItsUser
            } else if let Some(left) = never.why(p, false) {
                Why::Never(left)
            } else {
                match attribution.model_of(p.id()) {
                    Some(j) if j != i => {
                        earlier.entry(j).or_default().push(Seen::of(p));
                        Why::Earlier(key(j))
                    }
                    _ => continue,
                }
            };
            left_out.push((Seen::of(p), why));
        }
        let limit = config.daemon.warn_model_processes;
        if caught.len() > limit {
            warnings.push(RuleWarning::TooMany {
                rule: key(i),
                count: caught.len(),
                limit,
            });
        }
        let never_members: Vec<(Seen, LeftOut)> = left_out
            .iter()
            .filter_map(|(p, why)| match why {
                Why::Never(left) => Some((p.clone(), *left)),
                _ => None,
            })
            .collect();
        if !never_members.is_empty() {
            warnings.push(RuleWarning::CatchesNeverMembers {
                rule: key(i),
                left_out: never_members,
            });
        }
        for (j, caught) in earlier {
            warnings.push(RuleWarning::Overlap {
                rule: key(i),
                first: key(j),
                caught,
            });
        }
        rules.push(RuleCatch {
            rule: key(i),
            caught,
            left_out,
        });
    }
    let protect = &config.protect;
    let (mut caught, mut left_out) = (Vec::new(), Vec::new());
    for p in &live {
        if protect.protects(&p.comm, p.uid, &p.cmdline, &p.cgroup, p.exe.as_ref()) {
            caught.push(Seen::of(p));
        } else if protect.names(&p.comm, &p.cmdline) {
            left_out.push((Seen::of(p), Why::Untrusted));
        }
    }
    rules.push(RuleCatch {
        rule: "[protect]".into(),
        caught,
        left_out,
    });
    Survey { rules, warnings }
}
