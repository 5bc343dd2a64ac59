//! The `gpuguard` binary: everything lives in the library; see `gpuguard::cli`.

fn main() -> std::process::ExitCode {
    gpuguard::cli::main()
}
