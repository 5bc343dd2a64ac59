//! gpuguard: a host agent that keeps GPU machines alive.
//!
//! The pipeline, one module per stage:
//! `sample` (/proc, NVML) -> `snapshot` (plain data) -> `policy` (pure decisions) -> `act`
//! (signals, throttles) -> logs, `alert` (webhooks, event log), `metrics` (Prometheus) and
//! `history` (the flight recorder, read by `gpuguard history`),
//! driven by the `daemon` loop. `config` holds the TOML config, `units` the sizes and durations
//! it is written in.

pub mod act;
pub mod alert;
pub mod cli;
pub mod config;
pub mod daemon;
pub mod history;
pub mod http;
pub mod ipc;
pub mod kinds;
mod layers;
pub mod metrics;
pub mod plan;
pub mod policy;
#[cfg(test)]
mod properties;
pub mod protocol;
pub mod reserve;
pub mod sample;
pub mod secrets;
pub mod snapshot;
pub mod state_dir;
pub mod status;
/// The tests' skip helper, shared with the host suite.
#[cfg(test)]
#[path = "../tests/support/skip.rs"]
mod test_skip;
pub mod units;
pub mod view;
