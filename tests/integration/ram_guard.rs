//! The RAM guard through the real binary, on real child processes: floors, budgets, observe
//! mode, throttling, reload, and never leaving a process frozen.
//!
//! Floors are set relative to the MemAvailable seen at the start of each test (about 1 GiB below
//! it), and hogs stop by themselves a little beyond, so the machine is never in danger.

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use crate::common::*;
use nix::sys::signal::Signal;

/// A config whose only candidates are the test's own processes (matched by token).
fn config(extra_daemon: &str, ram: &str, models: &[(&str, &str, &str)]) -> String {
    let mut text = format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\ncandidates = \"models\"\ninterval = \"500ms\"\nmin_interval = \"10ms\"\nscan_interval = \"200ms\"\nterm_grace = \"500ms\"\n{extra_daemon}\n[gpu]\nenabled = false\n\n[ram]\n{ram}\n"
    );
    text.push_str(&models_toml(models));
    text
}

#[test]
fn hog_below_the_floor_is_killed_and_the_sentinel_survives() {
    let _lock = memory_pressure_lock();
    let (hog_token, sentinel_token) = (token("hog"), token("sentinel"));
    let (floor, floors) = floors_below_now();
    let daemon = GuardDaemon::start(&config(
        "",
        &floors,
        &[("hog", &hog_token, ""), ("sentinel", &sentinel_token, "")],
    ));
    let mut sentinel = Hog::start(&sentinel_token, 0, 64, 60);
    // 1 GiB/s up to 2.5 GiB: crosses the floor about a second in; stops by itself if not killed.
    let mut hog = Hog::start(&hog_token, 1024, 2560, 30);

    let status = hog
        .wait(Duration::from_secs(30))
        .expect("the hog was not stopped");
    assert!(
        matches!(status.signal(), Some(15) | Some(9)),
        "hog should die of SIGTERM/SIGKILL, got {status:?}\n{}",
        daemon.log_text()
    );
    assert!(
        sentinel.alive(),
        "the sentinel must survive\n{}",
        daemon.log_text()
    );
    // The first action names the hog, the RAM floor and what was available below it.
    let first = daemon.wait_for_event("process_killed", Duration::from_secs(10), |e| {
        e["subject"]["model"] == "hog"
    });
    assert_eq!(first["action"]["verb"], "terminate", "{first}");
    assert_eq!(first["action"]["reason"], "ram_floor", "{first}");
    assert_eq!(first["action"]["outcome"], "done", "{first}");
    assert_eq!(first["subject"]["pid"], hog.pid(), "{first}");
    assert_eq!(first["subject"]["comm"], "python3", "{first}");
    assert_eq!(first["subject"]["resource"], "RAM", "{first}");
    assert_eq!(first["subject"]["floor_bytes"], floor, "{first}");
    assert!(
        first["subject"]["available_bytes"]
            .as_u64()
            .is_some_and(|a| a < floor),
        "{first}"
    );
    let (code, log, events) = daemon.stop_with_events();
    assert_eq!(code, Some(0));
    assert_eq!(verbs_on(&events, "sentinel"), Vec::<String>::new(), "{log}");
}

#[test]
fn model_over_ram_budget_is_stopped_then_resumed_when_budget_is_raised() {
    let hog_token = token("budget");
    let model = |budget: &str| {
        config(
            "",
            "",
            &[(
                "greedy",
                &hog_token,
                &format!("ram = \"{budget}\"\naction = \"stop\"\ngrace = \"300ms\""),
            )],
        )
    };
    let daemon = GuardDaemon::start(&model("100MiB"));
    let mut hog = Hog::start(&hog_token, 0, 256, 60);
    let pid = hog.pid();

    assert!(
        wait_stopped(&[pid], Duration::from_secs(10)),
        "not stopped:\n{}",
        daemon.log_text()
    );
    let record = std::fs::read_to_string(daemon.state_dir().join("stopped.json")).unwrap();
    assert!(
        record.contains(&format!("\"pid\": {pid}")),
        "stopped process recorded on disk: {record}"
    );
    daemon.wait_for_event("budget_exceeded", Duration::from_secs(1), |e| {
        e["subject"]["model"] == "greedy" && e["subject"]["budget_bytes"] == 100 * MIB
    });

    daemon.rewrite_config(&model("4GiB"));
    daemon.signal(Signal::SIGHUP);
    assert!(
        wait_until(Duration::from_secs(10), || matches!(
            proc_state(pid),
            Some('S' | 'R')
        )),
        "not resumed:\n{}",
        daemon.log_text()
    );
    daemon.wait_for_event("budget_cleared", Duration::from_secs(2), |e| {
        e["subject"]["model"] == "greedy"
    });
    assert!(hog.alive());
    let record = std::fs::read_to_string(daemon.state_dir().join("stopped.json")).unwrap();
    assert!(
        !record.contains(&format!("\"pid\": {pid}")),
        "resumed process removed from the record: {record}"
    );
}

