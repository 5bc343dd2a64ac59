//! The `gpuguard` command line: one binary, one subcommand per job. `main.rs` only calls `main`.

mod generate;
mod launch;
mod status;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

use crate::config::Config;
use crate::daemon::{Daemon, Roots};
use crate::ipc::DEFAULT_SOCKET;

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
    /// `launch`: the model did not fit before the queue timeout; it was not started (EX_TEMPFAIL).
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
                  75 launch timed out in the queue; 77 launch refused; 126/127 command not executable/found."
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
    },
    /// Validate a config file: exit 0 if it is good, 2 with the file, key and value if not.
    CheckConfig {
        /// The config file.
        config: PathBuf,
    },
    /// Show GPUs, host memory, models, the launch queue, held processes and recent actions.
    Status {
        /// Print the report as JSON (a stable, versioned schema).
        #[arg(long)]
        json: bool,
        /// Refresh every 2 seconds until interrupted.
        #[arg(long)]
        watch: bool,
        #[arg(long, env = "GPUGUARD_SOCKET", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
    },
    /// Wait for memory through the daemon's launch queue, then exec CMD (same pid).
    Launch(launch::LaunchArgs),
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

/// Runs the command line; returns the process exit code.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::CheckConfig { config } => match Config::load(&config) {
            Ok(c) => {
                println!(
                    "config {}: ok ({} model(s), mode {:?})",
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
        } => run_daemon(path, lock),
        Command::Status {
            json,
            watch,
            socket,
        } => status::run(&socket, json, watch.then_some(Duration::from_secs(2))),
        Command::Launch(args) => launch::run(args),
        Command::Release { lease, socket } => release(&socket, lease),
        Command::GenerateAssets { dir } => generate::run(&dir),
    };
    ExitCode::from(code)
}

fn release(socket: &std::path::Path, lease: u64) -> u8 {
    match crate::ipc::client::ask(socket, crate::ipc::Request::Release { lease }) {
        Ok(crate::ipc::Response::Released { lease }) => {
            println!("lease {lease} released");
            exit::OK
        }
        Ok(crate::ipc::Response::Error { message }) => {
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

fn run_daemon(path: PathBuf, lock: bool) -> u8 {
    init_logging();
    let config = match Config::load(&path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpuguard: {e}");
            return exit::CONFIG;
        }
    };
    if lock {
        lock_memory();
    }
    match Daemon::new(&path, config, Roots::default()).and_then(Daemon::run) {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("gpuguard: {e:#}");
            exit::FAILURE
        }
    }
}

/// Keeps the guard resident when the host runs out of memory, when it matters most. First every
/// page mapped now (the whole binary, the rarely run kill path included) is faulted in and locked;
/// then later mappings (heap, thread stacks, NVML loaded at run time) are locked as they are
/// touched (MCL_ONFAULT, Linux 4.4+). Failure only warns.
///
/// The kernel accounts locked memory by mapping size, reservations included (hundreds of MiB
/// with NVML loaded, for a few MiB more resident than unlocked), so under a finite
/// RLIMIT_MEMLOCK, MCL_FUTURE would make later allocations fail once that account is full.
/// Future mappings are therefore locked only without a limit (the unit's LimitMEMLOCK=infinity)
/// or with CAP_IPC_LOCK.
fn lock_memory() {
    // SAFETY: mlockall takes flags only and changes no memory contents.
    if unsafe { libc::mlockall(libc::MCL_CURRENT) } != 0 {
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
    let future = unsafe { libc::mlockall(libc::MCL_FUTURE | libc::MCL_ONFAULT) } == 0
        || unsafe { libc::mlockall(libc::MCL_FUTURE) } == 0;
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
