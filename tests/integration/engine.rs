//! The model server's own limits in `status`: a fake engine (a small HTTP server on 127.0.0.1
//! speaking vLLM's metric names) whose KV cache and queue the daemon scrapes, shows in `status`,
//! `status --json`, `status --model` and its own metrics, and tells apart from "GPU 95%
//! reserved"; a metrics URL given at launch; a URL off loopback refused. The engine's listener
//! is held by the model's process (`FakeEngine::server`): the daemon asks only a model's own
//! sockets.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use serde_json::Value;

/// A fake vLLM `/metrics` endpoint. The body can be changed while it runs; `scrapes` counts the
/// requests answered; dropped, it stops answering.
struct FakeEngine {
    url: String,
    /// Its listener, for the model's process to hold (`server`).
    listener: TcpListener,
    body: Arc<Mutex<String>>,
    scrapes: Arc<AtomicU64>,
    stopped: Arc<AtomicBool>,
}

impl FakeEngine {
    fn start(body: String) -> FakeEngine {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let url = format!("http://{}/metrics", listener.local_addr().unwrap());
        let body = Arc::new(Mutex::new(body));
        let scrapes = Arc::new(AtomicU64::new(0));
        let stopped = Arc::new(AtomicBool::new(false));
        let (b, n, s) = (body.clone(), scrapes.clone(), stopped.clone());
        let held = listener.try_clone().unwrap();
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let Ok((mut stream, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                stream.set_nonblocking(false).unwrap();
                stream
                    .set_read_timeout(Some(Duration::from_secs(5)))
                    .unwrap();
                let mut request = Vec::new();
                let mut buf = [0u8; 1024];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(k) => request.extend_from_slice(&buf[..k]),
                    }
                }
                let text = b.lock().unwrap().clone();
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                    text.len()
                );
                n.fetch_add(1, Ordering::SeqCst);
            }
        });
        FakeEngine {
            url,
            listener: held,
            body,
            scrapes,
            stopped,
        }
    }

    fn set(&self, body: String) {
        *self.body.lock().unwrap() = body;
    }

    /// The model's server: a process (`command`) that holds the engine's listener (as its
    /// stdin), as a real server holds the socket it answers on.
    fn server(&self, mut command: Command) -> KillOnDrop {
        let socket = std::os::fd::OwnedFd::from(self.listener.try_clone().unwrap());
        KillOnDrop(command.stdin(Stdio::from(socket)).spawn().unwrap())
    }

    /// An idle process whose command line holds `token`, holding the listener.
    fn idle_server(&self, token: &str) -> KillOnDrop {
        let mut command = Command::new(python3());
        command
            .args(["-c", "import time; time.sleep(600)", token])
            .stdout(Stdio::null());
        self.server(command)
    }
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::Relaxed);
    }
}

/// vLLM's metrics as a vLLM 0.10 server writes them (one engine).
fn vllm(running: u32, waiting: u32, kv: f64, preemptions: u32) -> String {
    format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"Qwen/Qwen2.5-7B-Instruct\"}} {running}.0\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"Qwen/Qwen2.5-7B-Instruct\"}} {waiting}.0\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"Qwen/Qwen2.5-7B-Instruct\"}} {kv}\n\
         # TYPE vllm:num_preemptions counter\n\
         vllm:num_preemptions_total{{engine=\"0\",model_name=\"Qwen/Qwen2.5-7B-Instruct\"}} {preemptions}.0\n\
         # TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",gpu_memory_utilization=\"0.95\",num_gpu_blocks=\"27000\"}} 1.0\n\
         vllm:e2e_request_latency_seconds_bucket{{engine=\"0\",le=\"0.3\",model_name=\"Qwen/Qwen2.5-7B-Instruct\"}} 4.0\n"
    )
}

/// gpuguard's own metrics, served on 127.0.0.1:`port`.
fn metrics_at(port: u16) -> String {
    ureq::get(&format!("http://127.0.0.1:{port}/metrics"))
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap()
}

fn model(report: &Value, name: &str) -> Value {
    report["models"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m["name"] == name).cloned())
        .unwrap_or(Value::Null)
}

