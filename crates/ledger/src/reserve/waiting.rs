//! Time and the queues: waits and TTLs that run out, what fits once memory comes back, trim
//! hints, requests that wait for a scan to find their model, and the loop's tick.

use super::*;

impl Reservations {
    /// Requests whose wait is over are refused; permits past their TTL are revoked.
    pub fn expire(&mut self, now: Duration) {
        let mut changed = false;
        let pools: Vec<Pool> = self.waiting.keys().cloned().collect();
        for pool in pools {
            while let Some(i) = self.waiting.get(&pool).and_then(|q| {
                q.iter().position(|w| {
                    let pending = self
                        .unread_for(&w.peer, &pool, &w.demand, w.fresh_after)
                        .is_some();
                    w.deadline_with_grace(pending) <= now
                })
            }) {
                let w = self.waiting.get_mut(&pool).and_then(|q| q.remove(i));
                let Some(w) = w else { break };
                self.time_out_permit(w, now);
                changed = true;
            }
        }
        while let Some(i) = self.launch_queue.iter().position(|w| w.deadline <= now) {
            let w = self.launch_queue.remove(i).expect("index is valid");
            self.time_out_launch(w);
            changed = true;
        }
        let expired: Vec<u64> = self
            .holdings
            .iter()
            .filter(|(_, h)| matches!(h.kind, Held::Permit { expires_at, .. } if expires_at <= now))
            .map(|(id, _)| *id)
            .collect();
        for permit in expired {
            self.revoke(permit, now);
            changed = true;
        }
        self.waiting.retain(|_, q| !q.is_empty());
        if changed {
            self.admit_waiting(now);
        }
    }

    pub(super) fn time_out_permit(&mut self, w: Waiter, now: Duration) {
        let fit = self.fit(&w.peer, &w.pool, &w.demand, true);
        let shortfall = match fit {
            Fit::Later(s) | Fit::Never(s) => s,
            Fit::Now { .. } => Shortfall::new(Short::Reading, w.waiting_for.clone()),
        };
        let message = format!(
            "{}: needs GPU {} RAM {}, not free within {}: {}",
            model_label(&w.pool),
            fmt_bytes(w.demand.gpu_bytes_total()),
            fmt_bytes(w.demand.ram_bytes),
            crate::units::fmt_duration(Duration::from_millis(ms(now.saturating_sub(w.arrived)))),
            shortfall.message
        );
        let response = self.refusal_with(
            w.id,
            &w.pool,
            &w.demand,
            RefusalReason::Timeout,
            message.clone(),
            &shortfall,
        );
        self.event(
            // Info: a client's own request not granted in time (its answer says so); not news
            // for the operator, and a client can cause thousands a second.
            Event::new(
                Severity::Info,
                EventKind::PermitTimedOut,
                format!("permit for pid {} refused: {message}", w.peer.pid),
            )
            .about(about(&w.pool, &w.peer)),
        );
        self.send(w.conn, response);
    }

    pub(super) fn time_out_launch(&mut self, w: Waiter) {
        let Wanted::Launch(l) = &w.wanted else {
            return;
        };
        let message = format!(
            "model '{}' not started: it did not fit within the queue timeout of {}: {}",
            l.request.model,
            crate::units::fmt_duration(l.queue_timeout),
            w.waiting_for
        );
        self.event(
            // Info: the client hears of it; a client's loop could make many.
            Event::new(
                Severity::Info,
                EventKind::LaunchTimedOut,
                format!("{message} (pid {})", w.peer.pid),
            )
            .about(about(&w.pool, &w.peer)),
        );
        self.send(w.conn, Response::TimedOut { message });
    }

    pub(super) fn revoke(&mut self, permit: u64, now: Duration) {
        let Some(h) = self.holdings.get(&permit) else {
            return;
        };
        let Held::Permit { conn, .. } = h.kind else {
            return;
        };
        let (pool, peer) = (h.pool.clone(), h.peer);
        let held_for = now.saturating_sub(h.granted_at);
        self.end_permit(permit, now);
        if let Some(a) = self.pools.get_mut(&pool) {
            a.counts.expired += 1;
        }
        let message = format!(
            "permit {permit} of {} held by pid {} for {}, past its TTL: revoked",
            model_label(&pool),
            peer.pid,
            crate::units::fmt_duration(Duration::from_millis(ms(held_for)))
        );
        self.event(
            // Info: the holder's own permit ended (it is told); client-caused.
            Event::new(Severity::Info, EventKind::PermitExpired, message.clone())
                .about(about(&pool, &peer)),
        );
        self.send(conn, Response::Expired { permit, message });
    }

