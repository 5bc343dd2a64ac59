//! The socket server: tasks on the daemon's tokio runtime (`daemon::io`), beside the metrics
//! endpoint's.
//!
//! Each connection is pinned to its peer (`peer.rs`) and counted against the connection caps
//! before anything it sends is read; over a cap it is closed at once. Its requests are parsed and
//! bounded here and answered from the reservation table (permits, launches, releases) or from
//! the status report the daemon loop publishes: nothing a client sends waits for the control loop
//! or can stall it. A reader task handles the requests in order; a writer task sends every answer
//! (immediate ones and those the table sends later: a permit granted after waiting, a launch
//! admitted). Accept errors (out of file descriptors) back off instead of spinning.

use std::ops::{Deref, DerefMut};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc::{channel, Receiver};

use super::connections::{Connections, Desk};
use super::launched::PinnedProcess;
use super::peer::{credentials, pin};
use crate::config::Config;
use crate::protocol::{Envelope, Request, Response, MAX_REQUEST_BYTES, PROTOCOL_VERSION};
use crate::reserve::{ConnId, Launched, Peer, Reservations};
use crate::status::StatusReport;

/// What the socket thread shares with the daemon loop.
pub struct Shared {
    desk: Mutex<Desk>,
    /// The daemon clock's zero.
    pub epoch: Instant,
    /// The latest status report the loop published (the table's rows are added when served).
    status: Mutex<Arc<StatusReport>>,
    pub proc_root: PathBuf,
    /// Wakes the loop (a request started waiting: fresh capacity helps it).
    wake: Box<dyn Fn() + Send + Sync>,
    /// Wakes the expiry task, which sleeps while nothing can expire.
    expiry: tokio::sync::Notify,
}

impl Shared {
    pub fn new(
        config: &Config,
        epoch: Instant,
        proc_root: PathBuf,
        wake: Box<dyn Fn() + Send + Sync>,
    ) -> Shared {
        Shared {
            desk: Mutex::new(Desk::new(config)),
            epoch,
            status: Mutex::new(Arc::default()),
            proc_root,
            wake,
            expiry: tokio::sync::Notify::new(),
        }
    }

    /// The reservation ledger; what it decides while held is delivered when it is let go. A
    /// panic elsewhere while it was held leaves it usable.
    pub fn table(&self) -> Table<'_> {
        Table(self.desk.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The daemon clock.
    pub fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    pub fn publish_status(&self, report: StatusReport) {
        *self.status.lock().unwrap_or_else(|e| e.into_inner()) = Arc::new(report);
    }

    /// The published report with the table's rows as they are now.
    fn status(&self) -> StatusReport {
        let published = self
            .status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut report = (*published).clone();
        let rows = self.table().rows(self.now());
        report.queue = rows.queue;
        report.leases = rows.leases;
        report.permits = rows.permits;
        report
    }
}

/// The ledger, held: derefs to it, and delivers its outbox when let go.
pub struct Table<'a>(MutexGuard<'a, Desk>);

impl Table<'_> {
    pub fn connections(&mut self) -> &mut Connections {
        &mut self.0.connections
    }

    /// A reloaded config, for the connections' caps and the ledger.
    pub fn reconfigure(&mut self, config: &Config) {
        self.0.configure(config);
    }
}

impl Deref for Table<'_> {
    type Target = Reservations;
    fn deref(&self) -> &Reservations {
        &self.0.ledger
    }
}

impl DerefMut for Table<'_> {
    fn deref_mut(&mut self) -> &mut Reservations {
        &mut self.0.ledger
    }
}

impl Drop for Table<'_> {
    fn drop(&mut self) {
        self.0.deliver();
    }
}

