//! What `status` shows about each model beyond its budget: the model server's own limits (from
//! its metrics URL), which limit the model is at, and its processes one by one with the GPU
//! memory and weights files each holds.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::kinds::EngineState;
use crate::policy::ModelUsage;
use crate::sample::engine::{stale_after, EngineReading, Target};
use crate::snapshot::GpuStatus;
use crate::status::{EngineRow, ProcessGpu, ProcessRow};

use super::Daemon;

/// A KV cache this full is full (vLLM preempts or queues from here on).
const KV_FULL: f64 = 0.95;
/// A model holding this share of its GPUs has preallocated them.
const RESERVED: f64 = 0.9;

impl Daemon {
    /// Model name -> metrics URL for every model that has one: its `[[model]]`'s, else the one
    /// given at launch, with the model's processes (only their sockets are asked). Trusted: the
    /// config's, and root's launches.
    pub(super) fn engine_targets(&self) -> BTreeMap<String, Target> {
        let models = self.launches.models(&self.config);
        models
            .iter()
            .filter_map(|m| {
                let url = models.metrics_url(&m.name)?.to_string();
                let from_config = self
                    .config
                    .model(&m.name)
                    .is_some_and(|c| c.metrics_url.is_some());
                let by_root = m
                    .users
                    .as_ref()
                    .is_some_and(|u| u.iter().all(|u| u.uid == 0));
                let trusted = from_config || (self.config.model(&m.name).is_none() && by_root);
                let members = self
                    .state
                    .attribution
                    .models
                    .iter()
                    .find(|u| u.name == m.name)
                    .map(|u| u.members.clone())
                    .unwrap_or_default();
                Some((
                    m.name.clone(),
                    Target {
                        url,
                        trusted,
                        members,
                    },
                ))
            })
            .collect()
    }

    /// The latest scrape of each model's engine.
    pub(super) fn engine_rows(&self) -> BTreeMap<String, EngineRow> {
        let stale = stale_after(self.config.daemon.scan_interval);
        self.engines
            .readings()
            .into_iter()
            .map(|(model, r)| (model, engine_row(r, stale)))
            .collect()
    }

    /// The model's GPU memory over the total of the GPUs it holds memory on.
    pub(super) fn gpu_reserved_ratio(&self, m: &ModelUsage) -> Option<f64> {
        let gpus = &self.sampler.snapshot.gpus;
        if gpus.status != GpuStatus::Ok || m.gpu_bytes.is_empty() {
            return None;
        }
        let total: u64 = m
            .gpu_bytes
            .keys()
            .map(|i| gpus.devices.iter().find(|g| g.index == *i)?.total_bytes)
            .sum::<Option<u64>>()?;
        (total > 0).then(|| m.gpu_total_bytes() as f64 / total as f64)
    }

    /// The model's live processes: pid, role, RAM, GPU memory per GPU, mapped weights.
    pub(super) fn process_rows(&self, m: &ModelUsage) -> Vec<ProcessRow> {
        let s = &self.sampler.snapshot;
        let table = &s.processes.processes;
        let attribution = &self.state.attribution;
        let own = self
            .state
            .attribution
            .models
            .iter()
            .position(|u| u.name == m.name);
        m.members
            .iter()
            .filter_map(|&id| s.processes.get(id))
            .map(|p| {
                let parent_same = table
                    .iter()
                    .find(|q| q.pid == p.ppid)
                    .is_some_and(|q| attribution.model_of(q.id()) == own);
                let role = if self.launches.registered.contains_key(&p.id()) {
                    "launched"
                } else if parent_same {
                    "child"
                } else {
                    "matched"
                };
                ProcessRow {
                    pid: p.pid,
                    ppid: p.ppid,
                    comm: p.comm.clone(),
                    role: role.into(),
                    ram_bytes: p.ram_bytes(),
                    rss_bytes: p.rss_bytes,
                    gpus: s
                        .gpus
                        .devices
                        .iter()
                        .filter_map(|g| {
                            let bytes = *g.processes.get(&p.pid)?;
                            Some(ProcessGpu {
                                gpu: g.index,
                                bytes,
                            })
                        })
                        .collect(),
                    weights_files: s
                        .mapped_weights
                        .get(&p.pid)
                        .map(|files| files.iter().map(|f| f.path.clone()).collect())
                        .unwrap_or_default(),
                }
            })
            .collect()
    }
}

