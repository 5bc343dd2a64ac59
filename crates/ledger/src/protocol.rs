//! The protocol of the daemon's unix socket: a small versioned set of requests and responses
//! shared by the daemon (`ipc::server`), the reservation ledger and the CLI (`ipc::client`). One JSON message per line; `docs/protocol.md` is its
//! specification (the Python client in `clients/python` speaks it too).
//!
//! Every value a client sends is untrusted: it is bounded here (`validate`) before the daemon
//! looks at it, and who asks is taken from the socket's peer credentials, never from the message.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::status::StatusReport;

/// Bumped when a message changes incompatibly.
pub const PROTOCOL_VERSION: u32 = 1;
/// Longest message a client may send.
pub const MAX_REQUEST_BYTES: usize = 16 << 10;
/// Longest message the daemon sends (a status report with many models fits easily).
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;
/// Longest model name a client may use (printable ASCII, no spaces).
pub const MAX_MODEL_NAME: usize = 128;
/// Longest ready or metrics URL.
pub const MAX_URL: usize = 2048;

/// What a client sends, wrapped with the protocol version.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Envelope {
    pub version: u32,
    #[serde(flatten)]
    pub request: Request,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Request {
    /// The daemon's view of the host: GPUs, memory, models, queue, held processes, actions.
    Status,
    /// Queue the caller (its own pid, from the socket's peer credentials) for a model launch.
    Launch(LaunchRequest),
    /// End a lease early (the model is ready). Only its owner or root.
    Release { lease: u64 },
    /// A memory permit for one unit of work.
    Acquire(AcquireRequest),
    /// Give a permit back.
    ReleasePermit { id: u64, permit: u64 },
    /// Stop waiting for acquire `id`.
    Cancel { id: u64 },
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct LaunchRequest {
    pub model: String,
    /// Total GPU memory the model will take, over all its GPUs; `None`: the `[[model]]` budget.
    pub gpu_memory_bytes: Option<u64>,
    /// Host RAM the model will take; `None`: the `[[model]]` budget.
    pub ram_bytes: Option<u64>,
    /// How many GPUs to place it on (default 1 when it needs GPU memory).
    pub gpus: Option<u32>,
    /// A specific GPU index.
    pub gpu: Option<u32>,
    /// The caller's CUDA_VISIBLE_DEVICES, if set: respected and checked.
    pub cuda_visible_devices: Option<String>,
    pub ready_url: Option<String>,
    /// The model server's Prometheus endpoint (loopback http), scraped for its own limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_url: Option<String>,
    /// The KV cache `gpuguard plan` planned for it, in tokens per engine: `status --model` sets
    /// the engine's real one beside it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planned_kv_tokens: Option<u64>,
    pub ready_timeout_ms: Option<u64>,
    pub queue_timeout_ms: Option<u64>,
    /// The command about to be run (for status and logs).
    pub command: Vec<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct AcquireRequest {
    /// The client's number for this request, echoed in the answer.
    pub id: u64,
    /// The model the work belongs to; `None`: the caller's own model, else the host-wide pool.
    pub model: Option<String>,
    /// `None`: the model's observed p95 per permit, else its `permit_gpu_memory`, else 0.
    pub gpu_bytes: Option<u64>,
    pub ram_bytes: Option<u64>,
    pub gpu: Option<u32>,
    pub timeout_ms: Option<u64>,
    pub ttl_ms: Option<u64>,
    /// What the caller's GPU allocator holds unused (PyTorch: `memory_reserved -
    /// memory_allocated`): its own next permits may use it, up to what NVML shows it holding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_bytes: Option<u64>,
    /// When the allocator was read for `cache_bytes`: CLOCK_MONOTONIC in nanoseconds (Python's
    /// `time.monotonic_ns()`, the same clock on the same host). Absent: as it arrived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read_at_ns: Option<u64>,
    /// How long before the daemon took the request in `cache_read_at_ns` was (set by the
    /// socket server when the request is handled; never read from the wire).
    #[serde(skip)]
    pub cache_age: Option<Duration>,
}

/// Why a request was refused (`docs/protocol.md`).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum RefusalReason {
    Timeout,
    TooLarge,
    QueueFull,
    MaxPermits,
    NotAllowed,
    Invalid,
    Cancelled,
    /// The host drains before maintenance its cloud announced (GCE: `maintenance-event`).
    HostMaintenance,
    /// The host is being preempted (a GCE Spot or preemptible VM).
    Preempted,
}

impl RefusalReason {
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalReason::Timeout => "timeout",
            RefusalReason::TooLarge => "too_large",
            RefusalReason::QueueFull => "queue_full",
            RefusalReason::MaxPermits => "max_permits",
            RefusalReason::NotAllowed => "not_allowed",
            RefusalReason::Invalid => "invalid",
            RefusalReason::Cancelled => "cancelled",
            RefusalReason::HostMaintenance => "host_maintenance",
            RefusalReason::Preempted => "preempted",
        }
    }
}

