//! Who listens where: the listening TCP sockets of `/proc/net/tcp` and `/proc/net/tcp6`, which of
//! them a connection to an address reaches, and whether they belong to a set of processes (a
//! model's, a launched server and its descendants). A port answers for whoever bound it; this
//! tells whose it is.
//!
//! A socket is a process's when its inode is among the process's descriptors
//! (`/proc/PID/fd`). The kernel shows those only to a reader that may ptrace the process: the
//! packaged unit (no CAP_SYS_PTRACE) reads none of another account's, nor of a root process with
//! capabilities it lacks. Where some are hidden, the socket's owner (its uid in the table, the
//! account that made it) must be one the processes run as: no other account can make a socket
//! in their name.

use std::collections::{BTreeSet, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

use crate::sample::procfs::ProcReader;
use crate::snapshot::ProcessId;

/// TCP state LISTEN in `/proc/net/tcp*`.
const LISTEN: &str = "0A";
/// The processes of a tree looked at, at most (a launched server's descendants are the
/// launching account's to multiply).
const MAX_TREE: usize = 1024;
/// The descriptors of a set of processes read, at most; past it the rest count as hidden.
const MAX_FDS: usize = 1 << 16;

/// A listening TCP socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Listener {
    pub local: SocketAddr,
    /// The account that made it.
    pub uid: u32,
    pub inode: u64,
}

/// The host's listening TCP sockets (of this network namespace), IPv4's and IPv6's.
#[derive(Debug, Default)]
pub struct Listeners {
    v4: Vec<Listener>,
    v6: Vec<Listener>,
}

impl Listeners {
    pub fn read(proc_root: &Path) -> Listeners {
        Listeners {
            v4: table(proc_root, false),
            v6: table(proc_root, true),
        }
    }

    /// The listeners a connection to `addr` reaches, looked up as the kernel does: those bound
    /// to that very address (for IPv4 also as `::ffff:a.b.c.d`) if there are any, else those
    /// bound to the unspecified address: for IPv4 `0.0.0.0`'s if there are any (an IPv6 `[::]`
    /// socket on the same port beside them takes IPv6 only: the kernel refuses a dual-stack one
    /// there), else `[::]`'s (a dual-stack one takes IPv4 too).
    pub fn reached(&self, addr: SocketAddr) -> Vec<Listener> {
        let bound_to = |listeners: &[Listener], ip: IpAddr| -> Vec<Listener> {
            listeners
                .iter()
                .filter(|l| l.local.ip() == ip && l.local.port() == addr.port())
                .copied()
                .collect()
        };
        let any6 = bound_to(&self.v6, Ipv6Addr::UNSPECIFIED.into());
        let (exact, wildcard) = match addr.ip().to_canonical() {
            IpAddr::V4(ip) => {
                let exact = [
                    bound_to(&self.v4, ip.into()),
                    bound_to(&self.v6, ip.to_ipv6_mapped().into()),
                ]
                .concat();
                let any4 = bound_to(&self.v4, Ipv4Addr::UNSPECIFIED.into());
                (exact, if any4.is_empty() { any6 } else { any4 })
            }
            ip @ IpAddr::V6(_) => (bound_to(&self.v6, ip), any6),
        };
        if exact.is_empty() {
            wildcard
        } else {
            exact
        }
    }
}

/// What a set of processes holds: the socket inodes among their descriptors and the uids they
/// run as, read from /proc for the processes still alive as pinned (pid and start time).
#[derive(Debug, Default)]
pub struct Holdings {
    inodes: HashSet<u64>,
    uids: BTreeSet<u32>,
    /// Some of their descriptors could not be read.
    hidden: bool,
}

impl Holdings {
    pub fn of(proc_root: &Path, members: &[ProcessId]) -> Holdings {
        let mut reader = ProcReader::new(proc_root);
        let mut held = Holdings::default();
        let mut budget = MAX_FDS;
        for id in members {
            let Some(uid) = reader.status(id.pid, None).ok().and_then(|s| s.uid) else {
                continue;
            };
            let (inodes, hidden) = socket_inodes(proc_root, id.pid, &mut budget);
            // Read after the rest: a pid that still has the member's start time was the member
            // all along (a pid comes back only with another start time).
            if !reader
                .stat(id.pid, None)
                .is_ok_and(|s| s.start_time == id.start_time)
            {
                continue;
            }
            held.uids.insert(uid);
            held.inodes.extend(inodes);
            held.hidden |= hidden;
        }
        held
    }

