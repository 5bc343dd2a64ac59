//! The model servers' own limits: each model with a metrics URL (its `[[model]] metrics_url`,
//! or `gpuguard launch --metrics-url`) has its Prometheus endpoint scraped on a thread of its
//! own, with timeouts, so the control loop never waits for an engine. vLLM's names are read:
//! KV-cache usage, requests running and waiting, preemptions, and the cache's size. What a vLLM server
//! was told on its command line is read in the core (`engine::EngineFlags`).
//!
//! An answer counts only from a socket of the model's own processes (`sample::own_sockets`):
//! another account's listener at the URL's addresses (a free port taken first, `[::1]` beside
//! a server bound to IPv4 only) is not asked, and the log and the reading say so.
//!
//! The loop hands over the targets and reads the latest readings under a lock that is never
//! held across a request.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::prometheus::{self, Sample};
use crate::engine::EngineStats;
use crate::sample::own_sockets::OwnSockets;
use crate::snapshot::ProcessId;

/// One request (connect, send, read) may take at most this long.
const TIMEOUT: Duration = Duration::from_secs(2);
/// The largest answer read (vLLM's, histograms included, is a few hundred KiB).
const MAX_BODY_BYTES: u64 = 2 << 20;

/// vLLM's families (`vllm:gpu_cache_usage_perc` was renamed `vllm:kv_cache_usage_perc` in 0.10).
const KV_USAGE: [&str; 2] = ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"];
const RUNNING: &str = "vllm:num_requests_running";
const WAITING: &str = "vllm:num_requests_waiting";
const PREEMPTIONS: &str = "vllm:num_preemptions_total";
const CACHE_INFO: &str = "vllm:cache_config_info";

/// Reads vLLM's metrics from a `/metrics` answer; an answer without any is an error.
pub fn stats_from_vllm(text: &str) -> Result<EngineStats, String> {
    let samples = prometheus::parse(text, |n| {
        KV_USAGE.contains(&n) || [RUNNING, WAITING, PREEMPTIONS, CACHE_INFO].contains(&n)
    });
    if samples.is_empty() {
        return Err(format!(
            "no vLLM metrics in the answer (looked for {RUNNING}, {WAITING}, {})",
            KV_USAGE[0]
        ));
    }
    let of = |name: &'static str| samples.iter().filter(move |s| s.name == name);
    let kv = KV_USAGE
        .iter()
        .find_map(|name| max(of(name)))
        .map(|u| u.clamp(0.0, 1.0));
    let info = of(CACHE_INFO).next();
    let info_number = |key: &str| info.and_then(|s| s.label(key)?.parse::<f64>().ok());
    Ok(EngineStats {
        kv_cache_usage: kv,
        requests_running: sum(of(RUNNING)),
        requests_waiting: sum(of(WAITING)),
        preemptions_total: sum(of(PREEMPTIONS)),
        kv_cache_blocks: info_number("num_gpu_blocks").and_then(count),
        block_size_tokens: info_number("block_size").and_then(count),
        gpu_memory_utilization: info_number("gpu_memory_utilization")
            .filter(|u| (0.0..=1.0).contains(u)),
    })
}

/// A count from an untrusted float: whole, finite, not negative.
fn count(v: f64) -> Option<u64> {
    (0.0..9.0e15).contains(&v).then_some(v.round() as u64)
}

/// Summed over the series (engines, models) of one family; `None` if there is none or one is
/// not a count.
fn sum<'a>(samples: impl Iterator<Item = &'a Sample>) -> Option<u64> {
    let counts: Option<Vec<u64>> = samples.map(|s| count(s.value)).collect();
    counts.filter(|c| !c.is_empty()).map(|c| c.iter().sum())
}

fn max<'a>(samples: impl Iterator<Item = &'a Sample>) -> Option<f64> {
    samples
        .map(|s| s.value)
        .filter(|v| v.is_finite())
        .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))
}

/// The latest scrape of one model's engine.
#[derive(Clone, Debug)]
pub struct EngineReading {
    pub url: String,
    /// When it was taken (`None`: not yet).
    pub at: Option<Instant>,
    pub result: Result<EngineStats, String>,
}

