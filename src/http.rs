//! Outgoing HTTP (webhooks, readiness URLs): one place that builds the ureq agents, so every
//! request trusts the system's CA store (Debian's `ca-certificates`, plus `SSL_CERT_FILE` /
//! `SSL_CERT_DIR`), and an Alertmanager behind a company CA works.

use std::time::Duration;

use ureq::tls::{RootCerts, TlsConfig};

/// An agent whose requests take at most `timeout` and report HTTP errors as statuses.
pub fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .user_agent(concat!("gpuguard/", env!("CARGO_PKG_VERSION")))
        .tls_config(
            TlsConfig::builder()
                .root_certs(RootCerts::PlatformVerifier)
                .build(),
        )
        .build()
        .into()
}
