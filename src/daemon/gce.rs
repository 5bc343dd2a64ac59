//! GCE's notices (`sample::gce`) as the loop acts on them: each change said once as an event
//! (critical when announced, info when withdrawn; the alert pipeline takes them to the webhooks),
//! the host drained through the reservation ledger while one is in force (new launches and
//! permits refused with `host_maintenance` or `preempted` and a retry hint; held ones keep
//! running), and `[gce] on_notice` run once per notice.

use std::path::Path;
use std::time::Duration;

use tracing::{error, info};

use crate::config::Config;
use crate::kinds::EventKind;
use crate::policy::{Event, Severity};
use crate::protocol::RefusalReason;
use crate::reserve::Drain;
use crate::sample::gce::{self, GceWatcher, Notices};

use super::Daemon;

/// How long a drained request is told to wait before it tries again.
const RETRY_AFTER: Duration = Duration::from_secs(60);

/// Starts watching the metadata server if `[gce] watch` asks for it here.
pub(super) fn start(config: &Config) -> Option<GceWatcher> {
    if !gce::wanted(config.gce.watch, Path::new(gce::DMI_PRODUCT_NAME)) {
        return None;
    }
    match GceWatcher::start(&config.gce.metadata_url) {
        Ok(w) => {
            info!("watching GCE's maintenance and preemption notices");
            Some(w)
        }
        Err(e) => {
            error!("cannot watch GCE's notices: {e}");
            None
        }
    }
}

/// The notice in force, as requests are refused for it (preemption before maintenance).
pub(super) fn notice_in_force(n: &Notices) -> Option<RefusalReason> {
    if n.preempted {
        Some(RefusalReason::Preempted)
    } else {
        n.maintenance
            .as_ref()
            .map(|_| RefusalReason::HostMaintenance)
    }
}

/// The drain a notice asks for (`None`: none in force).
pub(super) fn drain_for(n: &Notices) -> Option<Drain> {
    let reason = notice_in_force(n)?;
    let message = match (reason, &n.maintenance) {
        (RefusalReason::HostMaintenance, Some(event)) => format!(
            "GCE announced host maintenance ({event}): no new launches or permits here until it is withdrawn; held ones keep running"
        ),
        _ => "GCE is preempting this VM (about 30 s left): no new launches or permits here; held ones keep running".into(),
    };
    Some(Drain {
        reason,
        message,
        retry_after: RETRY_AFTER,
    })
}

impl Daemon {
    /// A change in GCE's notices since the last tick: an event, the drain, `on_notice`.
    pub(super) fn note_gce(&mut self, events: &mut Vec<Event>) {
        let Some(watcher) = &self.sampler.gce else {
            return;
        };
        let now = watcher.notices();
        if now.failing.is_empty() != self.gce_notices.failing.is_empty() {
            let failing: Vec<&str> = now.failing.values().map(String::as_str).collect();
            events.push(match failing.first() {
                Some(_) => Event::new(
                    Severity::Warning,
                    EventKind::GceWatchFailing,
                    format!(
                        "cannot read GCE's maintenance and preemption notices ({}): a notice would not be seen; retrying",
                        failing.join("; ")
                    ),
                ),
                None => Event::new(
                    Severity::Info,
                    EventKind::GceWatchFailing,
                    "GCE's metadata server answers again: notices are seen".into(),
                ),
            });
            self.gce_notices.failing = now.failing.clone();
        }
        if now.upcoming != self.gce_notices.upcoming {
            events.push(upcoming_event(now.upcoming.as_deref()));
            self.gce_notices.upcoming = now.upcoming.clone();
        }
        if (now.preempted, &now.maintenance)
            == (self.gce_notices.preempted, &self.gce_notices.maintenance)
        {
            return;
        }
        let drain = drain_for(&now);
        let event = match (&drain, now.preempted) {
            (Some(d), true) => Event::new(
                Severity::Critical,
                EventKind::GcePreempted,
                d.message.clone(),
            ),
            (Some(d), false) => Event::new(
                Severity::Critical,
                EventKind::GceMaintenance,
                d.message.clone(),
            ),
            (None, _) => Event::new(
                Severity::Info,
                EventKind::GceNoticeWithdrawn,
                "GCE withdrew its notice: launches and permits are taken again".into(),
            ),
        };
        events.push(event);
        let announced = if now.preempted {
            Some("PREEMPTED".to_string())
        } else {
            now.maintenance.clone()
        };
        self.shared.table().drain(drain);
        if let (Some(notice), false) = (announced, self.config.gce.on_notice.trim().is_empty()) {
            run_on_notice(&self.config.gce.on_notice, &notice);
        }
        self.gce_notices = now;
    }
}

/// Scheduled maintenance ahead (`upcoming-maintenance`), or none any more: said, not drained
/// (GPU VMs get `maintenance-event` about an hour before the window, and drain then).
fn upcoming_event(upcoming: Option<&str>) -> Event {
    match upcoming {
        Some(line) => Event::new(
            Severity::Warning,
            EventKind::GceUpcomingMaintenance,
            format!("GCE plans maintenance of this VM's host: {line}; launches and permits are refused from its maintenance-event notice on"),
        ),
        None => Event::new(
            Severity::Info,
            EventKind::GceUpcomingMaintenance,
            "GCE no longer plans maintenance of this VM's host".into(),
        ),
    }
}

/// Runs `[gce] on_notice` with `GPUGUARD_NOTICE` set; reaped on a thread of its own.
fn run_on_notice(command: &str, notice: &str) {
    let spawned = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(command)
        .env("GPUGUARD_NOTICE", notice)
        .stdin(std::process::Stdio::null())
        .spawn();
    match spawned {
        Ok(mut child) => {
            info!(pid = child.id(), "gce.on_notice started for {notice}");
            let _ = std::thread::Builder::new()
                .name("gce-on-notice".into())
                .spawn(move || {
                    let status = child.wait();
                    info!("gce.on_notice ended: {status:?}");
                });
        }
        Err(e) => error!("gce.on_notice could not start: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preemption_goes_before_maintenance_and_none_lifts_the_drain() {
        let maintenance = Notices {
            maintenance: Some("TERMINATE_ON_HOST_MAINTENANCE".into()),
            ..Notices::default()
        };
        let d = drain_for(&maintenance).unwrap();
        assert_eq!(d.reason, RefusalReason::HostMaintenance);
        assert!(
            d.message.contains("TERMINATE_ON_HOST_MAINTENANCE"),
            "{}",
            d.message
        );
        let both = Notices {
            preempted: true,
            ..maintenance
        };
        assert_eq!(drain_for(&both).unwrap().reason, RefusalReason::Preempted);
        // An error alone (the metadata server unreachable) drains nothing.
        let error = Notices {
            failing: [("maintenance-event", "maintenance-event: unreachable".into())].into(),
            ..Notices::default()
        };
        assert_eq!(drain_for(&error), None);
    }
}
