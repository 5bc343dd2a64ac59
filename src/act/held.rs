//! The on-disk record of processes gpuguard holds stopped (SIGSTOP or a throttle duty cycle), so
//! none is left frozen: on shutdown, and on start after a crash, every one still stopped is resumed.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::snapshot::ProcessId;

use super::{ProcessControl, Sig};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct HeldProcess {
    pub pid: i32,
    pub start_time: u64,
    pub comm: String,
    /// Why it is held: "stop" or "throttle".
    pub why: String,
    /// Seconds since the epoch when it was stopped (for operators).
    pub since_unix: u64,
}

impl HeldProcess {
    pub fn id(&self) -> ProcessId {
        ProcessId {
            pid: self.pid,
            start_time: self.start_time,
        }
    }
}

pub struct HeldRecord {
    path: PathBuf,
    entries: Vec<HeldProcess>,
}

impl HeldRecord {
    /// Opens the record in `state_dir` (creating the directory), keeping what a previous run left.
    pub fn open(state_dir: &Path) -> std::io::Result<HeldRecord> {
        std::fs::create_dir_all(state_dir)?;
        let path = state_dir.join("stopped.json");
        let entries = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                tracing::warn!(
                    "{}: unreadable ({e}); starting with an empty record",
                    path.display()
                );
                Vec::new()
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e),
        };
        Ok(HeldRecord { path, entries })
    }

    pub fn entries(&self) -> &[HeldProcess] {
        &self.entries
    }

    pub fn add(&mut self, entry: HeldProcess) {
        self.entries.retain(|e| e.id() != entry.id());
        self.entries.push(entry);
        self.save();
    }

    pub fn remove(&mut self, id: ProcessId) {
        let before = self.entries.len();
        self.entries.retain(|e| e.id() != id);
        if self.entries.len() != before {
            self.save();
        }
    }

    /// SIGCONTs every recorded process that is still stopped (same pid and start time) and
    /// empties the record. Returns the ones resumed.
    pub fn resume_all(&mut self, control: &dyn ProcessControl) -> Vec<HeldProcess> {
        let mut resumed = Vec::new();
        for entry in std::mem::take(&mut self.entries) {
            if control.is_stopped(entry.id()) && control.send(entry.id(), Sig::Cont).is_ok() {
                resumed.push(entry);
            }
        }
        self.save();
        resumed
    }

    /// Written to a temporary file and renamed, so a crash never leaves half a record.
    fn save(&self) {
        let tmp = self.path.with_extension("json.tmp");
        let result = serde_json::to_vec_pretty(&self.entries)
            .map_err(std::io::Error::other)
            .and_then(|bytes| std::fs::write(&tmp, bytes))
            .and_then(|()| std::fs::rename(&tmp, &self.path));
        if let Err(e) = result {
            tracing::error!(
                "cannot write {}: {e}; stopped processes may not be resumed after a crash",
                self.path.display()
            );
        }
    }
}
