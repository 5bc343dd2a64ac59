//! Outgoing HTTP (webhooks, readiness URLs, engines' metrics): one place that builds the ureq
//! agents, so every request trusts the system's CA store (Debian's `ca-certificates`, plus
//! `SSL_CERT_FILE` / `SSL_CERT_DIR`), and an Alertmanager behind a company CA works. (A model
//! server's own URLs are asked of its own sockets only: `sample::own_sockets`.)

use std::time::Duration;

use ureq::tls::{RootCerts, TlsConfig};

/// An agent whose requests take at most `timeout`, report HTTP errors (and redirects) as
/// statuses and follow no redirect.
pub fn agent(timeout: Duration) -> ureq::Agent {
    config(timeout).build().into()
}

/// What `agent` is built from, for agents with parts of their own.
pub fn config(timeout: Duration) -> ureq::config::ConfigBuilder<ureq::typestate::AgentScope> {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        // A redirect would take a request where its URL's checks did not look (a loopback
        // metrics or ready URL redirecting elsewhere): never followed.
        .max_redirects(0)
        .user_agent(concat!("gpuguard/", env!("CARGO_PKG_VERSION")))
        .tls_config(
            TlsConfig::builder()
                .root_certs(RootCerts::PlatformVerifier)
                .build(),
        )
}

/// An answer's body as text, read up to `limit` bytes (more is an error, never a larger buffer).
pub fn body_text(
    response: &mut ureq::http::Response<ureq::Body>,
    limit: u64,
) -> Result<String, String> {
    response
        .body_mut()
        .with_config()
        .limit(limit)
        .read_to_string()
        .map_err(|e| format!("reading the answer: {e}"))
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    /// A redirect comes back as what it is: the request is not sent on to its Location.
    #[test]
    fn redirects_are_not_followed() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let mut served = 0;
            listener.set_nonblocking(false).unwrap();
            // The first request gets a redirect to a second path on the same listener; a
            // follower would come back for it.
            for stream in listener.incoming().take(1) {
                let mut stream = stream.unwrap();
                let mut buf = [0u8; 4096];
                let _ = stream.read(&mut buf);
                served += 1;
                let _ = stream.write_all(
                    format!(
                        "HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:{port}/elsewhere\r\n\
                         Content-Length: 0\r\nConnection: close\r\n\r\n"
                    )
                    .as_bytes(),
                );
            }
            served
        });
        let response = super::agent(std::time::Duration::from_secs(5))
            .get(&format!("http://127.0.0.1:{port}/health"))
            .call()
            .unwrap();
        assert_eq!(response.status(), 302);
        assert_eq!(server.join().unwrap(), 1);
    }
}
