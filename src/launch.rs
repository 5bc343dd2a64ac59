//! The daemon's side of `gpuguard launch`: a FIFO queue of callers waiting for memory, and the
//! leases of admitted models. At most `[launch] max_loading` models load at once (the launch
//! lock); a lease holds it until its model is ready (the ready URL answers 2xx, or its memory has
//! grown and then stayed flat for `settle`) or `ready_timeout` passes, and frees it at once if
//! the model dies while loading.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::UnboundedSender;

use crate::config::{Config, ModelAction, ModelConfig};
use crate::ipc::server::Peer;
use crate::ipc::{LaunchRequest, Response};
use crate::policy::admission::{admit, Admission, Need, Reservation};
use crate::policy::{About, Event, PolicyState, Severity};
use crate::snapshot::{ProcessId, Snapshot};
use crate::status::{LeaseRow, QueuedRow};
use crate::units::{fmt_bytes, Amount};

/// A caller waiting for its turn.
pub struct Queued {
    pub conn: u64,
    pub peer: Peer,
    pub request: LaunchRequest,
    pub need: Need,
    pub queued_at: Duration,
    pub queue_timeout: Duration,
    pub waiting_for: String,
    reply: UnboundedSender<Response>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseState {
    Loading,
    Ready,
}

/// An admitted model.
pub struct Lease {
    pub id: u64,
    pub model: String,
    pub process: ProcessId,
    pub uid: u32,
    pub gpus: Vec<u32>,
    pub need: Need,
    pub admitted_at: Duration,
    pub state: LeaseState,
    ready_timeout: Duration,
    /// Set by the ready-URL poller.
    url_ready: Option<Arc<AtomicBool>>,
    /// Stops the poller when the lease ends.
    stop_poller: Arc<AtomicBool>,
    last_usage: u64,
    stable_since: Duration,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.stop_poller.store(true, Ordering::Relaxed);
    }
}

#[derive(Default)]
pub struct Launches {
    next_lease: u64,
    pub queue: VecDeque<Queued>,
    pub leases: Vec<Lease>,
}

/// Memory counts as "flat" while it moves by less than this between ticks.
const FLAT_BYTES: u64 = 64 << 20;
/// Memory counts as "grown" once the model holds this much.
const GROWN_BYTES: u64 = 64 << 20;

impl Launches {
    /// Puts a caller in the queue and tells it where it stands.
    pub fn enqueue(
        &mut self,
        config: &Config,
        snapshot: &Snapshot,
        conn: u64,
        peer: Peer,
        request: LaunchRequest,
        reply: UnboundedSender<Response>,
    ) {
        match self.need(config, snapshot, &request) {
            Ok(need) => {
                let queue_timeout = request
                    .queue_timeout_ms
                    .map_or(config.launch.queue_timeout, Duration::from_millis);
                let position = self.queue.len() + 1;
                let waiting_for = if self.loading() >= config.launch.max_loading {
                    "the launch lock".to_string()
                } else {
                    "memory".to_string()
                };
                let _ = reply.send(Response::Queued {
                    position,
                    waiting_for: waiting_for.clone(),
                });
                tracing::info!(
                    "launch of model '{}' by pid {} (uid {}) queued at position {position}: needs GPU {} RAM {}",
                    request.model,
                    peer.pid,
                    peer.uid,
                    fmt_bytes(need.gpu_bytes),
                    fmt_bytes(need.ram_bytes)
                );
                self.queue.push_back(Queued {
                    conn,
                    peer,
                    request,
                    need,
                    queued_at: snapshot.at,
                    queue_timeout,
                    waiting_for,
                    reply,
                });
            }
            Err(message) => {
                let _ = reply.send(Response::Error { message });
            }
        }
    }

    /// The budget a launch declares: its flags, else its `[[model]]`.
    fn need(
        &self,
        config: &Config,
        snapshot: &Snapshot,
        r: &LaunchRequest,
    ) -> Result<Need, String> {
        if r.model.trim().is_empty() {
            return Err("--model must name a model".into());
        }
        let model = config.model(&r.model);
        let (ram_budget, gpu_budget) = model.map_or((None, None), |m| {
            m.budget_bytes(
                snapshot.host.total_bytes,
                snapshot.gpus.largest_total_bytes(),
            )
        });
        let gpu_bytes = r.gpu_memory_bytes.or(gpu_budget).unwrap_or(0);
        let ram_bytes = r.ram_bytes.or(ram_budget).unwrap_or(0);
        let pinned = match (r.gpu, &r.cuda_visible_devices) {
            (Some(index), _) => Some(vec![index]),
            (None, Some(visible)) if !visible.trim().is_empty() => {
                Some(parse_visible_devices(visible, snapshot)?)
            }
            _ => None,
        };
        Ok(Need {
            gpu_bytes,
            ram_bytes,
            gpu_count: r.gpus.unwrap_or(1).max(1),
            pinned,
        })
    }

