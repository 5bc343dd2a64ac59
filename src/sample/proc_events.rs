//! The kernel's process events (the netlink proc connector): which processes `exec`ed, changed
//! their uid or gid, or renamed themselves, as it happens, so the scanner re-reads exactly those
//! at its next round instead of finding out from a rotation that visits each process every few
//! minutes.
//!
//! Listening needs root with `CAP_NET_ADMIN` in the host's initial namespaces (the kernel ignores
//! listeners inside a container's PID namespace). Whether events really arrive is checked at
//! open: the opening thread renames itself to its own name, which the kernel reports as a
//! `COMM` event; no such event within `SELF_TEST_WAIT` means no events (`open` fails, and the
//! scanner falls back to its rotation).
//!
//! Kernels from 6.6 filter events per listener: only exec, uid, gid and comm events are asked
//! for. Older kernels send every fork and exit too; a thread of its own drains the socket
//! (at most every `DRAIN_EVERY`), so a fork storm cannot overflow it between scan rounds. If the
//! socket overflows anyway (or the pending set grows past `MAX_PENDING`), the events are *lost*
//! and the scanner re-reads every process once.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags};
use rustix::io::Errno;
use rustix::net::netlink::{self, SocketAddrNetlink};
use rustix::net::{bind, recvfrom, sendto, socket_with, AddressFamily, RecvFlags, SendFlags};
use rustix::net::{SocketFlags, SocketType};

/// `CN_IDX_PROC`/`CN_VAL_PROC`: the proc connector's id (linux/connector.h).
const CN_IDX_PROC: u32 = 1;
const CN_VAL_PROC: u32 = 1;
/// `enum proc_cn_mcast_op`.
const PROC_CN_MCAST_LISTEN: u32 = 1;
const PROC_CN_MCAST_IGNORE: u32 = 2;
/// `enum what` in linux/cn_proc.h: the events that change what the policy matches on.
const PROC_EVENT_EXEC: u32 = 0x2;
const PROC_EVENT_UID: u32 = 0x4;
const PROC_EVENT_GID: u32 = 0x40;
const PROC_EVENT_COMM: u32 = 0x200;
const WANTED: u32 = PROC_EVENT_EXEC | PROC_EVENT_UID | PROC_EVENT_GID | PROC_EVENT_COMM;
/// `NLMSG_DONE`: the connector's messages are single-part.
const NLMSG_DONE: u16 = 3;
/// sizeof(struct nlmsghdr) and sizeof(struct cn_msg).
const NLMSG_HDR: usize = 16;
const CN_MSG_HDR: usize = 20;
/// In a `proc_event`: `what` at 0, the union at 16 (after `cpu` and the 8-aligned timestamp).
const EVENT_DATA: usize = 16;

/// How long `open` waits for its own rename to come back as an event.
const SELF_TEST_WAIT: Duration = Duration::from_millis(300);
/// The drain thread reads the socket at most this often (a fork storm on a kernel that cannot
/// filter wakes it at most 50 times a second).
const DRAIN_EVERY: Duration = Duration::from_millis(20);
/// More pending pids than this and the events are treated as lost (everything is re-read).
const MAX_PENDING: usize = 1 << 16;
/// Receive buffer asked for (root may exceed `rmem_max`): a burst between two drains fits.
const RECV_BUFFER: usize = 4 << 20;

/// What happened since the last `take`.
#[derive(Debug, Default, PartialEq)]
pub struct Pending {
    /// Processes (thread-group ids) that `exec`ed: their name, command line and cgroup are new.
    pub execs: Vec<i32>,
    /// Processes whose uid/gid changed or that renamed themselves.
    pub changed: Vec<i32>,
    /// Events were dropped (the socket overflowed): anything may have changed.
    pub lost: bool,
}

impl Pending {
    fn len(&self) -> usize {
        self.execs.len() + self.changed.len()
    }

    /// Records one event; an event about a thread is an event about its process.
    fn record(&mut self, what: u32, pid: i32, tgid: i32) {
        match what {
            PROC_EVENT_EXEC => self.execs.push(tgid),
            PROC_EVENT_UID | PROC_EVENT_GID => self.changed.push(tgid),
            // Only the main thread's name is the process's (threads name themselves freely).
            PROC_EVENT_COMM if pid == tgid => self.changed.push(tgid),
            _ => {}
        }
        if self.len() > MAX_PENDING {
            self.lost();
        }
    }

    fn lost(&mut self) {
        self.execs.clear();
        self.changed.clear();
        self.lost = true;
    }
}

/// The socket and what has been read from it, shared by the drain thread and `take`.
struct Inner {
    socket: OwnedFd,
    pending: Pending,
    buf: Vec<u8>,
}

