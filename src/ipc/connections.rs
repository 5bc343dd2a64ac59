//! The socket's connections: the caps on how many are open (per uid and in all), where each
//! one's answers go, and what wakes it when it leaves its answers unread. The reservation ledger
//! decides; this delivers its answers (`Desk`), so the ledger never sees a channel.
//!
//! Root always keeps a way in: the accounts other than root share `max_connections` less one
//! uid's share (`max_connections_per_uid`), which stays root's, so no number of accounts (or one
//! account's subordinate uids) can fill the socket and leave `gpuguard status` or root's
//! `launch` outside.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::Sender;
use tokio::sync::Notify;

use crate::config::{ClientsConfig, Config};
use crate::protocol::Response;
use crate::reserve::{ConnId, Reservations};

struct Connection {
    uid: u32,
    /// Where its answers go, once its identity is pinned (until it hangs up).
    reply: Option<Sender<Response>>,
    /// Woken when answers pile up unread: the server then closes the connection.
    overflow: Arc<Notify>,
}

pub struct Connections {
    open: HashMap<ConnId, Connection>,
    caps: ClientsConfig,
}

impl Connections {
    pub fn new(config: &Config) -> Connections {
        Connections {
            open: HashMap::new(),
            caps: config.clients.clone(),
        }
    }

    /// A new connection from `uid`: refused when it would pass a connection cap.
    pub fn connect(&mut self, conn: ConnId, uid: u32) -> Result<(), String> {
        let c = &self.caps;
        let others = self.open.values().filter(|o| o.uid != 0).count();
        let root_share = c.max_connections_per_uid.min(c.max_connections);
        if uid != 0 && others >= c.max_connections.saturating_sub(root_share) {
            return Err(format!(
                "{others} connections of accounts other than root open (clients.max_connections less root's share of max_connections_per_uid)"
            ));
        }
        let of_uid = self.open.values().filter(|o| o.uid == uid).count();
        if of_uid >= c.max_connections_per_uid {
            return Err(format!(
                "uid {uid} has {of_uid} connections open (clients.max_connections_per_uid)"
            ));
        }
        self.open.insert(
            conn,
            Connection {
                uid,
                reply: None,
                overflow: Arc::new(Notify::new()),
            },
        );
        Ok(())
    }

    /// Where the connection's answers go. Returns what wakes when the client leaves its answers
    /// unread (the connection must then be closed).
    pub fn attach(&mut self, conn: ConnId, reply: Sender<Response>) -> Arc<Notify> {
        match self.open.get_mut(&conn) {
            Some(c) => {
                c.reply = Some(reply);
                c.overflow.clone()
            }
            None => Arc::new(Notify::new()),
        }
    }

    /// Nothing more is sent to it; it stays counted against the caps until `disconnect` (its
    /// descriptor lives on while its last answers are written).
    pub fn hang_up(&mut self, conn: ConnId) {
        if let Some(c) = self.open.get_mut(&conn) {
            c.reply = None;
        }
    }

    pub fn disconnect(&mut self, conn: ConnId) {
        self.open.remove(&conn);
    }

    /// How long a connection that holds nothing may stay silent.
    pub fn idle_timeout(&self) -> Duration {
        self.caps.idle_timeout
    }

    /// Sends an answer the ledger decided. A client whose queue is full does not read its
    /// answers: it is woken to be closed, which ends what it holds, so no permit stays granted
    /// to someone who never heard of it.
    fn deliver(&self, conn: ConnId, response: Response) {
        let Some(c) = self.open.get(&conn) else {
            return;
        };
        if c.reply
            .as_ref()
            .is_some_and(|r| r.try_send(response).is_err())
        {
            c.overflow.notify_one();
        }
    }
}

/// The ledger and the connections, behind one lock: whatever the ledger decides on a call is
/// delivered when the lock is let go (`Table`'s drop).
pub struct Desk {
    pub ledger: Reservations,
    pub connections: Connections,
}

impl Desk {
    pub fn new(config: &Config) -> Desk {
        Desk {
            ledger: Reservations::new(config.clone()),
            connections: Connections::new(config),
        }
    }

    /// A reloaded config: new caps and limits apply to new connections and requests.
    pub fn configure(&mut self, config: &Config) {
        self.connections.caps = config.clients.clone();
        self.ledger.configure(config.clone());
    }

    /// Delivers the ledger's outbox.
    pub fn deliver(&mut self) {
        for (conn, response) in self.ledger.take_outbox() {
            self.connections.deliver(conn, response);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connections(text: &str) -> Connections {
        Connections::new(&Config::parse(text, std::path::Path::new("t.toml")).unwrap())
    }

    /// Round three's lockout: accounts other than root fill the socket together (four of them,
    /// or one with subordinate uids); root still gets its share.
    #[test]
    fn accounts_other_than_root_never_take_roots_share() {
        let mut c = connections("[clients]\nmax_connections = 256\nmax_connections_per_uid = 64\n");
        let mut conn = 0;
        let mut refused = 0;
        for uid in [1001, 1002, 1003, 1004, 100_000, 100_001] {
            for _ in 0..64 {
                conn += 1;
                if c.connect(conn, uid).is_err() {
                    refused += 1;
                }
            }
        }
        assert_eq!(c.open.len(), 192, "the others share 256 less root's 64");
        assert_eq!(refused, 6 * 64 - 192);
        for _ in 0..64 {
            conn += 1;
            c.connect(conn, 0).expect("root's share");
        }
        assert!(
            c.connect(conn + 1, 0).is_err(),
            "root has a per-uid cap too"
        );
        assert_eq!(c.open.len(), 256);
        // One leaves: another account may take its place, not more.
        let first = *c.open.keys().find(|k| c.open[k].uid == 1001).unwrap();
        c.disconnect(first);
        c.connect(conn + 2, 1005).unwrap();
        assert!(c.connect(conn + 3, 1005).is_err());
    }
}
