//! gpuguard's core: what the guard decides from, and the decisions, as plain data.
//!
//! `config` (the TOML config, parsed and validated), `snapshot` (one moment of the host: GPUs,
//! RAM, processes), `policy` (the pure decisions: floors, budgets, admission, which process),
//! `status` (the `status --json` read model), `kinds` (the names of what happens), `units`
//! (sizes and durations), `secrets` (masking command lines), `engine` (what a model server says
//! of itself), `unattributed` (when NVML's per-process figures are trusted). Nothing here
//! touches the OS: what the config needs of the host it runs on (user names, interface
//! addresses) the agent installs once (`host`).

pub mod config;
pub mod engine;
pub mod host;
pub mod kinds;
pub mod policy;
pub mod secrets;
pub mod snapshot;
pub mod status;
pub mod unattributed;
pub mod units;

#[cfg(test)]
mod properties;
