//! Who listens where: the listening TCP sockets of `/proc/net/tcp` and `/proc/net/tcp6` by local
//! address, and whether a process holds one of them among its open descriptors. A port answers
//! for whoever bound it; this tells whose it is.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

/// TCP state LISTEN in `/proc/net/tcp*`.
const LISTEN: &str = "0A";

/// The inodes of the TCP sockets listening on `addr`'s port and address (or on the unspecified
/// address of its family, which takes every address of the host).
pub fn listening(proc_root: &Path, addr: SocketAddr) -> Vec<u64> {
    let file = match addr.ip() {
        IpAddr::V4(_) => "net/tcp",
        IpAddr::V6(_) => "net/tcp6",
    };
    let Ok(text) = std::fs::read_to_string(proc_root.join(file)) else {
        return Vec::new();
    };
    parse_listening(&text)
        .into_iter()
        .filter(|(local, _)| {
            local.port() == addr.port() && (local.ip() == addr.ip() || local.ip().is_unspecified())
        })
        .map(|(_, inode)| inode)
        .collect()
}

/// Whether `pid` has the socket `inode` among its open descriptors.
pub fn holds_socket(proc_root: &Path, pid: i32, inode: u64) -> bool {
    let want = format!("socket:[{inode}]");
    let Ok(fds) = std::fs::read_dir(proc_root.join(pid.to_string()).join("fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path()).is_ok_and(|target| target.as_os_str() == want.as_str())
    })
}

/// The listening sockets of a `/proc/net/tcp` or `tcp6` table: local address and inode.
fn parse_listening(text: &str) -> Vec<(SocketAddr, u64)> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.get(3) != Some(&LISTEN) {
                return None;
            }
            let local = parse_address(fields.get(1)?)?;
            let inode = fields.get(9)?.parse().ok()?;
            Some((local, inode))
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

    #[test]
    fn listening_sockets_are_read_with_their_addresses_and_inodes() {
        let v4: Vec<_> = parse_listening(TCP);
        assert_eq!(
            v4,
            [
                ("127.0.0.1:9835".parse().unwrap(), 41231),
                ("0.0.0.0:22".parse().unwrap(), 1201)
            ]
        );
        let v6 = parse_listening(TCP6);
        assert_eq!(
            v6,
            [
                ("[::1]:8000".parse().unwrap(), 52001),
                ("[::]:22".parse().unwrap(), 1202)
            ]
        );
    }

    #[test]
    fn a_port_is_found_on_its_address_or_the_unspecified_one() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("net")).unwrap();
        std::fs::write(root.path().join("net/tcp"), TCP).unwrap();
        std::fs::write(root.path().join("net/tcp6"), TCP6).unwrap();
        let at = |a: &str| listening(root.path(), a.parse().unwrap());
        assert_eq!(at("127.0.0.1:9835"), [41231]);
        assert_eq!(at("127.0.0.2:9835"), Vec::<u64>::new());
        assert_eq!(at("10.0.0.5:22"), [1201]);
        assert_eq!(at("[::1]:8000"), [52001]);
        assert_eq!(at("[::1]:9835"), Vec::<u64>::new());
    }

    /// The real kernel: a listener this test binds is found, and is this process's.
    #[test]
    fn a_listener_bound_here_is_found_among_this_process_descriptors() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let proc = Path::new("/proc");
        let inodes = listening(proc, addr);
        assert_eq!(inodes.len(), 1, "{addr}: {inodes:?}");
        assert!(holds_socket(proc, std::process::id() as i32, inodes[0]));
        assert!(!holds_socket(proc, 1, inodes[0]));
    }
}
