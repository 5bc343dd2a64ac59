//! Prometheus metrics: the families (prometheus-client), how the daemon loop updates them, and a
//! small HTTP server for `GET /metrics` on `[metrics] listen` (loopback), on its own thread.
//!
//! The loop only stores into atomics (and, for labelled families, takes a short lock that the
//! encoder shares): it never waits for a scrape. Units are in the names (`_bytes`, `_seconds`,
//! `_ratio`). A scraper that asks for OpenMetrics (Prometheus does) gets it as prometheus-client
//! writes it; anyone else gets the classic text format 0.0.4 (what `promtool check metrics`
//! reads).

use std::collections::{BTreeSet, HashSet};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Metric, Registry};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::kinds::{EventKind, LeaseState, Protection, Severity};
use crate::status::PermitPoolRow;
use crate::status::{GpuRow, MemoryStatus, ModelRow};
use crate::view::TickView;

type FGauge = Gauge<f64, AtomicU64>;

mod families;
pub mod probes;
mod serve;

pub use families::*;
pub use serve::serve;
use serve::to_text_format;

/// Every family gpuguard exports. Cloning shares the same metrics.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    gpu: GpuFamilies,
    host: HostFamilies,
    model: ModelFamilies,
    engine: EngineFamilies,
    counts: CountFamilies,
    loop_state: LoopFamilies,
    alerts: AlertFamilies,
    permits: PermitFamilies,
    seen: Arc<Mutex<Seen>>,
    /// What `/healthz` and `/readyz` answer from (`probes.rs`).
    pub probes: Arc<probes::Probes>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        // Registered in the order they are exported.
        let mut r = Registry::default();
        let build_info: Family<VersionLabels, Gauge> = register(
            &mut r,
            "gpuguard_build_info",
            "gpuguard's version (always 1)",
            Family::default(),
        );
        build_info
            .get_or_create(&VersionLabels {
                version: env!("CARGO_PKG_VERSION").into(),
            })
            .set(1);
        let gpu = GpuFamilies::register(&mut r);
        let host = HostFamilies::register(&mut r);
        let model = ModelFamilies::register(&mut r);
        let engine = EngineFamilies::register(&mut r);
        let counts = CountFamilies::register(&mut r);
        let loop_state = LoopFamilies::register(&mut r);
        // The values of `gpuguard_nvml_state{state}`: `GpuProtection::state` in the report.
        for state in Protection::ALL {
            loop_state
                .nvml_state
                .get_or_create(&StateLabels {
                    state: state.as_str().into(),
                })
                .set(0);
        }
        let alerts = AlertFamilies::register(&mut r);
        let permits = PermitFamilies::register(&mut r);
        Metrics {
            registry: Arc::new(r),
            gpu,
            host,
            model,
            engine,
            counts,
            loop_state,
            alerts,
            permits,
            seen: Arc::default(),
            probes: Arc::default(),
        }
    }

    /// Updates the gauges from the tick view (the daemon passes one now and then).
    pub fn update(&self, v: &TickView) {
        self.update_host(&v.ram);
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        self.update_gpus(&v.gpus, &mut seen);
        self.update_models(&v.models, &mut seen);
        self.update_engines(&v.models, &mut seen);
        drop(seen);
        self.update_loop(v);
        self.update_permits(&v.reservations.permits);
    }

    /// Host memory, swap, PSI and the RAM floors.
    fn update_host(&self, ram: &MemoryStatus) {
        let set = |g: &Gauge, v: Option<u64>| {
            if let Some(v) = v {
                g.set(v as i64);
            }
        };
        let m = &ram.host;
        set(&self.host.total, m.total_bytes);
        set(&self.host.available, m.available_bytes);
        set(&self.host.swap_total, m.swap_total_bytes);
        set(&self.host.swap_free, m.swap_free_bytes);
        set(&self.host.shmem, m.shmem_bytes);
        if let Some(p) = m.psi_some_avg10 {
            self.host.psi_some.set(p / 100.0);
        }
        for (floor, v) in [
            ("warn", ram.warn_available_bytes),
            ("min", ram.min_available_bytes),
        ] {
            let labels = FloorLabels {
                floor: floor.into(),
            };
            set_or_remove(&self.host.floor, &labels, v, |g, v| {
                g.set(v as i64);
            });
        }
    }

    /// Each GPU's memory, utilisation, lost flag and floors; a GPU gone loses its series.
    fn update_gpus(&self, gpus: &[GpuRow], seen: &mut Seen) {
        let labels_of = |g: &GpuRow| GpuLabels {
            gpu: g.index.to_string(),
            uuid: g.uuid.clone(),
        };
        let now: HashSet<GpuLabels> = gpus.iter().map(labels_of).collect();
        for g in gpus {
            let labels = labels_of(g);
            // A reading that failed is unknown: the series disappears rather than read 0.
            for (family, v) in [
                (&self.gpu.total, g.total_bytes),
                (&self.gpu.used, g.used_bytes),
                (&self.gpu.free, g.free_bytes),
            ] {
                set_or_remove(family, &labels, v.filter(|_| g.error.is_none()), |g, v| {
                    g.set(v as i64);
                });
            }
            self.gpu.lost.get_or_create(&labels).set(i64::from(g.lost));
            let utilization = g.utilization_percent.filter(|_| g.error.is_none());
            set_or_remove(&self.gpu.utilization, &labels, utilization, |g, u| {
                g.set(f64::from(u) / 100.0);
            });
            for (floor, v) in [("warn", g.warn_free_bytes), ("min", g.min_free_bytes)] {
                let labels = GpuFloorLabels {
                    gpu: labels.gpu.clone(),
                    uuid: labels.uuid.clone(),
                    floor: floor.into(),
                };
                set_or_remove(&self.gpu.floor, &labels, v, |g, v| {
                    g.set(v as i64);
                });
            }
        }
        for family in [
            &self.gpu.total,
            &self.gpu.used,
            &self.gpu.free,
            &self.gpu.lost,
        ] {
            for gone in seen.gpus.difference(&now) {
                family.remove(gone);
            }
        }
        let gpu_floors: HashSet<GpuFloorLabels> = now
            .iter()
            .flat_map(|g| {
                ["warn", "min"].map(|floor| GpuFloorLabels {
                    gpu: g.gpu.clone(),
                    uuid: g.uuid.clone(),
                    floor: floor.into(),
                })
            })
            .collect();
        retain(&self.gpu.utilization, &mut seen.gpus, now);
        retain(&self.gpu.floor, &mut seen.gpu_floors, gpu_floors);
    }

    /// Each model's use, budgets and process count; a model gone loses its series.
    fn update_models(&self, models: &[ModelRow], seen: &mut Seen) {
        let mut usage = HashSet::new();
        let mut budgets = HashSet::new();
        let mut names = HashSet::new();
        for model in models {
            let f = model;
            let ram = ModelLabels {
                model: model.name.clone(),
                resource: "ram".into(),
            };
            let gpu = ModelLabels {
                model: model.name.clone(),
                resource: "gpu".into(),
            };
            self.model.usage.get_or_create(&ram).set(f.ram_bytes as i64);
            // Unknown (no NVML): no series rather than a false 0.
            if let Some(used) = model.gpu_bytes {
                self.model.usage.get_or_create(&gpu).set(used as i64);
                usage.insert(gpu.clone());
            }
            for (labels, budget) in [(&ram, f.ram_budget_bytes), (&gpu, f.gpu_budget_bytes)] {
                if let Some(b) = budget {
                    self.model.budget.get_or_create(labels).set(b as i64);
                    budgets.insert(labels.clone());
                }
            }
            let name = NameLabels {
                model: model.name.clone(),
            };
            self.model
                .processes
                .get_or_create(&name)
                .set(model.pids.len() as i64);
            usage.insert(ram);
            names.insert(name);
        }
        retain(&self.model.usage, &mut seen.usage, usage);
        retain(&self.model.budget, &mut seen.budgets, budgets);
        retain(&self.model.processes, &mut seen.names, names);
    }

    /// The launch queue, the leases, the held processes and the GPU protection state.
    fn update_loop(&self, v: &TickView) {
        let r = &v.reservations;
        self.loop_state.queue_length.set(r.queue.len() as i64);
        for &state in LeaseState::ALL {
            self.loop_state
                .leases
                .get_or_create(&StateLabels {
                    state: state.as_str().into(),
                })
                .set(r.leases.iter().filter(|l| l.state == state).count() as i64);
        }
        self.loop_state.held.set(v.held.len() as i64);
        for &state in Protection::ALL {
            self.loop_state
                .nvml_state
                .get_or_create(&StateLabels {
                    state: state.as_str().into(),
                })
                .set(i64::from(v.gpu_protection.state == state));
        }
        self.loop_state
            .gpu_stale
            .set(i64::from(v.gpu_protection.stale));
        for notice in ["host_maintenance", "preempted"] {
            self.loop_state
                .cloud_notice
                .get_or_create(&StateLabels {
                    state: notice.into(),
                })
                .set(i64::from(v.cloud_notice == Some(notice)));
        }
    }

    fn update_permits(&self, permits: &[PermitPoolRow]) {
        let p = &self.permits;
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let mut names = HashSet::new();
        let mut reserved = HashSet::new();
        let mut quantiles = HashSet::new();
        for row in permits {
            let name = NameLabels {
                model: row.model.clone(),
            };
            p.held.get_or_create(&name).set(row.held as i64);
            p.waiting.get_or_create(&name).set(row.waiting as i64);
            names.insert(name);
            for (resource, bytes) in [
                ("gpu", row.reserved_gpu_bytes),
                ("ram", row.reserved_ram_bytes),
            ] {
                let labels = ModelLabels {
                    model: row.model.clone(),
                    resource: resource.into(),
                };
                p.reserved.get_or_create(&labels).set(bytes as i64);
                reserved.insert(labels);
            }
            for (outcome, total) in [
                ("granted", row.granted_total),
                ("refused", row.refused_total),
                ("expired", row.expired_total),
            ] {
                let labels = OutcomeLabels {
                    model: row.model.clone(),
                    outcome: outcome.into(),
                };
                // The table keeps totals; the counter moves by what is new since last time.
                let last = seen.permit_totals.entry(labels.clone()).or_default();
                p.outcomes
                    .get_or_create(&labels)
                    .inc_by(total.saturating_sub(*last));
                *last = (*last).max(total);
            }
            for (q, value) in [
                ("0.5", row.observed_gpu_bytes_p50),
                ("0.95", row.observed_gpu_bytes_p95),
            ] {
                let labels = QuantileLabels {
                    model: row.model.clone(),
                    quantile: q.into(),
                };
                set_or_remove(&p.observed, &labels, value, |g, v| {
                    g.set(v as i64);
                });
                if value.is_some() {
                    quantiles.insert(labels);
                }
            }
        }
        retain(&p.held, &mut seen.permit_names, names.clone());
        let mut previous = seen.permit_names_waiting.clone();
        retain(&p.waiting, &mut previous, names);
        seen.permit_names_waiting = previous;
        retain(&p.reserved, &mut seen.permit_reserved, reserved);
        retain(&p.observed, &mut seen.permit_quantiles, quantiles);
    }

    /// The model servers' own figures; a figure the engine did not give has no series.
    fn update_engines(&self, models: &[ModelRow], seen: &mut Seen) {
        let mut engines = HashSet::new();
        for model in models {
            let Some(e) = &model.engine else { continue };
            let labels = NameLabels {
                model: model.name.clone(),
            };
            let ok = e.state == crate::kinds::EngineState::Ok;
            self.engine.up.get_or_create(&labels).set(i64::from(ok));
            let keep = |v: Option<u64>| v.filter(|_| ok);
            set_or_remove(
                &self.engine.kv_usage,
                &labels,
                e.stats.kv_cache_usage.filter(|_| ok),
                |g, v| {
                    g.set(v);
                },
            );
            for (family, v) in [
                (&self.engine.running, keep(e.stats.requests_running)),
                (&self.engine.waiting, keep(e.stats.requests_waiting)),
                (&self.engine.preemptions, keep(e.stats.preemptions_total)),
                (
                    &self.engine.kv_tokens,
                    keep(e.stats.kv_cache_blocks)
                        .zip(e.stats.block_size_tokens)
                        .map(|(b, s)| b.saturating_mul(s)),
                ),
                (&self.engine.kv_planned_tokens, model.planned_kv_tokens),
            ] {
                // An engine's figures are its own: one past i64 is shown as the most there is,
                // not wrapped negative.
                set_or_remove(family, &labels, v, |g, v| {
                    g.set(i64::try_from(v).unwrap_or(i64::MAX));
                });
            }
            engines.insert(labels);
        }
        for gone in seen.engines.difference(&engines) {
            self.engine.kv_usage.remove(gone);
            self.engine.running.remove(gone);
            self.engine.waiting.remove(gone);
            self.engine.preemptions.remove(gone);
            self.engine.kv_tokens.remove(gone);
            self.engine.kv_planned_tokens.remove(gone);
        }
        retain(&self.engine.up, &mut seen.engines, engines);
    }

    pub fn observe_sample(&self, took: Duration) {
        self.loop_state.sample_duration.observe(took.as_secs_f64());
    }

    pub fn count_action(&self, verb: &str, reason: &str, outcome: &str) {
        self.counts
            .actions
            .get_or_create(&ActionLabels {
                verb: verb.into(),
                reason: reason.into(),
                outcome: outcome.into(),
            })
            .inc();
    }

    pub fn count_event(&self, kind: EventKind, severity: Severity) {
        self.counts
            .events
            .get_or_create(&EventLabels {
                kind: kind.as_str().into(),
                severity: severity.as_str().into(),
            })
            .inc();
    }

    /// Client-caused events the per-uid rate limit kept out.
    pub fn count_suppressed(&self, n: u64) {
        self.counts.events_suppressed.inc_by(n);
    }

    /// The counters of one alert sink (created at 0 so they show before the first alert).
    pub fn sink(&self, sink: &str, format: &str) -> SinkCounters {
        let labels = SinkLabels {
            sink: sink.into(),
            format: format.into(),
        };
        SinkCounters {
            sent: self.alerts.sent.get_or_create_owned(&labels),
            failed: self.alerts.failed.get_or_create_owned(&labels),
            dropped: self.alerts.dropped.get_or_create_owned(&labels),
        }
    }

    /// The OpenMetrics text, as prometheus-client writes it.
    pub fn openmetrics(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String");
        out
    }

    /// The classic Prometheus text format 0.0.4.
    pub fn text(&self) -> String {
        to_text_format(&self.openmetrics())
    }
}

