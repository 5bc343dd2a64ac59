//! GPU protection through the real binary and the real NVML code path (nvml-wrapper -> dlopen),
//! against the scripted fake libnvidia-ml.so.1 in tests/fake_nvml, on real child processes.

use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use crate::common::*;

const GIB_S: &str = "1073741824";

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
fn model_over_gpu_budget_summed_over_parent_and_child_is_stopped_after_grace() {
    let t = token("family");
    let family = Family::start(&t);
    let (parent, child) = (family.parent.id(), family.child_pid);
    let fake = FakeNvml::new(&two_gpus(
        6,
        6,
        &[(0, parent, "5368709120"), (1, child, "5368709120")],
    ));
    // 10 GiB over two GPUs in two processes against an 8 GiB budget.
    let daemon = GuardDaemon::start_with_fake(
        &gpu_config(
            "",
            &[(
                "fam",
                &t,
                "gpu_memory = \"8GiB\"\naction = \"stop\"\ngrace = \"2s\"",
            )],
        ),
        &fake,
    );
    let over = daemon.wait_for_event("budget_exceeded", Duration::from_secs(5), |e| {
        e["subject"]["model"] == "fam"
    });
    assert_eq!(over["subject"]["usage_bytes"], 10 * GIB, "{over}");
    assert_eq!(over["subject"]["budget_bytes"], 8 * GIB, "{over}");
    assert!(
        wait_stopped(&[parent, child], Duration::from_secs(5)),
        "{}",
        daemon.log_text()
    );
    // Stopped because its grace ran out (the grace itself is timed on the driven clock:
    // policy::tests::budget_*).
    let stop = daemon.wait_for_event("process_stopped", Duration::from_secs(5), |e| {
        e["subject"]["model"] == "fam"
    });
    assert!(
        stop["action"]["detail"]
            .as_str()
            .is_some_and(|d| d.ends_with("for longer than grace 2s")),
        "{over}\n{stop}"
    );

    // Back under budget (the child released memory): both resumed.
    fake.set(&two_gpus(6, 1, &[(0, parent, "5368709120")]));
    assert!(
        wait_resumed(&[parent, child], Duration::from_secs(5)),
        "{}",
        daemon.log_text()
    );
}

#[test]
fn unavailable_gpu_memory_never_leads_to_a_kill() {
    let t = token("na");
    let mut holder = Hog::idle(&t);
    let fake = FakeNvml::new(&two_gpus(15, 1, &[(0, holder.pid(), "NA")]));
    let daemon = GuardDaemon::start_with_fake(
        &gpu_config(
            "min_free = \"2GiB\"",
            &[(
                "na",
                &t,
                "gpu_memory = \"1GiB\"\naction = \"kill\"\ngrace = \"0s\"",
            )],
        ),
        &fake,
    );
    // GPU 0 is under its floor and its only holder's usage is unknown: nobody to act on.
    daemon.wait_for_event("no_victim", Duration::from_secs(5), |_| true);
    let report = daemon.next_tick_status();
    assert!(holder.alive(), "NA must not kill:\n{}", daemon.log_text());
    assert_eq!(
        daemon.events_of("budget_exceeded"),
        Vec::<serde_json::Value>::new(),
        "NA is unknown, not a usage"
    );
    assert_eq!(
        model_row(&report, "na").map(|m| &m["gpu_unknown"]),
        Some(&serde_json::json!(true)),
        "{report}"
    );
}

#[test]
fn gpu_lost_while_running_keeps_the_daemon_up_and_guarding_ram() {
    let _lock = memory_pressure_lock();
    let hog_t = token("lost-hog");
    let fake = FakeNvml::new(&two_gpus(1, 1, &[]));
    let available = mem_available();
    let min = available - GIB;
    let mut config = gpu_config("min_free = \"1GiB\"", &[("hog", &hog_t, "")]);
    config = config.replace(
        "min_available = \"0%\"\nwarn_available = \"0%\"",
        &format!(
            "min_available = {min}\nwarn_available = {}",
            min + 256 * MIB
        ),
    );
    let daemon = GuardDaemon::start_with_fake(&config, &fake);
    daemon.wait_gpus_on(Some(2), Duration::from_secs(5));

    fake.set(&format!("{}error * 15 gpu=1\n", two_gpus(1, 1, &[])));
    // GPU 1 is lost: protection degraded.
    daemon.wait_for_status(Duration::from_secs(5), |r| {
        r["gpu_protection"]["state"] == "degraded" && r["gpus"][1]["lost"] == true
    });
    let mut hog = Hog::start(&hog_t, 1024, 2560, 30);
    let status = hog
        .wait(Duration::from_secs(30))
        .unwrap_or_else(|| panic!("RAM hog not stopped:\n{}", daemon.log_text()));
    assert!(matches!(status.signal(), Some(15 | 9)), "{status:?}");
    let (code, log, events) = daemon.stop_with_events();
    assert_eq!(code, Some(0), "{log}");
    let first = actions_on(&events, "hog").into_iter().next();
    let first = first.unwrap_or_else(|| panic!("no action on the hog:\n{log}"));
    assert_eq!(first["action"]["reason"], "ram_floor", "{first}");
    assert_eq!(first["subject"]["pid"], hog.pid(), "{first}");
}

#[test]
fn no_libnvidia_ml_at_all_starts_and_guards_ram() {
    let t = token("nolib");
    let hog = Hog::start(&t, 0, 128, 60);
    let config = gpu_config(
        "",
        &[(
            "m",
            &t,
            "ram = \"64MiB\"\naction = \"stop\"\ngrace = \"0s\"",
        )],
    )
    .replace(&FakeNvml::library(), "/nonexistent/libnvidia-ml.so.1");
    let daemon = GuardDaemon::start(&config);
    daemon.wait_for_status(Duration::from_secs(5), |r| {
        r["gpu_protection"]["state"] == "unavailable"
            && r["gpu_protection"]["reason"]
                .as_str()
                .is_some_and(|why| why.contains("NVML library not loadable"))
    });
    assert!(
        wait_stopped(&[hog.pid()], Duration::from_secs(10)),
        "{}",
        daemon.log_text()
    );
}

