//! The TOML config: what to watch, the floors, the models and their budgets, what never to touch.
//!
//! Loading is strict: unknown keys are errors (a mistyped floor must not be silently ignored) and
//! every error names the file, the key and the bad value.

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use regex::Regex;
use serde::{Deserialize, Deserializer, Serialize};

use crate::kinds::Severity;
use crate::units::{duration, fmt_bytes, Amount};

/// A config that could not be loaded: which file, which key, what is wrong with the value.
#[derive(Debug)]
pub struct ConfigError {
    pub file: PathBuf,
    /// Dotted path of the offending key (`ram.min_available`, `model[0] 'qwen'.ram`); empty for
    /// errors about the whole file.
    pub key: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.key.is_empty() {
            write!(f, "config {}: {}", self.file.display(), self.message)
        } else {
            write!(
                f,
                "config {}: {}: {}",
                self.file.display(),
                self.key,
                self.message
            )
        }
    }
}

impl std::error::Error for ConfigError {}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub daemon: DaemonConfig,
    #[serde(default)]
    pub ram: RamConfig,
    #[serde(default)]
    pub gpu: GpuConfig,
    #[serde(default)]
    pub protect: ProtectConfig,
    #[serde(default)]
    pub launch: LaunchConfig,
    #[serde(default, rename = "model")]
    pub models: Vec<ModelConfig>,
    #[serde(default)]
    pub metrics: MetricsConfig,
    #[serde(default)]
    pub alert: AlertConfig,
    #[serde(default)]
    pub clients: ClientsConfig,
    #[serde(default)]
    pub permits: PermitsConfig,
}

/// `[clients]`: what the users of the socket may hold at once. Every cap bounds the daemon's
/// memory and file descriptors whatever local users do.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClientsConfig {
    /// Socket connections at once, all users together; beyond it new ones are closed at once.
    pub max_connections: usize,
    /// Socket connections at once per uid (root included).
    pub max_connections_per_uid: usize,
    /// Launches per uid, waiting in the queue or loading.
    pub max_launches_per_uid: usize,
    /// Launched models per uid whose process still runs (each lease keeps a pidfd).
    pub max_leases_per_uid: usize,
    /// Launched models whose process still runs, all users together.
    pub max_leases: usize,
    /// A connection that holds nothing and sends nothing for this long is closed.
    #[serde(with = "duration")]
    pub idle_timeout: Duration,
    /// What one uid other than root may hold reserved at once (loading launches and permits):
    /// a size or a share of all GPU memory (and, separately, of RAM). `None`: no cap.
    pub max_reserved_per_uid: Option<Amount>,
}

impl Default for ClientsConfig {
    fn default() -> Self {
        ClientsConfig {
            max_connections: 256,
            max_connections_per_uid: 64,
            max_launches_per_uid: 8,
            max_leases_per_uid: 32,
            max_leases: 256,
            idle_timeout: Duration::from_secs(60),
            max_reserved_per_uid: None,
        }
    }
}

/// `[permits]`: memory permits (`gpuguard permit`, the Python client): the defaults and caps of
/// what a request may ask for.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PermitsConfig {
    /// How long a request waits when it names no timeout.
    #[serde(with = "duration")]
    pub default_timeout: Duration,
    /// The longest a request may wait, whatever it asks.
    #[serde(with = "duration")]
    pub max_timeout: Duration,
    /// How long a permit may be held when the request names no TTL; past it, it is revoked.
    #[serde(with = "duration")]
    pub default_ttl: Duration,
    /// The longest TTL a request may ask for.
    #[serde(with = "duration")]
    pub max_ttl: Duration,
    /// Requests waiting per model (and in the host-wide pool); beyond it, refused at once.
    pub queue: usize,
    /// Permits held plus requests waiting, per uid (root included).
    pub max_per_uid: usize,
    /// Permits held plus requests waiting, all users together.
    pub max_total: usize,
    /// Who may take permits from the host-wide pool (a request that names no model, from a
    /// process in none), beside root (the default: root only). Anyone else takes them under a
    /// model they belong to, bounded by its budget.
    pub users: Option<Vec<User>>,
}

impl PermitsConfig {
    /// Who may take permits from the host-wide pool (root always may: `Users::may_act`).
    pub fn host_pool_users(&self) -> Users {
        Users::Only(self.users.iter().flatten().map(|u| u.uid).collect())
    }
}

impl Default for PermitsConfig {
    fn default() -> Self {
        PermitsConfig {
            default_timeout: Duration::from_secs(30),
            max_timeout: Duration::from_secs(600),
            default_ttl: Duration::from_secs(600),
            max_ttl: Duration::from_secs(3600),
            queue: 256,
            max_per_uid: 1024,
            max_total: 4096,
            users: None,
        }
    }
}

/// `[metrics]`: the Prometheus endpoint.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// `host:port` to serve `/metrics` on (loopback, e.g. `127.0.0.1:9835`); empty = off.
    pub listen: String,
}

impl MetricsConfig {
    /// The address to listen on, if metrics are on (validated when the config is loaded).
    pub fn address(&self) -> Option<std::net::SocketAddr> {
        let listen = self.listen.trim();
        (!listen.is_empty()).then(|| listen.parse().ok()).flatten()
    }
}

/// `[alert]`: where notifications go, how often they repeat, and the event log.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlertConfig {
    /// A condition still active (floor crossed, over budget, GPU lost) is notified again this often.
    #[serde(with = "duration")]
    pub repeat_interval: Duration,
    /// Notifications waiting per sink; when full, the oldest is dropped (and counted).
    pub queue: usize,
    /// One HTTP request may take at most this long.
    #[serde(with = "duration")]
    pub timeout: Duration,
    /// Retries after a network error, 429 or 5xx (exponential backoff with jitter).
    pub retries: u32,
    /// The first retry waits this long; each later one twice as long (at most 5 minutes).
    #[serde(with = "duration")]
    pub backoff: Duration,
    /// The JSON-lines event log in `daemon.state_dir` (`events.jsonl`).
    pub event_log: bool,
    /// The event log is rotated to `events.jsonl.1` at this size.
    pub event_log_max_size: Amount,
    #[serde(rename = "webhook")]
    pub webhooks: Vec<WebhookConfig>,
}

impl Default for AlertConfig {
    fn default() -> Self {
        AlertConfig {
            repeat_interval: Duration::from_secs(3600),
            queue: 256,
            timeout: Duration::from_secs(10),
            retries: 5,
            backoff: Duration::from_secs(1),
            event_log: true,
            event_log_max_size: Amount::Bytes(16 << 20),
            webhooks: Vec::new(),
        }
    }
}

/// What a webhook receives.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum WebhookFormat {
    /// gpuguard's JSON body, with a Slack-compatible `text` field.
    #[default]
    Json,
    /// Slack's incoming-webhook body (`text` only).
    Slack,
    /// Alertmanager's v2 API (`POST /api/v2/alerts`): active alerts, resolved with `endsAt`.
    Alertmanager,
}

impl WebhookFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            WebhookFormat::Json => "json",
            WebhookFormat::Slack => "slack",
            WebhookFormat::Alertmanager => "alertmanager",
        }
    }
}

/// One `[[alert.webhook]]`. Its URL may hold a secret (Slack's do): it is never logged whole.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    pub url: String,
    #[serde(default)]
    pub format: WebhookFormat,
    /// A file whose content (trailing newline trimmed) keys an HMAC-SHA256 of every body, sent as
    /// `X-Gpuguard-Signature: sha256=<hex>`.
    pub secret_file: Option<PathBuf>,
    /// Only notifications at least this severe: "info", "warning" or "critical".
    #[serde(
        default = "default_min_severity",
        deserialize_with = "deserialize_severity"
    )]
    pub min_severity: Severity,
}

