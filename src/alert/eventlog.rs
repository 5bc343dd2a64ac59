//! The event log: one JSON object per line in `state_dir/events.jsonl`, written by its own
//! thread. At `event_log_max_size` the file is rotated to `events.jsonl.1` (the previous `.1` is
//! dropped), so the log never takes more than twice that.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use tracing::warn;

use super::queue::Queue;
use super::Notice;
use crate::metrics::SinkCounters;

pub const FILE_NAME: &str = "events.jsonl";

struct EventLog {
    path: PathBuf,
    file: Option<File>,
    size: u64,
    max_bytes: u64,
    reported: bool,
}

pub fn start(
    state_dir: &Path,
    max_bytes: u64,
    queue: Arc<Queue<Notice>>,
    counters: SinkCounters,
) -> anyhow::Result<()> {
    let path = state_dir.join(FILE_NAME);
    let mut log = EventLog {
        path,
        file: None,
        size: 0,
        max_bytes,
        reported: false,
    };
    log.open()
        .with_context(|| format!("event log {}", log.path.display()))?;
    std::thread::Builder::new()
        .name("event-log".into())
        .spawn(move || {
            while let Some(notice) = queue.pop() {
                match log.write(&notice) {
                    Ok(()) => {
                        counters.sent.inc();
                        log.reported = false;
                    }
                    Err(e) => {
                        counters.failed.inc();
                        if !log.reported {
                            log.reported = true;
                            warn!("event log {}: {e}", log.path.display());
                        }
                    }
                }
                queue.done();
            }
        })?;
    Ok(())
}

impl EventLog {
    fn open(&mut self) -> std::io::Result<()> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        self.size = file.metadata()?.len();
        self.file = Some(file);
        Ok(())
    }

    fn write(&mut self, notice: &Notice) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(notice)?;
        line.push(b'\n');
        if self.size > 0 && self.size + line.len() as u64 > self.max_bytes {
            self.file = None;
            let mut rotated = self.path.clone().into_os_string();
            rotated.push(".1");
            std::fs::rename(&self.path, rotated)?;
        }
        if self.file.is_none() {
            self.open()?;
        }
        self.file.as_mut().expect("opened above").write_all(&line)?;
        self.size += line.len() as u64;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Severity;

    #[test]
    fn rotates_to_dot_one_at_the_size_limit() {
        let dir = tempfile::tempdir().unwrap();
        let counters = SinkCounters::default();
        let queue = Arc::new(Queue::new(1000, counters.dropped.clone()));
        start(dir.path(), 4096, queue.clone(), counters.clone()).unwrap();
        let notice = |i: usize| Notice {
            host: "h".into(),
            event: format!("e{i}"),
            severity: Severity::Info,
            status: super::super::Status::Firing,
            kind: "event",
            repeat: false,
            key: "k".into(),
            summary: "x".repeat(200),
            subject: Default::default(),
            action: None,
            at: std::time::SystemTime::now(),
            since: std::time::SystemTime::now(),
            refresh: false,
            superseded: false,
        };
        for i in 0..50 {
            queue.push(notice(i));
        }
        queue.close();
        assert!(queue.drain(std::time::Instant::now() + std::time::Duration::from_secs(5)));
        let current = std::fs::read_to_string(dir.path().join(FILE_NAME)).unwrap();
        let rotated = std::fs::read_to_string(dir.path().join("events.jsonl.1")).unwrap();
        assert!(current.len() <= 4096 && rotated.len() <= 4096);
        assert!(current.lines().last().unwrap().contains("\"e49\""));
        assert_eq!(counters.sent.get(), 50);
        for line in current.lines().chain(rotated.lines()) {
            serde_json::from_str::<serde_json::Value>(line).unwrap();
        }
    }
}
