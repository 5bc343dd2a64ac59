//! What a config needs of this host, checked by the same code for the daemon at start and for
//! `gpuguard check-config`: the state directory is gpuguard's own, the floors fit this host's
//! MemTotal, SwapTotal and GPU totals, every webhook's secret file reads, the metrics address
//! binds, and the socket is not another daemon's. (Users and regexes are checked when the
//! config is parsed.) Each problem is a `ConfigError` naming the file and the key: both exit 2
//! on it, so systemd does not restart a config that cannot work here.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::act::claim::Holder;
use crate::config::{Config, ConfigError, GpuTotal, HostTotals};
use crate::sample::nvml::{GpuMonitor, NvmlGpuSource};
use crate::sample::{sockets, ProcSource, ProcfsSource};
use crate::state_dir::{StateDir, StateDirError};

/// How long the GPU floors' check waits for NVML's first answer (loading NVML takes seconds on
/// some drivers; at start RAM is not guarded meanwhile, so not longer).
pub const FIRST_GPU_ANSWER: Duration = Duration::from_secs(5);

/// Who checks: the daemon at its own start, or `check-config` beside the daemon that runs the
/// config now, if one does (its own port and socket are not in the way of its reload).
#[derive(Clone, Debug)]
pub enum Checker {
    Daemon,
    CheckConfig {
        /// The daemon that holds the config's state directory (read as root only).
        running: Option<Holder>,
        /// Run as root, as the daemon is: what root alone may read is checked, not noted.
        root: bool,
    },
}

impl Checker {
    /// `check-config` as the current user.
    pub fn check_config(running: Option<Holder>) -> Checker {
        Checker::CheckConfig {
            running,
            root: rustix::process::geteuid().is_root(),
        }
    }

    fn running(&self) -> Option<i32> {
        match self {
            Checker::CheckConfig { running, .. } => running.as_ref().map(|h| h.pid),
            Checker::Daemon => None,
        }
    }

    /// A user other than root checking, who cannot read what the daemon (root) reads.
    fn unprivileged(&self) -> bool {
        matches!(self, Checker::CheckConfig { root: false, .. })
    }
}

/// What passing the checks leaves open for the daemon (the metrics address, bound), and what
/// is to be said of this host without refusing the config (another program holds the metrics
/// port or serves the socket; what a checker other than root could not check).
#[derive(Debug, Default)]
pub struct Ready {
    pub metrics: MetricsPort,
    pub notes: Vec<String>,
}

/// `[metrics] listen` as the start's checks found it.
#[derive(Debug, Default)]
pub enum MetricsPort {
    /// Off in the config (or, for `check-config`, the running daemon's).
    #[default]
    Off,
    Bound(TcpListener),
    /// Another program holds it (why, said): bound once it is free.
    Held(std::net::SocketAddr, String),
}

/// How often the daemon tries again to bind a metrics port another program held.
pub const METRICS_RETRY: Duration = Duration::from_secs(10);

/// This host's totals: MemTotal and SwapTotal from `procs`, each GPU's from NVML's first answer
/// when GPU floors are configured (waited for at most `FIRST_GPU_ANSWER`: a GPU that answers
/// later has its floors checked at the next reload).
pub fn host_totals(
    config: &Config,
    procs: &mut dyn ProcSource,
    gpus: Option<&GpuMonitor>,
) -> HostTotals {
    let host = procs.host_memory();
    let g = &config.gpu;
    let gpu_floors = g.warn_free.is_some() || g.min_free.is_some() || !g.devices.is_empty();
    let devices = match gpus {
        Some(monitor) if gpu_floors => {
            monitor.request(false);
            monitor.wait_first(FIRST_GPU_ANSWER);
            let (snapshot, _, _) =
                monitor.snapshot(Instant::now(), Duration::ZERO, config.gpu.sample_timeout);
            snapshot.devices
        }
        _ => Vec::new(),
    };
    HostTotals {
        ram_bytes: host.total_bytes,
        swap_bytes: host.swap_total_bytes,
        gpus: gpu_totals(&devices),
    }
}

