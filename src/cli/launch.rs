//! `gpuguard launch`: queue through the daemon for memory, then exec the command with the same
//! pid (so it works as a systemd `ExecStart=`). Fails closed: the command never starts unless
//! the daemon admitted it.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::exit;
use crate::config::DEFAULT_SOCKET;
use crate::ipc::client::{ClientError, Connection};
use crate::protocol::{LaunchRequest, Request, Response};
use crate::units::{parse_duration, Amount};

#[derive(Args)]
pub struct LaunchArgs {
    /// The model's name (its `[[model]]` in the daemon's config gives default budgets).
    #[arg(long)]
    model: String,
    /// GPU memory the model will take, over all its GPUs (e.g. "30GiB").
    #[arg(long, value_parser = parse_size)]
    gpu_mem: Option<u64>,
    /// Host RAM the model will take while loading and serving (e.g. "40GiB").
    #[arg(long, value_parser = parse_size)]
    ram: Option<u64>,
    /// Place it on this many GPUs (the ones with most room); without --gpu-mem it still gets
    /// CUDA_VISIBLE_DEVICES for that many GPUs.
    #[arg(long, conflicts_with = "gpu")]
    gpus: Option<u32>,
    /// Place it on this GPU index.
    #[arg(long)]
    gpu: Option<u32>,
    /// Ready when this URL answers 2xx (e.g. http://127.0.0.1:8000/health). Without it, a vLLM,
    /// SGLang or TGI command gets its /health URL from its --host/--port; any other command is
    /// ready once its memory has grown and stayed flat for the daemon's `[launch] settle`.
    #[arg(long)]
    ready_url: Option<String>,
    /// The server's Prometheus metrics (loopback http, e.g. http://127.0.0.1:8000/metrics):
    /// `status` shows its KV cache and queue.
    #[arg(long)]
    metrics_url: Option<String>,
    /// The KV cache `gpuguard plan` planned, in tokens per engine (its `planned_kv_tokens`):
    /// `status --model` sets the engine's real one beside it.
    #[arg(long)]
    planned_kv_tokens: Option<u64>,
    /// Hold the launch lock at most this long while loading (default: the daemon's).
    #[arg(long, value_parser = parse_duration)]
    ready_timeout: Option<Duration>,
    /// Fail if not admitted within this long (default: the daemon's).
    #[arg(long, value_parser = parse_duration)]
    queue_timeout: Option<Duration>,
    #[arg(long, env = "GPUGUARD_SOCKET", default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<OsString>,
}

pub(super) fn parse_size(text: &str) -> Result<u64, String> {
    match text.parse::<Amount>()? {
        Amount::Bytes(b) => Ok(b),
        Amount::Percent(_) => Err(format!(
            "'{text}': give an absolute size here (e.g. \"30GiB\")"
        )),
    }
}

pub fn run(args: LaunchArgs) -> u8 {
    let request = LaunchRequest {
        model: args.model.clone(),
        gpu_memory_bytes: args.gpu_mem,
        ram_bytes: args.ram,
        gpus: args.gpus,
        gpu: args.gpu,
        cuda_visible_devices: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
        ready_url: args.ready_url.clone(),
        metrics_url: args.metrics_url.clone(),
        planned_kv_tokens: args.planned_kv_tokens,
        ready_timeout_ms: args.ready_timeout.map(|d| d.as_millis() as u64),
        queue_timeout_ms: args.queue_timeout.map(|d| d.as_millis() as u64),
        command: args
            .command
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect(),
    };
    let mut connection = match Connection::open(&args.socket, Request::Launch(request)) {
        Ok(c) => c,
        Err(e) => return unreachable(&args.model, e),
    };
    loop {
        match connection.receive() {
            Ok(Response::Queued {
                position,
                waiting_for,
            }) => {
                eprintln!(
                    "gpuguard: model '{}' queued at position {position}, waiting for: {waiting_for}",
                    args.model
                );
            }
            Ok(Response::Admitted { lease, gpus, env }) => {
                eprintln!(
                    "gpuguard: model '{}' admitted (lease {lease}, GPUs {gpus:?}); starting {:?}",
                    args.model, args.command[0]
                );
                drop(connection);
                let error = std::process::Command::new(&args.command[0])
                    .args(&args.command[1..])
                    .envs(env)
                    .exec();
                eprintln!("gpuguard: cannot run {:?}: {error}", args.command[0]);
                return if error.kind() == std::io::ErrorKind::NotFound {
                    exit::NOT_FOUND
                } else {
                    exit::CANNOT_EXECUTE
                };
            }
            Ok(Response::TimedOut { message }) => {
                eprintln!("gpuguard: {message}");
                return exit::TRY_LATER;
            }
            Ok(Response::Refused {
                reason, message, ..
            }) => {
                eprintln!("gpuguard: {message}");
                return exit::refused(reason);
            }
            Ok(Response::Error { message, .. }) => {
                eprintln!("gpuguard: launch refused: {message}");
                return exit::REFUSED;
            }
            Ok(other) => {
                eprintln!("gpuguard: unexpected answer from the daemon: {other:?}");
                return exit::FAILURE;
            }
            Err(e) => return unreachable(&args.model, e),
        }
    }
}

fn unreachable(model: &str, e: ClientError) -> u8 {
    eprintln!("gpuguard: {e}; model '{model}' was not started");
    exit::UNREACHABLE
}