/// What a refused request asked for.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Needed {
    pub gpu_bytes: u64,
    pub ram_bytes: u64,
    pub gpu: Option<u32>,
}

/// What was available for it (room after floors and reservations); `None` where unknown.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Free {
    pub gpu_bytes: Option<u64>,
    pub ram_bytes: Option<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Response {
    Status(Box<StatusReport>),
    /// Waiting in the queue (sent once, only when the launch has to wait).
    Queued {
        position: usize,
        waiting_for: String,
    },
    /// Go: exec the command with this environment.
    Admitted {
        lease: u64,
        gpus: Vec<u32>,
        env: Vec<(String, String)>,
    },
    /// Did not fit before the queue timeout: the command must not start.
    TimedOut {
        message: String,
    },
    /// A permit.
    Granted {
        id: u64,
        permit: u64,
        gpu: Option<u32>,
        gpu_bytes: u64,
        ram_bytes: u64,
        waited_ms: u64,
        ttl_ms: u64,
    },
    /// No permit (or no launch), and why.
    Refused {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<u64>,
        reason: RefusalReason,
        message: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        retry_after_ms: Option<u64>,
        #[serde(default)]
        needed: Needed,
        #[serde(default)]
        free: Free,
    },
    /// A lease (`lease`) or a permit (`id`, `permit`) given back.
    Released {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        permit: Option<u64>,
    },
    /// A permit held past its TTL was revoked.
    Expired {
        permit: u64,
        message: String,
    },
    /// Another request of the caller's model waits for GPU memory that the caller's allocator
    /// keeps cached unused (`bytes` of it on GPU `gpu`): give it back (PyTorch:
    /// `torch.cuda.empty_cache()`). A hint; nothing is enforced by it.
    Trim {
        gpu: u32,
        bytes: u64,
    },
    /// A request that could not be served; `id` names the request when it had one.
    Error {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<u64>,
        message: String,
    },
}

impl Response {
    /// An error about no numbered request.
    pub fn error(message: String) -> Response {
        Response::Error { id: None, message }
    }

    /// A refusal for a request that was never looked at further.
    pub fn refused(id: Option<u64>, reason: RefusalReason, message: String) -> Response {
        Response::Refused {
            id,
            reason,
            message,
            retry_after_ms: None,
            needed: Needed::default(),
            free: Free::default(),
        }
    }
}

