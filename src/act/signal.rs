//! Signals through a pidfd, after checking that the pid is still the process that was chosen
//! (pid + start time), so a recycled pid is never hit. SIGKILL is followed by process_mrelease
//! where the kernel has it, to give the memory back before the exit finishes.
//!
//! process_mrelease blocks until the address space is freed (a few hundred ms for a few GiB), so
//! it runs on a reaper thread of its own and the loop goes on at once.
//!
//! Acting cannot fail for lack of a file descriptor: two are held in reserve and given up when
//! `pidfd_open` (or the /proc read that verifies the process) finds none left, then taken again.
//! A process whose thread-group leader has exited while other threads run is still the process:
//! it is signalled (the signal goes to the whole group) and its stopped state is read from a live
//! thread.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Mutex, MutexGuard};

use rustix::fs::{openat, Mode, OFlags, CWD};
use rustix::io::Errno;
use rustix::process::{pidfd_open, pidfd_send_signal, Pid, PidfdFlags, Signal};

use crate::sample::procfs::{ProcReader, ReadError};
use crate::snapshot::ProcessId;

use super::{ProcessControl, Sig, SignalError};

/// Descriptors held back for the kill path: a pidfd and the stat read that verifies it.
const RESERVE_FDS: usize = 2;

/// The real `ProcessControl`.
pub struct PidfdControl {
    reader: Mutex<ProcReader>,
    reserve: Mutex<Vec<OwnedFd>>,
    /// Pidfds of killed processes, for the reaper thread (`None`: it could not start; reaped here).
    reaper: Mutex<Option<Sender<OwnedFd>>>,
}

/// A lock that a panic elsewhere cannot make unusable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl PidfdControl {
    pub fn new(proc_root: impl Into<PathBuf>) -> Self {
        let control = PidfdControl {
            reader: Mutex::new(ProcReader::new(proc_root)),
            reserve: Mutex::new(Vec::with_capacity(RESERVE_FDS)),
            reaper: Mutex::new(start_reaper()),
        };
        control.refill();
        control
    }

    /// Takes back the reserve descriptors given up (as many as the process can get now).
    fn refill(&self) {
        let mut reserve = lock(&self.reserve);
        while reserve.len() < RESERVE_FDS {
            match openat(CWD, "/", OFlags::PATH | OFlags::CLOEXEC, Mode::empty()) {
                Ok(fd) => reserve.push(fd),
                Err(_) => break,
            }
        }
    }

    /// Gives the reserve up; true if there was any.
    fn release_reserve(&self) -> bool {
        let mut reserve = lock(&self.reserve);
        let had = !reserve.is_empty();
        reserve.clear();
        had
    }

    /// Runs `f`, and once more after giving up the reserve if it failed for lack of descriptors.
    fn with_reserve<T>(&self, mut f: impl FnMut() -> Result<T, Errno>) -> Result<T, Errno> {
        match f() {
            Err(Errno::MFILE | Errno::NFILE) if self.release_reserve() => f(),
            other => other,
        }
    }

    fn open_verified(&self, id: ProcessId) -> Result<OwnedFd, SignalError> {
        let pid = Pid::from_raw(id.pid).ok_or(SignalError::Gone)?;
        let fd = self
            .with_reserve(|| pidfd_open(pid, PidfdFlags::empty()))
            .map_err(|e| match e {
                Errno::SRCH => SignalError::Gone,
                e => SignalError::Failed(format!("pidfd_open: {}", std::io::Error::from(e))),
            })?;
        // The pidfd pins the process that had this pid when it was opened; if that process has
        // the start time we chose, it is the one we chose.
        let mut reader = lock(&self.reader);
        let stat = match reader.proc_stat(id.pid) {
            Err(ReadError::Unreadable(Errno::MFILE | Errno::NFILE)) if self.release_reserve() => {
                reader.proc_stat(id.pid)
            }
            other => other,
        };
        match stat {
            Ok(s) if s.stat.start_time != id.start_time => Err(SignalError::Replaced),
            // Exited (a zombie leader with live threads reads as its live thread's state).
            Ok(s) if matches!(s.stat.state, 'Z' | 'X' | 'x') => Err(SignalError::Gone),
            Ok(_) => Ok(fd),
            Err(ReadError::Gone) => Err(SignalError::Gone),
            // Not verified, not signalled.
            Err(e) => Err(SignalError::Failed(format!(
                "cannot check pid {} is the process chosen: {e}",
                id.pid
            ))),
        }
    }
}

fn send(fd: &OwnedFd, signal: Signal) -> Result<(), SignalError> {
    pidfd_send_signal(fd, signal).map_err(|e| match e {
        Errno::SRCH => SignalError::Gone,
        Errno::PERM => SignalError::Denied,
        e => SignalError::Failed(format!("pidfd_send_signal: {}", std::io::Error::from(e))),
    })
}

/// Reaps a killed process's address space now rather than when its exit gets to it. Kernels
/// before 5.15 lack it (ENOSYS); a process already reaped gives EINVAL/ESRCH. (Neither rustix
/// nor nix wraps it.)
fn mrelease(fd: &OwnedFd) {
    // SAFETY: process_mrelease(pidfd, flags = 0) takes a descriptor and flags only.
    unsafe { libc::syscall(libc::SYS_process_mrelease, fd.as_raw_fd(), 0) };
}

