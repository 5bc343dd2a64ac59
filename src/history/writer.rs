//! The `history` thread: takes records from the loop through a bounded queue and appends them to
//! the current segment, rolls segments, keeps the directory within its cap and retention, syncs
//! as often as the pressure on the host asks, and stops recording when the file system is nearly
//! full (or a write finds it full): then it looks again at most every `RETRY_FULL` (by the times
//! of the records it is handed) and resumes by itself, in a new segment, once there is room for
//! a segment above the floor. Other write errors stop it until the daemon restarts.

use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::fs::{openat, unlinkat, AtFlags, Mode, OFlags};
use rustix::io::Errno;

use super::{segment, segment_name, segment_number, Record, MAX_NUMBER};
use crate::config::HistoryConfig;
use crate::kinds::Severity;

/// Records waiting for the thread; beyond, new ones are dropped (and counted).
const QUEUE: usize = 1024;
/// Recording stops when the file system has less than this share free...
const MIN_FREE_SHARE: f64 = 0.02;
/// ...or less than this.
const MIN_FREE_BYTES: u64 = 256 << 20;
/// Segments are at least this large (and a sixteenth of the cap above it, at most
/// `segment::MAX_SEGMENT`).
const MIN_SEGMENT: u64 = 256 << 10;
/// Stopped on a full disk, the recorder looks at the free space again at most this often.
const RETRY_FULL: Duration = Duration::from_secs(10);

/// How close the host is to a floor: how often samples are kept and the file synced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Pressure {
    /// Every floor reads ok: a sample every `[history] interval`, synced every 6 of them.
    Quiet,
    /// A floor reads warn: a sample every second, synced every 5 s.
    Warn,
    /// A floor reads act (or a process is held): every sample, synced at once.
    Act,
}

impl Pressure {
    fn sample_every(self, quiet: Duration) -> Duration {
        match self {
            Pressure::Quiet => quiet,
            Pressure::Warn => Duration::from_secs(1),
            Pressure::Act => Duration::ZERO,
        }
    }

    fn sync_every(self, quiet: Duration) -> Duration {
        match self {
            Pressure::Quiet => quiet * 6,
            Pressure::Warn => Duration::from_secs(5),
            Pressure::Act => Duration::ZERO,
        }
    }
}

enum Message {
    Record(Record, Pressure),
    /// Sync what was written; answered when done (tests).
    #[cfg(test)]
    Flush(SyncSender<()>),
}

/// The loop's handle on the recorder.
pub struct Recorder {
    tx: Option<SyncSender<Message>>,
    thread: Option<std::thread::JoinHandle<()>>,
    shared: Arc<Shared>,
    config: HistoryConfig,
    last_sample: Option<Instant>,
}

#[derive(Default)]
struct Shared {
    /// Why recording stopped, once it did (taken once by `stopped`).
    stopped: Mutex<Option<String>>,
    /// That recording resumed, once it did (taken once by `resumed`).
    resumed: Mutex<Option<String>>,
    dropped: AtomicU64,
    /// Recording stops below this much free space (or `MIN_FREE_SHARE`): `MIN_FREE_BYTES`
    /// (tests move it to play a disk that fills and empties).
    min_free: AtomicU64,
}

/// Why the writer does not write.
enum Stopped {
    /// The file system is nearly full: looked at again by itself (`RETRY_FULL`).
    Full {
        /// When (a record's time, Unix ms) the free space was last looked at.
        checked_ms: u64,
        /// The first and last record times not kept (Unix ms), and how many.
        lost: (u64, u64),
        count: u64,
    },
    /// Any other write error: until the daemon restarts.
    Failed,
}

impl Recorder {
    /// Starts the thread on `dir` (the history directory, open), with a new segment.
    pub fn start(dir: OwnedFd, config: &HistoryConfig) -> std::io::Result<Recorder> {
        Recorder::start_with(dir, config, MIN_FREE_BYTES)
    }

