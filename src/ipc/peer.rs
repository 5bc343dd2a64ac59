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

/// Who serves the unix socket at `path`: `None` when nothing does (no file, a dead socket),
/// `Some(None)` when something does but its pid cannot be told (its backlog is full), else its
/// pid. Never waits: the connect is non-blocking (a full backlog would hold a blocking one).
pub fn server_of(path: &Path) -> Option<Option<i32>> {
    use rustix::net::{
        connect, socket_with, AddressFamily, SocketAddrUnix, SocketFlags, SocketType,
    };
    let address = SocketAddrUnix::new(path).ok()?;
    let fd = socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        None,
    )
    .ok()?;
    match connect(&fd, &address) {
        Ok(()) => Some(credentials(&fd).ok().map(|(_, pid)| pid)),
        Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INPROGRESS) => Some(None),
        Err(_) => None,
    }
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

    /// A socket served here is this process's; one with its backlog full is in use all the same,
    /// and asking never waits; a socket file nobody serves is free.
    #[test]
    fn the_server_of_a_socket_is_told_without_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        assert_eq!(server_of(&path), None);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        assert_eq!(server_of(&path), Some(Some(std::process::id() as i32)));
        drop(listener);
        std::fs::remove_file(&path).unwrap();
        // A listener with the smallest backlog, filled by connections it never accepts (made
        // non-blocking, as `server_of` makes its own): then in use, pid unknown, at once.
        use rustix::net::{bind, listen, socket, AddressFamily, SocketAddrUnix, SocketType};
        let listener = socket(AddressFamily::UNIX, SocketType::STREAM, None).unwrap();
        bind(&listener, &SocketAddrUnix::new(&path).unwrap()).unwrap();
        listen(&listener, 0).unwrap();
        let mut held = Vec::new();
        let mut answers = Vec::new();
        for _ in 0..16 {
            let c = rustix::net::socket_with(
                AddressFamily::UNIX,
                SocketType::STREAM,
                rustix::net::SocketFlags::NONBLOCK,
                None,
            )
            .unwrap();
            let _ = rustix::net::connect(&c, &SocketAddrUnix::new(&path).unwrap());
            held.push(c);
            answers.push(server_of(&path));
        }
        assert_eq!(answers.last(), Some(&Some(None)), "{answers:?}");
        drop(held);
        drop(listener);
        assert_eq!(
            server_of(&path),
            None,
            "a socket file nobody serves is free"
        );
    }

    #[test]
    fn pins_the_peer_of_a_socket_pair_to_this_process() {
        let (a, b) = UnixStream::pair().unwrap();
        let (uid, pid) = credentials(&a).unwrap();
        assert_eq!(pid, std::process::id() as i32);
        assert_eq!(uid, rustix::process::geteuid().as_raw());
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
