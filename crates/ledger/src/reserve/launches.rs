//! Launches: the launch queue (root's first), admission under the launch lock, the lease that
//! holds it until the server is ready or gone.

use super::*;

impl Reservations {
    /// A launch request. Returns the answer to send now: `admitted` or `refused`, `queued` (it
    /// waits; the final answer follows on the reply channel), or `None` when it only waits for a
    /// GPU reading newer than itself (then `queued` is sent only if it has to wait for more).
    pub fn launch(
        &mut self,
        conn: ConnId,
        request: LaunchRequest,
        process: Arc<dyn Launched>,
        now: Duration,
    ) -> Option<Response> {
        let refuse = |reason, message| Some(Response::refused(None, reason, message));
        let Some(&Client { peer, since }) = self.clients.get(&conn) else {
            return refuse(RefusalReason::Invalid, "connection not ready".into());
        };
        if let Some(refused) = self.drained(None) {
            return Some(refused);
        }
        let request = match self.check_launch(&peer, request) {
            Ok(r) => r,
            Err((reason, message)) => return refuse(reason, message),
        };
        let l = &self.config.launch;
        let ready_timeout = asked_ms(
            request.ready_timeout_ms,
            l.ready_timeout,
            l.max_ready_timeout,
        );
        let queue_timeout = asked_ms(
            request.queue_timeout_ms,
            l.queue_timeout,
            l.max_queue_timeout,
        );
        let demand = match self.launch_demand(&request) {
            Ok(d) => d,
            Err(message) => return refuse(RefusalReason::Invalid, message),
        };
        let pool = Some(request.model.clone());
        let waiter = Waiter {
            conn,
            id: 0,
            peer,
            pool,
            demand,
            arrived: now,
            deadline: now + queue_timeout,
            fresh_after: since,
            unplaced: None,
            wanted: Wanted::Launch(Box::new(LaunchWait {
                request,
                process,
                ready_timeout,
                queue_timeout,
            })),
            waiting_for: String::new(),
            told: true,
        };
        let slot = self.queue_slot(peer.uid);
        let alone = slot == 0;
        match self.launch_fit(&waiter) {
            Fit::Now { gpus } if alone => Some(self.admit_launch(waiter, gpus, now)),
            Fit::Never(s) => Some(never_fits(&waiter, &s)),
            // Only a GPU reading newer than the request is missing: it comes within a tick.
            Fit::Later(_) if alone && self.only_stale(&waiter) => {
                let mut waiter = waiter;
                waiter.told = false;
                self.launch_queue.insert(slot, waiter);
                None
            }
            fit => {
                let mut waiter = waiter;
                // Behind others it waits for its turn first (what it waits for at the head is
                // said once it gets there).
                waiter.waiting_for = match fit {
                    Fit::Later(s) if alone => s.message,
                    _ => "its turn: launches ahead of it in the queue".into(),
                };
                let answer = self.queued(&waiter, slot + 1);
                self.launch_queue.insert(slot, waiter);
                Some(answer)
            }
        }
    }

    /// True if a launch would be admitted now but for a GPU reading older than itself.
    pub(super) fn only_stale(&self, w: &Waiter) -> bool {
        self.stale_for(&w.demand, w.fresh_after)
            && matches!(self.launch_fit_now(w), Fit::Now { .. })
    }

    /// The `queued` answer (logged once).
    pub(super) fn queued(&self, w: &Waiter, position: usize) -> Response {
        tracing::info!(
            "launch of model '{}' by pid {} (uid {}) queued at position {position}: {}",
            model_label(&w.pool),
            w.peer.pid,
            w.peer.uid,
            w.waiting_for
        );
        Response::Queued {
            position,
            waiting_for: w.waiting_for.clone(),
        }
    }

