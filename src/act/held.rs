//! The on-disk record of processes gpuguard holds stopped (SIGSTOP or a throttle duty cycle), so
//! none is left frozen: on shutdown, and on start after a crash (before the config is even read),
//! every one still stopped is resumed. `stopped.json` in the state directory.

use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::snapshot::ProcessId;
use crate::state_dir::StateDir;

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
    dir: Arc<StateDir>,
    entries: Vec<HeldProcess>,
}

/// The record's file in the state directory.
pub const FILE_NAME: &str = "stopped.json";

impl HeldRecord {
    /// Opens the record in the state directory, keeping what a previous run left. A record that
    /// cannot be read (garbage, a symlink) is set aside under a new name, kept for the operator,
    /// and reported in `problems`: its processes may still be stopped.
    pub fn open(dir: Arc<StateDir>, problems: &mut Vec<String>) -> HeldRecord {
        let entries = match read_record(&dir, FILE_NAME) {
            Ok(entries) => entries,
            Err(problem) => {
                problems.push(problem);
                Vec::new()
            }
        };
        HeldRecord { dir, entries }
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
        if let Err(e) = write_record(&self.dir, FILE_NAME, &self.entries) {
            tracing::error!(
                "cannot write {}/{FILE_NAME}: {e}; stopped processes may not be resumed after a crash",
                self.dir.path().display()
            );
        }
    }
}

/// A JSON list from the state directory (none: empty). One that cannot be read is set aside and
/// the problem returned, loudly worded: what it listed may still be stopped or throttled.
pub fn read_record<T: DeserializeOwned>(dir: &StateDir, name: &str) -> Result<Vec<T>, String> {
    let path = dir.path().join(name);
    let why = match dir.read(name) {
        Ok(None) => return Ok(Vec::new()),
        Ok(Some(bytes)) => match serde_json::from_slice(&bytes) {
            Ok(entries) => return Ok(entries),
            Err(e) => format!("unreadable ({e})"),
        },
        Err(e) => format!("cannot be opened ({e})"),
    };
    let kept = match dir.set_aside(name, "corrupt") {
        Ok(aside) => format!("kept as {aside}"),
        Err(e) => format!("could not be moved aside: {e}"),
    };
    Err(format!(
        "{} is {why}, {kept}: processes a previous gpuguard run stopped or throttled may still be; check them (ps -eo pid,stat,comm | grep ' T')",
        path.display()
    ))
}

/// Writes a JSON list to the state directory at once (temporary file, then rename).
pub fn write_record<T: Serialize>(
    dir: &StateDir,
    name: &str,
    entries: &[T],
) -> std::io::Result<()> {
    let bytes = serde_json::to_vec_pretty(entries).map_err(std::io::Error::other)?;
    dir.write_atomic(name, &bytes)
}
