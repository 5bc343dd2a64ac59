//! What a launch adds to a reservation: the lease of an admitted model server, which holds the
//! launch lock until the server is ready (its ready URL answers, or its memory grew and stayed
//! flat for `settle`, or `gpuguard release`, or the ready timeout), and the environment the
//! server is started with. The launched process itself (is it alive, does its ready URL answer)
//! is watched by the transport through `Launched`: the ledger does no I/O.

use std::sync::Arc;
use std::time::Duration;

use crate::units::fmt_bytes;

/// The launched process, pinned by the transport when it connected (`ipc::launched`): a pidfd,
/// and a poller of its ready URL.
pub trait Launched: Send + Sync {
    /// True once the process has exited.
    fn exited(&self) -> bool;
    /// Starts polling `url` (the lease was admitted); polling stops when the result is dropped.
    fn watch_ready(&self, url: &str) -> Box<dyn ReadyUrl>;
}

/// A ready URL being polled.
pub trait ReadyUrl: Send {
    /// True once it answered 2xx.
    fn answered(&self) -> bool;
}

/// Memory counts as "flat" while it moves by less than this between ticks.
const FLAT_BYTES: u64 = 64 << 20;
/// Memory counts as "grown" once the model holds this much more than when it was admitted.
const GROWN_BYTES: u64 = 64 << 20;

/// How a loading lease became ready.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ready {
    /// Its ready URL answered.
    UrlAnswered,
    /// Its memory (GPU if `by_gpu`, else RAM) grew by `grown` bytes and stayed flat for
    /// `settle`.
    Settled {
        by_gpu: bool,
        grown: u64,
        settle: Duration,
    },
    /// Its ready timeout passed first: it held the launch lock all that while.
    TimedOut(Duration),
}

impl Ready {
    /// A lease that overran its ready timeout held the launch lock all that while: a warning.
    /// Ready in time is news for no one but the launcher.
    pub fn severity(self) -> crate::kinds::Severity {
        match self {
            Ready::TimedOut(_) => crate::kinds::Severity::Warning,
            Ready::UrlAnswered | Ready::Settled { .. } => crate::kinds::Severity::Info,
        }
    }
}

impl std::fmt::Display for Ready {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Ready::UrlAnswered => f.write_str("ready URL answered"),
            Ready::Settled {
                by_gpu,
                grown,
                settle,
            } => write!(
                f,
                "{} grew by {} and stayed flat for {}",
                if by_gpu { "GPU memory" } else { "RAM" },
                fmt_bytes(grown),
                crate::units::fmt_duration(settle)
            ),
            Ready::TimedOut(timeout) => write!(
                f,
                "not ready after ready_timeout {}",
                crate::units::fmt_duration(timeout)
            ),
        }
    }
}

pub use crate::kinds::LeaseState;

pub struct Lease {
    pub model: String,
    /// The launched process (it `exec`s the server: same pid), pinned when it connected.
    pub process: Arc<dyn Launched>,
    pub state: LeaseState,
    pub ready_timeout: Duration,
    /// Whether it is judged by GPU memory (it declared some) or by RAM.
    pub by_gpu: bool,
    ready_url: Option<Box<dyn ReadyUrl>>,
    usage_at_admission: u64,
    last_usage: u64,
    stable_since: Duration,
}

/// What a new lease is made of.
pub struct NewLease {
    pub model: String,
    pub process: Arc<dyn Launched>,
    pub ready_timeout: Duration,
    pub by_gpu: bool,
    pub ready_url: Option<String>,
}

impl Lease {
    /// A lease admitted at `now`, when its model used `usage` (GPU or RAM, as it is judged).
    pub fn new(spec: NewLease, usage: u64, now: Duration) -> Lease {
        Lease {
            model: spec.model,
            ready_url: spec.ready_url.map(|url| spec.process.watch_ready(&url)),
            process: spec.process,
            state: LeaseState::Loading,
            ready_timeout: spec.ready_timeout,
            by_gpu: spec.by_gpu,
            usage_at_admission: usage,
            last_usage: usage,
            stable_since: now,
        }
    }

    /// Ready now? Returns how it became so.
    /// `usage` is the model's GPU (or RAM) use now, `admitted_at` when the lease began.
    pub fn readiness(
        &mut self,
        usage: u64,
        now: Duration,
        admitted_at: Duration,
        settle: Duration,
    ) -> Option<Ready> {
        if self.ready_url.as_ref().is_some_and(|r| r.answered()) {
            return Some(Ready::UrlAnswered);
        }
        if usage.abs_diff(self.last_usage) > FLAT_BYTES {
            self.last_usage = usage;
            self.stable_since = now;
        }
        let grown = usage.saturating_sub(self.usage_at_admission);
        if self.ready_url.is_none()
            && grown >= GROWN_BYTES
            && now.saturating_sub(self.stable_since) >= settle
        {
            return Some(Ready::Settled {
                by_gpu: self.by_gpu,
                grown,
                settle,
            });
        }
        if now.saturating_sub(admitted_at) >= self.ready_timeout {
            return Some(Ready::TimedOut(self.ready_timeout));
        }
        None
    }

