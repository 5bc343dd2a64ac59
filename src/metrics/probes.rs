//! `/healthz` and `/readyz` on `[metrics] listen`: what a kubelet's liveness and readiness
//! probes (or a load balancer's health check) read. The loop records each tick here (`ticked`:
//! when, and what the tick view says of readiness); the metrics thread answers from that record
//! and its own clock. The decisions are pure functions of plain data (`health`, `readiness`,
//! `Readiness::answer`).
//!
//! - `/healthz`: 200 while the loop ticks (its last tick, or the start when there was none yet,
//!   is at most `allowed` old: 3 × `daemon.interval` plus `SLACK`), 503 once it is older. A
//!   wedged loop is restarted by the kubelet as systemd's watchdog restarts it under the unit.
//! - `/readyz`: 200 while the host is guarded and admits launches and permits; 503 while it
//!   drains for a cloud notice (GCE maintenance or preemption), while a floor (RAM or a GPU's)
//!   is at its act level, before the first tick, and while the loop does not tick.

use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::config::Mode;
use crate::kinds::Level;
use crate::view::TickView;

/// Added to 3 × `daemon.interval`: a tick may take a while (a reload, a slow /proc).
pub const SLACK: Duration = Duration::from_secs(5);

/// How old the last tick may be while the loop still counts as ticking.
pub fn allowed_gap(interval: Duration) -> Duration {
    interval.saturating_mul(3) + SLACK
}

/// A probe's answer: its status (200 or 503) and a one-line body that says why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    pub ok: bool,
    pub body: String,
}

impl Answer {
    pub fn status(&self) -> &'static str {
        if self.ok {
            "200 OK"
        } else {
            "503 Service Unavailable"
        }
    }
}

/// What a tick view says of readiness: plain data, kept until the next tick.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Readiness {
    pub mode: Mode,
    /// The cloud's notice the host drains for ("host_maintenance", "preempted").
    pub draining: Option<&'static str>,
    /// Host RAM is at its act floor (`ram.min_available`).
    pub ram_at_act: bool,
    /// The GPUs at their act floor (`gpu.min_free`), by index.
    pub gpus_at_act: Vec<u32>,
}

/// Readiness as the tick view `v` has it.
pub fn readiness(v: &TickView) -> Readiness {
    Readiness {
        mode: v.mode,
        draining: v.cloud_notice,
        ram_at_act: v.ram.level == Level::Act,
        gpus_at_act: v
            .gpus
            .iter()
            .filter(|g| g.level == Level::Act)
            .map(|g| g.index)
            .collect(),
    }
}

impl Readiness {
    /// `/readyz` once the loop ticks (`health` is its `/healthz` answer).
    pub fn answer(&self, health: &Answer) -> Answer {
        if !health.ok {
            return Answer {
                ok: false,
                body: format!("not ready: {}", health.body),
            };
        }
        let mut why = Vec::new();
        if let Some(notice) = self.draining {
            why.push(format!(
                "draining for the cloud's {notice} notice: new launches and permits are refused"
            ));
        }
        if self.ram_at_act {
            why.push("host RAM is at its act floor (ram.min_available)".to_string());
        }
        if !self.gpus_at_act.is_empty() {
            let mut gpus = String::new();
            for (i, g) in self.gpus_at_act.iter().enumerate() {
                let _ = write!(gpus, "{}{g}", if i == 0 { "" } else { ", " });
            }
            let s = if self.gpus_at_act.len() == 1 { "" } else { "s" };
            why.push(format!("GPU{s} {gpus} at the act floor (gpu.min_free)"));
        }
        if why.is_empty() {
            Answer {
                ok: true,
                body: format!("ready: guarding (mode {}) and admitting\n", self.mode),
            }
        } else {
            Answer {
                ok: false,
                body: format!("not ready: {}\n", why.join("; ")),
            }
        }
    }
}

/// `/healthz` at `now`: the loop's last tick (`None`: none yet, counted from `since`, the
/// start) at most `allowed` old.
pub fn health(
    last_tick: Option<Instant>,
    since: Instant,
    now: Instant,
    allowed: Duration,
) -> Answer {
    let age = now.saturating_duration_since(last_tick.unwrap_or(since));
    let secs = |d: Duration| format!("{:.1}s", d.as_secs_f64());
    match (last_tick, age <= allowed) {
        (Some(_), true) => Answer {
            ok: true,
            body: format!("ok: the loop ticked {} ago\n", secs(age)),
        },
        (None, true) => Answer {
            ok: true,
            body: format!("ok: starting, no tick yet ({} since start)\n", secs(age)),
        },
        (Some(_), false) => Answer {
            ok: false,
            body: format!(
                "the loop has not ticked for {} (allowed {}: 3 x daemon.interval + {}s)\n",
                secs(age),
                secs(allowed),
                SLACK.as_secs()
            ),
        },
        (None, false) => Answer {
            ok: false,
            body: format!(
                "no tick in the {} since start (allowed {}: 3 x daemon.interval + {}s)\n",
                secs(age),
                secs(allowed),
                SLACK.as_secs()
            ),
        },
    }
}

/// The loop's record for the probes, shared with the metrics thread.
#[derive(Debug)]
pub struct Probes {
    state: Mutex<ProbeState>,
}

#[derive(Debug)]
struct ProbeState {
    since: Instant,
    last_tick: Option<Instant>,
    allowed: Duration,
    ready: Readiness,
}

impl Default for Probes {
    fn default() -> Self {
        Probes::new(Instant::now())
    }
}

