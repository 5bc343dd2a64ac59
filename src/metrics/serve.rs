//! `GET /metrics` on `[metrics] listen`, a task of its own on the daemon's runtime: OpenMetrics
//! for a scraper that asks for it, the classic text format 0.0.4 for anyone else, a few
//! connections at a time. Also the probes `/healthz` and `/readyz` (`probes.rs`).

use super::*;

/// OpenMetrics -> text format 0.0.4: counters are named with their `_total` in HELP/TYPE, and
/// `# UNIT` and `# EOF` go.
pub(super) fn to_text_format(om: &str) -> String {
    let counters: BTreeSet<&str> = om
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(om.len());
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let rewritten = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{prefix}{name}_total {tail}"))
        });
        let _ = writeln!(out, "{}", rewritten.as_deref().unwrap_or(line));
    }
    out
}

/// How long a scraper may take to send its request headers: Prometheus sends them at once, so a
/// connection still silent after this is closed.
pub(super) const HEADER_TIMEOUT: Duration = Duration::from_secs(1);
/// How long writing the answer may take.
pub(super) const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
pub(super) const MAX_REQUEST_BYTES: usize = 8192;

/// Connections served at once. When all are taken, a new one closes the oldest that has not
/// sent its whole request yet (idle connections cannot keep scrapes out); only when every slot
/// is answering a request is the new one closed.
pub(super) const MAX_CONNECTIONS: usize = 32;

/// The open connections, by arrival: `Some` (the way to close it) while a connection still reads
/// its request, `None` once it is being answered.
#[derive(Default)]
pub(super) struct Slots {
    pub(super) open: std::collections::BTreeMap<u64, Option<tokio::sync::oneshot::Sender<()>>>,
    next: u64,
}

impl Slots {
    /// A slot for a new connection (its number and what closes it), closing the oldest
    /// connection still reading its request when all are taken; None when every slot is busy
    /// answering.
    pub(super) fn take(&mut self, max: usize) -> Option<(u64, tokio::sync::oneshot::Receiver<()>)> {
        if self.open.len() >= max {
            let oldest = self
                .open
                .iter()
                .find(|(_, r)| r.is_some())
                .map(|(id, _)| *id)?;
            if let Some(Some(close)) = self.open.remove(&oldest) {
                let _ = close.send(());
            }
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.next += 1;
        self.open.insert(self.next, Some(tx));
        Some((self.next, rx))
    }
}

/// A connection's slot: given back when the connection ends (unless it was closed to make room,
/// which gave it back already).
pub(super) struct Slot {
    slots: Arc<Mutex<Slots>>,
    id: u64,
}

impl Slot {
    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The request is in: the connection may no longer be closed to make room.
    fn answering(&self) {
        if let Some(entry) = self.lock().open.get_mut(&self.id) {
            *entry = None;
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let id = self.id;
        self.lock().open.remove(&id);
    }
}

/// Serves `/metrics` on `listener` (bound by the start's checks) on `io` (the daemon's
/// runtime, shared with the socket: a task of its own, so a panic here ends the endpoint alone)
/// until the process exits; returns the address it listens on.
pub fn serve(
    listener: std::net::TcpListener,
    metrics: Metrics,
    io: &tokio::runtime::Handle,
) -> anyhow::Result<SocketAddr> {
    listener.set_nonblocking(true)?;
    let bound = listener.local_addr()?;
    io.spawn(async move {
        let listener = match tokio::net::TcpListener::from_std(listener) {
            Ok(l) => l,
            Err(e) => return tracing::error!("metrics server: {e}"),
        };
        let slots = Arc::new(Mutex::new(Slots::default()));
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                // Out of file descriptors: wait rather than spin.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            // Over the cap the oldest idle connection makes room; if every slot is answering,
            // the new connection is closed at once: idle scrapers can neither use up the
            // daemon's file descriptors nor keep scrapes out.
            let taken = slots
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(MAX_CONNECTIONS);
            let Some((id, closed)) = taken else {
                drop(stream);
                continue;
            };
            let slot = Slot {
                slots: slots.clone(),
                id,
            };
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let _ = connection(stream, slot, closed, &metrics).await;
            });
        }
    });
    Ok(bound)
}

/// One connection: its request within `HEADER_TIMEOUT` (or until it is closed to make room),
/// then its answer within `ANSWER_TIMEOUT`.
pub(super) async fn connection(
    mut stream: tokio::net::TcpStream,
    slot: Slot,
    closed: tokio::sync::oneshot::Receiver<()>,
    metrics: &Metrics,
) -> std::io::Result<()> {
    let request = tokio::select! {
        _ = closed => return Ok(()),
        read = tokio::time::timeout(HEADER_TIMEOUT, read_request(&mut stream)) => match read {
            Ok(Ok(Some(request))) => request,
            _ => return Ok(()),
        },
    };
    slot.answering();
    let _ = tokio::time::timeout(ANSWER_TIMEOUT, answer(stream, &request, metrics)).await;
    drop(slot);
    Ok(())
}

/// The request head, up to its blank line; None if the peer closed or sent too much first.
pub(super) async fn read_request(
    stream: &mut tokio::net::TcpStream,
) -> std::io::Result<Option<Vec<u8>>> {
    let mut request = Vec::new();
    let mut buf = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf).await?;
        if n == 0 || request.len() + n > MAX_REQUEST_BYTES {
            return Ok(None);
        }
        request.extend_from_slice(&buf[..n]);
    }
    Ok(Some(request))
}

/// One response, then close.
pub(super) async fn answer(
    mut stream: tokio::net::TcpStream,
    request: &[u8],
    metrics: &Metrics,
) -> std::io::Result<()> {
    let request = String::from_utf8_lossy(request);
    let mut lines = request.lines();
    let first = lines.next().unwrap_or("");
    let mut parts = first.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let openmetrics = lines.any(|l| {
        l.to_ascii_lowercase().starts_with("accept:") && l.contains("application/openmetrics-text")
    });
    let path = target.split('?').next().unwrap_or("");
    let (status, content_type, body) = match (method, path) {
        ("GET" | "HEAD", "/metrics") if openmetrics => (
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.openmetrics(),
        ),
        ("GET" | "HEAD", "/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            metrics.text(),
        ),
        ("GET" | "HEAD", "/healthz" | "/readyz") => {
            let now = std::time::Instant::now();
            let probe = match path {
                "/healthz" => metrics.probes.health(now),
                _ => metrics.probes.ready(now),
            };
            (probe.status(), "text/plain; charset=utf-8", probe.body)
        }
        ("GET" | "HEAD", "/") => (
            "200 OK",
            "text/plain; charset=utf-8",
            "gpuguard: metrics at /metrics, probes at /healthz and /readyz\n".to_string(),
        ),
        ("GET" | "HEAD", _) => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "not found\n".to_string(),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain; charset=utf-8",
            "only GET\n".to_string(),
        ),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    if method != "HEAD" {
        stream.write_all(body.as_bytes()).await?;
    }
    stream.shutdown().await
}
