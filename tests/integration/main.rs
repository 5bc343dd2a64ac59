//! The integration tests, one test binary (linked once): the real `gpuguard` binary as a child
//! daemon acting on real child processes, the CLI, and the property tests. `common` holds the
//! shared harness (the daemon, hogs, waits, events, fake NVML state files). The tests that load
//! the fake NVML into this process are in `tests/nvml/`: its `FAKE_NVML_STATE` is process-wide.

mod common;
#[path = "../support/skip.rs"]
mod skip;

mod alerts;
mod cli;
mod engine;
mod faults;
mod first_hour;
mod gpu_guard;
mod launch;
mod metrics;
mod permits;
mod permits_allocators;
mod permits_python;
mod plan;
mod process_truth;
mod ram_guard;
mod rules;
mod security;
mod sigterm;
mod status;
