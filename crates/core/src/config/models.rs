//! What the config says of processes: `[protect]` (never touched), `[[model]]` (members,
//! budgets, users), and the URLs a model or a launch may name.

use super::*;
use crate::snapshot::Exe;

/// Processes never to touch. `pid 1`, kernel threads and gpuguard itself are always protected.
///
/// A process chooses its own name and command line (`prctl(PR_SET_NAME, "sshd")`), so the
/// `comm` and `cmdline` rules (the built-in list too) protect only processes of root and, by what
/// they are, of the system accounts (uid below 1000): a system account's process only when its
/// executable is a root-owned file nobody else may write, and for a name rule only when that
/// file's name matches the rule too (uid 33's python calling itself `sshd` is not sshd). A
/// user's hog named `sshd` is an ordinary candidate. What users cannot fake: their uid (`users`),
/// and the cgroup systemd put a service in (`units`, `cgroups`; with `defaults`, the built-in
/// units too: the kernel shows another account's executable only to a reader with
/// CAP_SYS_PTRACE, which the packaged unit lacks, so there a system account's service is known
/// by its unit alone).
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
    /// systemd units whose processes are never touched (`ssh.service`, `ml.slice/x.service`); a
    /// trailing `*` matches a prefix of the unit's name (`systemd-*`).
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

/// The built-in protected units: the services of the list above that run under system
/// accounts (dbus as `messagebus`, systemd's resolver and clock, chrony, NVIDIA's daemons, ...)
/// by the cgroup systemd runs them in, which no process can choose.
pub const DEFAULT_PROTECTED_UNITS: &[&str] = &[
    "ssh.service",
    "sshd.service",
    "dbus.service",
    "dbus-broker.service",
    "systemd-*",
    "polkit.service",
    "google-guest-agent.service",
    "google-osconfig-agent.service",
    "google-cloud-ops-agent*",
    "nvidia-persistenced.service",
    "nvidia-fabricmanager.service",
    "nvidia-dcgm.service",
    "chrony.service",
    "chronyd.service",
    "rsyslog.service",
    "containerd.service",
    "docker.service",
    "kubelet.service",
    "gpuguard.service",
];

impl ProtectConfig {
    /// True if a process with this name, uid, command line, cgroup and executable (read for
    /// system accounts) must never be touched.
    pub fn protects(
        &self,
        comm: &str,
        uid: u32,
        cmdline: &str,
        cgroup: &str,
        exe: Option<&Exe>,
    ) -> bool {
        let builtin_units = if self.defaults {
            DEFAULT_PROTECTED_UNITS
        } else {
            &[]
        };
        if self.users.iter().any(|u| u.uid == uid)
            || builtin_units
                .iter()
                .copied()
                .chain(self.units.iter().map(String::as_str))
                .any(|u| in_unit(cgroup, u))
            || self.cgroups.iter().any(|c| cgroup_has_prefix(cgroup, c))
        {
            return true;
        }
        // Names and command lines are the process's own choice: trusted from root, and from a
        // system account only with a system executable (whose name matches a name rule).
        let exe = match uid {
            0 => None,
            u if u < FIRST_USER_UID => match exe {
                Some(e) if e.system => Some(e),
                _ => return false,
            },
            _ => return false,
        };
        let exe_matches = |pattern: &str| {
            exe.is_none_or(|e| {
                let name: String = e.name.chars().take(15).collect();
                comm_matches(pattern, &name) || comm_matches(pattern, &e.name)
            })
        };
        let builtin = if self.defaults {
            DEFAULT_PROTECTED_COMM
        } else {
            &[]
        };
        builtin
            .iter()
            .copied()
            .chain(self.comm.iter().map(String::as_str))
            .any(|p| comm_matches(p, comm) && exe_matches(p))
            || self.cmdline.iter().any(|p| p.0.is_match(cmdline))
    }

