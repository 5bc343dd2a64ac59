//! Permits: a request for one unit of work's memory, granted at once, queued in its pool, or
//! refused; given back by release, cancel, its TTL, or its connection's end.

use super::*;

impl Reservations {
    /// A permit request. Answers at once (granted or refused), or `None`: it waits, and its
    /// answer goes out on the connection's reply channel.
    pub fn acquire(
        &mut self,
        conn: ConnId,
        request: AcquireRequest,
        now: Duration,
    ) -> Option<Response> {
        let id = request.id;
        let refuse = |reason, message| Some(Response::refused(Some(id), reason, message));
        let Some(&Client {
            peer,
            since: fresh_after,
        }) = self.clients.get(&conn)
        else {
            return refuse(RefusalReason::Invalid, "connection not ready".into());
        };
        if let Some(refused) = self.drained(Some(id)) {
            return Some(refused);
        }
        // Only a uid that may be some model's member waits for a scan to find its model (the
        // daemon forces scans for it): anyone else's request is decided now.
        let unplaced = request.model.is_none()
            && !self.capacity.member_of.contains_key(&peer.process())
            && self.capacity.scanned_at.is_none_or(|t| t < fresh_after)
            && self
                .models()
                .iter()
                .any(|m| m.allowed_users().member(peer.uid));
        let pool = match self.permit_pool(&peer, request.model.as_deref()) {
            Ok(pool) => pool,
            Err(_) if unplaced => None,
            Err((reason, message)) => return refuse(reason, message),
        };
        let (demand, ttl, timeout) =
            match self.permit_demand((!unplaced).then_some(&pool), &request) {
                Ok(d) => d,
                Err(message) => return refuse(RefusalReason::Invalid, message),
            };
        if !unplaced {
            self.report_cache(&pool, &peer, &request, now);
        }
        let duplicate = self
            .waiting
            .values()
            .flatten()
            .any(|w| w.conn == conn && w.id == id);
        if duplicate {
            return refuse(
                RefusalReason::Invalid,
                format!("request id {id} is already waiting on this connection"),
            );
        }
        // What can never fit is refused at once, before any cap or queue: waiting cannot help
        // it. A request whose pool is not known yet is set against the host alone.
        let fit = if unplaced {
            match self.never_here(&demand) {
                Some(s) => Fit::Never(s),
                None => Fit::Later(Shortfall::new(Short::Reading, UNPLACED)),
            }
        } else {
            self.fit_fresh(&peer, &pool, &demand, true, fresh_after)
        };
        let fit = match fit {
            Fit::Never(s) => {
                let message = self.never_message(&pool, unplaced, &s);
                let reason = RefusalReason::TooLarge;
                return Some(self.refusal(id, &peer, &pool, &demand, reason, message));
            }
            Fit::Now { gpus } => Ok(gpus),
            Fit::Later(s) => Err(s),
        };
        let limits = self.config.permits.clone();
        let total = self.permits_of(None);
        // Root's share of max_total (one uid's, max_per_uid) is never given to the others.
        let others = self.permits_where(|u| u != 0);
        let root_share = limits.max_per_uid.min(limits.max_total);
        let over_cap = if self.permits_of(Some(peer.uid)) >= limits.max_per_uid {
            Some(format!(
                "uid {} holds or waits for {} permits (permits.max_per_uid)",
                peer.uid, limits.max_per_uid
            ))
        } else if peer.uid != 0 && others >= limits.max_total - root_share {
            Some(format!(
                "{others} permits held or waiting by accounts other than root (permits.max_total less root's share of max_per_uid)"
            ))
        } else if total >= limits.max_total {
            Some(format!(
                "{total} permits held or waiting (permits.max_total)"
            ))
        } else {
            None
        };
        if let Some(message) = over_cap {
            let reason = RefusalReason::QueueFull;
            return Some(self.refusal(id, &peer, &pool, &demand, reason, message));
        }
        let queued = self
            .waiting
            .get(&pool)
            .map_or(0, |q| q.iter().filter(|w| w.unplaced.is_none()).count());
        let fit = match fit {
            // First come, first served: nobody overtakes a request of the same pool that waits,
            // but for one its own cache holds (it takes nothing the others wait for).
            Ok(_) if queued > 0 && !self.held_in_own_cache(&peer, &pool, &demand) => {
                Err(Shortfall::new(
                    Short::Turn,
                    format!("{queued} request(s) of this model wait ahead"),
                ))
            }
            fit => fit,
        };
        let waiter = |waiting_for: String| Waiter {
            conn,
            id,
            peer,
            pool: pool.clone(),
            demand: demand.clone(),
            arrived: now,
            deadline: now + timeout,
            fresh_after,
            wanted: Wanted::Permit { ttl },
            waiting_for,
            told: true,
            unplaced: None,
        };
        match fit {
            Ok(gpus) => Some(self.grant(waiter(String::new()), gpus, now)),
            Err(s) => {
                tracing::debug!(
                    "{}: permit of pid {} waits: {} (GPU reading consistent: {}; {})",
                    model_label(&pool),
                    peer.pid,
                    s.message,
                    self.capacity.gpu_consistent,
                    self.pools
                        .get(&pool)
                        .map_or("no pool yet".into(), |a| a.describe_holder(peer.process()))
                );
                if queued >= limits.queue {
                    let reason = queue_full_reason(s.short);
                    let message = format!(
                        "{}: {queued} requests wait already (permits.queue); {}",
                        model_label(&pool),
                        s.message
                    );
                    return Some(self.refusal_with(id, &pool, &demand, reason, message, &s));
                }
                let waiter = Waiter {
                    unplaced: unplaced.then(|| Box::new(request)),
                    ..waiter(s.message)
                };
                self.waiting.entry(pool).or_default().push_back(waiter);
                None
            }
        }
    }

