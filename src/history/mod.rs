//! The flight recorder: what the daemon saw, decided and did, kept on disk across crashes and
//! reboots, for `gpuguard history` and for the post-mortem the next start writes.
//!
//! The store is a directory of append-only segment files (`segment.rs`: framed JSON records
//! with checksums), `history/` under the state directory. Plain files, not a database: a crash or
//! a full disk can tear the last record of a segment and nothing else, a reader keeps everything
//! before the damage, no reader can lock the writer out, and the records are JSON that
//! `gpuguard history --json` prints for `jq` and friends. Bounded: segments roll at a sixteenth of
//! `[history] max_size` (at most `segment::MAX_SEGMENT`), are named by 16-digit numbers up to
//! `MAX_NUMBER` (so the cap sees every one the writer made), the oldest go first when the total
//! would pass it or when they are older than `retention`, and recording stops (a critical event
//! says why) when the file system is nearly full, and resumes by itself (a warning says so) once
//! it has room again.
//!
//! Readers (`visit`, `last_run`: `history`, `replay`, `plan --history-dir`, the post-mortem) may
//! be pointed at a directory anyone wrote (`--dir`): each segment is checked before it is read (a
//! regular file, not a link, no larger than `MAX_SEGMENT`, starting with the magic), read one
//! record at a time, with a few warning lines a segment at most, and every string of a record
//! comes back printable (control characters escaped), so what they print cannot fake lines.
//!
//! The control loop never waits on the disk: records go to the `history` thread through a
//! bounded queue (a record that does not fit is dropped and counted). How often a sample is kept
//! and how often the file is synced follow the pressure on the host (`Pressure`): every 10 s
//! and synced every minute when quiet, every second and synced every 5 s near a floor or with a
//! model of the config over its budget (not one a user launched), every sample and synced at once at the act floor, because the minutes
//! before a crash are the ones that matter; when a GPU's or a model's figures jump (`jumps.rs`,
//! bounded); and every tick on which the policy decided something
//! (an event, an action), except what a client caused (a model a user launched crossing the budget
//! it declared: `Event::caused_by`), which anyone can make happen every second. Each sample keeps what the policy decided from (`input.rs`), so that
//! `gpuguard replay` runs it through the policy again with another config (`replay.rs`).

pub mod input;
pub mod jumps;
pub mod kernel_log;
pub mod replay;
pub mod segment;
mod writer;

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::kinds::Severity;
use crate::snapshot::printable;
use crate::status::{ActionRow, StatusReport};
use crate::units::{fmt_bytes, fmt_opt_bytes};
use input::PolicyInput;

pub use writer::{Pressure, Recorder};

/// The directory under the state directory.
pub const DIR: &str = "history";
/// Segment files are named by the time their first record was written: `<unix ms>.seg`, the
/// number in 16 digits so that names sort as numbers do.
const SUFFIX: &str = ".seg";
/// The largest segment number: the one of `9999999999999999.seg`. The writer names no segment
/// past it (a longer name is one readers and the cap would not see).
const MAX_NUMBER: u64 = 9_999_999_999_999_999;

/// The number of a segment file's name (`None`: not a segment).
fn segment_number(name: &str) -> Option<u64> {
    let stem = name.strip_suffix(SUFFIX)?;
    (stem.len() == 16 && stem.bytes().all(|b| b.is_ascii_digit()))
        .then(|| stem.parse().ok())
        .flatten()
}

