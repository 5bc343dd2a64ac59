//! GPU protection through the real binary and the real NVML code path (nvml-wrapper -> dlopen),
//! against the scripted fake libnvidia-ml.so.1 in tests/fake_nvml, on real child processes: what
//! only the real library and the real daemon show: a memory query that answers late (the
//! sampler thread's deadline), and the flight recorder of a real daemon read by `gpuguard
//! history` and `gpuguard replay`, then SIGKILLed mid-incident. Budgets, unknown memory, lost
//! GPUs, NVML unavailable then back, pid reuse, duplicate loads and Xid events are tested in
//! process (`daemon::tests::gpu`, `policy::tests`), how NVML's answers (an Xid through its event
//! wait among them) become readings against the fake library (`tests/nvml/sampler.rs`).

use std::io::Write;
use std::time::Duration;

use crate::common::*;

/// The GPU daemon config, `candidates = "models"` (only this test's processes).
fn gpu_config(gpu: &str, models: &[(&str, &str, &str)]) -> String {
    gpu_daemon_config("models", gpu, models)
}

/// Two 16 GiB GPUs; `used` per GPU in GiB; process lines appended.
fn two_gpus(used0: u64, used1: u64, processes: &[(u32, u32, &str)]) -> String {
    let mut s = format!(
        "device 0 name=\"Fake A100\" uuid=GPU-aaaa total={} used={} util=50\ndevice 1 name=\"Fake A100\" uuid=GPU-bbbb total={} used={} util=10\n",
        16 * GIB,
        used0 * GIB,
        16 * GIB,
        used1 * GIB
    );
    for (gpu, pid, bytes) in processes {
        s.push_str(&format!("process {gpu} {pid} {bytes}\n"));
    }
    s
}

#[test]
fn stale_gpu_samples_alert_but_never_kill() {
    let t = token("stale");
    let mut holder = Hog::idle(&t);
    let fake = FakeNvml::new(&two_gpus(1, 1, &[(0, holder.pid(), "8589934592")]));
    let daemon =
        GuardDaemon::start_with_fake(&gpu_config("min_free = \"2GiB\"", &[("s", &t, "")]), &fake);
    daemon.wait_gpus_on(None, Duration::from_secs(5));
    // NVML now answers late (1 s per memory query, deadline 300 ms) with GPU 0 nearly full.
    fake.set(&format!(
        "{}delay nvmlDeviceGetMemoryInfo_v2 1000\n",
        two_gpus(15, 1, &[(0, holder.pid(), "8589934592")])
    ));
    daemon.wait_for_event("not_acting_stale", Duration::from_secs(10), |_| true);
    // The guard has looked again since (its ticks go on while NVML is late).
    daemon.next_tick_status();
    assert_eq!(
        daemon.verbs_on("s"),
        Vec::<String>::new(),
        "{}",
        daemon.log_text()
    );
    assert!(
        holder.alive(),
        "a stale sample must not kill:\n{}",
        daemon.log_text()
    );
}

