//! `gpuguard plan --gpu host` through the binary: this host's GPUs asked from the running daemon
//! over its socket, or read through NVML (the fake libnvidia-ml.so.1) when no daemon runs. The
//! plan's tables, JSON and bad input are tested in process (src/cli/plan/tests.rs).

use std::process::Command;

use crate::common::*;
use serde_json::Value;

fn fixture(name: &str) -> String {
    format!(
        "{}/tests/fixtures/plan/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn run(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = Command::new(BIN)
        .arg("plan")
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(args: &[&str], env: &[(&str, &str)]) -> Value {
    let (code, out, err) = run(&[args, &["--json"]].concat(), env);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).unwrap()
}

const TWO_CARDS: &str = "device 0 name=\"Fake L4\" total=24146608128 used=4294967296\ndevice 1 name=\"Fake L4\" total=24146608128 used=1073741824\n";

#[test]
fn this_host_read_through_nvml_when_no_daemon_runs() {
    let fake = FakeNvml::new(TWO_CARDS);
    let state = path(&fake.state);
    let dir = tempfile::tempdir().unwrap();
    let socket = path(&dir.path().join("none.sock"));
    let p = json(
        &[
            &fixture("llama-3-8b"),
            "--gpu",
            "host",
            "--socket",
            &socket,
            "--nvml-library",
            &FakeNvml::library(),
        ],
        &[("FAKE_NVML_STATE", &state)],
    );
    let o = &p["options"][0];
    assert_eq!(o["gpu"], "host: Fake L4");
    assert_eq!(o["live"], true);
    assert_eq!(o["gpu_total_bytes"], 24_146_608_128u64);
    // The tighter of the two: 22.5 GiB - 4 GiB used.
    assert_eq!(o["gpu_free_bytes"], 24_146_608_128u64 - (4 << 30));
}

#[test]
fn this_host_asked_from_the_running_daemon() {
    let fake = FakeNvml::new(TWO_CARDS);
    let config = format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\ncandidates = \"models\"\n[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n[gpu]\nnvml_library = \"{}\"\n",
        FakeNvml::library()
    );
    let daemon = GuardDaemon::start_with_fake(&config, &fake);
    daemon.wait_gpus_on(Some(2), std::time::Duration::from_secs(10));
    // No NVML for the CLI itself: the answer can only come from the daemon.
    let p = json(
        &[
            &fixture("mistral-7b-v0.1"),
            "--gpu",
            "host",
            "--socket",
            &path(&daemon.socket()),
            "--nvml-library",
            "/nonexistent/libnvidia-ml.so.1",
            "--max-model-len",
            "8192",
        ],
        &[],
    );
    let o = &p["options"][0];
    assert_eq!(o["gpu"], "host: Fake L4");
    assert_eq!(o["fits"], true);
    assert_eq!(p["recommended"], 0);
}
