//! The RAM guard through the real binary, on real child processes: a floor's kill, throttling,
//! and never leaving a process frozen at exit. (Budgets, observe mode, reload and resuming what
//! a killed daemon left stopped run in process: `daemon::tests`.)
//!
//! Floors are set relative to the MemAvailable seen at the start of each test (about 1 GiB below
//! it), and hogs stop by themselves a little beyond, so the machine is never in danger.

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use crate::common::*;

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