    /// Bounds and authorizes a launch request.
    pub(super) fn check_launch(
        &mut self,
        peer: &Peer,
        mut r: LaunchRequest,
    ) -> Result<LaunchRequest, (RefusalReason, String)> {
        let invalid = |e: String| (RefusalReason::Invalid, e);
        check_model_name(&r.model).map_err(|e| invalid(format!("--model: {e}")))?;
        r.model = self.scoped(&r.model, peer.uid);
        check_model_name(&r.model).map_err(|e| invalid(format!("--model: {e}")))?;
        if let Some(url) = &r.ready_url {
            check_url("--ready-url", url).map_err(invalid)?;
            crate::config::check_ready_url(url).map_err(|e| invalid(format!("--ready-url {e}")))?;
            // Another account may not have root poll the host's other addresses (services of
            // other users there) every 250 ms at a path of its choosing.
            if peer.uid != 0 && !crate::config::ready_url_is_loopback(url) {
                return Err(invalid(format!(
                    "--ready-url '{url}': only a loopback address (localhost, 127.0.0.1, ::1) for an account other than root"
                )));
            }
        }
        if let Some(url) = &r.metrics_url {
            check_url("--metrics-url", url).map_err(invalid)?;
            crate::config::check_metrics_url(url)
                .map_err(|e| invalid(format!("--metrics-url {e}")))?;
        }
        if let Some(n) = r.planned_kv_tokens {
            crate::config::check_planned_kv_tokens(n)
                .map_err(|e| invalid(format!("--planned-kv-tokens {e}")))?;
        }
        if r.cuda_visible_devices
            .as_ref()
            .is_some_and(|v| v.len() > 1024)
        {
            return Err(invalid("CUDA_VISIBLE_DEVICES is too long".into()));
        }
        r.command.truncate(MAX_COMMAND_WORDS);
        let mut budget = MAX_COMMAND_BYTES;
        for word in &mut r.command {
            let mut keep = budget.min(word.len());
            while !word.is_char_boundary(keep) {
                keep -= 1;
            }
            word.truncate(keep);
            budget -= keep;
        }
        let name = r.model.clone();
        // A launched model's users are its launcher.
        let allowed = match self.model_config(&name) {
            Some(m) => m.allowed_users().may_act(peer.uid),
            None => !self
                .launch_queue
                .iter()
                .any(|w| w.pool.as_deref() == Some(&name) && w.peer.uid != peer.uid),
        };
        if !allowed {
            return Err((
                RefusalReason::NotAllowed,
                format!(
                    "uid {} may not launch model '{name}': it belongs to other users (its [[model]] users, or whoever launched it first)",
                    peer.uid
                ),
            ));
        }
        let c = &self.config.clients;
        let leases_of = |uid: Option<u32>| {
            self.holdings
                .values()
                .filter(|h| matches!(h.kind, Held::Lease(_)) && uid.is_none_or(|u| h.peer.uid == u))
                .count()
        };
        if leases_of(Some(peer.uid)) >= c.max_leases_per_uid || leases_of(None) >= c.max_leases {
            return Err((
                RefusalReason::QueueFull,
                format!(
                    "too many launched models still running (clients.max_leases_per_uid {}, max_leases {})",
                    c.max_leases_per_uid, c.max_leases
                ),
            ));
        }
        let max = self.config.clients.max_launches_per_uid;
        if self.launches_of(peer.uid) >= max {
            return Err((
                RefusalReason::QueueFull,
                format!(
                    "uid {} has {max} launches waiting or loading (clients.max_launches_per_uid)",
                    peer.uid
                ),
            ));
        }
        Ok(r)
    }

    /// What a launch declares: its flags, else its `[[model]]` budgets.
    pub(super) fn launch_demand(&self, r: &LaunchRequest) -> Result<Demand, String> {
        let (ram_budget, gpu_budget) = self.config.model(&r.model).map_or((None, None), |m| {
            m.budget_bytes(self.capacity.ram.total, self.capacity.largest_gpu_bytes())
        });
        let gpu_bytes = r.gpu_memory_bytes.or(gpu_budget).unwrap_or(0);
        let ram_bytes = r.ram_bytes.or(ram_budget).unwrap_or(0);
        if gpu_bytes > MAX_BYTES || ram_bytes > MAX_BYTES {
            return Err("--gpu-mem and --ram must be below 1 PiB".into());
        }
        let pinned = match (r.gpu, &r.cuda_visible_devices) {
            (Some(index), _) => Some(vec![index]),
            (None, Some(visible)) if !visible.trim().is_empty() => {
                Some(parse_visible_devices(visible, &self.capacity)?)
            }
            _ => None,
        };
        let count = match (&pinned, r.gpus) {
            (Some(p), _) => p.len() as u32,
            (None, Some(n)) if n > 64 => return Err("--gpus: at most 64".into()),
            (None, Some(n)) => n.max(1),
            (None, None) => u32::from(gpu_bytes > 0),
        };
        Ok(Demand {
            gpu_bytes_per_gpu: gpu_bytes.div_ceil(u64::from(count.max(1))),
            gpu_count: count,
            pinned,
            ram_bytes,
        })
    }

