//! The config's sections other than the models: `[daemon]`, `[ram]`, `[gpu]` and per-GPU
//! overrides, `[launch]`, `[clients]`, `[permits]`, `[metrics]`, `[alert]` and its webhooks.

use super::*;

/// `[clients]`: what the users of the socket may hold at once. Every cap bounds the daemon's
/// memory and file descriptors whatever local users do.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClientsConfig {
    /// Socket connections at once, all users together; beyond it new ones are closed at once.
    /// Accounts other than root share it less root's share (`max_connections_per_uid`).
    pub max_connections: usize,
    /// Socket connections at once per uid (root included).
    pub max_connections_per_uid: usize,
    /// Launches per uid, waiting in the queue or loading.
    pub max_launches_per_uid: usize,
    /// Launched models per uid whose process still runs (each lease keeps a pidfd).
    pub max_leases_per_uid: usize,
    /// Launched models whose process still runs, all users together.
    pub max_leases: usize,
    /// A connection that holds and waits for nothing this long is closed, whatever it sends.
    #[serde(with = "duration")]
    pub idle_timeout: Duration,
    /// What one uid may hold reserved at once (loading launches and permits): a size or a share
    /// of all GPU memory (and, separately, of RAM); half by default. Root is not capped, nor a
    /// `[[model]]`'s users for that model ("100%" turns the cap off).
    pub max_reserved_per_uid: Option<Amount>,
    /// What all accounts other than root may hold reserved at once, together, of what their
    /// processes have not taken yet (loading launches, permits their processes did not grow
    /// into): a size or a share, as `max_reserved_per_uid`; half by default, the rest stays for
    /// root. Root is not capped, nor a `[[model]]`'s users for that model.
    pub max_reserved: Option<Amount>,
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
            max_reserved_per_uid: Some(Amount::Percent(50.0)),
            max_reserved: Some(Amount::Percent(50.0)),
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
    /// Permits held plus requests waiting, all users together; accounts other than root share
    /// it less root's share (`max_per_uid`).
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
    /// A `[[model]]` that takes in more processes than this (what its match catches and their
    /// descendants) is warned about by `check-config` and at start: a match that loose
    /// (`user = "root"`, `cmdline = "python"`) takes in shells, builds and other people's jobs.
    pub warn_model_processes: usize,
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
            warn_model_processes: 64,
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
    pub(super) fn floors_for_id(&self, id: &str) -> (Option<Amount>, Option<Amount>) {
        self.with_override(self.devices.iter().position(|d| d.gpu == id))
    }

    /// The `[[gpu.device]]` that applies to a GPU, by index or uuid (an empty uuid matches none).
    pub(super) fn override_index(&self, index: u32, uuid: &str) -> Option<usize> {
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
    pub(super) fn has(&self, field: &str) -> bool {
        match field {
            "warn_free" => self.warn_free.is_some(),
            _ => self.min_free.is_some(),
        }
    }
}

/// `[history]`: the flight recorder (`src/history`), on by default.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HistoryConfig {
    pub enabled: bool,
    /// The most the history directory holds; the oldest records go first.
    pub max_size: Amount,
    /// Records older than this go.
    #[serde(with = "duration")]
    pub retention: Duration,
    /// How often a sample is kept while every floor reads ok (near a floor: every second, and at
    /// the act floor every sample).
    #[serde(with = "duration")]
    pub interval: Duration,
    /// Critical events and kills to the kernel log too (`/dev/kmsg`): "auto" on Google Compute
    /// Engine only (its serial console keeps them outside the VM), "on", "off".
    pub kernel_log: OnGce,
}

/// A feature for Google Compute Engine (`[history] kernel_log`, `[gce] watch`): "auto" turns it
/// on there only (told by the DMI product name), "on", "off".
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum OnGce {
    #[default]
    Auto,
    On,
    Off,
}

impl Default for HistoryConfig {
    fn default() -> Self {
        HistoryConfig {
            enabled: true,
            max_size: Amount::Bytes(64 << 20),
            retention: Duration::from_secs(7 * 24 * 3600),
            interval: Duration::from_secs(10),
            kernel_log: OnGce::Auto,
        }
    }
}

impl HistoryConfig {
    /// `max_size` in bytes (validated to be a size).
    pub fn max_size_bytes(&self) -> u64 {
        match self.max_size {
            Amount::Bytes(b) => b,
            Amount::Percent(_) => 64 << 20,
        }
    }
}

/// `[gce]`: Google Compute Engine's maintenance and preemption notices (`sample::gce`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GceConfig {
    /// "auto" (on GCE only, told by the DMI product name), "on", "off".
    pub watch: OnGce,
    /// The metadata server's base URL (plain http: it is link-local on GCE).
    pub metadata_url: String,
    /// A command run (`/bin/sh -c`, as the daemon's user) once per notice, with
    /// `GPUGUARD_NOTICE` set to what was announced (e.g. to checkpoint a job). Empty: none.
    pub on_notice: String,
}

impl Default for GceConfig {
    fn default() -> Self {
        GceConfig {
            watch: OnGce::Auto,
            metadata_url: "http://metadata.google.internal/computeMetadata/v1".into(),
            on_notice: String::new(),
        }
    }
}