/// The thread that runs `mrelease` for killed processes, started before any emergency.
fn start_reaper() -> Option<Sender<OwnedFd>> {
    let (tx, rx) = channel::<OwnedFd>();
    std::thread::Builder::new()
        .name("reaper".into())
        .stack_size(64 << 10)
        .spawn(move || {
            while let Ok(fd) = rx.recv() {
                mrelease(&fd);
            }
        })
        .ok()
        .map(|_| tx)
}

impl ProcessControl for PidfdControl {
    /// Runs the verification path once on this process (its code resident before it is
    /// needed; see `daemon::warm`). Signals nothing.
    fn warm_up(&self) {
        let me = std::process::id() as i32;
        let start_time = lock(&self.reader).proc_stat(me).map(|s| s.stat.start_time);
        if let Ok(start_time) = start_time {
            let _ = self.open_verified(ProcessId {
                pid: me,
                start_time,
            });
        }
    }

    fn send(&self, id: ProcessId, sig: Sig) -> Result<(), SignalError> {
        let result = self.open_verified(id).and_then(|fd| match sig {
            Sig::Stop => send(&fd, Signal::STOP),
            Sig::Cont => send(&fd, Signal::CONT),
            // A stopped process only acts on SIGTERM once it runs again.
            Sig::Term => send(&fd, Signal::TERM).and_then(|()| send(&fd, Signal::CONT)),
            Sig::Kill => {
                send(&fd, Signal::KILL)?;
                // The reaper thread, else here.
                let unsent = match lock(&self.reaper).as_ref() {
                    Some(reaper) => reaper.send(fd).err().map(|e| e.0),
                    None => Some(fd),
                };
                if let Some(fd) = unsent {
                    mrelease(&fd);
                }
                Ok(())
            }
        });
        self.refill();
        result
    }

    fn is_stopped(&self, id: ProcessId) -> bool {
        lock(&self.reader)
            .proc_stat(id.pid)
            .is_ok_and(|s| s.stat.start_time == id.start_time && matches!(s.stat.state, 'T' | 't'))
    }
}

/// Sends signal 0 to pid 1 at start-up, so missing permissions show now, not during an emergency.
pub fn self_test() -> Result<(), String> {
    rustix::process::test_kill_process(Pid::INIT).map_err(|e| {
        format!("cannot signal other processes ({e}): run gpuguard as root or with CAP_KILL")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    fn id_of(pid: u32) -> ProcessId {
        let stat = ProcReader::new("/proc").stat(pid as i32, None).unwrap();
        ProcessId {
            pid: pid as i32,
            start_time: stat.start_time,
        }
    }

    fn wait_for(mut cond: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if cond() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    #[test]
    fn stops_resumes_and_kills_the_process_chosen_only() {
        let mut child = Command::new("sleep")
            .arg("60")
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let control = PidfdControl::new("/proc");
        let id = id_of(child.id());
        let other = ProcessId {
            start_time: id.start_time + 1,
            ..id
        };
        assert_eq!(control.send(other, Sig::Kill), Err(SignalError::Replaced));
        control.send(id, Sig::Stop).unwrap();
        assert!(wait_for(|| control.is_stopped(id)));
        control.send(id, Sig::Cont).unwrap();
        assert!(wait_for(|| !control.is_stopped(id)));
        control.send(id, Sig::Kill).unwrap();
        assert_eq!(child.wait().unwrap().signal(), Some(9));
        assert_eq!(control.send(id, Sig::Kill), Err(SignalError::Gone));
    }

    /// Run by `kills_even_with_no_descriptor_left` in a process of its own (filling the
    /// descriptor table would break the tests running beside it): SIGKILLs the pid in
    /// GPUGUARD_TEST_VICTIM with not one free descriptor left.
    #[test]
    #[ignore = "run in a child process by kills_even_with_no_descriptor_left"]
    fn child_kills_with_no_descriptor_left() {
        let Ok(victim) = std::env::var("GPUGUARD_TEST_VICTIM") else {
            return;
        };
        let id = id_of(victim.parse().unwrap());
        let control = PidfdControl::new("/proc");
        // A small table, then every free slot taken.
        let limit = rustix::process::Rlimit {
            current: Some(64),
            maximum: rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum,
        };
        rustix::process::setrlimit(rustix::process::Resource::Nofile, limit).unwrap();
        let mut held = Vec::new();
        loop {
            match openat(CWD, "/", OFlags::PATH | OFlags::CLOEXEC, Mode::empty()) {
                Ok(fd) => held.push(fd),
                Err(Errno::MFILE) => break,
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(
            std::fs::File::open("/proc/self/stat")
                .map_err(|e| e.raw_os_error())
                .err(),
            Some(Some(libc::EMFILE)),
            "the table is full"
        );
        assert_eq!(control.send(id, Sig::Kill), Ok(()));
    }

    #[test]
    fn kills_even_with_no_descriptor_left() {
        let mut victim = Command::new("sleep").arg("60").spawn().unwrap();
        let out = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "act::signal::tests::child_kills_with_no_descriptor_left",
                "--ignored",
                "--nocapture",
            ])
            .env("GPUGUARD_TEST_VICTIM", victim.id().to_string())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && text.contains("1 passed"), "{text}");
        assert_eq!(victim.wait().unwrap().signal(), Some(9));
    }
}