    /// Models loading that hold the launch lock against a launch by `uid`: all of them, but for
    /// root only root's (another user's launch that loads for hours, or never, must not keep the
    /// host's own servers from starting; memory admission still counts it).
    pub(super) fn loading_against(&self, uid: u32) -> usize {
        self.holdings
            .values()
            .filter(|h| h.loading())
            .filter(|h| !privileged(uid) || privileged(h.peer.uid))
            .count()
    }

    /// Where a launch by `uid` joins the queue: root's launches go ahead of everyone else's (first
    /// come, first served within each), so no user can hold them back.
    pub(super) fn queue_slot(&self, uid: u32) -> usize {
        if privileged(uid) {
            self.launch_queue
                .iter()
                .take_while(|w| privileged(w.peer.uid))
                .count()
        } else {
            self.launch_queue.len()
        }
    }

    /// A launch fits when the lock is free, no warn floor is crossed and its memory fits.
    pub(super) fn launch_fit(&self, w: &Waiter) -> Fit {
        match self.launch_fit_now(w) {
            Fit::Now { .. } if self.stale_for(&w.demand, w.fresh_after) => {
                Fit::Later(Shortfall::new(Short::Reading, FRESH_READING))
            }
            fit => fit,
        }
    }

    /// `launch_fit` on the reading there is, however old.
    pub(super) fn launch_fit_now(&self, w: &Waiter) -> Fit {
        let fit = self.fit(&w.peer, &w.pool, &w.demand, false);
        if matches!(fit, Fit::Never(_)) {
            return fit;
        }
        let max = self.config.launch.max_loading;
        if self.loading_against(w.peer.uid) >= max {
            return Fit::Later(Shortfall::new(
                Short::LaunchLock,
                "the launch lock: another model is loading",
            ));
        }
        if let Some(why) = &self.capacity.launch_pause {
            return Fit::Later(Shortfall::new(Short::LaunchLock, why.clone()));
        }
        fit
    }