    /// Lets in what fits now: the heads of the permit queues, then the head of the launches.
    /// What can never fit any more (the readings or the config changed), wherever it waits, is
    /// refused and leaves its queue: it holds back no one.
    pub fn admit_waiting(&mut self, now: Duration) {
        self.place_unplaced(now);
        let pools: Vec<Pool> = self.waiting.keys().cloned().collect();
        let mut starved = Vec::new();
        for pool in pools {
            // In order; behind one that waits, only those their own cache holds go ahead.
            // Requests still looking for their model are not ahead of anyone.
            let (mut i, mut blocked) = (0, false);
            while let Some(w) = self.waiting.get(&pool).and_then(|q| q.get(i)) {
                let fit = match &w.unplaced {
                    // Its pool is not known yet: only the host can say "never".
                    Some(_) => match self.never_here(&w.demand) {
                        Some(s) => Fit::Never(s),
                        None => {
                            i += 1;
                            continue;
                        }
                    },
                    None => self.fit_fresh(&w.peer, &pool, &w.demand, true, w.fresh_after),
                };
                let may_go = !blocked || self.held_in_own_cache(&w.peer, &pool, &w.demand);
                match fit {
                    Fit::Now { gpus } if may_go => {
                        let w = self
                            .waiting
                            .get_mut(&pool)
                            .and_then(|q| q.remove(i))
                            .expect("it exists");
                        let conn = w.conn;
                        let response = self.grant(w, gpus, now);
                        self.send(conn, response);
                    }
                    Fit::Now { .. } => i += 1,
                    Fit::Never(s) => {
                        let w = self
                            .waiting
                            .get_mut(&pool)
                            .and_then(|q| q.remove(i))
                            .expect("it exists");
                        let message = self.never_message(&pool, w.unplaced.is_some(), &s);
                        let reason = RefusalReason::TooLarge;
                        let response =
                            self.refusal(w.id, &w.peer, &pool, &w.demand, reason, message);
                        self.send(w.conn, response);
                    }
                    Fit::Later(s) => {
                        if let Some(w) = self.waiting.get_mut(&pool).and_then(|q| q.get_mut(i)) {
                            w.waiting_for = s.message;
                            if !blocked && w.demand.gpu_bytes_total() > 0 {
                                let size = w.demand.gpu_bytes_per_gpu;
                                starved.push((pool.clone(), w.peer, w.arrived, size));
                            }
                        }
                        blocked = true;
                        i += 1;
                    }
                }
            }
        }
        self.waiting.retain(|_, q| !q.is_empty());
        for (pool, peer, arrived, size) in starved {
            self.ask_to_trim(&pool, &peer, size, now.saturating_sub(arrived), now);
        }
        let mut i = 0;
        while let Some(w) = self.launch_queue.get(i) {
            match self.launch_fit(w) {
                Fit::Never(s) => {
                    let w = self.launch_queue.remove(i).expect("it exists");
                    tracing::info!(
                        "launch of model '{}' by pid {} refused: it can never fit on this host: {}",
                        model_label(&w.pool),
                        w.peer.pid,
                        s.message
                    );
                    self.send(w.conn, launches::never_fits(&w, &s));
                }
                _ => i += 1,
            }
        }
        while let Some(head) = self.launch_queue.front() {
            match self.launch_fit(head) {
                Fit::Now { gpus } => {
                    let w = self.launch_queue.pop_front().expect("head exists");
                    let conn = w.conn;
                    let response = self.admit_launch(w, gpus, now);
                    self.send(conn, response);
                }
                Fit::Later(s) | Fit::Never(s) => {
                    let stale_only = self.only_stale(head);
                    let Some(head) = self.launch_queue.front_mut() else {
                        break;
                    };
                    head.waiting_for = s.message;
                    if !head.told && !stale_only {
                        // It waits for more than a fresh reading: say so now, once.
                        head.told = true;
                        let answer = self.queued(&self.launch_queue[0], 1);
                        self.send(self.launch_queue[0].conn, answer);
                    }
                    break;
                }
            }
        }
    }

