//! /proc, read the cheap way. Host memory (`meminfo`, `pressure/memory`) comes through
//! descriptors opened once and read with `pread`, so a tick needs no new file descriptor; a
//! process is read one small file at a time relative to an open /proc directory, into reused
//! buffers. What to read when (the incremental scan) is `scan/`'s business.
//!
//! The root is configurable so tests can point it at fixture directories (hostile `comm` names
//! included). Every byte read here is untrusted: parsers never panic and never index blindly.

use std::fs::File;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{openat, seek, Mode, OFlags, RawDir, SeekFrom};
use rustix::io::{pread, read, Errno};

use crate::snapshot::{printable, Exe, HostMemory, Process, ProcessId};

use super::ProcSource;

/// `PF_KTHREAD` in /proc/PID/stat's flags.
const PF_KTHREAD: u64 = 0x0020_0000;
/// At most this much of a command line is kept (matchers see its first 4 KiB).
pub const CMDLINE_MAX_BYTES: usize = 4096;
/// At most this much of /proc/PID/cgroup is read (cgroup v1 hosts list a dozen hierarchies).
const CGROUP_MAX_BYTES: usize = 4096;

/// The size of a page, the unit of RSS in /proc/PID/stat. (Through libc: rustix's own
/// `page_size` reads the auxiliary vector in a way valgrind does not support.)
pub fn page_size() -> u64 {
    // SAFETY: sysconf takes a constant and returns a number.
    match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as u64,
        _ => 4096,
    }
}

/// Clock ticks per second, the unit of start times in /proc/PID/stat.
pub fn clock_ticks() -> u64 {
    // SAFETY: sysconf takes a constant and returns a number.
    match unsafe { libc::sysconf(libc::_SC_CLK_TCK) } {
        n if n > 0 => n as u64,
        _ => 100,
    }
}

/// Why a process could not be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadError {
    /// It has exited (or never existed): ENOENT/ESRCH.
    Gone,
    /// The file could not be read (no descriptor left, no permission...): nothing is known, and
    /// the process must not be taken for gone.
    Unreadable(Errno),
    /// The file did not parse.
    Malformed,
}

impl From<Errno> for ReadError {
    fn from(e: Errno) -> Self {
        match e {
            Errno::NOENT | Errno::SRCH => ReadError::Gone,
            e => ReadError::Unreadable(e),
        }
    }
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Gone => f.write_str("process has exited"),
            ReadError::Unreadable(e) => write!(f, "{}", io::Error::from(*e)),
            ReadError::Malformed => f.write_str("malformed"),
        }
    }
}

/// What changes when a process calls `exec`: where its code, data, stack, arguments and
/// environment live (fields 26-28 and 45-51 of /proc/PID/stat). With address-space layout
/// randomisation every exec moves the stack and the arguments, even of the same binary with the
/// same command line. All zeros where the reader may not see them (no ptrace access).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ExecMark([u64; 10]);

impl ExecMark {
    /// False when /proc hid the layout (another user's process read without privilege, or a
    /// process without memory): an exec cannot be told from it.
    pub fn known(&self) -> bool {
        self.0.iter().any(|&v| v > 1)
    }
}

/// The fields of /proc/PID/stat the guard uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stat {
    pub pid: i32,
    pub comm: String,
    pub state: char,
    pub ppid: i32,
    pub flags: u64,
    pub threads: i64,
    /// Clock ticks since boot.
    pub start_time: u64,
    pub rss_pages: u64,
    pub exec: ExecMark,
}

impl Stat {
    pub fn kernel_thread(&self) -> bool {
        self.flags & PF_KTHREAD != 0
    }
}

/// Parses one /proc/PID/stat line, shaped as the kernel writes it (`PID (comm) S ...`; anything
/// else is not a process). `comm` may contain anything, parentheses and spaces included: it runs
/// from the first `(` to the last `)`; control characters in it are escaped.
pub fn parse_stat(text: &[u8]) -> Option<Stat> {
    let open = text.iter().position(|&b| b == b'(')?;
    let close = text.iter().rposition(|&b| b == b')')?;
    if close < open || text.get(close + 1) != Some(&b' ') {
        return None;
    }
    let digits = text[..open].strip_suffix(b" ")?;
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let pid = std::str::from_utf8(digits).ok()?.parse().ok()?;
    let comm = printable(&String::from_utf8_lossy(&text[open + 1..close])).into_owned();
    let rest = std::str::from_utf8(text.get(close + 1..)?).ok()?;
    // Field N of proc(5) is at index N - 3 here (after pid and comm).
    let mut fields = [0u64; 49];
    let mut state = None;
    let mut ppid = None;
    for (i, word) in rest.split_ascii_whitespace().enumerate() {
        match i {
            0 => state = word.chars().next(),
            1 => ppid = word.parse::<i32>().ok(),
            // Numbers that do not parse (negative priorities, an odd kernel) stay 0.
            i if i < fields.len() => fields[i] = word.parse().unwrap_or(0),
            _ => break,
        }
    }
    let f = |n: usize| fields[n - 3];
    Some(Stat {
        pid,
        comm,
        state: state?,
        ppid: ppid?,
        flags: f(9),
        threads: f(20) as i64,
        start_time: f(22),
        rss_pages: f(24),
        exec: ExecMark([
            f(26),
            f(27),
            f(28),
            f(45),
            f(46),
            f(47),
            f(48),
            f(49),
            f(50),
            f(51),
        ]),
    })
}

