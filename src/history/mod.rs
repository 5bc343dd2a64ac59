//! The flight recorder: what the daemon saw, decided and did, kept on disk across crashes and
//! reboots, for `gpuguard history` and for the post-mortem the next start writes.
//!
//! The store is a directory of append-only segment files (`segment.rs`: framed JSON records
//! with checksums), `history/` under the state directory. Plain files, not a database: a crash or
//! a full disk can tear the last record of a segment and nothing else, a reader keeps everything
//! before the damage, no reader can lock the writer out, and the records are JSON that
//! `gpuguard history --json` prints for `jq` and friends. Bounded: segments roll at a sixteenth of
//! `[history] max_size`, the oldest go first when the total would pass it or when they are older
//! than `retention`, and recording stops (a critical event says why) when the file system is
//! nearly full, and resumes by itself (a warning says so) once it has room again.
//!
//! The control loop never waits on the disk: records go to the `history` thread through a
//! bounded queue (a record that does not fit is dropped and counted). How often a sample is kept
//! and how often the file is synced follow the pressure on the host (`Pressure`): every 10 s
//! and synced every minute when quiet, every second and synced every 5 s near a floor or with a
//! model of the config over its budget (not one a user launched), every sample and synced at once at the act floor, because the minutes
//! before a crash are the ones that matter; and every tick on which the policy decided something
//! (an event, an action), except what a client caused (a model a user launched crossing the budget
//! it declared: `Event::caused_by`), which anyone can make happen every second. Each sample keeps what the policy decided from (`input.rs`), so that
//! `gpuguard replay` runs it through the policy again with another config (`replay.rs`).

pub mod input;
pub mod kernel_log;
pub mod replay;
pub mod segment;
mod writer;

use std::collections::BTreeMap;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::status::{ActionRow, StatusReport};
use crate::units::{fmt_bytes, fmt_opt_bytes};
use input::PolicyInput;

pub use writer::{Pressure, Recorder};

/// The directory under the state directory.
pub const DIR: &str = "history";
/// Segment files are named by the time their first record was written: `<unix ms>.seg`, the
/// number in 16 digits so that names sort as numbers do.
const SUFFIX: &str = ".seg";

/// The number of a segment file's name (`None`: not a segment).
fn segment_number(name: &str) -> Option<u64> {
    let stem = name.strip_suffix(SUFFIX)?;
    (stem.len() == 16 && stem.bytes().all(|b| b.is_ascii_digit()))
        .then(|| stem.parse().ok())
        .flatten()
}

/// The name of segment `number`.
fn segment_name(number: u64) -> String {
    format!("{number:016}{SUFFIX}")
}

/// One record.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Record {
    /// The daemon started.
    Start {
        at_ms: u64,
        version: String,
        boot_id: String,
    },
    /// What `gpuguard status` would have printed at that moment, and what the policy decided
    /// from (for `gpuguard replay`; absent from records of versions before it).
    Sample {
        at_ms: u64,
        status: Box<StatusReport>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        input: Option<Box<PolicyInput>>,
    },
    /// An event the daemon logged and alerted.
    Event {
        at_ms: u64,
        severity: String,
        kind: String,
        message: String,
    },
    /// An action on a process and its outcome.
    Action { at_ms: u64, action: ActionRow },
    /// The daemon stopped cleanly.
    Stop { at_ms: u64 },
}

impl Record {
    /// When it was recorded (Unix time in milliseconds).
    pub fn at_ms(&self) -> u64 {
        match self {
            Record::Start { at_ms, .. }
            | Record::Sample { at_ms, .. }
            | Record::Event { at_ms, .. }
            | Record::Action { at_ms, .. }
            | Record::Stop { at_ms } => *at_ms,
        }
    }
}

/// Everything a history directory holds, oldest first, with what could not be read (for tests:
/// the CLI and the daemon read through `visit` and `last_run`, which keep only what they need).
#[cfg(test)]
#[derive(Debug, Default)]
pub struct History {
    pub records: Vec<Record>,
    /// One line per damaged segment or record ("<file>: at byte N: why").
    pub warnings: Vec<String>,
}