/// Which limit a model is at, in words: the engine's (KV cache full, requests queued) when it
/// reports one, else a GPU taken up front, which says nothing about load.
pub(super) fn describe_limit(reserved: Option<f64>, engine: Option<&EngineRow>) -> Option<String> {
    let percent = |r: f64| format!("{:.0}%", r * 100.0);
    if let Some(e) = engine.filter(|e| e.state == EngineState::Ok) {
        let kv = e.stats.kv_cache_usage;
        let waiting = e.stats.requests_waiting.unwrap_or(0);
        return match kv {
            Some(kv) if kv >= KV_FULL && waiting > 0 => Some(format!(
                "KV cache {}, {waiting} waiting: the engine is full",
                percent(kv)
            )),
            Some(kv) if kv >= KV_FULL => Some(format!("KV cache {}", percent(kv))),
            _ if waiting > 0 => Some(format!(
                "{waiting} waiting with KV cache {}: the engine's max-num-seqs or compute, not memory",
                kv.map_or("unknown".into(), percent)
            )),
            _ => None,
        };
    }
    reserved.filter(|r| *r >= RESERVED).map(|r| {
        format!(
            "GPU {} reserved (taken up front; give the model a metrics_url to see its load)",
            percent(r)
        )
    })
}

/// One engine reading as status shows it: `ok`, `stale` (its last answer older than `stale`:
/// the figures are kept, marked old), `error` or `pending`.
fn engine_row(r: EngineReading, stale: Duration) -> EngineRow {
    let age = r.at.map(|t| t.elapsed());
    let mut row = EngineRow {
        url: r.url,
        age_seconds: age.map(|a| a.as_secs_f64()),
        ..EngineRow::default()
    };
    match r.result {
        Ok(stats) if age.is_some_and(|a| a > stale) => {
            row.state = EngineState::Stale;
            row.error = Some(format!(
                "last answer {} ago",
                crate::units::fmt_duration(Duration::from_secs(age.unwrap_or_default().as_secs()))
            ));
            row.stats = stats;
        }
        Ok(stats) => {
            row.state = EngineState::Ok;
            row.stats = stats;
        }
        Err(e) => {
            row.state = if r.at.is_some() {
                EngineState::Error
            } else {
                EngineState::Pending
            };
            row.error = Some(e);
        }
    }
    row
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineStats;

    fn engine(kv: f64, running: u64, waiting: u64) -> EngineRow {
        EngineRow {
            state: EngineState::Ok,
            stats: EngineStats {
                kv_cache_usage: Some(kv),
                requests_running: Some(running),
                requests_waiting: Some(waiting),
                ..EngineStats::default()
            },
            ..EngineRow::default()
        }
    }

    /// Round three: a reading whose engine stopped answering showed as `ok` with its old figures.
    /// Older than `stale_after`, it is `stale`, figures kept and marked.
    #[test]
    fn an_old_reading_is_stale_not_ok() {
        let reading = |ago: Duration| EngineReading {
            url: "http://127.0.0.1:9/metrics".into(),
            at: std::time::Instant::now().checked_sub(ago),
            result: Ok(EngineStats {
                requests_running: Some(3),
                ..EngineStats::default()
            }),
        };
        let stale = stale_after(Duration::from_millis(200));
        let fresh = engine_row(reading(Duration::ZERO), stale);
        assert_eq!(fresh.state, "ok");
        let old = engine_row(reading(stale + Duration::from_secs(1)), stale);
        assert_eq!(old.state, "stale");
        assert_eq!(old.stats.requests_running, Some(3));
        assert!(old
            .error
            .as_deref()
            .is_some_and(|e| e.starts_with("last answer")));
    }

    #[test]
    fn says_which_limit_is_hit() {
        let cases = [
            (Some(0.95), None, Some("GPU 95% reserved (taken up front")),
            (Some(0.5), None, None),
            (Some(0.95), Some(engine(0.1, 1, 0)), None),
            (
                Some(0.95),
                Some(engine(1.0, 8, 24)),
                Some("KV cache 100%, 24 waiting: the engine is full"),
            ),
            (Some(0.95), Some(engine(0.97, 8, 0)), Some("KV cache 97%")),
            (
                None,
                Some(engine(0.3, 64, 5)),
                Some("5 waiting with KV cache 30%: the engine's max-num-seqs"),
            ),
        ];
        for (reserved, e, want) in cases {
            let got = describe_limit(reserved, e.as_ref());
            match want {
                Some(w) => assert!(
                    got.as_deref().is_some_and(|g| g.starts_with(w)),
                    "{got:?} / {w}"
                ),
                None => assert_eq!(got, None),
            }
        }
        let failed = EngineRow {
            state: EngineState::Error,
            ..EngineRow::default()
        };
        assert!(describe_limit(Some(0.95), Some(&failed))
            .unwrap()
            .starts_with("GPU 95%"));
    }
}
