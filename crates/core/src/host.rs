//! What the config asks of the host it is read on: the uid of a user name, and the addresses
//! of the host's interfaces. The agent installs the host's own answers once, at start
//! (`install`); before that (or in a program that never installs any) a user name is looked
//! up in `/etc/passwd` alone and only loopback addresses are the host's, so a name is never
//! guessed and a URL never taken for local when it might not be.

use std::net::IpAddr;
use std::path::Path;
use std::sync::OnceLock;

/// The host's answers.
pub trait HostFacts: Send + Sync {
    /// The uid of the user named `name`; None when the host knows no such user.
    fn uid_of(&self, name: &str) -> Option<u32>;
    /// The IP addresses of the host's interfaces.
    fn local_addresses(&self) -> Vec<IpAddr>;
    /// The text of a config file, or why it cannot be used (`Config::load`). The agent's
    /// reads only a regular file of bounded size, without blocking, that only root can change
    /// when the daemon is root.
    fn read_config(&self, path: &Path) -> Result<String, String> {
        std::fs::read_to_string(path).map_err(|e| e.to_string())
    }
}

static FACTS: OnceLock<Box<dyn HostFacts>> = OnceLock::new();

/// Installs the host's answers; the first install holds for the life of the process.
pub fn install(facts: Box<dyn HostFacts>) {
    let _ = FACTS.set(facts);
}

/// The installed answers, or `/etc/passwd` and loopback only.
pub fn facts() -> &'static dyn HostFacts {
    FACTS.get().map_or(&PasswdOnly, |f| f.as_ref())
}

/// `/etc/passwd`'s users, no interface addresses.
struct PasswdOnly;

impl HostFacts for PasswdOnly {
    fn uid_of(&self, name: &str) -> Option<u32> {
        let text = std::fs::read_to_string("/etc/passwd").ok()?;
        uid_in_passwd(&text, name)
    }

    fn local_addresses(&self) -> Vec<IpAddr> {
        Vec::new()
    }
}

/// The uid of `name` in the text of a passwd(5) file.
fn uid_in_passwd(text: &str, name: &str) -> Option<u32> {
    text.lines().find_map(|line| {
        let mut fields = line.split(':');
        (fields.next() == Some(name)).then(|| fields.nth(1)?.parse().ok())?
    })
}

/// The host the core's tests run on: `/etc/passwd`'s users, and interfaces with 10.1.2.3 and
/// fd00::7 besides loopback.
#[cfg(test)]
pub(crate) fn install_test_host() {
    struct TestHost;
    impl HostFacts for TestHost {
        fn uid_of(&self, name: &str) -> Option<u32> {
            PasswdOnly.uid_of(name)
        }
        fn local_addresses(&self) -> Vec<IpAddr> {
            ["127.0.0.1", "10.1.2.3", "::1", "fd00::7"]
                .iter()
                .map(|a| a.parse().unwrap())
                .collect()
        }
    }
    install(Box::new(TestHost));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_is_found_by_its_whole_name_only() {
        let passwd = "root:x:0:0:root:/root:/bin/bash\nvllm:x:1001:1001::/home/vllm:/bin/sh\n";
        assert_eq!(uid_in_passwd(passwd, "root"), Some(0));
        assert_eq!(uid_in_passwd(passwd, "vllm"), Some(1001));
        assert_eq!(uid_in_passwd(passwd, "vll"), None);
        assert_eq!(uid_in_passwd(passwd, "x"), None);
        assert_eq!(
            uid_in_passwd("broken:x:notanumber:0::/:/bin/sh\n", "broken"),
            None
        );
    }

    #[test]
    fn without_an_install_root_is_known_and_no_address_is_local() {
        assert_eq!(PasswdOnly.uid_of("root"), Some(0));
        assert!(PasswdOnly.local_addresses().is_empty());
    }
}