    pub(super) fn admit_launch(&mut self, w: Waiter, gpus: Vec<u32>, now: Duration) -> Response {
        let Wanted::Launch(l) = w.wanted else {
            unreachable!("only launches are admitted here")
        };
        let LaunchWait {
            request,
            process,
            ready_timeout,
            ..
        } = *l;
        let lease_id = self.new_id();
        let model = request.model.clone();
        let need = &w.demand;
        let mut env = vec![
            ("GPUGUARD_MODEL".to_string(), model.clone()),
            ("GPUGUARD_LEASE".to_string(), lease_id.to_string()),
            (
                "GPUGUARD_GPU_MEMORY_BYTES".to_string(),
                need.gpu_bytes_total().to_string(),
            ),
            ("GPUGUARD_RAM_BYTES".to_string(), need.ram_bytes.to_string()),
        ];
        if !gpus.is_empty() {
            let list: Vec<String> = gpus.iter().map(u32::to_string).collect();
            // NVML numbers GPUs by PCI bus id; make CUDA number them the same way.
            env.push(("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into()));
            env.push(("CUDA_VISIBLE_DEVICES".into(), list.join(",")));
            if let Some(fraction) = self.memory_fraction(&gpus, need.gpu_bytes_per_gpu) {
                env.push(("GPUGUARD_GPU_MEMORY_FRACTION".into(), fraction));
            }
        }
        let capacity = &self.capacity;
        let account = account_in(&mut self.pools, capacity, &w.pool);
        account.reserve(
            w.peer.process(),
            capacity,
            (&gpus, need.gpu_bytes_per_gpu, need.ram_bytes),
            now,
        );
        let by_gpu = need.gpu_bytes_per_gpu > 0;
        let usage = if by_gpu {
            account.usage().gpu_total_bytes()
        } else {
            account.usage().ram_bytes
        };
        // Also kept for a configured model launched with a metrics URL or a planned KV cache
        // (its [[model]] wins for everything else).
        let engine_given = request.metrics_url.is_some() || request.planned_kv_tokens.is_some();
        if self.config.model(&model).is_none() || engine_given {
            let launched = self.launched.entry(model.clone()).or_insert_with(|| {
                ModelConfig::launched(&model, w.peer.uid, need.ram_bytes, need.gpu_bytes_total())
            });
            if request.metrics_url.is_some() {
                launched.metrics_url = request.metrics_url.clone();
            }
            if request.planned_kv_tokens.is_some() {
                launched.planned_kv_tokens = request.planned_kv_tokens;
            }
        }
        let ready_url = request
            .ready_url
            .clone()
            .or_else(|| lease::guess_ready_url(&request.command))
            .filter(|url| w.peer.uid == 0 || crate::config::ready_url_is_loopback(url));
        self.event(
            Event::new(
                Severity::Info,
                EventKind::LaunchAdmitted,
                format!(
                    "model '{model}' admitted as lease {lease_id} (pid {}, uid {}) on GPU(s) {gpus:?}: GPU {} RAM {}; waited {}{}",
                    w.peer.pid,
                    w.peer.uid,
                    fmt_bytes(need.gpu_bytes_total()),
                    fmt_bytes(need.ram_bytes),
                    crate::units::fmt_duration(Duration::from_millis(ms(now.saturating_sub(w.arrived)))),
                    match (&request.ready_url, &ready_url) {
                        (None, Some(url)) => format!("; ready when {url} answers (a known server)"),
                        _ => String::new(),
                    }
                ),
            )
            .about(about(&w.pool, &w.peer)),
        );
        let lease = Lease::new(
            NewLease {
                model,
                process,
                ready_timeout,
                by_gpu,
                ready_url,
            },
            usage,
            now,
        );
        self.holdings.insert(
            lease_id,
            Holding {
                pool: w.pool,
                peer: w.peer,
                gpus: gpus.clone(),
                gpu_bytes_per_gpu: need.gpu_bytes_per_gpu,
                ram_bytes: need.ram_bytes,
                granted_at: now,
                kind: Held::Lease(Box::new(lease)),
            },
        );
        Response::Admitted {
            lease: lease_id,
            gpus,
            env,
        }
    }

    /// The share of its GPUs a launch may take, for `vllm --gpu-memory-utilization`: its
    /// per-GPU need over the smallest chosen GPU's memory, rounded down.
    pub(super) fn memory_fraction(&self, gpus: &[u32], per_gpu: u64) -> Option<String> {
        let total = gpus
            .iter()
            .filter_map(|g| self.capacity.gpu(*g).and_then(|c| c.total))
            .min()?;
        if per_gpu == 0 || total == 0 {
            return None;
        }
        let fraction = (per_gpu as f64 / total as f64).min(1.0);
        Some(format!("{:.4}", (fraction * 10_000.0).floor() / 10_000.0))
    }

    /// Ends a launch's loading early: its owner or root only.
    pub fn release_lease(&mut self, peer: Peer, lease: u64, now: Duration) -> Response {
        let Some(h) = self.holdings.get_mut(&lease) else {
            return Response::Error {
                id: None,
                message: format!("no lease {lease}"),
            };
        };
        if !peer.is_root() && h.peer.uid != peer.uid {
            return Response::Error {
                id: None,
                message: format!(
                    "lease {lease} belongs to uid {}, not to uid {}",
                    h.peer.uid, peer.uid
                ),
            };
        }
        let Held::Lease(l) = &mut h.kind else {
            return Response::Error {
                id: None,
                message: format!("{lease} is a permit, not a lease"),
            };
        };
        let model = l.model.clone();
        if l.state == LeaseState::Loading {
            self.lease_ready(lease, now);
        }
        tracing::info!(
            "lease {lease} of model '{model}' released by uid {}",
            peer.uid
        );
        self.admit_waiting(now);
        Response::Released {
            lease: Some(lease),
            id: None,
            permit: None,
        }
    }

    /// A lease's model is loaded: its memory is now the model's own.
    pub(super) fn lease_ready(&mut self, lease: u64, now: Duration) {
        let Some(h) = self.holdings.get_mut(&lease) else {
            return;
        };
        if let Held::Lease(l) = &mut h.kind {
            l.set_ready();
        }
        let (pool, gpus, per_gpu, ram) = (
            h.pool.clone(),
            h.gpus.clone(),
            h.gpu_bytes_per_gpu,
            h.ram_bytes,
        );
        let holder = h.peer.process();
        if let Some(a) = self.pools.get_mut(&pool) {
            a.unreserve(holder, (&gpus, per_gpu, ram), now);
            a.rebase(holder);
        }
    }

    /// Leases whose process died, or whose model became ready.
    pub(super) fn watch_leases(&mut self, now: Duration) {
        let settle = self.config.launch.settle;
        let mut ready = Vec::new();
        let mut dead = Vec::new();
        for (id, h) in self.holdings.iter_mut() {
            let Held::Lease(l) = &mut h.kind else {
                continue;
            };
            if l.exited() {
                dead.push(*id);
                continue;
            }
            if l.state != LeaseState::Loading {
                continue;
            }
            let usage = self.capacity.models.get(&l.model).map_or(0, |u| {
                if l.by_gpu {
                    u.gpu_total_bytes()
                } else {
                    u.ram_bytes
                }
            });
            if let Some(why) = l.readiness(usage, now, h.granted_at, settle) {
                ready.push((*id, why));
            }
        }
        for (id, why) in ready {
            let Some(h) = self.holdings.get(&id) else {
                continue;
            };
            let severity = why.severity();
            let (pool, peer) = (h.pool.clone(), h.peer);
            self.event(
                Event::new(
                    severity,
                    EventKind::LaunchReady,
                    format!(
                        "model '{}' (pid {}): {why}; launch lock released",
                        model_label(&pool),
                        peer.pid
                    ),
                )
                .about(about(&pool, &peer)),
            );
            self.lease_ready(id, now);
        }
        for id in dead {
            let Some(h) = self.holdings.get(&id) else {
                continue;
            };
            let loading = h.reserving();
            let (pool, peer) = (h.pool.clone(), h.peer);
            if loading {
                self.lease_ready(id, now);
                // Info: the launching client's own process exited (it can do so in a loop);
                // a kill by the guard has its own critical event.
                self.event(
                    Event::new(
                        Severity::Info,
                        EventKind::LaunchDied,
                        format!(
                            "model '{}' (pid {}) exited while loading; launch lock released",
                            model_label(&pool),
                            peer.pid
                        ),
                    )
                    .about(about(&pool, &peer)),
                );
            }
            self.holdings.remove(&id);
        }
    }
}

/// The answer to a launch that can never fit on this host: refused, nothing started.
pub(super) fn never_fits(w: &Waiter, s: &Shortfall) -> Response {
    Response::refused(
        None,
        RefusalReason::TooLarge,
        format!(
            "model '{}' not started: it can never fit on this host: {}",
            model_label(&w.pool),
            s.message
        ),
    )
}

/// Root: its launches go first. (Not the system accounts: a model server's own account, `vllm`
/// say, runs code it downloaded.)
fn privileged(uid: u32) -> bool {
    uid == 0
}

/// CUDA_VISIBLE_DEVICES as GPU indices: "0,2", or GPU UUIDs (full or a unique prefix). A GPU
/// named twice is refused: the demand is split over the list, so "0,0" would otherwise be
/// admitted against half the memory it needs on GPU 0.
pub(super) fn parse_visible_devices(text: &str, capacity: &Capacity) -> Result<Vec<u32>, String> {
    let indices = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .take(64)
        .map(|item| {
            if let Ok(index) = item.parse::<u32>() {
                return Ok(index);
            }
            let found: Vec<u32> = capacity
                .gpus
                .iter()
                .filter(|g| !g.uuid.is_empty() && g.uuid.starts_with(item))
                .map(|g| g.index)
                .collect();
            match found.as_slice() {
                [one] => Ok(*one),
                _ => Err(format!(
                    "CUDA_VISIBLE_DEVICES: '{item}' is not a GPU index or the uuid of exactly one GPU"
                )),
            }
        })
        .collect::<Result<Vec<u32>, String>>()?;
    for (i, index) in indices.iter().enumerate() {
        if indices[..i].contains(index) {
            return Err(format!("CUDA_VISIBLE_DEVICES: GPU {index} is named twice"));
        }
    }
    Ok(indices)
}
