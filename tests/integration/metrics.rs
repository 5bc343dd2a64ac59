//! The Prometheus endpoint of the real daemon (fake NVML, real child processes): its output
//! passes `promtool check metrics`, and a real Prometheus server (Debian's `prometheus`, started
//! here on loopback, scraping every second) returns the expected values through its query API,
//! including after they change.
//!
//! Needs `prometheus` and `promtool` on the PATH (.ci/run installs Debian's `prometheus`): the
//! tests fail, not skip, without them.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::*;
use serde_json::Value;

/// A child that is killed when the test ends, however it ends.
fn gpus(used0_gib: u64) -> String {
    format!(
        "device 0 name=\"Fake A100\" uuid=GPU-aaaa total={} used={} util=25\ndevice 1 name=\"Fake A100\" uuid=GPU-bbbb total={} used={} util=0\n",
        16 * GIB,
        used0_gib * GIB,
        16 * GIB,
        GIB
    )
}

struct Setup {
    fake: FakeNvml,
    daemon: GuardDaemon,
    port: u16,
    held: Hog,
}

fn setup() -> Setup {
    let t = token("metrics-held");
    let held = Hog::start(&t, 0, 64, 600);
    let fake = FakeNvml::new(&gpus(6));
    let port = free_port();
    let config = format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\ncandidates = \"models\"\ninterval = \"200ms\"\nscan_interval = \"200ms\"\n\
         [ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n\
         [gpu]\nnvml_library = \"{}\"\nsample_timeout = \"500ms\"\nmin_free = \"1GiB\"\n\
         [metrics]\nlisten = \"127.0.0.1:{port}\"\n\
         [[model]]\nname = \"held\"\nmatch = {{ cmdline = \"{t}\" }}\nram = \"16MiB\"\ngpu_memory = \"4GiB\"\naction = \"stop\"\ngrace = \"0s\"\n",
        FakeNvml::library()
    );
    let daemon = GuardDaemon::start_with_fake(&config, &fake);
    daemon.wait_gpus_on(Some(2), Duration::from_secs(5));
    assert!(
        wait_until(Duration::from_secs(5), || get(&format!(
            "http://127.0.0.1:{port}/metrics"
        ))
        .is_some()),
        "no metrics on port {port}:\n{}",
        daemon.log_text()
    );
    assert!(
        wait_stopped(&[held.pid()], Duration::from_secs(10)),
        "{}",
        daemon.log_text()
    );
    Setup {
        fake,
        daemon,
        port,
        held,
    }
}

