//! gpuguard: a host agent that keeps GPU machines alive.
//!
//! The pipeline, one module per stage:
//! `sample` (/proc, NVML) -> `snapshot` (plain data) -> `policy` (pure decisions) -> `act`
//! (signals, throttles) -> logs, `alert` (webhooks, event log), `metrics` (Prometheus) and
//! `history` (the flight recorder, read by `gpuguard history`),
//! driven by the `daemon` loop. `config` holds the TOML config, `units` the sizes and durations
//! it is written in.

// The core (crates/core): the config, the snapshot, the pure policy and the read model.
pub use gpuguard_core::{
    config, engine, host, kinds, policy, secrets, snapshot, status, unattributed, units,
};
// The ledger (crates/ledger) and the planner (crates/plan).
pub use gpuguard_ledger::{protocol, reserve};
pub use gpuguard_plan as plan;

pub mod act;
pub mod alert;
pub mod cli;
pub mod daemon;
pub mod history;
pub mod http;
pub mod ipc;
pub mod metrics;
#[cfg(test)]
mod properties;
pub mod sample;
pub mod state_dir;
pub mod view;
