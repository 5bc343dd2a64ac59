//! One `[[alert.webhook]]`: a worker thread that formats each notice (gpuguard JSON with a
//! Slack-compatible `text`, Slack, or Alertmanager's v2 API), signs it (HMAC-SHA256 keyed by the
//! sink's `secret_file`, in `X-Gpuguard-Signature: sha256=<hex>`) and posts it, retrying network
//! errors, 429 (after its Retry-After) and 5xx with exponential backoff and jitter.
//!
//! The URL can hold a secret (Slack's do) and so does the key: logs show only the URL's scheme
//! and host.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use hmac::{Hmac, KeyInit, Mac};
use prometheus_client::metrics::counter::Counter;
use serde_json::{json, Value};
use sha2::Sha256;
use tracing::{debug, warn};

use super::queue::Queue;
use super::{Notice, Status, ALERTMANAGER_REFRESH};
use crate::config::{AlertConfig, WebhookConfig, WebhookFormat};
use crate::metrics::SinkCounters;

/// The signature header: `sha256=` and the hex HMAC-SHA256 of the body.
pub const SIGNATURE_HEADER: &str = "X-Gpuguard-Signature";
/// The longest wait between two attempts, and the most of a Retry-After that is honoured.
const MAX_BACKOFF: Duration = Duration::from_secs(300);
/// One-off events stay this long in Alertmanager.
const ALERTMANAGER_EVENT_TTL: Duration = Duration::from_secs(300);

struct Sink {
    name: String,
    url: String,
    redacted: String,
    format: WebhookFormat,
    key: Option<Vec<u8>>,
    agent: ureq::Agent,
    retries: u32,
    backoff: Duration,
    sent: Counter,
    failed: Counter,
    rng: u64,
}

/// What a webhook sink is: a reload that leaves it the same keeps its worker and queue.
#[derive(Clone, PartialEq, Eq)]
pub struct Spec {
    index: usize,
    name: String,
    url: String,
    redacted: String,
    format: WebhookFormat,
    key: Option<Vec<u8>>,
    timeout: Duration,
    retries: u32,
    backoff: Duration,
    queue: usize,
}

impl Spec {
    /// Reads the secret: fails if `secret_file` cannot be read or is empty.
    pub fn new(index: usize, config: &WebhookConfig, alert: &AlertConfig) -> anyhow::Result<Spec> {
        let name = format!("alert.webhook[{index}] ({})", config.redacted_url());
        let key = match &config.secret_file {
            Some(path) => Some(read_secret(path).map_err(|e| anyhow::anyhow!("{name}: {e}"))?),
            None => None,
        };
        let url = match config.format {
            WebhookFormat::Alertmanager => alertmanager_url(&config.url),
            _ => config.url.trim().to_string(),
        };
        Ok(Spec {
            index,
            name,
            url,
            redacted: config.redacted_url(),
            format: config.format,
            key,
            timeout: alert.timeout,
            retries: alert.retries,
            backoff: alert.backoff,
            queue: alert.queue,
        })
    }
}

/// Opens a secret file for reading without waiting (a FIFO in its place does not block).
pub fn open_secret(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY)
        .open(path)
}

/// The most a secret file may hold.
const MAX_SECRET_BYTES: u64 = 4096;

/// A webhook's signing secret: the file's bytes without trailing whitespace; an error if it
/// cannot be read or holds nothing (checked at start, by `check-config` and on reload). Opened
/// without waiting (a FIFO put in its place must not hang the daemon or its reload), and only
/// a regular file of root's (or this user's) that nobody else may write, of at most 4 KiB, is
/// read: another account's file is a key that account knows.
pub fn read_secret(path: &std::path::Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let shown = path.display();
    let file =
        open_secret(path).map_err(|e| format!("secret_file '{shown}' cannot be read: {e}"))?;
    let m = file
        .metadata()
        .map_err(|e| format!("secret_file '{shown}' cannot be read: {e}"))?;
    let me = rustix::process::geteuid().as_raw();
    if !m.is_file() {
        return Err(format!("secret_file '{shown}' is not a regular file"));
    }
    if (m.uid() != 0 && m.uid() != me) || m.mode() & 0o022 != 0 {
        return Err(format!(
            "secret_file '{shown}' is not root's alone (owner uid {}, mode {:04o}): another \
             account could choose the key",
            m.uid(),
            m.mode() & 0o7777
        ));
    }
    if m.len() > MAX_SECRET_BYTES {
        return Err(format!(
            "secret_file '{shown}' holds {} bytes: a secret is at most {MAX_SECRET_BYTES}",
            m.len()
        ));
    }
    let mut text = Vec::new();
    file.take(MAX_SECRET_BYTES)
        .read_to_end(&mut text)
        .map_err(|e| format!("secret_file '{shown}' cannot be read: {e}"))?;
    let trimmed = text.trim_ascii_end().to_vec();
    if trimmed.is_empty() {
        return Err(format!("secret_file '{shown}' is empty"));
    }
    Ok(trimmed)
}

