//! Where the scripted fake `libnvidia-ml.so.1` (tests/fake_nvml/fake_nvml.c, its state file format
//! in tests/fake_nvml/README.md) was built: a dev-dependency of gpuguard, so the fake is compiled
//! for the tests and benchmarks only, never for the binary. Missing if the C compiler failed
//! (the build said so in a warning).

/// The directory that holds the fake `libnvidia-ml.so.1` (for `LD_LIBRARY_PATH`).
pub const DIR: &str = env!("GPUGUARD_FAKE_NVML_DIR");

/// The fake library itself (for `[gpu] nvml_library` or `dlopen`).
pub const LIBRARY: &str = concat!(env!("GPUGUARD_FAKE_NVML_DIR"), "/libnvidia-ml.so.1");
