//! `gpuguard status` and `status --json` against the real daemon with the fake NVML, in a scenario
//! where every section has something to show: two GPUs, a model with budgets, usage and pids, a
//! model held stopped over its RAM budget (with the stop in the recent actions), a launch that
//! holds the launch lock (a lease) and one queued behind it; `status --model` for one model's
//! processes and for a model that is not there. What the per-process rows hold (roles, GPUs,
//! mapped weights) is tested in process (`daemon::tests::gpu`).

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::*;
use serde_json::Value;

fn launch(daemon: &GuardDaemon, model: &str, token: &str) -> KillOnDrop {
    KillOnDrop(
        Command::new(BIN)
            .args([
                "launch",
                "--model",
                model,
                "--gpu-mem",
                "2GiB",
                "--ram",
                "64MiB",
            ])
            .args(["--", python3(), "-c", "import time; time.sleep(600)", token])
            .env("GPUGUARD_SOCKET", daemon.socket())
            .env_remove("CUDA_VISIBLE_DEVICES")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

use crate::common::model_row as model;

#[test]
fn status_shows_every_section_consistent_with_the_scenario() {
    let (served_t, held_t) = (token("served"), token("held"));
    let served = Hog::start(&served_t, 0, 0, 600);
    let held = Hog::start(&held_t, 0, 64, 600);
    let fake = FakeNvml::new(&format!(
        "device 0 name=\"Fake A100\" uuid=GPU-aaaa total={} used={} util=40\ndevice 1 name=\"Fake A100\" uuid=GPU-bbbb total={} used={} util=0\nprocess 0 {} {}\n",
        16 * GIB,
        6 * GIB,
        16 * GIB,
        GIB,
        served.pid(),
        5 * GIB
    ));
    let config = format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\ncandidates = \"models\"\ninterval = \"200ms\"\nscan_interval = \"200ms\"\n\
         [ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n\
         [gpu]\nnvml_library = \"{}\"\nsample_timeout = \"500ms\"\nwarn_free = \"2GiB\"\nmin_free = \"1GiB\"\n\
         [launch]\nsocket = \"{{state_dir}}/gpuguard.sock\"\nsettle = \"60s\"\nmax_loading = 1\n\
         [[model]]\nname = \"served\"\nmatch = {{ cmdline = \"{served_t}\" }}\nram = \"1GiB\"\ngpu_memory = \"8GiB\"\n\
         [[model]]\nname = \"held\"\nmatch = {{ cmdline = \"{held_t}\" }}\nram = \"16MiB\"\naction = \"stop\"\ngrace = \"0s\"\n",
        FakeNvml::library()
    );
    let daemon = GuardDaemon::start_with_fake(&config, &fake);
    daemon.wait_gpus_on(Some(2), Duration::from_secs(5));
    assert!(
        wait_stopped(&[held.pid()], Duration::from_secs(10)),
        "the model over its RAM budget is not held stopped:\n{}",
        daemon.log_text()
    );
    let (loading_t, queued_t) = (token("loading"), token("queued"));
    let _loading = launch(&daemon, "loading", &loading_t);
    assert!(
        wait_until(Duration::from_secs(10), || daemon.status()["leases"]
            .as_array()
            .is_some_and(|l| !l.is_empty())),
        "no lease:\n{}",
        daemon.log_text()
    );
    let _queued = launch(&daemon, "queued", &queued_t);
    assert!(
        wait_until(Duration::from_secs(10), || daemon.status()["queue"]
            .as_array()
            .is_some_and(|q| !q.is_empty())),
        "nothing queued:\n{}",
        daemon.log_text()
    );
    // Wait for a scan that sees the served model's pid with its GPU memory.
    assert!(wait_until(Duration::from_secs(5), || {
        model(&daemon.status(), "served").is_some_and(|m| m["gpu_bytes"] == 5 * GIB)
    }));

    let r = daemon.status();
    assert_eq!(r["schema_version"], 2);
    assert_eq!(r["mode"], "enforce");
    assert!(r["hostname"].as_str().is_some_and(|h| !h.is_empty()));

    // Host memory: figures from /proc, floors at 0%.
    let m = &r["memory"];
    assert!(m["total_bytes"].as_u64().unwrap() > m["available_bytes"].as_u64().unwrap());
    assert_eq!(m["min_available_bytes"], 0);
    assert_eq!(m["level"], "ok");

    // GPUs as the fake NVML reports them, with their floors resolved.
    assert_eq!(r["gpu_protection"]["state"], "ok");
    let gpus = r["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 2);
    assert_eq!(gpus[0]["uuid"], "GPU-aaaa");
    assert_eq!(gpus[0]["name"], "Fake A100");
    assert_eq!(gpus[0]["total_bytes"], 16 * GIB);
    assert_eq!(gpus[0]["used_bytes"], 6 * GIB);
    assert_eq!(gpus[0]["free_bytes"], 10 * GIB);
    assert_eq!(gpus[0]["utilization_percent"], 40);
    assert_eq!(gpus[0]["warn_free_bytes"], 2 * GIB);
    assert_eq!(gpus[0]["min_free_bytes"], GIB);
    assert_eq!(gpus[1]["free_bytes"], 15 * GIB);

    // The served model: budget, used, headroom, pids.
    let s = model(&r, "served").expect("served model");
    assert_eq!(s["source"], "config");
    assert_eq!(s["pids"], serde_json::json!([served.pid()]));
    assert_eq!(s["gpu_bytes"], 5 * GIB);
    assert_eq!(s["gpu_budget_bytes"], 8 * GIB);
    assert_eq!(s["gpu_headroom_bytes"], 3 * GIB);
    assert_eq!(s["ram_budget_bytes"], GIB);
    let ram = s["ram_bytes"].as_i64().unwrap();
    assert!(ram > 0);
    assert_eq!(s["ram_headroom_bytes"].as_i64().unwrap(), GIB as i64 - ram);
    assert_eq!(s["state"], "ok");

    // The held model: stopped over budget, negative headroom, in `held` and the actions.
    let h = model(&r, "held").expect("held model");
    assert_eq!(h["state"], "stopped");
    assert!(h["ram_headroom_bytes"].as_i64().unwrap() < 0);
    let held_rows = r["held"].as_array().unwrap();
    assert!(
        held_rows
            .iter()
            .any(|row| row["pid"] == held.pid() && row["why"] == "stop"),
        "{held_rows:?}"
    );
    let actions = r["recent_actions"].as_array().unwrap();
    assert!(
        actions.iter().any(|a| a["verb"] == "stop"
            && a["reason_kind"] == "ram_budget"
            && a["outcome"] == "done"
            && a["target"]
                .as_str()
                .unwrap()
                .contains(&held.pid().to_string())),
        "{actions:?}"
    );

    // The launch lock: one loading lease, one queued behind it.
    let leases = r["leases"].as_array().unwrap();
    assert_eq!(leases.len(), 1, "{leases:?}");
    assert_eq!(leases[0]["model"], "loading");
    assert_eq!(leases[0]["state"], "loading");
    assert_eq!(leases[0]["gpu_bytes"], 2 * GIB);
    let queue = r["queue"].as_array().unwrap();
    assert_eq!(queue.len(), 1, "{queue:?}");
    assert_eq!(queue[0]["model"], "queued");
    assert_eq!(queue[0]["position"], 1);

    // The table shows the same.
    let out = Command::new(BIN)
        .args(["status", "--socket"])
        .arg(daemon.socket())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let table = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "Host memory: available",
        "GPUs: protection ok",
        "Fake A100",
        "served (config)",
        "GPU 3.0 GiB",
        &format!("{}", served.pid()),
        "Launch queue:",
        "lease ",
        "waiting for",
        "Held stopped by gpuguard:",
        &format!("pid {} (", held.pid()),
        "): stop",
        "Recent actions:",
        "stop model 'held'",
    ] {
        assert!(table.contains(needle), "{needle:?} missing from:\n{table}");
    }

    // One model and its processes one by one (`status --model`, JSON and table), and a model
    // that is not there (exit 1, naming the models there are).
    let status_model = |name: &str, json: bool| {
        let mut cmd = Command::new(BIN);
        cmd.args(["status", "--model", name, "--socket"])
            .arg(daemon.socket());
        if json {
            cmd.arg("--json");
        }
        cmd.output().unwrap()
    };
    let out = status_model("served", true);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let one: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(one["name"], "served", "{one}");
    let row = &one["processes"][0];
    assert_eq!(row["pid"], served.pid(), "{one}");
    assert_eq!(row["role"], "matched", "{one}");
    assert_eq!(
        row["gpus"],
        serde_json::json!([{"gpu": 0, "bytes": 5 * GIB}]),
        "{one}"
    );
    let out = status_model("served", false);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let table = String::from_utf8_lossy(&out.stdout);
    for needle in ["role", "matched", "GPU 0: 5.0 GiB"] {
        assert!(table.contains(needle), "{needle:?} missing from:\n{table}");
    }
    let out = status_model("nope", false);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no model 'nope' (models: ") && err.contains("served"),
        "{err}"
    );
    drop(held);
}

#[test]
fn status_without_a_daemon_says_so_with_exit_69() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["status", "--json", "--socket"])
        .arg(dir.path().join("none.sock"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(69));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("gpuguard: "), "{err}");
    assert!(out.stdout.is_empty());
}

