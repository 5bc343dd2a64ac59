//! The `gpuguard` command line: one binary, one subcommand per job. `main.rs` only calls `main`.

mod generate;
mod history;
mod launch;
mod matches;
mod permit;
mod plan;
mod replay;
mod status;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};

use crate::act::signal::PidfdControl;
use crate::act::{undo_leftovers, Leftovers};
use crate::config::DEFAULT_SOCKET;
use crate::config::{Config, DaemonConfig};
use crate::daemon::{Daemon, Roots};
use crate::state_dir::{StateDir, StateDirError};

/// Exit codes, documented in the README and the man page.
pub mod exit {
    /// Success.
    pub const OK: u8 = 0;
    /// A runtime error (the daemon could not start, an I/O error).
    pub const FAILURE: u8 = 1;
    /// A bad config file or bad usage.
    pub const CONFIG: u8 = 2;
    /// The daemon is not reachable on its socket (EX_UNAVAILABLE).
    pub const UNREACHABLE: u8 = 69;
    /// `launch`/`permit`: not admitted in time, or can never fit; nothing was started (EX_TEMPFAIL).
    pub const TIMED_OUT: u8 = 75;
    /// `launch`: the daemon refused the request (EX_NOPERM).
    pub const REFUSED: u8 = 77;
    /// `launch`: the command could not be executed (as in shells).
    pub const CANNOT_EXECUTE: u8 = 126;
    /// `launch`: the command was not found (as in shells).
    pub const NOT_FOUND: u8 = 127;
}

#[derive(Parser)]
#[command(
    name = "gpuguard",
    version,
    about = "Keeps GPU machines alive: guards GPU memory and host RAM for model servers",
    after_help = "Exit codes: 0 ok; 1 runtime error; 2 bad config or usage; 69 daemon unreachable; \
                  75 launch or permit not granted in time (or never fits); 77 refused; 126/127 command not executable/found."
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the guard in the foreground (as systemd runs it).
    Daemon {
        /// The config file.
        #[arg(long, short, default_value = "/etc/gpuguard/config.toml")]
        config: PathBuf,
        /// Lock the daemon's memory (mlockall) so it is never paged out under memory pressure
        /// (the systemd unit sets this, with LimitMEMLOCK=infinity). Failure only warns.
        #[arg(long)]
        lock_memory: bool,
        /// The state directory, overriding the config's daemon.state_dir. What a previous run
        /// left stopped or throttled there (default /var/lib/gpuguard) is let go before the
        /// config is read, so a broken config never leaves a process frozen.
        #[arg(long)]
        state_dir: Option<PathBuf>,
    },
    /// Validate a config file: exit 0 if it is good, 2 with the file, key and value if not.
    CheckConfig {
        /// The config file.
        config: PathBuf,
        /// Also show what each [[model]] and [protect] rule catches on this host now: how many
        /// processes, a few of them, and what its match catches that is left out and why.
        #[arg(long)]
        matches: bool,
    },
    /// Show GPUs, host memory, models, the launch queue, held processes and recent actions.
    Status {
        /// Print the report as JSON (a stable, versioned schema).
        #[arg(long)]
        json: bool,
        /// Refresh every 2 seconds until interrupted (redrawn in place on a terminal; with
        /// --json, one report per line).
        #[arg(long)]
        watch: bool,
        /// Show one model: its engine's limits and its processes one by one (pid, role, RAM,
        /// GPU memory per GPU, weights files mapped).
        #[arg(long, conflicts_with = "watch")]
        model: Option<String>,
        #[arg(long, env = "GPUGUARD_SOCKET", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
    },
    /// What the flight recorder kept: the status at a moment (--at), host RAM and GPU memory
    /// over time with floors and actions, the events; works with the daemon down.
    History(history::HistoryArgs),
    /// What-if: the recorded samples through the policy with another config, beside the
    /// actions that were taken (to tune floors and budgets before enforcing them).
    Replay(replay::ReplayArgs),
    /// Wait for memory through the daemon's launch queue, then exec CMD (same pid).
    Launch(launch::LaunchArgs),
    /// Hold a memory permit while CMD runs: waits until its memory fits (exit 75 if not in time).
    Permit(permit::PermitArgs),
    /// Work out the GPU memory a model needs (weights, KV cache per request, overheads), how
    /// many concurrent requests fit on which GPUs, the vLLM flags and the `[[model]]` budget.
    Plan(Box<plan::PlanArgs>),
    /// Tell the daemon a launched model is ready: frees the launch lock (owner or root only).
    Release {
        /// The lease number (launched commands get it as GPUGUARD_LEASE).
        #[arg(env = "GPUGUARD_LEASE")]
        lease: u64,
        #[arg(long, env = "GPUGUARD_SOCKET", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
    },
    /// Packaging: write the man pages and shell completions under DIR.
    #[command(hide = true)]
    GenerateAssets { dir: PathBuf },
}

