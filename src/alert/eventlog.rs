//! The event log: one JSON object per line in `state_dir/events.jsonl`, written by its own
//! thread. At `event_log_max_size` the file is rotated to `events.jsonl.1` (the previous `.1` is
//! dropped), so the log never takes more than twice that. The same writer keeps
//! `state_dir/actions.jsonl`: only the actions taken and the critical notices, which clients
//! cannot cause, so requests sent in a loop (which fill `events.jsonl`) cannot rotate the
//! record of a kill away. The file is opened in the checked state
//! directory without following symlinks (one planted there is set aside), and opened again when
//! it has been removed or rotated away (by an operator, by logrotate) since the last line.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use tracing::warn;

use super::queue::Queue;
use super::Notice;
use crate::metrics::SinkCounters;
use crate::state_dir::{identity_of, FileIdentity, StateDir};

pub const FILE_NAME: &str = "events.jsonl";
/// Actions and critical notices only.
pub const ACTIONS_FILE_NAME: &str = "actions.jsonl";

struct EventLog {
    dir: StateDir,
    /// The file's name in `dir`; rotated to `name.1`.
    name: &'static str,
    rotated: String,
    /// The open file and which file it is, to notice it being removed or renamed.
    file: Option<(File, FileIdentity)>,
    size: u64,
    max_bytes: u64,
    reported: bool,
}

pub fn start(
    state_dir: &Path,
    name: &'static str,
    max_bytes: u64,
    queue: Arc<Queue<Notice>>,
    counters: SinkCounters,
) -> anyhow::Result<()> {
    let dir = StateDir::create(state_dir)?;
    let mut log = EventLog {
        dir,
        name,
        rotated: format!("{name}.1"),
        file: None,
        size: 0,
        max_bytes,
        reported: false,
    };
    log.open()
        .with_context(|| format!("event log {}", log.path()))?;
    std::thread::Builder::new()
        .name(format!("log-{name}"))
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
                            warn!("event log {}: {e}", log.path());
                        }
                    }
                }
                queue.done();
            }
        })?;
    Ok(())
}

impl EventLog {
    fn path(&self) -> String {
        self.dir.path().join(self.name).display().to_string()
    }

    fn open(&mut self) -> std::io::Result<()> {
        let (file, set_aside) = self.dir.open_append(self.name)?;
        if let Some(why) = set_aside {
            warn!("event log: {why}");
        }
        self.size = file.metadata()?.len();
        let identity = identity_of(&file)?;
        self.file = Some((file, identity));
        Ok(())
    }

    /// True if the name no longer leads to the file held open (removed, renamed, replaced).
    fn moved_away(&self) -> std::io::Result<bool> {
        match &self.file {
            Some((_, held)) => Ok(self.dir.identity(self.name)? != Some(*held)),
            None => Ok(false),
        }
    }

    fn write(&mut self, notice: &Notice) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(notice)?;
        line.push(b'\n');
        if self.moved_away()? {
            self.file = None;
        }
        if self.file.is_some() && self.size > 0 && self.size + line.len() as u64 > self.max_bytes {
            self.file = None;
            self.dir.rename(self.name, &self.rotated)?;
        }
        if self.file.is_none() {
            self.open()?;
        }
        let (file, _) = self.file.as_mut().expect("opened above");
        file.write_all(&line)?;
        self.size += line.len() as u64;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Severity;

    fn notice(i: usize) -> Notice {
        Notice {
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
        }
    }

    #[test]
    fn rotates_to_dot_one_at_the_size_limit() {
        let dir = tempfile::tempdir().unwrap();
        let counters = SinkCounters::default();
        let queue = Arc::new(Queue::new(1000, counters.dropped.clone()));
        start(dir.path(), FILE_NAME, 4096, queue.clone(), counters.clone()).unwrap();
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

    #[test]
    fn removed_or_rotated_away_it_is_opened_again() {
        let dir = tempfile::tempdir().unwrap();
        let counters = SinkCounters::default();
        let queue = Arc::new(Queue::new(1000, counters.dropped.clone()));
        start(
            dir.path(),
            FILE_NAME,
            1 << 20,
            queue.clone(),
            counters.clone(),
        )
        .unwrap();
        let log = dir.path().join(FILE_NAME);
        let written = |n: u64| {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while counters.sent.get() < n && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        };
        queue.push(notice(1));
        written(1);
        std::fs::remove_file(&log).unwrap();
        queue.push(notice(2));
        written(2);
        assert!(std::fs::read_to_string(&log).unwrap().contains("\"e2\""));
        std::fs::rename(&log, dir.path().join("events.jsonl-20260101")).unwrap();
        queue.push(notice(3));
        written(3);
        let now = std::fs::read_to_string(&log).unwrap();
        assert!(now.contains("\"e3\"") && !now.contains("\"e2\""), "{now}");
    }
}