fn default_min_severity() -> Severity {
    Severity::Warning
}

fn deserialize_severity<'de, D: Deserializer<'de>>(d: D) -> Result<Severity, D::Error> {
    let text = String::deserialize(d)?;
    match text.as_str() {
        "info" => Ok(Severity::Info),
        "warning" => Ok(Severity::Warning),
        "critical" => Ok(Severity::Critical),
        _ => Err(serde::de::Error::custom(format!(
            "'{text}' is not a severity (use \"info\", \"warning\" or \"critical\")"
        ))),
    }
}

impl WebhookConfig {
    /// The URL without path, query or credentials: what logs and metrics may show.
    pub fn redacted_url(&self) -> String {
        let (scheme, rest) = self.url.split_once("://").unwrap_or(("", &self.url));
        let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
        let host = authority.rsplit('@').next().unwrap_or("");
        format!("{scheme}://{host}/…")
    }
}

impl fmt::Debug for WebhookConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WebhookConfig")
            .field("url", &self.redacted_url())
            .field("format", &self.format)
            .field("secret_file", &self.secret_file)
            .field("min_severity", &self.min_severity)
            .finish()
    }
}

/// Config enums print as they are written in the config (`enforce`, not `Enforce`).
macro_rules! display_as_written {
    ($($name:ident),*) => {$(
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match serde_json::to_value(self) {
                    Ok(serde_json::Value::String(s)) => f.write_str(&s),
                    _ => write!(f, "{self:?}"),
                }
            }
        }
    )*};
}
display_as_written!(Mode, Candidates, FloorAction, ModelAction);

/// `observe` decides, logs and alerts, but never signals a process.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Enforce,
    Observe,
}

/// Which processes may be chosen as a victim when a floor is crossed.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Candidates {
    /// Any process that is not protected (like the kernel OOM killer, but earlier).
    #[default]
    Any,
    /// Only processes that belong to a configured or launched model.
    Models,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DaemonConfig {
    /// The slowest sampling interval, used while memory is far from every floor.
    #[serde(with = "duration")]
    pub interval: Duration,
    /// The fastest sampling interval, used at and just above a floor.
    #[serde(with = "duration")]
    pub min_interval: Duration,
    /// Scan all processes at least every this often while nothing is near a floor or a budget.
    #[serde(with = "duration")]
    pub scan_interval: Duration,
    pub mode: Mode,
    pub state_dir: PathBuf,
    pub candidates: Candidates,
    /// After SIGTERM, how long a victim gets before SIGKILL.
    #[serde(with = "duration")]
    pub term_grace: Duration,
    /// After SIGTERM, a victim whose own memory grows by more than this is not shutting down:
    /// SIGKILL at once, without waiting out `term_grace` (a size, or a share of MemTotal).
    pub term_max_growth: Amount,
    /// The longest a process stays SIGSTOPped by gpuguard before it is killed.
    #[serde(with = "duration")]
    pub max_stop: Duration,
    /// After an action on a floor, how long to wait for memory to come back before acting again.
    #[serde(with = "duration")]
    pub settle: Duration,
    /// A victim still there this long after SIGKILL is reported (stuck in the kernel or driver)
    /// and nothing more is killed for that incident.
    #[serde(with = "duration")]
    pub kill_timeout: Duration,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        DaemonConfig {
            interval: Duration::from_secs(1),
            min_interval: Duration::from_millis(10),
            scan_interval: Duration::from_secs(5),
            mode: Mode::Enforce,
            state_dir: PathBuf::from("/var/lib/gpuguard"),
            candidates: Candidates::Any,
            term_grace: Duration::from_secs(1),
            term_max_growth: Amount::Bytes(8 << 20),
            max_stop: Duration::from_secs(300),
            settle: Duration::from_secs(2),
            kill_timeout: Duration::from_secs(10),
        }
    }
}

/// `gpuguard launch`: the socket, the launch lock and its timeouts.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LaunchConfig {
    /// The daemon's unix socket (also used by `gpuguard status`).
    pub socket: PathBuf,
    /// How many models may load at once (the launch lock).
    pub max_loading: usize,
    /// A loading model is ready once its memory has grown and stayed flat this long.
    #[serde(with = "duration")]
    pub settle: Duration,
    /// A loading model holds the lock at most this long (default for --ready-timeout).
    #[serde(with = "duration")]
    pub ready_timeout: Duration,
    /// How long a launch may wait in the queue before it fails (default for --queue-timeout).
    #[serde(with = "duration")]
    pub queue_timeout: Duration,
    /// The longest --ready-timeout a launch may ask for.
    #[serde(with = "duration")]
    pub max_ready_timeout: Duration,
    /// The longest --queue-timeout a launch may ask for.
    #[serde(with = "duration")]
    pub max_queue_timeout: Duration,
}

impl Default for LaunchConfig {
    fn default() -> Self {
        LaunchConfig {
            socket: PathBuf::from(DEFAULT_SOCKET),
            max_loading: 1,
            settle: Duration::from_secs(10),
            ready_timeout: Duration::from_secs(600),
            queue_timeout: Duration::from_secs(1800),
            max_ready_timeout: Duration::from_secs(7200),
            max_queue_timeout: Duration::from_secs(86400),
        }
    }
}

/// What gpuguard does to the chosen victim when a floor is crossed.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum FloorAction {
    /// Only alert.
    Alert,
    /// SIGSTOP the victim; SIGTERM/SIGKILL if memory is still below the floor after `settle`.
    Stop,
    /// SIGTERM, then SIGKILL after `term_grace` (at once when far below the floor).
    #[default]
    Kill,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RamConfig {
    /// Below this MemAvailable: alert (and pause launches).
    pub warn_available: Option<Amount>,
    /// Below this MemAvailable: choose a victim and act.
    pub min_available: Option<Amount>,
    /// Below this SwapFree (hosts with swap only): choose a victim and act.
    pub min_swap_free: Option<Amount>,
    /// PSI memory `some avg10` (percent) above which the host counts as under pressure: alone it
    /// warns; with MemAvailable below `warn_available` it acts.
    pub psi_some_avg10: Option<f64>,
    pub action: FloorAction,
    /// The brake on cascades: at most this many victims for the RAM floor within
    /// `victim_window`, counted across incidents; then it stops acting and alerts
    /// (`floor_brake`) until the window has passed. 0 turns the brake off.
    pub max_victims: u32,
    #[serde(with = "duration")]
    pub victim_window: Duration,
}

impl Default for RamConfig {
    fn default() -> Self {
        RamConfig {
            warn_available: Some(Amount::Percent(10.0)),
            min_available: Some(Amount::Percent(5.0)),
            min_swap_free: None,
            psi_some_avg10: None,
            action: FloorAction::Kill,
            max_victims: DEFAULT_MAX_VICTIMS,
            victim_window: DEFAULT_VICTIM_WINDOW,
        }
    }
}