    /// The head of `pool`'s queue waits for `size` of GPU memory: the pool's other processes
    /// that may keep memory cached unused are asked to give it back (`Response::Trim`, at most
    /// once per `TRIM_EVERY` each), those of the waiting request's uid only: a request never
    /// costs another user's server its cache. Those are the holders seen keeping memory beyond
    /// their reservations (the waiting one too when its request is larger than its cached blocks
    /// may be: they cannot serve it, and hold memory it needs), and, once the request has
    /// `waited` `BLIND_TRIM_AFTER`, the pool's (its model's; for the host-wide pool, of no model)
    /// connected processes with nothing reserved and no report of their cache, the waiting
    /// one's own included, whose cache NVML cannot tell from their own memory once it was there
    /// when their baseline was taken (their books are let go while they hold nothing): they
    /// keep nothing a permit needs, and what they give back is free memory.
    pub(super) fn ask_to_trim(
        &mut self,
        pool: &Pool,
        waiting: &Peer,
        size: u64,
        waited: Duration,
        now: Duration,
    ) {
        let usable: Vec<u32> = self
            .capacity
            .gpus
            .iter()
            .filter(|g| g.usable)
            .map(|g| g.index)
            .collect();
        let account = self.pools.get(pool);
        let mut asks: Vec<(ProcessId, u32, u64)> = Vec::new();
        if let Some(account) = account {
            for &gpu in &usable {
                for (holder, bytes) in account.idle_caches(&self.capacity, gpu) {
                    let others =
                        holder != waiting.process() || account.outgrows_cache(holder, gpu, size);
                    if others && !asks.iter().any(|(h, ..)| *h == holder) {
                        asks.push((holder, gpu, bytes));
                    }
                }
            }
        }
        if waited >= BLIND_TRIM_AFTER {
            let reserving: std::collections::HashSet<ProcessId> = self
                .holdings
                .values()
                .filter(|h| h.reserving())
                .map(|h| h.peer.process())
                .collect();
            for client in self.clients.values() {
                let process = client.peer.process();
                // The host-wide pool's are the processes of no model.
                let member = self.capacity.member_of.get(&process) == pool.as_ref();
                if !member
                    || reserving.contains(&process)
                    || account.is_some_and(|a| a.reports(process))
                    || asks.iter().any(|(h, ..)| *h == process)
                {
                    continue;
                }
                let held_on = self.capacity.tree(process).and_then(|t| {
                    usable
                        .iter()
                        .copied()
                        .find(|g| t.gpu_bytes.get(g).is_some_and(|&b| b > 0))
                });
                if let Some(gpu) = held_on {
                    asks.push((process, gpu, 0));
                }
            }
        }
        self.trims.retain(|_, at| now < *at + TRIM_EVERY);
        for (holder, gpu, bytes) in asks {
            if self.trims.contains_key(&holder) {
                continue;
            }
            let conns: Vec<ConnId> = self
                .clients
                .iter()
                .filter(|(_, c)| c.peer.process() == holder && c.peer.uid == waiting.uid)
                .map(|(id, _)| *id)
                .collect();
            if conns.is_empty() {
                continue;
            }
            tracing::debug!(
                "{}: asking pid {} to give back {} of cache on GPU {gpu} (pid {} waits)",
                model_label(pool),
                holder.pid,
                fmt_bytes(bytes),
                waiting.pid
            );
            self.trims.insert(holder, now);
            if let Some(account) = self.pools.get_mut(pool) {
                account.forget_report(holder, now);
            }
            for conn in conns {
                self.send(conn, Response::Trim { gpu, bytes });
            }
        }
    }

