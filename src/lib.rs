//! gpuguard, the agent: a host daemon that keeps GPU machines alive, and its CLI.
//!
//! The pipeline, one module per stage: `sample` (/proc, NVML) -> the core's `snapshot` (plain
//! data) -> its `policy` (pure decisions) and the ledger's `reserve` -> `act` (signals,
//! throttles) -> logs, `alert` (webhooks, event log), `metrics` (Prometheus) and `history` (the
//! flight recorder), driven by the `daemon` loop; `ipc` serves the socket, `cli` the commands.
//! The libraries' modules are named here as the agent's own (`crate::config`, ...). Only
//! what the binary and the host suite use is public, so the dead-code lint sees the rest.

// The core (crates/core): the config, the snapshot, the pure policy and the read model.
pub use gpuguard_core::{
    config, engine, host, kinds, policy, secrets, snapshot, status, unattributed, units,
};
// The ledger (crates/ledger) and the planner (crates/plan).
pub use gpuguard_ledger::{protocol, reserve};
pub use gpuguard_plan as plan;

mod act;
mod alert;
pub mod cli;
mod daemon;
mod history;
mod http;
pub mod ipc;
mod metrics;
#[cfg(test)]
mod properties;
pub mod sample;
mod state_dir;
/// The tests' skip helper, shared with the host suite.
#[cfg(test)]
#[path = "../tests/support/skip.rs"]
mod test_skip;
mod view;