    /// The caller hung up.
    pub fn cancel(&mut self, conn: u64) {
        if let Some(i) = self.queue.iter().position(|q| q.conn == conn) {
            let q = self.queue.remove(i).expect("index is valid");
            tracing::info!(
                "launch of model '{}' by pid {} left the queue (caller hung up)",
                q.request.model,
                q.peer.pid
            );
        }
    }

    /// Ends a lease early: its owner or root only.
    pub fn release(&mut self, lease: u64, peer: Peer) -> Response {
        let Some(i) = self.leases.iter().position(|l| l.id == lease) else {
            return Response::Error {
                message: format!("no lease {lease}"),
            };
        };
        if !peer.is_root() && self.leases[i].uid != peer.uid {
            return Response::Error {
                message: format!(
                    "lease {lease} belongs to uid {}, not to uid {}",
                    self.leases[i].uid, peer.uid
                ),
            };
        }
        self.leases[i].state = LeaseState::Ready;
        tracing::info!(
            "lease {lease} of model '{}' released by uid {}",
            self.leases[i].model,
            peer.uid
        );
        Response::Released { lease }
    }

    fn loading(&self) -> usize {
        self.leases
            .iter()
            .filter(|l| l.state == LeaseState::Loading)
            .count()
    }

    /// One tick: readiness and deaths of admitted models, queue timeouts, and admission of the
    /// head of the queue. `alive` says whether a process still exists.
    pub fn tick(
        &mut self,
        config: &Config,
        snapshot: &Snapshot,
        state: &mut PolicyState,
        alive: &mut dyn FnMut(ProcessId) -> bool,
    ) -> Vec<Event> {
        let now = snapshot.at;
        let mut events = Vec::new();

        // Leases: dead, ready, or timed out.
        self.leases.retain_mut(|lease| {
            if !alive(lease.process) {
                if lease.state == LeaseState::Loading {
                    events.push(event(
                        Severity::Warning,
                        "launch_died",
                        format!(
                            "model '{}' (pid {}) exited while loading; launch lock released",
                            lease.model, lease.process.pid
                        ),
                        &lease.model,
                        lease.process.pid,
                        lease.uid,
                    ));
                }
                state.unregister(lease.process);
                return false;
            }
            if lease.state == LeaseState::Loading {
                if let Some(why) = readiness(lease, state, now, config.launch.settle) {
                    lease.state = LeaseState::Ready;
                    let level = if why.starts_with("not ready") {
                        Severity::Warning
                    } else {
                        Severity::Info
                    };
                    events.push(event(
                        level,
                        "launch_ready",
                        format!(
                            "model '{}' (pid {}): {why}; launch lock released",
                            lease.model, lease.process.pid
                        ),
                        &lease.model,
                        lease.process.pid,
                        lease.uid,
                    ));
                }
            }
            true
        });

        // Queue: timeouts first, then the head if the lock is free and its need fits.
        let mut i = 0;
        while i < self.queue.len() {
            let q = &self.queue[i];
            if now.saturating_sub(q.queued_at) >= q.queue_timeout {
                let q = self.queue.remove(i).expect("index is valid");
                let message = format!(
                    "model '{}' not started: it did not fit within the queue timeout of {}: {}",
                    q.request.model,
                    humantime::format_duration(q.queue_timeout),
                    q.waiting_for
                );
                events.push(event(
                    Severity::Warning,
                    "launch_timed_out",
                    format!("{message} (pid {})", q.peer.pid),
                    &q.request.model,
                    q.peer.pid,
                    q.peer.uid,
                ));
                let _ = q.reply.send(Response::TimedOut { message });
                continue;
            }
            i += 1;
        }
        let Some(head) = self.queue.front_mut() else {
            return events;
        };
        if self
            .leases
            .iter()
            .filter(|l| l.state == LeaseState::Loading)
            .count()
            >= config.launch.max_loading
        {
            head.waiting_for = "the launch lock: another model is loading".into();
            return events;
        }
        let loading: Vec<Reservation> = self
            .leases
            .iter()
            .filter(|l| l.state == LeaseState::Loading)
            .map(|l| reservation(l, state))
            .collect();
        match admit(config, snapshot, &state.levels, &head.need, &loading) {
            Admission::Wait { why } => head.waiting_for = why,
            Admission::Admit { gpus } => {
                let q = self.queue.pop_front().expect("head exists");
                self.start_lease(config, snapshot, state, q, gpus, &mut events);
            }
        }
        events
    }