    /// Whether `listener` is theirs: its inode among their descriptors, or, where the kernel
    /// hid some of those, its owner one of their uids.
    pub fn hold(&self, listener: &Listener) -> bool {
        self.inodes.contains(&listener.inode) || (self.hidden && self.uids.contains(&listener.uid))
    }
}

/// The socket inodes among a process's descriptors (`budget` of them read at most, over all
/// calls), and whether some could not be read.
fn socket_inodes(proc_root: &Path, pid: i32, budget: &mut usize) -> (Vec<u64>, bool) {
    let Ok(fds) = std::fs::read_dir(proc_root.join(pid.to_string()).join("fd")) else {
        return (Vec::new(), true);
    };
    let mut inodes = Vec::new();
    for fd in fds.flatten() {
        let Some(left) = budget.checked_sub(1) else {
            return (inodes, true);
        };
        *budget = left;
        match std::fs::read_link(fd.path()) {
            Ok(target) => inodes.extend(socket_inode(&target.to_string_lossy())),
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => return (inodes, true),
            // Closed meanwhile.
            Err(_) => {}
        }
    }
    (inodes, false)
}

/// Whether `pid` has the socket `inode` among its open descriptors.
pub fn holds_socket(proc_root: &Path, pid: i32, inode: u64) -> bool {
    let mut budget = usize::MAX;
    socket_inodes(proc_root, pid, &mut budget)
        .0
        .contains(&inode)
}

/// `socket:[12345]` -> 12345.
fn socket_inode(link: &str) -> Option<u64> {
    link.strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// A process and its descendants (through `/proc/PID/task/TID/children`), pinned by pid and
/// start time: empty when `root` is no longer the process it was.
pub fn tree(proc_root: &Path, root: ProcessId) -> Vec<ProcessId> {
    let mut reader = ProcReader::new(proc_root);
    let mut found = vec![root];
    if !reader
        .stat(root.pid, None)
        .is_ok_and(|s| s.start_time == root.start_time)
    {
        return Vec::new();
    }
    let mut next = 0;
    while next < found.len() && found.len() < MAX_TREE {
        let pid = found[next].pid;
        next += 1;
        let Ok(tasks) = std::fs::read_dir(proc_root.join(pid.to_string()).join("task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let Ok(children) = std::fs::read_to_string(task.path().join("children")) else {
                continue;
            };
            for child in children
                .split_ascii_whitespace()
                .filter_map(|c| c.parse().ok())
            {
                let Ok(stat) = reader.stat(child, None) else {
                    continue;
                };
                // A child listed by its parent was its child when read: its start time now pins it.
                if stat.ppid == pid && found.len() < MAX_TREE {
                    found.push(ProcessId {
                        pid: child,
                        start_time: stat.start_time,
                    });
                }
            }
        }
    }
    found
}

/// The listening sockets of one table (`tcp6` or `tcp`).
fn table(proc_root: &Path, v6: bool) -> Vec<Listener> {
    let file = if v6 { "net/tcp6" } else { "net/tcp" };
    std::fs::read_to_string(proc_root.join(file))
        .map(|text| parse_listening(&text))
        .unwrap_or_default()
}

/// The listening sockets of a `/proc/net/tcp` or `tcp6` table.
fn parse_listening(text: &str) -> Vec<Listener> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.get(3) != Some(&LISTEN) {
                return None;
            }
            Some(Listener {
                local: parse_address(fields.get(1)?)?,
                uid: fields.get(7)?.parse().ok()?,
                inode: fields.get(9)?.parse().ok()?,
            })
        })
        .collect()
}

