//! The on-disk record of processes gpuguard holds stopped (SIGSTOP or a throttle duty cycle), so
//! none is left frozen: on shutdown every one still stopped is resumed, and what a crashed run
//! left is resumed by the next daemon on the same state directory that may act on this host.
//! `stopped.json` in the state directory.
//!
//! The record holds two lists: this run's own holds, and what a previous run left that this run
//! could not let go of yet (another daemon enforced on the host when it started: resuming them
//! might undo that daemon's work). Both are written to the file; only the own ones are this
//! run's to resume, and the inherited ones wait for `take_inherited`.

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
    /// What a previous run left, not let go of yet.
    inherited: Vec<HeldProcess>,
}

/// The record's file in the state directory.
pub const FILE_NAME: &str = "stopped.json";

impl HeldRecord {
    /// Opens the record in the state directory: what a previous run left is inherited, none of
    /// it this run's own. A record that cannot be read (garbage, a symlink) is set aside under a
    /// new name, kept for the operator, and reported in `problems`: its processes may still be
    /// stopped.
    pub fn open(dir: Arc<StateDir>, problems: &mut Vec<String>) -> HeldRecord {
        let inherited = match read_record(&dir, FILE_NAME) {
            Ok(entries) => entries,
            Err(problem) => {
                problems.push(problem);
                Vec::new()
            }
        };
        HeldRecord {
            dir,
            entries: Vec::new(),
            inherited,
        }
    }

    /// This run's own holds.
    pub fn entries(&self) -> &[HeldProcess] {
        &self.entries
    }

    /// What a previous run left and this one has not let go of.
    pub fn inherited(&self) -> &[HeldProcess] {
        &self.inherited
    }

    /// Whether this run holds `id` (so may resume it).
    pub fn holds(&self, id: ProcessId) -> bool {
        self.entries.iter().any(|e| e.id() == id)
    }

    /// SIGCONTs every inherited process still stopped (same pid and start time) and drops them
    /// from the record; returns the ones resumed. Only for a daemon that may act on the host.
    pub fn take_inherited(&mut self, control: &dyn ProcessControl) -> Vec<HeldProcess> {
        if self.inherited.is_empty() {
            return Vec::new();
        }
        let resumed = resume(std::mem::take(&mut self.inherited), control);
        self.save();
        resumed
    }

    pub fn add(&mut self, entry: HeldProcess) {
        self.entries.retain(|e| e.id() != entry.id());
        self.inherited.retain(|e| e.id() != entry.id());
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

    /// SIGCONTs every process this run holds that is still stopped (same pid and start time)
    /// and drops them from the record (what was inherited stays). Returns the ones resumed.
    pub fn resume_all(&mut self, control: &dyn ProcessControl) -> Vec<HeldProcess> {
        let resumed = resume(std::mem::take(&mut self.entries), control);
        self.save();
        resumed
    }

    /// Written to a temporary file and renamed, so a crash never leaves half a record.
    fn save(&self) {
        let all: Vec<&HeldProcess> = self.entries.iter().chain(&self.inherited).collect();
        if let Err(e) = write_record(&self.dir, FILE_NAME, &all) {
            tracing::error!(
                "cannot write {}/{FILE_NAME}: {e}; stopped processes may not be resumed after a crash",
                self.dir.path().display()
            );
        }
    }
}

/// SIGCONT to each of `entries` still stopped; the ones resumed.
fn resume(entries: Vec<HeldProcess>, control: &dyn ProcessControl) -> Vec<HeldProcess> {
    entries
        .into_iter()
        .filter(|e| control.is_stopped(e.id()) && control.send(e.id(), Sig::Cont).is_ok())
        .collect()
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
