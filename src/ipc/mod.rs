//! The daemon's unix socket, the transport of `protocol`: the server (connections, their caps,
//! reply channels and wake-ups, in front of the reservation ledger), the CLI's client, and the
//! pinning of who is on the other end.

pub mod client;
pub(crate) mod connections;
pub(crate) mod launched;
pub(crate) mod peer;
pub(crate) mod server;
