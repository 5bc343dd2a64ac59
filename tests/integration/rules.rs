//! Issue 40, "rules that cannot swallow the host", through the real binary: a `[[model]]` of
//! everything root runs, with a budget that is always over, in a daemon in observe mode: what it
//! would do names none of pid 1, the daemon, the test that started it and that test's
//! ancestors; and `check-config --matches` on the real /proc. (Each exclusion, the warnings and
//! the zero budgets are pinned in process: `policy::tests::rules`, `config::tests`.)
//!
//! Safety: the one model here that matches processes the test did not start is in a daemon in
//! observe mode, which never signals; its floors are off.

use std::process::Command;
use std::time::Duration;

use crate::common::*;

/// The test process's ancestors, from its parent up to (not including) pid 1.
fn my_ancestors() -> Vec<i32> {
    let mut out = Vec::new();
    let mut pid = std::process::id() as i32;
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let ppid = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().nth(1))
            .and_then(|v| v.parse::<i32>().ok())
            .unwrap_or(0);
        if ppid <= 1 {
            return out;
        }
        out.push(ppid);
        pid = ppid;
    }
}

#[test]
fn a_model_of_everything_root_runs_never_names_init_the_guard_or_what_started_it() {
    require_root();
    // A root process of the test's own: the model takes it in.
    let mut member = Hog::idle(&token("rules-member"));
    let daemon = GuardDaemon::start(
        "[daemon]\nstate_dir = \"{state_dir}\"\nmode = \"observe\"\ninterval = \"200ms\"\n\
         min_interval = \"10ms\"\nscan_interval = \"200ms\"\n\
         [gpu]\nenabled = false\n\
         [ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n\
         [[model]]\nname = \"root\"\nmatch = { user = \"root\" }\nram = \"1MiB\"\n\
         action = \"kill\"\ngrace = \"0s\"\n",
    );
    let me = std::process::id() as i32;
    let mut never = vec![1, daemon.child.id() as i32, me];
    never.extend(my_ancestors());
    let member_pid = member.pid() as i32;
    let pids = |v: &serde_json::Value| -> Vec<i32> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|p| p.as_i64())
                    .map(|p| p as i32)
                    .collect()
            })
            .unwrap_or_default()
    };
    // What it would do to the model over its budget: the test's own root process, among others.
    let first = daemon.wait_for_event("process_killed", Duration::from_secs(30), |e| {
        e["subject"]["model"] == "root" && pids(&e["subject"]["pids"]).contains(&member_pid)
    });
    assert_eq!(first["action"]["outcome"], "observed", "{first}");
    assert_eq!(first["action"]["reason"], "ram_budget", "{first}");
    let report = daemon.wait_for_status(Duration::from_secs(10), |r| {
        model_row(r, "root").is_some_and(|m| pids(&m["pids"]).contains(&member_pid))
    });
    let members = pids(&model_row(&report, "root").unwrap()["pids"]);
    let (code, log, events) = daemon.stop_with_events();
    assert_eq!(code, Some(0), "{log}");
    let acted: Vec<serde_json::Value> = actions_on(&events, "root");
    assert!(!acted.is_empty());
    for event in &acted {
        assert_eq!(event["action"]["outcome"], "observed", "{event}");
        let named = pids(&event["subject"]["pids"]);
        let wrong: Vec<&i32> = named.iter().filter(|p| never.contains(p)).collect();
        assert!(
            wrong.is_empty(),
            "would act on {wrong:?} (never: {never:?}): {event}"
        );
    }
    let wrong: Vec<&i32> = members.iter().filter(|p| never.contains(p)).collect();
    assert!(wrong.is_empty(), "members {wrong:?} (never: {never:?})");
    assert!(member.alive(), "observe mode signals nothing");
}

/// `check-config --matches` on the real /proc: the test's own process in the row of the rule
/// that catches it by its token; a second rule that catches it too is told it is the first's;
/// a rule of everything root runs is told what it catches that no model takes in (pid 1 at
/// least). Without `--matches` the warnings come, the table does not.
#[test]
fn check_config_matches_shows_what_each_rule_catches_on_this_host() {
    require_root();
    let tok = token("rules-matches");
    let hog = Hog::idle(&tok);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "[daemon]\nmode = \"observe\"\n\
             [[model]]\nname = \"mine\"\nmatch = {{ cmdline = \"{tok}\" }}\n\
             [[model]]\nname = \"everything\"\nmatch = {{ user = \"root\" }}\n"
        ),
    )
    .unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(BIN).args(args).arg(&config).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stdout, stderr) = run(&["check-config", "--matches"]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.lines().all(|l| l.chars().count() <= 100), "{stdout}");
    // The row of `mine`: one process, the hog, by pid, name and user.
    let row = stdout
        .lines()
        .find(|l| l.contains("model[0] 'mine'"))
        .unwrap_or_else(|| panic!("no row for mine:\n{stdout}"));
    // Borders only: the cells are apart by runs of spaces, their words by one.
    let cells: Vec<&str> = row
        .trim_matches(|c: char| c == '│' || c.is_whitespace())
        .split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    assert_eq!(
        cells,
        [
            "model[0] 'mine'",
            "1",
            &format!("{} python3 root", hog.pid()),
            "-"
        ],
        "{stdout}"
    );
    assert!(stdout.contains("model[1] 'everything'"), "{stdout}");
    assert!(stdout.contains("[protect]"), "{stdout}");
    let overlap = format!(
        "model[1] 'everything': its match catches 1 process(es) that model[0] 'mine' caught \
         first, so they belong to that one (a process is the first matching [[model]]'s): pid {} \
         (python3)",
        hog.pid()
    );
    assert!(stderr.contains(&overlap), "{stderr}");
    assert!(
        stderr.contains("model[1] 'everything': its match catches ") && stderr.contains("pid 1 ("),
        "{stderr}"
    );
    assert!(stdout.contains("ok (2 model(s), mode observe)"), "{stdout}");

    let (code, stdout, stderr) = run(&["check-config"]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(!stdout.contains("model[0] 'mine'"), "{stdout}");
    assert!(stderr.contains(&overlap), "{stderr}");
}