/// The segment files of `dir`, oldest first (by name: the time they were started). A run of the
/// daemon starts a segment of its own, so the first record of a run's first segment is `Start`.
pub fn segments(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut named: BTreeMap<u64, PathBuf> = BTreeMap::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if let Some(number) = entry.file_name().to_str().and_then(segment_number) {
            named.insert(number, entry.path());
        }
    }
    Ok(named.into_values().collect())
}

/// The records of one segment, and what could not be read of it (a line each).
fn read_one(path: &Path, warnings: &mut Vec<String>) -> std::io::Result<Vec<Record>> {
    // A segment is a regular file, read without following a link (`--dir` may point at a
    // directory anyone wrote: a FIFO or a link to /dev/zero must not hang or fill the reader).
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .and_then(|f| {
            if f.metadata()?.file_type().is_file() {
                Ok(f)
            } else {
                Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "not a regular file",
                ))
            }
        });
    let file = match opened {
        Ok(f) => f,
        // Dropped by the daemon's cap while we listed: nothing to read.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(std::io::Error::new(
                e.kind(),
                format!("{}: {e}", path.display()),
            ))
        }
    };
    let segment = segment::read_segment(&mut std::io::BufReader::new(file))?;
    let mut out = Vec::with_capacity(segment.records.len());
    for bytes in segment.records {
        match serde_json::from_slice::<Record>(&bytes) {
            Ok(r) => out.push(r),
            Err(e) => warnings.push(format!("{}: a record that is not one: {e}", path.display())),
        }
    }
    if let Some(damage) = segment.damage {
        warnings.push(format!("{}: {damage}; read up to there", path.display()));
    }
    Ok(out)
}

/// Hands every record of `dir` to `each`, oldest first, one segment in memory at a time
/// (read-only; works whether the daemon runs or not). Returns what could not be read.
pub fn visit(dir: &Path, mut each: impl FnMut(Record)) -> std::io::Result<Vec<String>> {
    let mut warnings = Vec::new();
    for path in segments(dir)? {
        read_one(&path, &mut warnings)?
            .into_iter()
            .for_each(&mut each);
    }
    Ok(warnings)
}

/// Every record of `dir`.
#[cfg(test)]
pub fn read(dir: &Path) -> std::io::Result<History> {
    let mut records = Vec::new();
    let warnings = visit(dir, |r| records.push(r))?;
    Ok(History { records, warnings })
}

#[cfg(test)]
impl History {
    /// The latest sample taken at or before `at_ms`.
    pub fn status_at(&self, at_ms: u64) -> Option<(u64, &StatusReport)> {
        self.records.iter().rev().find_map(|r| match r {
            Record::Sample {
                at_ms: t, status, ..
            } if *t <= at_ms => Some((*t, status.as_ref())),
            _ => None,
        })
    }

    /// How many runs it holds (each begins at a `Start`).
    pub fn runs(&self) -> usize {
        self.records
            .iter()
            .filter(|r| matches!(r, Record::Start { .. }))
            .count()
    }
}

/// What the post-mortem needs of the latest run.
#[derive(Debug, Default)]
pub struct LastRun {
    /// Its `Start` (when, which boot), if its first segment is still there.
    pub start: Option<(u64, String)>,
    /// Its last record's time, and whether that record is a clean `Stop`.
    pub last_at: u64,
    pub stopped: bool,
    pub last_sample: Option<(u64, StatusReport)>,
    /// Its last few actions, oldest first.
    pub last_actions: Vec<(u64, ActionRow)>,
}

/// Actions the post-mortem names.
const POST_MORTEM_ACTIONS: usize = 3;