/// `host_totals` from the real /proc and NVML (`check-config`, no daemon of its own).
pub fn host_totals_now(config: &Config) -> HostTotals {
    let mut procs = ProcfsSource::new("/proc");
    let gpus = config.gpu.enabled.then(|| {
        let source = NvmlGpuSource::new(config.gpu.nvml_library.clone(), config.gpu.retry_init);
        GpuMonitor::start(Box::new(source), config.gpu.sample_timeout)
    });
    host_totals(config, &mut procs, gpus.as_ref())
}

pub fn gpu_totals(devices: &[crate::snapshot::Gpu]) -> Vec<GpuTotal> {
    devices
        .iter()
        .map(|g| GpuTotal {
            index: g.index,
            uuid: g.uuid.clone(),
            total_bytes: g.total_bytes,
        })
        .collect()
}

/// Every check of `config` (read from `file`) against this host, in the order the daemon needs
/// them.
pub fn check(
    config: &Config,
    file: &Path,
    totals: &HostTotals,
    who: &Checker,
) -> Result<Ready, ConfigError> {
    let mut ready = Ready::default();
    check_state_dir(config, file, who, &mut ready)?;
    config.check_host(totals, file)?;
    check_secrets_as(config, file, who, &mut ready)?;
    check_socket(config, file, who, &mut ready)?;
    ready.metrics = bind_metrics(config, file, who, &mut ready)?;
    Ok(ready)
}

/// The state directory is not gpuguard's own (owned by another user, writable by others): a
/// config error, the key `daemon.state_dir`.
pub fn state_dir_error(file: &Path, e: StateDirError) -> ConfigError {
    error(file, "daemon.state_dir", e.to_string())
}

fn check_state_dir(
    config: &Config,
    file: &Path,
    who: &Checker,
    ready: &mut Ready,
) -> Result<(), ConfigError> {
    let path = &config.daemon.state_dir;
    if !who.unprivileged() {
        return match StateDir::open_existing(path) {
            Ok(_) => Ok(()),
            Err(e) => Err(state_dir_error(file, e)),
        };
    }
    // Root's directory, seen by another user: only what anyone can see of it.
    use std::os::unix::fs::MetadataExt;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.mode() & 0o022 != 0 => Err(error(
            file,
            "daemon.state_dir",
            format!(
                "'{}' is writable by group or others (mode {:04o}): the daemon refuses it",
                path.display(),
                m.mode() & 0o7777
            ),
        )),
        Ok(_) => {
            ready.notes.push(format!(
                "daemon.state_dir: '{}' checked only for its mode (its owner as root)",
                path.display()
            ));
            Ok(())
        }
        Err(_) => Ok(()),
    }
}

/// Every webhook's `secret_file` reads and holds a secret (the daemon at start).
pub fn check_secrets(config: &Config, file: &Path) -> Result<(), ConfigError> {
    check_secrets_as(config, file, &Checker::Daemon, &mut Ready::default())
}

fn check_secrets_as(
    config: &Config,
    file: &Path,
    who: &Checker,
    ready: &mut Ready,
) -> Result<(), ConfigError> {
    for (i, w) in config.alert.webhooks.iter().enumerate() {
        let Some(path) = &w.secret_file else {
            continue;
        };
        let key = format!("alert.webhook[{i}].secret_file");
        let denied = crate::alert::webhook::open_secret(path)
            .is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied);
        if denied && who.unprivileged() {
            ready.notes.push(format!(
                "{key}: '{}' is not readable by this user (the daemon reads it as root)",
                path.display()
            ));
            continue;
        }
        crate::alert::webhook::read_secret(path).map_err(|e| error(file, &key, e))?;
    }
    Ok(())
}