#[test]
fn sigterm_resumes_stopped_processes_before_exit() {
    let hog_token = token("term");
    let daemon = GuardDaemon::start(&config(
        "",
        "",
        &[(
            "m",
            &hog_token,
            "ram = \"64MiB\"\naction = \"stop\"\ngrace = \"0s\"",
        )],
    ));
    let mut hog = Hog::start(&hog_token, 0, 128, 60);
    let pid = hog.pid();
    assert!(
        wait_stopped(&[pid], Duration::from_secs(10)),
        "{}",
        daemon.log_text()
    );
    let (code, log) = daemon.stop();
    assert_eq!(code, Some(0), "{log}");
    assert!(
        matches!(proc_state(pid), Some('S' | 'R')),
        "still stopped after the daemon exited:\n{log}"
    );
    assert!(hog.alive());
}

#[test]
fn daemon_killed_while_holding_a_process_resumes_it_on_restart() {
    let hog_token = token("crash");
    let text = config(
        "",
        "",
        &[(
            "m",
            &hog_token,
            "ram = \"64MiB\"\naction = \"stop\"\ngrace = \"0s\"",
        )],
    );
    let daemon = GuardDaemon::start(&text);
    let mut hog = Hog::start(&hog_token, 0, 128, 60);
    let pid = hog.pid();
    assert!(
        wait_stopped(&[pid], Duration::from_secs(10)),
        "{}",
        daemon.log_text()
    );

    // crash() has reaped the daemon: nothing is left to resume it.
    let dir = daemon.crash();
    assert_eq!(
        proc_state(pid),
        Some('T'),
        "a SIGKILLed daemon cannot resume anything itself"
    );

    // The restarted daemon no longer budgets this model: it must resume the leftover at start.
    let restarted = GuardDaemon::start_in(dir, &config("", "", &[]), &[]);
    assert!(
        wait_until(Duration::from_secs(5), || matches!(
            proc_state(pid),
            Some('S' | 'R')
        )),
        "{}",
        restarted.log_text()
    );
    restarted.wait_for_event("leftovers_undone", Duration::from_secs(2), |_| true);
    assert!(hog.alive());
}

#[test]
fn throttle_measurably_slows_a_growing_hog() {
    let _lock = memory_pressure_lock();
    // Unthrottled growth rate of the same hog, measured the same way.
    let free_rate = {
        let hog = Hog::start_chunked(&token("free"), 400, 600, 60, 4);
        growth_per_second(
            hog.pid(),
            Duration::from_millis(300),
            Duration::from_millis(800),
        )
    };
    let hog_token = token("throttled");
    let daemon = GuardDaemon::start(&config(
        "",
        "",
        &[(
            "t",
            &hog_token,
            "ram = \"32MiB\"\naction = \"throttle\"\ngrace = \"0s\"",
        )],
    ));
    let hog = Hog::start_chunked(&hog_token, 400, 1024, 60, 4);
    daemon.wait_for_event("process_throttled", Duration::from_secs(10), |e| {
        e["subject"]["model"] == "t" && e["subject"]["pid"] == hog.pid()
    });
    let throttled_rate = growth_per_second(hog.pid(), Duration::ZERO, Duration::from_millis(1500));
    assert!(
        free_rate > 100.0 * MIB as f64,
        "the free hog must grow (measured {free_rate} B/s)"
    );
    assert!(
        throttled_rate < free_rate * 0.5,
        "throttled growth {:.0} MiB/s is not well below free growth {:.0} MiB/s\n{}",
        throttled_rate / MIB as f64,
        free_rate / MIB as f64,
        daemon.log_text()
    );
    let (code, _) = daemon.stop();
    assert_eq!(code, Some(0));
    assert!(
        matches!(proc_state(hog.pid()), Some('S' | 'R')),
        "left stopped after the throttle ended"
    );
}

/// RSS growth of `pid` in bytes per second, measured over `over` after waiting `after`.
fn growth_per_second(pid: u32, after: Duration, over: Duration) -> f64 {
    std::thread::sleep(after);
    let start = rss_bytes(pid);
    std::thread::sleep(over);
    (rss_bytes(pid).saturating_sub(start)) as f64 / over.as_secs_f64()
}

#[test]
fn bad_reload_keeps_the_old_config_running() {
    let hog_token = token("reload");
    let good = config(
        "",
        "",
        &[(
            "m",
            &hog_token,
            "ram = \"64MiB\"\naction = \"stop\"\ngrace = \"0s\"",
        )],
    );
    let daemon = GuardDaemon::start(&good);
    daemon.rewrite_config(&good.replace("ram = \"64MiB\"", "ram = \"64 parsecs\""));
    daemon.signal(Signal::SIGHUP);
    // The failed reload is an event naming the key and the bad value.
    let failed = daemon.wait_for_event("config_reload_failed", Duration::from_secs(5), |_| true);
    assert!(
        failed["summary"]
            .as_str()
            .is_some_and(|s| s.contains("model[0] 'm'.ram: '64 parsecs' is not a size")),
        "{failed}"
    );
    // The old budget still acts.
    let hog = Hog::start(&hog_token, 0, 128, 60);
    assert!(
        wait_stopped(&[hog.pid()], Duration::from_secs(10)),
        "{}",
        daemon.log_text()
    );
}
