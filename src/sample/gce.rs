//! Google Compute Engine's notices of what is about to happen to the VM, from its metadata
//! server: `instance/maintenance-event` (`NONE`, or `TERMINATE_ON_HOST_MAINTENANCE` about an
//! hour ahead for GPU VMs, which cannot live-migrate; `MIGRATE_ON_HOST_MAINTENANCE` elsewhere)
//! and `instance/preempted` (`TRUE` about 30 s before a Spot or preemptible VM is stopped), and
//! where the server has it `instance/upcoming-maintenance` (JSON: `type`, `maintenance_status`
//! `PENDING` or `ONGOING`, `window_start_time`, `window_end_time`, `can_reschedule`; a 404 when
//! none is planned), which tells of scheduled maintenance days ahead.
//! One thread per key, each a long poll as Google documents it: a first plain read for the value
//! and its `ETag`, then `?wait_for_change=true&last_etag=...&timeout_sec=...`, which the server
//! answers when the value changes (at once if it already differs from that ETag). Errors back off
//! (1 s doubling to 60 s) and are kept for status; nothing here acts: the loop reads `notices`.
//!
//! Only on GCE (`[gce] watch = "auto"`: the DMI product name says so; no network probe
//! elsewhere). The metadata URL is configurable: tests play Google's answers on 127.0.0.1.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::config::OnGce;

/// Where Linux says which machine this is.
pub const DMI_PRODUCT_NAME: &str = "/sys/class/dmi/id/product_name";
/// The DMI product name GCE VMs report.
const GCE_PRODUCT: &str = "Google Compute Engine";

/// Whether this VM runs on Google Compute Engine (its DMI product name).
pub fn on_gce(dmi_product_name: &Path) -> bool {
    std::fs::read_to_string(dmi_product_name).is_ok_and(|p| p.trim() == GCE_PRODUCT)
}

/// Whether a feature for GCE (`[history] kernel_log`, `[gce] watch`) is on here: "auto" on GCE
/// only.
pub fn wanted(setting: OnGce, dmi_product_name: &Path) -> bool {
    match setting {
        OnGce::Off => false,
        OnGce::On => true,
        OnGce::Auto => on_gce(dmi_product_name),
    }
}

/// What the metadata server says now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Notices {
    /// `maintenance-event` when it is not `NONE` (`TERMINATE_ON_HOST_MAINTENANCE`, ...).
    pub maintenance: Option<String>,
    /// `preempted` is `TRUE`.
    pub preempted: bool,
    /// `upcoming-maintenance`, when the server plans one: what and when, in one line.
    pub upcoming: Option<String>,
    /// Each watch's latest error, until it answers again.
    pub failing: std::collections::BTreeMap<&'static str, String>,
}

/// How long one wait-for-change asks the server to hang (it answers then even with no change).
const WAIT_SECS: u64 = 60;
/// What an answer may hold.
const MAX_BODY: u64 = 4096;
/// The keys watched under `instance/`.
const KEYS: [&str; 3] = ["maintenance-event", "preempted", "upcoming-maintenance"];

/// The watch threads, and what they saw.
pub struct GceWatcher {
    notices: Arc<Mutex<Notices>>,
}

impl GceWatcher {
    /// Starts watching under `base` (`http://metadata.google.internal/computeMetadata/v1`).
    pub fn start(base: &str) -> std::io::Result<GceWatcher> {
        let notices = Arc::new(Mutex::new(Notices::default()));
        for key in KEYS {
            let (url, notices) = (
                format!("{}/instance/{key}", base.trim_end_matches('/')),
                notices.clone(),
            );
            std::thread::Builder::new()
                .name(format!("gce-{key}"))
                .spawn(move || watch(&url, key, &notices))?;
        }
        Ok(GceWatcher { notices })
    }