/// `gpuguard history` on what the flight recorder of a real daemon kept (issue 25): a model over
/// its GPU budget, stopped; `--at` prints the status as it was and `--since` draws it with the
/// action marked. The daemon is then killed (SIGKILL, mid-incident) and garbage lands at the end
/// of its segment: the history reads up to the damage with a warning, and the next start writes
/// a post-mortem event naming the action. Before that, `gpuguard replay` runs the records
/// through the policy with other configs.
#[test]
fn a_budget_incident_is_in_the_history_and_a_killed_daemon_gets_a_post_mortem() {
    let t = token("hist");
    let family = Family::start(&t);
    let (parent, child) = (family.parent.id(), family.child_pid);
    let fake = FakeNvml::new(&two_gpus(
        6,
        6,
        &[(0, parent, "5368709120"), (1, child, "5368709120")],
    ));
    let config = gpu_config(
        "",
        &[(
            "hist",
            &t,
            "gpu_memory = \"8GiB\"\naction = \"stop\"\ngrace = \"1s\"",
        )],
    );
    let daemon = GuardDaemon::start_with_fake(&config, &fake);
    assert!(
        wait_stopped(&[parent, child], Duration::from_secs(10)),
        "{}",
        daemon.log_text()
    );
    let dir = daemon.state_dir().join("history");
    let history = |args: &[&str]| {
        let out = std::process::Command::new(BIN)
            .arg("history")
            .arg("--dir")
            .arg(&dir)
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        (
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8(out.stderr).unwrap(),
        )
    };
    // Actions are synced as they are taken; the samples while held come every tick.
    assert!(
        wait_until(Duration::from_secs(10), || {
            let (records, _) = history(&["--json"]);
            records.contains("\"type\":\"action\"")
                && history(&["--at", "now", "--json"])
                    .0
                    .contains("\"stopped\"")
        }),
        "{}\n{}",
        history(&["--json"]).0,
        daemon.log_text()
    );
    let (at, _) = history(&["--at", "now", "--json"]);
    let status: serde_json::Value = serde_json::from_str(&at).unwrap();
    let model = status["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "hist")
        .unwrap()
        .clone();
    assert_eq!(model["state"], "stopped", "{model}");
    assert_eq!(model["gpu_bytes"], 10 * GIB, "{model}");
    assert_eq!(status["held"].as_array().unwrap().len(), 2, "{status}");
    let (table, _) = history(&["--at", "now"]);
    assert!(table.starts_with("as recorded at "), "{table}");
    assert!(table.contains("hist"), "{table}");
    let (chart, _) = history(&["--since", "10m ago"]);
    assert!(
        chart.contains("GPU 0 free") && chart.contains("GPU 1 free"),
        "{chart}"
    );
    assert!(chart.contains("action   stop"), "{chart}");
    assert!(
        chart.lines().any(|l| l.contains('*') && l.contains('#')),
        "the stretch with the action is marked: {chart}"
    );
    // One model: its use against its budget (10 GiB over 8: the bar is full, `!` at the budget).
    let (model_chart, _) = history(&["--since", "10m ago", "--model", "hist"]);
    assert!(model_chart.contains("model GPU used"), "{model_chart}");
    assert!(
        model_chart
            .lines()
            .any(|l| l.contains("10.0 GiB") && l.contains('!')),
        "{model_chart}"
    );
    let (model_csv, _) = history(&["--since", "10m ago", "--model", "hist", "--csv"]);
    let (gib10, gib8) = ((10 * GIB).to_string(), (8 * GIB).to_string());
    assert!(
        model_csv.lines().any(|l| {
            let f: Vec<&str> = l.split(',').collect();
            f[1..3] == ["hist", "stopped"] && f[5] == gib10 && f[6] == gib8
        }),
        "{model_csv}"
    );

    // What-if replay of the same records: with the config they were recorded with, the stop
    // is on both sides; with a higher budget it would not have happened; with a GPU floor above
    // the free memory (10 GiB of 16), the model would have been terminated or killed as well.
    let replay = |name: &str, config: &str| {
        let path = daemon.state_dir().join(name);
        let text = config.replace("{state_dir}", &daemon.state_dir().display().to_string());
        std::fs::write(&path, text).unwrap();
        let out = std::process::Command::new(BIN)
            .args(["replay", "--since", "10m ago", "--config"])
            .arg(&path)
            .arg("--dir")
            .arg(&dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let same = replay("same.toml", &config);
    assert!(
        same.contains("only with same.toml: none\nonly taken then: none\non both sides: 1\n"),
        "{same}"
    );
    let budget = replay(
        "budget.toml",
        &config.replace("gpu_memory = \"8GiB\"", "gpu_memory = \"16GiB\""),
    );
    assert!(
        budget.contains("only with budget.toml: none\nonly taken then: 1 stop\n"),
        "{budget}"
    );
    assert!(budget.contains("taken: stop model 'hist' pids"), "{budget}");
    let floor = replay(
        "floor.toml",
        &config.replace(
            "[gpu]\n",
            "[gpu]\nmin_free = \"12GiB\"\nwarn_free = \"13GiB\"\n",
        ),
    );
    assert!(
        floor.lines().any(|l| l.starts_with("only with floor.toml:")
            && (l.contains("kill") || l.contains("terminate"))),
        "{floor}"
    );
    assert!(floor.contains("would: "), "{floor}");
    assert!(floor.contains("min_free 12.0 GiB"), "{floor}");

    // Killed mid-incident; garbage at the end of its segment.
    let state = daemon.crash();
    let segment = std::fs::read_dir(state.path().join("state/history"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .max()
        .unwrap();
    let whole = std::fs::read(&segment).unwrap().len();
    std::fs::OpenOptions::new()
        .append(true)
        .open(&segment)
        .unwrap()
        .write_all(b"\x00\x00\x00\x10garbage after a crash")
        .unwrap();
    let dir = state.path().join("state/history");
    let out = std::process::Command::new(BIN)
        .args(["history", "--json", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let (records, warning) = (
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    );
    assert!(out.status.success(), "{warning}");
    assert!(
        warning.contains(&format!("at byte {whole}")) && warning.contains("read up to there"),
        "{warning}"
    );
    assert!(
        records.contains("\"type\":\"action\""),
        "kept before the damage"
    );

    let daemon = GuardDaemon::start_in_with_fake(state, &config, &fake);
    let post_mortem =
        daemon.wait_for_event("previous_run_unclean", Duration::from_secs(10), |_| true);
    let message = post_mortem["summary"]
        .as_str()
        .unwrap_or_else(|| panic!("{post_mortem}"));
    assert!(message.contains("ended without a clean stop"), "{message}");
    assert!(message.contains("did not reboot"), "{message}");
    assert!(message.contains("stop model 'hist' pids"), "{message}");
}