/// Waits until the model's engine row shows `running` requests from a scrape made after
/// `after` scrapes were answered (proof the daemon looked since the engine changed).
fn wait_engine(daemon: &GuardDaemon, engine: &FakeEngine, name: &str, running: u64) -> Value {
    let after = engine.scrapes.load(Ordering::SeqCst);
    let mut last = Value::Null;
    let seen = wait_until(Duration::from_secs(20), || {
        last = model(&daemon.status(), name);
        engine.scrapes.load(Ordering::SeqCst) > after
            && last["engine"]["requests_running"] == running
    });
    assert!(
        seen,
        "engine of '{name}' never showed {running} running: {last:#}\n{}",
        daemon.log_text()
    );
    last
}

#[test]
fn kv_cache_full_and_gpu_reserved_are_different_states() {
    let t = token("engine");
    let engine = FakeEngine::start(vllm(1, 0, 0.1, 0));
    let server = engine.idle_server(&t);
    // A vLLM-like server holding 95% of a 24 GiB card: 22.8 GiB.
    let held = 24 * GIB * 95 / 100;
    let fake = FakeNvml::new(&format!(
        "device 0 name=\"Fake L4\" total={} used={held}\nprocess 0 {} {held}\n",
        24 * GIB,
        server.0.id()
    ));
    let port = free_port();
    let config = format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\ncandidates = \"models\"\ninterval = \"200ms\"\nscan_interval = \"200ms\"\n\
         [ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n\
         [gpu]\nnvml_library = \"{}\"\n\
         [metrics]\nlisten = \"127.0.0.1:{port}\"\n\
         [[model]]\nname = \"qwen\"\nmatch = {{ cmdline = \"{t}\" }}\ngpu_memory = \"23GiB\"\nmetrics_url = \"{}\"\n",
        FakeNvml::library(),
        engine.url
    );
    let daemon = GuardDaemon::start_with_fake(&config, &fake);

    daemon.wait_gpus_on(Some(1), Duration::from_secs(10));
    assert!(wait_until(Duration::from_secs(10), || model(
        &daemon.status(),
        "qwen"
    )["gpu_bytes"]
        == held));

    // Concurrency 1: the engine is far from its limits; the GPU is 95% taken all the same.
    let m = wait_engine(&daemon, &engine, "qwen", 1);
    assert_eq!(m["gpu_bytes"], held);
    assert!(
        (m["gpu_reserved_ratio"].as_f64().unwrap() - 0.95).abs() < 1e-9,
        "{m:#}"
    );
    let e = &m["engine"];
    assert_eq!(e["state"], "ok");
    assert_eq!(e["url"], engine.url.as_str());
    assert_eq!(e["requests_waiting"], 0);
    assert_eq!(e["kv_cache_usage_ratio"], 0.1);
    assert_eq!(e["kv_cache_blocks"], 27000);
    assert_eq!(m["limit"], Value::Null, "not at any limit: {m:#}");

    // Concurrency 32: 8 running, 24 waiting, the KV cache full, 3 preemptions.
    engine.set(vllm(8, 24, 1.0, 3));
    let m = wait_engine(&daemon, &engine, "qwen", 8);
    assert_eq!(m["engine"]["requests_waiting"], 24);
    assert_eq!(m["engine"]["preemptions_total"], 3);
    assert_eq!(m["limit"], "KV cache 100%, 24 waiting: the engine is full");
    let table = Command::new(BIN)
        .args(["status", "--socket"])
        .arg(daemon.socket())
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    for needle in [
        "\n  qwen: engine KV 100% · 8 running · 24 waiting · 3 preempted\n",
        "\n  qwen: holds 95% of its GPUs\n",
        "\n  qwen: KV cache 100%, 24 waiting: the engine is full\n",
    ] {
        assert!(table.contains(needle), "{needle:?} missing from:\n{table}");
    }
    // gpuguard's own metrics carry the engine's figures (refreshed a moment after status).
    let scrape = || metrics_at(port);
    let mut metrics = String::new();
    wait_until(Duration::from_secs(10), || {
        metrics = scrape();
        metrics.contains("gpuguard_engine_requests_waiting{model=\"qwen\"} 24")
    });
    for series in [
        "gpuguard_engine_requests_waiting{model=\"qwen\"} 24",
        "gpuguard_engine_requests_running{model=\"qwen\"} 8",
        "gpuguard_engine_kv_cache_usage_ratio{model=\"qwen\"} 1",
        "gpuguard_engine_preemptions{model=\"qwen\"} 3",
        "gpuguard_engine_up{model=\"qwen\"} 1",
    ] {
        assert!(
            metrics.lines().any(|l| l.starts_with(series)),
            "{series} missing:\n{metrics}"
        );
    }
    promtool_check(&metrics);

    // The engine goes away: its row says so, and the limit falls back to what memory shows.
    drop(engine);
    let mut m = Value::Null;
    assert!(
        wait_until(Duration::from_secs(20), || {
            m = model(&daemon.status(), "qwen");
            m["engine"]["state"] == "error"
        }),
        "{m:#}"
    );
    assert!(
        m["engine"]["error"]
            .as_str()
            .unwrap()
            .contains("unreachable"),
        "{m:#}"
    );
    assert!(
        m["limit"].as_str().unwrap().starts_with("GPU 95% reserved"),
        "{m:#}"
    );
}

