//! A model server's own URLs (its ready URL, its metrics URL), asked of its own sockets only.
//! On a host shared by several accounts anyone may listen on a free port, or on another address
//! `localhost` names (`[::1]` beside a server bound to IPv4 only), and would answer in the
//! model's name: a ready URL releases the launch lock, an engine's figures go into status, the
//! flight recorder and plans.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ureq::unversioned::resolver::{ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::{DefaultConnector, NextTimeout};

use super::sockets::{Holdings, Listener, Listeners};
use crate::snapshot::ProcessId;

/// Asks URLs on this host of the sockets of given processes only (a model's, a launched
/// server's tree): every address the URL's host names is looked up in /proc/net, and the
/// request goes to the first whose listeners (those a connection there reaches) are all
/// theirs (`sockets::Holdings`); the others are left alone and reported. The listeners are
/// looked at again after the answer: one that changed meanwhile voids it.
pub struct OwnSockets {
    agent: ureq::Agent,
    /// Where the next request connects: the address just checked.
    pinned: Arc<Mutex<Option<SocketAddr>>>,
    proc_root: PathBuf,
}

/// What asking gave: the answer read from the processes' own socket (or why there is none), and
/// the sockets of others found at the URL's addresses, which were not asked.
#[derive(Debug)]
pub struct Asked<T> {
    pub answer: Result<T, String>,
    pub ignored: Vec<String>,
}

impl OwnSockets {
    pub fn new(timeout: Duration, proc_root: PathBuf) -> OwnSockets {
        let pinned = Arc::new(Mutex::new(None));
        // A connection is made for each request, to the address checked for it: none is kept
        // for the next.
        let config = crate::http::config(timeout).max_idle_connections(0).build();
        let agent =
            ureq::Agent::with_parts(config, DefaultConnector::default(), Pin(pinned.clone()));
        OwnSockets {
            agent,
            pinned,
            proc_root,
        }
    }

    /// `GET url` of `members`' own socket (`members` is called once something listens), the
    /// answer given to `read`.
    pub fn get<T>(
        &self,
        url: &str,
        members: impl FnOnce() -> Vec<ProcessId>,
        read: impl FnOnce(&mut ureq::http::Response<ureq::Body>) -> Result<T, String>,
    ) -> Asked<T> {
        match addresses(url) {
            Ok(addresses) => self.ask(url, &addresses, members, read),
            Err(e) => Asked {
                answer: Err(e),
                ignored: Vec::new(),
            },
        }
    }

    /// `get`, `url`'s host naming `addresses`.
    fn ask<T>(
        &self,
        url: &str,
        addresses: &[SocketAddr],
        members: impl FnOnce() -> Vec<ProcessId>,
        read: impl FnOnce(&mut ureq::http::Response<ureq::Body>) -> Result<T, String>,
    ) -> Asked<T> {
        let mut ignored = Vec::new();
        let listeners = Listeners::read(&self.proc_root);
        let mut members = Some(members);
        let mut held: Option<Holdings> = None;
        let mut own: Option<(SocketAddr, Vec<Listener>)> = None;
        for &addr in addresses {
            let reached = listeners.reached(addr);
            if reached.is_empty() {
                continue;
            }
            let held = held.get_or_insert_with(|| {
                let members = members.take().map(|f| f()).unwrap_or_default();
                Holdings::of(&self.proc_root, &members)
            });
            let others: Vec<String> = reached
                .iter()
                .filter(|l| !held.hold(l))
                .map(|l| format!("{addr} is uid {}'s socket {}", l.uid, l.inode))
                .collect();
            if others.is_empty() {
                own.get_or_insert((addr, reached));
            }
            ignored.extend(others);
        }
        let Some((addr, reached)) = own else {
            let why = if ignored.is_empty() {
                format!("nothing listens at {}", list(addresses))
            } else {
                format!(
                    "no socket of the model's processes at {} ({}: not asked)",
                    list(addresses),
                    ignored.join(", ")
                )
            };
            return Asked {
                answer: Err(why),
                ignored,
            };
        };
        *self.pinned.lock().unwrap_or_else(|e| e.into_inner()) = Some(addr);
        let answer = self
            .agent
            .get(url)
            .call()
            .map_err(|e| format!("unreachable: {e}"))
            .and_then(|mut response| read(&mut response));
        *self.pinned.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let inodes = |l: &[Listener]| {
            l.iter()
                .map(|l| l.inode)
                .collect::<std::collections::BTreeSet<_>>()
        };
        let after = Listeners::read(&self.proc_root).reached(addr);
        let answer = if inodes(&after) == inodes(&reached) {
            answer
        } else {
            Err(format!(
                "the sockets listening at {addr} changed while it answered: answer ignored"
            ))
        };
        Asked { answer, ignored }
    }
}

