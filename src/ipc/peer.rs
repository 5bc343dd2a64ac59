//! Who is on the other end of the socket, pinned when the connection arrives.
//!
//! The kernel's peer credentials give the uid and pid the client had when it connected. A pid
//! alone can be reused by another process (of another user) before the daemon acts on it, so
//! the identity is pinned at once: a pidfd for the exact peer (`SO_PEERPIDFD`, Linux 6.5+; else
//! `pidfd_open` on the pid), its start time, and a check that the process behind the pidfd still
//! runs as the uid that connected. Everything the daemon later does for the connection (leases,
//! registrations, permits) is bound to that identity (pid + start time + uid).

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use rustix::event::{poll, PollFd, PollFlags};
use rustix::process::{pidfd_open, Pid, PidfdFlags};

pub use crate::reserve::Peer;

/// The connected process's uid and pid as the kernel recorded them at connect().
pub fn credentials(socket: impl AsFd) -> std::io::Result<(u32, i32)> {
    let cred = rustix::net::sockopt::socket_peercred(socket)?;
    Ok((cred.uid.as_raw(), cred.pid.as_raw_nonzero().get()))
}

/// Pins the peer of `socket` (whose credentials are `uid`, `pid`): returns its identity and a
/// pidfd that refers to that very process for as long as it is held.
pub fn pin(
    socket: impl AsFd,
    uid: u32,
    pid: i32,
    proc_root: &Path,
) -> Result<(Peer, OwnedFd), String> {
    let pidfd = match nix::sys::socket::getsockopt(&socket, nix::sys::socket::sockopt::PeerPidfd) {
        Ok(fd) => fd,
        // Kernels before 6.5: the pid may have been reused since connect(); the uid and
        // start-time checks below catch a process of another user.
        Err(_) => {
            let raw = Pid::from_raw(pid).ok_or("peer pid 0 (another pid namespace?)")?;
            pidfd_open(raw, PidfdFlags::empty()).map_err(|e| format!("pidfd_open({pid}): {e}"))?
        }
    };
    let start_time = read_start_time(proc_root, pid)?;
    let owner = read_effective_uid(proc_root, pid)?;
    // The start time and uid were read from /proc/PID: they belong to the pidfd's process only
    // if it has not exited (and the pid been reused) meanwhile.
    if exited(&pidfd) {
        return Err(format!("pid {pid} exited while connecting"));
    }
    if owner != uid {
        return Err(format!(
            "pid {pid} runs as uid {owner}, but uid {uid} connected: identity changed"
        ));
    }
    Ok((
        Peer {
            uid,
            pid,
            start_time,
        },
        pidfd,
    ))
}

/// True once the process behind a pidfd has exited (a pidfd polls readable then).
pub fn exited(pidfd: &OwnedFd) -> bool {
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    let zero = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
}

fn read_start_time(proc_root: &Path, pid: i32) -> Result<u64, String> {
    let stat = std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat"))
        .map_err(|e| format!("pid {pid}: {e}"))?;
    // Field 22, counted after the last ')' (the name may hold anything).
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(19))
        .and_then(|t| t.parse().ok())
        .ok_or_else(|| format!("pid {pid}: unreadable stat"))
}

fn read_effective_uid(proc_root: &Path, pid: i32) -> Result<u32, String> {
    let status = std::fs::read_to_string(proc_root.join(pid.to_string()).join("status"))
        .map_err(|e| format!("pid {pid}: {e}"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .and_then(|u| u.parse().ok())
        .ok_or_else(|| format!("pid {pid}: unreadable status"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn pins_the_peer_of_a_socket_pair_to_this_process() {
        let (a, b) = UnixStream::pair().unwrap();
        let (uid, pid) = credentials(&a).unwrap();
        assert_eq!(pid, std::process::id() as i32);
        assert_eq!(uid, nix::unistd::geteuid().as_raw());
        let (peer, pidfd) = pin(&a, uid, pid, Path::new("/proc")).unwrap();
        assert_eq!(peer.pid, pid);
        assert!(peer.start_time > 0);
        assert!(!exited(&pidfd));
        // A uid that is not the process's own is refused.
        assert!(pin(&a, uid + 1, pid, Path::new("/proc"))
            .unwrap_err()
            .contains("identity changed"));
        drop(b);
    }

    #[test]
    fn a_pidfd_reports_the_exit_of_its_process() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = Pid::from_raw(child.id() as i32).unwrap();
        let fd = pidfd_open(pid, PidfdFlags::empty()).unwrap();
        child.wait().unwrap();
        assert!(exited(&fd));
    }
}