    /// What a refusal of a request that can never fit says (`unplaced`: its pool is not known
    /// yet, and the host alone said so).
    pub(super) fn never_message(&self, pool: &Pool, unplaced: bool, s: &Shortfall) -> String {
        if unplaced {
            format!("can never fit on this host: {}", s.message)
        } else {
            format!("{}: can never fit: {}", model_label(pool), s.message)
        }
    }

    /// The pool a permit request belongs to, if the caller may use it.
    pub(super) fn permit_pool(
        &self,
        peer: &Peer,
        model: Option<&str>,
    ) -> Result<Pool, (RefusalReason, String)> {
        let own = self.capacity.member_of.get(&peer.process()).cloned();
        let Some(name) = model else {
            if own.is_none() && !self.config.permits.host_pool_users().may_act(peer.uid) {
                return Err((
                    RefusalReason::NotAllowed,
                    format!(
                        "uid {} may not take permits from the host-wide pool (permits.users): \
                         name a model you are a user of",
                        peer.uid
                    ),
                ));
            }
            return Ok(own);
        };
        check_model_name(name).map_err(|e| (RefusalReason::Invalid, e))?;
        let name = &self.scoped(name, peer.uid);
        let Some(users) = self.users_of(name) else {
            return Err((
                RefusalReason::Invalid,
                format!("no model '{name}' (not in the config, not launched)"),
            ));
        };
        if users.may_act(peer.uid) || own.as_deref() == Some(name) {
            Ok(Some(name.to_string()))
        } else {
            Err((
                RefusalReason::NotAllowed,
                format!(
                    "uid {} may not take permits for model '{name}' (not one of its users)",
                    peer.uid
                ),
            ))
        }
    }

    /// What the caller's allocator says it caches (`cache_bytes`), for its books in `pool`: the
    /// request arrived at `arrived`, its report was read `cache_age` before that.
    pub(super) fn report_cache(
        &mut self,
        pool: &Pool,
        peer: &Peer,
        request: &AcquireRequest,
        arrived: Duration,
    ) {
        if let Some(bytes) = request.cache_bytes {
            let read_at = arrived.saturating_sub(request.cache_age.unwrap_or_default());
            account_in(&mut self.pools, &self.capacity, pool).report_cache(
                peer.process(),
                &self.capacity,
                bytes.min(MAX_BYTES),
                read_at,
            );
        }
    }

