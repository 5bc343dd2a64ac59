//! `gpuguard permit`: hold a memory permit while a command runs — the host-wide, memory-aware
//! semaphore from the shell. The command starts only once the permit is granted; the permit is
//! given back when it exits (or when this process dies: the daemon ends a permit whose connection
//! closes). Exits with the command's status, or, when no permit came, with `exit::refused`'s
//! code for why (the same table as `launch`'s: 75 not now, 65 never on this host, 77 not
//! allowed, 2 invalid).

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Command, ExitStatus};
use std::time::Duration;

use clap::Args;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};

use super::exit;
use super::launch::parse_size;
use crate::config::DEFAULT_SOCKET;
use crate::ipc::client::Connection;
use crate::protocol::{AcquireRequest, Request, Response};
use crate::units::{fmt_bytes, parse_duration};

#[derive(Args)]
pub struct PermitArgs {
    /// The model the work belongs to (default: the model this process belongs to, else the
    /// host-wide pool).
    #[arg(long)]
    model: Option<String>,
    /// GPU memory the work needs (e.g. "3GiB"; default: the model's observed p95 per permit,
    /// else its permit_gpu_memory, else none).
    #[arg(long, value_parser = parse_size)]
    gpu_mem: Option<u64>,
    /// Host RAM the work needs.
    #[arg(long, value_parser = parse_size)]
    ram: Option<u64>,
    /// The GPU index (default: the one with most room, of those the model uses).
    #[arg(long)]
    gpu: Option<u32>,
    /// Wait at most this long for the permit (default: the daemon's).
    #[arg(long, value_parser = parse_duration)]
    timeout: Option<Duration>,
    /// Hold the permit at most this long; past it the daemon revokes it (default: the daemon's).
    #[arg(long, value_parser = parse_duration)]
    ttl: Option<Duration>,
    #[arg(long, env = "GPUGUARD_SOCKET", default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<OsString>,
}

pub fn run(args: PermitArgs) -> u8 {
    let request = AcquireRequest {
        id: 1,
        model: args.model.clone(),
        gpu_bytes: args.gpu_mem,
        ram_bytes: args.ram,
        gpu: args.gpu,
        timeout_ms: args.timeout.map(|d| d.as_millis() as u64),
        ttl_ms: args.ttl.map(|d| d.as_millis() as u64),
        ..AcquireRequest::default()
    };
    let mut conn = match Connection::open(&args.socket, Request::Acquire(request)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpuguard: {e}; the command was not started");
            return exit::UNREACHABLE;
        }
    };
    let (permit, gpu) = {
        match conn.receive() {
            Ok(Response::Granted {
                permit,
                gpu,
                gpu_bytes,
                waited_ms,
                ..
            }) => {
                if waited_ms > 0 {
                    eprintln!(
                        "gpuguard: permit {permit} granted after {} (GPU {} {})",
                        crate::units::fmt_duration(Duration::from_millis(waited_ms)),
                        gpu.map_or("-".into(), |g| g.to_string()),
                        fmt_bytes(gpu_bytes)
                    );
                }
                (permit, gpu)
            }
            Ok(Response::Refused {
                reason,
                message,
                retry_after_ms,
                ..
            }) => {
                let retry = retry_after_ms.map_or(String::new(), |ms| {
                    format!(
                        " (try again in {})",
                        crate::units::fmt_duration(Duration::from_millis(ms))
                    )
                });
                eprintln!("gpuguard: no permit: {message}{retry}; the command was not started");
                return exit::refused(reason);
            }
            Ok(Response::Error { message, .. }) => {
                eprintln!("gpuguard: permit refused: {message}");
                return exit::REFUSED;
            }
            Ok(other) => {
                eprintln!("gpuguard: unexpected answer from the daemon: {other:?}");
                return exit::FAILURE;
            }
            Err(e) => {
                eprintln!("gpuguard: {e}; the command was not started");
                return exit::UNREACHABLE;
            }
        }
    };
    // From here one thread reads the connection: it says when the daemon revokes the permit
    // (held past its TTL) and hands back the answer to the release.
    let (released, answer) = std::sync::mpsc::channel();
    if let Ok(mut reader) = conn.try_clone() {
        let _ = std::thread::Builder::new()
            .name("permit-watch".into())
            .spawn(move || {
                while let Ok(answer) = reader.receive() {
                    match answer {
                        Response::Expired { message, .. } => eprintln!("gpuguard: {message}"),
                        Response::Released { .. } => {
                            let _ = released.send(());
                        }
                        _ => {}
                    }
                }
            });
    }
    let status = run_holding(&args, permit, gpu);
    // Give it back (the daemon would also end it when this connection closes).
    if conn.send(Request::ReleasePermit { id: 2, permit }).is_ok() {
        let _ = answer.recv_timeout(Duration::from_secs(2));
    }
    status
}

/// Runs the command while the permit is held; returns its exit code.
fn run_holding(args: &PermitArgs, permit: u64, gpu: Option<u32>) -> u8 {
    let mut command = Command::new(&args.command[0]);
    command
        .args(&args.command[1..])
        .env("GPUGUARD_PERMIT", permit.to_string());
    if let Some(g) = gpu {
        command.env("GPUGUARD_PERMIT_GPU", g.to_string());
        if std::env::var_os("CUDA_VISIBLE_DEVICES").is_none() {
            command
                .env("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
                .env("CUDA_VISIBLE_DEVICES", g.to_string());
        }
    }
    let mut child = match command.spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpuguard: cannot run {:?}: {e}", args.command[0]);
            return if e.kind() == std::io::ErrorKind::NotFound {
                exit::NOT_FOUND
            } else {
                exit::CANNOT_EXECUTE
            };
        }
    };
    forward_signals(child.id() as i32);
    match child.wait() {
        Ok(status) => code(status),
        Err(e) => {
            eprintln!("gpuguard: waiting for the command: {e}");
            exit::FAILURE
        }
    }
}

/// SIGTERM/SIGINT/SIGHUP to this process go to the command, which decides how to end.
fn forward_signals(child: i32) {
    let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP]) else {
        return;
    };
    let _ = std::thread::Builder::new()
        .name("permit-signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                let sig = rustix::process::Signal::from_named_raw(signal);
                if let (Some(sig), Some(pid)) = (sig, rustix::process::Pid::from_raw(child)) {
                    let _ = rustix::process::kill_process(pid, sig);
                }
            }
        });
}

/// The exit code a shell would give: the command's, or 128 + the signal that ended it.
fn code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => c as u8,
        (None, Some(s)) => 128u8.wrapping_add(s as u8),
        _ => exit::FAILURE,
    }
}