/// The name of segment `number` (at most `MAX_NUMBER`: the writer never asks for more).
fn segment_name(number: u64) -> String {
    debug_assert!(number <= MAX_NUMBER, "segment number {number}");
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
    /// An event the daemon logged and alerted. Its kind stays a string: a record an older or a
    /// newer version wrote may name one this version does not know.
    Event {
        at_ms: u64,
        severity: Severity,
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

/// Hands the records of one segment to `each`, one at a time, and says what could not be read
/// of it (a line each, at most a few a segment). The file is checked before anything is read:
/// a regular file (a link is not followed), no larger than `MAX_SEGMENT`, starting with the
/// segment's magic; a file that is not one is a warning, and the next segment is read.
fn read_one(
    path: &Path,
    warnings: &mut Vec<String>,
    each: &mut impl FnMut(Record),
) -> std::io::Result<()> {
    // `--dir` may point at a directory anyone wrote: a FIFO or a link to /dev/zero must not
    // hang or fill the reader, nor a sparse terabyte named like a segment.
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .and_then(|f| {
            let meta = f.metadata()?;
            if meta.file_type().is_file() {
                Ok((f, meta.len()))
            } else {
                Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "not a regular file",
                ))
            }
        });
    let (file, size) = match opened {
        Ok(f) => f,
        // Dropped by the daemon's cap while we listed: nothing to read.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(std::io::Error::new(
                e.kind(),
                format!("{}: {e}", path.display()),
            ))
        }
    };
    if size > segment::MAX_SEGMENT {
        warnings.push(format!(
            "{}: {}, larger than any segment gpuguard writes ({}): not read",
            path.display(),
            fmt_bytes(size),
            fmt_bytes(segment::MAX_SEGMENT)
        ));
        return Ok(());
    }
    // Bounded even if the file grows while it is read.
    let mut input = std::io::BufReader::new(file.take(segment::MAX_SEGMENT));
    let mut not_records = 0u64;
    let mut first_error = None;
    let damage = segment::read_segment(&mut input, |bytes, at| match decode(bytes) {
        Ok(r) => each(r),
        Err(e) => {
            not_records += 1;
            first_error.get_or_insert_with(|| format!("at byte {at}: {e}"));
        }
    })?;
    if let Some(first) = first_error {
        warnings.push(format!(
            "{}: {not_records} record(s) that are not one, skipped (the first {first})",
            path.display()
        ));
    }
    if let Some(damage) = damage {
        warnings.push(format!("{}: {damage}; read up to there", path.display()));
    }
    Ok(())
}

/// One record from its bytes, every string in it printable (`snapshot::printable`: control
/// characters such as `\n` and `\r`, and bidirectional overrides, escaped): the daemon escapes
/// what processes chose when it samples them, but a segment in a `--dir` anyone wrote may hold
/// anything, and what `history`, `replay` and `plan` print must not fake lines or rewrite the
/// reader's terminal.
fn decode(bytes: &[u8]) -> serde_json::Result<Record> {
    if plainly_printable(bytes) {
        return serde_json::from_slice(bytes);
    }
    let mut value: serde_json::Value = serde_json::from_slice(bytes)?;
    make_printable(&mut value);
    serde_json::from_value(value)
}

/// Printable ASCII whose only escapes are `\"`, `\\` and `\/`: no string of such JSON holds a
/// character `printable` would escape (the daemon's own records, nearly always).
fn plainly_printable(bytes: &[u8]) -> bool {
    let mut i = 0;
    while i < bytes.len() {
        match (bytes[i], bytes.get(i + 1)) {
            (b'\\', Some(b'"' | b'\\' | b'/')) => i += 2,
            (b'\\', _) => return false,
            (0x20..=0x7e, _) => i += 1,
            _ => return false,
        }
    }
    true
}

fn make_printable(value: &mut serde_json::Value) {
    use serde_json::Value;
    match value {
        Value::String(s) => {
            if let std::borrow::Cow::Owned(escaped) = printable(s) {
                *s = escaped;
            }
        }
        Value::Array(items) => items.iter_mut().for_each(make_printable),
        Value::Object(map) => {
            *map = std::mem::take(map)
                .into_iter()
                .map(|(k, mut v)| {
                    make_printable(&mut v);
                    (printable(&k).into_owned(), v)
                })
                .collect();
        }
        Value::Null | Value::Bool(_) | Value::Number(_) => {}
    }
}