impl Spec {
    pub fn format(&self) -> WebhookFormat {
        self.format
    }
}

/// Starts the sink's worker. It ends when its queue is closed and empty, or at once (after the
/// request in flight) when the queue is abandoned.
pub fn start(spec: &Spec, queue: Arc<Queue<Notice>>, counters: SinkCounters) -> anyhow::Result<()> {
    let agent = crate::http::agent(spec.timeout);
    let mut sink = Sink {
        name: spec.name.clone(),
        url: spec.url.clone(),
        redacted: spec.redacted.clone(),
        format: spec.format,
        key: spec.key.clone(),
        agent,
        retries: spec.retries,
        backoff: spec.backoff,
        sent: counters.sent,
        failed: counters.failed,
        rng: seed(spec.index),
    };
    std::thread::Builder::new()
        .name(format!("webhook-{}", spec.index))
        .spawn(move || {
            while let Some(notice) = queue.pop() {
                sink.deliver(&notice, &queue);
                queue.done();
            }
        })?;
    Ok(())
}

/// `http://host:9093` -> `http://host:9093/api/v2/alerts` (a full API URL is kept).
fn alertmanager_url(url: &str) -> String {
    let url = url.trim().trim_end_matches('/');
    if url.ends_with("/api/v2/alerts") {
        url.to_string()
    } else {
        format!("{url}/api/v2/alerts")
    }
}

fn seed(index: usize) -> u64 {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    (nanos ^ (u64::from(std::process::id()) << 32) ^ index as u64) | 1
}

/// What one attempt came to.
enum Attempt {
    Delivered,
    /// Worth another try, after at least this long (Retry-After) if given.
    Retry(String, Option<Duration>),
    /// Retrying will not help (4xx other than 429).
    Rejected(String),
}

impl Sink {
    fn deliver(&mut self, notice: &Notice, queue: &Queue<Notice>) {
        let body = match self.body(notice) {
            Ok(b) => b,
            Err(e) => {
                warn!("{}: cannot encode the notice: {e}", self.name);
                return;
            }
        };
        let signature = self.key.as_deref().map(|key| sign(key, &body));
        let mut attempt = 0;
        loop {
            match self.attempt(&body, signature.as_deref()) {
                Attempt::Delivered => {
                    self.sent.inc();
                    debug!(
                        "{}: delivered {} {:?}",
                        self.name, notice.event, notice.status
                    );
                    return;
                }
                Attempt::Rejected(why) => {
                    self.failed.inc();
                    warn!("{}: {} notice rejected: {why}", self.name, notice.event);
                    return;
                }
                Attempt::Retry(why, _) if attempt >= self.retries => {
                    self.failed.inc();
                    warn!(
                        "{}: giving up on the {} notice after {} attempt(s): {why}",
                        self.name,
                        notice.event,
                        attempt + 1
                    );
                    return;
                }
                Attempt::Retry(why, after) => {
                    let wait = wait_before_retry(after, self.backoff, attempt, &mut self.rng);
                    debug!(
                        "{}: attempt {} failed ({why}); retrying in {}",
                        self.name,
                        attempt + 1,
                        crate::units::fmt_duration(wait)
                    );
                    if !queue.pause(wait) {
                        debug!("{}: replaced by a reload; not retrying", self.name);
                        return;
                    }
                    attempt += 1;
                }
            }
        }
    }

