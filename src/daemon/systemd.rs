//! systemd's notify protocol.

use std::time::{Duration, Instant};

use tracing::info;

/// systemd's notify protocol: READY once serving, STATUS now and then, and watchdog pings from
/// the control loop itself, so a wedged loop gets the service restarted. No-ops outside systemd.
pub(super) struct Systemd {
    watchdog: Option<Duration>,
    last_ping: Option<Instant>,
    last_status: Option<Instant>,
}

impl Systemd {
    pub(super) fn new() -> Systemd {
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
        let watchdog = sd_notify::watchdog_enabled();
        if let Some(w) = watchdog {
            info!("systemd watchdog armed: {}", crate::units::fmt_duration(w));
        }
        Systemd {
            watchdog,
            last_ping: None,
            last_status: None,
        }
    }

    /// The loop must come round at least this often to keep the watchdog fed.
    pub(super) fn max_sleep(&self) -> Duration {
        self.watchdog.map_or(Duration::MAX, |w| w / 4)
    }

    pub(super) fn tick(&mut self, now: Instant, status: impl FnOnce() -> String) {
        if let Some(w) = self.watchdog {
            if self
                .last_ping
                .is_none_or(|t| now.duration_since(t) >= w / 4)
            {
                let _ = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]);
                self.last_ping = Some(now);
            }
        }
        if self
            .last_status
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(5))
        {
            let _ = sd_notify::notify(&[sd_notify::NotifyState::Status(&status())]);
            self.last_status = Some(now);
        }
    }
}