/// The fields of /proc/PID/status the guard uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Status {
    /// The real uid (`Uid:`'s first column).
    pub uid: Option<u32>,
    pub swap_bytes: Option<u64>,
}

pub fn parse_status(text: &[u8]) -> Status {
    let mut status = Status::default();
    for line in text.split(|&b| b == b'\n') {
        let Ok(line) = std::str::from_utf8(line) else {
            continue;
        };
        if let Some(rest) = line.strip_prefix("Uid:") {
            status.uid = rest
                .split_ascii_whitespace()
                .next()
                .and_then(|u| u.parse().ok());
        } else if let Some(rest) = line.strip_prefix("VmSwap:") {
            let mut parts = rest.split_ascii_whitespace();
            status.swap_bytes = match (parts.next().map(str::parse::<u64>), parts.next()) {
                (Some(Ok(kib)), Some("kB")) => kib.checked_mul(1024),
                _ => None,
            };
        }
    }
    status
}

/// The five /proc/meminfo fields the guard needs. (procfs's `Meminfo` parses every field into a
/// map and fails as a whole if one it expects is missing; this is the hot path, and a missing
/// field must leave only that reading unknown.)
pub fn parse_meminfo(text: &str, host: &mut HostMemory) {
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let slot = match key {
            "MemTotal" => &mut host.total_bytes,
            "MemAvailable" => &mut host.available_bytes,
            "SwapTotal" => &mut host.swap_total_bytes,
            "SwapFree" => &mut host.swap_free_bytes,
            "Shmem" => &mut host.shmem_bytes,
            _ => continue,
        };
        let mut parts = rest.split_whitespace();
        let value = parts.next().and_then(|v| v.parse::<u64>().ok());
        let scale = match parts.next() {
            Some("kB") => 1024,
            None => 1,
            Some(_) => continue,
        };
        *slot = value.and_then(|v| v.checked_mul(scale));
    }
}

/// `some avg10` from /proc/pressure/memory (the `full` line is not used).
pub fn parse_psi(text: &str, host: &mut HostMemory) {
    for line in text.lines() {
        let mut words = line.split_ascii_whitespace();
        if words.next() != Some("some") {
            continue;
        }
        host.psi_some_avg10 = words
            .find_map(|w| w.strip_prefix("avg10="))
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite());
    }
}

/// The cgroup v2 path (`0::/system.slice/x.service`), else the first hierarchy's path.
pub fn parse_cgroup(text: &str) -> String {
    let path_of = |line: &str| line.splitn(3, ':').nth(2).map(str::to_string);
    text.lines()
        .find(|l| l.starts_with("0::"))
        .and_then(path_of)
        .or_else(|| text.lines().next().and_then(path_of))
        .unwrap_or_default()
}

/// Arguments joined by spaces (NULs become spaces; the final NUL goes; control characters are
/// escaped).
fn parse_cmdline(raw: &[u8]) -> String {
    let raw = raw.strip_suffix(&[0]).unwrap_or(raw);
    printable(&String::from_utf8_lossy(raw).replace('\0', " ")).into_owned()
}

/// Reads `file` at offset 0 into `buf` (at most `cap` bytes). The buffer keeps its allocation.
fn pread_all(file: &impl AsFd, buf: &mut Vec<u8>, cap: usize) -> Result<(), Errno> {
    buf.clear();
    loop {
        let len = buf.len();
        if len >= cap {
            return Ok(());
        }
        buf.resize((len + 4096).min(cap), 0);
        match pread(file, &mut buf[len..], len as u64) {
            Ok(0) => {
                buf.truncate(len);
                return Ok(());
            }
            Ok(n) => buf.truncate(len + n),
            Err(Errno::INTR) => buf.truncate(len),
            Err(e) => {
                buf.truncate(len);
                return Err(e);
            }
        }
    }
}

/// Host memory, read every tick through two descriptors opened once.
pub struct HostReader {
    root: PathBuf,
    meminfo: Option<File>,
    psi: Option<File>,
    /// The kernel has no PSI (or it is off): not an error, just unknown.
    psi_absent: bool,
    buf: Vec<u8>,
    /// Why the last meminfo read failed, if it did.
    error: Option<String>,
}