    /// What a permit request asks for in `pool`, with its defaults and caps applied (`None`:
    /// its pool is not known yet, and a size it does not name counts as none until it is).
    pub(super) fn permit_demand(
        &self,
        pool: Option<&Pool>,
        r: &AcquireRequest,
    ) -> Result<(Demand, Duration, Duration), String> {
        let limits = &self.config.permits;
        let gpu_bytes = match (r.gpu_bytes, pool) {
            (Some(b), _) => b,
            (None, Some(pool)) => self.default_permit_size(pool),
            (None, None) => 0,
        };
        let ram_bytes = r.ram_bytes.unwrap_or(0);
        if gpu_bytes > MAX_BYTES || ram_bytes > MAX_BYTES {
            return Err("gpu_bytes and ram_bytes must be below 1 PiB".into());
        }
        let ttl = asked_ms(r.ttl_ms, limits.default_ttl, limits.max_ttl);
        let timeout = asked_ms(r.timeout_ms, limits.default_timeout, limits.max_timeout);
        let demand = Demand {
            gpu_bytes_per_gpu: gpu_bytes,
            gpu_count: u32::from(gpu_bytes > 0 || r.gpu.is_some()),
            pinned: r.gpu.map(|g| vec![g]),
            ram_bytes,
        };
        Ok((demand, ttl, timeout))
    }

    /// The size of a permit that names none: the pool's observed p95 once known (never for an
    /// engine that preallocates), else its model's `permit_gpu_memory`, else 0 (a slot).
    pub(super) fn default_permit_size(&self, pool: &Pool) -> u64 {
        let preallocated = pool
            .as_ref()
            .is_some_and(|name| self.capacity.preallocated.contains(name));
        let learner = self.pools.get(pool).map(|a| &a.learner);
        // An engine that preallocated its KV cache (its metrics say so) serves requests out of
        // it: a permit is a slot, whatever its warm-up taught the learner.
        let learner = learner.filter(|_| !preallocated);
        if let Some(l) = learner.filter(|l| l.samples() >= SAMPLES_FOR_DEFAULT) {
            if let Some(p95) = l.quantile(0.95) {
                return p95;
            }
        }
        pool.as_deref()
            .and_then(|name| self.model_config(name))
            .and_then(|m| m.permit_gpu_memory)
            .and_then(|a| a.resolve(self.capacity.largest_gpu_bytes()))
            .unwrap_or(0)
    }

    /// Grants a permit request (taken out of its queue, if it waited) on `gpus`.
    pub(super) fn grant(&mut self, w: Waiter, gpus: Vec<u32>, now: Duration) -> Response {
        let Waiter {
            conn,
            id,
            peer,
            pool,
            demand,
            arrived,
            wanted,
            ..
        } = w;
        let Wanted::Permit { ttl } = wanted else {
            unreachable!("only permits are granted here")
        };
        let demand = &demand;
        let permit = self.new_id();
        let held = self.permits_held(&pool) + 1;
        let capacity = &self.capacity;
        let account = account_in(&mut self.pools, capacity, &pool);
        account.reserve(
            peer.process(),
            capacity,
            (&gpus, demand.gpu_bytes_per_gpu, demand.ram_bytes),
            now,
        );
        account.permit_granted(held);
        account.counts.granted += 1;
        tracing::debug!(
            "permit {permit} of {} granted to pid {}: GPU {} on {gpus:?} ({})",
            model_label(&pool),
            peer.pid,
            fmt_bytes(demand.gpu_bytes_per_gpu),
            account.describe_holder(peer.process())
        );
        let waited = now.saturating_sub(arrived);
        if !waited.is_zero() {
            account.counts.granted_after_wait += 1;
        }
        let gpu = gpus.first().copied();
        self.holdings.insert(
            permit,
            Holding {
                pool: pool.clone(),
                peer,
                gpus,
                gpu_bytes_per_gpu: demand.gpu_bytes_per_gpu,
                ram_bytes: demand.ram_bytes,
                granted_at: now,
                kind: Held::Permit {
                    conn,
                    expires_at: now + ttl,
                },
            },
        );
        if waited >= Duration::from_millis(1) {
            self.event(
                Event::new(
                    Severity::Info,
                    EventKind::PermitGranted,
                    format!(
                        "permit {permit} for {}: GPU {} RAM {} granted to pid {} after waiting {}",
                        model_label(&pool),
                        fmt_bytes(demand.gpu_bytes_per_gpu),
                        fmt_bytes(demand.ram_bytes),
                        peer.pid,
                        crate::units::fmt_duration(Duration::from_millis(ms(waited)))
                    ),
                )
                .about(about(&pool, &peer)),
            );
        }
        Response::Granted {
            id,
            permit,
            gpu,
            gpu_bytes: demand.gpu_bytes_per_gpu,
            ram_bytes: demand.ram_bytes,
            waited_ms: ms(waited),
            ttl_ms: ms(ttl),
        }
    }