    /// True if a `comm` or `cmdline` rule (the built-in list too) names a process so, whoever
    /// runs it: what `protects` trusts only from root and the system accounts.
    pub fn names(&self, comm: &str, cmdline: &str) -> bool {
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
    /// The KV cache `gpuguard plan` planned for the model, in tokens per engine (its
    /// `[[model]]` block says it): `status --model` and the metrics show it beside what the
    /// engine reports (`vllm:cache_config_info`).
    #[serde(default)]
    pub planned_kv_tokens: Option<u64>,
    /// The account that launched it, for a model with no `[[model]]` (`launched`): its budget is
    /// that account's own declaration, and its budget events are that account's doing. Never
    /// set from a config file.
    #[serde(skip)]
    pub launched_by: Option<u32>,
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

/// A planned KV cache in tokens: at least one, at most 2^40 (the plan's own bound).
pub fn check_planned_kv_tokens(n: u64) -> Result<(), String> {
    match n {
        1..=0x100_0000_0000 => Ok(()),
        _ => Err(format!("'{n}' must be between 1 and 2^40 tokens")),
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
    if ip.is_loopback() || crate::host::facts().local_addresses().contains(&ip) {
        Ok(())
    } else {
        Err(format!("'{url}': {ip} is not an address of this host"))
    }
}

/// Whether a ready URL names a loopback host (`localhost`, 127.0.0.0/8, `::1`): what an account
/// other than root may have the daemon poll (root may name the host's other addresses too).
pub fn ready_url_is_loopback(url: &str) -> bool {
    let Ok(host) = url_host(url, &["http", "https"], "") else {
        return false;
    };
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The host of an absolute URL with one of `schemes` and no credentials.
fn url_host(url: &str, schemes: &[&str], what: &str) -> Result<String, String> {
    let bad = |why: &str| Err(format!("'{url}' {why}"));
    let Ok(uri) = url.parse::<http::Uri>() else {
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

impl ModelConfig {
    /// A launched model with no `[[model]]`: its flags are its budgets (0: none), it is only
    /// alerted on, and only its launcher's processes belong to it.
    pub fn launched(name: &str, owner: u32, ram_bytes: u64, gpu_bytes: u64) -> ModelConfig {
        let amount = |b: u64| (b > 0).then_some(Amount::Bytes(b));
        ModelConfig {
            name: name.to_string(),
            matcher: Matcher::default(),
            ram: amount(ram_bytes),
            gpu_memory: amount(gpu_bytes),
            action: ModelAction::Alert,
            grace: Duration::from_secs(10),
            priority: 0,
            users: Some(vec![User {
                name: owner.to_string(),
                uid: owner,
            }]),
            max_permits: None,
            permit_gpu_memory: None,
            metrics_url: None,
            planned_kv_tokens: None,
            launched_by: Some(owner),
        }
    }

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

/// Whether `cgroup` is in the unit `unit` (its own cgroup or below it); a trailing `*` in the
/// unit's name matches a prefix of it.
fn in_unit(cgroup: &str, unit: &str) -> bool {
    match unit.strip_suffix('*') {
        Some(prefix) => {
            let prefix = unit_cgroup(prefix);
            cgroup
                .strip_prefix(prefix.as_str())
                .is_some_and(|rest| !rest.is_empty())
        }
        None => cgroup_has_prefix(cgroup, &unit_cgroup(unit)),
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

std::thread_local! {
    /// Set while a config for another host is parsed: names of users unknown here pass.
    static PORTABLE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `parse` with user names left unresolved where this host does not know them (their uid
/// is then `UNRESOLVED`): for a config checked for another host, never one that runs here.
pub(super) fn portable_users<T>(parse: impl FnOnce() -> T) -> T {
    PORTABLE.with(|p| p.set(true));
    let out = parse();
    PORTABLE.with(|p| p.set(false));
    out
}

/// The uid of a user a portable parse could not resolve (the kernel's overflow uid, nobody's).
pub const UNRESOLVED: u32 = 65534;

impl<'de> Deserialize<'de> for User {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        if let Ok(uid) = name.parse::<u32>() {
            return Ok(User { name, uid });
        }
        match crate::host::facts().uid_of(&name) {
            Some(uid) => Ok(User { name, uid }),
            _ if PORTABLE.with(|p| p.get()) => Ok(User {
                name,
                uid: UNRESOLVED,
            }),
            _ => Err(serde::de::Error::custom(format!(
                "'{name}' is not a known user"
            ))),
        }
    }
}
