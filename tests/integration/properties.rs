//! Property tests through the real daemon (proptest, bounded case counts): any socket line leaves
//! it answering. The parsers and the policy on arbitrary input are property-tested in-process
//! (`src/properties.rs`); NVML states through the fake library in tests/nvml/sampler.rs.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;

use crate::common::*;

/// `n` cases, or `PROPTEST_CASES` when set (for a longer run by hand).
fn cases(n: u32) -> ProptestConfig {
    let n = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(n);
    ProptestConfig {
        cases: n,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---- socket lines, through the real daemon ---------------------------------------------------

fn ipc_line() -> impl Strategy<Value = Vec<u8>> {
    let json_value = prop_oneof![
        Just("null".to_string()),
        (0u64..=u64::MAX).prop_map(|n| n.to_string()),
        Just("-1".to_string()),
        Just("1e400".to_string()),
        "\"[a-z_]{0,12}\"",
        Just("[[[[[[[[[[]]]]]]]]]]".to_string()),
        Just("{\"a\":{\"b\":{}}}".to_string()),
    ];
    let key = prop::sample::select(vec![
        "model",
        "gpu_memory_bytes",
        "ram_bytes",
        "gpus",
        "gpu",
        "cuda_visible_devices",
        "ready_url",
        "ready_timeout_ms",
        "queue_timeout_ms",
        "command",
        "lease",
        "x",
    ]);
    let kind = prop::sample::select(vec!["status", "launch", "release", "Status", "", "permit"]);
    prop_oneof![
        (
            prop::option::of(0u64..3),
            kind,
            prop::collection::vec((key, json_value), 0..5)
        )
            .prop_map(|(version, kind, fields)| {
                let mut obj = format!("{{\"type\":\"{kind}\"");
                if let Some(v) = version {
                    obj += &format!(",\"version\":{v}");
                }
                for (k, v) in fields {
                    obj += &format!(",\"{k}\":{v}");
                }
                (obj + "}").into_bytes()
            }),
        prop::collection::vec(any::<u8>(), 0..200),
    ]
}

#[test]
fn any_socket_line_leaves_the_daemon_answering() {
    let daemon = GuardDaemon::start(
        "[daemon]\nstate_dir = \"{state_dir}\"\ncandidates = \"models\"\n[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n[gpu]\nenabled = false\n",
    );
    let socket = daemon.socket();
    let send = |line: &[u8]| -> Option<String> {
        let mut stream = UnixStream::connect(&socket).ok()?;
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .ok()?;
        let mut line = line.to_vec();
        line.retain(|&b| b != b'\n');
        line.push(b'\n');
        stream.write_all(&line).ok()?;
        let mut reply = String::new();
        BufReader::new(stream).read_line(&mut reply).ok()?;
        Some(reply)
    };
    let mut runner = proptest::test_runner::TestRunner::new(cases(64));
    let result = runner.run(&ipc_line(), |line| {
        // Launch requests that happen to be valid wait in the queue: only look for an answer
        // to the others.
        let _ = send(&line);
        Ok(())
    });
    result.unwrap();
    let status = send(b"{\"version\":1,\"type\":\"status\"}").expect("the daemon still answers");
    assert!(status.contains("\"schema_version\""), "{status}");
    let mut daemon = daemon;
    assert!(
        daemon.child.try_wait().unwrap().is_none(),
        "{}",
        daemon.log_text()
    );
}
