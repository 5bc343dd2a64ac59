//! The host's own answers to what the config asks (`gpuguard_core::host`): users from the
//! system's user database (NSS: /etc/passwd, LDAP, sssd), addresses from its interfaces, and
//! the config file read as a root daemon must read it. Installed once, first thing in
//! `cli::main`.

use std::io::Read;
use std::net::IpAddr;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use crate::host::HostFacts;

/// This host, through libc.
pub struct ThisHost;

impl HostFacts for ThisHost {
    fn uid_of(&self, name: &str) -> Option<u32> {
        nix::unistd::User::from_name(name)
            .ok()
            .flatten()
            .map(|u| u.uid.as_raw())
    }

    fn local_addresses(&self) -> Vec<IpAddr> {
        let Ok(addresses) = nix::ifaddrs::getifaddrs() else {
            return Vec::new();
        };
        addresses
            .filter_map(|a| a.address)
            .filter_map(|a| {
                a.as_sockaddr_in()
                    .map(|v4| IpAddr::V4(v4.ip()))
                    .or_else(|| a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
            })
            .collect()
    }

    /// The config file (symlinks followed: a ConfigMap's file is one): opened without blocking
    /// (a FIFO put in its place must not stall the loop), a regular file of at most
    /// `MAX_CONFIG_BYTES`, and, when the daemon is root, one that only root can change (owned
    /// by root, writable by no group but root's and by no one else): whoever can write the
    /// config can have any process stopped or killed.
    fn read_config(&self, path: &Path) -> Result<String, String> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .map_err(|e| e.to_string())?;
        let meta = file.metadata().map_err(|e| e.to_string())?;
        trusted_config(
            meta.file_type().is_file(),
            (meta.uid(), meta.gid(), meta.mode()),
            rustix::process::geteuid().is_root(),
        )?;
        let mut text = String::new();
        file.take(MAX_CONFIG_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|e| e.to_string())?;
        if text.len() as u64 > MAX_CONFIG_BYTES {
            return Err(format!("larger than {MAX_CONFIG_BYTES} bytes"));
        }
        Ok(text)
    }
}

/// The largest config file read (the example, comments and all, is about 20 KiB).
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Whether a config file (a regular file or not; its owner, group and mode) may be read
/// (`root`: by a root daemon).
fn trusted_config(
    regular: bool,
    (uid, gid, mode): (u32, u32, u32),
    root: bool,
) -> Result<(), String> {
    if !regular {
        return Err("not a regular file".into());
    }
    if root {
        let mode = mode & 0o7777;
        if uid != 0 {
            return Err(format!(
                "owned by uid {uid}, not root: a root daemon takes its config only from a file root \
                 alone can change"
            ));
        }
        if mode & 0o002 != 0 || (mode & 0o020 != 0 && gid != 0) {
            return Err(format!(
                "writable by others or by group {gid} (mode {mode:04o}): a root daemon takes its \
                 config only from a file root alone can change"
            ));
        }
    }
    Ok(())
}

/// Installs `ThisHost` (the first install holds).
pub fn install() {
    crate::host::install(Box::new(ThisHost));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_and_loopback_are_this_hosts() {
        assert_eq!(ThisHost.uid_of("root"), Some(0));
        assert_eq!(ThisHost.uid_of("no-such-user-here"), None);
        assert!(ThisHost
            .local_addresses()
            .contains(&IpAddr::from([127, 0, 0, 1])));
    }

    /// Who may change a config a root daemon reads: root alone (root's group may write it: a
    /// umask of 002 gives that). Anyone else's file, or one others can write, is refused, and
    /// the words say why; a daemon that is not root reads what it can.
    #[test]
    fn a_root_daemon_reads_a_config_only_root_can_change() {
        for (regular, owner, root, ok) in [
            (true, (0, 0, 0o100644), true, true),
            (true, (0, 0, 0o100664), true, true),
            (true, (0, 1000, 0o100640), true, true),
            (true, (0, 1000, 0o100660), true, false),
            (true, (0, 0, 0o100666), true, false),
            (true, (1000, 1000, 0o100644), true, false),
            (true, (1000, 1000, 0o100666), false, true),
            (false, (0, 0, 0o010644), true, false),
            (false, (0, 0, 0o010644), false, false),
        ] {
            let got = trusted_config(regular, owner, root);
            assert_eq!(got.is_ok(), ok, "{regular} {owner:?} root {root}: {got:?}");
        }
        let why = trusted_config(true, (1000, 1000, 0o100644), true).unwrap_err();
        assert!(why.starts_with("owned by uid 1000, not root"), "{why}");
        let why = trusted_config(true, (0, 1000, 0o100664), true).unwrap_err();
        assert!(
            why.starts_with("writable by others or by group 1000 (mode 0664)"),
            "{why}"
        );
    }

    /// A FIFO in the config's place is refused at once, not waited on (the loop would stall
    /// until a writer came); so are a directory and a file over the bound.
    #[test]
    fn what_is_not_a_small_regular_file_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("config.toml");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o644),
            0,
        )
        .unwrap();
        assert_eq!(
            ThisHost.read_config(&fifo),
            Err("not a regular file".into())
        );
        assert_eq!(
            ThisHost.read_config(dir.path()),
            Err("not a regular file".into())
        );
        let big = dir.path().join("big.toml");
        std::fs::write(&big, vec![b'#'; MAX_CONFIG_BYTES as usize + 1]).unwrap();
        assert_eq!(
            ThisHost.read_config(&big),
            Err(format!("larger than {MAX_CONFIG_BYTES} bytes"))
        );
        let ok = dir.path().join("ok.toml");
        std::fs::write(&ok, "[ram]\n").unwrap();
        assert_eq!(ThisHost.read_config(&ok), Ok("[ram]\n".into()));
    }
}
