//! The daemon's own SIGTERM during its startup stops it cleanly (a real signal to the real
//! binary). What it does to a victim after SIGTERM (one that grows is killed at once, one that
//! shuts down gets its grace) is tested in-process: `daemon::tests`, `policy::tests`.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::*;

#[test]
fn a_sigterm_during_startup_waits_for_the_loop_and_exits_cleanly() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "[daemon]\nstate_dir = \"{}\"\nmode = \"observe\"\n[gpu]\nenabled = false\n\
             [launch]\nsocket = \"{}\"\n",
            dir.path().join("state").display(),
            dir.path().join("gpuguard.sock").display()
        ),
    )
    .unwrap();
    let mut child = Command::new(BIN)
        .args(["daemon", "--lock-memory", "--config"])
        .arg(&config)
        .env("GPUGUARD_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    // Its first line ("memory locked", or why not) comes early in startup.
    let first = lines.next().unwrap().unwrap();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(child.id() as i32).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let rest = std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>());
    let status = wait_child(&mut child, Duration::from_secs(20)).expect("still running");
    let rest = rest.join().unwrap();
    assert_eq!(
        status.code(),
        Some(0),
        "{status:?}\n{first}\n{}",
        rest.join("\n")
    );
    assert!(
        rest.iter().any(|l| l.contains("gpuguard stopped")),
        "{first}\n{}",
        rest.join("\n")
    );
}