/// The terminal width the human output of the CLI fits in (plan, status, history, replay).
pub(crate) const WIDTH: usize = 100;

/// `text` wrapped at word boundaries to `WIDTH`, the first line after `first`, the others after
/// `rest` (a word longer than a line stays whole).
pub(crate) fn wrapped(text: &str, first: &str, rest: &str) -> String {
    let mut out = String::new();
    let mut line = first.to_string();
    // Whether the line holds no word yet (a prefix that is not blank counts as one).
    let mut empty = first.trim().is_empty();
    for word in text.split(' ').filter(|w| !w.is_empty()) {
        if !empty && line.chars().count() + 1 + word.chars().count() > WIDTH {
            out.push_str(&line);
            out.push('\n');
            line = rest.to_string();
            empty = true;
        }
        if !empty {
            line.push(' ');
        }
        line.push_str(word);
        empty = false;
    }
    out.push_str(&line);
    out.push('\n');
    out
}

/// Runs the command line; returns the process exit code.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::CheckConfig { config, matches } => match Config::load(&config) {
            Ok(c) => {
                for warning in c.warnings() {
                    eprintln!("gpuguard: config {}: warning: {warning}", config.display());
                }
                matches::run(&config, &c, matches);
                println!(
                    "config {}: ok ({} model(s), mode {})",
                    config.display(),
                    c.models.len(),
                    c.daemon.mode
                );
                exit::OK
            }
            Err(e) => {
                eprintln!("gpuguard: {e}");
                exit::CONFIG
            }
        },
        Command::Daemon {
            config: path,
            lock_memory: lock,
            state_dir,
        } => run_daemon(path, lock, state_dir),
        Command::Status {
            json,
            watch,
            model,
            socket,
        } => status::run(
            &socket,
            json,
            watch.then_some(Duration::from_secs(2)),
            model.as_deref(),
        ),
        Command::Launch(args) => launch::run(args),
        Command::Permit(args) => permit::run(args),
        Command::Plan(args) => plan::run(*args),
        Command::History(args) => history::run(args),
        Command::Replay(args) => replay::run(args),
        Command::Release { lease, socket } => release(&socket, lease),
        Command::GenerateAssets { dir } => generate::run(&dir),
    };
    ExitCode::from(code)
}

fn release(socket: &std::path::Path, lease: u64) -> u8 {
    match crate::ipc::client::ask(socket, crate::protocol::Request::Release { lease }) {
        Ok(crate::protocol::Response::Released { .. }) => {
            println!("lease {lease} released");
            exit::OK
        }
        Ok(
            crate::protocol::Response::Error { message, .. }
            | crate::protocol::Response::Refused { message, .. },
        ) => {
            eprintln!("gpuguard: release refused: {message}");
            exit::REFUSED
        }
        Ok(other) => {
            eprintln!("gpuguard: unexpected answer from the daemon: {other:?}");
            exit::FAILURE
        }
        Err(e) => {
            eprintln!("gpuguard: {e}");
            exit::UNREACHABLE
        }
    }
}