/// The socket's directory is root's alone (the daemon binds it, then chmods it by name); one
/// served by another process now is said (`check-config`; the daemon itself then exits 1: the
/// other may go, and systemd tries again).
fn check_socket(
    config: &Config,
    file: &Path,
    who: &Checker,
    ready: &mut Ready,
) -> Result<(), ConfigError> {
    let path = &config.launch.socket;
    if path.parent().is_some_and(|p| p.exists()) {
        crate::state_dir::check_parent(path).map_err(|e| error(file, "launch.socket", e))?;
    }
    let Some(pid) = crate::ipc::peer::server_of(path) else {
        return Ok(());
    };
    if pid.is_some() && pid == who.running() {
        return Ok(());
    }
    let by = pid.map_or("another process".into(), |p| format!("pid {p}"));
    ready.notes.push(match who {
        Checker::CheckConfig { root: false, .. } => format!(
            "launch.socket: '{}' is served by {by}: the daemon of this config if it runs (as \
             root, check-config tells)",
            path.display()
        ),
        _ => format!(
            "launch.socket: '{}' is in use by {by} (another gpuguard daemon?): a daemon of this \
             config does not start while it is (exit 1); give it a socket of its own (--socket)",
            path.display()
        ),
    });
    Ok(())
}

/// `[metrics] listen`: bound now; held by another program (a user may bind a loopback port
/// first: the guard starts without its metrics and binds them once free, never stays down for
/// it); or an address that can never be bound here (not this host's, a port below 1024 without
/// the capability): a config error.
fn bind_metrics(
    config: &Config,
    file: &Path,
    who: &Checker,
    ready: &mut Ready,
) -> Result<MetricsPort, ConfigError> {
    let Some(address) = config.metrics.address() else {
        return Ok(MetricsPort::Off);
    };
    let e = match TcpListener::bind(address) {
        Ok(listener) => return Ok(MetricsPort::Bound(listener)),
        Err(e) => e,
    };
    if e.kind() != std::io::ErrorKind::AddrInUse {
        return Err(error(
            file,
            "metrics.listen",
            format!("'{address}' cannot be bound: {e}"),
        ));
    }
    let proc = PathBuf::from("/proc");
    let listeners = sockets::Listeners::read(&proc).reached(address);
    if let Some(pid) = who.running() {
        if listeners
            .iter()
            .any(|l| sockets::holds_socket(&proc, pid, l.inode))
        {
            return Ok(MetricsPort::Off);
        }
    }
    let holders: Vec<String> = listeners.iter().map(|l| format!("uid {}", l.uid)).collect();
    let held = format!(
        "'{address}' is held by another program ({})",
        if holders.is_empty() {
            "its owner unknown".into()
        } else {
            holders.join(", ")
        }
    );
    ready.notes.push(match who {
        Checker::CheckConfig { root: false, .. } => format!(
            "metrics.listen: {held}: the daemon of this config if it runs (as root, check-config \
             tells)"
        ),
        _ => format!(
            "metrics.listen: {held}: the daemon serves no metrics until it is free (it tries \
             again every {}s)",
            METRICS_RETRY.as_secs()
        ),
    });
    Ok(MetricsPort::Held(address, held))
}