impl Inner {
    /// Reads every datagram waiting (never blocks).
    fn drain(&mut self) {
        loop {
            match recv_from_kernel(&self.socket, &mut self.buf, RecvFlags::DONTWAIT) {
                Ok(Some(n)) => {
                    if let Some((what, pid, tgid)) = parse(&self.buf[..n]) {
                        self.pending.record(what, pid, tgid);
                    }
                }
                Ok(None) => {}
                Err(Errno::AGAIN) => return,
                Err(Errno::INTR) => continue,
                // The kernel dropped events for this socket.
                Err(Errno::NOBUFS) => self.pending.lost(),
                Err(_) => {
                    self.pending.lost();
                    return;
                }
            }
        }
    }
}

/// A live subscription to process events.
pub struct ProcEvents {
    inner: Arc<Mutex<Inner>>,
    /// Written to stop the drain thread.
    stop: Arc<OwnedFd>,
    thread: Option<JoinHandle<()>>,
    filtered: bool,
}

fn lock(inner: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    inner.lock().unwrap_or_else(|e| e.into_inner())
}

impl ProcEvents {
    /// Subscribes and checks that events arrive; `Err` says why there are none.
    pub fn open() -> Result<ProcEvents, String> {
        let socket = socket_with(
            AddressFamily::NETLINK,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC,
            Some(netlink::CONNECTOR),
        )
        .map_err(|e| format!("netlink connector socket: {e}"))?;
        bind(&socket, &SocketAddrNetlink::new(0, CN_IDX_PROC))
            .map_err(|e| format!("bind to the proc connector: {e}"))?;
        if rustix::net::sockopt::set_socket_recv_buffer_size_force(&socket, RECV_BUFFER).is_err() {
            let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&socket, RECV_BUFFER);
        }
        let mut inner = Inner {
            socket,
            pending: Pending::default(),
            buf: vec![0; 4096],
        };
        // Filtered first (6.6+); a kernel that cannot filter ignores that request, then gets
        // the plain one.
        let requests = [
            &[PROC_CN_MCAST_LISTEN, WANTED][..],
            &[PROC_CN_MCAST_LISTEN][..],
        ];
        let live = requests.iter().position(|request| {
            control(&inner.socket, request).is_ok() && self_test(&mut inner).unwrap_or(false)
        });
        let Some(which) = live else {
            let _ = control(&inner.socket, &[PROC_CN_MCAST_IGNORE]);
            return Err(
                "no process events arrived (needs root with CAP_NET_ADMIN, outside a \
                        container's PID namespace)"
                    .into(),
            );
        };
        inner.pending = Pending::default();
        let stop =
            Arc::new(eventfd(0, EventfdFlags::CLOEXEC).map_err(|e| format!("eventfd: {e}"))?);
        let inner = Arc::new(Mutex::new(inner));
        let thread = {
            let (inner, stop) = (Arc::clone(&inner), Arc::clone(&stop));
            std::thread::Builder::new()
                .name("proc-events".into())
                .stack_size(64 << 10)
                .spawn(move || drain_loop(&inner, &stop))
                .map_err(|e| format!("starting the proc-events thread: {e}"))?
        };
        Ok(ProcEvents {
            inner,
            stop,
            thread: Some(thread),
            filtered: which == 0,
        })
    }

    /// The kernel sends only the events asked for (6.6+), not every fork and exit.
    pub fn filtered(&self) -> bool {
        self.filtered
    }

    /// Everything that happened since the last call (the socket is drained first, so an
    /// event the kernel sent before this call is in the answer).
    pub fn take(&self) -> Pending {
        let mut inner = lock(&self.inner);
        inner.drain();
        std::mem::take(&mut inner.pending)
    }
}

impl Drop for ProcEvents {
    fn drop(&mut self) {
        let _ = rustix::io::write(&*self.stop, &1u64.to_ne_bytes());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        // The kernel counts listeners; without this it would go on building events for nobody.
        let _ = control(&lock(&self.inner).socket, &[PROC_CN_MCAST_IGNORE]);
    }
}

/// Waits for the socket to have data, drains it, rests `DRAIN_EVERY`; until `stop` is written.
fn drain_loop(inner: &Mutex<Inner>, stop: &OwnedFd) {
    let socket = match lock(inner).socket.try_clone() {
        Ok(s) => s,
        Err(_) => return,
    };
    loop {
        let mut fds = [
            PollFd::new(&socket, PollFlags::IN),
            PollFd::new(stop, PollFlags::IN),
        ];
        match poll(&mut fds, None) {
            Ok(_) => {}
            Err(Errno::INTR) => continue,
            Err(_) => return,
        }
        if !fds[1].revents().is_empty() {
            return;
        }
        lock(inner).drain();
        std::thread::sleep(DRAIN_EVERY);
    }
}