/// Runs the guard. The order matters: what a previous run left held is let go first (from
/// `--state-dir`, else the default directory), then the config is read (exit 2 if it is bad,
/// or if its floors cannot be right on this host), then the guard starts.
fn run_daemon(path: PathBuf, lock: bool, state_dir: Option<PathBuf>) -> u8 {
    init_logging();
    // First: a SIGTERM from here on waits for the loop, which stops cleanly.
    let signals = match Daemon::signals() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("gpuguard: {e:#}");
            return exit::FAILURE;
        }
    };
    let swept = state_dir
        .clone()
        .unwrap_or_else(|| DaemonConfig::default().state_dir);
    let leftovers = match undo_leftovers_in(&swept) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("gpuguard: {e}");
            return exit::FAILURE;
        }
    };
    let mut config = match Config::load(&path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpuguard: {e}");
            return exit::CONFIG;
        }
    };
    if let Some(dir) = state_dir {
        config.daemon.state_dir = dir;
    }
    raise_file_limit();
    if lock {
        lock_memory();
    }
    let mut daemon = match Daemon::new(&path, config, Roots::default()) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gpuguard: {e:#}");
            return exit::FAILURE;
        }
    };
    daemon.announce_leftovers(&leftovers);
    if let Err(e) = daemon.check_floors_at_start() {
        eprintln!("gpuguard: {e}");
        return exit::CONFIG;
    }
    match daemon.run(signals) {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("gpuguard: {e:#}");
            exit::FAILURE
        }
    }
}

/// Raises the soft limit on open files to the hard one (the unit sets LimitNOFILE): the socket's
/// connection caps stay far below it, so clients can never use up the descriptors the guard
/// needs to read /proc and signal a victim.
fn raise_file_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!("cannot raise the open-file limit from {soft} to {hard}: {e}");
            }
        }
        Ok(_) => {}
        Err(e) => tracing::warn!("cannot read the open-file limit: {e}"),
    }
}

/// Lets go of what a previous run left held in `dir`, if it exists (it is not created here).
fn undo_leftovers_in(dir: &Path) -> Result<Leftovers, StateDirError> {
    let Some(dir) = StateDir::open_existing(dir)? else {
        return Ok(Leftovers::default());
    };
    let roots = Roots::default();
    let control = PidfdControl::new(&roots.proc);
    let leftovers = undo_leftovers(&Arc::new(dir), &control, &roots.cgroup);
    leftovers.log();
    Ok(leftovers)
}

/// Keeps the guard resident when the host runs out of memory, when it matters most. Every page
/// the daemon has touched, and every page it touches from now on, is locked as it is touched
/// (MCL_ONFAULT, Linux 4.4+; as earlyoom does): the daemon's resident set, not every mapping of
/// the binary and its libraries, so it stays a few MiB. The daemon runs its decision and signal
/// paths once at start (`daemon::warm`), so the code an emergency needs is already resident and
/// locked. Failure only warns.
///
/// The kernel accounts locked memory by mapping size, reservations included (hundreds of MiB
/// with NVML loaded, for a few MiB more resident than unlocked), so under a finite
/// RLIMIT_MEMLOCK, MCL_FUTURE would make later allocations fail once that account is full.
/// Future mappings are therefore locked only without a limit (the unit's LimitMEMLOCK=infinity)
/// or with CAP_IPC_LOCK.
fn lock_memory() {
    // SAFETY: mlockall takes flags only and changes no memory contents.
    let current = unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_ONFAULT) } == 0
        || unsafe { libc::mlockall(libc::MCL_CURRENT) } == 0;
    if !current {
        let e = std::io::Error::last_os_error();
        tracing::warn!(
            "memory not locked, gpuguard may be paged out under pressure: mlockall: {e}"
        );
        return;
    }
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit struct that we own.
    let unlimited = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } == 0
        && limit.rlim_cur == libc::RLIM_INFINITY;
    // CapEff, bit 14: CAP_IPC_LOCK lifts the limit.
    let ipc_lock = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let hex = s.lines().find_map(|l| l.strip_prefix("CapEff:"))?.trim();
            u64::from_str_radix(hex, 16).ok()
        })
        .is_some_and(|caps| caps & (1 << 14) != 0);
    if !unlimited && !ipc_lock {
        tracing::warn!(
            "only the memory mapped at start is locked: RLIMIT_MEMLOCK is finite \
             (LimitMEMLOCK=infinity lifts it)"
        );
        return;
    }
    // SAFETY: as above.
    let future =
        unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE | libc::MCL_ONFAULT) } == 0
            || unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE) } == 0;
    if future {
        tracing::info!("memory locked");
    } else {
        let e = std::io::Error::last_os_error();
        tracing::warn!("memory mapped from now on is not locked: mlockall: {e}");
    }
}

/// Logs to stderr, one line per event, without colours when not on a terminal (journald).
fn init_logging() {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("GPUGUARD_LOG")
        .unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .init();
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
