//! What the guard knows about a process is the truth, through the real binary on real processes:
//! a process that execs (keeping its name) is seen as what it has become (within one scan:
//! `sample::scan::tests::young_processes_see_exec_and_setuid_at_once`), and a
//! process whose main thread has exited while a worker thread holds the memory (the leader shows
//! state Z and rss 0 in /proc/PID/stat) is measured, held to its budget and killed. A change of
//! the real uid alone is reported by the kernel in process (`sample::proc_events`), read from
//! /proc/PID/status (`sample::procfs`) and followed by membership (`policy::tests`); choosing a
//! process at a floor is `daemon::tests`'s.

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::common::*;
use rustix::process::Signal;
use serde_json::Value;

/// A daemon config: fast scans, no GPU, nothing but the given models as candidates.
fn config(ram: &str, models: &str) -> String {
    format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\ncandidates = \"models\"\ninterval = \"200ms\"\n\
         scan_interval = \"200ms\"\nterm_grace = \"500ms\"\n[gpu]\nenabled = false\n[ram]\n{ram}\n{models}"
    )
}

/// The pids `status` lists for model `name`.
fn model_pids(daemon: &GuardDaemon, name: &str) -> Vec<i64> {
    let report = daemon.status();
    report["models"]
        .as_array()
        .and_then(|models| models.iter().find(|m| m["name"] == name))
        .and_then(|m| m["pids"].as_array())
        .map(|pids| pids.iter().filter_map(Value::as_i64).collect())
        .unwrap_or_default()
}

fn wait_for_member(daemon: &GuardDaemon, model: &str, pid: u32) {
    if !wait_until(Duration::from_secs(30), || {
        model_pids(daemon, model).contains(&(pid as i64))
    }) {
        panic!(
            "pid {pid} never listed in model '{model}': {}\n{}",
            daemon.status()["models"],
            daemon.log_text()
        );
    }
}

/// A python process that idles, and on SIGUSR1 runs `on_usr1` (python statements).
struct Idler(Child);

impl Idler {
    fn start(token: &str, on_usr1: &str) -> Idler {
        let code = format!(
            "import os, signal, sys, time\n\
             def on_usr1(*_):\n    {on_usr1}\n\
             signal.signal(signal.SIGUSR1, on_usr1)\n\
             print('ready', flush=True)\n\
             while True:\n    time.sleep(1)\n"
        );
        let mut child = Command::new(python3())
            .args(["-c", &code, token])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready");
        Idler(child)
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }

    fn signal(&self, sig: Signal) {
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(self.pid() as i32).unwrap(),
            sig,
        )
        .unwrap();
    }
}

impl Drop for Idler {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn models(pairs: &[(&str, &str)]) -> String {
    pairs
        .iter()
        .map(|(name, matcher)| format!("[[model]]\nname = \"{name}\"\nmatch = {{ {matcher} }}\n"))
        .collect()
}

#[test]
fn an_exec_that_keeps_the_name_moves_the_process_to_its_new_model() {
    let token = token("exec");
    let daemon = GuardDaemon::start(&config(
        "",
        &models(&[
            ("before", &format!("cmdline = \"{token}-before\"")),
            ("after", &format!("cmdline = \"{token}-after\"")),
        ]),
    ));
    // python3 execs python3: same name, same binary, same pid and start time; a new command line.
    let idler = Idler::start(
        &format!("{token}-before"),
        &format!(
            "os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(600)', '{token}-after'])"
        ),
    );
    wait_for_member(&daemon, "before", idler.pid());
    idler.signal(Signal::USR1);
    wait_for_member(&daemon, "after", idler.pid());
    assert!(!model_pids(&daemon, "before").contains(&(idler.pid() as i64)));
}

/// Compiles tests/helpers/zombie_leader.c into a temporary directory.
fn zombie_leader_binary() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let binary = dir.path().join("zombie_leader");
    let source = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/helpers/zombie_leader.c");
    let out = Command::new("cc")
        .args(["-O2", "-pthread", "-o"])
        .arg(&binary)
        .arg(source)
        .output()
        .expect("a C compiler is needed for this test (apt-get install gcc)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (dir, binary)
}

/// The zombie-leader process: `cap_mib` held by a worker thread after the main thread left.
struct ZombieLeader {
    child: Child,
    _dir: tempfile::TempDir,
}

impl ZombieLeader {
    fn start(token: &str, cap_mib: u64, stop_below: u64) -> ZombieLeader {
        let (dir, binary) = zombie_leader_binary();
        let child = Command::new(binary)
            .args([token, &cap_mib.to_string(), &stop_below.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        ZombieLeader { child, _dir: dir }
    }

    fn wait_full(&mut self) {
        let mut line = String::new();
        BufReader::new(self.child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "full");
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Checks the process hides the way this test is about.
    fn assert_hidden(&self) {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap();
        let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
        assert_eq!(
            (fields[0], fields[21]),
            ("Z", "0"),
            "state Z, rss 0: {stat}"
        );
    }
}

impl Drop for ZombieLeader {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_process_whose_leader_exited_is_measured_and_held_to_its_budget() {
    let token = token("zombie-budget");
    let mut hidden = ZombieLeader::start(&token, 256, 0);
    hidden.wait_full();
    hidden.assert_hidden();
    // Started only now: the daemon first sees the process with its leader already gone (no
    // command line on the leader, no memory on its stat).
    let daemon = GuardDaemon::start(&config(
        "",
        &format!(
            "{}ram = \"64MiB\"\naction = \"kill\"\ngrace = \"0s\"\n",
            models(&[("hidden", &format!("cmdline = \"{token}\""))])
        ),
    ));
    let status = wait_child(&mut hidden.child, Duration::from_secs(30))
        .unwrap_or_else(|| panic!("never acted on:\n{}", daemon.log_text()));
    assert!(
        matches!(status.signal(), Some(15) | Some(9)),
        "{status:?}\n{}",
        daemon.log_text()
    );
    let acted = daemon.wait_for_event("process_killed", Duration::from_secs(10), |e| {
        e["subject"]["model"] == "hidden"
    });
    assert_eq!(acted["action"]["reason"], "ram_budget", "{acted}");
    assert_eq!(acted["subject"]["pid"], hidden.pid(), "{acted}");
    assert_eq!(acted["subject"]["comm"], "zombie_leader", "{acted}");
}