/// How long a new connection may take to send its first request.
const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Answers waiting for a client that does not read; beyond it the connection is closed (so a
/// connection holds at most this many answers of at most ~1 KiB, beside its 16 KiB request).
const REPLY_QUEUE: usize = 64;
/// How long one write of answers may wait for the client to read.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often waits and TTLs are checked.
const EXPIRY_TICK: Duration = Duration::from_millis(20);

/// Binds the socket (replacing a stale one) and serves it on `io` (the daemon's runtime) until
/// the process exits.
pub fn spawn(
    path: &Path,
    shared: Arc<Shared>,
    io: &tokio::runtime::Handle,
) -> anyhow::Result<SocketGuard> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    // Bound, then chmod'ed by name: only in a directory nobody else may write.
    crate::state_dir::check_parent(path).map_err(anyhow::Error::msg)?;
    if let Some(pid) = super::peer::server_of(path) {
        let by = pid.map_or("another process".into(), |p| format!("pid {p}"));
        anyhow::bail!(
            "{} is in use by {by} (another gpuguard daemon?): give this one a socket of its own \
             (--socket)",
            path.display()
        );
    }
    let _ = std::fs::remove_file(path);
    let std_listener = std::os::unix::net::UnixListener::bind(path)
        .with_context(|| format!("binding {}", path.display()))?;
    // Anyone may connect; what they may do is decided from their peer credentials.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    std_listener.set_nonblocking(true)?;
    io.spawn(async move {
        let listener = match UnixListener::from_std(std_listener) {
            Ok(l) => l,
            Err(e) => return tracing::error!("socket server: {e}"),
        };
        tokio::spawn(expire(shared.clone()));
        accept(listener, shared).await;
    });
    Ok(SocketGuard {
        path: path.to_path_buf(),
    })
}