/// A model's engine to scrape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub url: String,
    /// The URL is the config's, or root launched the model: scraped apart from URLs other
    /// accounts gave, so that theirs (slow, or never answering) cannot leave it stale.
    pub trusted: bool,
    /// The model's processes (as the last scan found them): only their sockets are asked.
    pub members: Vec<ProcessId>,
}

#[derive(Default)]
struct Shared {
    /// Model name -> what to scrape.
    targets: BTreeMap<String, Target>,
    interval: Duration,
    readings: BTreeMap<String, EngineReading>,
    /// A thread per lane (trusted, others), started with the lane's first target.
    running: [bool; 2],
}

/// A reading older than this is stale (the engine stopped answering within its timeout, or its
/// lane is slow): status says so instead of showing old figures as current.
pub fn stale_after(interval: Duration) -> Duration {
    interval * 3 + TIMEOUT * 2
}

/// Scrapes every target every `interval` on its own thread (started with the first target).
#[derive(Clone, Default)]
pub struct EngineScraper {
    shared: Arc<Mutex<Shared>>,
}

impl EngineScraper {
    /// Sets the models to scrape and how often.
    pub fn set_targets(&self, targets: BTreeMap<String, Target>, interval: Duration) {
        let mut s = self.lock();
        if s.targets == targets && s.interval == interval {
            return;
        }
        s.readings
            .retain(|model, r| targets.get(model).is_some_and(|t| t.url == r.url));
        for (model, target) in &targets {
            s.readings
                .entry(model.clone())
                .or_insert_with(|| EngineReading {
                    url: target.url.clone(),
                    at: None,
                    result: Err("not scraped yet".into()),
                });
        }
        s.targets = targets;
        s.interval = interval.max(Duration::from_millis(100));
        for trusted in [true, false] {
            let lane = usize::from(!trusted);
            let wanted = s.targets.values().any(|t| t.trusted == trusted);
            if s.running[lane] || !wanted {
                continue;
            }
            s.running[lane] = true;
            let weak = Arc::downgrade(&self.shared);
            let spawned = std::thread::Builder::new()
                .name("engine-metrics".into())
                .spawn(move || scrape_loop(weak, trusted));
            if let Err(e) = spawned {
                s.running[lane] = false;
                tracing::warn!("engine metrics: cannot start a scraper thread: {e}");
            }
        }
    }

    /// The latest reading of each target.
    pub fn readings(&self) -> BTreeMap<String, EngineReading> {
        self.lock().readings.clone()
    }

    /// The models whose latest reading shows a preallocated KV cache.
    pub fn preallocated(&self) -> std::collections::BTreeSet<String> {
        self.lock()
            .readings
            .iter()
            .filter(|(_, r)| r.result.as_ref().is_ok_and(|s| s.kv_cache_blocks.is_some()))
            .map(|(model, _)| model.clone())
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Until the daemon drops the scraper: scrape every target of one lane (trusted or not), store,
/// sleep.
fn scrape_loop(shared: Weak<Mutex<Shared>>, trusted: bool) {
    let asker = OwnSockets::new(TIMEOUT, "/proc".into());
    // What was last logged of each model's URL: the sockets of others found there.
    let mut logged: BTreeMap<String, Vec<String>> = BTreeMap::new();
    loop {
        let Some(strong) = shared.upgrade() else {
            return;
        };
        let (targets, interval) = {
            let s = strong.lock().unwrap_or_else(|e| e.into_inner());
            let mine: Vec<(String, Target)> = s
                .targets
                .iter()
                .filter(|(_, t)| t.trusted == trusted)
                .map(|(m, t)| (m.clone(), t.clone()))
                .collect();
            (mine, s.interval)
        };
        drop(strong);
        logged.retain(|model, _| targets.iter().any(|(m, _)| m == model));
        for (model, target) in targets {
            let (result, ignored) = scrape(&asker, &target);
            if let Err(e) = &result {
                tracing::debug!("engine metrics of model '{model}' ({}): {e}", target.url);
            }
            if !ignored.is_empty() && logged.get(&model) != Some(&ignored) {
                tracing::warn!(
                    "engine metrics of model '{model}' ({}): {}: not the model's processes, not \
                     asked, their answers do not count",
                    target.url,
                    ignored.join(", ")
                );
            }
            logged.insert(model.clone(), ignored);
            let Some(strong) = shared.upgrade() else {
                return;
            };
            let mut s = strong.lock().unwrap_or_else(|e| e.into_inner());
            if s.targets.get(&model).is_some_and(|t| t.url == target.url) {
                s.readings.insert(
                    model,
                    EngineReading {
                        url: target.url,
                        at: Some(Instant::now()),
                        result,
                    },
                );
            }
        }
        std::thread::sleep(interval);
    }
}

/// One scrape of a target's own sockets: its figures, and the sockets of others found at its
/// URL (not asked).
fn scrape(asker: &OwnSockets, target: &Target) -> (Result<EngineStats, String>, Vec<String>) {
    let asked = asker.get(
        &target.url,
        || target.members.clone(),
        |response| {
            if !response.status().is_success() {
                return Err(format!("HTTP {}", response.status()));
            }
            crate::http::body_text(response, MAX_BODY_BYTES)
        },
    );
    (
        asked.answer.and_then(|text| stats_from_vllm(&text)),
        asked.ignored,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2.5-7B"} 8.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen2.5-7B"} 7.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen2.5-7B"} 24.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen2.5-7B"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen2.5-7B"} 1.0
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen2.5-7B"} 0.42
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="Qwen/Qwen2.5-7B"} 3.0
vllm:num_preemptions_created{engine="0",model_name="Qwen/Qwen2.5-7B"} 1.7e9
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",gpu_memory_utilization="0.95",num_gpu_blocks="27000",num_cpu_blocks="2048"} 1.0
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="Qwen/Qwen2.5-7B"} 12.0
"#;