    /// `start`, stopping when the file system has less than `min_free` bytes free (tests).
    fn start_with(
        dir: OwnedFd,
        config: &HistoryConfig,
        min_free: u64,
    ) -> std::io::Result<Recorder> {
        let shared = Arc::new(Shared::default());
        shared.min_free.store(min_free, Ordering::Relaxed);
        let (tx, rx) = sync_channel(QUEUE);
        let writer = Writer::new(dir, config, shared.clone());
        let thread = std::thread::Builder::new()
            .name("history".into())
            .spawn(move || writer.run(rx))?;
        Ok(Recorder {
            tx: Some(tx),
            thread: Some(thread),
            shared,
            config: config.clone(),
            last_sample: None,
        })
    }

    /// Queues a record (never waits: dropped if the queue is full).
    pub fn record(&self, record: Record, pressure: Pressure) {
        if let Some(tx) = &self.tx {
            if let Err(TrySendError::Full(_)) = tx.try_send(Message::Record(record, pressure)) {
                self.shared.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Whether a sample taken at `now` under `pressure` is due (and if so, counts it as taken).
    pub fn sample_due(&mut self, now: Instant, pressure: Pressure) -> bool {
        let every = pressure.sample_every(self.config.interval);
        let due = self
            .last_sample
            .is_none_or(|t| now.saturating_duration_since(t) >= every);
        if due {
            self.last_sample = Some(now);
        }
        due
    }

    /// Why recording stopped, the first time this is asked after it did.
    pub fn stopped(&self) -> Option<String> {
        self.shared.stopped.lock().unwrap().take()
    }

    /// That recording resumed after a full disk (and what it did not keep meanwhile), the first
    /// time this is asked after it did.
    pub fn resumed(&self) -> Option<String> {
        self.shared.resumed.lock().unwrap().take()
    }

    /// Records dropped because the queue was full or one was too large, since the start.
    #[cfg(test)]
    pub fn dropped(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }

    /// Waits until everything queued so far is written and synced (for tests: the loop never
    /// waits for the disk).
    #[cfg(test)]
    pub fn flush(&self) {
        if let Some(tx) = &self.tx {
            let (done, wait) = sync_channel(1);
            if tx.send(Message::Flush(done)).is_ok() {
                let _ = wait.recv();
            }
        }
    }

    /// Writes what is queued, syncs and ends the thread.
    pub fn shutdown(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The thread's state.
struct Writer {
    dir: OwnedFd,
    max_size: u64,
    segment_size: u64,
    retention: Duration,
    quiet: Duration,
    shared: Arc<Shared>,
    /// The segment being written: its name, file and size.
    current: Option<(File, u64)>,
    synced: Instant,
    dirty: bool,
    stopped: Option<Stopped>,
    writes: u64,
    /// Since the start: bytes written and syncs (said when the thread ends).
    written: u64,
    syncs: u64,
}

impl Writer {
    fn new(dir: OwnedFd, config: &HistoryConfig, shared: Arc<Shared>) -> Writer {
        let max_size = config.max_size_bytes();
        Writer {
            dir,
            max_size,
            segment_size: (max_size / 16).clamp(MIN_SEGMENT, segment::MAX_SEGMENT),
            retention: config.retention,
            quiet: config.interval,
            shared,
            current: None,
            synced: Instant::now(),
            dirty: false,
            stopped: None,
            writes: 0,
            written: 0,
            syncs: 0,
        }
    }

    fn run(mut self, rx: Receiver<Message>) {
        for message in rx {
            match message {
                Message::Record(record, pressure) => {
                    if let Err(e) = self.write(&record, pressure) {
                        let full = matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT));
                        let then = if full {
                            "it starts again by itself once the file system has room"
                        } else {
                            "it starts again with the daemon"
                        };
                        let why = format!("cannot write: {e}: recording stopped ({then})");
                        self.stop(why, full.then_some(record.at_ms()));
                    }
                }
                #[cfg(test)]
                Message::Flush(done) => {
                    self.sync();
                    let _ = done.send(());
                }
            }
        }
        self.sync();
        tracing::info!(
            "history: {} records, {} written, {} syncs since the start",
            self.writes,
            crate::units::fmt_bytes(self.written),
            self.syncs
        );
    }

    /// Stops writing and says why; `full_at`: stopped on a full disk at that record's time
    /// (then it looks again by itself).
    fn stop(&mut self, why: String, full_at: Option<u64>) {
        if self.stopped.is_none() {
            self.stopped = Some(match full_at {
                Some(at_ms) => Stopped::Full {
                    checked_ms: at_ms,
                    lost: (at_ms, at_ms),
                    count: 1,
                },
                None => Stopped::Failed,
            });
            self.current = None;
            *self.shared.stopped.lock().unwrap() = Some(why);
        }
    }

    /// While stopped: whether `at_ms`'s record may be written, the recording resumed. On a full
    /// disk the free space is looked at again once `RETRY_FULL` has passed since the last look
    /// (by the records' times; at once if the clock went back), and recording resumes once
    /// there is room for a segment above the floor.
    fn resume(&mut self, at_ms: u64) -> bool {
        let Some(Stopped::Full {
            checked_ms,
            lost,
            count,
        }) = &mut self.stopped
        else {
            return self.stopped.is_none();
        };
        let due = at_ms
            .checked_sub(*checked_ms)
            .is_none_or(|since| since >= RETRY_FULL.as_millis() as u64);
        let needed =
            (self.shared.min_free.load(Ordering::Relaxed)).saturating_add(self.segment_size);
        let room = due
            .then(|| {
                *checked_ms = at_ms;
                free_space(&self.dir)
            })
            .flatten()
            .filter(|&(free, share)| free >= needed && share >= MIN_FREE_SHARE);
        let Some((free, share)) = room else {
            *count += 1;
            lost.1 = at_ms;
            return false;
        };
        *self.shared.resumed.lock().unwrap() = Some(format!(
            "the file system of the history has {} free ({:.1}%) again: recording resumed in a new segment; {count} record(s) from {} to {} were not kept",
            crate::units::fmt_bytes(free),
            share * 100.0,
            super::format_ms(lost.0),
            super::format_ms(lost.1)
        ));
        self.stopped = None;
        true
    }

    fn write(&mut self, record: &Record, pressure: Pressure) -> std::io::Result<()> {
        if !self.resume(record.at_ms()) {
            return Ok(());
        }
        let bytes = serde_json::to_vec(record).map_err(std::io::Error::other)?;
        if bytes.len() > segment::MAX_RECORD {
            // Too large to keep (a host with processes beyond count): this record is lost, not
            // the recording.
            self.shared.dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let full = self
            .current
            .as_ref()
            .is_none_or(|(_, size)| size + bytes.len() as u64 + 8 > self.segment_size);
        if full || self.writes % 256 == 0 {
            if let Some(why) = self.disk_nearly_full() {
                self.stop(why, Some(record.at_ms()));
                return Ok(());
            }
        }
        if full {
            self.roll(record.at_ms())?;
        }
        let (file, size) = self.current.as_mut().expect("a segment after roll");
        segment::write_record(file, &bytes)?;
        *size += bytes.len() as u64 + 8;
        self.written += bytes.len() as u64 + 8;
        self.writes += 1;
        self.dirty = true;
        let critical = matches!(record, Record::Event { severity, .. } if *severity == Severity::Critical)
            || matches!(record, Record::Action { .. } | Record::Stop { .. });
        if critical || self.synced.elapsed() >= pressure.sync_every(self.quiet) {
            self.sync();
        }
        Ok(())
    }

    fn sync(&mut self) {
        if let (true, Some((file, _))) = (self.dirty, &self.current) {
            let _ = file.sync_data();
            self.syncs += 1;
        }
        self.dirty = false;
        self.synced = Instant::now();
    }

    /// Ends the current segment and starts one named by `at_ms`; then drops what the cap and
    /// the retention do not keep.
    fn roll(&mut self, at_ms: u64) -> std::io::Result<()> {
        self.sync();
        // Named by the time of its first record, after every segment there (the clock may have
        // gone back, within a run or across a reboot): names stay in write order.
        let mut segments = self.list()?;
        let at_ms = at_ms.min(MAX_NUMBER);
        if segments
            .last()
            .is_some_and(|(newest, ..)| *newest == MAX_NUMBER)
        {
            // No name sorts after the newest: those named for now or later (a clock that was
            // ahead by millennia, a file put there) go, so that names stay in write order.
            let (kept, ahead): (Vec<_>, Vec<_>) =
                segments.into_iter().partition(|(n, ..)| *n < at_ms);
            for (number, ..) in &ahead {
                tracing::warn!(
                    "history: removing {}, named for a time after now: no segment name is left after it",
                    segment_name(*number)
                );
                self.unlink(*number)?;
            }
            segments = kept;
        }
        let mut number = segments
            .last()
            .map_or(at_ms, |(newest, ..)| at_ms.max(newest + 1));
        let flags =
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = loop {
            let name = segment_name(number);
            match openat(
                &self.dir,
                name.as_str(),
                flags,
                Mode::from_bits_truncate(0o644),
            ) {
                Ok(fd) => break fd,
                // Something else took the name meanwhile: the next one, if there is one.
                Err(Errno::EXIST) if number < MAX_NUMBER => number += 1,
                Err(e) => return Err(e.into()),
            }
        };
        // Readable by any user (`gpuguard history`), whatever the umask (0077 under systemd).
        rustix::fs::fchmod(&fd, Mode::from_bits_truncate(0o644))?;
        let mut file = File::from(fd);
        file.write_all(segment::MAGIC)?;
        self.current = Some((file, segment::MAGIC.len() as u64));
        self.enforce_bounds(at_ms, segments)
    }

    /// Drops the oldest of `segments` (those there before the current one) while all of them
    /// together would pass the cap once the current one is full, and those whose newest record
    /// is older than the retention (a segment's modification time).
    fn enforce_bounds(
        &mut self,
        now_ms: u64,
        segments: Vec<(u64, u64, u64)>,
    ) -> std::io::Result<()> {
        let mut total: u64 = segments.iter().map(|(_, size, _)| size).sum();
        let budget = self.max_size.saturating_sub(self.segment_size);
        let retention_ms = self.retention.as_millis() as u64;
        for (number, size, modified_ms) in segments {
            let expired = now_ms.saturating_sub(modified_ms) > retention_ms;
            if total <= budget && !expired {
                continue;
            }
            self.unlink(number)?;
            total = total.saturating_sub(size);
        }
        Ok(())
    }

    /// Removes segment `number` (gone already is fine).
    fn unlink(&self, number: u64) -> std::io::Result<()> {
        match unlinkat(&self.dir, segment_name(number).as_str(), AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// The segments: (number, size, modified at in Unix ms), oldest first.
    fn list(&self) -> std::io::Result<Vec<(u64, u64, u64)>> {
        let listing = openat(
            &self.dir,
            ".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let mut out = Vec::new();
        for entry in rustix::fs::Dir::read_from(&listing)? {
            let entry = entry?;
            let Ok(name) = entry.file_name().to_str() else {
                continue;
            };
            let Some(number) = segment_number(name) else {
                continue;
            };
            let st = match rustix::fs::statat(&self.dir, name, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                Err(Errno::NOENT) => continue,
                Err(e) => return Err(e.into()),
            };
            let modified_ms = (st.st_mtime.max(0) as u64) * 1000;
            out.push((number, st.st_size.max(0) as u64, modified_ms));
        }
        out.sort();
        Ok(out)
    }

    /// Why recording must stop, if the file system is nearly full.
    fn disk_nearly_full(&self) -> Option<String> {
        let (free, share) = free_space(&self.dir)?;
        let floor = self.shared.min_free.load(Ordering::Relaxed);
        (free < floor || share < MIN_FREE_SHARE).then(|| {
            format!(
                "the file system of the history has {} free ({:.1}%): recording stopped so the disk never fills (it starts again by itself once there is room)",
                crate::units::fmt_bytes(free),
                share * 100.0
            )
        })
    }
}

/// The free space of the file system `dir` is on: bytes available to the daemon, and their
/// share of its size (`None`: unknown).
fn free_space(dir: &OwnedFd) -> Option<(u64, f64)> {
    let st = rustix::fs::fstatvfs(dir).ok()?;
    let block = st.f_frsize.max(1);
    let free = st.f_bavail * block;
    let total = st.f_blocks * block;
    let share = if total > 0 {
        free as f64 / total as f64
    } else {
        1.0
    };
    Some((free, share))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::segment_name;
    use crate::history::{now_ms, read, segments};
    use crate::units::Amount;

    fn dir_fd(path: &std::path::Path) -> OwnedFd {
        rustix::fs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .unwrap()
    }

    fn event(at_ms: u64, size: usize) -> Record {
        Record::Event {
            at_ms,
            severity: Severity::Warning,
            kind: "test".into(),
            message: "x".repeat(size),
        }
    }

    fn total_size(path: &std::path::Path) -> u64 {
        segments(path)
            .unwrap()
            .iter()
            .map(|p| std::fs::metadata(p).unwrap().len())
            .sum()
    }

    /// A long run at the act rate (synced at every record) keeps the directory within its cap:
    /// the oldest segments go, the newest records stay, and what is left reads back whole.
    #[test]
    fn the_cap_holds_over_a_long_run_and_the_newest_records_stay() {
        let tmp = tempfile::tempdir().unwrap();
        let config = HistoryConfig {
            max_size: Amount::Bytes(1 << 20),
            ..HistoryConfig::default()
        };
        let now = now_ms();
        let recorder = Recorder::start(dir_fd(tmp.path()), &config).unwrap();
        // 6 MiB of 4 KiB records: six times the cap.
        for i in 0..1536u64 {
            recorder.record(event(now + i, 4096), Pressure::Quiet);
            if i % 256 == 255 {
                recorder.flush();
                assert!(total_size(tmp.path()) <= 1 << 20, "after {i} records");
            }
        }
        recorder.flush();
        assert_eq!(recorder.dropped(), 0);
        let h = read(tmp.path()).unwrap();
        assert!(h.warnings.is_empty(), "{:?}", h.warnings);
        assert_eq!(h.records.last().unwrap().at_ms(), now + 1535);
        let kept = h.records.len() as u64;
        assert!((150..256).contains(&kept), "{kept} records kept of 1536");
        // Contiguous: nothing lost in the middle.
        let first = h.records[0].at_ms();
        assert_eq!(first + kept - 1, now + 1535);
    }

    /// Segments whose newest record is older than the retention go when the recorder starts
    /// (and at every roll).
    #[test]
    fn segments_past_the_retention_go() {
        let tmp = tempfile::tempdir().unwrap();
        let config = HistoryConfig::default();
        {
            let r = Recorder::start(dir_fd(tmp.path()), &config).unwrap();
            r.record(event(1_000, 10), Pressure::Act);
        }
        let old = segments(tmp.path()).unwrap();
        assert_eq!(old.len(), 1);
        // Eight days old.
        let eight_days = std::time::SystemTime::now() - Duration::from_secs(8 * 24 * 3600);
        std::fs::File::options()
            .write(true)
            .open(&old[0])
            .unwrap()
            .set_modified(eight_days)
            .unwrap();
        let r = Recorder::start(dir_fd(tmp.path()), &config).unwrap();
        r.record(event(now_ms(), 10), Pressure::Act);
        r.flush();
        let left = segments(tmp.path()).unwrap();
        assert_eq!(left.len(), 1);
        assert_ne!(left[0], old[0]);
    }

    /// A clock that went back (a reboot with a wrong RTC, an NTP step): the new run's segment is
    /// still named after the newest one there, so it is read after it.
    #[test]
    fn a_clock_that_went_back_keeps_segments_in_write_order() {
        let tmp = tempfile::tempdir().unwrap();
        let config = HistoryConfig::default();
        {
            let r = Recorder::start(dir_fd(tmp.path()), &config).unwrap();
            r.record(event(now_ms() + 3_600_000, 10), Pressure::Act);
        }
        let r = Recorder::start(dir_fd(tmp.path()), &config).unwrap();
        r.record(event(now_ms(), 20), Pressure::Act);
        r.flush();
        let h = read(tmp.path()).unwrap();
        let sizes: Vec<usize> = h
            .records
            .iter()
            .map(|r| match r {
                Record::Event { message, .. } => message.len(),
                _ => 0,
            })
            .collect();
        assert_eq!(sizes, [10, 20]);
    }

    /// Issue 41: a segment named `9999999999999999.seg` made the next one a 17-digit name that
    /// readers skip and the cap never deletes (each roll another). Now no name passes the largest:
    /// the segments named for a time after now go, and every file the writer leaves is a segment
    /// readers read and the cap counts.
    #[test]
    fn a_segment_named_at_the_top_leaves_no_name_readers_skip() {
        let tmp = tempfile::tempdir().unwrap();
        let top = tmp.path().join(segment_name(MAX_NUMBER));
        let mut bytes = segment::MAGIC.to_vec();
        let old = serde_json::to_vec(&event(MAX_NUMBER, 10)).unwrap();
        segment::write_record(&mut bytes, &old).unwrap();
        std::fs::write(&top, bytes).unwrap();
        let config = HistoryConfig {
            max_size: Amount::Bytes(1 << 20),
            ..HistoryConfig::default()
        };
        let now = now_ms();
        let recorder = Recorder::start(dir_fd(tmp.path()), &config).unwrap();
        // Six times the cap: many rolls.
        for i in 0..1536u64 {
            recorder.record(event(now + i, 4096), Pressure::Quiet);
            if i % 256 == 255 {
                recorder.flush();
            }
        }
        recorder.flush();
        assert_eq!((recorder.stopped(), recorder.dropped()), (None, 0));
        for entry in std::fs::read_dir(tmp.path()).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            assert!(segment_number(&name).is_some(), "{name} is not read");
        }
        assert!(!top.exists());
        assert!(total_size(tmp.path()) <= 1 << 20);
        let h = read(tmp.path()).unwrap();
        assert_eq!(h.records.last().unwrap().at_ms(), now + 1535);
    }

    /// A record larger than a segment may hold is dropped and counted; the recording goes on.
    #[test]
    fn a_record_too_large_is_dropped_not_the_recording() {
        let tmp = tempfile::tempdir().unwrap();
        let r = Recorder::start_with(dir_fd(tmp.path()), &HistoryConfig::default(), 0).unwrap();
        r.record(event(1, segment::MAX_RECORD + 1), Pressure::Act);
        r.record(event(2, 10), Pressure::Act);
        r.flush();
        assert_eq!(r.stopped(), None);
        assert_eq!(r.dropped(), 1);
        let h = read(tmp.path()).unwrap();
        assert!(
            matches!(h.records[..], [Record::Event { at_ms: 2, .. }]),
            "{:?}",
            h.records
        );
    }

    /// A history directory anyone may have written (`--dir`): a FIFO or a link named like a
    /// segment is refused at once, never read (a reader would hang or read /dev/zero forever).
    #[test]
    fn a_segment_that_is_not_a_regular_file_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let fifo = tmp.path().join(super::super::segment_name(1));
        rustix::fs::mkfifoat(rustix::fs::CWD, &fifo, Mode::from_bits_truncate(0o600)).unwrap();
        let e = read(tmp.path()).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        std::fs::remove_file(&fifo).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &fifo).unwrap();
        assert!(read(tmp.path()).is_err());
    }

    /// A file system nearly full: recording stops and says why once. It looks at the free space
    /// again at most every `RETRY_FULL` (by the records' times), and once there is room again it
    /// resumes by itself in a new segment and says what it did not keep. Issue 41: a user who
    /// filled the disk for a moment stopped the recorder until the daemon restarted.
    #[test]
    fn a_nearly_full_file_system_stops_the_recording_until_it_has_room_again() {
        let tmp = tempfile::tempdir().unwrap();
        let r =
            Recorder::start_with(dir_fd(tmp.path()), &HistoryConfig::default(), u64::MAX).unwrap();
        let t0 = 1_764_140_000_000;
        let retry = RETRY_FULL.as_millis() as u64;
        r.record(event(t0, 10), Pressure::Act);
        r.flush();
        let why = r.stopped().expect("stopped");
        assert!(why.contains("recording stopped"), "{why}");
        assert_eq!(r.stopped(), None, "said once");
        // Still full when it looks again: it stays stopped, and looks again `RETRY_FULL` later.
        r.record(event(t0 + retry, 10), Pressure::Act);
        r.flush();
        r.shared.min_free.store(0, Ordering::Relaxed);
        r.record(event(t0 + 2 * retry - 1, 10), Pressure::Act);
        r.flush();
        assert_eq!(r.resumed(), None, "looked again before RETRY_FULL");
        assert!(read(tmp.path()).unwrap().records.is_empty());
        r.record(event(t0 + 2 * retry, 20), Pressure::Act);
        r.flush();
        let resumed = r.resumed().expect("resumed");
        assert!(
            resumed.contains("recording resumed") && resumed.contains("3 record(s) from"),
            "{resumed}"
        );
        assert_eq!(r.stopped(), None);
        let h = read(tmp.path()).unwrap();
        let kept: Vec<u64> = h.records.iter().map(Record::at_ms).collect();
        assert_eq!(kept, [t0 + 2 * retry]);
    }
}

#[cfg(test)]
mod last_run_tests {
    use super::*;
    use crate::history::{last_run, unclean_end};
    use crate::status::{ActionRow, StatusReport};

    /// The post-mortem reads the latest run back to its `Start`, across the segments it filled,
    /// and not into the run before it.
    #[test]
    fn the_last_run_is_read_back_to_its_start_across_segments() {
        let tmp = tempfile::tempdir().unwrap();
        let fd = || {
            rustix::fs::open(
                tmp.path(),
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .unwrap()
        };
        let config = HistoryConfig {
            max_size: crate::units::Amount::Bytes(4 << 20),
            ..HistoryConfig::default()
        };
        let action = |verb: &str| ActionRow {
            at_unix: 0,
            reason_kind: crate::kinds::ReasonKind::RamFloor,
            reason: String::new(),
            verb: *crate::policy::Verb::ALL
                .iter()
                .find(|v| v.as_str() == verb)
                .unwrap(),
            target: "pid 7(hog)".into(),
            outcome: crate::policy::Outcome::Done,
        };
        {
            // An earlier run that stopped cleanly.
            let r = Recorder::start(fd(), &config).unwrap();
            r.record(
                Record::Start {
                    at_ms: 1,
                    version: "0".into(),
                    boot_id: "a".into(),
                },
                Pressure::Act,
            );
            r.record(
                Record::Action {
                    at_ms: 2,
                    action: action("kill"),
                },
                Pressure::Act,
            );
            r.record(Record::Stop { at_ms: 3 }, Pressure::Act);
        }
        let r = Recorder::start(fd(), &config).unwrap();
        r.record(
            Record::Start {
                at_ms: 10,
                version: "0".into(),
                boot_id: "b".into(),
            },
            Pressure::Act,
        );
        for i in 0..4 {
            r.record(
                Record::Action {
                    at_ms: 11 + i,
                    action: action("stop"),
                },
                Pressure::Act,
            );
        }
        let mut status = StatusReport::default();
        status.memory.level = crate::kinds::Level::Act;
        r.record(
            Record::Sample {
                at_ms: 20,
                status: Box::new(status),
                input: None,
            },
            Pressure::Act,
        );
        // A megabyte of events after it: the run spans several segments.
        for i in 0..256 {
            r.record(
                Record::Event {
                    at_ms: 30 + i,
                    severity: Severity::Warning,
                    kind: "test".into(),
                    message: "x".repeat(4096),
                },
                Pressure::Quiet,
            );
            if i % 64 == 63 {
                r.flush();
            }
        }
        r.flush();
        assert!(crate::history::segments(tmp.path()).unwrap().len() >= 4);
        let (run, warnings) = last_run(tmp.path()).unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        let run = run.unwrap();
        assert_eq!(run.start, Some((10, "b".to_string())));
        assert_eq!((run.last_at, run.stopped), (285, false));
        assert_eq!(run.last_sample.as_ref().map(|(at, _)| *at), Some(20));
        let at: Vec<u64> = run.last_actions.iter().map(|(at, _)| *at).collect();
        assert_eq!(
            at,
            [12, 13, 14],
            "the last three, not the earlier run's kill"
        );
        let line = unclean_end(&run, "b").unwrap();
        assert!(
            line.contains("did not reboot") && line.contains("(act)"),
            "{line}"
        );
        assert!(unclean_end(&run, "c")
            .unwrap()
            .contains("went down with it"));
    }
}