    /// Permit requests whose caller's model was not known yet, once a process scan newer than
    /// their connection is in: to their caller's model's queue (behind those waiting there), or
    /// the host-wide pool's if it has none and may use it, else refused.
    pub(super) fn place_unplaced(&mut self, now: Duration) {
        let scanned_at = self.capacity.scanned_at;
        let Some(queue) = self.waiting.get_mut(&None) else {
            return;
        };
        let ready: Vec<usize> = queue
            .iter()
            .enumerate()
            .filter(|(_, w)| w.unplaced.is_some() && scanned_at.is_some_and(|t| t >= w.fresh_after))
            .map(|(i, _)| i)
            .collect();
        let mut placed = Vec::new();
        for i in ready.into_iter().rev() {
            placed.push(queue.remove(i).expect("index is valid"));
        }
        for mut w in placed.into_iter().rev() {
            let request = w.unplaced.take().expect("chosen for it");
            let placed = self.permit_pool(&w.peer, None).and_then(|pool| {
                match self.permit_demand(Some(&pool), &request) {
                    Ok((demand, ..)) => Ok((pool, demand)),
                    Err(message) => Err((RefusalReason::Invalid, message)),
                }
            });
            match placed {
                Ok((pool, demand)) => {
                    self.report_cache(&pool, &w.peer, &request, w.arrived);
                    w.pool = pool.clone();
                    w.demand = demand;
                    // A wait that ended while its model was looked for is decided now.
                    w.deadline = w.deadline.max(now);
                    let queue = self.waiting.entry(pool).or_default();
                    // In arrival order among the host-wide pool's, behind a model's queue.
                    let at = queue
                        .iter()
                        .position(|q| q.arrived > w.arrived && w.pool.is_none());
                    queue.insert(at.unwrap_or(queue.len()), w);
                }
                Err((reason, message)) => {
                    self.send(w.conn, Response::refused(Some(w.id), reason, message));
                }
            }
        }
        self.waiting.retain(|_, q| !q.is_empty());
    }

    /// True while a permit request waits for a process scan to find its caller's model: the
    /// loop then has one taken at once.
    pub fn wants_fresh_scan(&self) -> bool {
        self.waiting
            .get(&None)
            .is_some_and(|q| q.iter().any(|w| w.unplaced.is_some()))
    }

    /// After a tick of the loop: the new capacity, the launched servers' progress, expiries and
    /// admissions. Returns what the loop must apply.
    pub fn tick(&mut self, now: Duration, capacity: Capacity) -> TickReport {
        self.capacity = capacity;
        for (pool, account) in self.pools.iter_mut() {
            account.observe(pool.as_deref(), &self.capacity);
        }
        self.watch_leases(now);
        // What fits on the new reading first: a request that waited for a reading newer than
        // itself is decided on it, not refused because its (zero) timeout passed meanwhile.
        self.admit_waiting(now);
        self.expire(now);
        self.forget_unused();
        let summaries = self.event_limit.roll(now);
        self.events.extend(summaries);
        if self.events_dropped > 0 {
            let n = std::mem::take(&mut self.events_dropped);
            self.events.push(Event::new(
                Severity::Warning,
                EventKind::EventsDropped,
                format!("{n} reservation events were not kept (more than {MAX_EVENTS} between two ticks)"),
            ));
        }
        let registered = self
            .holdings
            .values()
            .filter_map(|h| match &h.kind {
                Held::Lease(l) => Some((h.peer.process(), l.model.clone())),
                Held::Permit { .. } => None,
            })
            .collect();
        TickReport {
            events: std::mem::take(&mut self.events),
            events_suppressed: self.event_limit.take_suppressed(),
            registered,
            launched_models: self.launched.values().cloned().collect(),
        }
    }

    /// Pools and launched models nothing refers to any more.
    pub(super) fn forget_unused(&mut self) {
        let leased: Vec<String> = self
            .holdings
            .values()
            .filter(|h| matches!(h.kind, Held::Lease(_)))
            .filter_map(|h| h.pool.clone())
            .collect();
        let queued: Vec<String> = self
            .launch_queue
            .iter()
            .filter_map(|w| w.pool.clone())
            .collect();
        self.launched
            .retain(|name, _| leased.contains(name) || queued.contains(name));
        let waiting: Vec<Pool> = self.waiting.keys().cloned().collect();
        let models = &self.capacity.models;
        let config = &self.config;
        let launched = &self.launched;
        // The host-wide pool and known models keep their books (their totals and learned
        // sizes); a launched model's go with it.
        self.pools.retain(|pool, a| {
            !a.unused()
                || waiting.contains(pool)
                || pool.as_ref().is_none_or(|n| {
                    models.contains_key(n) || config.model(n).is_some() || launched.contains_key(n)
                })
        });
    }
}
