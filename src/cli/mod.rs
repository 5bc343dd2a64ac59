//! The `gpuguard` command line: one binary, one subcommand per job. `main.rs` only calls `main`.

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

use crate::act::claim::{self, Holder};
use crate::act::signal::PidfdControl;
use crate::act::Executor;
use crate::config::DEFAULT_SOCKET;
use crate::config::{Config, Mode, Overrides};
use crate::daemon::preflight::{self, Checker};
use crate::daemon::{Daemon, Roots, StartError};
use crate::state_dir::StateDir;

/// Exit codes, documented in the README, the man page and docs/protocol.md.
pub mod exit {
    use crate::protocol::RefusalReason;

    /// Success.
    pub const OK: u8 = 0;
    /// A runtime error: an I/O error; the daemon could not start because another gpuguard holds
    /// its state directory or enforces on this host (it may let go: systemd tries again).
    pub const FAILURE: u8 = 1;
    /// A bad config file, or one that cannot work on this host (systemd does not restart it), or
    /// bad usage (`launch`/`permit`: a request the daemon calls invalid).
    pub const CONFIG: u8 = 2;
    /// `launch`/`permit`: it can never fit on this host as asked (more than any GPU or the RAM
    /// above its floor, GPU memory on a host without a GPU, above its model's budget): trying
    /// again here is pointless; nothing was started (EX_DATAERR).
    pub const NEVER_FITS: u8 = 65;
    /// The daemon is not reachable on its socket (EX_UNAVAILABLE).
    pub const UNREACHABLE: u8 = 69;
    /// `launch`/`permit`: not now: not admitted in time, its queue full or its model's slots
    /// taken, the host draining for maintenance or preemption; try again later (or elsewhere);
    /// nothing was started (EX_TEMPFAIL).
    pub const TRY_LATER: u8 = 75;
    /// The daemon refused the request: the caller may not (EX_NOPERM).
    pub const REFUSED: u8 = 77;
    /// `launch`/`permit`: the command could not be executed (as in shells).
    pub const CANNOT_EXECUTE: u8 = 126;
    /// `launch`/`permit`: the command was not found (as in shells).
    pub const NOT_FOUND: u8 = 127;

