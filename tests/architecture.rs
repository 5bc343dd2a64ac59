//! The workspace is the architecture, and Cargo holds it: the core decides from data and
//! touches no OS, the ledger is the core's and the protocol's only, the planner is arithmetic.
//! Read from `cargo tree` (the normal dependencies each crate builds with, transitively), so a
//! crate that brings a runtime or a syscall layer in by the back door fails here too. Plain
//! `cargo test` runs it.

use std::collections::BTreeSet;
use std::process::Command;

/// The crates that do I/O: a runtime, a syscall layer, NVML, HTTP.
const OS: &[&str] = &[
    "tokio",
    "nix",
    "rustix",
    "libc",
    "nvml-wrapper",
    "ureq",
    "sysinfo",
    "procfs",
    "signal-hook",
];

/// Every crate `package` builds with (its normal dependencies, transitively).
fn dependencies(package: &str) -> BTreeSet<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "--locked",
            "-e",
            "normal",
            "--prefix",
            "none",
            "-p",
        ])
        .arg(package)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree -p {package}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

#[test]
fn the_libraries_touch_no_os_and_depend_only_downwards() {
    let core = dependencies("gpuguard-core");
    let ledger = dependencies("gpuguard-ledger");
    let plan = dependencies("gpuguard-plan");
    for (name, deps) in [("core", &core), ("ledger", &ledger), ("plan", &plan)] {
        let os: Vec<_> = OS.iter().filter(|c| deps.contains(**c)).collect();
        assert!(os.is_empty(), "gpuguard-{name} builds with {os:?}");
        assert!(
            !deps.contains("gpuguard"),
            "gpuguard-{name} depends on the agent"
        );
    }
    assert!(core.contains("regex"), "cargo tree read nothing: {core:?}");
    for upper in ["gpuguard-ledger", "gpuguard-plan"] {
        assert!(!core.contains(upper), "the core depends on {upper}");
    }
    assert!(ledger.contains("gpuguard-core"));
    assert!(
        !ledger.contains("gpuguard-plan"),
        "the ledger depends on the planner"
    );
    assert!(
        !plan.contains("gpuguard-ledger"),
        "the planner depends on the ledger"
    );
}
