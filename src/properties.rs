//! Property tests of the agent's parsers, in-process (proptest, bounded case counts so `cargo
//! test` stays fast): /proc files of any shape are read without panicking and whatever is read
//! the policy takes. The socket lines a local user might send are drawn here too (`ipc_line`,
//! served by `ipc::server::tests`); NVML states go through the fake library in
//! tests/nvml/sampler.rs. The config and policy properties are the core's
//! (crates/core/src/properties.rs).

use std::path::Path;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;

use crate::config::Config;
use crate::policy::{evaluate, Launches, PolicyState};
use crate::sample::{ProcSource, ProcfsSource};
use crate::snapshot::{ProcessTable, Snapshot};

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

// ---- socket lines -----------------------------------------------------------------------------

/// A line a local user might send on the socket: requests of every kind with odd values, or
/// random bytes.
pub(crate) fn ipc_line() -> impl Strategy<Value = Vec<u8>> {
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

// ---- /proc --------------------------------------------------------------------------------

fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u64..=u64::MAX).prop_map(|n| n.to_string()),
        (0u64..100_000).prop_map(|n| n.to_string()),
        Just("-1".to_string()),
        "[a-z0-9]{0,4}",
    ]
}

fn meminfo() -> impl Strategy<Value = String> {
    let key = prop::sample::select(vec![
        "MemTotal",
        "MemAvailable",
        "SwapTotal",
        "SwapFree",
        "MemFree",
        "Bogus",
    ]);
    let unit = prop::sample::select(vec![" kB", "", " MB", " kB extra"]);
    prop::collection::vec((key, number(), unit), 0..8).prop_map(|lines| {
        lines
            .into_iter()
            .map(|(k, n, u)| format!("{k}: {n}{u}\n"))
            .collect()
    })
}

/// `/proc/PID/stat`: a real layout with hostile names and any numbers, or garbage.
fn stat(pid: u32) -> impl Strategy<Value = String> {
    prop_oneof![
        (
            ".{0,20}",
            "[RSDZTtXxIKWP?]",
            prop::collection::vec(number(), 49)
        )
            .prop_map(move |(comm, state, fields)| format!(
                "{pid} ({comm}) {state} {}\n",
                fields.join(" ")
            )),
        ".{0,200}",
    ]
}

fn status() -> impl Strategy<Value = String> {
    let key = prop::sample::select(vec![
        "Name", "Uid", "Gid", "VmSwap", "VmRSS", "State", "Tgid",
    ]);
    prop::collection::vec((key, prop::collection::vec(number(), 1..5), ".{0,5}"), 0..8).prop_map(
        |lines| {
            lines
                .into_iter()
                .map(|(k, v, tail)| format!("{k}:\t{}{tail}\n", v.join("\t")))
                .collect()
        },
    )
}

/// Shapes that once panicked procfs's `stat` parser (it slices by the first '(' and last ')').
#[test]
fn stat_files_the_kernel_would_never_write_are_not_processes() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("7");
    std::fs::create_dir_all(&p).unwrap();
    let fields = "S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 5 0 0";
    for stat in [
        ")(".to_string(),
        "(".to_string(),
        "(x) S".to_string(),
        "é(x) S 1".to_string(),
        "7 (x)S 1".to_string(),
        "7 (x)".to_string(),
        format!("7x (x) {fields}"),
    ] {
        std::fs::write(p.join("stat"), &stat).unwrap();
        let mut source = ProcfsSource::new(dir.path());
        assert!(source.read(7).is_none(), "{stat:?}");
        assert!(source.scan().is_empty(), "{stat:?}");
    }
    // The kernel's shape, hostile name included, still reads.
    std::fs::write(
        p.join("stat"),
        format!("7 (a) (b) {fields} 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n"),
    )
    .unwrap();
    std::fs::write(p.join("status"), "Uid:\t0\t0\t0\t0\n").unwrap();
    let read = ProcfsSource::new(dir.path()).read(7);
    assert_eq!(read.map(|p| p.comm), Some("a) (b".to_string()));
}

proptest! {
    #![proptest_config(cases(128))]

    #[test]
    fn any_proc_files_are_read_without_panicking(
        meminfo in meminfo(),
        pressure in ".{0,80}",
        stat in stat(4242),
        status in status(),
        cmdline in prop::collection::vec(any::<u8>(), 0..64),
        cgroup in ".{0,60}",
    ) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::write(root.join("meminfo"), meminfo).unwrap();
        std::fs::create_dir_all(root.join("pressure")).unwrap();
        std::fs::write(root.join("pressure/memory"), pressure).unwrap();
        let p = root.join("4242");
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(p.join("stat"), stat).unwrap();
        std::fs::write(p.join("status"), status).unwrap();
        std::fs::write(p.join("cmdline"), cmdline).unwrap();
        std::fs::write(p.join("cgroup"), cgroup).unwrap();
        let mut source = ProcfsSource::new(root);
        let host = source.host_memory();
        let scanned = source.scan();
        let read = source.read(4242);
        prop_assert!(scanned.len() <= 1);
        prop_assert_eq!(scanned.first().map(|p| p.pid), read.map(|p| p.pid));
        // Whatever was read, the policy takes it.
        let config = Config::parse("", Path::new("c.toml")).unwrap();
        let snapshot = Snapshot {
            host,
            processes: ProcessTable { scanned_at: Some(Duration::ZERO), processes: scanned, pss_read: true },
            ..Default::default()
        };
        evaluate(&config, &snapshot, &Launches::default(), &mut PolicyState::default());
    }
}
