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

mod models;
mod sections;

pub use models::*;
pub use sections::*;

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
    #[serde(default)]
    pub history: HistoryConfig,
    #[serde(default)]
    pub gce: GceConfig,
}

/// What `gpuguard daemon` flags set over the config file (`--state-dir`, `--socket`,
/// `--observe`): applied at start and again at every reload, so a reload never undoes them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    pub state_dir: Option<PathBuf>,
    pub socket: Option<PathBuf>,
    /// Observe whatever the file says: decide and log, never signal.
    pub observe: bool,
}

impl Overrides {
    pub fn apply(&self, config: &mut Config) {
        if let Some(dir) = &self.state_dir {
            config.daemon.state_dir = dir.clone();
        }
        if let Some(socket) = &self.socket {
            config.launch.socket = socket.clone();
        }
        if self.observe {
            config.daemon.mode = Mode::Observe;
        }
    }
}

impl Config {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = crate::host::facts()
            .read_config(path)
            .map_err(|e| ConfigError {
                file: path.to_path_buf(),
                key: String::new(),
                message: format!("cannot read: {e}"),
            })?;
        Config::parse(&text, path)
    }

    /// `load`, for a host other than this one (`check-config --portable`, packaging): users
    /// the config names need not exist here (they are resolved on the host that runs it).
    pub fn load_portable(path: &Path) -> Result<Config, ConfigError> {
        models::portable_users(|| Config::load(path))
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
                    crate::units::fmt_duration(d.min_interval),
                    crate::units::fmt_duration(d.interval)
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
        if d.warn_model_processes == 0 {
            return Err((
                "daemon.warn_model_processes".into(),
                "'0' would warn about every model that has a process; use 1 or more".into(),
            ));
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
        let h = &self.history;
        if !matches!(h.max_size, Amount::Bytes(b) if b >= 1 << 20) {
            return Err((
                "history.max_size".into(),
                format!("'{}' must be a size of at least 1MiB", h.max_size),
            ));
        }
        if h.interval.is_zero() || h.interval > Duration::from_secs(3600) {
            return Err((
                "history.interval".into(),
                format!(
                    "'{}' must be above 0 and at most 1h",
                    crate::units::fmt_duration(h.interval)
                ),
            ));
        }
        if h.retention < Duration::from_secs(60) {
            return Err((
                "history.retention".into(),
                format!(
                    "'{}' must be at least 1m",
                    crate::units::fmt_duration(h.retention)
                ),
            ));
        }
        let url = self.gce.metadata_url.trim();
        if !url.starts_with("http://") || url.len() < 10 {
            return Err((
                "gce.metadata_url".into(),
                format!("'{url}' is not an http:// URL (the metadata server speaks plain http)"),
            ));
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
            if let Some(n) = m.planned_kv_tokens {
                check_planned_kv_tokens(n).map_err(|e| (format!("{key}.planned_kv_tokens"), e))?;
            }
            if m.action != ModelAction::Alert && m.ram.is_none() && m.gpu_memory.is_none() {
                return Err((
                    format!("{key}.action"),
                    format!("'{}' needs a budget: set ram or gpu_memory", m.action),
                ));
            }
            // A budget of nothing is crossed by any process the model has: its action would
            // take every member the moment it starts.
            for (field, budget) in [("ram", m.ram), ("gpu_memory", m.gpu_memory)] {
                let zero = |a: &Amount| match *a {
                    Amount::Bytes(b) => b == 0,
                    Amount::Percent(p) => p <= 0.0,
                };
                if let Some(amount) = budget.filter(zero) {
                    if m.action != ModelAction::Alert {
                        return Err((
                            format!("{key}.{field}"),
                            format!(
                                "'{amount}' with action '{}' would act on the model as soon as \
                                 it has a process; give a budget above 0 (or action = \"alert\")",
                                m.action
                            ),
                        ));
                    }
                }
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
        assert!(c.protect.protects(
            "sshd",
            0,
            "/usr/sbin/sshd -D",
            "/system.slice/ssh.service",
            None
        ));
        assert!(c.protect.protects("nvidia-persiste", 0, "", "/", None));
        assert!(c.protect.protects("systemd-journal", 0, "", "/", None));
        assert!(!c
            .protect
            .protects("python3", 1000, "python3 -m vllm", "/", None));
        // A system account is trusted by its executable, not the name it gives itself.
        let exe = |name: &str, system| crate::snapshot::Exe {
            name: name.into(),
            system,
        };
        let sshd =
            |e: Option<&crate::snapshot::Exe>| c.protect.protects("sshd", 33, "sshd", "/", e);
        assert!(!sshd(None), "no executable read: not trusted");
        assert!(
            !sshd(Some(&exe("python3.11", true))),
            "a system python calling itself sshd"
        );
        assert!(
            !sshd(Some(&exe("sshd", false))),
            "a copy of sshd the account owns"
        );
        assert!(sshd(Some(&exe("sshd", true))));
        assert!(c.protect.protects(
            "nvidia-persiste",
            107,
            "",
            "/",
            Some(&exe("nvidia-persistenced", true))
        ));
        // A user's process that calls itself sshd is not protected (issue #11).
        assert!(!c
            .protect
            .protects("sshd", 1001, "/usr/sbin/sshd -D", "/user.slice", None));
        // Under the packaged unit no other account's executable can be read: a system
        // account's service is protected by the unit systemd runs it in, whatever its name;
        // the same account's process anywhere else is not.
        let in_cgroup =
            |comm: &str, uid, cgroup: &str| c.protect.protects(comm, uid, "", cgroup, None);
        assert!(in_cgroup("dbus-daemon", 102, "/system.slice/dbus.service"));
        assert!(in_cgroup(
            "systemd-resolve",
            991,
            "/system.slice/systemd-resolved.service"
        ));
        assert!(in_cgroup(
            "fluent-bit",
            998,
            "/system.slice/google-cloud-ops-agent-fluent-bit.service"
        ));
        assert!(!in_cgroup(
            "dbus-daemon",
            102,
            "/user.slice/user-102.slice/session-1.scope"
        ));
        assert!(!in_cgroup("python3", 33, "/system.slice/apache2.service"));
        assert!(!in_cgroup("sshd", 33, "/system.slice/ssh.service-fake"));
        let no_defaults = parse("[protect]\ndefaults = false\nunits = [\"ml-*\"]\n").unwrap();
        let protects = |cgroup: &str| no_defaults.protect.protects("x", 102, "", cgroup, None);
        assert!(!protects("/system.slice/dbus.service"));
        assert!(protects("/system.slice/ml-serve.service"));
        assert!(!protects("/system.slice/ml-"));
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
            // Issue 40: a budget of nothing with an action that acts.
            (
                "[[model]]\nname = \"qwen\"\nram = \"0\"\naction = \"kill\"\n",
                "model[0] 'qwen'.ram: '0 B' with action 'kill' would act on the model as soon as it has a process",
            ),
            (
                "[[model]]\nname = \"qwen\"\nram = \"8GiB\"\ngpu_memory = \"0%\"\naction = \"stop\"\n",
                "model[0] 'qwen'.gpu_memory: '0%' with action 'stop'",
            ),
            (
                "[[model]]\nname = \"a\"\n[[model]]\nname = \"b\"\ngpu_memory = \"0B\"\naction = \"throttle\"\n",
                "model[1] 'b'.gpu_memory: '0 B' with action 'throttle'",
            ),
            ("[[model]]\nname = \"a\"\nram = 0\naction = \"kill\"\n", "model[0] 'a'.ram: '0 B'"),
            // Alerting on any use is allowed.
            ("[[model]]\nname = \"a\"\nram = \"0\"\n", ""),
            ("[[model]]\nname = \"a\"\nram = \"1MiB\"\naction = \"kill\"\n", ""),
            (
                "[daemon]\nwarn_model_processes = 0\n",
                "daemon.warn_model_processes: '0' would warn about every model",
            ),
            ("[daemon]\nwarn_model_processes = -1\n", "daemon.warn_model_processes"),
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
            ("[launch]\nsocket = \"\"\n", "launch.socket: must not be empty"),
            (
                "[launch]\nsocket = \"gpuguard.sock\"\n",
                "launch.socket: 'gpuguard.sock' must be an absolute path",
            ),
            ("[gpu]\nnvml_library = \"\"\n", "gpu.nvml_library: must not be empty"),
            (
                "[[model]]\nname = \"v\"\nplanned_kv_tokens = 0\n",
                "model[0] 'v'.planned_kv_tokens: '0' must be between 1 and 2^40 tokens",
            ),
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
        crate::host::install_test_host();
        for url in [
            "http://10.1.2.3:8000/health",
            "http://[fd00::7]:8000/health",
        ] {
            assert_eq!(check_ready_url(url), Ok(()), "{url}");
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