    pub(super) fn refusal(
        &mut self,
        id: u64,
        peer: &Peer,
        pool: &Pool,
        demand: &Demand,
        reason: RefusalReason,
        message: String,
    ) -> Response {
        let (gpus, ram) = self.rooms(pool, peer.process(), demand.gpu_bytes_per_gpu);
        let best = demand
            .pinned
            .as_ref()
            .and_then(|p| p.first())
            .and_then(|i| gpus.iter().find(|g| g.index == *i))
            .or_else(|| gpus.iter().max_by_key(|g| g.room));
        let shortfall = Shortfall {
            free_gpu_bytes: best.and_then(|g| g.room).map(|r| r.max(0) as u64),
            free_ram_bytes: ram.room.map(|r| r.max(0) as u64),
            gpu: best.map(|g| g.index),
            ..Shortfall::new(Short::Gpu, String::new())
        };
        self.refusal_with(id, pool, demand, reason, message, &shortfall)
    }

    pub(super) fn refusal_with(
        &mut self,
        id: u64,
        pool: &Pool,
        demand: &Demand,
        reason: RefusalReason,
        message: String,
        shortfall: &Shortfall,
    ) -> Response {
        let account = self.account(pool);
        account.counts.refused += 1;
        let retry_after = match reason {
            RefusalReason::Timeout | RefusalReason::QueueFull | RefusalReason::MaxPermits => {
                Some(ms(account
                    .learner
                    .typical_hold()
                    .unwrap_or(Duration::from_secs(1))
                    .clamp(Duration::from_millis(100), Duration::from_secs(60))))
            }
            _ => None,
        };
        Response::Refused {
            id: Some(id),
            reason,
            message,
            retry_after_ms: retry_after,
            needed: Needed {
                gpu_bytes: demand.gpu_bytes_per_gpu,
                ram_bytes: demand.ram_bytes,
                gpu: demand
                    .pinned
                    .as_ref()
                    .and_then(|p| p.first().copied())
                    .or(shortfall.gpu),
            },
            free: Free {
                gpu_bytes: shortfall.free_gpu_bytes,
                ram_bytes: shortfall.free_ram_bytes,
            },
        }
    }

    /// The holder gives a permit back.
    pub fn release_permit(
        &mut self,
        conn: ConnId,
        id: u64,
        permit: u64,
        now: Duration,
    ) -> Response {
        let owned = self
            .holdings
            .get(&permit)
            .is_some_and(|h| matches!(h.kind, Held::Permit { conn: c, .. } if c == conn));
        if !owned {
            return Response::Error {
                id: Some(id),
                message: format!("permit {permit} is not held by this connection"),
            };
        }
        self.end_permit(permit, now);
        self.admit_waiting(now);
        Response::Released {
            lease: None,
            id: Some(id),
            permit: Some(permit),
        }
    }

    /// Ends a permit: its memory is free for others.
    pub(super) fn end_permit(&mut self, permit: u64, now: Duration) {
        let Some(h) = self.holdings.remove(&permit) else {
            return;
        };
        let held = self.permits_held(&h.pool);
        if let Some(a) = self.pools.get_mut(&h.pool) {
            a.unreserve(
                h.peer.process(),
                (&h.gpus, h.gpu_bytes_per_gpu, h.ram_bytes),
                now,
            );
            a.permit_ended(now.saturating_sub(h.granted_at), held);
        }
    }

    /// The client stopped waiting for request `id`.
    pub fn cancel(&mut self, conn: ConnId, id: u64) -> Option<Response> {
        self.take_waiter(|w| w.conn == conn && w.id == id)?;
        self.waiting.retain(|_, q| !q.is_empty());
        Some(Response::refused(
            Some(id),
            RefusalReason::Cancelled,
            format!("request {id} cancelled by the client"),
        ))
    }

    /// Removes the first waiting permit request that `which` picks.
    pub(super) fn take_waiter(&mut self, which: impl Fn(&Waiter) -> bool) -> Option<Waiter> {
        for queue in self.waiting.values_mut() {
            if let Some(i) = queue.iter().position(&which) {
                return queue.remove(i);
            }
        }
        None
    }
}
