//! A host that drains: its cloud announced maintenance or preemption (`sample::gce`). New
//! permits and launches are refused at once with the reason and a retry hint, those waiting are
//! refused when the drain begins, and those held keep running (their work finishes or the host
//! goes down under them; either way the guard does not cut them short). A notice withdrawn
//! lifts the drain.

use super::*;

/// Why the host drains, as requests are told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Drain {
    pub reason: RefusalReason,
    pub message: String,
    /// When to try again (elsewhere, or here once the notice is withdrawn).
    pub retry_after: Duration,
}

impl Reservations {
    /// Starts, changes or (with `None`) lifts the drain.
    pub fn drain(&mut self, drain: Option<Drain>) {
        let begins = drain.is_some() && self.drain.is_none();
        self.drain = drain;
        if !begins {
            return;
        }
        let waiting: Vec<Waiter> = std::mem::take(&mut self.waiting)
            .into_values()
            .flatten()
            .chain(std::mem::take(&mut self.launch_queue))
            .collect();
        for w in waiting {
            let id = matches!(w.wanted, Wanted::Permit { .. }).then_some(w.id);
            if let Some(refused) = self.drained(id) {
                self.send(w.conn, refused);
            }
        }
    }

    /// The answer to a new request while the host drains.
    pub(super) fn drained(&self, id: Option<u64>) -> Option<Response> {
        let d = self.drain.as_ref()?;
        Some(Response::Refused {
            id,
            reason: d.reason,
            message: d.message.clone(),
            retry_after_ms: Some(ms(d.retry_after)),
            needed: Needed::default(),
            free: Free::default(),
        })
    }
}