/// The latest run of `dir`, read from its newest segment back to the one it started with, one
/// segment in memory at a time (`None`: no records at all).
pub fn last_run(dir: &Path) -> std::io::Result<(Option<LastRun>, Vec<String>)> {
    let mut warnings = Vec::new();
    let mut run: Option<LastRun> = None;
    for path in segments(dir)?.iter().rev() {
        let records = read_one(path, &mut warnings)?;
        for r in records.into_iter().rev() {
            let run = run.get_or_insert_with(|| LastRun {
                last_at: r.at_ms(),
                stopped: matches!(r, Record::Stop { .. }),
                ..LastRun::default()
            });
            match r {
                Record::Sample { at_ms, status, .. } if run.last_sample.is_none() => {
                    run.last_sample = Some((at_ms, *status));
                }
                Record::Action { at_ms, action }
                    if run.last_actions.len() < POST_MORTEM_ACTIONS =>
                {
                    run.last_actions.insert(0, (at_ms, action));
                }
                Record::Start { at_ms, boot_id, .. } => {
                    run.start = Some((at_ms, boot_id));
                    return Ok((Some(std::mem::take(run)), warnings));
                }
                _ => {}
            }
        }
    }
    Ok((run, warnings))
}

/// How the latest run ended, as far as its records tell (`None`: it stopped cleanly): one line
/// for the post-mortem event. `boot_id`: this boot's, to say whether the host went down with it.
pub fn unclean_end(run: &LastRun, boot_id: &str) -> Option<String> {
    if run.stopped {
        return None;
    }
    let rebooted = match &run.start {
        Some((_, then)) if !then.is_empty() && !boot_id.is_empty() => {
            if then == boot_id {
                " (the host did not reboot: the daemon was killed or crashed)"
            } else {
                " (the host went down with it: a reboot, crash or power loss since)"
            }
        }
        _ => "",
    };
    let started = run.start.as_ref().map_or_else(
        || "at an unknown time".into(),
        |(at, _)| format!("at {}", format_ms(*at)),
    );
    let mut out = format!(
        "the previous run of gpuguard (started {started}) ended without a clean stop{rebooted}; its last record is from {}",
        format_ms(run.last_at)
    );
    if let Some((at_ms, status)) = &run.last_sample {
        let m = &status.memory;
        out.push_str(&format!(
            "; at {}: RAM {} available ({})",
            format_ms(*at_ms),
            fmt_opt_bytes(m.available_bytes),
            m.level
        ));
        for g in &status.gpus {
            out.push_str(&format!(
                ", GPU {} {} free ({})",
                g.index,
                fmt_opt_bytes(g.free_bytes),
                g.level
            ));
        }
        let mut models: Vec<_> = status.models.iter().collect();
        models.sort_by_key(|m| std::cmp::Reverse(m.ram_bytes + m.gpu_bytes.unwrap_or(0)));
        let largest: Vec<String> = models
            .iter()
            .take(3)
            .map(|m| {
                format!(
                    "{} (RAM {}, GPU {})",
                    m.name,
                    fmt_bytes(m.ram_bytes),
                    fmt_opt_bytes(m.gpu_bytes)
                )
            })
            .collect();
        if !largest.is_empty() {
            out.push_str(&format!("; largest models: {}", largest.join(", ")));
        }
    }
    if !run.last_actions.is_empty() {
        let actions: Vec<String> = run
            .last_actions
            .iter()
            .map(|(at_ms, a)| {
                format!(
                    "{} {} {} ({})",
                    format_ms(*at_ms),
                    a.verb,
                    a.target,
                    a.outcome
                )
            })
            .collect();
        out.push_str(&format!("; last actions: {}", actions.join(", ")));
    }
    Some(out)
}

/// A Unix time in milliseconds as RFC 3339 in UTC, to the second.
pub fn format_ms(ms: u64) -> String {
    jiff::Timestamp::from_millisecond(ms as i64)
        .map(|t| t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string())
        .unwrap_or_else(|_| format!("{ms} ms"))
}

/// Now, as a Unix time in milliseconds.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