impl Probes {
    pub fn new(since: Instant) -> Probes {
        Probes {
            state: Mutex::new(ProbeState {
                since,
                last_tick: None,
                allowed: allowed_gap(Duration::from_secs(1)),
                ready: Readiness::default(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ProbeState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A tick at `now`, with the config's `daemon.interval` and the tick's view.
    pub fn ticked(&self, now: Instant, interval: Duration, v: &TickView) {
        let ready = readiness(v);
        let mut s = self.lock();
        s.last_tick = Some(now);
        s.allowed = allowed_gap(interval);
        s.ready = ready;
    }

    /// `/healthz` at `now`.
    pub fn health(&self, now: Instant) -> Answer {
        let s = self.lock();
        health(s.last_tick, s.since, now, s.allowed)
    }

    /// `/readyz` at `now`.
    pub fn ready(&self, now: Instant) -> Answer {
        let s = self.lock();
        let health = health(s.last_tick, s.since, now, s.allowed);
        if s.last_tick.is_none() && health.ok {
            return Answer {
                ok: false,
                body: "not ready: starting, no tick yet\n".into(),
            };
        }
        s.ready.answer(&health)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{GpuRow, MemoryStatus};

    const S: Duration = Duration::from_secs(1);

    fn view(ram: Level, gpus: &[Level], notice: Option<&'static str>) -> TickView {
        TickView {
            mode: Mode::Enforce,
            ram: MemoryStatus {
                level: ram,
                ..MemoryStatus::default()
            },
            gpus: gpus
                .iter()
                .enumerate()
                .map(|(i, level)| GpuRow {
                    index: i as u32,
                    level: *level,
                    ..GpuRow::default()
                })
                .collect(),
            cloud_notice: notice,
            ..TickView::default()
        }
    }

    fn ok() -> Answer {
        Answer {
            ok: true,
            body: "ok\n".into(),
        }
    }

    #[test]
    fn a_loop_that_ticked_within_three_intervals_and_the_slack_is_healthy_and_not_after() {
        let t0 = Instant::now();
        let allowed = allowed_gap(S);
        assert_eq!(allowed, 8 * S);
        let tick = Some(t0);
        let fresh = health(tick, t0, t0 + 8 * S, allowed);
        assert!(fresh.ok, "{fresh:?}");
        assert_eq!(fresh.body, "ok: the loop ticked 8.0s ago\n");
        let stale = health(tick, t0, t0 + 9 * S, allowed);
        assert!(!stale.ok);
        assert_eq!(stale.status(), "503 Service Unavailable");
        assert_eq!(
            stale.body,
            "the loop has not ticked for 9.0s (allowed 8.0s: 3 x daemon.interval + 5s)\n"
        );
        // Before the first tick the start counts, with the same allowance.
        assert!(health(None, t0, t0 + 2 * S, allowed).ok);
        let never = health(None, t0, t0 + 20 * S, allowed);
        assert!(!never.ok);
        assert!(
            never.body.starts_with("no tick in the 20.0s since start"),
            "{never:?}"
        );
    }

    #[test]
    fn ready_while_guarding_and_admitting_with_floors_below_act() {
        for (ram, gpus) in [
            (Level::Ok, vec![Level::Ok, Level::Ok]),
            (Level::Warn, vec![Level::Warn]),
            (Level::Unknown, vec![Level::Unknown]),
        ] {
            let a = readiness(&view(ram, &gpus, None)).answer(&ok());
            assert!(a.ok, "{ram:?} {gpus:?}: {a:?}");
            assert_eq!(a.body, "ready: guarding (mode enforce) and admitting\n");
        }
    }

    #[test]
    fn not_ready_while_draining_or_at_an_act_floor_and_the_body_says_which() {
        let a = readiness(&view(Level::Ok, &[Level::Ok], Some("host_maintenance"))).answer(&ok());
        assert!(!a.ok);
        assert_eq!(
            a.body,
            "not ready: draining for the cloud's host_maintenance notice: new launches and permits are refused\n"
        );
        let a = readiness(&view(Level::Act, &[Level::Ok], None)).answer(&ok());
        assert!(!a.ok);
        assert_eq!(
            a.body,
            "not ready: host RAM is at its act floor (ram.min_available)\n"
        );
        let a = readiness(&view(
            Level::Ok,
            &[Level::Act, Level::Warn, Level::Act],
            None,
        ))
        .answer(&ok());
        assert!(!a.ok);
        assert_eq!(
            a.body,
            "not ready: GPUs 0, 2 at the act floor (gpu.min_free)\n"
        );
        let a = readiness(&view(Level::Act, &[Level::Act], Some("preempted"))).answer(&ok());
        assert_eq!(
            a.body,
            "not ready: draining for the cloud's preempted notice: new launches and permits \
             are refused; host RAM is at its act floor (ram.min_available); GPU 0 at the act \
             floor (gpu.min_free)\n"
        );
    }

    #[test]
    fn a_loop_that_stopped_ticking_is_not_ready_whatever_its_last_view_said() {
        let t0 = Instant::now();
        let probes = Probes::new(t0);
        let ready = probes.ready(t0);
        assert!(!ready.ok);
        assert_eq!(ready.body, "not ready: starting, no tick yet\n");
        probes.ticked(t0 + S, S, &view(Level::Ok, &[], None));
        assert!(probes.ready(t0 + 2 * S).ok);
        assert!(probes.health(t0 + 2 * S).ok);
        let late = t0 + S + 9 * S;
        assert!(!probes.health(late).ok);
        let ready = probes.ready(late);
        assert!(!ready.ok);
        assert!(
            ready
                .body
                .starts_with("not ready: the loop has not ticked for 9.0s"),
            "{ready:?}"
        );
        // A longer daemon.interval allows a longer gap.
        probes.ticked(t0 + S, 10 * S, &view(Level::Ok, &[], None));
        assert!(probes.health(late).ok);
    }
}
