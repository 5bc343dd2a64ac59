//! Has the linker place the daemon's hot code first and together in release builds
//! (`order_hot_code`). (The fake NVML the tests load is built by crates/fake-nvml, a
//! dev-dependency: never for the binary.)

use std::path::{Path, PathBuf};
use std::process::Command;

const HOT_CODE_ORDER: &str = "packaging/hot-code.order";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    order_hot_code(&out_dir);
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