/// A model name a client may use: 1 to `MAX_MODEL_NAME` printable ASCII characters, no spaces
/// or quotes (it ends up in logs, alerts, metrics labels and status tables), not starting with
/// `(`: names in parentheses are the daemon's own labels (`(host)`, the host-wide permit pool),
/// which a client must not impersonate.
pub fn check_model_name(name: &str) -> Result<(), String> {
    if name.starts_with('(') {
        return Err(format!(
            "a model name may not start with '(' (reserved for the daemon's own labels such as '(host)'; got {name:?})"
        ));
    }
    if name.is_empty() || name.len() > MAX_MODEL_NAME {
        return Err(format!(
            "a model name has 1 to {MAX_MODEL_NAME} characters (got {})",
            name.len()
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !c.is_ascii_graphic() || matches!(c, '"' | '\'' | '\\' | '`'))
    {
        return Err(format!(
            "a model name is printable ASCII without spaces or quotes (found {:?})",
            c
        ));
    }
    Ok(())
}

/// An http:// or https:// URL of bounded length, in printable ASCII without spaces (a URL's
/// other characters are percent-encoded; a raw one, a control character or a bidirectional
/// override, would reach logs and terminals where the URL is shown).
pub fn check_url(what: &str, url: &str) -> Result<(), String> {
    if url.len() > MAX_URL {
        return Err(format!("{what}: longer than {MAX_URL} bytes"));
    }
    if let Some(c) = url.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(format!(
            "{what}: {:?} is not printable ASCII (percent-encode it)",
            c
        ));
    }
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(format!("{what}: not an http:// or https:// URL"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_are_bounded_and_printable() {
        assert!(check_model_name("qwen-32b_v2.1@a100/x").is_ok());
        for bad in ["", "a b", "a\nb", "a\x1b[2Jb", "é", "a\"b"] {
            assert!(check_model_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_model_name(&"x".repeat(MAX_MODEL_NAME)).is_ok());
        assert!(check_model_name(&"x".repeat(MAX_MODEL_NAME + 1)).is_err());
    }

    /// Round four: a user's metrics URL with a bidirectional override reached root's terminal
    /// through `status --model`. A URL is printable ASCII.
    #[test]
    fn a_url_is_printable_ascii() {
        assert_eq!(
            check_url("--metrics-url", "http://127.0.0.1:8000/m%C3%A9trics"),
            Ok(())
        );
        for bad in [
            "http://127.0.0.1:8000/\u{202e}scirtem",
            "http://127.0.0.1:8000/métrics",
            "http://127.0.0.1:8000/a b",
            "http://127.0.0.1:8000/\x1b[2J",
            "http://127.0.0.1:8000/\n",
        ] {
            let e = check_url("--metrics-url", bad).unwrap_err();
            assert!(e.contains("is not printable ASCII"), "{bad:?}: {e}");
        }
        assert!(check_url("--ready-url", "ftp://h/").is_err());
    }

    /// `(host)` is how status and the metrics name the host-wide permit pool: no client model
    /// may take that name, or any other in parentheses.
    #[test]
    fn names_in_parentheses_are_reserved() {
        for bad in ["(host)", "(", "(x", "()"] {
            let e = check_model_name(bad).unwrap_err();
            assert!(e.contains("may not start with '('"), "{bad:?}: {e}");
        }
        assert!(check_model_name("host").is_ok());
        assert!(check_model_name("a(host)").is_ok());
    }

    #[test]
    fn permit_messages_round_trip_as_documented() {
        let line = r#"{"version":1,"type":"acquire","id":7,"model":"qwen","gpu_bytes":3221225472,"timeout_ms":2000,"extra":"ignored"}"#;
        let e: Envelope = serde_json::from_str(line).unwrap();
        let Request::Acquire(a) = e.request else {
            panic!()
        };
        assert_eq!((a.id, a.gpu_bytes, a.ttl_ms), (7, Some(3 << 30), None));
        let refused = Response::refused(Some(7), RefusalReason::TooLarge, "m".into());
        let text = serde_json::to_string(&refused).unwrap();
        assert!(
            text.starts_with(r#"{"type":"refused","id":7,"reason":"too_large""#),
            "{text}"
        );
        let released = serde_json::to_string(&Response::Released {
            lease: None,
            id: Some(8),
            permit: Some(123),
        })
        .unwrap();
        assert_eq!(released, r#"{"type":"released","id":8,"permit":123}"#);
    }
}