/// The addresses a URL's host names (an IP address, or `localhost`'s from /etc/hosts), with its
/// port, each once, in the resolver's order.
fn addresses(url: &str) -> Result<Vec<SocketAddr>, String> {
    let uri: ureq::http::Uri = url.parse().map_err(|e| format!("'{url}': {e}"))?;
    let port = uri
        .port_u16()
        .or(match uri.scheme_str() {
            Some("http") => Some(80),
            Some("https") => Some(443),
            _ => None,
        })
        .ok_or_else(|| format!("'{url}' has no port"))?;
    let host = uri.host().ok_or_else(|| format!("'{url}' has no host"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let found: Vec<SocketAddr> = match host.parse::<IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => (host, port)
            .to_socket_addrs()
            .map_err(|e| format!("{host}: {e}"))?
            .collect(),
    };
    let mut unique = Vec::new();
    for a in found {
        if !unique.contains(&a) {
            unique.push(a);
        }
    }
    Ok(unique)
}

fn list(addresses: &[SocketAddr]) -> String {
    addresses
        .iter()
        .map(SocketAddr::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The resolver of `OwnSockets`' agent: the one address checked for the request, whatever the
/// URL's host names.
#[derive(Debug)]
struct Pin(Arc<Mutex<Option<SocketAddr>>>);

impl Resolver for Pin {
    fn resolve(
        &self,
        _uri: &ureq::http::Uri,
        _config: &ureq::config::Config,
        _timeout: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, ureq::Error> {
        let mut out = self.empty();
        let pinned = *self.0.lock().unwrap_or_else(|e| e.into_inner());
        out.push(pinned.ok_or(ureq::Error::HostNotFound)?);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpListener;

    use super::*;

    /// Answers each request on `listener` with status 200 and `body`.
    fn serve(listener: TcpListener, body: &'static str) {
        std::thread::spawn(move || {
            for mut conn in listener.incoming().map_while(Result::ok) {
                let mut buf = [0u8; 1024];
                let _ = conn.read(&mut buf);
                let _ = write!(
                    conn,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
    }

    /// A child process holding `listener` (as its stdin), and it as a model's only member.
    fn holder(listener: &TcpListener) -> (std::process::Child, ProcessId) {
        let child = std::process::Command::new("sleep")
            .arg("60")
            .stdin(std::process::Stdio::from(std::os::fd::OwnedFd::from(
                listener.try_clone().unwrap(),
            )))
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let start_time = crate::sample::procfs::ProcReader::new("/proc")
            .stat(pid, None)
            .unwrap()
            .start_time;
        (child, ProcessId { pid, start_time })
    }

    fn text(response: &mut ureq::http::Response<ureq::Body>) -> Result<String, String> {
        crate::http::body_text(response, 1024)
    }

    /// Round four: with `::1 localhost` in /etc/hosts and a server bound to IPv4 only, a user
    /// listening on `[::1]:PORT` answered root's `localhost` URLs. Of every address the host
    /// names (here `[::1]` first, as glibc sorts them), only one whose listener is the
    /// model's is asked; the other is reported, not asked. With the model's socket gone, no
    /// answer counts.
    #[test]
    fn of_the_addresses_localhost_names_only_the_models_socket_is_asked() {
        let model = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = model.local_addr().unwrap().port();
        let Ok(squatter) = TcpListener::bind(("::1", port)) else {
            crate::test_skip::skip("ipv6", "cannot listen on the IPv6 loopback here");
            return;
        };
        let (mut child, member) = holder(&model);
        serve(model, "model");
        serve(squatter, "squatter");
        let asker = OwnSockets::new(Duration::from_secs(5), "/proc".into());
        let url = format!("http://localhost:{port}/metrics");
        let both: [SocketAddr; 2] = [
            format!("[::1]:{port}").parse().unwrap(),
            format!("127.0.0.1:{port}").parse().unwrap(),
        ];
        let asked = asker.ask(&url, &both, || vec![member], text);
        assert_eq!(asked.answer.as_deref(), Ok("model"));
        assert_eq!(asked.ignored.len(), 1, "{asked:?}");
        assert!(
            asked.ignored[0].starts_with(&format!("[::1]:{port} is uid ")),
            "{asked:?}"
        );
        child.kill().unwrap();
        child.wait().unwrap();
        let asked = asker.ask(&url, &both, || vec![member], text);
        let err = asked.answer.unwrap_err();
        assert!(err.contains("no socket of the model's processes"), "{err}");
        assert!(err.contains("not asked"), "{err}");
    }

    /// The host's own addresses for a URL: an IP address as it is, `localhost` as the resolver
    /// names it, the scheme's port when none is given.
    #[test]
    fn a_urls_addresses_are_its_hosts() {
        assert_eq!(
            addresses("http://127.0.0.1:8000/health").unwrap(),
            ["127.0.0.1:8000".parse::<SocketAddr>().unwrap()]
        );
        assert_eq!(
            addresses("http://[::1]/metrics").unwrap(),
            ["[::1]:80".parse::<SocketAddr>().unwrap()]
        );
        let local = addresses("https://localhost/health").unwrap();
        assert!(!local.is_empty());
        assert!(
            local
                .iter()
                .all(|a| a.ip().is_loopback() && a.port() == 443),
            "{local:?}"
        );
    }
}
