//! Duplicate weights found by what processes map: a server started with `python3 server.py`
//! and two workers it starts with multiprocessing's `spawn` (command lines of their own:
//! `python3 -c 'from multiprocessing.spawn import spawn_main...' --multiprocessing-fork`) all
//! mmap the same weights file. The two on GPU 0 are reported once as the same weights loaded
//! twice; the one alone on GPU 1 (tensor-parallel-like) is not. `status --model` shows the
//! processes one by one.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::common::*;
use serde_json::Value;

const SERVER_PY: &str = r#"
import mmap, multiprocessing as mp, os, sys, time

def hold(path):
    f = open(path, "rb")
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    m[0]
    return f, m

def worker(path, ready):
    kept = hold(path)
    ready.put(os.getpid())
    time.sleep(600)

if __name__ == "__main__":
    path = sys.argv[1]
    kept = hold(path)
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    workers = [ctx.Process(target=worker, args=(path, ready)) for _ in range(2)]
    for w in workers:
        w.start()
    pids = sorted(ready.get(timeout=60) for _ in workers)
    print(os.getpid(), *pids, flush=True)
    time.sleep(600)
"#;

/// The server and its two workers; every one of them is killed on drop.
struct Server {
    child: Child,
    pids: Vec<u32>,
}

impl Server {
    fn start(dir: &std::path::Path, weights: &std::path::Path, token: &str) -> Server {
        let script = dir.join(format!("{token}.py"));
        std::fs::write(&script, SERVER_PY).unwrap();
        let mut child = Command::new(python3())
            .arg(&script)
            .arg(weights)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pids = first_line(&mut child)
            .split_whitespace()
            .map(|p| p.parse().unwrap())
            .collect();
        Server { child, pids }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        for &pid in &self.pids[1..] {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn status_model(daemon: &GuardDaemon, name: &str, json: bool) -> String {
    let mut cmd = Command::new(BIN);
    cmd.args(["status", "--model", name, "--socket"])
        .arg(daemon.socket());
    if json {
        cmd.arg("--json");
    }
    let out = cmd.output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn process(m: &Value, pid: u32) -> Option<&Value> {
    m["processes"].as_array()?.iter().find(|p| p["pid"] == pid)
}

#[test]
fn spawn_started_workers_mapping_the_same_weights_are_reported_once() {
    let dir = tempfile::tempdir().unwrap();
    let t = token("weights");
    let weights = dir.path().join("model.safetensors");
    std::fs::write(&weights, vec![7u8; 4 << 20]).unwrap();
    let server = Server::start(dir.path(), &weights, &t);
    let (main, w1, w2) = (server.pids[0], server.pids[1], server.pids[2]);
    let gpus = |w2_gpu: u32| {
        format!(
            "device 0 name=\"Fake A100\" total={} used={}\ndevice 1 name=\"Fake A100\" total={} used={}\n\
             process 0 {main} {}\nprocess 0 {w1} {}\nprocess {w2_gpu} {w2} {}\n",
            16 * GIB, 12 * GIB, 16 * GIB, 4 * GIB, GIB, 4 * GIB, 4 * GIB
        )
    };
    let fake = FakeNvml::new(&gpus(1));
    let config = format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\ncandidates = \"models\"\ninterval = \"200ms\"\nscan_interval = \"200ms\"\n\
         [ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n\
         [gpu]\nnvml_library = \"{}\"\n\
         [[model]]\nname = \"server\"\nmatch = {{ cmdline = \"{t}\" }}\n",
        FakeNvml::library()
    );
    let daemon = GuardDaemon::start_with_fake(&config, &fake);
    let weights_path = weights
        .canonicalize()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    daemon.wait_for_log(
        &format!(
            "GPU 0: 2 processes [{}, {}] of model 'server' map the same weights ({weights_path}, 4.0 MiB) and hold 5.0 GiB together",
            main.min(w1),
            main.max(w1)
        ),
        Duration::from_secs(20),
    );
    // The command-line rule could not have found them: the server and its workers are related
    // and their command lines differ.
    // (Still one duplicate_load on a tick that began after it.)
    daemon.next_tick_status();
    assert_eq!(
        daemon.events_of("duplicate_load").len(),
        1,
        "{}",
        daemon.log_text()
    );

    // Per process: the server matched, the workers its children, GPU per device, the file
    // (status is published now and then: wait for one from after the scan that reported them).
    let mut m = Value::Null;
    wait_until(Duration::from_secs(10), || {
        m = serde_json::from_str(&status_model(&daemon, "server", true)).unwrap();
        process(&m, w2)
            .is_some_and(|p| p["weights_files"].as_array().is_some_and(|f| !f.is_empty()))
            && process(&m, w1).is_some_and(|p| p["gpus"].as_array().is_some_and(|g| !g.is_empty()))
    });
    let row = |pid| process(&m, pid).unwrap_or_else(|| panic!("{pid} not in {m:#}"));
    assert_eq!(row(main)["role"], "matched");
    assert_eq!(row(w1)["role"], "child");
    assert_eq!(row(w1)["ppid"], main);
    assert_eq!(
        row(w1)["gpus"],
        serde_json::json!([{"gpu": 0, "bytes": 4 * GIB}])
    );
    assert_eq!(
        row(w2)["gpus"],
        serde_json::json!([{"gpu": 1, "bytes": 4 * GIB}])
    );
    assert_eq!(row(w2)["weights_files"], serde_json::json!([weights_path]));
    assert!(row(w1)["ram_bytes"].as_u64().unwrap() > 0);
    let table = status_model(&daemon, "server", false);
    for needle in [
        "role",
        "matched",
        "child",
        "GPU 0: 1.0 GiB",
        "GPU 1: 4.0 GiB",
        "model.safetensors",
    ] {
        assert!(table.contains(needle), "{needle:?} missing from:\n{table}");
    }

    // The third worker moves onto GPU 0 too: the group grows, and is still reported once.
    fake.set(&gpus(0));
    assert!(wait_until(Duration::from_secs(20), || {
        let m: Value = serde_json::from_str(&status_model(&daemon, "server", true)).unwrap();
        process(&m, w2).is_some_and(|p| p["gpus"][0]["gpu"] == 0)
    }));
    let reports = daemon.log_text().matches("map the same weights").count();
    assert_eq!(reports, 1, "{}", daemon.log_text());

    let out = Command::new(BIN)
        .args(["status", "--model", "nope", "--socket"])
        .arg(daemon.socket())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no model 'nope' (models: server)"));
}