    pub fn notices(&self) -> Notices {
        self.notices
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// Long-polls one key for as long as the process lives.
fn watch(url: &str, key: &'static str, notices: &Mutex<Notices>) {
    let agent = crate::http::agent(Duration::from_secs(WAIT_SECS + 10));
    let mut etag: Option<String> = None;
    let mut backoff = Duration::from_secs(1);
    loop {
        let request = match &etag {
            None => url.to_string(),
            Some(e) => format!("{url}?wait_for_change=true&last_etag={e}&timeout_sec={WAIT_SECS}"),
        };
        let asked = std::time::Instant::now();
        match read(&agent, &request) {
            Ok((value, tag)) => {
                backoff = Duration::from_secs(1);
                if asked.elapsed() < Duration::from_secs(1) {
                    // A wait that did not wait (a server that does not hang, or one that answers
                    // a fresh ETag every time): at most one request a second, never a tight loop.
                    std::thread::sleep(Duration::from_secs(1));
                }
                // An ETag is a hex digest: anything else is not put back into a URL.
                etag = tag.filter(|t| {
                    !t.is_empty() && t.len() <= 64 && t.bytes().all(|b| b.is_ascii_alphanumeric())
                });
                let mut n = notices.lock().unwrap_or_else(|e| e.into_inner());
                n.failing.remove(key);
                match key {
                    "preempted" => n.preempted = printable(&value).eq_ignore_ascii_case("TRUE"),
                    "upcoming-maintenance" => n.upcoming = upcoming(&value),
                    _ => {
                        let value = printable(&value);
                        n.maintenance = (!value.is_empty() && value != "NONE").then_some(value);
                    }
                }
                drop(n);
                if etag.is_none() {
                    // No ETag to wait on: read again in a while rather than in a tight loop.
                    std::thread::sleep(Duration::from_secs(5));
                }
            }
            Err(e) => {
                notices
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .failing
                    .insert(key, format!("{key}: {e}"));
                etag = None;
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(60));
            }
        }
    }
}

/// One GET with the header the metadata server requires: the value (printable ASCII, trimmed)
/// and the ETag. A key the server does not have (404) reads as empty.
fn read(agent: &ureq::Agent, url: &str) -> Result<(String, Option<String>), String> {
    let mut response = agent
        .get(url)
        .header("Metadata-Flavor", "Google")
        .call()
        .map_err(|e| format!("unreachable: {e}"))?;
    let status = response.status();
    let etag = response
        .headers()
        .get("etag")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    if status == 404 {
        return Ok((String::new(), etag));
    }
    if !status.is_success() {
        return Err(format!("HTTP {status}"));
    }
    let text = crate::http::body_text(&mut response, MAX_BODY)?;
    Ok((text, etag))
}

/// A value as the notices keep it: printable ASCII, trimmed, at most 64 characters.
fn printable(text: &str) -> String {
    text.trim()
        .chars()
        .filter(|c| c.is_ascii_graphic())
        .take(64)
        .collect()
}

/// `upcoming-maintenance` in one line ("SCHEDULED maintenance PENDING, window
/// 2026-12-01T10:00:00Z to 2026-12-01T18:00:00Z, can be rescheduled"); `None` when none is
/// planned (empty, `{}`) or the answer is not the JSON Google documents.
pub fn upcoming(body: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(body.trim()).ok()?;
    let field = |name: &str| {
        v.get(name).and_then(|f| match f {
            serde_json::Value::String(s) => Some(printable(s)),
            serde_json::Value::Bool(b) => Some(b.to_string()),
            _ => None,
        })
    };
    let status = field("maintenance_status");
    let start = field("window_start_time");
    if status.is_none() && start.is_none() {
        return None;
    }
    let mut line = format!(
        "{} maintenance {}",
        field("type").unwrap_or_else(|| "planned".into()),
        status.unwrap_or_else(|| "PENDING".into())
    );
    if let Some(start) = start {
        line.push_str(&format!(", window {start}"));
        if let Some(end) = field("window_end_time") {
            line.push_str(&format!(" to {end}"));
        }
    }
    if field("can_reschedule").as_deref() == Some("true") {
        line.push_str(", can be rescheduled (gcloud compute instances perform-maintenance)");
    }
    Some(line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Write};

    /// `upcoming-maintenance` as Google documents it (snake_case JSON), and what is not it.
    #[test]
    fn upcoming_maintenance_reads_as_one_line() {
        let body = r#"{
  "can_reschedule": true,
  "latest_window_start_time": "2026-12-03T10:00:00Z",
  "maintenance_status": "PENDING",
  "type": "SCHEDULED",
  "window_end_time": "2026-12-01T18:00:00Z",
  "window_start_time": "2026-12-01T10:00:00Z"
}"#;
        assert_eq!(
            upcoming(body).as_deref(),
            Some("SCHEDULED maintenance PENDING, window 2026-12-01T10:00:00Z to 2026-12-01T18:00:00Z, can be rescheduled (gcloud compute instances perform-maintenance)")
        );
        let ongoing =
            r#"{"maintenance_status":"ONGOING","type":"UNSCHEDULED","can_reschedule":false}"#;
        assert_eq!(
            upcoming(ongoing).as_deref(),
            Some("UNSCHEDULED maintenance ONGOING")
        );
        for none in ["", "{}", "NONE", "<html>", "[1,2]"] {
            assert_eq!(upcoming(none), None, "{none}");
        }
        // What the server sends is made printable before it goes into an event.
        let hostile = "{\"maintenance_status\":\"PENDING\\u001b[2J\",\"type\":\"X\\nY\"}";
        assert_eq!(
            upcoming(hostile).as_deref(),
            Some("XY maintenance PENDING[2J")
        );
    }
    use std::net::TcpListener;
    use std::sync::mpsc;

