//! Builds the scripted fake NVML (tests/fake_nvml/fake_nvml.c, in the repository) into
//! `$OUT_DIR/fake_nvml/libnvidia-ml.so.1` and tells this crate where it is
//! (`GPUGUARD_FAKE_NVML_DIR`, read by `src/lib.rs`). Never fails the build: a failing C compiler
//! prints a cargo warning, and the tests that load the fake fail.

use std::path::PathBuf;
use std::process::Command;

const SOURCE: &str = "../../tests/fake_nvml/fake_nvml.c";

fn main() {
    println!("cargo:rerun-if-changed={SOURCE}");
    println!("cargo:rerun-if-changed=build.rs");

    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
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

    // The compiler and its arguments (cc's command also carries the whole environment).
    let shown = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ");
    match cmd.output() {
        Ok(out) => {
            for line in String::from_utf8_lossy(&out.stderr).lines() {
                println!("cargo:warning=fake_nvml: {line}");
            }
            if !out.status.success() {
                println!("cargo:warning=fake_nvml: {shown} failed ({})", out.status);
            }
        }
        Err(e) => println!("cargo:warning=fake_nvml: cannot run {shown}: {e}"),
    }
}
