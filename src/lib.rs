//! gpuguard: a host agent that keeps GPU machines alive.
//!
//! The pipeline, one module per stage:
//! `sample` (/proc, NVML) -> `snapshot` (plain data) -> `policy` (pure decisions) -> `act`
//! (signals, throttles) -> logs and alerts, driven by the `daemon` loop. `config` holds the TOML
//! config, `units` the sizes and durations it is written in.

pub mod act;
pub mod cli;
pub mod config;
pub mod daemon;
pub mod ipc;
pub mod launch;
pub mod policy;
pub mod sample;
pub mod snapshot;
pub mod status;
pub mod units;