/// `0100007F:2653` (IPv4, the address as the kernel's native-endian word) or 32 hex digits
/// (IPv6, four such words), then the port in hex.
fn parse_address(text: &str) -> Option<SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    // The kernel prints each 32-bit word of the address as a native integer: its bytes in
    // memory order are the address's.
    let word = |hex: &str| u32::from_str_radix(hex, 16).ok().map(u32::to_ne_bytes);
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(ip)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for (i, chunk) in bytes.chunks_mut(4).enumerate() {
                let hex = ip.get(i * 8..i * 8 + 8)?;
                chunk.copy_from_slice(&word(hex)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    /// Lines as Linux writes them on a little-endian machine (x86_64, arm64): 127.0.0.1:9835 and 0.0.0.0:22
    /// listening, one established connection; `[::1]:8000` and `[::]:22` listening.
    const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:266B 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 41231 1 0000000000000000 100 0 0 10 0
   1: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1201 1 0000000000000000 100 0 0 10 0
   2: 0100007F:266B 0100007F:A2C4 01 00000000:00000000 00:00000000 00000000     0        0 41250 1 0000000000000000 20 4 30 10 -1
";
    const TCP6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:1F40 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 52001 1 0000000000000000 100 0 0 10 0
   1: 00000000000000000000000000000000:0016 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1202 1 0000000000000000 100 0 0 10 0
";

    fn listener(local: &str, uid: u32, inode: u64) -> Listener {
        Listener {
            local: local.parse().unwrap(),
            uid,
            inode,
        }
    }

    #[test]
    fn listening_sockets_are_read_with_their_addresses_owners_and_inodes() {
        assert_eq!(
            parse_listening(TCP),
            [
                listener("127.0.0.1:9835", 0, 41231),
                listener("0.0.0.0:22", 0, 1201)
            ]
        );
        assert_eq!(
            parse_listening(TCP6),
            [
                listener("[::1]:8000", 1000, 52001),
                listener("[::]:22", 0, 1202)
            ]
        );
    }

    /// A table line for `l`, written as the kernel writes it.
    fn line(l: &Listener) -> String {
        let word = |b: &[u8]| format!("{:08X}", u32::from_ne_bytes(b.try_into().unwrap()));
        let ip = match l.local.ip() {
            IpAddr::V4(ip) => word(&ip.octets()),
            IpAddr::V6(ip) => ip.octets().chunks(4).map(word).collect(),
        };
        format!(
            "   0: {ip}:{:04X} 00000000:0000 0A 00000000:00000000 00:00000000 00000000 {} 0 {} 1 0 100 0 0 10 0\n",
            l.local.port(),
            l.uid,
            l.inode
        )
    }

    /// A /proc with these listening sockets.
    fn proc_with(listeners: &[Listener]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("net")).unwrap();
        for (file, v6) in [("net/tcp", false), ("net/tcp6", true)] {
            let lines: String = listeners
                .iter()
                .filter(|l| l.local.is_ipv6() == v6)
                .map(line)
                .collect();
            std::fs::write(
                root.path().join(file),
                format!("  sl  local_address\n{lines}"),
            )
            .unwrap();
        }
        root
    }

    #[test]
    fn a_connection_reaches_the_listeners_the_kernel_looks_up_for_its_address() {
        let server = listener("127.0.0.1:8000", 0, 1);
        let squatter = listener("[::1]:8000", 1001, 2);
        let any4 = listener("0.0.0.0:9000", 0, 3);
        let v6only = listener("[::]:9000", 1001, 4);
        let dual = listener("[::]:7000", 1001, 5);
        let mapped = listener("[::ffff:127.0.0.1]:6000", 1001, 6);
        let root = proc_with(&[server, squatter, any4, v6only, dual, mapped]);
        let listeners = Listeners::read(root.path());
        let at = |a: &str| listeners.reached(a.parse().unwrap());
        assert_eq!(at("127.0.0.1:8000"), [server]);
        assert_eq!(at("[::1]:8000"), [squatter]);
        assert_eq!(at("127.0.0.2:8000"), []);
        assert_eq!(at("127.0.0.1:9000"), [any4]);
        assert_eq!(at("10.0.0.5:9000"), [any4]);
        assert_eq!(at("[::1]:9000"), [v6only]);
        assert_eq!(at("127.0.0.1:7000"), [dual]);
        assert_eq!(at("[::ffff:127.0.0.1]:7000"), [dual]);
        assert_eq!(at("127.0.0.1:6000"), [mapped]);
        assert_eq!(at("[::1]:6000"), []);
    }

    /// `/proc/PID` of a fake process: its stat (start time), its owner, its descriptors (`None`:
    /// hidden, as the kernel hides another account's).
    fn fake_process(root: &Path, pid: i32, start_time: u64, uid: u32, sockets: Option<&[u64]>) {
        let dir = root.join(pid.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        let mut fields = vec!["0".to_string(); 49];
        fields[0] = "S".into();
        fields[1] = "1".into();
        fields[19] = start_time.to_string();
        std::fs::write(
            dir.join("stat"),
            format!("{pid} (x) {}\n", fields.join(" ")),
        )
        .unwrap();
        std::fs::write(
            dir.join("status"),
            format!("Uid:\t{uid}\t{uid}\t{uid}\t{uid}\n"),
        )
        .unwrap();
        match sockets {
            Some(inodes) => {
                std::fs::create_dir(dir.join("fd")).unwrap();
                for (fd, inode) in inodes.iter().enumerate() {
                    std::os::unix::fs::symlink(
                        format!("socket:[{inode}]"),
                        dir.join("fd").join(fd.to_string()),
                    )
                    .unwrap();
                }
            }
            // Not a directory: read_dir fails as it does for a hidden one.
            None => std::fs::write(dir.join("fd"), "").unwrap(),
        }
    }

    /// A listener is the processes' when its inode is among their descriptors; where some of
    /// those are hidden, when its owner is one of their uids; never through a member that is
    /// not the process it was (its pid reused).
    #[test]
    fn a_listener_is_theirs_by_inode_and_where_hidden_by_owner() {
        let root = tempfile::tempdir().unwrap();
        let p = root.path();
        fake_process(p, 10, 100, 1001, Some(&[7, 8]));
        fake_process(p, 11, 110, 1002, Some(&[9]));
        fake_process(p, 12, 120, 1003, None);
        let id = |pid, start_time| ProcessId { pid, start_time };
        let own = listener("127.0.0.1:8000", 1001, 8);
        let same_uid_other_socket = listener("127.0.0.1:8000", 1001, 99);
        let reused = listener("127.0.0.1:8000", 1002, 9);
        let readable = Holdings::of(p, &[id(10, 100), id(11, 999)]);
        assert!(readable.hold(&own));
        assert!(!readable.hold(&same_uid_other_socket), "every fd was read");
        assert!(!readable.hold(&reused), "pid 11 is another process now");
        let hidden = Holdings::of(p, &[id(10, 100), id(12, 120)]);
        assert!(hidden.hold(&own));
        assert!(hidden.hold(&listener("[::1]:8000", 1003, 50)), "uid 1003's");
        assert!(
            hidden.hold(&same_uid_other_socket),
            "uid 1001's, fds of 12 hidden"
        );
        assert!(
            !hidden.hold(&listener("[::1]:8000", 1004, 51)),
            "another account's"
        );
        assert!(!Holdings::of(p, &[]).hold(&own));
    }

    /// The real kernel: a listener handed to a child is found on its address, is the child's
    /// tree's and not this process's, though both run as the same account.
    #[test]
    fn a_listener_handed_to_a_child_is_its_trees_only() {
        let bound = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = bound.local_addr().unwrap();
        let mut child = Command::new("sleep")
            .arg("60")
            .stdin(Stdio::from(std::os::fd::OwnedFd::from(bound)))
            .spawn()
            .unwrap();
        let proc = Path::new("/proc");
        let me = ProcessId {
            pid: std::process::id() as i32,
            start_time: ProcReader::new(proc)
                .stat(std::process::id() as i32, None)
                .unwrap()
                .start_time,
        };
        let reached = Listeners::read(proc).reached(addr);
        assert_eq!(reached.len(), 1, "{addr}: {reached:?}");
        let family = tree(proc, me);
        assert!(
            family.iter().any(|p| p.pid == child.id() as i32),
            "{family:?}"
        );
        assert!(Holdings::of(proc, &family).hold(&reached[0]));
        assert!(!Holdings::of(proc, &[me]).hold(&reached[0]));
        assert!(holds_socket(proc, child.id() as i32, reached[0].inode));
        assert!(!holds_socket(proc, me.pid, reached[0].inode));
        let stale = ProcessId {
            start_time: me.start_time + 1,
            ..me
        };
        assert_eq!(tree(proc, stale), []);
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
