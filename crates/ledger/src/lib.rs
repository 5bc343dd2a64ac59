//! gpuguard's ledger: the reservations (`reserve`: launch leases and request permits, admitted
//! against live free memory, the floors and each other) and the wire protocol they are asked
//! for in (`protocol`). Plain data in, answers out; the daemon owns the ledger, and the
//! socket's transport (the agent's `ipc`) holds a handle.

pub mod protocol;
pub mod reserve;

// The core's modules, under the names the ledger's code uses for them.
#[cfg(test)]
use gpuguard_core::unattributed;
use gpuguard_core::{config, kinds, policy, snapshot, status, units};