/// Victims a floor may act on within `victim_window` before its brake holds it (RAM and GPU).
/// Where the daemon listens and the CLI connects (`[launch] socket`).
pub const DEFAULT_SOCKET: &str = "/run/gpuguard/gpuguard.sock";
pub const DEFAULT_MAX_VICTIMS: u32 = 3;
pub const DEFAULT_VICTIM_WINDOW: Duration = Duration::from_secs(300);

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GpuConfig {
    /// Turn GPU protection off even where NVML is present.
    pub enabled: bool,
    /// Load NVML from this file instead of the library search path.
    pub nvml_library: Option<PathBuf>,
    /// Below this NVML `free` on a GPU: alert (and pause launches on it).
    pub warn_free: Option<Amount>,
    /// Below this NVML `free` on a GPU: choose a victim among its processes and act.
    pub min_free: Option<Amount>,
    pub action: FloorAction,
    /// A GPU sample later than this is stale: used for alerts, never for kills.
    #[serde(with = "duration")]
    pub sample_timeout: Duration,
    /// How often to retry loading NVML when it is missing or failed.
    #[serde(with = "duration")]
    pub retry_init: Duration,
    /// After a kill, how long GPU memory may take to come back before it counts as stuck.
    #[serde(with = "duration")]
    pub release_timeout: Duration,
    /// Per-GPU overrides of the floors.
    #[serde(rename = "device")]
    pub devices: Vec<GpuOverride>,
    /// The brake on cascades, per GPU: as `[ram] max_victims` / `victim_window`.
    pub max_victims: u32,
    #[serde(with = "duration")]
    pub victim_window: Duration,
}

impl Default for GpuConfig {
    fn default() -> Self {
        GpuConfig {
            enabled: true,
            nvml_library: None,
            warn_free: None,
            min_free: None,
            action: FloorAction::Kill,
            sample_timeout: Duration::from_millis(500),
            retry_init: Duration::from_secs(60),
            release_timeout: Duration::from_secs(10),
            devices: Vec::new(),
            max_victims: DEFAULT_MAX_VICTIMS,
            victim_window: DEFAULT_VICTIM_WINDOW,
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuOverride {
    /// The GPU's index (`"0"`) or uuid (`"GPU-…"`).
    pub gpu: String,
    pub warn_free: Option<Amount>,
    pub min_free: Option<Amount>,
}

impl RamConfig {
    /// The (warn, min) MemAvailable floors in bytes on a host with `total` bytes of RAM.
    pub fn floor_bytes(&self, total: Option<u64>) -> (Option<u64>, Option<u64>) {
        (
            self.warn_available.and_then(|a| a.resolve(total)),
            self.min_available.and_then(|a| a.resolve(total)),
        )
    }
}

impl GpuConfig {
    /// The (warn, min) free-memory floors in bytes of one GPU with `total` bytes.
    pub fn floor_bytes(
        &self,
        index: u32,
        uuid: &str,
        total: Option<u64>,
    ) -> (Option<u64>, Option<u64>) {
        let (warn, min) = self.floors_for(index, uuid);
        (
            warn.and_then(|a| a.resolve(total)),
            min.and_then(|a| a.resolve(total)),
        )
    }

    /// The (warn, min) floors for one GPU, overrides first.
    pub fn floors_for(&self, index: u32, uuid: &str) -> (Option<Amount>, Option<Amount>) {
        self.with_override(self.override_index(index, uuid))
    }

    /// The (warn, min) floors of the GPU a `[[gpu.device]] gpu` names.
    fn floors_for_id(&self, id: &str) -> (Option<Amount>, Option<Amount>) {
        self.with_override(self.devices.iter().position(|d| d.gpu == id))
    }

    /// The `[[gpu.device]]` that applies to a GPU, by index or uuid (an empty uuid matches none).
    fn override_index(&self, index: u32, uuid: &str) -> Option<usize> {
        let index = index.to_string();
        self.devices
            .iter()
            .position(|d| d.gpu == index || (!uuid.is_empty() && d.gpu == uuid))
    }

    fn with_override(&self, device: Option<usize>) -> (Option<Amount>, Option<Amount>) {
        match device.map(|i| &self.devices[i]) {
            Some(o) => (o.warn_free.or(self.warn_free), o.min_free.or(self.min_free)),
            None => (self.warn_free, self.min_free),
        }
    }
}

impl GpuOverride {
    /// True if this override sets `field` (`warn_free` or `min_free`) itself.
    fn has(&self, field: &str) -> bool {
        match field {
            "warn_free" => self.warn_free.is_some(),
            _ => self.min_free.is_some(),
        }
    }
}

/// Processes never to touch. `pid 1`, kernel threads and gpuguard itself are always protected.
///
/// A process chooses its own name and command line (`prctl(PR_SET_NAME, "sshd")`), so the
/// `comm` and `cmdline` rules (the built-in list too) protect only processes of root and the
/// system accounts (uid below 1000): a user's hog named `sshd` is an ordinary candidate. What
/// users cannot fake: their uid (`users`), and the cgroup systemd put a service in (`units`,
/// `cgroups`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProtectConfig {
    /// Include the built-in list (sshd, systemd*, cloud guest agents, nvidia-persistenced, ...).
    pub defaults: bool,
    /// More process names (`comm`); a trailing `*` matches a prefix. System uids only.
    pub comm: Vec<String>,
    /// Regexes over the full command line. System uids only.
    pub cmdline: Vec<Pattern>,
    /// Users whose processes are never touched.
    pub users: Vec<User>,
    /// systemd units whose processes are never touched (`ssh.service`, `ml.slice/x.service`).
    pub units: Vec<String>,
    /// cgroup v2 path prefixes whose processes are never touched.
    pub cgroups: Vec<String>,
}

impl Default for ProtectConfig {
    fn default() -> Self {
        ProtectConfig {
            defaults: true,
            comm: Vec::new(),
            cmdline: Vec::new(),
            users: Vec::new(),
            units: Vec::new(),
            cgroups: Vec::new(),
        }
    }
}

/// The built-in protect list: what keeps a GCP GPU VM reachable and its GPUs usable.
pub const DEFAULT_PROTECTED_COMM: &[&str] = &[
    "systemd*",
    "init",
    "sshd",
    "dbus-daemon",
    "dbus-broker*",
    "agetty",
    "gpuguard",
    "google_guest_ag*",
    "google_osconfig*",
    "google_cloud_op*",
    "otelopscol",
    "fluent-bit",
    "nvidia-persiste*",
    "nv-fabricmanage*",
    "nv-hostengine",
    "containerd*",
    "dockerd",
    "kubelet",
    "chronyd",
    "rsyslogd",
];

impl ProtectConfig {
    /// True if a process with this name, uid, command line and cgroup must never be touched.
    pub fn protects(&self, comm: &str, uid: u32, cmdline: &str, cgroup: &str) -> bool {
        if self.users.iter().any(|u| u.uid == uid)
            || self
                .units
                .iter()
                .any(|u| cgroup_has_prefix(cgroup, &unit_cgroup(u)))
            || self.cgroups.iter().any(|c| cgroup_has_prefix(cgroup, c))
        {
            return true;
        }
        // Names and command lines are the process's own choice: trusted from system uids only.
        if uid >= FIRST_USER_UID {
            return false;
        }
        let builtin = if self.defaults {
            DEFAULT_PROTECTED_COMM
        } else {
            &[]
        };
        builtin
            .iter()
            .copied()
            .chain(self.comm.iter().map(String::as_str))
            .any(|p| comm_matches(p, comm))
            || self.cmdline.iter().any(|p| p.0.is_match(cmdline))
    }
}

/// `pattern` against a process name: exact (the kernel truncates names to 15 bytes, so a longer
/// pattern matches its first 15), or a prefix with a trailing `*`.
pub fn comm_matches(pattern: &str, comm: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => comm.starts_with(prefix),
        None => pattern == comm || (pattern.len() > 15 && pattern.get(..15) == Some(comm)),
    }
}

/// What gpuguard does to a model that stays over its budget longer than its `grace`.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum ModelAction {
    #[default]
    Alert,
    Throttle,
    Stop,
    Kill,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub name: String,
    #[serde(rename = "match", default)]
    pub matcher: Matcher,
    /// Host RAM budget: RSS summed over the model's processes and their descendants.
    pub ram: Option<Amount>,
    /// GPU memory budget, summed over the model's processes, per GPU and in total.
    pub gpu_memory: Option<Amount>,
    #[serde(default)]
    pub action: ModelAction,
    /// How long the model may stay over budget before its action.
    #[serde(with = "duration", default = "default_grace")]
    pub grace: Duration,
    /// Higher is more important: lower priorities are chosen as victims first.
    #[serde(default)]
    pub priority: i32,
    /// The users whose processes may belong to the model, and who may launch it or take permits
    /// for it. Unset: the `match.user`, else only root and system accounts (uid below 1000),
    /// which no unprivileged user can become: a user cannot join or steer a model by naming a
    /// process like its server.
    pub users: Option<Vec<User>>,
    /// At most this many permits held at once (for those who think in slots); unset: no limit.
    pub max_permits: Option<u32>,
    /// The GPU memory of a permit that names no size, until the observed p95 per permit is known.
    pub permit_gpu_memory: Option<Amount>,
    /// The model server's Prometheus endpoint (vLLM's `/metrics`), on loopback, plain http:
    /// scraped for its own limits (KV cache, running and waiting requests, preemptions).
    #[serde(default)]
    pub metrics_url: Option<String>,
}

