//! The CLI through its binary: arguments -> exit code -> a piece of stderr/stdout (like earlyoom's
//! CLI table; the documented example config among them is valid), and systemd's notify protocol.

use std::process::Command;

use crate::common::BIN;

fn run(args: &[&str]) -> (i32, String) {
    // A daemon it starts enforces on a host of its own (not on /run/gpuguard/enforce.lock).
    let lock = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(args)
        .env("GPUGUARD_ENFORCE_LOCK", lock.path().join("enforce.lock"))
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn config_errors_exit_2_naming_file_key_and_value() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.to_string_lossy().into_owned()
    };
    let bad_size = write("bad_size.toml", "[ram]\nmin_available = \"12X\"\n");
    let typo = write("typo.toml", "[ram]\nmin_availble = \"1GiB\"\n");
    let bad_model = write(
        "bad_model.toml",
        "[[model]]\nname = \"qwen\"\ngpu_memory = \"12X\"\n",
    );
    let missing = dir
        .path()
        .join("missing.toml")
        .to_string_lossy()
        .into_owned();
    let good = write("good.toml", "[daemon]\nmode = \"observe\"\n");
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/config.example.toml");
    let exposed = write("exposed.toml", "[metrics]\nlisten = \"0.0.0.0:9835\"\n");
    // Issue 40: a budget of nothing with an action that acts.
    let zero = write(
        "zero.toml",
        "[[model]]\nname = \"qwen\"\nmatch = { user = \"root\" }\nram = \"0\"\naction = \"kill\"\n",
    );
    // Valid anywhere but above this host's MemTotal: both refuse it (what is checked:
    // daemon::tests::gpu, floors_that_cannot_be_right_*), `--portable` passes it.
    let above_host = write(
        "above_host.toml",
        &format!(
            "[daemon]\nstate_dir = \"{}\"\n[gpu]\nenabled = false\n[ram]\nmin_available = \"1PiB\"\nwarn_available = \"1PiB\"\n",
            dir.path().join("state").display()
        ),
    );
    let cases: Vec<(Vec<&str>, i32, String)> = vec![
        (
            vec!["check-config", &bad_size],
            2,
            format!("config {bad_size}: ram.min_available: '12X' is not a size"),
        ),
        (
            vec!["check-config", &typo],
            2,
            "unknown field `min_availble`".into(),
        ),
        (
            vec!["check-config", &bad_model],
            2,
            "model[0] 'qwen'.gpu_memory: '12X' is not a size".into(),
        ),
        (
            vec!["check-config", &missing],
            2,
            format!("config {missing}: cannot read"),
        ),
        (
            vec!["check-config", &good],
            0,
            "ok (0 model(s), mode observe)".into(),
        ),
        (
            vec!["check-config", example],
            0,
            format!("config {example}: ok ("),
        ),
        (
            vec!["check-config", &above_host],
            2,
            "ram.min_available: '1.0 PiB' (1.0 PiB) is at or above this host's MemTotal".into(),
        ),
        (
            vec!["check-config", "--portable", &above_host],
            0,
            "ok (0 model(s), mode enforce; portable: not checked against this host)".into(),
        ),
        (
            vec!["check-config", &exposed],
            0,
            "warning: metrics.listen '0.0.0.0:9835' is not a loopback address".into(),
        ),
        (
            vec!["check-config", &zero],
            2,
            format!("config {zero}: model[0] 'qwen'.ram: '0 B' with action 'kill' would act"),
        ),
        (
            vec!["daemon", "--config", &zero],
            2,
            "model[0] 'qwen'.ram: '0 B' with action 'kill'".into(),
        ),
        (
            vec!["daemon", "--config", &bad_size],
            2,
            "ram.min_available: '12X'".into(),
        ),
        (
            vec!["daemon", "--config", &above_host],
            2,
            "ram.min_available: '1.0 PiB' (1.0 PiB) is at or above this host's MemTotal".into(),
        ),
        (
            vec!["daemon", "--config", &missing],
            2,
            "cannot read".into(),
        ),
        (vec!["frobnicate"], 2, "unrecognized subcommand".into()),
    ];
    for (args, code, needle) in cases {
        let (got, text) = run(&args);
        assert_eq!(got, code, "{args:?}: {text}");
        assert!(
            text.contains(&needle),
            "{args:?}: {text:?} lacks {needle:?}"
        );
    }
}

