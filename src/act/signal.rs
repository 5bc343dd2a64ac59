//! Signals through a pidfd, after checking that the pid is still the process that was chosen
//! (pid + start time), so a recycled pid is never hit. SIGKILL is followed by process_mrelease
//! where the kernel has it, to give the memory back before the exit finishes.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;

use procfs::process::Process as ProcfsProcess;

use crate::snapshot::ProcessId;

use super::{ProcessControl, Sig, SignalError};

/// The real `ProcessControl`.
pub struct PidfdControl {
    proc_root: PathBuf,
}

impl PidfdControl {
    pub fn new(proc_root: impl Into<PathBuf>) -> Self {
        PidfdControl {
            proc_root: proc_root.into(),
        }
    }

    fn open_verified(&self, id: ProcessId) -> Result<OwnedFd, SignalError> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, id.pid, 0) };
        if fd < 0 {
            let err = std::io::Error::last_os_error();
            return Err(match err.raw_os_error() {
                Some(libc::ESRCH) => SignalError::Gone,
                _ => SignalError::Failed(format!("pidfd_open: {err}")),
            });
        }
        // SAFETY: fd was just returned by pidfd_open and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        // The pidfd pins the process that had this pid when it was opened; if that process has
        // the start time we chose, it is the one we chose.
        let stat = ProcfsProcess::new_with_root(self.proc_root.join(id.pid.to_string()))
            .and_then(|p| p.stat())
            .map_err(|_| SignalError::Gone)?;
        if stat.starttime != id.start_time {
            return Err(SignalError::Replaced);
        }
        if matches!(stat.state, 'Z' | 'X') {
            return Err(SignalError::Gone);
        }
        Ok(fd)
    }
}

fn send(fd: &OwnedFd, signal: i32) -> Result<(), SignalError> {
    // SAFETY: pidfd_send_signal(pidfd, sig, info = NULL, flags = 0).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    Err(match err.raw_os_error() {
        Some(libc::ESRCH) => SignalError::Gone,
        Some(libc::EPERM) => SignalError::Denied,
        _ => SignalError::Failed(format!("pidfd_send_signal: {err}")),
    })
}

impl ProcessControl for PidfdControl {
    fn send(&self, id: ProcessId, sig: Sig) -> Result<(), SignalError> {
        let fd = self.open_verified(id)?;
        match sig {
            Sig::Stop => send(&fd, libc::SIGSTOP),
            Sig::Cont => send(&fd, libc::SIGCONT),
            // A stopped process only acts on SIGTERM once it runs again.
            Sig::Term => send(&fd, libc::SIGTERM).and_then(|()| send(&fd, libc::SIGCONT)),
            Sig::Kill => {
                send(&fd, libc::SIGKILL)?;
                // Reap the address space now rather than when the exit path gets to it. Kernels
                // before 5.15 lack it (ENOSYS); a process already reaped gives EINVAL/ESRCH.
                // SAFETY: process_mrelease(pidfd, flags = 0).
                unsafe { libc::syscall(libc::SYS_process_mrelease, fd.as_raw_fd(), 0) };
                Ok(())
            }
        }
    }

    fn is_stopped(&self, id: ProcessId) -> bool {
        ProcfsProcess::new_with_root(self.proc_root.join(id.pid.to_string()))
            .and_then(|p| p.stat())
            .is_ok_and(|s| s.starttime == id.start_time && matches!(s.state, 'T' | 't'))
    }
}

/// Sends signal 0 to pid 1 at start-up, so missing permissions show now, not during an emergency.
pub fn self_test() -> Result<(), String> {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(1), None).map_err(|e| {
        format!("cannot signal other processes ({e}): run gpuguard as root or with CAP_KILL")
    })
}