/// Below this a uid is root or a system account (Debian's `SYS_UID_MAX` is 999): users cannot
/// get one, so what they run can be trusted with a name.
pub const FIRST_USER_UID: u32 = 1000;

/// Who may run a model's processes and act for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Users {
    /// Root and the system accounts.
    System,
    /// These uids (root is always allowed to act, but its processes join only if listed or
    /// when the list is `System`).
    Only(Vec<u32>),
}

impl Users {
    /// True if a process of `uid` may belong to the model.
    pub fn member(&self, uid: u32) -> bool {
        match self {
            Users::System => uid < FIRST_USER_UID,
            Users::Only(uids) => uids.contains(&uid),
        }
    }

    /// True if a client of `uid` may launch the model or take its permits.
    pub fn may_act(&self, uid: u32) -> bool {
        uid == 0 || self.member(uid)
    }
}

/// A model server's metrics URL must be plain `http://` on a loopback address (the daemon is
/// root and fetches it; a URL from a client must not reach anywhere else).
pub fn check_metrics_url(url: &str) -> Result<(), String> {
    let host = url_host(url, &["http"], "the engine's metrics on this host")?;
    let loopback = host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if !loopback {
        return Err(format!(
            "'{url}' must be on a loopback address (127.0.0.1, [::1] or localhost)"
        ));
    }
    Ok(())
}

/// A launched server's ready URL must be on this host: `localhost`, a loopback address or an
/// address of one of this host's interfaces (the daemon is root and polls it; a URL from a
/// client must not make it probe other hosts). Redirects are never followed (`http::agent`).
pub fn check_ready_url(url: &str) -> Result<(), String> {
    let host = url_host(
        url,
        &["http", "https"],
        "the server's health endpoint on this host",
    )?;
    if host.eq_ignore_ascii_case("localhost") {
        return Ok(());
    }
    let Ok(ip) = host.parse::<std::net::IpAddr>() else {
        return Err(format!(
            "'{url}' must name localhost or an IP address of this host, not a host name"
        ));
    };
    if ip.is_loopback() || local_addresses().contains(&ip) {
        Ok(())
    } else {
        Err(format!("'{url}': {ip} is not an address of this host"))
    }
}

/// The host of an absolute URL with one of `schemes` and no credentials.
fn url_host(url: &str, schemes: &[&str], what: &str) -> Result<String, String> {
    let bad = |why: &str| Err(format!("'{url}' {why}"));
    let Ok(uri) = url.parse::<ureq::http::Uri>() else {
        return bad("is not a URL");
    };
    if !uri.scheme_str().is_some_and(|s| schemes.contains(&s)) {
        return bad(&format!(
            "must be an {}:// URL ({what})",
            schemes.join(":// or ")
        ));
    }
    let Some(authority) = uri.authority() else {
        return bad("has no host");
    };
    if authority.as_str().contains('@') {
        return bad("must not hold credentials");
    }
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    Ok(host.to_string())
}

/// The IP addresses of this host's interfaces.
fn local_addresses() -> Vec<std::net::IpAddr> {
    let Ok(addresses) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    addresses
        .filter_map(|a| a.address)
        .filter_map(|a| {
            a.as_sockaddr_in()
                .map(|v4| std::net::IpAddr::V4(v4.ip()))
                .or_else(|| a.as_sockaddr_in6().map(|v6| std::net::IpAddr::V6(v6.ip())))
        })
        .collect()
}

impl ModelConfig {
    /// Who may run the model's processes and act for it (see `users`).
    pub fn allowed_users(&self) -> Users {
        match (&self.users, &self.matcher.user) {
            (Some(list), _) => Users::Only(list.iter().map(|u| u.uid).collect()),
            // A model matched by user is that user's.
            (None, Some(user)) => Users::Only(vec![user.uid]),
            (None, None) => Users::System,
        }
    }

    /// The (RAM, GPU memory) budgets in bytes: a `%` RAM budget is a share of MemTotal
    /// (`host_total`), a `%` GPU budget a share of the largest GPU (`largest_gpu`).
    pub fn budget_bytes(
        &self,
        host_total: Option<u64>,
        largest_gpu: Option<u64>,
    ) -> (Option<u64>, Option<u64>) {
        (
            self.ram.and_then(|a| a.resolve(host_total)),
            self.gpu_memory.and_then(|a| a.resolve(largest_gpu)),
        )
    }
}

fn default_grace() -> Duration {
    Duration::from_secs(10)
}

/// Which processes make up a model; every given key must match. Descendants of a matching
/// process belong to the model too.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Matcher {
    /// Regex over the command line (arguments joined by spaces).
    pub cmdline: Option<Pattern>,
    /// Process name (`comm`); a trailing `*` matches a prefix.
    pub comm: Option<String>,
    pub user: Option<User>,
    /// systemd unit, e.g. `vllm.service`: matches processes in that unit's own cgroup
    /// (`/system.slice/vllm.service`, or `SLICE/NAME` for a unit in another slice).
    pub unit: Option<String>,
    /// cgroup v2 path prefix, e.g. `/system.slice/vllm.service`.
    pub cgroup: Option<String>,
}

impl Matcher {
    pub fn is_empty(&self) -> bool {
        self.cmdline.is_none()
            && self.comm.is_none()
            && self.user.is_none()
            && self.unit.is_none()
            && self.cgroup.is_none()
    }

    pub fn matches(&self, comm: &str, uid: u32, cmdline: &str, cgroup: &str) -> bool {
        !self.is_empty()
            && self.comm.as_deref().is_none_or(|p| comm_matches(p, comm))
            && self.user.as_ref().is_none_or(|u| u.uid == uid)
            && self
                .unit
                .as_deref()
                .is_none_or(|u| cgroup_has_prefix(cgroup, &unit_cgroup(u)))
            && self
                .cgroup
                .as_deref()
                .is_none_or(|prefix| cgroup_has_prefix(cgroup, prefix))
            && self
                .cmdline
                .as_ref()
                .is_none_or(|re| re.0.is_match(cmdline))
    }
}

