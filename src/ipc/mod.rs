//! The daemon's unix socket: a small versioned request/response protocol shared by the daemon
//! (server) and the CLI (client). One JSON message per line, at most `MAX_MESSAGE_BYTES`.

pub mod client;
pub mod server;

use serde::{Deserialize, Serialize};

use crate::status::StatusReport;

/// Bumped when a message changes incompatibly.
pub const PROTOCOL_VERSION: u32 = 1;
/// Longest message either side accepts (a status report with many models fits easily).
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;
pub const DEFAULT_SOCKET: &str = "/run/gpuguard/gpuguard.sock";

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
    pub ready_timeout_ms: Option<u64>,
    pub queue_timeout_ms: Option<u64>,
    /// The command about to be run (for status and logs).
    pub command: Vec<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Response {
    Status(Box<StatusReport>),
    /// Waiting in the queue (sent once on arrival; the final answer follows).
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
    Released {
        lease: u64,
    },
    Error {
        message: String,
    },
}