    fn attempt(&self, body: &[u8], signature: Option<&str>) -> Attempt {
        let mut request = self
            .agent
            .post(&self.url)
            .header("Content-Type", "application/json");
        if let Some(signature) = signature {
            request = request.header(SIGNATURE_HEADER, signature);
        }
        match request.send(body) {
            Ok(response) => {
                let status = response.status().as_u16();
                match status {
                    200..=299 => Attempt::Delivered,
                    429 | 500..=599 => Attempt::Retry(
                        format!("HTTP {status}"),
                        retry_after(
                            response
                                .headers()
                                .get("retry-after")
                                .and_then(|v| v.to_str().ok()),
                        ),
                    ),
                    _ => Attempt::Rejected(format!("HTTP {status}")),
                }
            }
            // ureq's errors may quote the URL: keep only its host.
            Err(e) => Attempt::Retry(e.to_string().replace(&self.url, &self.redacted), None),
        }
    }

    fn body(&self, n: &Notice) -> serde_json::Result<Vec<u8>> {
        let value = match self.format {
            WebhookFormat::Json => {
                let mut v = serde_json::to_value(n)?;
                v["version"] = json!(1);
                v["text"] = json!(n.text());
                v
            }
            WebhookFormat::Slack => json!({ "text": n.text() }),
            WebhookFormat::Alertmanager => alertmanager_body(n),
        };
        serde_json::to_vec(&value)
    }
}

/// How long to wait before attempt `attempt + 1`: the server's Retry-After where it gave one,
/// else exponential backoff with jitter (between half and all of `backoff * 2^attempt`); never
/// more than `MAX_BACKOFF`. `rng` is the sink's xorshift64 state (jitter needs no more).
fn wait_before_retry(
    after: Option<Duration>,
    backoff: Duration,
    attempt: u32,
    rng: &mut u64,
) -> Duration {
    let wait = after.unwrap_or_else(|| {
        let full = backoff
            .saturating_mul(1u32 << attempt.min(16))
            .min(MAX_BACKOFF);
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        let fraction = (*rng % 1000) as f64 / 1000.0;
        full.mul_f64(0.5 + fraction / 2.0)
    });
    wait.min(MAX_BACKOFF)
}

/// A Retry-After header in seconds (its HTTP-date form is not honoured: backoff applies).
fn retry_after(header: Option<&str>) -> Option<Duration> {
    header
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs)
}

/// The HMAC-SHA256 of `body` keyed by `key`, as the header carries it.
pub fn sign(key: &[u8], body: &[u8]) -> String {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(key).expect("HMAC takes any key");
    mac.update(body);
    let digest = mac.finalize().into_bytes();
    let mut hex = String::with_capacity(7 + digest.len() * 2);
    hex.push_str("sha256=");
    for b in digest {
        hex.push_str(&format!("{b:02x}"));
    }
    hex
}