/// The cgroup of a systemd unit: `vllm.service` lives at `/system.slice/vllm.service`; a unit in
/// another slice is written with it (`ml.slice/vllm.service`). Only the unit's own cgroup and its
/// children match: a user's `…/user@1001.service/app.slice/vllm.service` does not.
fn unit_cgroup(unit: &str) -> String {
    let unit = unit.trim_matches('/');
    if unit.contains('/') {
        format!("/{unit}")
    } else {
        format!("/system.slice/{unit}")
    }
}

fn cgroup_has_prefix(cgroup: &str, prefix: &str) -> bool {
    let prefix = prefix.trim_end_matches('/');
    cgroup == prefix
        || cgroup
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('/'))
}

/// A compiled regex from the config.
#[derive(Clone, Debug)]
pub struct Pattern(pub Regex);

impl<'de> Deserialize<'de> for Pattern {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Regex::new(&text)
            .map(Pattern)
            .map_err(|e| serde::de::Error::custom(format!("'{text}' is not a valid regex: {e}")))
    }
}

/// A user given by name or numeric uid, resolved when the config is loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
}

impl<'de> Deserialize<'de> for User {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        if let Ok(uid) = name.parse::<u32>() {
            return Ok(User { name, uid });
        }
        match nix::unistd::User::from_name(&name) {
            Ok(Some(user)) => Ok(User {
                name,
                uid: user.uid.as_raw(),
            }),
            _ => Err(serde::de::Error::custom(format!(
                "'{name}' is not a known user"
            ))),
        }
    }
}

impl Config {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: path.to_path_buf(),
            key: String::new(),
            message: format!("cannot read: {e}"),
        })?;
        Config::parse(&text, path)
    }

    /// Parses and validates config text; `file` is only used in error messages.
    pub fn parse(text: &str, file: &Path) -> Result<Config, ConfigError> {
        let error = |key: String, message: String| ConfigError {
            file: file.to_path_buf(),
            key,
            message,
        };
        let deserializer = toml::Deserializer::parse(text).map_err(|e| {
            error(
                String::new(),
                format!("TOML syntax error: {}", describe(&e, text)),
            )
        })?;
        let config: Config = serde_path_to_error::deserialize(deserializer).map_err(|e| {
            let key = name_models_in_path(&e.path().to_string(), text);
            error(key, describe(e.inner(), text))
        })?;
        config
            .validate()
            .map_err(|(key, message)| error(key, message))?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), (String, String)> {
        let d = &self.daemon;
        if d.min_interval.is_zero() || d.min_interval > d.interval {
            return Err((
                "daemon.min_interval".into(),
                format!(
                    "'{}' must be above 0 and at most daemon.interval ('{}')",
                    humantime::format_duration(d.min_interval),
                    humantime::format_duration(d.interval)
                ),
            ));
        }
        if self.launch.max_loading == 0 {
            return Err((
                "launch.max_loading".into(),
                "'0' would never let a model load; use 1 or more".into(),
            ));
        }
        if d.interval > Duration::from_secs(60) {
            return Err(("daemon.interval".into(), "must be at most 60s".into()));
        }
        self.validate_floors()?;
        self.validate_paths()?;
        for (key, max, window) in [
            ("ram", self.ram.max_victims, self.ram.victim_window),
            ("gpu", self.gpu.max_victims, self.gpu.victim_window),
        ] {
            if max > 0 && window.is_zero() {
                return Err((
                    format!("{key}.victim_window"),
                    "'0s' would never hold the brake; give a duration such as \"5m\" (or max_victims = 0 to turn the brake off)".into(),
                ));
            }
        }
        if let Some(psi) = self.ram.psi_some_avg10 {
            if !(0.0..=100.0).contains(&psi) {
                return Err((
                    "ram.psi_some_avg10".into(),
                    format!("'{psi}' must be a percentage (0-100)"),
                ));
            }
        }
        let listen = self.metrics.listen.trim();
        if !listen.is_empty() && listen.parse::<std::net::SocketAddr>().is_err() {
            return Err((
                "metrics.listen".into(),
                format!("'{listen}' is not an address:port such as \"127.0.0.1:9835\""),
            ));
        }
        let a = &self.alert;
        if a.queue == 0 {
            return Err(("alert.queue".into(), "'0' would drop every alert".into()));
        }
        if a.repeat_interval.is_zero() {
            return Err((
                "alert.repeat_interval".into(),
                "must be above 0 (it would repeat every tick)".into(),
            ));
        }
        if !matches!(a.event_log_max_size, Amount::Bytes(b) if b >= 4096) {
            return Err((
                "alert.event_log_max_size".into(),
                format!("'{}' must be a size of at least 4KiB", a.event_log_max_size),
            ));
        }
        for (i, w) in a.webhooks.iter().enumerate() {
            let url = w.url.trim();
            if !(url.starts_with("http://") || url.starts_with("https://")) || url.len() < 10 {
                return Err((
                    format!("alert.webhook[{i}].url"),
                    format!("'{}' is not an http:// or https:// URL", w.redacted_url()),
                ));
            }
        }
        let mut names = HashSet::new();
        for (i, m) in self.models.iter().enumerate() {
            let key = format!("model[{i}] '{}'", m.name);
            if m.name.trim().is_empty() {
                return Err((format!("model[{i}].name"), "must not be empty".into()));
            }
            if m.name.starts_with('(') {
                return Err((
                    format!("{key}.name"),
                    "must not start with '(' (reserved for the daemon's own labels such as '(host)')"
                        .into(),
                ));
            }
            if !names.insert(m.name.as_str()) {
                return Err((
                    format!("{key}.name"),
                    format!("'{}' is used by another [[model]]", m.name),
                ));
            }
            if let Some(url) = &m.metrics_url {
                check_metrics_url(url).map_err(|e| (format!("{key}.metrics_url"), e))?;
            }
            if m.action != ModelAction::Alert && m.ram.is_none() && m.gpu_memory.is_none() {
                return Err((
                    format!("{key}.action"),
                    format!("'{}' needs a budget: set ram or gpu_memory", m.action),
                ));
            }
        }
        Ok(())
    }

    /// What is allowed but probably not meant: said by `check-config` and at start.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(address) = self.metrics.address() {
            if !address.ip().is_loopback() {
                out.push(format!(
                    "metrics.listen '{address}' is not a loopback address: anyone who can reach \
                     it reads the host's memory, models and process names"
                ));
            }
        }
        out
    }

    /// The model config with this name.
    pub fn model(&self, name: &str) -> Option<&ModelConfig> {
        self.models.iter().find(|m| m.name == name)
    }

    /// Floors wrong on any host: a share of 100 % (always crossed: every candidate a victim),
    /// a warn floor below its act floor (same units), a per-GPU override naming no GPU.
    fn validate_floors(&self) -> Result<(), (String, String)> {
        let (ram, gpu) = (&self.ram, &self.gpu);
        let mut floors = vec![
            ("ram.warn_available".to_string(), ram.warn_available),
            ("ram.min_available".to_string(), ram.min_available),
            ("ram.min_swap_free".to_string(), ram.min_swap_free),
            ("gpu.warn_free".to_string(), gpu.warn_free),
            ("gpu.min_free".to_string(), gpu.min_free),
        ];
        for (i, o) in gpu.devices.iter().enumerate() {
            let key = format!("gpu.device[{i}] '{}'", o.gpu);
            floors.push((format!("{key}.warn_free"), o.warn_free));
            floors.push((format!("{key}.min_free"), o.min_free));
        }
        for (key, floor) in floors {
            if let Some(Amount::Percent(p)) =
                floor.filter(|f| matches!(f, Amount::Percent(p) if *p >= 100.0))
            {
                return Err((
                    key,
                    format!("'{p}%' is the whole memory: it would always be crossed (use less than 100%)"),
                ));
            }
        }
        check_floor_order(
            "ram.warn_available",
            ram.warn_available,
            "ram.min_available",
            ram.min_available,
        )?;
        check_floor_order("gpu.warn_free", gpu.warn_free, "gpu.min_free", gpu.min_free)?;
        let mut ids = HashSet::new();
        for (i, o) in gpu.devices.iter().enumerate() {
            let key = format!("gpu.device[{i}] '{}'", o.gpu);
            if !is_gpu_id(&o.gpu) {
                return Err((
                    format!("gpu.device[{i}].gpu"),
                    format!(
                        "'{}' is not a GPU: use its index (\"0\") or its uuid (\"GPU-…\", see nvidia-smi -L)",
                        o.gpu
                    ),
                ));
            }
            if !ids.insert(o.gpu.as_str()) {
                return Err((
                    format!("{key}.gpu"),
                    format!("'{}' has another [[gpu.device]] already", o.gpu),
                ));
            }
            let (warn, min) = gpu.floors_for_id(&o.gpu);
            check_floor_order(
                &format!("{key}.warn_free"),
                warn,
                &format!("{key}.min_free"),
                min,
            )?;
        }
        Ok(())
    }

    /// Paths that must name something: the state directory and the socket (absolute, since the
    /// daemon's working directory is not the config's), the NVML library and secret files if set.
    fn validate_paths(&self) -> Result<(), (String, String)> {
        let mut paths = vec![
            (
                "daemon.state_dir".to_string(),
                Some(&self.daemon.state_dir),
                true,
            ),
            ("launch.socket".to_string(), Some(&self.launch.socket), true),
            (
                "gpu.nvml_library".to_string(),
                self.gpu.nvml_library.as_ref(),
                false,
            ),
        ];
        for (i, w) in self.alert.webhooks.iter().enumerate() {
            paths.push((
                format!("alert.webhook[{i}].secret_file"),
                w.secret_file.as_ref(),
                false,
            ));
        }
        for (key, path, absolute) in paths {
            let Some(path) = path else { continue };
            let text = path.to_string_lossy();
            if text.trim().is_empty() {
                return Err((key, "must not be empty".into()));
            }
            if absolute && !path.is_absolute() {
                return Err((key, format!("'{text}' must be an absolute path")));
            }
        }
        Ok(())
    }

    /// Floors that cannot be right on this host, resolved against its totals: an act floor at or
    /// above the total (every process would be a victim, always), or a warn floor below the act
    /// floor once both are in bytes (`"1%"` against `"20GiB"`). GPU floors are checked per GPU
    /// with that GPU's own total and overrides. The daemon refuses such a config at start and on
    /// reload; `check-config` cannot know the host and checks only what is wrong anywhere.
    pub fn check_host(&self, host: &HostTotals, file: &Path) -> Result<(), ConfigError> {
        self.host_problem(host).map_or(Ok(()), |(key, message)| {
            Err(ConfigError {
                file: file.to_path_buf(),
                key,
                message,
            })
        })
    }

    fn host_problem(&self, host: &HostTotals) -> Option<(String, String)> {
        let ram = &self.ram;
        let what = "this host's MemTotal";
        let (warn, min) = ram.floor_bytes(host.ram_bytes);
        let floors = FloorPair {
            warn: Floor::new("ram.warn_available", ram.warn_available, warn),
            min: Floor::new("ram.min_available", ram.min_available, min),
        };
        if let Some(p) = floors.problem(host.ram_bytes, what) {
            return Some(p);
        }
        if let (Some(floor), Some(total)) = (ram.min_swap_free, host.swap_bytes.filter(|&t| t > 0))
        {
            let bytes = floor.resolve(Some(total)).unwrap_or(0);
            if bytes >= total {
                return Some((
                    "ram.min_swap_free".into(),
                    at_or_above(floor, bytes, total, "this host's SwapTotal"),
                ));
            }
        }
        for g in &host.gpus {
            let (warn_amount, min_amount) = self.gpu.floors_for(g.index, &g.uuid);
            let (warn, min) = self.gpu.floor_bytes(g.index, &g.uuid, g.total_bytes);
            let key = |field: &str| match self.gpu.override_index(g.index, &g.uuid) {
                Some(i) if self.gpu.devices[i].has(field) => {
                    format!("gpu.device[{i}] '{}'.{field}", self.gpu.devices[i].gpu)
                }
                _ => format!("gpu.{field}"),
            };
            let what = format!("GPU {}'s total", g.index);
            let floors = FloorPair {
                warn: Floor::new(&key("warn_free"), warn_amount, warn),
                min: Floor::new(&key("min_free"), min_amount, min),
            };
            if let Some(p) = floors.problem(g.total_bytes, &what) {
                return Some(p);
            }
        }
        None
    }
}