impl HostReader {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        let mut reader = HostReader {
            root: root.into(),
            meminfo: None,
            psi: None,
            psi_absent: false,
            buf: Vec::with_capacity(8192),
            error: None,
        };
        reader.open();
        reader
    }

    fn open(&mut self) {
        if self.meminfo.is_none() {
            let path = self.root.join("meminfo");
            match File::open(&path) {
                Ok(f) => self.meminfo = Some(f),
                Err(e) => self.error = Some(format!("cannot open {}: {e}", path.display())),
            }
        }
        if self.psi.is_none() && !self.psi_absent {
            match File::open(self.root.join("pressure/memory")) {
                Ok(f) => self.psi = Some(f),
                Err(e) if e.kind() == io::ErrorKind::NotFound => self.psi_absent = true,
                Err(_) => {}
            }
        }
    }

    /// MemTotal/MemAvailable/swap/PSI. A reading that fails is `None` and `error()` says why; the
    /// descriptor is opened again on the next call.
    pub fn read(&mut self) -> HostMemory {
        self.open();
        let mut host = HostMemory::default();
        if let Some(file) = &self.meminfo {
            match pread_all(file, &mut self.buf, 64 << 10) {
                Ok(()) => {
                    parse_meminfo(&String::from_utf8_lossy(&self.buf), &mut host);
                    self.error = match host.available_bytes {
                        Some(_) => None,
                        None => Some(format!(
                            "{} has no MemAvailable",
                            self.root.join("meminfo").display()
                        )),
                    };
                }
                Err(e) => {
                    self.error = Some(format!(
                        "cannot read {}: {}",
                        self.root.join("meminfo").display(),
                        io::Error::from(e)
                    ));
                    self.meminfo = None;
                }
            }
        }
        if let Some(file) = &self.psi {
            match pread_all(file, &mut self.buf, 4096) {
                Ok(()) => parse_psi(&String::from_utf8_lossy(&self.buf), &mut host),
                // Booted with psi=0: the file is there but reads fail for good.
                Err(Errno::OPNOTSUPP) => {
                    self.psi = None;
                    self.psi_absent = true;
                }
                Err(_) => self.psi = None,
            }
        }
        host
    }

    /// Why host memory is unknown, while it is.
    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }
}

/// A process's stat as the guard uses it: the leader's identity, and where the leader has
/// exited while other threads run (state Z, rss 0), a live thread's state, memory and layout.
#[derive(Clone, Debug)]
pub struct ProcStat {
    pub stat: Stat,
    /// The live thread the memory was read from, when the leader has exited.
    pub thread: Option<i32>,
}

/// The volatile part of a process, re-read every tick for the victims the guard waits on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Vitals {
    pub id: ProcessId,
    pub state: char,
    pub ppid: i32,
    pub rss_bytes: u64,
    pub swap_bytes: Option<u64>,
}

/// Reads processes relative to an open /proc, one small file at a time, into reused buffers.
pub struct ProcReader {
    root: PathBuf,
    dir: Result<OwnedFd, Errno>,
    buf: Vec<u8>,
    path: String,
    dirents: Vec<MaybeUninit<u8>>,
    page_size: u64,
}

impl ProcReader {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        let root = root.into();
        let dir = open_dir(&root);
        ProcReader {
            root,
            dir,
            buf: Vec::with_capacity(8192),
            path: String::with_capacity(64),
            dirents: Vec::new(),
            page_size: crate::sample::procfs::page_size(),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// A process's proportional set size (`Pss:` of its smaps_rollup): costly, the kernel walks
    /// its page tables. The kernel shows it only to a reader that may ptrace the process: the
    /// packaged unit (no CAP_SYS_PTRACE) reads its own processes only (the scan then estimates
    /// the others' share from their memory cgroups) and says so once.
    pub fn pss(&mut self, pid: i32) -> Option<u64> {
        static DENIED_SAID: std::sync::atomic::AtomicBool =
            std::sync::atomic::AtomicBool::new(false);
        let path = self.root.join(pid.to_string()).join("smaps_rollup");
        match std::fs::read_to_string(path) {
            Ok(text) => parse_pss(&text),
            Err(e) => {
                if e.kind() == std::io::ErrorKind::PermissionDenied
                    && !DENIED_SAID.swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    tracing::warn!(
                        "cannot read /proc/{pid}/smaps_rollup: {e}; near the RAM floor such \
                         processes are ranked by their share of their memory cgroup's \
                         anonymous memory (cgroup v2), else by RSS, which counts pages forked \
                         workers share once in each (the kernel wants CAP_SYS_PTRACE to read \
                         another account's: add it to the unit's CapabilityBoundingSet= in a \
                         drop-in)"
                    );
                }
                None
            }
        }
    }