    /// A metadata server as Google documents it, for one key at a time: a plain read answers the
    /// value and its ETag; a wait-for-change with the current ETag hangs until the value changes.
    #[test]
    fn a_maintenance_notice_is_seen_when_it_comes_and_when_it_is_withdrawn() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let (set, values) = mpsc::channel::<&'static str>();
        let (seen_tx, seen) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            let mut value = "NONE";
            let mut version = 0;
            for stream in listener.incoming() {
                let mut stream = stream.unwrap();
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut request = String::new();
                let mut line = String::new();
                while reader.read_line(&mut line).unwrap() > 2 {
                    request.push_str(&line);
                    line.clear();
                }
                let path = request.split_whitespace().nth(1).unwrap().to_string();
                if path.contains("upcoming-maintenance") {
                    // None planned: Google answers 404.
                    let _ = write!(
                        stream,
                        "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    );
                    continue;
                }
                let _ = seen_tx.send(request.clone());
                let body = if path.contains("preempted") {
                    "FALSE"
                } else {
                    if path.contains("wait_for_change=true")
                        && path.contains(&format!("last_etag=e{version}"))
                    {
                        // Hang until the test changes the value.
                        value = values.recv().unwrap();
                        version += 1;
                    }
                    value
                };
                let etag = if path.contains("preempted") {
                    "p0".to_string()
                } else {
                    format!("e{version}")
                };
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nMetadata-Flavor: Google\r\nETag: {etag}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        let w = GceWatcher::start(&format!("http://127.0.0.1:{port}/computeMetadata/v1")).unwrap();
        let wait_for = |want: &dyn Fn(&Notices) -> bool| {
            for _ in 0..500 {
                if want(&w.notices()) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            panic!("never saw it: {:?}", w.notices());
        };
        // Every request carries the header the server requires.
        let first = seen.recv().unwrap();
        assert!(
            first.contains("Metadata-Flavor: Google") || first.contains("metadata-flavor: Google"),
            "{first}"
        );
        set.send("TERMINATE_ON_HOST_MAINTENANCE").unwrap();
        wait_for(&|n| n.maintenance.as_deref() == Some("TERMINATE_ON_HOST_MAINTENANCE"));
        assert!(!w.notices().preempted);
        set.send("NONE").unwrap();
        wait_for(&|n| n.maintenance.is_none());
    }
}
