//! The room a demand has: free memory less the floors and every other pool's promises, then a
//! model's slots and budget, a uid's cap and the other accounts' share (root keeps the rest);
//! whether a request is held in its caller's own cache.

use super::*;

impl Reservations {
    /// A pool's books; a new one starts from the pool's use now (its baseline).
    pub(super) fn account(&mut self, pool: &Pool) -> &mut Account {
        account_in(&mut self.pools, &self.capacity, pool)
    }

    /// The models in force: the config's, then those launched without a `[[model]]`.
    pub(super) fn models(&self) -> ModelsInForce<'_> {
        ModelsInForce::new(&self.config, &self.launched)
    }

    pub(super) fn model_config(&self, name: &str) -> Option<&ModelConfig> {
        self.models().get(name)
    }

    /// Who may act for a model (launch it, take its permits), if it exists.
    pub(super) fn users_of(&self, name: &str) -> Option<Users> {
        self.model_config(name).map(|m| m.allowed_users())
    }

    /// The room for `holder`'s next reservation of `pool` (`gpu_bytes` per GPU) on every GPU and
    /// in RAM: free memory minus the floors and what every reservation may still take, what the
    /// next one would strand of the holder's cache included, less the holder's own cache.
    pub(super) fn rooms(
        &self,
        pool: &Pool,
        holder: ProcessId,
        gpu_bytes: u64,
    ) -> (Vec<GpuRoom>, RamRoom) {
        let consistent = self.capacity.gpu_consistent;
        let own = self.pools.get(pool);
        let gpus = self
            .capacity
            .gpus
            .iter()
            .map(|g| {
                let others: i64 = self
                    .pools
                    .iter()
                    .filter(|(p, _)| *p != pool)
                    .map(|(_, a)| a.gpu_promised(g.index, consistent) as i64)
                    .sum();
                let mine = own.map_or(0, |a| {
                    a.gpu_promised_beside(holder, &self.capacity, g.index, consistent, gpu_bytes)
                });
                let room = (g.usable)
                    .then(|| g.free.map(|f| f as i64 - g.floor as i64 - others - mine))
                    .flatten();
                GpuRoom {
                    index: g.index,
                    room,
                    free: g.free.filter(|_| g.usable),
                    floor: g.floor,
                    promised: (others + mine.max(0)) as u64,
                    preferred: own.is_some_and(|a| a.on_gpu(g.index)),
                }
            })
            .collect();
        let ram = &self.capacity.ram;
        let others: i64 = self
            .pools
            .iter()
            .filter(|(p, _)| *p != pool)
            .map(|(_, a)| a.ram_promised())
            .sum();
        let mine = own.map_or(0, |a| a.ram_promised());
        let ram_room = RamRoom {
            room: ram
                .available
                .map(|a| a as i64 - ram.floor as i64 - others - mine),
            available: ram.available,
            floor: ram.floor,
            promised: (others + mine) as u64,
        };
        (gpus, ram_room)
    }

    /// Why `demand` can never fit on this host, whatever its pool: more than the host's memory
    /// above its floors, or a GPU on a host without one (`admission::never`).
    pub(super) fn never_here(&self, demand: &Demand) -> Option<Shortfall> {
        never(demand, &self.capacity.ceilings())
    }

    /// Does `demand` fit `pool` now: never on this host, never or not now within the uid's cap
    /// and the model's slots and budget (what can never fit first, whatever else waits), then
    /// the memory.
    pub(super) fn fit(&self, peer: &Peer, pool: &Pool, demand: &Demand, permit: bool) -> Fit {
        if let Some(s) = self.never_here(demand) {
            return Fit::Never(s);
        }
        let mut limits = self.uid_cap_fit(peer.uid, pool, demand);
        limits.extend(self.others_share_fit(peer.uid, pool, demand));
        if let Some(name) = pool {
            if let Some(model) = self.model_config(name) {
                limits.extend(self.budget_fit(name, model, demand, permit));
            }
        }
        let worst = match limits.iter().position(|f| matches!(f, Fit::Never(_))) {
            Some(i) => Some(limits.swap_remove(i)),
            None => limits.into_iter().next(),
        };
        if let Some(f) = worst {
            return f;
        }
        let (gpus, ram) = self.rooms(pool, peer.process(), demand.gpu_bytes_per_gpu);
        match place(demand, &gpus, &ram) {
            Ok(gpus) => Fit::Now { gpus },
            Err(s) => Fit::Later(s),
        }
    }

    /// `fit`, on a GPU reading that can decide it (`unread_for`).
    pub(super) fn fit_fresh(
        &self,
        peer: &Peer,
        pool: &Pool,
        demand: &Demand,
        permit: bool,
        fresh_after: Duration,
    ) -> Fit {
        match self.fit(peer, pool, demand, permit) {
            Fit::Now { gpus } => match self.unread_for(peer, pool, demand, fresh_after) {
                Some(why) => Fit::Later(Shortfall::new(Short::Reading, why)),
                None => Fit::Now { gpus },
            },
            fit => fit,
        }
    }

    /// The GPU reading a permit request waits for before it is decided, if the latest will not
    /// do: one taken after `fresh_after` (the request's connection's start: memory a client
    /// allocated before it asked, weights it just loaded, is in the reading its requests are
    /// decided on); and, while its caller has no books in `pool` yet, one that read the GPUs'
    /// process lists. The books open on what that reading shows the caller holding: its
    /// baseline, settled at once. Opened on lists of an earlier pass (most readings have none
    /// while nothing is reserved), they would settle only once at rest, taking the cache its
    /// first permits left for its own memory: its cache would never serve it again (issue 41's
    /// caching server in no model, served 3 requests of 30).
    pub(super) fn unread_for(
        &self,
        peer: &Peer,
        pool: &Pool,
        demand: &Demand,
        fresh_after: Duration,
    ) -> Option<&'static str> {
        if self.stale_for(demand, fresh_after) {
            return Some(FRESH_READING);
        }
        let opens_books = demand.gpu_bytes_total() > 0
            && !self
                .pools
                .get(pool)
                .is_some_and(|a| a.has_books(peer.process()));
        (opens_books && self.capacity.gpu_processes_stale).then_some(PROCESS_LISTS)
    }

    pub(super) fn stale_for(&self, demand: &Demand, fresh_after: Duration) -> bool {
        demand.gpus_wanted() > 0 && self.capacity.gpu_sampled_at.is_none_or(|t| t < fresh_after)
    }

    /// True while a GPU reading taken now could let a request in: one waits only for a reading
    /// newer than itself or one with the process lists (`unread_for`), or a permit ended while
    /// requests wait (what became of its memory, cached for its holder or free, is known from
    /// the first reading after its end). The loop then has one taken at once, with the lists,
    /// instead of at its next tick.
    pub fn wants_fresh_gpu(&self) -> bool {
        let unread_permit = self.waiting.iter().any(|(pool, q)| {
            q.front().is_some_and(|w| {
                self.unread_for(&w.peer, pool, &w.demand, w.fresh_after)
                    .is_some()
            })
        });
        let stale_launch = self
            .launch_queue
            .front()
            .is_some_and(|w| self.stale_for(&w.demand, w.fresh_after));
        let ended_while_waiting = (!self.waiting.is_empty() || !self.launch_queue.is_empty())
            && self.pools.values().any(Account::ended_unseen);
        unread_permit || stale_launch || ended_while_waiting
    }

    /// Whether `demand` would come wholly out of the memory its caller's processes already hold
    /// beyond their reservations (their allocator's cache), on one GPU.
    pub(super) fn held_in_own_cache(&self, peer: &Peer, pool: &Pool, demand: &Demand) -> bool {
        if demand.ram_bytes > 0 || demand.gpu_bytes_per_gpu == 0 || demand.gpu_count != 1 {
            return false;
        }
        let Some(account) = self.pools.get(pool) else {
            return false;
        };
        self.capacity
            .gpus
            .iter()
            .filter(|g| g.usable)
            .filter(|g| demand.pinned.as_ref().is_none_or(|p| p.contains(&g.index)))
            .any(|g| {
                account.own_cache_holds(
                    peer.process(),
                    &self.capacity,
                    g.index,
                    demand.gpu_bytes_per_gpu,
                )
            })
    }

    /// Root, and a uid the config names for the `[[model]]` it asks for (the model's budget
    /// bounds it): the reservation caps are not theirs.
    fn uncapped(&self, uid: u32, pool: &Pool) -> bool {
        let named = pool
            .as_deref()
            .and_then(|name| self.config.model(name))
            .is_some_and(|m| m.allowed_users().may_act(uid));
        uid == 0 || named
    }

    /// `[clients] max_reserved_per_uid` (half of the memory by default): what a uid holds
    /// reserved (loading launches and permits) plus `demand`, against the cap: what it is short
    /// of (none when within it). Root is not capped, nor a uid the config names for the model
    /// it asks for (a `[[model]]`'s users): the model's budget bounds them.
    pub(super) fn uid_cap_fit(&self, uid: u32, pool: &Pool, demand: &Demand) -> Vec<Fit> {
        let Some(cap) = self.config.clients.max_reserved_per_uid else {
            return Vec::new();
        };
        if self.uncapped(uid, pool) {
            return Vec::new();
        }
        let (gpu_held, ram_held) = self
            .holdings
            .values()
            .filter(|h| h.peer.uid == uid && h.reserving())
            .fold((0u64, 0u64), |(g, r), h| {
                (
                    g + h.gpu_bytes_per_gpu * h.gpus.len() as u64,
                    r + h.ram_bytes,
                )
            });
        self.cap_fit(
            cap,
            (gpu_held, ram_held),
            demand,
            |what, held, asked, limit| {
                format!(
                    "uid {uid}: {what} {} reserved + {} asked > {} (clients.max_reserved_per_uid)",
                    fmt_bytes(held),
                    fmt_bytes(asked),
                    fmt_bytes(limit)
                )
            },
        )
    }

    /// `[clients] max_reserved` (half of the memory by default): what all accounts other than
    /// root hold reserved and not yet in use, together (loading launches and permits, as far as
    /// no memory their processes took backs them: what their books still promise), plus
    /// `demand`, against the cap: what it is short of (none when within it). However many
    /// accounts (or subordinate uids of one user) reserve memory they never use, root keeps the
    /// rest: root is not capped, nor a uid the config names for the model it asks for (the
    /// model's budget bounds them), as for `max_reserved_per_uid`.
    pub(super) fn others_share_fit(&self, uid: u32, pool: &Pool, demand: &Demand) -> Vec<Fit> {
        let Some(cap) = self.config.clients.max_reserved else {
            return Vec::new();
        };
        if self.uncapped(uid, pool) {
            return Vec::new();
        }
        let others: std::collections::HashSet<ProcessId> = self
            .holdings
            .values()
            .filter(|h| h.peer.uid != 0 && h.reserving())
            .map(|h| h.peer.process())
            .collect();
        let whose = |p: ProcessId| others.contains(&p);
        let consistent = self.capacity.gpu_consistent;
        let gpu_held: u64 = self
            .capacity
            .gpus
            .iter()
            .flat_map(|g| {
                self.pools
                    .values()
                    .map(move |a| a.gpu_promised_by(g.index, consistent, &whose))
            })
            .sum();
        let ram_held: u64 = self
            .holdings
            .values()
            .filter(|h| h.peer.uid != 0 && h.reserving())
            .map(|h| h.ram_bytes)
            .sum();
        self.cap_fit(cap, (gpu_held, ram_held), demand, |what, held, asked, limit| {
            format!(
                "accounts other than root: {what} {} reserved and not in use + {} asked > {} (clients.max_reserved)",
                fmt_bytes(held),
                fmt_bytes(asked),
                fmt_bytes(limit)
            )
        })
    }

    /// What `held` (GPU memory over all GPUs, RAM) plus `demand` is short of against `cap`, a
    /// size or a share of the host's memory (none when within it); `why` words a shortfall from
    /// what it is of ("GPU memory", "RAM"), the bytes held, asked and the limit.
    fn cap_fit(
        &self,
        cap: crate::units::Amount,
        (gpu_held, ram_held): (u64, u64),
        demand: &Demand,
        why: impl Fn(&str, u64, u64, u64) -> String,
    ) -> Vec<Fit> {
        let gpu_total = self
            .capacity
            .gpus
            .iter()
            .map(|g| g.total)
            .sum::<Option<u64>>()
            .filter(|&t| t > 0);
        let check = |held: u64, asked: u64, total: Option<u64>, what: &str| {
            let limit = cap.resolve(total)?;
            limit_fit(Short::UidCap, held, asked, limit, || {
                why(what, held, asked, limit)
            })
        };
        [
            check(gpu_held, demand.gpu_bytes_total(), gpu_total, "GPU memory"),
            check(ram_held, demand.ram_bytes, self.capacity.ram.total, "RAM"),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    /// A model's `max_permits` and budget, before the memory: what they are short of (none
    /// when they allow it).
    pub(super) fn budget_fit(
        &self,
        name: &str,
        model: &ModelConfig,
        demand: &Demand,
        permit: bool,
    ) -> Vec<Fit> {
        let account = self.pools.get(&Some(name.to_string()));
        let mut short = Vec::new();
        if let Some(max) = model.max_permits.filter(|_| permit) {
            let held = self.permits_held(&Some(name.to_string()));
            if max == 0 {
                short.push(Fit::Never(Shortfall::new(
                    Short::MaxPermits,
                    format!("model '{name}': max_permits is 0"),
                )));
            } else if held >= max as usize {
                short.push(Fit::Later(Shortfall::new(
                    Short::MaxPermits,
                    format!("model '{name}': {held} of max_permits {max} permits held"),
                )));
            }
        }
        let (ram_budget, gpu_budget) =
            model.budget_bytes(self.capacity.ram.total, self.capacity.largest_gpu_bytes());
        // A launched model (no `[[model]]`) gives permits only out of what it declared: one
        // that declared nothing has no budget, and its permits must not be unbounded.
        let launched = permit && self.config.model(name).is_none();
        let check = |budget: Option<u64>, committed: u64, asked: u64, what: &str| {
            let budget = if launched {
                budget.unwrap_or(0)
            } else {
                budget?
            };
            limit_fit(Short::Budget, committed, asked, budget, || {
                format!(
                    "model '{name}': {what} {} committed + {} asked > budget {}{}",
                    fmt_bytes(committed),
                    fmt_bytes(asked),
                    fmt_bytes(budget),
                    if launched {
                        " (a launched model's permits come out of the memory its launch declared)"
                    } else {
                        ""
                    }
                )
            })
        };
        short.extend(check(
            gpu_budget,
            account.map_or(0, Account::gpu_committed),
            demand.gpu_bytes_total(),
            "GPU memory",
        ));
        short.extend(check(
            ram_budget,
            account.map_or(0, Account::ram_committed),
            demand.ram_bytes,
            "RAM",
        ));
        short
    }
}