#[test]
fn a_metrics_url_and_planned_kv_cache_given_at_launch_are_used_and_one_off_loopback_is_refused() {
    let engine = FakeEngine::start(vllm(5, 2, 0.5, 0));
    let fake = FakeNvml::new(&format!(
        "device 0 name=\"Fake L4\" total={} used={}\n",
        24 * GIB,
        GIB
    ));
    let config = format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\ncandidates = \"models\"\ninterval = \"200ms\"\nscan_interval = \"200ms\"\n\
         [ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n\
         [gpu]\nnvml_library = \"{}\"\n\
         [launch]\nsocket = \"{{state_dir}}/gpuguard.sock\"\nsettle = \"60s\"\n",
        FakeNvml::library()
    );
    let daemon = GuardDaemon::start_with_fake(&config, &fake);
    daemon.wait_gpus_on(Some(1), Duration::from_secs(10));

    let refused = Command::new(BIN)
        .args([
            "launch",
            "--model",
            "far",
            "--gpu-mem",
            "1GiB",
            "--metrics-url",
            "http://10.1.2.3:8000/metrics",
            "--",
        ])
        .args([python3(), "-c", "print('never')"])
        .env("GPUGUARD_SOCKET", daemon.socket())
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2), "an invalid request");
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains("--metrics-url 'http://10.1.2.3:8000/metrics' must be on a loopback address"),
        "{err}"
    );
    assert!(!String::from_utf8_lossy(&refused.stdout).contains("never"));

    let t = token("launched-engine");
    let mut launch = Command::new(BIN);
    launch
        .args([
            "launch",
            "--model",
            "served",
            "--gpu-mem",
            "1GiB",
            "--metrics-url",
            &engine.url,
            "--planned-kv-tokens",
            "476000",
            "--",
        ])
        .args([python3(), "-c", "import time; time.sleep(600)", &t])
        .env("GPUGUARD_SOCKET", daemon.socket())
        .env_remove("CUDA_VISIBLE_DEVICES")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // It execs the server: the listener stays with the launched process.
    let _launch = engine.server(launch);
    let m = wait_engine(&daemon, &engine, "served", 5);
    assert_eq!(m["source"], "launch");
    assert_eq!(m["engine"]["requests_waiting"], 2);
    assert_eq!(
        m["limit"],
        "2 waiting with KV cache 50%: the engine's max-num-seqs or compute, not memory"
    );
    // What `gpuguard plan`'s launch line carries: the planned KV cache, beside the engine's.
    assert_eq!(m["planned_kv_tokens"], 476000, "{m:#}");
}

