//! After SIGTERM at a floor, through the real binary on real processes: a victim that ignores
//! SIGTERM and keeps growing is SIGKILLed long before `term_grace` runs out (one that shuts down
//! gets one SIGTERM and its grace: `policy::tests`). And the daemon's own SIGTERM during its
//! startup stops it cleanly.
//!
//! Floors are about 1 GiB below the MemAvailable seen at the start of each test; the processes
//! stop by themselves a little beyond.

use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::common::*;

/// A python process that allocates 1 MiB every `delay_s` until MemAvailable is below
/// `stop_below` (then it holds), and does `on_term` on SIGTERM ("ignore" or "handle": stop
/// allocating, clean up for 2 s, exit 0). Small steps: an allocation under way when SIGTERM
/// comes is finished, and stays well under `term_max_growth`.
const GROWER_PY: &str = r#"
import signal, sys, time
token, stop_below, on_term, delay = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
terminated = False
def handler(*_):
    global terminated
    terminated = True
if on_term == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, handler)
def available():
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
chunks = []
while not terminated and available() > stop_below:
    chunks.append(b"\x01" * (1 << 20))
    time.sleep(delay)
if terminated:
    # A clean shutdown: flush, close, a little cleanup time; no new memory.
    time.sleep(2)
    sys.exit(0)
print("below", flush=True)
time.sleep(120)
"#;

fn grower(token: &str, stop_below: u64, on_term: &str, delay_s: f64) -> Child {
    Command::new(python3())
        .args(["-c", GROWER_PY, token])
        .args([stop_below.to_string(), on_term.into(), delay_s.to_string()])
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

/// `term_grace` long enough that only the victim's own growth can explain a SIGKILL in time.
fn config(floor: u64, token: &str, term_grace: &str) -> String {
    format!(
        "[daemon]\nstate_dir = \"{{state_dir}}\"\ncandidates = \"models\"\nterm_grace = \"{term_grace}\"\n\
         [gpu]\nenabled = false\n[ram]\nmin_available = {floor}\nwarn_available = {}\n\
         [[model]]\nname = \"grower\"\nmatch = {{ cmdline = \"{token}\" }}\n",
        floor + 256 * MIB
    )
}

#[test]
fn a_victim_that_ignores_sigterm_and_grows_is_killed_without_waiting_for_term_grace() {
    let _lock = memory_pressure_lock();
    let token = token("ignores-term");
    let floor = mem_available() - GIB;
    let daemon = GuardDaemon::start(&config(floor, &token, "10m"));
    // 1 MiB every 2 ms (a few hundred MiB/s), until 512 MiB below the floor.
    let mut hog = KillOnDrop(grower(&token, floor - 512 * MIB, "ignore", 0.002));
    let status = wait_child(&mut hog.0, Duration::from_secs(120))
        .unwrap_or_else(|| panic!("not killed:\n{}", daemon.log_text()));
    assert_eq!(
        status.signal(),
        Some(9),
        "{status:?}\n{}",
        daemon.log_text()
    );
    // SIGTERM first, then SIGKILL for the growth after it (the reason's detail says so).
    daemon.wait_for_event("process_killed", Duration::from_secs(10), |e| {
        e["subject"]["model"] == "grower" && e["action"]["verb"] == "kill"
    });
    let actions = daemon.actions_on("grower");
    let verbs = daemon.verbs_on("grower");
    assert_eq!(
        verbs.first().map(String::as_str),
        Some("terminate"),
        "{actions:#?}"
    );
    let kill = actions
        .iter()
        .find(|e| e["action"]["verb"] == "kill")
        .unwrap();
    assert_eq!(kill["action"]["reason"], "ram_floor", "{kill}");
    assert!(
        kill["action"]["detail"]
            .as_str()
            .is_some_and(|d| d.ends_with("after SIGTERM: it is not shutting down")),
        "{kill}"
    );
}

/// The daemon's own SIGTERM during startup (systemd stopping it as it starts, the package
/// test's host run): its handlers are in place before it logs anything, so the signal waits for
/// the loop, which stops cleanly (exit 0), instead of killing it half started (exit 143).
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
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
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
