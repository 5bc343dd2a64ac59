//! The host's own answers to what the config asks (`gpuguard_core::host`): users from the
//! system's user database (NSS: /etc/passwd, LDAP, sssd), addresses from its interfaces.
//! Installed once, first thing in `cli::main`.

use std::net::IpAddr;

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
}