/// Alertmanager's v2 body: one alert, its labels the identity (same labels = same alert).
fn alertmanager_body(n: &Notice) -> Value {
    let rfc3339 = super::rfc3339_millis;
    let mut labels = serde_json::Map::new();
    labels.insert("alertname".into(), json!(n.event));
    labels.insert("host".into(), json!(n.host));
    labels.insert("instance".into(), json!(n.host));
    labels.insert("severity".into(), json!(n.severity.as_str()));
    labels.insert("key".into(), json!(n.key));
    labels.insert("job".into(), json!("gpuguard"));
    if let Some(model) = &n.subject.model {
        labels.insert("model".into(), json!(model));
    }
    if let Some(resource) = &n.subject.resource {
        labels.insert("resource".into(), json!(resource));
    }
    let ends = match (n.status, n.kind) {
        (Status::Resolved, _) => n.at,
        (Status::Firing, "event") => n.at + ALERTMANAGER_EVENT_TTL,
        (Status::Firing, _) => n.at + 3 * ALERTMANAGER_REFRESH,
    };
    let mut annotations = serde_json::Map::new();
    annotations.insert("summary".into(), json!(n.summary));
    annotations.insert("description".into(), json!(n.text()));
    if let Ok(subject) = serde_json::to_string(&n.subject) {
        annotations.insert("subject".into(), json!(subject));
    }
    if let Some(a) = &n.action {
        annotations.insert(
            "action".into(),
            json!(format!("{} ({}): {}", a.verb, a.outcome, a.detail)),
        );
    }
    json!([{
        "labels": labels,
        "annotations": annotations,
        "startsAt": rfc3339(n.since),
        "endsAt": rfc3339(ends),
    }])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Round five (a hostile review of issue 40): a secret file another account could swap
    /// hung root's check-config and daemon (a FIFO), or ate its memory (`/dev/zero`). Only a
    /// regular file of root's that nobody else may write, of at most 4 KiB, is read, without
    /// waiting.
    #[test]
    fn a_secret_is_read_only_from_a_small_regular_file_nobody_else_may_write() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good");
        std::fs::write(&good, "s3cret\n").unwrap();
        std::fs::set_permissions(&good, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_secret(&good).unwrap(), b"s3cret");

        let fifo = dir.path().join("fifo");
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        let e = read_secret(&fifo).unwrap_err();
        assert!(e.contains("is not a regular file"), "{e}");

        let zero = dir.path().join("zero");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let e = read_secret(&zero).unwrap_err();
        assert!(e.contains("is not a regular file"), "{e}");

        let big = dir.path().join("big");
        std::fs::write(&big, vec![b'x'; 8192]).unwrap();
        std::fs::set_permissions(&big, std::fs::Permissions::from_mode(0o600)).unwrap();
        let e = read_secret(&big).unwrap_err();
        assert!(e.contains("holds 8192 bytes"), "{e}");

        let open = dir.path().join("open");
        std::fs::write(&open, "s3cret").unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = read_secret(&open).unwrap_err();
        assert!(e.contains("not root's alone (owner uid"), "{e}");
        if rustix::process::geteuid().is_root() {
            std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o600)).unwrap();
            rustix::fs::chown(&open, Some(rustix::fs::Uid::from_raw(65534)), None).unwrap();
            let e = read_secret(&open).unwrap_err();
            assert!(e.contains("owner uid 65534"), "{e}");
        }
    }

    #[test]
    fn signature_matches_a_known_hmac_sha256() {
        // RFC 4231 test case 2.
        assert_eq!(
            sign(b"Jefe", b"what do ya want for nothing?"),
            "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    /// A 429's Retry-After is what the sink waits (up to its cap); without one, each retry
    /// backs off exponentially with jitter, never below half the step nor above it or the cap.
    #[test]
    fn a_retry_waits_as_long_as_the_server_asks_else_backs_off() {
        let mut rng = seed(0);
        let base = Duration::from_millis(100);
        assert_eq!(retry_after(Some(" 1 ")), Some(Duration::from_secs(1)));
        assert_eq!(retry_after(Some("Wed, 21 Oct 2015 07:28:00 GMT")), None);
        assert_eq!(retry_after(Some("-1")), None);
        assert_eq!(retry_after(None), None);
        assert_eq!(
            wait_before_retry(retry_after(Some("1")), base, 0, &mut rng),
            Duration::from_secs(1)
        );
        assert_eq!(
            wait_before_retry(retry_after(Some("86400")), base, 0, &mut rng),
            MAX_BACKOFF
        );
        let mut seen = std::collections::BTreeSet::new();
        for attempt in 0..24u32 {
            for _ in 0..50 {
                let wait = wait_before_retry(None, base, attempt, &mut rng);
                let full = base.saturating_mul(1 << attempt.min(16)).min(MAX_BACKOFF);
                assert!(wait >= full / 2 && wait <= full, "{attempt}: {wait:?}");
                seen.insert(wait);
            }
        }
        // Jittered: not the same wait every time.
        assert!(seen.len() > 24 * 10, "{}", seen.len());
    }

    #[test]
    fn alertmanager_url_gets_the_v2_path_once() {
        assert_eq!(
            alertmanager_url("http://127.0.0.1:9093/"),
            "http://127.0.0.1:9093/api/v2/alerts"
        );
        assert_eq!(
            alertmanager_url("http://am:9093/api/v2/alerts"),
            "http://am:9093/api/v2/alerts"
        );
    }
}