/// Counters of one alert sink, shared with its worker thread.
#[derive(Clone, Debug, Default)]
pub struct SinkCounters {
    pub sent: Counter,
    pub failed: Counter,
    pub dropped: Counter,
}

/// Sets the series to `value`, or removes it when the value is unknown (a missing reading is
/// no series, never a 0).
fn set_or_remove<S, M, V>(
    family: &Family<S, M>,
    labels: &S,
    value: Option<V>,
    set: impl FnOnce(&M, V),
) where
    S: Clone + std::hash::Hash + Eq,
    M: Default,
{
    match value {
        Some(v) => set(&family.get_or_create(labels), v),
        None => {
            family.remove(labels);
        }
    }
}

/// Removes the series present last time whose labels are gone now, and remembers the new set.
fn retain<S, M>(family: &Family<S, M>, previous: &mut HashSet<S>, now: HashSet<S>)
where
    S: Clone + std::hash::Hash + Eq,
{
    for gone in previous.difference(&now) {
        family.remove(gone);
    }
    *previous = now;
}

/// The labelled series the last update set, to remove those that disappear (a GPU lost, a model
/// gone).
#[derive(Default)]
struct Seen {
    permit_names: HashSet<NameLabels>,
    permit_names_waiting: HashSet<NameLabels>,
    permit_reserved: HashSet<ModelLabels>,
    permit_quantiles: HashSet<QuantileLabels>,
    permit_totals: std::collections::HashMap<OutcomeLabels, u64>,
    gpus: HashSet<GpuLabels>,
    gpu_floors: HashSet<GpuFloorLabels>,
    usage: HashSet<ModelLabels>,
    budgets: HashSet<ModelLabels>,
    names: HashSet<NameLabels>,
    engines: HashSet<NameLabels>,
}