    /// Whether its process has exited.
    pub fn exited(&self) -> bool {
        self.process.exited()
    }

    /// Loaded (or given up on): the lock and the reservation end, the URL poller stops.
    pub fn set_ready(&mut self) {
        self.state = LeaseState::Ready;
        self.ready_url = None;
    }
}

/// Whether a ready-URL poller thread runs for this lease (tests count them through status).
impl Lease {
    pub fn polling(&self) -> bool {
        self.ready_url.is_some()
    }
}

/// The ready URL of a known model server, from its command line, when the launch named none:
/// vLLM (`vllm serve`, `vllm.entrypoints`), SGLang (`sglang.launch_server`) and TGI
/// (`text-generation-launcher`) answer `GET /health` once loaded, KV cache allocated.
pub fn guess_ready_url(command: &[String]) -> Option<String> {
    let joined = command.join(" ");
    let (default_port, known) = if joined.contains("vllm serve")
        || joined.contains("vllm.entrypoints")
        || command
            .first()
            .is_some_and(|c| c.ends_with("/vllm") || c == "vllm")
            && command.get(1).is_some_and(|a| a == "serve")
    {
        (8000, true)
    } else if joined.contains("sglang.launch_server") {
        (30000, true)
    } else if command
        .first()
        .is_some_and(|c| c.ends_with("text-generation-launcher"))
    {
        (80, true)
    } else {
        (0, false)
    };
    if !known {
        return None;
    }
    let value = |flag: &str| {
        command.iter().enumerate().find_map(|(i, a)| {
            a.strip_prefix(&format!("{flag}="))
                .map(str::to_string)
                .or_else(|| (a == flag).then(|| command.get(i + 1).cloned()).flatten())
        })
    };
    let port: u16 = value("--port")
        .and_then(|p| p.parse().ok())
        .unwrap_or(default_port);
    // A server bound to all interfaces answers on loopback too.
    let host = match value("--host").as_deref() {
        None | Some("0.0.0.0") | Some("::") | Some("") => "127.0.0.1".to_string(),
        Some(h) if h.contains(':') => format!("[{h}]"),
        Some(h) => h.to_string(),
    };
    // Only a host this host answers on (a client's command line must not aim the daemon's
    // polling anywhere else, nor carry newlines into its logs).
    let url = format!("http://{host}:{port}/health");
    crate::config::check_ready_url(&url).ok().map(|()| url)
}

/// A launched process for tests of the ledger and the daemon: alive until told otherwise
/// (`exited`), its ready URL never answers. The daemon's tests take it through the `fakes`
/// feature.
#[cfg(any(test, feature = "fakes"))]
#[derive(Default)]
pub struct FakeProcess {
    pub exited: std::sync::atomic::AtomicBool,
}

#[cfg(any(test, feature = "fakes"))]
impl Launched for FakeProcess {
    fn exited(&self) -> bool {
        self.exited.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn watch_ready(&self, _url: &str) -> Box<dyn ReadyUrl> {
        struct Silent;
        impl ReadyUrl for Silent {
            fn answered(&self) -> bool {
                false
            }
        }
        Box::new(Silent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kinds::Severity;

    fn args(text: &str) -> Vec<String> {
        text.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn known_servers_get_their_health_url() {
        assert_eq!(
            guess_ready_url(&args(
                "/opt/vllm/bin/vllm serve Qwen/Qwen2.5-32B --port 8001"
            )),
            Some("http://127.0.0.1:8001/health".into())
        );
        assert_eq!(
            guess_ready_url(&args(
                "python3 -m vllm.entrypoints.openai.api_server --host=127.0.0.2"
            )),
            Some("http://127.0.0.2:8000/health".into())
        );
        // Not an address of this host, or not an address at all: no guess.
        for host in [
            "192.0.2.7",
            "metadata.google.internal",
            "127.0.0.1\nERROR x",
        ] {
            assert_eq!(
                guess_ready_url(&[
                    "vllm".into(),
                    "serve".into(),
                    "m".into(),
                    "--host".into(),
                    host.into()
                ]),
                None,
                "{host:?}"
            );
        }
        assert_eq!(
            guess_ready_url(&args("python -m sglang.launch_server --model-path x")),
            Some("http://127.0.0.1:30000/health".into())
        );
        assert_eq!(guess_ready_url(&args("python3 train.py --port 9")), None);
    }

    /// Only a lease its ready timeout released is a warning; the words say how each became ready.
    #[test]
    fn a_lease_released_by_its_timeout_is_the_one_warning() {
        let timed_out = Ready::TimedOut(Duration::from_secs(600));
        assert_eq!(timed_out.severity(), Severity::Warning);
        assert_eq!(timed_out.to_string(), "not ready after ready_timeout 10m");
        let settled = Ready::Settled {
            by_gpu: true,
            grown: 2 << 30,
            settle: Duration::from_secs(1),
        };
        assert_eq!(settled.severity(), Severity::Info);
        assert_eq!(
            settled.to_string(),
            "GPU memory grew by 2.0 GiB and stayed flat for 1s"
        );
        assert_eq!(Ready::UrlAnswered.severity(), Severity::Info);
    }
}