fn error(file: &Path, key: &str, message: String) -> ConfigError {
    ConfigError {
        file: file.to_path_buf(),
        key: key.into(),
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str, dir: &Path) -> Config {
        let text = format!(
            "[daemon]\nstate_dir = \"{}\"\n[launch]\nsocket = \"{}\"\n{text}",
            dir.join("state").display(),
            dir.join("sock").display()
        );
        Config::parse(&text, Path::new("/etc/gpuguard/config.toml")).unwrap()
    }

    fn totals() -> HostTotals {
        HostTotals {
            ram_bytes: Some(64 << 30),
            swap_bytes: Some(0),
            gpus: Vec::new(),
        }
    }

    /// Issue 40: what passed `check-config` and then stopped the daemon is refused by the one
    /// check both run, with the key: a floor above MemTotal, a missing secret file, a metrics
    /// address that can never be bound here, a socket or state directory in a directory another
    /// account may write (root binds and chmods there by name).
    #[test]
    fn what_the_daemon_refuses_at_start_is_refused_with_its_key() {
        let root = tempfile::tempdir().unwrap();
        let file = Path::new("/etc/gpuguard/config.toml");
        let key = |text: &str| {
            check(
                &config(text, root.path()),
                file,
                &totals(),
                &Checker::Daemon,
            )
            .unwrap_err()
            .key
        };
        assert_eq!(
            key("[ram]\nmin_available = \"65GiB\"\n"),
            "ram.min_available"
        );
        let missing = root.path().join("no-such-secret");
        assert_eq!(
            key(&format!(
                "[[alert.webhook]]\nurl = \"http://127.0.0.1:9/h\"\nsecret_file = \"{}\"\n",
                missing.display()
            )),
            "alert.webhook[0].secret_file"
        );
        // TEST-NET-1: never an address of this host.
        assert_eq!(
            key("[metrics]\nlisten = \"192.0.2.1:9835\"\n"),
            "metrics.listen"
        );
        let open = tempfile::tempdir().unwrap();
        std::fs::set_permissions(
            open.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        )
        .unwrap();
        let text = format!(
            "[daemon]\nstate_dir = \"{}\"\n[launch]\nsocket = \"{}\"\n",
            root.path().join("state").display(),
            open.path().join("g.sock").display()
        );
        let parsed = Config::parse(&text, file).unwrap();
        let e = check(&parsed, file, &totals(), &Checker::Daemon).unwrap_err();
        assert_eq!(e.key, "launch.socket", "{e}");
        assert!(e.message.contains("writable by others"), "{e}");
        let text = format!(
            "[daemon]\nstate_dir = \"{}\"\n",
            open.path().join("state").display()
        );
        let parsed = Config::parse(&text, file).unwrap();
        std::fs::create_dir(open.path().join("state")).unwrap();
        let e = check(&parsed, file, &totals(), &Checker::Daemon).unwrap_err();
        assert_eq!(e.key, "daemon.state_dir", "{e}");
    }

    /// Round five (a hostile review of issue 40): a user who binds the metrics port first must
    /// not keep the guard down (exit 2 is never restarted): the config passes, the port is
    /// said to be held (by whose uid), and the daemon serves it later. A socket another process
    /// serves is said too (the daemon exits 1 on it: it may go). Beside the running daemon, its
    /// own port and socket are neither.
    #[test]
    fn a_port_or_socket_another_holds_is_said_never_refused() {
        let root = tempfile::tempdir().unwrap();
        let file = Path::new("/etc/gpuguard/config.toml");
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap();
        let held = config(&format!("[metrics]\nlisten = \"{port}\"\n"), root.path());
        let server = std::os::unix::net::UnixListener::bind(root.path().join("sock")).unwrap();
        let ready = check(&held, file, &totals(), &Checker::Daemon).unwrap();
        assert!(
            matches!(&ready.metrics, MetricsPort::Held(a, why) if *a == port && why.contains("uid")),
            "{:?}",
            ready.metrics
        );
        let notes = ready.notes.join("\n");
        assert!(
            notes.contains("metrics.listen") && notes.contains("launch.socket"),
            "{notes}"
        );

        let beside = Checker::CheckConfig {
            running: Some(Holder::me(file, root.path())),
            root: true,
        };
        let ready = check(&held, file, &totals(), &beside).unwrap();
        assert!(
            matches!(ready.metrics, MetricsPort::Off),
            "{:?}",
            ready.metrics
        );
        assert!(ready.notes.is_empty(), "{:?}", ready.notes);
        drop(server);
        std::fs::remove_file(root.path().join("sock")).unwrap();
        // A good config binds its port for the daemon.
        let free = config("[metrics]\nlisten = \"127.0.0.1:0\"\n", root.path());
        let ready = check(&free, file, &totals(), &Checker::Daemon).unwrap();
        assert!(matches!(ready.metrics, MetricsPort::Bound(_)));
    }
}
