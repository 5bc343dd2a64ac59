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
    // Survival counts only once the guard has looked again with the hog gone.
    daemon.next_tick_status();
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

/// A server whose workers forked after it loaded: `N` MiB touched, then `workers` children that
/// share those pages and sleep. Each process shows the whole of it as RSS; between them they hold
/// it once (PSS: a share each). In a process group of its own, killed with it when dropped.
struct Forked {
    leader: std::process::Child,
}

impl Forked {
    fn start(token: &str, mib: u64, workers: u32) -> Forked {
        use std::os::unix::process::CommandExt;
        let mut leader = std::process::Command::new(python3())
            .args([
                "-c",
                FORKED_PY,
                token,
                &mib.to_string(),
                &workers.to_string(),
            ])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        assert_eq!(first_line(&mut leader).trim(), "forked");
        Forked { leader }
    }

    /// The leader and its workers (the processes in its group).
    fn pids(&self) -> Vec<u32> {
        let group = self.leader.id();
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                    let fields: Vec<&str> = stat
                        .rsplit(')')
                        .next()
                        .unwrap_or("")
                        .split_whitespace()
                        .collect();
                    fields.get(2).and_then(|g| g.parse::<u32>().ok()) == Some(group)
                })
            })
            .collect()
    }
}

impl Drop for Forked {
    fn drop(&mut self) {
        // Only our own group: the leader we started and the workers it forked.
        let group = rustix::process::Pid::from_child(&self.leader);
        let _ = rustix::process::kill_process_group(group, rustix::process::Signal::CONT);
        let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
        let _ = self.leader.wait();
    }
}

/// Issue 24's ranking by what a kill frees, on the real kernel: a model of four processes with
/// 512 MiB of RSS each that share it (512 MiB between them, as forked workers do) against a
/// model holding more than 1 GiB of its own. Near the RAM floor the scan reads their PSS
/// (smaps_rollup; root's processes too), and the floor takes the second: by RSS the first
/// (2 GiB) would have gone, and freed half as much.
#[test]
fn forked_workers_are_ranked_by_what_killing_them_frees() {
    let _lock = memory_pressure_lock();
    let (forked_t, unique_t) = (token("forked"), token("unique"));
    let forked = Forked::start(&forked_t, 512, 3);
    let workers = forked.pids();
    assert_eq!(workers.len(), 4, "{workers:?}");
    // Floors below what is available with the workers loaded.
    let (floor, floors) = floors_below_now();
    let daemon = GuardDaemon::start(&config(
        "",
        &floors,
        &[("forked", &forked_t, ""), ("unique", &unique_t, "")],
    ));
    // 256 MiB/s through warn to under the act floor, whatever the machine gives back meanwhile.
    let mut unique = Hog::start_until_below(&unique_t, 256, floor - 256 * MIB, 3072, 60);
    let status = unique
        .wait(Duration::from_secs(60))
        .expect("the model that would free the most was not acted on");
    assert!(
        matches!(status.signal(), Some(15) | Some(9)),
        "{status:?}\n{}",
        daemon.log_text()
    );
    let first = daemon.wait_for_event("process_killed", Duration::from_secs(10), |_| true);
    assert_eq!(first["subject"]["model"], "unique", "{first}");
    // Acted on: the workers were never signalled, and all four are still there.
    assert_eq!(daemon.verbs_on("forked"), Vec::<String>::new());
    assert!(
        workers
            .iter()
            .all(|&pid| matches!(proc_state(pid), Some('S' | 'R'))),
        "{}",
        daemon.log_text()
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

/// A throttled process that shares its cgroup is duty-cycled by real signals: stopped and
/// continued in turn while throttled, running when the daemon stops. (How much the cycle slows
/// its growth is a rate over wall-clock windows: `bench/throttle.sh`.)
#[test]
fn throttle_stops_and_continues_a_real_process_and_never_leaves_it_stopped() {
    let _lock = memory_pressure_lock();
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
    let hog = Hog::start_chunked(&hog_token, 100, 256, 60, 4);
    daemon.wait_for_event("process_throttled", Duration::from_secs(10), |e| {
        e["subject"]["model"] == "t" && e["subject"]["pid"] == hog.pid()
    });
    // Seen stopped, then running again, then stopped again: a cycle, not one SIGSTOP.
    for want in ['T', 'R', 'T'] {
        let seen = |c: Option<char>| match want {
            'T' => c == Some('T'),
            _ => matches!(c, Some('S' | 'R')),
        };
        assert!(
            wait_until(Duration::from_secs(10), || seen(proc_state(hog.pid()))),
            "never seen {want} while throttled\n{}",
            daemon.log_text()
        );
    }
    let (code, _) = daemon.stop();
    assert_eq!(code, Some(0));
    assert!(
        matches!(proc_state(hog.pid()), Some('S' | 'R')),
        "left stopped after the throttle ended"
    );
}