/// The totals a config's floors are resolved against.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HostTotals {
    pub ram_bytes: Option<u64>,
    pub swap_bytes: Option<u64>,
    pub gpus: Vec<GpuTotal>,
}

/// One GPU as seen by NVML, for `Config::check_host`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuTotal {
    pub index: u32,
    pub uuid: String,
    pub total_bytes: Option<u64>,
}

/// One floor: its key, its value as written and resolved to bytes on this host.
struct Floor {
    key: String,
    amount: Option<Amount>,
    bytes: Option<u64>,
}

impl Floor {
    fn new(key: &str, amount: Option<Amount>, bytes: Option<u64>) -> Floor {
        Floor {
            key: key.to_string(),
            amount,
            bytes,
        }
    }
}

/// A resource's warn and act floors.
struct FloorPair {
    warn: Floor,
    min: Floor,
}

impl FloorPair {
    /// The act floor at or above `total` (what names it), or the warn floor below the act
    /// floor, in bytes: (key, message).
    fn problem(&self, total: Option<u64>, what: &str) -> Option<(String, String)> {
        let (warn, min) = (&self.warn, &self.min);
        if let (Some(amount), Some(bytes), Some(total)) = (min.amount, min.bytes, total) {
            if bytes >= total {
                return Some((min.key.clone(), at_or_above(amount, bytes, total, what)));
            }
        }
        match (warn.amount, warn.bytes, min.amount, min.bytes) {
            (Some(w), Some(wb), Some(m), Some(mb)) if wb < mb => Some((
                warn.key.clone(),
                format!(
                    "'{w}' ({} here) is below {} '{m}' ({} here): the act floor would be crossed before the warning",
                    fmt_bytes(wb),
                    min.key,
                    fmt_bytes(mb)
                ),
            )),
            _ => None,
        }
    }
}

fn at_or_above(amount: Amount, bytes: u64, total: u64, what: &str) -> String {
    format!(
        "'{amount}' ({}) is at or above {what} ({}): every process would be a victim, always",
        fmt_bytes(bytes),
        fmt_bytes(total)
    )
}