/// Issue 40: what passed `check-config` and then stopped the daemon (with exit 1, which the
/// unit restarts every second, the host unguarded) is refused by both, with exit 2 and the key:
/// a webhook's missing secret file, a metrics address that can never be bound here, a user this
/// host does not know, a state directory others may write, a socket in a directory others may
/// write. `--portable` checks none of what depends on this host. (A metrics port another program
/// holds is not among them: `first_hour`.)
#[test]
fn host_config_errors_exit_2_from_check_config_and_the_daemon() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let state = dir.path().join(format!("{name}-state"));
        let p = dir.path().join(format!("{name}.toml"));
        let socket = match text.contains("[launch]") {
            true => String::new(),
            false => format!(
                "[launch]\nsocket = \"{}\"\n",
                dir.path().join(format!("{name}.sock")).display()
            ),
        };
        std::fs::write(
            &p,
            format!(
                "[daemon]\nstate_dir = \"{}\"\n[gpu]\nenabled = false\n{socket}{text}",
                state.display(),
            ),
        )
        .unwrap();
        p.to_string_lossy().into_owned()
    };
    let missing = dir.path().join("no-such-secret");
    let secret = write(
        "secret",
        &format!(
            "[[alert.webhook]]\nurl = \"http://127.0.0.1:9/hook\"\nsecret_file = \"{}\"\n",
            missing.display()
        ),
    );
    // TEST-NET-1: never an address of this host.
    let unbindable = write("port", "[metrics]\nlisten = \"192.0.2.1:9835\"\n");
    let open_sockets = tempfile::tempdir().unwrap();
    std::fs::set_permissions(open_sockets.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let open_socket = write(
        "socket",
        &format!(
            "[launch]\nsocket = \"{}\"\n",
            open_sockets.path().join("g.sock").display()
        ),
    );
    let user = write("user", "[protect]\nusers = [\"gpuguard-no-such-user\"]\n");
    let open_dir = write("open", "");
    let open_state = dir.path().join("open-state");
    std::fs::create_dir(&open_state).unwrap();
    std::fs::set_permissions(&open_state, std::fs::Permissions::from_mode(0o777)).unwrap();
    let cases = [
        (&secret, "alert.webhook[0].secret_file: secret_file '"),
        (
            &unbindable,
            "metrics.listen: '192.0.2.1:9835' cannot be bound",
        ),
        (&open_socket, "launch.socket: "),
        (&user, "'gpuguard-no-such-user' is not a known user"),
        (&open_dir, "daemon.state_dir: state directory"),
    ];
    for (config, needle) in cases {
        for command in ["check-config", "daemon"] {
            let args: Vec<&str> = match command {
                "daemon" => vec!["daemon", "--config", config],
                _ => vec!["check-config", config],
            };
            let (got, text) = run(&args);
            assert_eq!(got, 2, "{args:?}: {text}");
            assert!(text.contains(needle), "{args:?}: {text:?} lacks {needle:?}");
        }
        let (got, text) = run(&["check-config", "--portable", config]);
        assert_eq!(got, 0, "--portable {config}: {text}");
    }
}

/// The daemon speaks systemd's notify protocol: READY, STATUS, watchdog pings, STOPPING.
#[test]
fn daemon_notifies_systemd_ready_status_and_watchdog() {
    use std::os::unix::net::UnixDatagram;
    let dir = tempfile::tempdir().unwrap();
    let notify = dir.path().join("notify.sock");
    let socket = UnixDatagram::bind(&notify).unwrap();
    socket
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "[daemon]\nstate_dir = \"{0}/state\"\n[gpu]\nenabled = false\n[launch]\nsocket = \"{0}/g.sock\"\n",
            dir.path().display()
        ),
    )
    .unwrap();
    let mut daemon = Command::new(BIN)
        .args(["daemon", "--config"])
        .arg(&config)
        .env("GPUGUARD_ENFORCE_LOCK", dir.path().join("enforce.lock"))
        .env("NOTIFY_SOCKET", &notify)
        .env("WATCHDOG_USEC", "400000")
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::time::Instant::now() < deadline
        && seen
            .iter()
            .filter(|m: &&String| m.contains("WATCHDOG=1"))
            .count()
            < 3
    {
        if let Ok(n) = socket.recv(&mut buf) {
            seen.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
    }
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(daemon.id() as i32).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let _ = daemon.wait();
    while let Ok(n) = socket.recv(&mut buf) {
        seen.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        if seen.last().unwrap().contains("STOPPING=1") {
            break;
        }
    }
    assert!(seen.iter().any(|m| m.contains("READY=1")), "{seen:?}");
    assert!(
        seen.iter()
            .any(|m| m.contains("STATUS=enforce: RAM available")),
        "{seen:?}"
    );
    assert!(
        seen.iter().filter(|m| m.contains("WATCHDOG=1")).count() >= 3,
        "watchdog pinged repeatedly: {seen:?}"
    );
    assert!(seen.iter().any(|m| m.contains("STOPPING=1")), "{seen:?}");
}