#[test]
fn driver_appearing_later_is_picked_up_by_the_init_retry() {
    let fake = FakeNvml::new("");
    std::fs::remove_file(&fake.state).unwrap();
    let daemon = GuardDaemon::start_with_fake(&gpu_config("", &[]), &fake);
    daemon.wait_for_status(Duration::from_secs(5), |r| {
        r["gpu_protection"]["state"] == "unavailable"
            && r["gpu_protection"]["reason"]
                .as_str()
                .is_some_and(|why| why.contains("NVIDIA driver not loaded"))
    });
    fake.set(&two_gpus(1, 1, &[]));
    daemon.wait_gpus_on(Some(2), Duration::from_secs(5));
}

#[test]
fn injected_xid_shows_up_as_a_critical_event() {
    let fake = FakeNvml::new(&two_gpus(1, 1, &[]));
    let daemon = GuardDaemon::start_with_fake(&gpu_config("", &[]), &fake);
    daemon.wait_gpus_on(None, Duration::from_secs(5));
    fake.set(&format!("{}xid 1 79 id=7\n", two_gpus(1, 1, &[])));
    let xid = daemon.wait_for_event("xid_critical", Duration::from_secs(5), |_| true);
    assert_eq!(xid["severity"], "critical", "{xid}");
    assert_eq!(xid["subject"]["resource"], "GPU 1", "{xid}");
    // The guard has looked again since: still one.
    daemon.next_tick_status();
    assert_eq!(
        daemon.events_of("xid_critical").len(),
        1,
        "delivered once:\n{}",
        daemon.log_text()
    );
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

/// Round three (#24): NVML lists pids only. The victim's memory still listed under its pid after
/// it exited is stuck memory, but once the kernel gives that pid to a new process, what the driver
/// lists there is the new process's: the floor goes on to it (it stalled: the next holder was
/// never acted on while GPU memory stayed under the floor). The pid is really reused here.
#[test]
fn a_pid_reused_by_a_new_gpu_holder_is_acted_on_not_taken_for_stuck_memory() {
    let t = token("reuse");
    let mut victim = Hog::idle(&t);
    let pid = victim.pid();
    // GPU 0: 15 of 16 GiB used, 14 GiB of it under that pid, whoever has it.
    let fake = FakeNvml::new(&two_gpus(15, 1, &[(0, pid, "15032385536")]));
    let daemon = GuardDaemon::start_with_fake(
        &gpu_config("min_free = \"2GiB\"", &[("reuse", &t, "")]),
        &fake,
    );
    let status = victim
        .wait(Duration::from_secs(10))
        .expect("the first holder was not stopped");
    assert_eq!(status.signal(), Some(15), "{}", daemon.log_text());
    // Reaped, its pid is free: a new process of the same model gets it, and the driver's list
    // (the fake's) still shows 14 GiB under that pid.
    let mut next = Hog::idle_with_pid(&t, pid);
    let status = next
        .wait(Duration::from_secs(30))
        .expect("the new holder under the reused pid was never acted on");
    assert_eq!(status.signal(), Some(15), "{}", daemon.log_text());
    // Both terminations are in the event log (written by its own thread, maybe after the
    // signal).
    let terminated = || {
        daemon
            .events_of("process_killed")
            .into_iter()
            .filter(|e| e["subject"]["pid"] == pid)
            .count()
    };
    assert!(
        wait_until(Duration::from_secs(10), || terminated() == 2),
        "{}",
        daemon.log_text()
    );
}

#[test]
fn same_model_loaded_twice_on_one_gpu_is_reported_once() {
    let t = token("dup");
    // Two unrelated processes with the same command line.
    let (a, b) = (Hog::idle(&t), Hog::idle(&t));
    let fake = FakeNvml::new(&two_gpus(
        9,
        1,
        &[(0, a.pid(), "4294967296"), (0, b.pid(), "4294967296")],
    ));
    let daemon = GuardDaemon::start_with_fake(&gpu_config("", &[]), &fake);
    let dup = daemon.wait_for_event("duplicate_load", Duration::from_secs(5), |_| true);
    assert_eq!(dup["severity"], "warning", "{dup}");
    // The guard has looked again since: still reported once.
    daemon.next_tick_status();
    assert_eq!(daemon.events_of("duplicate_load").len(), 1, "reported once");
    let _ = GIB_S;
}

#[test]
fn driver_library_mismatch_is_a_state_not_a_crash() {
    let fake = FakeNvml::new(&format!("{}error nvmlInit_v2 18\n", two_gpus(1, 1, &[])));
    let daemon = GuardDaemon::start_with_fake(&gpu_config("", &[]), &fake);
    daemon.wait_for_status(Duration::from_secs(5), |r| {
        r["gpu_protection"]["state"] == "unavailable"
            && r["gpu_protection"]["reason"]
                .as_str()
                .is_some_and(|why| why.contains("NVML/driver version mismatch"))
    });
    // Once the mismatch is gone (reboot), the retry picks the GPUs up; the daemon never stopped.
    fake.set(&two_gpus(1, 1, &[]));
    daemon.wait_gpus_on(Some(2), Duration::from_secs(5));
    assert_eq!(
        daemon.events_of("gpu_unavailable").len(),
        1,
        "said once:
{}",
        daemon.log_text()
    );
    let (code, _) = daemon.stop();
    assert_eq!(code, Some(0));
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