/// A GPU as `[[gpu.device]] gpu` names it: its index, or its uuid (`GPU-` and hex digits).
fn is_gpu_id(id: &str) -> bool {
    let index = !id.is_empty() && id.len() <= 4 && id.bytes().all(|b| b.is_ascii_digit());
    let uuid = id.strip_prefix("GPU-").is_some_and(|rest| {
        rest.bytes().any(|b| b.is_ascii_hexdigit())
            && rest.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
    });
    index || uuid
}

/// A warn floor must lie above its act floor (when both are of the same kind).
fn check_floor_order(
    warn_key: &str,
    warn: Option<Amount>,
    min_key: &str,
    min: Option<Amount>,
) -> Result<(), (String, String)> {
    let below = match (warn, min) {
        (Some(Amount::Bytes(w)), Some(Amount::Bytes(m))) => w < m,
        (Some(Amount::Percent(w)), Some(Amount::Percent(m))) => w < m,
        _ => false,
    };
    if below {
        return Err((
            warn_key.into(),
            format!(
                "'{}' is below {min_key} ('{}')",
                warn.unwrap(),
                min.unwrap()
            ),
        ));
    }
    Ok(())
}

/// serde_path_to_error says `model[1].ram`; operators know models by name: `model[1] 'qwen'.ram`.
fn name_models_in_path(path: &str, text: &str) -> String {
    let Some(rest) = path.strip_prefix("model[") else {
        return path.to_string();
    };
    let Some((index, tail)) = rest.split_once(']') else {
        return path.to_string();
    };
    let name = toml::from_str::<toml::Table>(text).ok().and_then(|t| {
        let i: usize = index.parse().ok()?;
        t.get("model")?
            .as_array()?
            .get(i)?
            .get("name")?
            .as_str()
            .map(str::to_string)
    });
    match name {
        Some(name) => format!("model[{index}] '{name}'{tail}"),
        None => path.to_string(),
    }
}