    /// The exit code of `launch` and `permit` for a refusal: one table for both, decided by
    /// what the caller can do about it (docs/protocol.md lists it beside each reason). (A
    /// launch not admitted within its queue timeout is `TRY_LATER`; an `error` answer, a request
    /// the daemon would not take at all, is `REFUSED`.)
    pub fn refused(reason: RefusalReason) -> u8 {
        match reason {
            RefusalReason::Timeout
            | RefusalReason::QueueFull
            | RefusalReason::MaxPermits
            | RefusalReason::Cancelled
            | RefusalReason::HostMaintenance
            | RefusalReason::Preempted => TRY_LATER,
            RefusalReason::TooLarge => NEVER_FITS,
            RefusalReason::NotAllowed => REFUSED,
            RefusalReason::Invalid => CONFIG,
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// docs/protocol.md's table of refusal reasons: (reason, exit code) per row.
        fn documented() -> Vec<(String, u8)> {
            let text = include_str!("../../docs/protocol.md");
            let table = text
                .split_once("<!-- refusals -->")
                .expect("docs/protocol.md marks its table of refusals")
                .1;
            table
                .lines()
                .skip_while(|l| !l.starts_with('|'))
                .take_while(|l| l.starts_with('|'))
                .skip(2)
                .map(|row| {
                    let cells: Vec<&str> = row.split('|').map(str::trim).collect();
                    let reason = cells[1].trim_matches('`').to_string();
                    (reason, cells[2].parse().expect(row))
                })
                .collect()
        }

        /// Every reason the daemon gives is in the documented table, with the code the CLI
        /// exits with.
        #[test]
        fn the_exit_code_of_every_refusal_is_the_documented_one() {
            let table = documented();
            let reasons = [
                RefusalReason::Timeout,
                RefusalReason::TooLarge,
                RefusalReason::QueueFull,
                RefusalReason::MaxPermits,
                RefusalReason::NotAllowed,
                RefusalReason::Invalid,
                RefusalReason::Cancelled,
                RefusalReason::HostMaintenance,
                RefusalReason::Preempted,
            ];
            assert_eq!(table.len(), reasons.len(), "{table:?}");
            for reason in reasons {
                let row = table.iter().find(|(r, _)| r == reason.as_str());
                assert_eq!(
                    row.map(|(_, code)| *code),
                    Some(refused(reason)),
                    "{}",
                    reason.as_str()
                );
            }
            // Never fits, not now, not allowed, invalid: four answers a script can tell apart.
            let codes: std::collections::BTreeSet<u8> = reasons.map(refused).into();
            assert_eq!(codes.len(), 4);
        }
    }
}

#[derive(Parser)]
#[command(
    name = "gpuguard",
    version,
    about = "Keeps GPU machines alive: guards GPU memory and host RAM for model servers",
    after_help = "Exit codes: 0 ok; 1 runtime error (daemon: another gpuguard holds its state directory \
                  or enforces on this host); 2 bad config, one that cannot work on this host, or bad usage; \
                  65 launch or permit can never fit on this host (do not retry here); 69 daemon unreachable; \
                  75 launch or permit not now (not in time, queue full, host draining: try again later); \
                  77 not allowed; 126/127 command not executable/found."
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct DaemonArgs {
    /// The config file.
    #[arg(long, short, default_value = "/etc/gpuguard/config.toml")]
    config: PathBuf,
    /// Decide, log and alert, but never signal a process, whatever the config's daemon.mode
    /// says (kept across reloads). An observer may run beside the daemon that enforces.
    #[arg(long)]
    observe: bool,
    /// The state directory, overriding the config's daemon.state_dir. One daemon at a time
    /// uses a state directory; what a previous run left stopped or throttled there is let go
    /// (when no other daemon enforces on this host), also when the config is broken.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// The socket, overriding the config's launch.socket (a daemon beside the service needs
    /// one of its own).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Lock the daemon's memory (mlockall) so it is never paged out under memory pressure
    /// (the systemd unit sets this, with LimitMEMLOCK=infinity). Failure only warns.
    #[arg(long)]
    lock_memory: bool,
    /// Look at the config file every INTERVAL (e.g. 10s) and reload it, as SIGHUP does, when its
    /// content changed: for a Kubernetes ConfigMap volume, which changes without a signal.
    /// Symlinks are followed. A config with an error keeps the running one and says why.
    #[arg(long, value_name = "INTERVAL", value_parser = parse_watch_interval, env = "GPUGUARD_WATCH_CONFIG")]
    watch_config: Option<Duration>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the guard in the foreground (as systemd runs it).
    Daemon(DaemonArgs),
    /// Validate a config file for this host, with every check the daemon runs at start: exit 0
    /// if it is good, 2 with the file, key and value if not.
    CheckConfig {
        /// The config file.
        config: PathBuf,
        /// Only what is wrong on any host (packaging): not the floors against this host's
        /// memory, the secret files, the ports, the socket, the state directory, nor whether
        /// the users it names exist here.
        #[arg(long)]
        portable: bool,
        /// Also show what each [[model]] and [protect] rule catches on this host now: how many
        /// processes, a few of them, and what its match catches that is left out and why.
        #[arg(long)]
        matches: bool,
        /// The state directory the daemon is given (`daemon --state-dir`), over the config's:
        /// check the config as that daemon runs it (the unit's reload passes it).
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// The socket the daemon is given (`daemon --socket`), over the config's.
        #[arg(long)]
        socket: Option<PathBuf>,
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
}

/// The terminal width the human output of the CLI fits in (plan, status, history, replay).
pub(crate) const WIDTH: usize = 100;

/// `text` wrapped at word boundaries to `WIDTH` columns (as the terminal shows them: a fullwidth
/// character takes two), the first line after `first`, the others after `rest` (a word longer
/// than a line stays whole).
pub(crate) fn wrapped(text: &str, first: &str, rest: &str) -> String {
    let mut out = String::new();
    let mut line = first.to_string();
    // Whether the line holds no word yet (a prefix that is not blank counts as one).
    let mut empty = first.trim().is_empty();
    use unicode_width::UnicodeWidthStr;
    for word in text.split(' ').filter(|w| !w.is_empty()) {
        if !empty && line.width() + 1 + word.width() > WIDTH {
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
    crate::sample::host_facts::install();
    let cli = Cli::parse();
    let code = match cli.command {
        Command::CheckConfig {
            config,
            portable,
            matches,
            state_dir,
            socket,
        } => {
            let overrides = Overrides {
                state_dir,
                socket,
                observe: false,
            };
            check_config(&config, &overrides, portable, matches)
        }
        Command::Daemon(args) => run_daemon(args),
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

/// `check-config`: the config parsed and validated, what its rules catch among this host's
/// processes (the table with `matches`), then (unless `portable`) every check the daemon runs at
/// start, against this host, beside the daemon that runs the config now if one does.
fn check_config(path: &Path, overrides: &Overrides, portable: bool, matches: bool) -> u8 {
    let loaded = match portable {
        true => Config::load_portable(path),
        false => Config::load(path),
    };
    let mut config = match loaded {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpuguard: {e}");
            return exit::CONFIG;
        }
    };
    overrides.apply(&mut config);
    let warn = |line: &str| eprintln!("gpuguard: config {}: warning: {line}", path.display());
    for warning in config.warnings() {
        warn(&warning);
    }
    // What its rules catch on this host (a config for another host: only when asked).
    if !portable || matches {
        matches::run(path, &config, matches);
    }
    if !portable {
        let dir = StateDir::open_existing(&config.daemon.state_dir)
            .ok()
            .flatten();
        let running = dir.as_ref().and_then(claim::state_dir_holder);
        let totals = preflight::host_totals_now(&config);
        match preflight::check(
            &config,
            path,
            &totals,
            &Checker::check_config(running.clone()),
        ) {
            Ok(ready) => {
                for line in &ready.notes {
                    warn(line);
                }
            }
            Err(e) => {
                eprintln!("gpuguard: {e}");
                return exit::CONFIG;
            }
        }
        let enforcer = claim::enforce_holder(&roots().enforce_lock);
        let other = enforcer.filter(|e| running.as_ref().is_none_or(|r| r.pid != e.pid));
        match (config.daemon.mode, other, &running) {
            // The reload of a daemon that runs this config and observes: it would be refused.
            (Mode::Enforce, Some(other), Some(running)) => {
                eprintln!(
                    "gpuguard: config {}: daemon.mode: 'enforce': {other} enforces on this host: \
                     the daemon of this config (pid {}) cannot enforce while it does",
                    path.display(),
                    running.pid
                );
                return exit::CONFIG;
            }
            (Mode::Enforce, Some(other), None) => warn(&format!(
                "{other} enforces on this host: a daemon with this config does not start while \
                 it does (exit 1); with --observe it watches beside it"
            )),
            _ => {}
        }
    }
    println!(
        "config {}: ok ({} model(s), mode {}{})",
        path.display(),
        config.models.len(),
        config.daemon.mode,
        if portable {
            "; portable: not checked against this host"
        } else {
            ""
        }
    );
    exit::OK
}

/// `--watch-config`'s interval: a duration of at least 100 ms.
fn parse_watch_interval(text: &str) -> Result<Duration, String> {
    let every = crate::units::parse_duration(text)?;
    if every < Duration::from_millis(100) {
        return Err(format!(
            "'{text}' is too short: at least 100ms (e.g. \"10s\")"
        ));
    }
    Ok(every)
}

/// Where this daemon looks at the system: the defaults, and the enforce lock that
/// `GPUGUARD_ENFORCE_LOCK` names (tests that run daemons side by side).
fn roots() -> Roots {
    let mut roots = Roots::default();
    if let Some(path) = std::env::var_os(claim::ENFORCE_LOCK_ENV) {
        roots.enforce_lock = PathBuf::from(path);
    }
    roots
}

/// Runs the guard. The order matters: the config is read (exit 2 if it is bad), the state
/// directory claimed (exit 1 if another daemon holds it, or enforces on this host while this
/// one would), what a previous run left there let go of, then every check `check-config` runs
/// too (exit 2), then the guard starts. A config that cannot be read leaves nothing frozen
/// when the command line names the state directory (the unit does): that is swept anyway.
fn run_daemon(args: DaemonArgs) -> u8 {
    init_logging();
    // First: a SIGTERM from here on waits for the loop, which stops cleanly.
    let signals = match Daemon::signals() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("gpuguard: {e:#}");
            return exit::FAILURE;
        }
    };
    let overrides = Overrides {
        state_dir: args.state_dir,
        socket: args.socket,
        observe: args.observe,
    };
    let roots = roots();
    let mut config = match Config::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpuguard: {e}");
            if let Some(dir) = &overrides.state_dir {
                let_go_of_leftovers_in(dir, &args.config, &roots);
            }
            return exit::CONFIG;
        }
    };
    overrides.apply(&mut config);
    if overrides.observe {
        tracing::info!("--observe: deciding and logging only, never signalling a process");
    }
    raise_file_limit();
    if args.lock_memory {
        lock_memory();
    }
    let mut daemon = match Daemon::new(&args.config, config, roots) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gpuguard: {e}");
            return match e {
                StartError::Config(_) => exit::CONFIG,
                StartError::Claimed(_) | StartError::Runtime(_) => exit::FAILURE,
            };
        }
    };
    daemon.keep_overrides(overrides);
    if let Some(every) = args.watch_config {
        tracing::info!(
            "--watch-config: reloading {} when its content changes (looked at every {})",
            args.config.display(),
            crate::units::fmt_duration(every)
        );
        daemon.watch_config(every);
    }
    if let Err(e) = daemon.preflight() {
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

/// What a previous run left held in `dir` (when it exists and no other daemon holds it), let go
/// of when no other daemon enforces on the host: the config could not be read, and a broken
/// config must not leave a process frozen.
fn let_go_of_leftovers_in(dir: &Path, config: &Path, roots: &Roots) {
    let Ok(Some(dir)) = StateDir::open_existing(dir) else {
        return;
    };
    let me = Holder::me(config, dir.path());
    let Ok(_claim) = claim::claim_state_dir(&dir, &me) else {
        return;
    };
    let control = Arc::new(PidfdControl::new(&roots.proc));
    let dir = Arc::new(dir);
    if let Ok((_, leftovers)) = Executor::new(
        control,
        dir,
        &roots.cgroup,
        Mode::Observe,
        &roots.enforce_lock,
        me,
    ) {
        leftovers.log();
    }
}

/// Raises the soft limit on open files to the hard one (the unit sets LimitNOFILE): the socket's
/// connection caps stay far below it, so clients can never use up the descriptors the guard
/// needs to read /proc and signal a victim.
fn raise_file_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    // `None` is unlimited.
    let below = match (limit.current, limit.maximum) {
        (Some(soft), Some(hard)) => soft < hard,
        (Some(_), None) => true,
        (None, _) => false,
    };
    if below {
        let raised = Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        if let Err(e) = setrlimit(Resource::Nofile, raised) {
            let show = |l: Option<u64>| l.map_or("unlimited".to_string(), |n| n.to_string());
            tracing::warn!(
                "cannot raise the open-file limit from {} to {}: {e}",
                show(limit.current),
                show(limit.maximum)
            );
        }
    }
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
    use rustix::mm::{mlockall, MlockAllFlags as Mcl};
    // MCL_ONFAULT first; kernels before 4.4 refuse it, and then the whole mapping is locked.
    let lock = |flags: Mcl| mlockall(flags | Mcl::ONFAULT).or_else(|_| mlockall(flags));
    if let Err(e) = lock(Mcl::CURRENT) {
        tracing::warn!(
            "memory not locked, gpuguard may be paged out under pressure: mlockall: {e}"
        );
        return;
    }
    let unlimited = rustix::process::getrlimit(rustix::process::Resource::Memlock)
        .current
        .is_none();
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
    match lock(Mcl::CURRENT | Mcl::FUTURE) {
        Ok(()) => tracing::info!("memory locked"),
        Err(e) => tracing::warn!("memory mapped from now on is not locked: mlockall: {e}"),
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

    /// Issue 40: `--help` wraps (clap's `wrap_help`: to the terminal, to 100 columns where
    /// there is none); `plan --help` had lines of 332 columns.
    #[test]
    fn every_help_fits_100_columns() {
        let mut cli = Cli::command().term_width(100);
        cli.build();
        let mut commands = vec![cli.clone()];
        commands.extend(cli.get_subcommands().cloned());
        for mut command in commands {
            let name = command.get_name().to_string();
            let help = command.render_long_help().to_string();
            let widest = help.lines().map(|l| l.chars().count()).max().unwrap_or(0);
            assert!(widest <= WIDTH, "{name} --help: {widest} columns:\n{help}");
        }
    }

    /// The unit keeps what the guard needs (see its header); the boot test in
    /// packaging/test-deb.sh checks the same on a running systemd.
    #[test]
    fn systemd_unit_keeps_what_the_guard_needs() {
        let unit = include_str!("../../systemd/gpuguard.service");
        let settings: Vec<(&str, &str)> = unit
            .lines()
            .filter(|l| !l.starts_with('#') && !l.starts_with('['))
            .filter_map(|l| l.split_once('='))
            .collect();
        let get = |key: &str| -> Vec<&str> {
            settings
                .iter()
                .filter(|(k, _)| *k == key)
                .map(|(_, v)| *v)
                .collect()
        };
        for (key, value) in [
            ("Type", "notify"),
            ("Restart", "always"),
            ("OOMScoreAdjust", "-1000"),
            ("LimitMEMLOCK", "infinity"),
            ("RuntimeDirectory", "gpuguard"),
            ("RuntimeDirectoryMode", "0755"),
            ("StateDirectory", "gpuguard"),
            ("CapabilityBoundingSet", "CAP_KILL CAP_NET_ADMIN"),
            ("SystemCallErrorNumber", "EPERM"),
        ] {
            assert_eq!(get(key), [value], "{key}");
        }
        assert!(get("WatchdogSec").len() == 1, "WatchdogSec");
        assert_eq!(get("ExecReload").last(), Some(&"/bin/kill -HUP $MAINPID"));
        let exec = get("ExecStart");
        assert_eq!(
            exec,
            ["/usr/bin/gpuguard daemon --config /etc/gpuguard/config.toml --state-dir /var/lib/gpuguard --lock-memory"]
        );
        // The arguments are the CLI's.
        let args = exec[0].split_whitespace();
        if let Err(e) = <Cli as clap::Parser>::try_parse_from(args) {
            panic!("{e}");
        }

        // Nothing that hides /proc entries or devices, freezes cgroups or the hostname.
        for key in [
            "ProtectProc",
            "ProcSubset",
            "PrivateDevices",
            "DevicePolicy",
            "DeviceAllow",
            "ProtectClock",
            "ProtectControlGroups",
            "PrivateUsers",
            "ProtectHostname",
            "PrivatePIDs",
            "User",
            "DynamicUser",
        ] {
            assert!(get(key).is_empty(), "{key} must not be set: {:?}", get(key));
        }
        // The kill path survives the system call filter.
        let filter = get("SystemCallFilter").join(" ");
        for call in [
            "kill",
            "pidfd_open",
            "pidfd_send_signal",
            "process_mrelease",
            "mlockall",
        ] {
            assert!(filter.split(' ').any(|c| c == call), "{call} not allowed");
        }
        // Where the daemon puts its socket and state by default is where the unit lets it write.
        assert!(crate::config::DEFAULT_SOCKET.starts_with("/run/gpuguard/"));
        let defaults = crate::config::Config::parse("", Path::new("-")).unwrap();
        assert_eq!(defaults.daemon.state_dir, Path::new("/var/lib/gpuguard"));
    }
}
