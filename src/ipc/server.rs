//! The socket server: a small tokio runtime on its own thread. Each connection sends one
//! request; it is checked (size, version, shape) here and handed to the daemon loop with the
//! caller's peer credentials. Nothing a client sends can stall or crash the loop: a bad message
//! gets an error reply, a slow or half-sent one is dropped after a timeout.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};

use super::{Envelope, Request, Response, MAX_MESSAGE_BYTES, PROTOCOL_VERSION};

/// Who is on the other end, from SO_PEERCRED.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    pub uid: u32,
    pub pid: i32,
}

impl Peer {
    pub fn is_root(&self) -> bool {
        self.uid == 0
    }
}

/// What the server hands to the daemon loop.
pub enum IpcEvent {
    Request {
        conn: u64,
        peer: Peer,
        request: Request,
        reply: UnboundedSender<Response>,
    },
    /// The client went away (e.g. a queued launch was interrupted).
    Closed { conn: u64 },
}

/// How long a client may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Binds the socket (replacing a stale one) and serves it on a new thread until the process
/// exits. `deliver` wraps events for the daemon's channel.
pub fn spawn<E: Send + 'static>(
    path: &Path,
    events: Sender<E>,
    deliver: fn(IpcEvent) -> E,
) -> anyhow::Result<SocketGuard> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        anyhow::bail!(
            "{} is in use: is another gpuguard daemon running?",
            path.display()
        );
    }
    let _ = std::fs::remove_file(path);
    let std_listener = std::os::unix::net::UnixListener::bind(path)
        .with_context(|| format!("binding {}", path.display()))?;
    // Anyone may connect; what they may do is decided from their peer credentials.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    std_listener.set_nonblocking(true)?;
    std::thread::Builder::new()
        .name("ipc".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(r) => r,
                Err(e) => return tracing::error!("socket server: cannot start its runtime: {e}"),
            };
            runtime.block_on(async move {
                let listener = match UnixListener::from_std(std_listener) {
                    Ok(l) => l,
                    Err(e) => return tracing::error!("socket server: {e}"),
                };
                let next_conn = AtomicU64::new(1);
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    let conn = next_conn.fetch_add(1, Ordering::Relaxed);
                    let events = events.clone();
                    tokio::spawn(async move {
                        if let Err(e) = serve(stream, conn, &events, deliver).await {
                            tracing::debug!(conn, "socket client: {e}");
                        }
                    });
                }
            });
        })?;
    Ok(SocketGuard {
        path: path.to_path_buf(),
    })
}

/// Removes the socket file when the daemon exits.
pub struct SocketGuard {
    path: PathBuf,
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

async fn serve<E>(
    stream: UnixStream,
    conn: u64,
    events: &Sender<E>,
    deliver: fn(IpcEvent) -> E,
) -> anyhow::Result<()> {
    let cred = stream.peer_cred()?;
    let peer = Peer {
        uid: cred.uid(),
        pid: cred.pid().unwrap_or(0),
    };
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    let request = match tokio::time::timeout(READ_TIMEOUT, read_line(&mut reader)).await {
        Err(_) => {
            return reply(
                &mut write,
                &Response::Error {
                    message: "timed out waiting for a request".into(),
                },
            )
            .await
        }
        Ok(Err(message)) => return reply(&mut write, &Response::Error { message }).await,
        Ok(Ok(line)) => match parse(&line) {
            Ok(request) => request,
            Err(message) => return reply(&mut write, &Response::Error { message }).await,
        },
    };
    let (tx, mut rx) = unbounded_channel();
    if events
        .send(deliver(IpcEvent::Request {
            conn,
            peer,
            request,
            reply: tx,
        }))
        .is_err()
    {
        return reply(
            &mut write,
            &Response::Error {
                message: "daemon is shutting down".into(),
            },
        )
        .await;
    }
    let mut probe = [0u8; 1];
    loop {
        tokio::select! {
            response = rx.recv() => {
                let Some(response) = response else { return Ok(()) };
                let last = !matches!(response, Response::Queued { .. });
                reply(&mut write, &response).await?;
                if last {
                    return Ok(());
                }
            }
            // A client that hangs up while waiting (Ctrl-C in `gpuguard launch`) leaves the queue.
            n = reader.read(&mut probe) => {
                if matches!(n, Ok(0) | Err(_)) {
                    let _ = events.send(deliver(IpcEvent::Closed { conn }));
                    return Ok(());
                }
            }
        }
    }
}

/// One line of at most MAX_MESSAGE_BYTES.
async fn read_line<R: tokio::io::AsyncBufRead + Unpin>(reader: &mut R) -> Result<String, String> {
    let mut buf = Vec::new();
    let mut limited = reader.take(MAX_MESSAGE_BYTES as u64 + 1);
    limited
        .read_until(b'\n', &mut buf)
        .await
        .map_err(|e| format!("read error: {e}"))?;
    if buf.len() > MAX_MESSAGE_BYTES {
        return Err(format!("message longer than {MAX_MESSAGE_BYTES} bytes"));
    }
    if buf.last() != Some(&b'\n') {
        return Err("incomplete message (no newline)".into());
    }
    String::from_utf8(buf).map_err(|_| "message is not UTF-8".into())
}

fn parse(line: &str) -> Result<Request, String> {
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    match value.get("version").and_then(|v| v.as_u64()) {
        Some(v) if v == u64::from(PROTOCOL_VERSION) => {}
        Some(v) => {
            return Err(format!(
                "protocol version {v} not supported (this daemon speaks {PROTOCOL_VERSION})"
            ))
        }
        None => return Err("missing protocol version".into()),
    }
    serde_json::from_value::<Envelope>(value)
        .map(|e| e.request)
        .map_err(|e| format!("bad request: {e}"))
}

async fn reply(
    write: &mut tokio::net::unix::OwnedWriteHalf,
    response: &Response,
) -> anyhow::Result<()> {
    let mut line = serde_json::to_vec(response)?;
    line.push(b'\n');
    write.write_all(&line).await?;
    Ok(())
}