/// A toml error on one line (its Display spans several, with a caret under the value).
fn describe(e: &toml::de::Error, text: &str) -> String {
    let message = e.message().trim().replace('\n', " ");
    match e.span() {
        Some(span) => format!(
            "{message} (line {})",
            text[..span.start.min(text.len())].matches('\n').count() + 1
        ),
        None => message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, String> {
        Config::parse(text, Path::new("/etc/gpuguard/config.toml")).map_err(|e| e.to_string())
    }

    #[test]
    fn empty_config_has_safe_defaults() {
        let c = parse("").unwrap();
        assert_eq!(c.daemon.mode, Mode::Enforce);
        assert_eq!(c.ram.min_available, Some(Amount::Percent(5.0)));
        assert!(c
            .protect
            .protects("sshd", 0, "/usr/sbin/sshd -D", "/system.slice/ssh.service"));
        assert!(c.protect.protects("nvidia-persiste", 0, "", "/"));
        assert!(c.protect.protects("systemd-journal", 0, "", "/"));
        assert!(!c.protect.protects("python3", 1000, "python3 -m vllm", "/"));
        // A user's process that calls itself sshd is not protected (issue #11).
        assert!(!c
            .protect
            .protects("sshd", 1001, "/usr/sbin/sshd -D", "/user.slice"));
    }

    #[test]
    fn errors_name_file_key_and_value() {
        let cases = [
            (
                "[ram]\nmin_available = \"12X\"\n",
                "ram.min_available: '12X' is not a size",
            ),
            (
                "[ram]\nmin_availble = \"1GiB\"\n",
                "unknown field `min_availble`",
            ),
            (
                "[daemon]\ninterval = \"soon\"\n",
                "daemon.interval: 'soon' is not a duration",
            ),
            (
                "[daemon]\nmode = \"yolo\"\n",
                "daemon.mode: unknown variant `yolo`",
            ),
            (
                "[[model]]\nname = \"qwen\"\ngpu_memory = \"12X\"\n",
                "model[0] 'qwen'.gpu_memory: '12X' is not a size",
            ),
            (
                "[[model]]\nname = \"a\"\nmatch = { cmdline = \"(\" }\n",
                "model[0] 'a'.match.cmdline: '(' is not a valid regex",
            ),
            (
                "[ram]\nwarn_available = \"1GiB\"\nmin_available = \"2GiB\"\n",
                "ram.warn_available: '1.0 GiB' is below",
            ),
            (
                "[[model]]\nname = \"a\"\naction = \"kill\"\n",
                "model[0] 'a'.action: 'kill' needs a budget",
            ),
            (
                "[[model]]\nname = \"a\"\n[[model]]\nname = \"a\"\n",
                "model[1] 'a'.name: 'a' is used by another",
            ),
            (
                "[[model]]\nname = \"(host)\"\n",
                "model[0] '(host)'.name: must not start with '('",
            ),
            ("[ram\n", "TOML syntax error"),
            (
                "[ram]\nmin_available = \"100%\"\n",
                "ram.min_available: '100%' is the whole memory",
            ),
            (
                "[gpu]\nwarn_free = \"100%\"\n",
                "gpu.warn_free: '100%' is the whole memory",
            ),
            (
                "[ram]\nvictim_window = \"0s\"\n",
                "ram.victim_window: '0s' would never hold the brake",
            ),
            (
                "[gpu]\nvictim_window = \"0s\"\n",
                "gpu.victim_window: '0s'",
            ),
            (
                "[ram]\nmax_victims = -1\n",
                "ram.max_victims",
            ),
            (
                "[ram]\nmin_swap_free = \"100%\"\n",
                "ram.min_swap_free: '100%'",
            ),
            (
                "[[gpu.device]]\ngpu = \"banana\"\nmin_free = \"1GiB\"\n",
                "gpu.device[0].gpu: 'banana' is not a GPU",
            ),
            (
                "[[gpu.device]]\ngpu = \"GPU-\"\n",
                "gpu.device[0].gpu: 'GPU-' is not a GPU",
            ),
            (
                "[[gpu.device]]\ngpu = \"1\"\n[[gpu.device]]\ngpu = \"1\"\n",
                "gpu.device[1] '1'.gpu: '1' has another [[gpu.device]]",
            ),
            (
                "[[gpu.device]]\ngpu = \"1\"\nmin_free = \"50%\"\n[[gpu.device]]\ngpu = \"0\"\n",
                "",
            ),
            (
                "[gpu]\nwarn_free = \"40%\"\n[[gpu.device]]\ngpu = \"0\"\nmin_free = \"1GiB\"\n[[gpu.device]]\ngpu = \"1\"\nmin_free = \"50%\"\n",
                "gpu.device[1] '1'.warn_free: '40%' is below gpu.device[1] '1'.min_free ('50%')",
            ),
            ("[daemon]\nstate_dir = \"\"\n", "daemon.state_dir: must not be empty"),
            ("[launch]\nsocket = \" \"\n", "launch.socket: must not be empty"),
            (
                "[launch]\nsocket = \"gpuguard.sock\"\n",
                "launch.socket: 'gpuguard.sock' must be an absolute path",
            ),
            ("[gpu]\nnvml_library = \"\"\n", "gpu.nvml_library: must not be empty"),
            (
                "[[model]]\nname = \"v\"\nmetrics_url = \"http://10.0.0.5:8000/metrics\"\n",
                "model[0] 'v'.metrics_url: 'http://10.0.0.5:8000/metrics' must be on a loopback address",
            ),
            (
                "[[model]]\nname = \"v\"\nmetrics_url = \"https://127.0.0.1/metrics\"\n",
                "model[0] 'v'.metrics_url: 'https://127.0.0.1/metrics' must be an http:// URL",
            ),
            (
                "[[model]]\nname = \"v\"\nmetrics_url = \"http://u:p@127.0.0.1/metrics\"\n",
                "must not hold credentials",
            ),
        ];
        for (text, want) in cases {
            if want.is_empty() {
                assert!(parse(text).is_ok(), "{text:?}: {:?}", parse(text).err());
                continue;
            }
            let err = parse(text).unwrap_err();
            assert!(
                err.starts_with("config /etc/gpuguard/config.toml: "),
                "{err}"
            );
            assert!(err.contains(want), "{text:?}: got {err:?}, want {want:?}");
            assert!(!err.contains('\n'), "one line: {err:?}");
        }
    }

    #[test]
    fn floors_impossible_on_this_host_are_refused_after_resolving() {
        let gib = 1u64 << 30;
        let gpu = |index: u32, uuid: &str, total: u64| GpuTotal {
            index,
            uuid: uuid.into(),
            total_bytes: Some(total),
        };
        let host = HostTotals {
            ram_bytes: Some(64 * gib),
            swap_bytes: Some(0),
            gpus: vec![gpu(0, "GPU-aa", 16 * gib), gpu(1, "GPU-bb", 80 * gib)],
        };
        let cases = [
            ("", ""),
            (
                "[ram]\nmin_available = \"64GiB\"\n",
                "ram.min_available: '64.0 GiB' (64.0 GiB) is at or above this host's MemTotal (64.0 GiB)",
            ),
            // Mixed units: 1 % of 64 GiB is below 20 GiB.
            (
                "[ram]\nwarn_available = \"1%\"\nmin_available = \"20GiB\"\n",
                "ram.warn_available: '1%' (655.4 MiB here) is below ram.min_available '20.0 GiB' (20.0 GiB here)",
            ),
            ("[ram]\nwarn_available = \"50%\"\nmin_available = \"20GiB\"\n", ""),
            // No swap here: a swap floor has nothing to act on and is not refused.
            ("[ram]\nmin_swap_free = \"1TiB\"\n", ""),
            (
                "[gpu]\nmin_free = \"20GiB\"\n",
                "gpu.min_free: '20.0 GiB' (20.0 GiB) is at or above GPU 0's total (16.0 GiB)",
            ),
            // Per GPU, with each GPU's own total: 20 GiB fits GPU 1 (80 GiB), not GPU 0 (16 GiB).
            ("[[gpu.device]]\ngpu = \"1\"\nmin_free = \"20GiB\"\n", ""),
            (
                "[[gpu.device]]\ngpu = \"GPU-aa\"\nmin_free = \"20GiB\"\n",
                "gpu.device[0] 'GPU-aa'.min_free: '20.0 GiB' (20.0 GiB) is at or above GPU 0's total",
            ),
            (
                "[gpu]\nwarn_free = \"10%\"\n[[gpu.device]]\ngpu = \"1\"\nmin_free = \"10GiB\"\n",
                "gpu.warn_free: '10%' (8.0 GiB here) is below gpu.device[0] '1'.min_free '10.0 GiB'",
            ),
        ];
        for (text, want) in cases {
            let c = parse(text).unwrap();
            let got = c
                .check_host(&host, Path::new("/etc/gpuguard/config.toml"))
                .map_err(|e| e.to_string());
            match (want, got) {
                ("", Ok(())) => {}
                ("", Err(e)) => panic!("{text:?}: refused: {e}"),
                (want, Ok(())) => panic!("{text:?}: accepted, want {want:?}"),
                (want, Err(e)) => assert!(
                    e.starts_with("config /etc/gpuguard/config.toml: ") && e.contains(want),
                    "{text:?}: got {e:?}, want {want:?}"
                ),
            }
        }
        // With swap: a swap floor at or above SwapTotal is refused.
        let swap = HostTotals {
            swap_bytes: Some(4 * gib),
            ..host
        };
        let e = parse("[ram]\nmin_swap_free = \"4GiB\"\n")
            .unwrap()
            .check_host(&swap, Path::new("c.toml"))
            .unwrap_err();
        assert!(e.to_string().contains("ram.min_swap_free"), "{e}");
    }

    #[test]
    fn matcher_requires_every_given_key() {
        let c = parse(
            "[[model]]\nname = \"vllm\"\nmatch = { cmdline = \"vllm serve\", unit = \"vllm.service\" }\n",
        )
        .unwrap();
        let m = &c.models[0].matcher;
        assert!(m.matches(
            "python3",
            0,
            "python3 -m vllm serve x",
            "/system.slice/vllm.service"
        ));
        assert!(!m.matches("python3", 0, "python3 -m vllm serve x", "/user.slice"));
        assert!(!Matcher::default().matches("x", 0, "x", "/"));
    }

    #[test]
    fn metrics_urls_on_loopback_are_accepted() {
        for url in [
            "http://127.0.0.1:8000/metrics",
            "http://localhost:8000/metrics",
            "http://[::1]:8000/metrics",
            "http://127.0.0.2/metrics",
        ] {
            assert_eq!(check_metrics_url(url), Ok(()), "{url}");
        }
        for url in [
            "http://example.com/metrics",
            "file:///etc/shadow",
            "127.0.0.1:8000",
            "",
        ] {
            assert!(check_metrics_url(url).is_err(), "{url}");
        }
    }

    #[test]
    fn ready_urls_must_be_on_this_host() {
        for url in [
            "http://127.0.0.1:8000/health",
            "https://localhost:8443/health",
            "http://[::1]:8000/health",
        ] {
            assert_eq!(check_ready_url(url), Ok(()), "{url}");
        }
        if let Some(ip) = local_addresses().into_iter().find(|ip| !ip.is_loopback()) {
            let url = match ip {
                std::net::IpAddr::V4(v4) => format!("http://{v4}:8000/health"),
                std::net::IpAddr::V6(v6) => format!("http://[{v6}]:8000/health"),
            };
            assert_eq!(check_ready_url(&url), Ok(()), "{url}");
        }
        for url in [
            "http://192.0.2.7/health",
            "http://169.254.169.254/computeMetadata/v1/",
            "http://metadata.google.internal/",
            "http://user@127.0.0.1/",
            "ftp://127.0.0.1/",
        ] {
            assert!(check_ready_url(url).is_err(), "{url}");
        }
    }

    #[test]
    fn comm_patterns() {
        assert!(comm_matches("systemd*", "systemd-logind"));
        assert!(comm_matches("nvidia-persistenced", "nvidia-persiste"));
        assert!(!comm_matches("sshd", "sshd2"));
    }

    #[test]
    fn gpu_overrides_by_index_or_uuid() {
        let c = parse(
            "[gpu]\nmin_free = \"1GiB\"\n[[gpu.device]]\ngpu = \"1\"\nmin_free = \"2GiB\"\n[[gpu.device]]\ngpu = \"GPU-abc\"\nwarn_free = \"8GiB\"\n",
        )
        .unwrap();
        assert_eq!(c.gpu.floors_for(0, "GPU-x").1, Some(Amount::Bytes(1 << 30)));
        assert_eq!(c.gpu.floors_for(1, "GPU-y").1, Some(Amount::Bytes(2 << 30)));
        assert_eq!(
            c.gpu.floors_for(2, "GPU-abc"),
            (Some(Amount::Bytes(8 << 30)), Some(Amount::Bytes(1 << 30)))
        );
    }
}