#[cfg(test)]
mod tests {
    use super::serve::*;
    use super::*;

    fn scrape(port: u16) -> String {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer
    }

    /// Red-team finding 8: any local user could hold every slot with connections that send
    /// nothing. Now the oldest of those makes room for a new one (which one goes is
    /// `a_full_table_closes_the_oldest_reader_never_one_being_answered`), and each is closed
    /// after `HEADER_TIMEOUT` anyway: every scrape is answered.
    #[test]
    fn idle_connections_holding_every_slot_do_not_keep_a_scrape_out() {
        let m = Metrics::new();
        m.count_action("kill", "ram_floor", "done");
        let io = crate::daemon::io::start().unwrap();
        let port = serve(std::net::TcpListener::bind("127.0.0.1:0").unwrap(), m, &io)
            .unwrap()
            .port();
        let idle: Vec<std::net::TcpStream> = (0..40)
            .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap())
            .collect();
        // Until the server has taken all 40: the 8 over the cap have closed the 8 oldest.
        let closed = |s: &std::net::TcpStream| {
            use std::io::Read;
            s.set_nonblocking(true).unwrap();
            matches!((&*s).read(&mut [0u8; 1]), Ok(0))
        };
        while idle.iter().filter(|s| closed(s)).count() < 40 - MAX_CONNECTIONS {
            std::thread::sleep(Duration::from_millis(1));
        }
        for _ in 0..3 {
            let answer = scrape(port);
            assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer:?}");
            assert!(answer.contains("gpuguard_actions_total"), "{answer}");
        }
        drop(idle);
    }

    #[test]
    fn a_connection_that_sends_no_request_is_closed_after_the_header_deadline() {
        use std::io::Read;
        let io = crate::daemon::io::start().unwrap();
        let port = serve(
            std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
            Metrics::new(),
            &io,
        )
        .unwrap()
        .port();
        // Before connecting: the server's deadline starts when it accepts, after this.
        let started = std::time::Instant::now();
        let mut idle = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        idle.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut buf = [0u8; 16];
        // Closed by the server (end of file), not answered, and not left open until the read
        // gives up (an error): the 10 s are a safety net, not a bound the test measures.
        let read = idle.read(&mut buf);
        assert!(matches!(read, Ok(0)), "{read:?}");
        // Not before its deadline.
        let took = started.elapsed();
        assert!(took >= HEADER_TIMEOUT, "{took:?}");
    }

    #[test]
    fn a_full_table_closes_the_oldest_reader_never_one_being_answered() {
        let mut slots = Slots::default();
        let (a, mut a_closed) = slots.take(2).unwrap();
        let (b, mut b_closed) = slots.take(2).unwrap();
        // a is being answered: b, the oldest still reading, makes room for c.
        *slots.open.get_mut(&a).unwrap() = None;
        let (c, _c_closed) = slots.take(2).unwrap();
        assert!(b_closed.try_recv().is_ok(), "b told to close");
        assert!(
            a_closed
                .try_recv()
                .is_err_and(|e| e == tokio::sync::oneshot::error::TryRecvError::Closed),
            "a was not told to close"
        );
        assert_eq!(slots.open.keys().copied().collect::<Vec<_>>(), vec![a, c]);
        assert!(!slots.open.contains_key(&b));
        // Both answering: a new connection finds no room.
        *slots.open.get_mut(&c).unwrap() = None;
        assert!(slots.take(2).is_none());
    }

    /// An engine reporting blocks and a block size whose product passes i64 shows the most a
    /// gauge holds, not a negative count; the planned figure sits beside it.
    #[test]
    fn engine_kv_tokens_never_wrap_negative() {
        use crate::status::EngineRow;
        let m = Metrics::new();
        let stats = crate::engine::EngineStats {
            kv_cache_blocks: Some(9_000_000_000_000_000),
            block_size_tokens: Some(9_000_000_000_000_000),
            ..Default::default()
        };
        let model = crate::status::ModelRow {
            name: "m".into(),
            engine: Some(EngineRow {
                state: crate::kinds::EngineState::Ok,
                stats,
                ..EngineRow::default()
            }),
            planned_kv_tokens: Some(476_000),
            ..Default::default()
        };
        m.update_engines(&[model], &mut Seen::default());
        let text = m.text();
        assert!(
            text.contains("gpuguard_engine_kv_cache_tokens{model=\"m\"} 9223372036854775807"),
            "{text}"
        );
        assert!(
            text.contains("gpuguard_engine_kv_cache_planned_tokens{model=\"m\"} 476000"),
            "{text}"
        );
    }

    #[test]
    fn text_format_names_counters_with_total_and_drops_eof() {
        let m = Metrics::new();
        m.count_action("kill", "ram_floor", "done");
        let text = m.text();
        assert!(
            text.contains("# TYPE gpuguard_actions_total counter"),
            "{text}"
        );
        assert!(text.contains(
            "gpuguard_actions_total{verb=\"kill\",reason=\"ram_floor\",outcome=\"done\"} 1"
        ));
        assert!(!text.contains("# EOF"));
        assert!(m.openmetrics().ends_with("# EOF\n"));
    }
}
