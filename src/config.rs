//! The TOML config: what to watch, the floors, the models and their budgets, what never to touch.
//!
//! Loading is strict: unknown keys are errors (a mistyped floor must not be silently ignored) and
//! every error names the file, the key and the bad value.

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use regex::Regex;
use serde::{Deserialize, Deserializer};

use crate::policy::Severity;
use crate::units::{duration, Amount};

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

/// `observe` decides, logs and alerts, but never signals a process.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Enforce,
    Observe,
}

/// Which processes may be chosen as a victim when a floor is crossed.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
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
}

impl Default for LaunchConfig {
    fn default() -> Self {
        LaunchConfig {
            socket: PathBuf::from(crate::ipc::DEFAULT_SOCKET),
            max_loading: 1,
            settle: Duration::from_secs(10),
            ready_timeout: Duration::from_secs(600),
            queue_timeout: Duration::from_secs(1800),
        }
    }
}

/// What gpuguard does to the chosen victim when a floor is crossed.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
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
}

impl Default for RamConfig {
    fn default() -> Self {
        RamConfig {
            warn_available: Some(Amount::Percent(10.0)),
            min_available: Some(Amount::Percent(5.0)),
            min_swap_free: None,
            psi_some_avg10: None,
            action: FloorAction::Kill,
        }
    }
}

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
        let index = index.to_string();
        match self
            .devices
            .iter()
            .find(|d| d.gpu == index || d.gpu == uuid)
        {
            Some(o) => (o.warn_free.or(self.warn_free), o.min_free.or(self.min_free)),
            None => (self.warn_free, self.min_free),
        }
    }
}

/// Processes never to touch. `pid 1`, kernel threads and gpuguard itself are always protected.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProtectConfig {
    /// Include the built-in list (sshd, systemd*, cloud guest agents, nvidia-persistenced, ...).
    pub defaults: bool,
    /// More process names (`comm`); a trailing `*` matches a prefix.
    pub comm: Vec<String>,
    /// Regexes over the full command line.
    pub cmdline: Vec<Pattern>,
    /// Users whose processes are never touched.
    pub users: Vec<User>,
}

impl Default for ProtectConfig {
    fn default() -> Self {
        ProtectConfig {
            defaults: true,
            comm: Vec::new(),
            cmdline: Vec::new(),
            users: Vec::new(),
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
    /// True if a process with this name, uid and command line must never be touched.
    pub fn protects(&self, comm: &str, uid: u32, cmdline: &str) -> bool {
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
            || self.users.iter().any(|u| u.uid == uid)
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
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
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
}

impl ModelConfig {
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
    /// systemd unit, e.g. `vllm.service`: matches processes in that unit's cgroup.
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
                .is_none_or(|u| cgroup.split('/').any(|part| part == u))
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
        check_floor_order(
            "ram.warn_available",
            self.ram.warn_available,
            "ram.min_available",
            self.ram.min_available,
        )?;
        check_floor_order(
            "gpu.warn_free",
            self.gpu.warn_free,
            "gpu.min_free",
            self.gpu.min_free,
        )?;
        for (i, o) in self.gpu.devices.iter().enumerate() {
            let (warn, min) = self.gpu.floors_for(0, &o.gpu);
            let key = format!("gpu.device[{i}] '{}'", o.gpu);
            check_floor_order(
                &format!("{key}.warn_free"),
                warn,
                &format!("{key}.min_free"),
                min,
            )?;
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
            if !names.insert(m.name.as_str()) {
                return Err((
                    format!("{key}.name"),
                    format!("'{}' is used by another [[model]]", m.name),
                ));
            }
            if m.action != ModelAction::Alert && m.ram.is_none() && m.gpu_memory.is_none() {
                return Err((
                    format!("{key}.action"),
                    format!("'{:?}' needs a budget: set ram or gpu_memory", m.action)
                        .to_lowercase(),
                ));
            }
        }
        Ok(())
    }

    /// The model config with this name.
    pub fn model(&self, name: &str) -> Option<&ModelConfig> {
        self.models.iter().find(|m| m.name == name)
    }
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
        assert!(c.protect.protects("sshd", 0, "/usr/sbin/sshd -D"));
        assert!(c.protect.protects("nvidia-persiste", 0, ""));
        assert!(c.protect.protects("systemd-journal", 0, ""));
        assert!(!c.protect.protects("python3", 1000, "python3 -m vllm"));
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
            ("[ram\n", "TOML syntax error"),
        ];
        for (text, want) in cases {
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