/// Sends one proc connector control message (`op` and, for a filtered listen, the event mask).
fn control(socket: &OwnedFd, words: &[u32]) -> rustix::io::Result<()> {
    let payload = words.len() * 4;
    let mut msg = Vec::with_capacity(NLMSG_HDR + CN_MSG_HDR + payload);
    msg.extend(((NLMSG_HDR + CN_MSG_HDR + payload) as u32).to_ne_bytes());
    msg.extend(NLMSG_DONE.to_ne_bytes());
    msg.extend(0u16.to_ne_bytes()); // flags
    msg.extend(0u32.to_ne_bytes()); // seq
    msg.extend(std::process::id().to_ne_bytes());
    msg.extend(CN_IDX_PROC.to_ne_bytes());
    msg.extend(CN_VAL_PROC.to_ne_bytes());
    msg.extend(0u32.to_ne_bytes()); // seq
    msg.extend(0u32.to_ne_bytes()); // ack
    msg.extend((payload as u16).to_ne_bytes());
    msg.extend(0u16.to_ne_bytes()); // flags
    for w in words {
        msg.extend(w.to_ne_bytes());
    }
    sendto(
        socket,
        &msg,
        SendFlags::empty(),
        &SocketAddrNetlink::new(0, 0),
    )
    .map(|_| ())
}

/// Renames this thread to its own name and waits for the kernel's `COMM` event about it.
fn self_test(inner: &mut Inner) -> rustix::io::Result<bool> {
    let name = rustix::thread::name()?;
    let tid = rustix::thread::gettid().as_raw_nonzero().get();
    rustix::thread::set_name(&name)?;
    let deadline = Instant::now() + SELF_TEST_WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        let timeout = rustix::event::Timespec::try_from(left).unwrap_or_default();
        let mut fds = [PollFd::new(&inner.socket, PollFlags::IN)];
        if poll(&mut fds, Some(&timeout))? == 0 {
            return Ok(false);
        }
        let Some(n) = recv_from_kernel(&inner.socket, &mut inner.buf, RecvFlags::DONTWAIT)? else {
            continue;
        };
        if let Some((PROC_EVENT_COMM, pid, _)) = parse(&inner.buf[..n]) {
            if pid == tid {
                return Ok(true);
            }
        }
    }
}

/// One datagram, if the kernel sent it (netlink port 0): a local process that may send to this
/// socket is not believed. `Ok(Some(len))`, `Ok(None)` for a datagram from anyone else.
fn recv_from_kernel(
    socket: &OwnedFd,
    buf: &mut [u8],
    flags: RecvFlags,
) -> rustix::io::Result<Option<usize>> {
    let (n, _, from) = recvfrom(socket, &mut *buf, flags)?;
    let kernel = from
        .and_then(|a| SocketAddrNetlink::try_from(a).ok())
        .is_some_and(|a| a.pid() == 0);
    Ok(kernel.then_some(n.min(buf.len())))
}

