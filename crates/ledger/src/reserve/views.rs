//! What status and the metrics show of the ledger.

use super::*;

impl Reservations {
    /// True while anything is reserved or waiting: the loop then ticks often, with fresh GPU
    /// process lists.
    pub fn busy(&self) -> bool {
        !self.launch_queue.is_empty()
            || !self.waiting.is_empty()
            || self.holdings.values().any(Holding::reserving)
    }

    /// True while anything waits or holds a permit (something may reach its deadline or TTL).
    pub fn can_expire(&self) -> bool {
        !self.waiting.is_empty()
            || !self.launch_queue.is_empty()
            || self
                .holdings
                .values()
                .any(|h| matches!(h.kind, Held::Permit { .. }))
    }

    /// True while a launch waits or loads (admission and readiness are looked at every tick).
    pub fn launching(&self) -> bool {
        !self.launch_queue.is_empty() || self.holdings.values().any(Holding::loading)
    }

    /// The table as `status` shows it.
    pub fn rows(&self, now: Duration) -> Rows {
        let queue = self
            .launch_queue
            .iter()
            .enumerate()
            .map(|(i, w)| QueuedRow {
                position: i + 1,
                model: model_label(&w.pool),
                pid: w.peer.pid,
                uid: w.peer.uid,
                waiting_seconds: now.saturating_sub(w.arrived).as_secs_f64(),
                gpu_bytes: w.demand.gpu_bytes_total(),
                ram_bytes: w.demand.ram_bytes,
                waiting_for: w.waiting_for.clone(),
                queue_timeout_seconds: w.deadline.saturating_sub(w.arrived).as_secs_f64(),
            })
            .collect();
        let mut leases: Vec<LeaseRow> = self
            .holdings
            .iter()
            .filter_map(|(id, h)| match &h.kind {
                Held::Lease(l) => Some(LeaseRow {
                    lease: *id,
                    model: l.model.clone(),
                    pid: h.peer.pid,
                    uid: h.peer.uid,
                    gpus: h.gpus.clone(),
                    state: l.state,
                    seconds: now.saturating_sub(h.granted_at).as_secs_f64(),
                    gpu_bytes: h.gpu_bytes_per_gpu * h.gpus.len() as u64,
                    ram_bytes: h.ram_bytes,
                    polling_ready_url: l.polling(),
                    ready_timeout_seconds: l.ready_timeout.as_secs_f64(),
                }),
                Held::Permit { .. } => None,
            })
            .collect();
        leases.sort_by_key(|l| l.lease);
        let permits = self
            .figures()
            .into_iter()
            .filter(|f| f.held + f.waiting > 0 || f.granted + f.refused > 0)
            .map(|f| PermitPoolRow {
                max_permits: self.config.model(&f.pool).and_then(|m| m.max_permits),
                model: f.pool,
                held: f.held,
                waiting: f.waiting,
                reserved_gpu_bytes: f.reserved_gpu_bytes,
                reserved_ram_bytes: f.reserved_ram_bytes,
                observed_gpu_bytes_p50: f.observed_p50_bytes,
                observed_gpu_bytes_p95: f.observed_p95_bytes,
                granted_total: f.granted,
                refused_total: f.refused,
                expired_total: f.expired,
            })
            .collect();
        Rows {
            queue,
            leases,
            permits,
        }
    }

    /// Per pool figures, for status and metrics.
    pub fn figures(&self) -> Vec<PoolFigures> {
        self.pools
            .iter()
            .map(|(pool, a)| {
                let permits =
                    |h: &&Holding| h.pool == *pool && matches!(h.kind, Held::Permit { .. });
                let held: Vec<&Holding> = self.holdings.values().filter(permits).collect();
                PoolFigures {
                    pool: model_label(pool),
                    held: held.len(),
                    waiting: self.waiting.get(pool).map_or(0, VecDeque::len),
                    reserved_gpu_bytes: held
                        .iter()
                        .map(|h| h.gpu_bytes_per_gpu * h.gpus.len() as u64)
                        .sum(),
                    reserved_ram_bytes: held.iter().map(|h| h.ram_bytes).sum(),
                    granted: a.counts.granted,
                    refused: a.counts.refused,
                    expired: a.counts.expired,
                    observed_p50_bytes: a.learner.quantile(0.5),
                    observed_p95_bytes: a.learner.quantile(0.95),
                }
            })
            .collect()
    }
}