    /// This test process, as a model's only member: the listeners it binds are its model's.
    fn me() -> Vec<ProcessId> {
        let pid = std::process::id() as i32;
        let stat = crate::sample::procfs::ProcReader::new("/proc")
            .stat(pid, None)
            .unwrap();
        vec![ProcessId {
            pid,
            start_time: stat.start_time,
        }]
    }

    /// Answers every request on `listener` with `body`.
    fn serve(listener: std::net::TcpListener, body: String) {
        use std::io::{Read, Write};
        std::thread::spawn(move || {
            for mut conn in listener.incoming().map_while(Result::ok) {
                let mut buf = [0u8; 1024];
                let _ = conn.read(&mut buf);
                let _ = write!(
                    conn,
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
    }

    /// Round four: a user listening on the port of root's model's metrics URL before its server
    /// (or on `[::1]` beside it) fed fake figures into status, the flight recorder and `plan`.
    /// Only a socket of the model's processes is asked: here the model (a child holding its
    /// listener) has none at the URL, and the test's own socket there is another's.
    #[test]
    fn a_socket_that_is_not_the_models_is_not_asked() {
        let model = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .stdin(std::process::Stdio::from(std::os::fd::OwnedFd::from(
                model.try_clone().unwrap(),
            )))
            .spawn()
            .unwrap();
        let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let squatted = squatter.local_addr().unwrap();
        serve(squatter, VLLM.replace("} 8.0", "} 999.0"));
        let real = model.local_addr().unwrap();
        serve(model, VLLM.into());
        let pid = child.id() as i32;
        let stat = crate::sample::procfs::ProcReader::new("/proc")
            .stat(pid, None)
            .unwrap();
        let members = vec![ProcessId {
            pid,
            start_time: stat.start_time,
        }];
        let asker = OwnSockets::new(TIMEOUT, "/proc".into());
        let target = |addr: std::net::SocketAddr| Target {
            url: format!("http://{addr}/metrics"),
            trusted: true,
            members: members.clone(),
        };
        let (result, ignored) = scrape(&asker, &target(squatted));
        let err = result.unwrap_err();
        assert!(err.contains("not asked"), "{err}");
        assert_eq!(ignored.len(), 1, "{ignored:?}");
        assert!(
            ignored[0].starts_with(&format!("{squatted} is uid ")),
            "{ignored:?}"
        );
        let (result, ignored) = scrape(&asker, &target(real));
        assert_eq!(result.unwrap().requests_running, Some(15));
        assert_eq!(ignored, Vec::<String>::new());
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// Round three: ten metrics URLs a user launched that accept and never answer made root's
    /// model's engine figures stale (one thread, 2 s each in turn) while status said `ok`. The
    /// config's and root's URLs are scraped on a lane of their own.
    #[test]
    fn urls_that_never_answer_do_not_hold_up_the_trusted_lane() {
        use std::io::{Read, Write};
        let hang = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let serve = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let serve_port = serve.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for mut conn in serve.incoming().map_while(Result::ok) {
                let mut buf = [0u8; 1024];
                let _ = conn.read(&mut buf);
                let body = VLLM;
                let _ = write!(
                    conn,
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        let hang_port = hang.local_addr().unwrap().port();
        let mut targets: BTreeMap<String, Target> = (0..10)
            .map(|i| {
                let url = format!("http://127.0.0.1:{hang_port}/m{i}");
                (
                    format!("a{i}"),
                    Target {
                        url,
                        trusted: false,
                        members: me(),
                    },
                )
            })
            .collect();
        let url = format!("http://127.0.0.1:{serve_port}/metrics");
        targets.insert(
            "zzz".into(),
            Target {
                url,
                trusted: true,
                members: me(),
            },
        );
        let scraper = EngineScraper::default();
        scraper.set_targets(targets, Duration::from_millis(100));
        // The trusted model's figures come while the hung ones still wait (20 s on one lane).
        let mut ok = false;
        for _ in 0..100 {
            let readings = scraper.readings();
            if readings["zzz"].result.is_ok() {
                ok = true;
                let hung = readings
                    .iter()
                    .filter(|(m, r)| *m != "zzz" && r.at.is_none());
                assert!(hung.count() >= 5, "the hung lane moved on: {readings:?}");
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(ok, "{:?}", scraper.readings());
        drop(hang);
    }

    /// Round three: 8 MiB answers grew the daemon by 100 MB. An answer over `MAX_BODY_BYTES` is
    /// an error, not read on.
    #[test]
    fn an_answer_over_the_limit_is_an_error() {
        use std::io::{Read, Write};
        let serve = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = serve.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for mut conn in serve.incoming().map_while(Result::ok) {
                let mut buf = [0u8; 1024];
                let _ = conn.read(&mut buf);
                let body = VLLM.repeat((MAX_BODY_BYTES as usize / VLLM.len()) + 2);
                let _ = write!(
                    conn,
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        let target = Target {
            url: format!("http://127.0.0.1:{port}/metrics"),
            trusted: true,
            members: me(),
        };
        let err = scrape(&OwnSockets::new(TIMEOUT, "/proc".into()), &target)
            .0
            .unwrap_err();
        assert!(err.starts_with("reading the answer"), "{err}");
    }

    #[test]
    fn reads_vllm_names_over_engines() {
        let s = stats_from_vllm(VLLM).unwrap();
        assert_eq!(s.requests_running, Some(15));
        assert_eq!(s.requests_waiting, Some(24));
        assert_eq!(s.kv_cache_usage, Some(1.0), "the fullest engine");
        assert_eq!(s.preemptions_total, Some(3));
        assert_eq!(s.kv_cache_blocks, Some(27000));
        assert_eq!(s.block_size_tokens, Some(16));
        assert_eq!(s.gpu_memory_utilization, Some(0.95));
    }

    #[test]
    fn older_names_and_missing_families() {
        let s = stats_from_vllm("vllm:gpu_cache_usage_perc 0.5\n").unwrap();
        assert_eq!(s.kv_cache_usage, Some(0.5));
        assert_eq!(s.requests_waiting, None, "not reported: unknown, not 0");
        let err = stats_from_vllm("python_gc_objects_collected_total 3\n").unwrap_err();
        assert!(err.contains("no vLLM metrics"), "{err}");
    }

    #[test]
    fn untrusted_values_do_not_become_counts() {
        let s = stats_from_vllm(
            "vllm:num_requests_waiting -4\nvllm:num_requests_running NaN\nvllm:kv_cache_usage_perc 7\n",
        )
        .unwrap();
        assert_eq!(s.requests_waiting, None);
        assert_eq!(s.requests_running, None);
        assert_eq!(s.kv_cache_usage, Some(1.0), "clamped");
    }
}