/// A proc connector datagram: `(what, pid, tgid)` of its event (`pid`/`tgid` are the first two
/// fields of every event but fork's, which the caller does not ask about). `None` if it is not
/// one (short, another connector, an ack).
fn parse(data: &[u8]) -> Option<(u32, i32, i32)> {
    let u32_at = |off: usize| -> Option<u32> {
        Some(u32::from_ne_bytes(data.get(off..off + 4)?.try_into().ok()?))
    };
    if u32_at(NLMSG_HDR)? != CN_IDX_PROC || u32_at(NLMSG_HDR + 4)? != CN_VAL_PROC {
        return None;
    }
    let event = NLMSG_HDR + CN_MSG_HDR;
    let what = u32_at(event)?;
    let pid = u32_at(event + EVENT_DATA)? as i32;
    let tgid = u32_at(event + EVENT_DATA + 4)? as i32;
    Some((what, pid, tgid))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A datagram as the kernel builds it.
    fn datagram(what: u32, pid: i32, tgid: i32) -> Vec<u8> {
        let mut d = vec![0u8; NLMSG_HDR];
        d.extend(CN_IDX_PROC.to_ne_bytes());
        d.extend(CN_VAL_PROC.to_ne_bytes());
        d.extend([0u8; 12]);
        d.extend(what.to_ne_bytes());
        d.extend([0u8; 12]); // cpu, timestamp
        d.extend(pid.to_ne_bytes());
        d.extend(tgid.to_ne_bytes());
        d.extend([0u8; 16]);
        d
    }

    #[test]
    fn datagrams_are_parsed_and_odd_ones_ignored() {
        assert_eq!(
            parse(&datagram(PROC_EVENT_EXEC, 12, 10)),
            Some((PROC_EVENT_EXEC, 12, 10))
        );
        let mut other = datagram(PROC_EVENT_EXEC, 12, 10);
        other[NLMSG_HDR] = 7; // another connector
        assert_eq!(parse(&other), None);
        let d = datagram(PROC_EVENT_EXEC, 12, 10);
        for len in 0..NLMSG_HDR + CN_MSG_HDR + EVENT_DATA + 8 {
            assert_eq!(parse(&d[..len]), None, "{len} bytes");
        }
    }

    #[test]
    fn events_are_kept_per_process_and_a_flood_is_lost_not_grown() {
        let mut p = Pending::default();
        p.record(PROC_EVENT_EXEC, 12, 10);
        p.record(PROC_EVENT_UID, 13, 10);
        p.record(PROC_EVENT_COMM, 14, 10); // a thread naming itself
        p.record(PROC_EVENT_COMM, 20, 20);
        p.record(0x1, 30, 30); // fork: not asked for
        assert_eq!(p.execs, vec![10]);
        assert_eq!(p.changed, vec![10, 20]);
        assert!(!p.lost);
        for i in 0..=MAX_PENDING as i32 {
            p.record(PROC_EVENT_EXEC, i, i);
        }
        assert!(p.lost);
        assert!(p.len() < MAX_PENDING);
    }

    /// A datagram another process sends to the listener's port (root may) is not an event:
    /// only the kernel's count.
    #[test]
    fn a_forged_datagram_from_a_process_is_not_believed() {
        if !rustix::process::geteuid().is_root() {
            crate::test_skip::skip("root", "the kernel's process events need root");
            return;
        }
        let events = ProcEvents::open().expect("root on the host gets process events");
        let port = {
            let inner = lock(&events.inner);
            let addr = rustix::net::getsockname(&inner.socket).unwrap();
            SocketAddrNetlink::try_from(addr).unwrap().pid()
        };
        let forger = socket_with(
            AddressFamily::NETLINK,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC,
            Some(netlink::CONNECTOR),
        )
        .unwrap();
        let forged = datagram(PROC_EVENT_EXEC, 424242, 424242);
        let sent = sendto(
            &forger,
            &forged,
            SendFlags::empty(),
            &SocketAddrNetlink::new(port, 0),
        );
        assert_eq!(
            sent.ok(),
            Some(forged.len()),
            "the forged datagram was not even sent"
        );
        // A real exec after it: once the kernel's event for it is read, the forged datagram
        // (queued on the socket before it) has been read too.
        let mut child = std::process::Command::new("/bin/true").spawn().unwrap();
        let real = child.id() as i32;
        child.wait().unwrap();
        let mut seen = Pending::default();
        while !seen.execs.contains(&real) && !seen.lost {
            let p = events.take();
            seen.execs.extend(p.execs);
            seen.changed.extend(p.changed);
            seen.lost |= p.lost;
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            !seen.execs.contains(&424242),
            "forged event believed: {seen:?}"
        );
    }

    /// Real processes against the real kernel: an `exec` and a `setuid` in a child are reported
    /// for the child's pid. Needs root (CAP_NET_ADMIN) on the host, as the daemon does.
    #[test]
    fn a_real_exec_and_setuid_are_reported() {
        if !rustix::process::geteuid().is_root() {
            crate::test_skip::skip("root", "the kernel's process events need root");
            return;
        }
        let events = ProcEvents::open().expect("root on the host gets process events");
        let script =
            "import os, sys\nsys.stdin.readline()\nos.setuid(65534)\nsys.stdin.readline()\n\
                      os.execv('/bin/sleep', ['sleep', '30'])\n";
        let mut child = std::process::Command::new(crate::sample::python3())
            .args(["-c", script])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let mut stdin = child.stdin.take().unwrap();
        let wait_for = |want: &dyn Fn(&Pending) -> bool| {
            let deadline = Instant::now() + Duration::from_secs(5);
            let mut seen = Pending::default();
            while Instant::now() < deadline {
                let p = events.take();
                seen.execs.extend(p.execs);
                seen.changed.extend(p.changed);
                if want(&seen) {
                    return seen;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            seen
        };
        // The child's own start (fork, then exec of python) is reported first: wait for it, so
        // what follows is about the setuid and the exec asked for.
        let started = wait_for(&|p| p.execs.contains(&pid));
        assert!(
            started.execs.contains(&pid),
            "python's exec not reported: {started:?}"
        );
        use std::io::Write;
        stdin.write_all(b"\n").unwrap();
        let seen = wait_for(&|p| p.changed.contains(&pid));
        assert!(seen.changed.contains(&pid), "setuid not reported: {seen:?}");
        assert!(!seen.execs.contains(&pid), "no exec yet: {seen:?}");
        stdin.write_all(b"\n").unwrap();
        let seen = wait_for(&|p| p.execs.contains(&pid));
        assert!(seen.execs.contains(&pid), "exec not reported: {seen:?}");
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