/// `gpuguard plan`'s answer as JSON, through the real binary, with `env` set.
fn plan_json(args: &[&str], env: &[(&str, &str)]) -> Value {
    let out = Command::new(BIN)
        .arg("plan")
        .args(args)
        .arg("--json")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// What the engine really got for its KV cache beside what was planned (issue 27): a model whose
/// `[[model]]` says `planned_kv_tokens = 476000` runs an engine that reports 27000 blocks of 16
/// tokens (432,000, 9.2 % fewer). `status --model` and the metrics show both, and `plan --gpu
/// host` for that model takes the overhead it was seen to take on this host instead of the
/// modelled one (a plan under another name still gets the model).
#[test]
fn the_engines_real_kv_cache_is_shown_beside_the_plan_and_teaches_plan_host() {
    let t = token("planned");
    let engine = FakeEngine::start(vllm(1, 0, 0.1, 0));
    let server = engine.idle_server(&t);
    let total = 81_559 * MIB;
    let held = 72 * GIB;
    let fake = FakeNvml::new(&format!(
        "device 0 name=\"NVIDIA H100 80GB HBM3\" total={total} used={held}\nprocess 0 {} {held}\n",
        server.0.id()
    ));
    let port = free_port();
    let config = format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\ncandidates = \"models\"\ninterval = \"200ms\"\nscan_interval = \"200ms\"\n\
         [ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n\
         [gpu]\nnvml_library = \"{}\"\n\
         [metrics]\nlisten = \"127.0.0.1:{port}\"\n\
         [history]\ninterval = \"200ms\"\n\
         [[model]]\nname = \"llama-3-8b\"\nmatch = {{ cmdline = \"{t}\" }}\ngpu_memory = \"79GiB\"\n\
         metrics_url = \"{}\"\nplanned_kv_tokens = 476000\n",
        FakeNvml::library(),
        engine.url
    );
    let daemon = GuardDaemon::start_with_fake(&config, &fake);
    daemon.wait_gpus_on(Some(1), Duration::from_secs(10));
    let m = wait_engine(&daemon, &engine, "llama-3-8b", 1);
    assert_eq!(
        (m["planned_kv_tokens"].clone(), m["gpu_count"].clone()),
        (476000.into(), 1.into()),
        "{m:#}"
    );
    assert_eq!(m["gpu_bytes"], held, "{m:#}");

    let out = Command::new(BIN)
        .args(["status", "--model", "llama-3-8b", "--socket"])
        .arg(daemon.socket())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(
            "KV cache: 27000 blocks of 16 tokens (432000 tokens; planned 476000, the engine has -9.2%)"
        ),
        "{text}"
    );
    let scrape = || metrics_at(port);
    let mut metrics = String::new();
    let both = [
        "gpuguard_engine_kv_cache_tokens{model=\"llama-3-8b\"} 432000",
        "gpuguard_engine_kv_cache_planned_tokens{model=\"llama-3-8b\"} 476000",
    ];
    assert!(
        wait_until(Duration::from_secs(10), || {
            metrics = scrape();
            both.iter().all(|s| metrics.lines().any(|l| l == *s))
        }),
        "{metrics}"
    );
    promtool_check(&metrics);

    // plan --gpu host for this model: the overhead seen here, 72 GiB less its 16,060,522,496
    // bytes of weights, 432,000 × 128 KiB of KV cache and the 640 MiB CUDA context.
    let fixture = format!(
        "{}/tests/fixtures/plan/llama-3-8b.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let socket = daemon.socket().to_string_lossy().into_owned();
    let here = |name: &str| {
        plan_json(
            &[
                &fixture, "--gpu", "host", "--socket", &socket, "--name", name,
            ],
            &[],
        )["options"][0]
            .clone()
    };
    let seen = here("llama-3-8b");
    let overhead = held - 16_060_522_496 - 432_000 * (128 << 10) - 640 * MIB;
    assert_eq!(seen["overhead_observed"], true, "{seen:#}");
    assert_eq!(seen["overhead_bytes"], overhead, "{seen:#}");
    let modelled = here("another");
    assert_eq!(modelled["overhead_observed"], false, "{modelled:#}");
    assert_ne!(modelled["kv_space_bytes"], seen["kv_space_bytes"]);
    assert!(
        seen["kv_space_bytes"].as_u64() < modelled["kv_space_bytes"].as_u64(),
        "seen {seen:#}\nmodelled {modelled:#}"
    );

    // Remembered: with no daemon to ask (another socket; the GPUs read through NVML), the
    // overhead comes from the flight recorder's newest sample of the model, with its time.
    let history = path(&daemon.state_dir().join("history"));
    let state = path(&fake.state);
    let from_history = |name: &str| {
        plan_json(
            &[
                &fixture,
                "--gpu",
                "host",
                "--name",
                name,
                "--socket",
                "/nonexistent/gpuguard.sock",
                "--history-dir",
                &history,
                "--nvml-library",
                &FakeNvml::library(),
            ],
            &[("FAKE_NVML_STATE", &state)],
        )
    };
    let mut remembered = Value::Null;
    assert!(
        wait_until(Duration::from_secs(10), || {
            remembered = from_history("llama-3-8b");
            remembered["options"][0]["overhead_observed"] == true
        }),
        "{remembered:#}"
    );
    assert_eq!(remembered["options"][0]["overhead_bytes"], overhead);
    assert!(
        remembered["observed_at_ms"].as_u64().is_some(),
        "{remembered:#}"
    );
    // Another model's name has nothing in the history: modelled.
    let other = from_history("another");
    assert_eq!(other["options"][0]["overhead_observed"], false, "{other:#}");
    assert!(other.get("observed_at_ms").is_none(), "{other:#}");
}