/// Hands every record of `dir` to `each`, oldest first, one record in memory at a time
/// (read-only; works whether the daemon runs or not). Returns what could not be read.
pub fn visit(dir: &Path, mut each: impl FnMut(Record)) -> std::io::Result<Vec<String>> {
    let mut warnings = Vec::new();
    for path in segments(dir)? {
        read_one(&path, &mut warnings, &mut each)?;
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
/// record in memory at a time (`None`: no records at all).
pub fn last_run(dir: &Path) -> std::io::Result<(Option<LastRun>, Vec<String>)> {
    let mut warnings = Vec::new();
    let mut run: Option<LastRun> = None;
    for path in segments(dir)?.iter().rev() {
        let mut tail = LastRun::default();
        let mut any = false;
        read_one(path, &mut warnings, &mut |r| {
            any = true;
            tail.take(r);
        })?;
        if !any {
            continue;
        }
        let started = tail.start.is_some();
        run = Some(match run {
            None => tail,
            Some(newer) => newer.after(tail),
        });
        if started {
            break;
        }
    }
    Ok((run, warnings))
}

impl LastRun {
    /// The next record of a segment read forward: a `Start` begins the run again.
    fn take(&mut self, r: Record) {
        let (at, stopped) = (r.at_ms(), matches!(r, Record::Stop { .. }));
        match r {
            Record::Start { at_ms, boot_id, .. } => {
                *self = LastRun {
                    start: Some((at_ms, boot_id)),
                    ..LastRun::default()
                }
            }
            Record::Sample { at_ms, status, .. } => self.last_sample = Some((at_ms, *status)),
            Record::Action { at_ms, action } => {
                if self.last_actions.len() == POST_MORTEM_ACTIONS {
                    self.last_actions.remove(0);
                }
                self.last_actions.push((at_ms, action));
            }
            Record::Event { .. } | Record::Stop { .. } => {}
        }
        (self.last_at, self.stopped) = (at, stopped);
    }

    /// This run (read from later segments, with no `Start` among them) after `earlier`, the
    /// part of it an earlier segment holds.
    fn after(mut self, earlier: LastRun) -> LastRun {
        self.start = earlier.start;
        if self.last_sample.is_none() {
            self.last_sample = earlier.last_sample;
        }
        let room = POST_MORTEM_ACTIONS - self.last_actions.len();
        let skip = earlier.last_actions.len().saturating_sub(room);
        let mut actions: Vec<_> = earlier.last_actions.into_iter().skip(skip).collect();
        actions.append(&mut self.last_actions);
        self.last_actions = actions;
        self
    }
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
            fmt_opt_bytes(m.host.available_bytes),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A segment file at `dir/name` holding `records`.
    fn write_segment(dir: &Path, name: &str, records: &[Record]) {
        let mut bytes = segment::MAGIC.to_vec();
        for r in records {
            segment::write_record(&mut bytes, &serde_json::to_vec(r).unwrap()).unwrap();
        }
        std::fs::write(dir.join(name), bytes).unwrap();
    }

    fn event(at_ms: u64, message: &str) -> Record {
        Record::Event {
            at_ms,
            severity: Severity::Critical,
            kind: "x".into(),
            message: message.into(),
        }
    }

    /// Issue 41: names the writer makes are names readers read, up to the largest.
    #[test]
    fn segment_names_and_numbers_agree_up_to_the_largest() {
        for n in [0, 1, 1_764_140_000_000, MAX_NUMBER] {
            let name = segment_name(n);
            assert_eq!(name.len(), 16 + SUFFIX.len(), "{name}");
            assert_eq!(segment_number(&name), Some(n), "{name}");
        }
        assert_eq!(segment_number("10000000000000000.seg"), None);
        assert_eq!(segment_number("000000000000001.seg"), None);
    }

    /// Issue 41: a sparse file over the largest segment size, in a `--dir` anyone wrote, cost
    /// the reader its size in memory (a terabyte takes the host). Now it is refused unread, with
    /// a warning, and the segments beside it are read.
    #[test]
    fn a_file_larger_than_any_segment_is_refused_unread() {
        let tmp = tempfile::tempdir().unwrap();
        let huge = std::fs::File::create(tmp.path().join(segment_name(1))).unwrap();
        huge.set_len(1 << 40).unwrap();
        write_segment(tmp.path(), &segment_name(2), &[event(5, "kept")]);
        let mut records = Vec::new();
        let warnings = visit(tmp.path(), |r| records.push(r)).unwrap();
        assert_eq!(records, [event(5, "kept")]);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("1.0 TiB, larger than any segment gpuguard writes"),
            "{warnings:?}"
        );
    }

    /// A file within the size that starts as a segment and goes on with zeros (each 8 zero
    /// bytes frame an empty record whose checksum matches): one warning for the segment, not
    /// one a frame.
    #[test]
    fn frames_that_are_not_records_are_one_warning_a_segment() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(segment_name(1));
        std::fs::write(&path, segment::MAGIC).unwrap();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.set_len(segment::MAGIC.len() as u64 + 8 * 4096)
            .unwrap();
        let warnings = visit(tmp.path(), |_| panic!("a record")).unwrap();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0]
                .contains("4096 record(s) that are not one, skipped (the first at byte 19: "),
            "{warnings:?}"
        );
        // Not a segment at all: nothing past its first bytes is read.
        std::fs::write(&path, b"GPUGUARD-HISTORY-2\n").unwrap();
        let warnings = visit(tmp.path(), |_| panic!("a record")).unwrap();
        assert!(
            warnings[0].contains("not a gpuguard history segment"),
            "{warnings:?}"
        );
    }

    /// Issue 41: a crafted record's `\n` was printed raw (a faked line of `history`'s output).
    /// Every string read from a segment comes back printable, wherever it is in the record.
    #[test]
    fn control_characters_in_what_a_segment_holds_come_back_escaped() {
        let tmp = tempfile::tempdir().unwrap();
        let mut status = StatusReport::default();
        status.models.push(crate::status::ModelRow {
            name: "m\r\n11-26 09:44:19  critical process_killed: sshd".into(),
            ..Default::default()
        });
        let forged = [
            event(
                1,
                "ok\n2026-01-01 00:00:00  critical faked: \u{1b}[2J\u{202e}",
            ),
            Record::Sample {
                at_ms: 2,
                status: Box::new(status),
                input: None,
            },
            event(3, "plain \"quoted\" \\u{1b} a/b"),
        ];
        write_segment(tmp.path(), &segment_name(1), &forged);
        let mut records = Vec::new();
        let warnings = visit(tmp.path(), |r| records.push(r)).unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        let Record::Event { message, .. } = &records[0] else {
            panic!("{records:?}")
        };
        assert_eq!(
            message,
            "ok\\u{a}2026-01-01 00:00:00  critical faked: \\u{1b}[2J\\u{202e}"
        );
        let Record::Sample { status, .. } = &records[1] else {
            panic!("{records:?}")
        };
        assert!(status.models[0].name.starts_with("m\\u{d}\\u{a}11-26"));
        assert_eq!(records[2], event(3, "plain \"quoted\" \\u{1b} a/b"));
        assert!(plainly_printable(&serde_json::to_vec(&records[2]).unwrap()));
    }

    /// The post-mortem's reading, forward through each segment: the latest run's last record,
    /// sample and actions, across segments, back to its `Start` and not into the run before.
    #[test]
    fn the_last_run_is_gathered_from_segments_read_forward() {
        let tmp = tempfile::tempdir().unwrap();
        let start = |at_ms: u64, boot: &str| Record::Start {
            at_ms,
            version: "0".into(),
            boot_id: boot.into(),
        };
        let action = |at_ms: u64| Record::Action {
            at_ms,
            action: ActionRow {
                at_unix: 0,
                verb: crate::policy::Verb::Stop,
                target: String::new(),
                reason_kind: crate::kinds::ReasonKind::RamBudget,
                reason: String::new(),
                outcome: crate::policy::Outcome::Done,
            },
        };
        let sample = |at_ms: u64| Record::Sample {
            at_ms,
            status: Box::default(),
            input: None,
        };
        write_segment(
            tmp.path(),
            &segment_name(1),
            &[start(1, "a"), action(2), Record::Stop { at_ms: 3 }],
        );
        write_segment(
            tmp.path(),
            &segment_name(2),
            &[start(10, "b"), action(11), action(12), sample(13)],
        );
        write_segment(tmp.path(), &segment_name(3), &[action(20), action(21)]);
        write_segment(tmp.path(), &segment_name(4), &[event(30, "x")]);
        let (run, warnings) = last_run(tmp.path()).unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        let run = run.unwrap();
        assert_eq!(run.start, Some((10, "b".to_string())));
        assert_eq!((run.last_at, run.stopped), (30, false));
        assert_eq!(run.last_sample.map(|(at, _)| at), Some(13));
        let at: Vec<u64> = run.last_actions.iter().map(|(at, _)| *at).collect();
        assert_eq!(at, [12, 20, 21]);
    }
}
