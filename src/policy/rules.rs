//! The processes no model may take in whatever its `match` (issue 40: "rules that cannot
//! swallow the host").
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
//! matchable. What a user can still do: name a direct child of their session's sshd like a shell,
//! and so keep that one process out of its model and its budget (`exe` is not readable for other
//! accounts under the packaged unit, so a shell is known by its name). The floors still see it:
//! this is about membership; victim choice is unchanged. A process `gpuguard launch` registered
//! is its model's even as a session's shell (`ssh host gpuguard launch -- bash -c ...`): its
//! owner named it, through the socket's peer credentials; everything else above applies to it.

use std::collections::HashSet;
use std::fmt;

use crate::config::Config;
use crate::snapshot::{Process, ProcessTable};

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
}

impl<'a> NeverMembers<'a> {
    /// `guard`: the guard's own pid (0 for none: `check-config`).
    pub fn new(config: &'a Config, table: &'a ProcessTable, guard: i32) -> Self {
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
            || (is_shell(&p.comm) && self.parent(p).is_some_and(|q| self.session_leader(q)))
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