    /// A process's resident anonymous memory: `statm`'s resident pages less its shared ones
    /// (file-backed and shmem), which anyone may read.
    pub fn anon_bytes(&mut self, pid: i32) -> Result<u64, ReadError> {
        self.dir()?;
        self.read_file(pid, None, "statm", 256)?;
        let text = std::str::from_utf8(&self.buf).map_err(|_| ReadError::Malformed)?;
        let mut fields = text.split_ascii_whitespace().skip(1).map(str::parse::<u64>);
        match (fields.next(), fields.next()) {
            (Some(Ok(resident)), Some(Ok(shared))) => Ok(resident
                .saturating_sub(shared)
                .saturating_mul(self.page_size)),
            _ => Err(ReadError::Malformed),
        }
    }

    fn dir(&mut self) -> Result<&OwnedFd, ReadError> {
        if self.dir.is_err() {
            self.dir = open_dir(&self.root);
        }
        self.dir.as_ref().map_err(|e| ReadError::from(*e))
    }

    /// Reads `PID[/task/TID]/FILE` into the buffer.
    fn read_file(
        &mut self,
        pid: i32,
        thread: Option<i32>,
        file: &str,
        cap: usize,
    ) -> Result<(), ReadError> {
        use std::fmt::Write;
        self.path.clear();
        let _ = match thread {
            Some(tid) => write!(self.path, "{pid}/task/{tid}/{file}"),
            None => write!(self.path, "{pid}/{file}"),
        };
        let dir = self.dir.as_ref().map_err(|e| ReadError::from(*e))?;
        let fd = openat(
            dir,
            self.path.as_str(),
            OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::empty(),
        )?;
        self.buf.clear();
        loop {
            let len = self.buf.len();
            if len >= cap {
                return Ok(());
            }
            self.buf.resize((len + 4096).min(cap), 0);
            match read(&fd, &mut self.buf[len..]) {
                Ok(0) => {
                    self.buf.truncate(len);
                    return Ok(());
                }
                Ok(n) => self.buf.truncate(len + n),
                Err(Errno::INTR) => self.buf.truncate(len),
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Every numeric entry of the root, in the order the kernel lists them (ascending pids), into
    /// `out`. One descriptor, kept open and rewound.
    pub fn list_pids(&mut self, out: &mut Vec<i32>) -> Result<(), ReadError> {
        out.clear();
        if self.dirents.is_empty() {
            self.dirents.resize(32 << 10, MaybeUninit::uninit());
        }
        self.dir()?;
        let dir = self.dir.as_ref().map_err(|e| ReadError::from(*e))?;
        list_numeric(dir, &mut self.dirents, out)
    }

    /// /proc/PID/stat, or /proc/PID/task/TID/stat.
    pub fn stat(&mut self, pid: i32, thread: Option<i32>) -> Result<Stat, ReadError> {
        self.dir()?;
        self.read_file(pid, thread, "stat", 4096)?;
        parse_stat(&self.buf).ok_or(ReadError::Malformed)
    }

    /// The process's stat; if its leader has exited while other threads hold the memory, with a
    /// live thread's state, RSS and layout.
    pub fn proc_stat(&mut self, pid: i32) -> Result<ProcStat, ReadError> {
        let mut stat = self.stat(pid, None)?;
        if stat.pid != pid {
            return Err(ReadError::Malformed);
        }
        let mut thread = None;
        if stat.state == 'Z' && stat.threads > 1 && !stat.kernel_thread() {
            if let Some((tid, live)) = self.live_thread(pid) {
                stat.state = live.state;
                stat.rss_pages = live.rss_pages;
                stat.exec = live.exec;
                thread = Some(tid);
            }
        }
        Ok(ProcStat { stat, thread })
    }

    /// A thread of `pid` other than the leader that has not exited, with its stat.
    fn live_thread(&mut self, pid: i32) -> Option<(i32, Stat)> {
        let dir = self.dir.as_ref().ok()?;
        let task = openat(
            dir,
            format!("{pid}/task").as_str(),
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::empty(),
        )
        .ok()?;
        let mut buf = vec![MaybeUninit::uninit(); 8192];
        let mut tids = Vec::new();
        list_numeric(&task, &mut buf, &mut tids).ok()?;
        tids.into_iter().filter(|&tid| tid != pid).find_map(|tid| {
            let stat = self.stat(pid, Some(tid)).ok()?;
            (!matches!(stat.state, 'Z' | 'X' | 'x')).then_some((tid, stat))
        })
    }

    /// /proc/PID/status (or a thread's).
    pub fn status(&mut self, pid: i32, thread: Option<i32>) -> Result<Status, ReadError> {
        self.dir()?;
        self.read_file(pid, thread, "status", 16 << 10)?;
        Ok(parse_status(&self.buf))
    }

    /// The command line (its first `CMDLINE_MAX_BYTES`), arguments joined by spaces.
    pub fn cmdline(&mut self, pid: i32, thread: Option<i32>) -> Result<String, ReadError> {
        self.dir()?;
        self.read_file(pid, thread, "cmdline", CMDLINE_MAX_BYTES)?;
        Ok(parse_cmdline(&self.buf))
    }

    pub fn cgroup(&mut self, pid: i32) -> Result<String, ReadError> {
        self.dir()?;
        self.read_file(pid, None, "cgroup", CGROUP_MAX_BYTES)?;
        Ok(parse_cgroup(&String::from_utf8_lossy(&self.buf)))
    }

    /// VmSwap, where the host has swap (elsewhere it is 0 and not worth a read).
    fn swap_bytes(
        &mut self,
        pid: i32,
        stat: &ProcStat,
        host_has_swap: bool,
    ) -> Result<Option<u64>, ReadError> {
        if stat.stat.kernel_thread() {
            return Ok(None);
        }
        if !host_has_swap {
            return Ok(Some(0));
        }
        Ok(self.status(pid, stat.thread)?.swap_bytes)
    }

    /// State and memory of one process, for the victims re-read every tick.
    pub fn vitals(&mut self, pid: i32, host_has_swap: bool) -> Result<Vitals, ReadError> {
        let stat = self.proc_stat(pid)?;
        let swap_bytes = self.swap_bytes(pid, &stat, host_has_swap)?;
        Ok(self.vitals_of(&stat, swap_bytes))
    }

    pub fn vitals_of(&self, stat: &ProcStat, swap_bytes: Option<u64>) -> Vitals {
        let s = &stat.stat;
        Vitals {
            id: ProcessId {
                pid: s.pid,
                start_time: s.start_time,
            },
            state: s.state,
            ppid: s.ppid,
            rss_bytes: s.rss_pages.saturating_mul(self.page_size),
            swap_bytes,
        }
    }

    /// Everything about one process: stat, then uid (and VmSwap) from status, command line and
    /// cgroup. Kernel threads get uid 0 and no command line without further reads.
    pub fn process(&mut self, pid: i32, host_has_swap: bool) -> Result<FullRead, ReadError> {
        let stat = self.proc_stat(pid)?;
        let vitals = self.vitals_of(&stat, None);
        let kernel_thread = stat.stat.kernel_thread();
        let (uid, swap_bytes, cmdline, cgroup) = if kernel_thread {
            (0, None, String::new(), String::new())
        } else {
            let status = self.status(pid, stat.thread)?;
            let swap = if host_has_swap {
                status.swap_bytes
            } else {
                Some(0)
            };
            // Read after stat and status: a file missing now is a process that is exiting
            // (or a fixture without it); what stat and status said still stands.
            let cmdline = self.cmdline(pid, stat.thread).unwrap_or_default();
            let cgroup = self.cgroup(pid).unwrap_or_default();
            (
                status.uid.ok_or(ReadError::Malformed)?,
                swap,
                cmdline,
                cgroup,
            )
        };
        Ok(FullRead {
            process: Process {
                pid,
                start_time: stat.stat.start_time,
                ppid: stat.stat.ppid,
                uid,
                state: stat.stat.state,
                comm: stat.stat.comm.clone(),
                cmdline,
                cgroup,
                rss_bytes: vitals.rss_bytes,
                swap_bytes,
                kernel_thread,
                exe: (!kernel_thread && uid > 0 && uid < crate::config::FIRST_USER_UID)
                    .then(|| self.exe(pid))
                    .flatten(),
                pss_bytes: None,
            },
            stat,
        })
    }

    /// `/proc/PID/exe`: the executable's name, and whether root owns it and nobody else may
    /// write it (`stat` through the link reaches the very file, in any mount namespace).
    pub fn exe(&self, pid: i32) -> Option<Exe> {
        let link = self.root.join(pid.to_string()).join("exe");
        let target = std::fs::read_link(&link).ok()?;
        let text = target.to_string_lossy();
        let deleted = text.ends_with(" (deleted)");
        let name = target.file_name()?.to_string_lossy();
        let name = name.strip_suffix(" (deleted)").unwrap_or(&name);
        let meta = std::fs::metadata(&link).ok()?;
        use std::os::unix::fs::MetadataExt;
        Some(Exe {
            name: crate::snapshot::printable(name).into_owned(),
            system: !deleted && meta.uid() == 0 && meta.mode() & 0o022 == 0,
        })
    }
}

/// One process read in full, with the stat it was read from.
#[derive(Clone, Debug)]
pub struct FullRead {
    pub process: Process,
    pub stat: ProcStat,
}

fn open_dir(path: &Path) -> Result<OwnedFd, Errno> {
    openat(
        rustix::fs::CWD,
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// Numeric entries of an open directory, from its start.
fn list_numeric(
    dir: &OwnedFd,
    buf: &mut [MaybeUninit<u8>],
    out: &mut Vec<i32>,
) -> Result<(), ReadError> {
    seek(dir, SeekFrom::Start(0))?;
    let mut entries = RawDir::new(dir, buf);
    while let Some(entry) = entries.next() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if !name.is_empty() && name.iter().all(u8::is_ascii_digit) {
            if let Some(pid) = std::str::from_utf8(name).ok().and_then(|n| n.parse().ok()) {
                out.push(pid);
            }
        }
    }
    Ok(())
}

/// The simple, synchronous source: host memory and single processes. The daemon scans on a
/// thread of its own (`scan/`); this serves the loop's own few reads.
pub struct ProcfsSource {
    host: HostReader,
    reader: ProcReader,
    host_has_swap: bool,
    /// The cgroup v2 hierarchy, where login users' slices say the shared memory they made.
    cgroups: Option<crate::sample::cgroup::Cgroups>,
}

impl ProcfsSource {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        let root = root.into();
        ProcfsSource {
            host: HostReader::new(&root),
            reader: ProcReader::new(&root),
            host_has_swap: true,
            cgroups: None,
        }
    }

    /// With the cgroup hierarchy at `root` (`/sys/fs/cgroup`): tmpfs owners include what each
    /// login user's slice is charged for (cgroup v2 only).
    pub fn with_cgroups(mut self, root: &Path) -> Self {
        self.cgroups = crate::sample::cgroup::Cgroups::open(root);
        self
    }

    /// Every process on the host, read in full (a process that exits mid-scan is skipped): the
    /// parsers' tests read a whole fake /proc so (the daemon's scan is `scan/`'s).
    #[cfg(test)]
    pub fn scan(&mut self) -> Vec<Process> {
        let mut pids = Vec::new();
        if self.reader.list_pids(&mut pids).is_err() {
            return Vec::new();
        }
        pids.into_iter().filter_map(|pid| self.read(pid)).collect()
    }

    /// One process, or `None` if it is gone.
    #[cfg(test)]
    pub fn read(&mut self, pid: i32) -> Option<Process> {
        self.reader
            .process(pid, self.host_has_swap)
            .ok()
            .map(|r| r.process)
    }
}

impl ProcSource for ProcfsSource {
    fn host_memory(&mut self) -> HostMemory {
        let host = self.host.read();
        self.host_has_swap = host.swap_total_bytes != Some(0);
        host
    }

    fn host_error(&self) -> Option<&str> {
        self.host.error()
    }

    fn host_has_swap(&self) -> bool {
        self.host_has_swap
    }

    fn vitals(&mut self, pid: i32) -> Result<Vitals, ReadError> {
        self.reader.vitals(pid, self.host_has_swap)
    }

    /// The files each uid owns in the tmpfs directories, or the shared memory its login slice
    /// is charged for where that is more: the walk cannot enter another account's private
    /// directory without CAP_DAC_READ_SEARCH (the packaged unit has none), nor see `/run/user`
    /// under `ProtectHome=`, nor an unlinked file; the kernel charged all of them to the
    /// cgroup of the process that wrote them.
    fn tmpfs_owners(&mut self) -> std::collections::BTreeMap<u32, u64> {
        let dirs: Vec<&Path> = crate::sample::tmpfs::TMPFS_DIRS
            .iter()
            .map(Path::new)
            .collect();
        let mut owners = crate::sample::tmpfs::owners(&dirs);
        if let Some(cgroups) = &self.cgroups {
            for (uid, shmem) in cgroups.user_shmem() {
                let owned = owners.entry(uid).or_default();
                *owned = (*owned).max(shmem);
            }
        }
        owners
    }
}

/// `Pss:` of /proc/PID/smaps_rollup, in bytes.
pub fn parse_pss(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .and_then(|kib| kib.checked_mul(1024))
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn fixture() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::write(
            root.join("meminfo"),
            "MemTotal:       24683656 kB\nMemFree:        1000 kB\nMemAvailable:   2048 kB\nSwapTotal:      0 kB\nSwapFree:       0 kB\nShmem:          512 kB\n",
        )
        .unwrap();
        // A hostile name: parentheses and spaces inside comm.
        let p = root.join("4242");
        std::fs::create_dir_all(&p).unwrap();
        let stat = "4242 (foo) Z ) S 1 4242 4242 0 -1 4194304 100 0 0 0 5 3 0 0 20 0 1 0 98765 100000000 2560 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0 0 0 0 0 0 0 0 0\n";
        std::fs::write(p.join("stat"), stat).unwrap();
        // A real status file with the fields of interest rewritten.
        let status: String = std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .map(|l| match l.split(':').next() {
                Some("Name") => "Name:\tfoo) Z ".to_string(),
                Some("Uid") => "Uid:\t1000\t1000\t1000\t1000".to_string(),
                Some("VmSwap") => "VmSwap:\t512 kB".to_string(),
                _ => l.to_string(),
            })
            .map(|l| l + "\n")
            .collect();
        std::fs::write(p.join("status"), status).unwrap();
        std::fs::write(p.join("cmdline"), "python3\0-m\0vllm.entrypoints\0").unwrap();
        std::fs::write(p.join("cgroup"), "0::/system.slice/vllm.service\n").unwrap();
        // A kernel thread.
        let k = root.join("2");
        std::fs::create_dir_all(&k).unwrap();
        std::fs::write(k.join("stat"), "2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 1 0 0 18446744073709551615 0 0 0 0 0 0 0 2147483647 0 0 0 0 17 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n").unwrap();
        // A process that vanished between readdir and read: a directory with no files.
        std::fs::create_dir_all(root.join("999")).unwrap();
        dir
    }

    #[test]
    fn reads_meminfo_in_bytes_and_psi_absent_is_unknown() {
        let dir = fixture();
        let mut reader = HostReader::new(dir.path());
        let host = reader.read();
        assert_eq!(host.total_bytes, Some(24683656 * 1024));
        assert_eq!(host.available_bytes, Some(2048 * 1024));
        assert_eq!(
            host.shmem_bytes,
            Some(512 * 1024),
            "Shmem: tmpfs and shared memory"
        );
        assert_eq!(
            host.psi_some_avg10, None,
            "no pressure file: unknown, not zero"
        );
        assert_eq!(reader.error(), None);
    }

    #[test]
    fn meminfo_is_read_through_the_descriptor_opened_at_start() {
        // The file is replaced after the reader opened it: the reader keeps reading the open
        // file (pread at offset 0), so a tick needs no new descriptor.
        let dir = fixture();
        let mut reader = HostReader::new(dir.path());
        std::fs::remove_file(dir.path().join("meminfo")).unwrap();
        assert_eq!(reader.read().available_bytes, Some(2048 * 1024));
        assert_eq!(reader.read().available_bytes, Some(2048 * 1024));
    }

    #[test]
    fn unreadable_meminfo_is_unknown_and_says_why() {
        let dir = tempfile::tempdir().unwrap();
        let mut reader = HostReader::new(dir.path());
        assert_eq!(reader.read().available_bytes, None);
        let error = reader.error().expect("an error").to_string();
        assert!(
            error.contains("meminfo") && error.contains("No such file"),
            "{error}"
        );
        // It comes back once the file does.
        std::fs::write(dir.path().join("meminfo"), "MemAvailable: 10 kB\n").unwrap();
        assert_eq!(reader.read().available_bytes, Some(10 * 1024));
        assert_eq!(reader.error(), None);
    }

    #[test]
    fn parses_psi() {
        let mut host = HostMemory::default();
        parse_psi(
            "some avg10=1.50 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.25 avg60=0.00 avg300=0.00 total=0\n",
            &mut host,
        );
        assert_eq!(host.psi_some_avg10, Some(1.5));
        let mut host = HostMemory::default();
        parse_psi("some avg10=nan\nfull garbage\n", &mut host);
        assert_eq!(host.psi_some_avg10, None);
    }

    #[test]
    fn parses_hostile_comm_and_skips_vanished_processes() {
        let dir = fixture();
        let mut source = ProcfsSource::new(dir.path());
        source.host_memory();
        let mut procs = source.scan();
        procs.sort_by_key(|p| p.pid);
        assert_eq!(procs.len(), 2, "{procs:?}");
        let kthread = &procs[0];
        assert!(kthread.kernel_thread);
        let p = &procs[1];
        assert_eq!(p.comm, "foo) Z ");
        assert_eq!(p.state, 'S');
        assert_eq!(p.ppid, 1);
        assert_eq!(p.start_time, 98765);
        assert_eq!(p.uid, 1000);
        assert_eq!(p.rss_bytes, 2560 * crate::sample::procfs::page_size());
        assert_eq!(p.swap_bytes, Some(0), "no swap on this host: not read");
        assert_eq!(p.cmdline, "python3 -m vllm.entrypoints");
        assert_eq!(p.cgroup, "/system.slice/vllm.service");
        assert!(!p.kernel_thread);
        assert!(source.read(999).is_none());
        assert_eq!(source.vitals(999), Err(ReadError::Gone));
    }

    #[test]
    fn reads_swap_where_the_host_has_swap() {
        let dir = fixture();
        std::fs::write(
            dir.path().join("meminfo"),
            "MemTotal: 100 kB\nMemAvailable: 10 kB\nSwapTotal: 100 kB\nSwapFree: 50 kB\n",
        )
        .unwrap();
        let mut source = ProcfsSource::new(dir.path());
        source.host_memory();
        assert_eq!(source.read(4242).unwrap().swap_bytes, Some(512 * 1024));
        assert_eq!(source.vitals(4242).unwrap().swap_bytes, Some(512 * 1024));
    }

    /// A login user's slice charged with more shared memory than the files the walk finds of
    /// it (none: its directory cannot be entered, or the files are unlinked): the slice's
    /// figure is what it owns. Without the cgroup tree, only the walk.
    #[test]
    fn tmpfs_owners_take_what_a_login_users_slice_is_charged_for() {
        let dir = fixture();
        let cgroups = tempfile::tempdir().unwrap();
        std::fs::write(cgroups.path().join("cgroup.controllers"), "memory\n").unwrap();
        let slice = cgroups.path().join("user.slice/user-4000000000.slice");
        std::fs::create_dir_all(&slice).unwrap();
        std::fs::write(slice.join("memory.stat"), "anon 1\nshmem 2147483648\n").unwrap();
        let mut source = ProcfsSource::new(dir.path()).with_cgroups(cgroups.path());
        assert_eq!(source.tmpfs_owners().get(&4_000_000_000), Some(&(2 << 30)));
        let mut walk_only = ProcfsSource::new(dir.path());
        assert_eq!(walk_only.tmpfs_owners().get(&4_000_000_000), None);
    }

    #[test]
    fn pss_is_read_from_smaps_rollup() {
        let rollup = "00400000-7ffd1 ---p 00000000 00:00 0    [rollup]\nRss:   2048 kB\nPss:   1536 kB\nPss_Anon: 1000 kB\n";
        assert_eq!(parse_pss(rollup), Some(1536 * 1024));
        assert_eq!(parse_pss("Rss: 5 kB\n"), None);
        let own = ProcReader::new("/proc").pss(std::process::id() as i32);
        assert!(own.is_some_and(|b| b > 0), "{own:?}");
    }

    #[test]
    fn reads_an_executable_through_proc() {
        let exe = ProcReader::new("/proc")
            .exe(std::process::id() as i32)
            .expect("own executable");
        assert!(exe.name.starts_with("gpuguard"), "{exe:?}");
        assert!(ProcReader::new("/proc").exe(i32::MAX).is_none());
    }

    #[test]
    fn reads_this_process_from_real_proc() {
        let mut source = ProcfsSource::new("/proc");
        assert!(source.host_memory().available_bytes.is_some());
        let me = source.read(std::process::id() as i32).expect("own process");
        assert!(me.rss_bytes > 0);
        assert!(!me.kernel_thread);
        assert!(me.cmdline.contains("gpuguard"), "{}", me.cmdline);
        assert!(source.scan().iter().any(|p| p.pid == me.pid));
        let vitals = source.vitals(me.pid).unwrap();
        assert_eq!(vitals.id, me.id());
        assert!(vitals.rss_bytes > 0);
        let stat = ProcReader::new("/proc").stat(me.pid, None).unwrap();
        assert!(stat.exec.known(), "root (or the owner) sees the layout");
        // The kernel's statm: anonymous pages (resident less shared) are part of the RSS.
        let anon = ProcReader::new("/proc").anon_bytes(me.pid).unwrap();
        assert!(anon > 0 && anon <= vitals.rss_bytes + (64 << 20), "{anon}");
    }

    #[test]
    fn missing_meminfo_fields_stay_unknown() {
        let mut host = HostMemory::default();
        parse_meminfo("MemTotal: 100 kB\nSwapFree: 0 kB\nBogus line\n", &mut host);
        assert_eq!(host.total_bytes, Some(102400));
        assert_eq!(host.available_bytes, None);
        assert_eq!(host.swap_free_bytes, Some(0));
        parse_meminfo("MemAvailable: 18446744073709551615 kB\n", &mut host);
        assert_eq!(host.available_bytes, None, "overflow is unknown");
    }

    #[test]
    fn cgroup_prefers_v2_line() {
        assert_eq!(parse_cgroup("4:memory:/a\n0::/b.service\n"), "/b.service");
        assert_eq!(parse_cgroup("4:memory:/a\n"), "/a");
    }

    #[test]
    fn stat_parser_survives_garbage() {
        for text in [
            &b""[..],
            b"(",
            b")(",
            b"12 (x)",
            b"12 (x) ",
            b"abc (x) S 1",
            b"12 (x) S notanumber",
            b"7 (x)S 1",
            b"7(x) S 1",
            b" 7 (x) S 1",
            &[0xff, 0xfe, b'(', b')', b' ', b'S'],
        ] {
            assert_eq!(parse_stat(text), None, "{text:?}");
        }
        let short = parse_stat(b"7 (\xff\n) R 1").expect("short but valid");
        assert_eq!(
            (short.pid, short.state, short.ppid, short.rss_pages),
            (7, 'R', 1, 0)
        );
        assert_eq!(short.comm, "\u{fffd}\\u{a}", "control characters escaped");
        assert!(!short.exec.known());
    }

    #[test]
    fn status_parser_reads_the_real_uid() {
        let s = parse_status(b"Name:\tx\nUid:\t1001\t0\t0\t0\nVmSwap:\t  12 kB\n");
        assert_eq!(s.uid, Some(1001));
        assert_eq!(s.swap_bytes, Some(12 * 1024));
        assert_eq!(parse_status(b"Uid: x\nVmSwap: 1 MB\n"), Status::default());
    }

    #[test]
    fn cmdline_joins_arguments() {
        assert_eq!(parse_cmdline(b"a\0b c\0\0d\0"), "a b c  d");
        assert_eq!(parse_cmdline(b"setproctitle style"), "setproctitle style");
        assert_eq!(parse_cmdline(b""), "");
    }
}
