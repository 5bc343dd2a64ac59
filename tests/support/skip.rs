//! The tests' one way to skip. A test that can check nothing on this host (no root, cgroup v1, no
//! IPv6 loopback) calls `skip` and returns: it says so on stderr and appends `TEST<TAB>WHY` to the
//! file `GPUGUARD_TEST_SKIPS` names (scripts/test sets it, counts these tests as skipped rather
//! than passed and lists them). `GPUGUARD_REQUIRE` (comma-separated: `root`, `cgroup2`, `ipv6`,
//! or `all`) turns a skip for want of what it names into a failure, on a host that must have it.
//! Included by path in the unit tests (`src/lib.rs`) and the host suite (`tests/integration/`).

use std::io::Write;

/// Reports the calling test as skipped for want of `need` (`root`, `cgroup2`, `ipv6`), saying
/// `why`; panics instead if `GPUGUARD_REQUIRE` names `need`.
pub fn skip(need: &str, why: &str) {
    let required = std::env::var("GPUGUARD_REQUIRE").unwrap_or_default();
    if required
        .split(',')
        .map(str::trim)
        .any(|r| r == need || r == "all")
    {
        panic!("{why}, and GPUGUARD_REQUIRE={required} requires {need}");
    }
    // libtest names each test's thread after the test; the binary says which suite.
    let binary = std::env::current_exe()
        .ok()
        .and_then(|p| Some(p.file_stem()?.to_string_lossy().into_owned()))
        .unwrap_or_default();
    let binary = binary
        .rsplit_once('-')
        .map_or(&*binary, |(name, _hash)| name);
    let test = std::thread::current().name().unwrap_or("?").to_string();
    eprintln!("skipped ({need}): {why}");
    if let Some(path) = std::env::var_os("GPUGUARD_TEST_SKIPS") {
        let file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path);
        if let Ok(mut file) = file {
            let _ = writeln!(file, "{binary} {test}\t{why}");
        }
    }
}
