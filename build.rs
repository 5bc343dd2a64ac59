//! Two things, neither of which can fail the build:
//! - Builds the scripted fake NVML (tests/fake_nvml/fake_nvml.c) into
//!   `$OUT_DIR/fake_nvml/libnvidia-ml.so.1` and tells the tests where it is
//!   (`env!("GPUGUARD_FAKE_NVML_DIR")`). A failing C compiler prints a cargo warning (the
//!   binary does not need the fake), and the tests that load the fake fail.
//! - Has the linker place the daemon's hot code first and together in release builds
//!   (`order_hot_code`).

use std::path::{Path, PathBuf};
use std::process::Command;

const SOURCE: &str = "tests/fake_nvml/fake_nvml.c";
const HOT_CODE_ORDER: &str = "packaging/hot-code.order";

fn main() {
    println!("cargo:rerun-if-changed={SOURCE}");
    println!("cargo:rerun-if-changed=build.rs");

    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    order_hot_code(&out_dir);
    let dir = out_dir.join("fake_nvml");
    std::fs::create_dir_all(&dir).expect("create $OUT_DIR/fake_nvml");
    let lib = dir.join("libnvidia-ml.so.1");
    let _ = std::fs::remove_file(&lib); // never leave a stale fake behind a failed compile
    let source = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"),
    )
    .join(SOURCE);
    println!("cargo:rustc-env=GPUGUARD_FAKE_NVML_DIR={}", dir.display());

    let mut cmd: Command = cc::Build::new().get_compiler().to_command();
    cmd.args(["-shared", "-fPIC", "-O2", "-Wall", "-pthread"])
        // soname as the real library; nodelete keeps its state (Xid numbering,
        // events, event sets) for the life of the process across dlclose.
        .args(["-Wl,-soname,libnvidia-ml.so.1", "-Wl,-z,nodelete"])
        .arg("-o")
        .arg(&lib)
        .arg(&source);

    match cmd.output() {
        Ok(out) => {
            for line in String::from_utf8_lossy(&out.stderr).lines() {
                println!("cargo:warning=fake_nvml: {line}");
            }
            if !out.status.success() {
                println!("cargo:warning=fake_nvml: {cmd:?} failed ({})", out.status);
            }
        }
        Err(e) => println!("cargo:warning=fake_nvml: cannot run {cmd:?}: {e}"),
    }
}

/// The functions an idle daemon runs (`packaging/hot-code.order`, written by
/// `bench/hot-code.sh`) go first and together in the release binary's text, so the code it keeps
/// resident (and locked, with `--lock-memory`) is a few contiguous MiB, not pages scattered over
/// the whole binary, each bringing its neighbours in with it. Only when lld links the binary:
/// rustc's default linker for x86_64 Linux since 1.90, unless the flags or the environment name
/// another linker (GNU ld does not know the option). Names the linker does not find (the list is
/// from an older build) are skipped without a warning: a stale list costs memory, not
/// correctness. `GPUGUARD_NO_HOT_CODE_ORDER=1` turns it off.
fn order_hot_code(out_dir: &Path) {
    println!("cargo:rerun-if-changed={HOT_CODE_ORDER}");
    println!("cargo:rerun-if-env-changed=GPUGUARD_NO_HOT_CODE_ORDER");
    let var = |name: &str| std::env::var(name).unwrap_or_default();
    let order = PathBuf::from(var("CARGO_MANIFEST_DIR")).join(HOT_CODE_ORDER);
    if var("PROFILE") != "release"
        || !order.is_file()
        || std::env::var_os("GPUGUARD_NO_HOT_CODE_ORDER").is_some()
    {
        return;
    }
    let flags = var("CARGO_ENCODED_RUSTFLAGS");
    let lld = var("TARGET") == "x86_64-unknown-linux-gnu"
        && !["linker", "link-self-contained", "fuse-ld"]
            .iter()
            .any(|f| flags.contains(f))
        && std::env::var_os("CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER").is_none()
        // Last: it runs rustc.
        && rustc_minor_version().is_some_and(|minor| minor >= 90);
    if !lld {
        return;
    }
    // The linker reads a copy in OUT_DIR: the build script's output is cached per package, not
    // per checkout, so a path into this checkout could name another (or a deleted) one later.
    let copy = out_dir.join("hot-code.order");
    if let Err(e) = std::fs::copy(&order, &copy) {
        println!(
            "cargo:warning=hot code order: cannot copy {}: {e}",
            order.display()
        );
        return;
    }
    println!(
        "cargo:rustc-link-arg-bins=-Wl,--symbol-ordering-file={}",
        copy.display()
    );
    println!("cargo:rustc-link-arg-bins=-Wl,--no-warn-symbol-ordering");
}

/// The y of rustc 1.y (from `$RUSTC --version`).
fn rustc_minor_version() -> Option<u32> {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let out = Command::new(rustc).arg("--version").output().ok()?;
    let version = String::from_utf8(out.stdout).ok()?;
    version
        .split_whitespace()
        .nth(1)?
        .split('.')
        .nth(1)?
        .parse()
        .ok()
}