async fn accept(listener: UnixListener, shared: Arc<Shared>) {
    let next_conn = AtomicU64::new(1);
    let mut backoff = Duration::from_millis(10);
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                backoff = Duration::from_millis(10);
                let conn = next_conn.fetch_add(1, Ordering::Relaxed);
                // Counted against the caps before anything else, here in the accept loop: a
                // connection over a cap is closed before the next one is accepted, so a flood
                // never holds more descriptors than the caps allow.
                let Ok((uid, pid)) = credentials(&stream) else {
                    continue;
                };
                let since = shared.now();
                if let Err(why) = shared.table().connections().connect(conn, uid) {
                    tracing::debug!(conn, uid, "socket: connection refused: {why}");
                    continue;
                }
                let shared = shared.clone();
                tokio::spawn(async move {
                    if let Err(e) = serve(stream, conn, uid, pid, since, &shared).await {
                        tracing::debug!(conn, "socket client: {e}");
                    }
                    let mut table = shared.table();
                    table.leave(conn, shared.now());
                    table.connections().disconnect(conn);
                });
            }
            Err(e) => {
                // EMFILE/ENFILE/ENOMEM: retrying at once would spin a core.
                tracing::warn!(
                    "socket: accept failed ({e}); retrying in {}",
                    crate::units::fmt_duration(backoff)
                );
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// Refuses requests whose wait is over and revokes permits past their TTL: every EXPIRY_TICK
/// while anything waits or holds a permit; otherwise it sleeps until a request comes (only a
/// request adds something that can expire), so an idle daemon does not wake 50 times a second.
async fn expire(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(EXPIRY_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // Registered before looking, so a request that comes meanwhile is not missed.
        let request = shared.expiry.notified();
        let pending = {
            let mut table = shared.table();
            table.expire(shared.now());
            table.can_expire()
        };
        if pending {
            tick.tick().await;
        } else {
            request.await;
            tick.reset();
        }
    }
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

/// One connection (counted against the caps already): its identity first, then its requests.
async fn serve(
    stream: UnixStream,
    conn: ConnId,
    uid: u32,
    pid: i32,
    since: Duration,
    shared: &Arc<Shared>,
) -> anyhow::Result<()> {
    let (peer, pidfd) = match pin(&stream, uid, pid, &shared.proc_root) {
        Ok(pinned) => pinned,
        Err(message) => {
            let (_, mut write) = stream.into_split();
            return write_line(&mut write, &Response::error(message)).await;
        }
    };
    let process: Arc<dyn Launched> = Arc::new(PinnedProcess {
        pidfd,
        id: peer.process(),
        proc_root: shared.proc_root.clone(),
    });
    let (tx, rx) = channel(REPLY_QUEUE);
    let (overflow, idle) = {
        let mut table = shared.table();
        table.join(conn, peer, since);
        let connections = table.connections();
        (
            connections.attach(conn, tx.clone()),
            connections.idle_timeout(),
        )
    };
    let (read, write) = stream.into_split();
    let mut writer = tokio::spawn(write_answers(write, rx));
    let mut reader = BufReader::new(read);
    let mut first = true;
    // Since when the connection has held nothing and waited for nothing: past `idle` it is
    // closed, whatever it sends meanwhile (a refused request or a cancel of nothing does not
    // keep a connection, and with it a share of the caps, open).
    let mut idle_since = tokio::time::Instant::now();
    let mut was_engaged = false;
    loop {
        let wait = if first {
            FIRST_REQUEST_TIMEOUT
        } else {
            idle.saturating_sub(idle_since.elapsed())
        };
        let read = tokio::select! {
            read = tokio::time::timeout(wait, read_line(&mut reader)) => read,
            () = overflow.notified() => {
                tracing::debug!(conn, "socket client leaves its answers unread: closing");
                break;
            }
            // The writer gave up on a client that does not read (WRITE_TIMEOUT).
            () = tx.closed() => break,
        };
        let line = match read {
            Err(_) if first => {
                let _ = tx
                    .send(Response::error("timed out waiting for a request".into()))
                    .await;
                break;
            }
            Err(_) if shared.table().engaged(conn) => {
                idle_since = tokio::time::Instant::now();
                was_engaged = true;
                continue;
            }
            Err(_) => break,
            Ok(Ok(None)) => break,
            Ok(Ok(Some(line))) => line,
            Ok(Err(message)) => {
                let _ = tx.send(Response::error(message)).await;
                break;
            }
        };
        first = false;
        let request = match parse(&line) {
            Ok(request) => request,
            Err(message) => {
                let _ = tx.send(Response::error(message)).await;
                break;
            }
        };
        let (answer, last, engaged) = handle(shared, conn, peer, &process, request);
        // The request may have added something with a deadline: the expiry task looks again.
        shared.expiry.notify_one();
        // Engaged, or just done with what it held: the idle time starts again.
        if engaged || was_engaged {
            idle_since = tokio::time::Instant::now();
        }
        was_engaged = engaged;
        if let Some(answer) = answer {
            if tx.send(answer).await.is_err() {
                break;
            }
        }
        if last {
            break;
        }
    }
    // Ends what the connection held, then lets the writer finish and close. The connection
    // stays counted against the caps until the caller's `disconnect`, after the writer is done:
    // a client that stops reading cannot hold descriptors outside the caps.
    {
        let mut table = shared.table();
        table.leave(conn, shared.now());
        table.connections().hang_up(conn);
    }
    drop(tx);
    if tokio::time::timeout(WRITE_TIMEOUT, &mut writer)
        .await
        .is_err()
    {
        writer.abort();
    }
    Ok(())
}

/// One request under the table's lock: its answer (`None`: it comes later, from the table),
/// whether it is the connection's last, and whether the connection is engaged after it
/// (holds or waits for something).
fn handle(
    shared: &Shared,
    conn: ConnId,
    peer: Peer,
    process: &Arc<dyn Launched>,
    request: Request,
) -> (Option<Response>, bool, bool) {
    let now = shared.now();
    match request {
        Request::Status => (
            Some(Response::Status(Box::new(shared.status()))),
            true,
            false,
        ),
        Request::Release { lease } => (
            Some(shared.table().release_lease(peer, lease, now)),
            true,
            false,
        ),
        Request::Launch(launch) => {
            let (answer, engaged) = {
                let mut table = shared.table();
                let answer = table.launch(conn, launch, process.clone(), now);
                (answer, table.engaged(conn))
            };
            let waits = matches!(answer, None | Some(Response::Queued { .. }));
            if waits {
                (shared.wake)();
            }
            // A waiting launch keeps the connection: its answer comes from the table.
            (answer, !waits, engaged)
        }
        Request::Acquire(mut acquire) => {
            acquire.cache_age = acquire.cache_read_at_ns.map(monotonic_age);
            let (answer, engaged) = {
                let mut table = shared.table();
                let answer = table.acquire(conn, acquire, now);
                (answer, table.engaged(conn))
            };
            if answer.is_none() {
                (shared.wake)();
            }
            (answer, false, engaged)
        }
        Request::ReleasePermit { id, permit } => {
            let (answer, engaged, fresh_wanted) = {
                let mut table = shared.table();
                let answer = table.release_permit(conn, id, permit, now);
                (answer, table.engaged(conn), table.wants_fresh_gpu())
            };
            if fresh_wanted {
                // Others wait: the reading that shows what became of its memory, now.
                (shared.wake)();
            }
            (Some(answer), false, engaged)
        }
        Request::Cancel { id } => {
            let mut table = shared.table();
            let answer = table.cancel(conn, id);
            (answer, false, table.engaged(conn))
        }
    }
}

/// Sends the answers in order; a launch's final answer ends the connection.
async fn write_answers(mut write: tokio::net::unix::OwnedWriteHalf, mut rx: Receiver<Response>) {
    let mut buf = Vec::with_capacity(4096);
    while let Some(answer) = rx.recv().await {
        // Everything queued goes out in one write (under load, answers come in bursts).
        let mut last = false;
        let mut next = Some(answer);
        while let Some(answer) = next {
            last |= matches!(
                answer,
                Response::Admitted { .. } | Response::TimedOut { .. }
            );
            if serde_json::to_writer(&mut buf, &answer).is_err() {
                return;
            }
            buf.push(b'\n');
            next = if last { None } else { rx.try_recv().ok() };
        }
        // A client that does not read its answers is closed, not waited for.
        match tokio::time::timeout(WRITE_TIMEOUT, write.write_all(&buf)).await {
            Ok(Ok(())) if !last => {}
            _ => break,
        }
        buf.clear();
    }
    let _ = write.shutdown().await;
}

/// One line of at most MAX_REQUEST_BYTES; `None` at the end of the stream.
async fn read_line<R: tokio::io::AsyncBufRead + Unpin>(
    reader: &mut R,
) -> Result<Option<String>, String> {
    let mut buf = Vec::new();
    let mut limited = reader.take(MAX_REQUEST_BYTES as u64 + 1);
    let n = limited
        .read_until(b'\n', &mut buf)
        .await
        .map_err(|e| format!("read error: {e}"))?;
    if n == 0 {
        return Ok(None);
    }
    if buf.len() > MAX_REQUEST_BYTES {
        return Err(format!("message longer than {MAX_REQUEST_BYTES} bytes"));
    }
    if buf.last() != Some(&b'\n') {
        return Err("incomplete message (no newline)".into());
    }
    String::from_utf8(buf)
        .map(Some)
        .map_err(|_| "message is not UTF-8".into())
}

fn parse(line: &str) -> Result<Request, String> {
    // The common case in one pass; the slow path below only explains what is wrong.
    if let Ok(envelope) = serde_json::from_str::<Envelope>(line) {
        if envelope.version == PROTOCOL_VERSION {
            return Ok(envelope.request);
        }
    }
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

async fn write_line(
    write: &mut tokio::net::unix::OwnedWriteHalf,
    response: &Response,
) -> anyhow::Result<()> {
    let mut line = serde_json::to_vec(response)?;
    line.push(b'\n');
    write.write_all(&line).await?;
    Ok(())
}

/// How long ago `read_at_ns` (CLOCK_MONOTONIC, from a client on this host) was; a time still to
/// come is now.
fn monotonic_age(read_at_ns: u64) -> Duration {
    monotonic_now().saturating_sub(Duration::from_nanos(read_at_ns))
}

fn monotonic_now() -> Duration {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_read_time_is_read_on_the_clients_clock_and_never_in_the_future() {
        // Python's time.monotonic_ns() is CLOCK_MONOTONIC, as here.
        let five_seconds_ago = monotonic_now().as_nanos() as u64 - 5_000_000_000;
        assert!(monotonic_age(five_seconds_ago) >= Duration::from_secs(5));
        assert_eq!(monotonic_age(u64::MAX), Duration::ZERO);
    }

    /// A connection served as the accept loop serves it, on the test's paused clock; the
    /// client's end is returned.
    fn connection(shared: &Arc<Shared>) -> tokio::io::BufReader<UnixStream> {
        served(shared).0
    }

    /// `connection`, with the task that serves it.
    fn served(
        shared: &Arc<Shared>,
    ) -> (
        tokio::io::BufReader<UnixStream>,
        tokio::task::JoinHandle<anyhow::Result<()>>,
    ) {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let conn = NEXT.fetch_add(1, Ordering::Relaxed);
        let (client, server) = UnixStream::pair().unwrap();
        let (uid, pid) = credentials(&server).unwrap();
        shared.table().connections().connect(conn, uid).unwrap();
        let shared = shared.clone();
        let task =
            tokio::spawn(async move { serve(server, conn, uid, pid, shared.now(), &shared).await });
        (tokio::io::BufReader::new(client), task)
    }

    /// Everything the server answers to `bytes` on a connection of its own (the client's write
    /// side shut after them when `close_write`), up to the server closing it.
    async fn exchange(shared: &Arc<Shared>, bytes: &[u8], close_write: bool) -> String {
        let mut client = connection(shared);
        let _ = client.get_mut().write_all(bytes).await;
        if close_write {
            let _ = client.get_mut().shutdown().await;
        }
        let mut answer = Vec::new();
        let _ = client.read_to_end(&mut answer).await;
        String::from_utf8_lossy(&answer).into_owned()
    }

    /// What a local user can write that is not a request is answered with an error naming what
    /// was wrong, and the connection closed; the server goes on answering others. A client that
    /// says nothing is closed after the first request's timeout.
    #[tokio::test(start_paused = true)]
    async fn garbage_on_the_socket_is_answered_with_what_was_wrong_and_closed() {
        let shared = shared("");
        let cases: Vec<(Vec<u8>, bool, &str)> = vec![
            (b"hello\n".to_vec(), false, "not JSON"),
            (
                b"{\"version\":1,\"type\":\"format_disk\"}\n".to_vec(),
                false,
                "bad request",
            ),
            (
                b"{\"version\":99,\"type\":\"status\"}\n".to_vec(),
                false,
                "protocol version 99 not supported",
            ),
            (
                b"{\"type\":\"status\"}\n".to_vec(),
                false,
                "missing protocol version",
            ),
            (
                b"{\"version\":1,\"type\":\"sta".to_vec(),
                true,
                "incomplete message",
            ),
            (
                vec![b'x'; MAX_REQUEST_BYTES + 10],
                false,
                "message longer than",
            ),
            (vec![0xff, 0xfe, b'\n'], false, "not UTF-8"),
            (Vec::new(), false, "timed out waiting for a request"),
        ];
        for (bytes, close_write, want) in cases {
            let answer = exchange(&shared, &bytes, close_write).await;
            assert!(
                answer.contains(r#""type":"error""#),
                "{want:?}: got {answer:?}"
            );
            assert!(answer.contains(want), "{want:?}: got {answer:?}");
        }
        let status = exchange(&shared, STATUS, false).await;
        assert!(status.contains(r#""schema_version""#), "{status}");
    }

    /// Any line a local user sends (requests of every kind with odd values, or random bytes)
    /// leaves the server answering the next client: nothing panics its task or wedges the table.
    #[tokio::test(start_paused = true)]
    async fn any_socket_line_leaves_the_server_answering() {
        use proptest::strategy::{Strategy, ValueTree};
        // Room for every case's two connections, closed or not by then, for whoever runs it
        // (accounts other than root share max_connections less root's share).
        let shared = shared("[clients]\nmax_connections = 4096\nmax_connections_per_uid = 1024\n");
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        for _ in 0..256 {
            let mut line = crate::properties::ipc_line()
                .new_tree(&mut runner)
                .unwrap()
                .current();
            line.retain(|&b| b != b'\n');
            line.push(b'\n');
            // Valid launches and permits that do not fit wait: their answer is not awaited.
            let (mut client, task) = served(&shared);
            client.get_mut().write_all(&line).await.unwrap();
            let mut status = connection(&shared);
            send(&mut status, std::str::from_utf8(STATUS).unwrap()).await;
            let answer = answer(&mut status).await.unwrap_or_default();
            assert!(
                answer.contains(r#""schema_version""#),
                "after {line:?}: {answer}"
            );
            // The client leaves: its connection's task ends without a panic.
            drop(client);
            let ended = task.await;
            assert!(
                ended.is_ok(),
                "after {:?}: {ended:?}",
                String::from_utf8_lossy(&line)
            );
        }
    }

    fn shared(config: &str) -> Arc<Shared> {
        let config = Config::parse(config, Path::new("test.toml")).unwrap();
        Arc::new(Shared::new(
            &config,
            Instant::now(),
            "/proc".into(),
            Box::new(|| {}),
        ))
    }

    async fn send(client: &mut tokio::io::BufReader<UnixStream>, line: &str) {
        client.get_mut().write_all(line.as_bytes()).await.unwrap();
    }

    /// The next line from the server, or None at end of file.
    async fn answer(client: &mut tokio::io::BufReader<UnixStream>) -> Option<String> {
        let mut line = String::new();
        let n = client.read_line(&mut line).await.unwrap();
        (n > 0).then_some(line)
    }

    /// Round three: a refused acquire and then a cancel of nothing every 20 s kept a connection
    /// (and its share of the caps) open forever. A connection that holds and waits for nothing
    /// is closed `idle_timeout` after it last did, whatever it sends meanwhile.
    #[tokio::test(start_paused = true)]
    async fn a_connection_that_holds_nothing_is_closed_after_idle_timeout_whatever_it_sends() {
        let shared = shared("[clients]\nidle_timeout = \"10s\"\n");
        let mut client = connection(&shared);
        let start = tokio::time::Instant::now();
        send(&mut client, ACQUIRE_NO_SUCH_MODEL).await;
        let refused = answer(&mut client).await.unwrap();
        assert!(refused.contains(r#""type":"refused""#), "{refused}");
        // A cancel of nothing every 3 s: no answer, and no new lease of life.
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_secs(3)).await;
            send(&mut client, CANCEL_NOTHING).await;
        }
        assert_eq!(answer(&mut client).await, None, "closed, not answered");
        assert_eq!(
            start.elapsed(),
            Duration::from_secs(10),
            "closed at idle_timeout"
        );
    }

    /// A connection waiting for a permit is engaged: it stays open past `idle_timeout`, and its
    /// idle time starts when it stops waiting.
    #[tokio::test(start_paused = true)]
    async fn a_connection_that_waits_for_a_permit_outlives_idle_timeout() {
        // The host-wide pool is root's unless `permits.users` names the account: the test's
        // own account is named so that it waits, whoever runs it (plain `cargo test` as a user).
        let me = rustix::process::geteuid().as_raw();
        let shared = shared(&format!(
            "[clients]\nidle_timeout = \"2s\"\n[permits]\nusers = [\"{me}\"]\n"
        ));
        let mut client = connection(&shared);
        let start = tokio::time::Instant::now();
        send(&mut client, ACQUIRE_WAITING_30S).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
        send(&mut client, CANCEL_WAITING).await;
        let cancelled = answer(&mut client).await.unwrap();
        assert!(cancelled.contains(r#""id":5"#), "{cancelled}");
        assert_eq!(start.elapsed(), Duration::from_secs(5), "{cancelled}");
        assert_eq!(answer(&mut client).await, None, "closed, not answered");
        assert_eq!(
            start.elapsed(),
            Duration::from_secs(7),
            "closed 2 s after it stopped waiting"
        );
    }

    const STATUS: &[u8] = b"{\"version\":1,\"type\":\"status\"}\n";
    const ACQUIRE_NO_SUCH_MODEL: &str =
        "{\"version\":1,\"type\":\"acquire\",\"id\":1,\"model\":\"no-such-model\"}\n";
    const CANCEL_NOTHING: &str = "{\"version\":1,\"type\":\"cancel\",\"id\":99}\n";
    const CANCEL_WAITING: &str = "{\"version\":1,\"type\":\"cancel\",\"id\":5}\n";
    const ACQUIRE_WAITING_30S: &str =
        "{\"version\":1,\"type\":\"acquire\",\"id\":5,\"gpu_bytes\":1024,\"timeout_ms\":30000}\n";
}