/// The value of the one sample of `name{labels}` in text-format output.
#[test]
fn metrics_pass_promtool_and_show_the_host() {
    let s = setup();
    let url = format!("http://127.0.0.1:{}/metrics", s.port);
    // Wait until the gauges include the stop of the held model.
    let mut text = String::new();
    assert!(
        wait_until(Duration::from_secs(5), || {
            text = get(&url).unwrap_or_default();
            // The counter moves at once, the gauges at their next refresh (every 250 ms).
            text.contains("gpuguard_actions_total{verb=\"stop\"")
                && text.contains("gpuguard_held_processes 1")
                && text.contains("gpuguard_gpu_memory_total_bytes{gpu=\"0\"")
        }),
        "{text}\n{}",
        s.daemon.log_text()
    );

    promtool_check(&text);

    let gpu0 = "{gpu=\"0\",uuid=\"GPU-aaaa\"}";
    assert_eq!(
        sample(&text, &format!("gpuguard_gpu_memory_total_bytes{gpu0}")),
        Some((16 * GIB) as f64)
    );
    assert_eq!(
        sample(&text, &format!("gpuguard_gpu_memory_used_bytes{gpu0}")),
        Some((6 * GIB) as f64)
    );
    assert_eq!(
        sample(&text, &format!("gpuguard_gpu_memory_free_bytes{gpu0}")),
        Some((10 * GIB) as f64)
    );
    assert_eq!(
        sample(&text, &format!("gpuguard_gpu_utilization_ratio{gpu0}")),
        Some(0.25)
    );
    assert_eq!(
        sample(
            &text,
            "gpuguard_gpu_memory_floor_bytes{gpu=\"0\",uuid=\"GPU-aaaa\",floor=\"min\"}"
        ),
        Some(GIB as f64)
    );
    assert!(sample(&text, "gpuguard_host_memory_available_bytes").unwrap() > 0.0);
    assert!(sample(&text, "gpuguard_swap_free_bytes").is_some());
    // Shmem (tmpfs, shared memory) from the host's /proc/meminfo.
    assert!(sample(&text, "gpuguard_host_memory_shmem_bytes").is_some());
    assert_eq!(
        sample(
            &text,
            "gpuguard_model_budget_bytes{model=\"held\",resource=\"ram\"}"
        ),
        Some((16 * MIB) as f64)
    );
    assert_eq!(
        sample(
            &text,
            "gpuguard_model_budget_bytes{model=\"held\",resource=\"gpu\"}"
        ),
        Some((4 * GIB) as f64)
    );
    assert!(
        sample(
            &text,
            "gpuguard_model_usage_bytes{model=\"held\",resource=\"ram\"}"
        )
        .unwrap()
            > (16 * MIB) as f64
    );
    assert_eq!(
        sample(&text, "gpuguard_model_processes{model=\"held\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            "gpuguard_actions_total{verb=\"stop\",reason=\"ram_budget\",outcome=\"done\"}"
        ),
        Some(1.0)
    );
    assert_eq!(sample(&text, "gpuguard_held_processes"), Some(1.0));
    assert_eq!(sample(&text, "gpuguard_launch_queue_length"), Some(0.0));
    assert_eq!(
        sample(&text, "gpuguard_nvml_state{state=\"ok\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "gpuguard_nvml_state{state=\"off\"}"),
        Some(0.0)
    );
    assert_eq!(
        sample(&text, "gpuguard_nvml_state{state=\"starting\"}"),
        Some(0.0),
        "every state status can report has its series"
    );
    assert!(sample(&text, "gpuguard_sample_duration_seconds_count").unwrap() >= 1.0);
    assert!(text.contains("# TYPE gpuguard_sample_duration_seconds histogram"));
    assert!(text.contains("gpuguard_sample_duration_seconds_bucket{le=\"+Inf\"}"));

    // Unknown paths and methods get proper answers.
    assert!(get(&format!("http://127.0.0.1:{}/nope", s.port)).is_none());
    drop(s.held);
}

/// Polls Prometheus's query API until `query` returns one sample equal to `want`.
fn wait_for_query(prom: u16, query: &str, want: f64, timeout: Duration) -> Result<(), String> {
    let url = format!(
        "http://127.0.0.1:{prom}/api/v1/query?query={}",
        query
            .bytes()
            .map(|b| if b.is_ascii_alphanumeric() || b == b'_' {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            })
            .collect::<String>()
    );
    let mut last = String::new();
    if wait_until(timeout, || {
        last = get(&url).unwrap_or_default();
        let Ok(v) = serde_json::from_str::<Value>(&last) else {
            return false;
        };
        v["status"] == "success"
            && v["data"]["result"].as_array().is_some_and(|r| {
                r.len() == 1
                    && r[0]["value"][1]
                        .as_str()
                        .and_then(|x| x.parse::<f64>().ok())
                        == Some(want)
            })
    }) {
        Ok(())
    } else {
        Err(format!("{query}: never {want}; last answer: {last}"))
    }
}

#[test]
fn a_real_prometheus_scrapes_the_daemon_and_answers_queries() {
    let s = setup();
    let dir = tempfile::tempdir().unwrap();
    let prom_port = free_port();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: gpuguard\n    static_configs:\n      - targets: ['127.0.0.1:{}']\n",
            s.port
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
    let _prometheus = KillOnDrop(
        Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("prometheus is needed for this test (apt-get install prometheus)"),
    );
    let prom_log =
        || std::fs::read_to_string(dir.path().join("prometheus.log")).unwrap_or_default();
    assert!(
        wait_until(Duration::from_secs(30), || get(&format!(
            "http://127.0.0.1:{prom_port}/-/ready"
        ))
        .is_some()),
        "prometheus never became ready:\n{}",
        prom_log()
    );

    let timeout = Duration::from_secs(20);
    wait_for_query(prom_port, "up{job=\"gpuguard\"}", 1.0, timeout)
        .unwrap_or_else(|e| panic!("{e}\n{}", prom_log()));
    wait_for_query(
        prom_port,
        "gpuguard_gpu_memory_free_bytes{gpu=\"0\",uuid=\"GPU-aaaa\"}",
        (10 * GIB) as f64,
        timeout,
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", prom_log()));
    wait_for_query(
        prom_port,
        "gpuguard_model_budget_bytes{model=\"held\",resource=\"gpu\"}",
        (4 * GIB) as f64,
        timeout,
    )
    .unwrap();
    wait_for_query(
        prom_port,
        "sum(gpuguard_actions_total{verb=\"stop\"})",
        1.0,
        timeout,
    )
    .unwrap();

    // GPU 0 fills up: Prometheus sees the new figure on a later scrape.
    s.fake.set(&gpus(12));
    wait_for_query(
        prom_port,
        "gpuguard_gpu_memory_free_bytes{gpu=\"0\"}",
        (4 * GIB) as f64,
        timeout,
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", s.daemon.log_text()));
    drop(s.held);
}

/// One GET on 127.0.0.1:`port`: the status code and the body (the probes answer 503 with a
/// body, which `get` takes for no answer).
fn probe(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body.to_string()))
}

/// Issue 43, through the real binary's HTTP endpoint on loopback (what a kubelet's probes and a
/// load balancer's health check read; the decisions are `metrics::probes`' tests): /healthz is
/// 200 while the loop ticks; /readyz is 503 naming the GPU while GPU 0 is at its act floor, 200
/// once it has room again; and with `GPUGUARD_WATCH_CONFIG` (`--watch-config`) a config
/// replaced on disk, with no signal, is reloaded (its mode shows in /readyz).
#[test]
fn healthz_and_readyz_answer_on_the_metrics_address_and_a_changed_config_reloads_unsignalled() {
    let fake = FakeNvml::new(&gpus(15));
    let port = free_port();
    let config = |mode: &str| {
        format!(
            "[daemon]\nstate_dir = \"{{state_dir}}\"\nmode = \"{mode}\"\ncandidates = \"models\"\n\
             interval = \"200ms\"\nscan_interval = \"200ms\"\n\
             [ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n\
             [gpu]\nnvml_library = \"{}\"\nsample_timeout = \"500ms\"\nmin_free = \"2GiB\"\n\
             [metrics]\nlisten = \"127.0.0.1:{port}\"\n",
            FakeNvml::library()
        )
    };
    let mut env = fake.env();
    env.push(("GPUGUARD_WATCH_CONFIG", "200ms".into()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let daemon = GuardDaemon::start_in(tempfile::tempdir().unwrap(), &config("enforce"), &env);
    let answer = |path: &str, code: u16, body: &str| {
        let mut last = None;
        let seen = wait_until(Duration::from_secs(10), || {
            last = probe(port, path);
            last.as_ref()
                .is_some_and(|(c, b)| *c == code && b.contains(body))
        });
        assert!(
            seen,
            "{path}: wanted {code} {body:?}, last {last:?}\n{}",
            daemon.log_text()
        );
    };
    answer("/healthz", 200, "ok: the loop ticked");
    answer(
        "/readyz",
        503,
        "not ready: GPU 0 at the act floor (gpu.min_free)",
    );
    // Live all along: the loop ticks at the floor.
    answer("/healthz", 200, "ok: the loop ticked");
    fake.set(&gpus(6));
    answer(
        "/readyz",
        200,
        "ready: guarding (mode enforce) and admitting",
    );

    daemon.rewrite_config(&config("observe"));
    answer(
        "/readyz",
        200,
        "ready: guarding (mode observe) and admitting",
    );
    daemon.wait_for_log(
        "changed on disk (--watch-config): reloading",
        Duration::from_secs(5),
    );
    let (code, log) = daemon.stop();
    assert_eq!(code, Some(0), "{log}");
}