    fn start_lease(
        &mut self,
        config: &Config,
        snapshot: &Snapshot,
        state: &mut PolicyState,
        q: Queued,
        gpus: Vec<u32>,
        events: &mut Vec<Event>,
    ) {
        let Some(start_time) = procfs::process::Process::new(q.peer.pid)
            .and_then(|p| p.stat())
            .ok()
            .map(|s| s.starttime)
        else {
            tracing::info!(
                "launch of model '{}': pid {} is gone",
                q.request.model,
                q.peer.pid
            );
            return;
        };
        self.next_lease += 1;
        let id = self.next_lease;
        let process = ProcessId {
            pid: q.peer.pid,
            start_time,
        };
        let model = q.request.model.clone();
        let mut env = vec![
            ("GPUGUARD_MODEL".to_string(), model.clone()),
            ("GPUGUARD_LEASE".to_string(), id.to_string()),
            (
                "GPUGUARD_GPU_MEMORY_BYTES".to_string(),
                q.need.gpu_bytes.to_string(),
            ),
            (
                "GPUGUARD_RAM_BYTES".to_string(),
                q.need.ram_bytes.to_string(),
            ),
        ];
        if !gpus.is_empty() {
            let list: Vec<String> = gpus.iter().map(u32::to_string).collect();
            // NVML numbers GPUs by PCI bus id; make CUDA number them the same way.
            env.push(("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into()));
            env.push(("CUDA_VISIBLE_DEVICES".into(), list.join(",")));
        }
        if q.reply
            .send(Response::Admitted {
                lease: id,
                gpus: gpus.clone(),
                env,
            })
            .is_err()
        {
            return;
        }
        state.register(process, &model);
        if config.model(&model).is_none() {
            state
                .launched_models
                .insert(model.clone(), launched_model_config(&model, &q.need));
        }
        let stop_poller = Arc::new(AtomicBool::new(false));
        let url_ready = q
            .request
            .ready_url
            .as_ref()
            .map(|url| poll_ready_url(url.clone(), stop_poller.clone()));
        let ready_timeout = q
            .request
            .ready_timeout_ms
            .map_or(config.launch.ready_timeout, Duration::from_millis);
        events.push(event(
            Severity::Info,
            "launch_admitted",
            format!(
                "model '{model}' admitted as lease {id} (pid {}, uid {}) on GPU(s) {gpus:?}: GPU {} RAM {}; waited {}",
                process.pid,
                q.peer.uid,
                fmt_bytes(q.need.gpu_bytes),
                fmt_bytes(q.need.ram_bytes),
                humantime::format_duration(Duration::from_millis(snapshot.at.saturating_sub(q.queued_at).as_millis() as u64))
            ),
            &model,
            process.pid,
            q.peer.uid,
        ));
        self.leases.push(Lease {
            id,
            model,
            process,
            uid: q.peer.uid,
            gpus,
            need: q.need,
            admitted_at: snapshot.at,
            state: LeaseState::Loading,
            ready_timeout,
            url_ready,
            stop_poller,
            last_usage: 0,
            stable_since: snapshot.at,
        });
    }

    /// True while a model is loading or waiting: the loop then ticks often.
    pub fn busy(&self) -> bool {
        !self.queue.is_empty() || self.loading() > 0
    }

    pub fn queue_rows(&self, now: Duration) -> Vec<QueuedRow> {
        self.queue
            .iter()
            .enumerate()
            .map(|(i, q)| QueuedRow {
                position: i + 1,
                model: q.request.model.clone(),
                pid: q.peer.pid,
                uid: q.peer.uid,
                waiting_seconds: now.saturating_sub(q.queued_at).as_secs_f64(),
                gpu_bytes: q.need.gpu_bytes,
                ram_bytes: q.need.ram_bytes,
                waiting_for: q.waiting_for.clone(),
            })
            .collect()
    }

    pub fn lease_rows(&self, now: Duration) -> Vec<LeaseRow> {
        self.leases
            .iter()
            .map(|l| LeaseRow {
                lease: l.id,
                model: l.model.clone(),
                pid: l.process.pid,
                uid: l.uid,
                gpus: l.gpus.clone(),
                state: if l.state == LeaseState::Loading {
                    "loading"
                } else {
                    "ready"
                }
                .into(),
                seconds: now.saturating_sub(l.admitted_at).as_secs_f64(),
                gpu_bytes: l.need.gpu_bytes,
                ram_bytes: l.need.ram_bytes,
            })
            .collect()
    }
}

/// Is a loading model ready? Returns how it became so.
fn readiness(
    lease: &mut Lease,
    state: &PolicyState,
    now: Duration,
    settle: Duration,
) -> Option<String> {
    if lease
        .url_ready
        .as_ref()
        .is_some_and(|r| r.load(Ordering::Relaxed))
    {
        return Some("ready URL answered".into());
    }
    let usage = state
        .attribution
        .models
        .iter()
        .find(|m| m.name == lease.model)
        .map_or(0, |m| {
            if lease.need.gpu_bytes > 0 {
                m.gpu_total_bytes()
            } else {
                m.rss_bytes
            }
        });
    if usage.abs_diff(lease.last_usage) > FLAT_BYTES {
        lease.last_usage = usage;
        lease.stable_since = now;
    }
    if lease.url_ready.is_none()
        && usage >= GROWN_BYTES
        && now.saturating_sub(lease.stable_since) >= settle
    {
        let what = if lease.need.gpu_bytes > 0 {
            "GPU memory"
        } else {
            "RAM"
        };
        return Some(format!(
            "{what} grew to {} and stayed flat for {}",
            fmt_bytes(usage),
            humantime::format_duration(settle)
        ));
    }
    if now.saturating_sub(lease.admitted_at) >= lease.ready_timeout {
        return Some(format!(
            "not ready after ready_timeout {}",
            humantime::format_duration(lease.ready_timeout)
        ));
    }
    None
}

/// What a loading lease will still take: its need minus what it already holds.
fn reservation(lease: &Lease, state: &PolicyState) -> Reservation {
    let usage = state
        .attribution
        .models
        .iter()
        .find(|m| m.name == lease.model);
    let per_gpu = lease.need.gpu_bytes_per_gpu();
    let gpu_bytes: BTreeMap<u32, u64> = lease
        .gpus
        .iter()
        .map(|g| {
            (
                *g,
                per_gpu
                    .saturating_sub(usage.and_then(|u| u.gpu_bytes.get(g)).copied().unwrap_or(0)),
            )
        })
        .collect();
    Reservation {
        ram_bytes: lease
            .need
            .ram_bytes
            .saturating_sub(usage.map_or(0, |u| u.rss_bytes)),
        gpu_bytes,
    }
}

/// A launched model with no `[[model]]`: its flags are its budgets, and it is only alerted on.
fn launched_model_config(name: &str, need: &Need) -> ModelConfig {
    let amount = |b: u64| (b > 0).then_some(Amount::Bytes(b));
    ModelConfig {
        name: name.to_string(),
        matcher: Default::default(),
        ram: amount(need.ram_bytes),
        gpu_memory: amount(need.gpu_bytes),
        action: ModelAction::Alert,
        grace: Duration::from_secs(10),
        priority: 0,
    }
}

/// CUDA_VISIBLE_DEVICES as GPU indices: "0,2", or GPU UUIDs (full or a unique prefix).
fn parse_visible_devices(text: &str, snapshot: &Snapshot) -> Result<Vec<u32>, String> {
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|item| {
            if let Ok(index) = item.parse::<u32>() {
                return Ok(index);
            }
            let found: Vec<u32> = snapshot.gpus.devices.iter().filter(|g| !g.uuid.is_empty() && g.uuid.starts_with(item)).map(|g| g.index).collect();
            match found.as_slice() {
                [one] => Ok(*one),
                _ => Err(format!("CUDA_VISIBLE_DEVICES: '{item}' is not a GPU index or the uuid of exactly one GPU")),
            }
        })
        .collect()
}

/// Polls a readiness URL until it answers 2xx or the lease ends.
fn poll_ready_url(url: String, stop: Arc<AtomicBool>) -> Arc<AtomicBool> {
    let ready = Arc::new(AtomicBool::new(false));
    let flag = ready.clone();
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(2)))
        .http_status_as_error(false)
        .build()
        .into();
    let _ = std::thread::Builder::new()
        .name("ready-url".into())
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(response) = agent.get(&url).call() {
                    if response.status().is_success() {
                        flag.store(true, Ordering::Relaxed);
                        return;
                    }
                }
                std::thread::sleep(Duration::from_millis(250));
            }
        });
    ready
}

fn event(
    severity: Severity,
    kind: &'static str,
    message: String,
    model: &str,
    pid: i32,
    uid: u32,
) -> Event {
    Event::new(severity, kind, message).about(About {
        model: Some(model.to_string()),
        pid: Some(pid),
        uid: Some(uid),
        resource: None,
    })
}