/// Issue #10: with NVML unavailable a model's GPU use is unknown (null), not `0 B` with a full
/// headroom; and `--watch` into a pipe writes plain reports (JSON lines with --json), no escapes.
#[test]
fn without_nvml_model_gpu_use_is_unknown_and_watch_into_a_pipe_is_plain() {
    let t = token("nonvml");
    let _p = Hog::start(&t, 0, 0, 600);
    let config = format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\ncandidates = \"models\"\ninterval = \"200ms\"\nscan_interval = \"200ms\"\n\
         [gpu]\nnvml_library = \"{}\"\n\
         [[model]]\nname = \"m\"\nmatch = {{ cmdline = \"{t}\" }}\ngpu_memory = \"8GiB\"\n",
        FakeNvml::library()
    );
    // No FAKE_NVML_STATE: the fake answers "driver not loaded".
    let daemon = GuardDaemon::start(&config);
    daemon.wait_for_status(Duration::from_secs(10), |r| {
        r["gpu_protection"]["state"] == "unavailable"
    });
    assert!(wait_until(Duration::from_secs(10), || model(
        &daemon.status(),
        "m"
    )
    .is_some_and(|m| m["pids"]
        .as_array()
        .is_some_and(|p| !p.is_empty()))));
    let r = daemon.status();
    let m = model(&r, "m").unwrap();
    assert_eq!(m["gpu_bytes"], Value::Null, "{m}");
    assert_eq!(m["gpu_headroom_bytes"], Value::Null, "{m}");
    assert_eq!(m["gpu_budget_bytes"], 8 * GIB);

    let table = Command::new(BIN)
        .args(["status", "--socket"])
        .arg(daemon.socket())
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout).to_string();
    assert!(table.contains("?/8.0 GiB"), "{table}");
    assert!(!table.contains("0 B/8.0 GiB"), "{table}");

    let mut watch = Command::new(BIN)
        .args(["status", "--watch", "--json", "--socket"])
        .arg(daemon.socket())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(watch.stdout.take().unwrap()));
    for _ in 0..2 {
        let line = lines.next().unwrap().unwrap();
        assert!(!line.contains('\x1b'), "{line:?}");
        let report: Value = serde_json::from_str(&line).expect("one JSON report per line");
        assert_eq!(report["schema_version"], 2);
    }
    let _ = watch.kill();
    let _ = watch.wait();
}
