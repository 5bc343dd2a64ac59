//! The metric families and their labels, registered once.

use super::*;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GpuLabels {
    pub gpu: String,
    pub uuid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GpuFloorLabels {
    pub gpu: String,
    pub uuid: String,
    /// "warn" or "min".
    pub floor: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FloorLabels {
    pub floor: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    pub model: String,
    /// "ram" or "gpu".
    pub resource: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NameLabels {
    pub model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabels {
    pub verb: String,
    pub reason: String,
    /// "done", "observed", "skipped" or "failed".
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabels {
    pub kind: String,
    pub severity: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SinkLabels {
    /// The sink's index in `[[alert.webhook]]`, or "event_log".
    pub sink: String,
    pub format: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VersionLabels {
    pub version: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub model: String,
    /// "granted", "refused" or "expired".
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QuantileLabels {
    pub model: String,
    pub quantile: String,
}

/// Memory permits per model (`(host)`: permits of no model).
#[derive(Clone)]
pub(super) struct PermitFamilies {
    pub(super) held: Family<NameLabels, Gauge>,
    pub(super) waiting: Family<NameLabels, Gauge>,
    pub(super) reserved: Family<ModelLabels, Gauge>,
    pub(super) outcomes: Family<OutcomeLabels, Counter>,
    pub(super) observed: Family<QuantileLabels, Gauge>,
}

/// Per GPU, labelled `gpu` and `uuid`.
#[derive(Clone)]
pub(super) struct GpuFamilies {
    pub(super) total: Family<GpuLabels, Gauge>,
    pub(super) used: Family<GpuLabels, Gauge>,
    pub(super) free: Family<GpuLabels, Gauge>,
    pub(super) utilization: Family<GpuLabels, FGauge>,
    pub(super) lost: Family<GpuLabels, Gauge>,
    pub(super) floor: Family<GpuFloorLabels, Gauge>,
}

impl GpuFamilies {
    pub(super) fn register(r: &mut Registry) -> GpuFamilies {
        GpuFamilies {
            total: register(
                r,
                "gpuguard_gpu_memory_total_bytes",
                "GPU memory per GPU (NVML)",
                Family::default(),
            ),
            used: register(
                r,
                "gpuguard_gpu_memory_used_bytes",
                "GPU memory in use per GPU (NVML v2 memory info)",
                Family::default(),
            ),
            free: register(
                r,
                "gpuguard_gpu_memory_free_bytes",
                "GPU memory free per GPU (NVML), what the GPU floors are about",
                Family::default(),
            ),
            utilization: register(
                r,
                "gpuguard_gpu_utilization_ratio",
                "GPU utilisation, 0 to 1",
                Family::default(),
            ),
            lost: register(
                r,
                "gpuguard_gpu_lost",
                "1 if the GPU fell off the bus or left NVML's device list (its readings are unknown)",
                Family::default(),
            ),
            floor: register(
                r,
                "gpuguard_gpu_memory_floor_bytes",
                "GPU free-memory floors per GPU: floor=warn (alert) and floor=min (act)",
                Family::default(),
            ),
        }
    }
}

/// Host RAM, swap and pressure.
#[derive(Clone)]
pub(super) struct HostFamilies {
    pub(super) total: Gauge,
    pub(super) available: Gauge,
    pub(super) floor: Family<FloorLabels, Gauge>,
    pub(super) swap_total: Gauge,
    pub(super) swap_free: Gauge,
    pub(super) shmem: Gauge,
    pub(super) psi_some: FGauge,
}

impl HostFamilies {
    pub(super) fn register(r: &mut Registry) -> HostFamilies {
        HostFamilies {
            total: register(
                r,
                "gpuguard_host_memory_total_bytes",
                "Host RAM (MemTotal)",
                Gauge::default(),
            ),
            available: register(
                r,
                "gpuguard_host_memory_available_bytes",
                "Host RAM available (MemAvailable)",
                Gauge::default(),
            ),
            floor: register(
                r,
                "gpuguard_host_memory_floor_bytes",
                "Host MemAvailable floors: floor=warn (alert) and floor=min (act)",
                Family::default(),
            ),
            swap_total: register(
                r,
                "gpuguard_swap_total_bytes",
                "Swap space (SwapTotal)",
                Gauge::default(),
            ),
            swap_free: register(
                r,
                "gpuguard_swap_free_bytes",
                "Swap free (SwapFree)",
                Gauge::default(),
            ),
            shmem: register(
                r,
                "gpuguard_host_memory_shmem_bytes",
                "Shared memory and tmpfs (Shmem): counted out of MemAvailable, held by no process",
                Gauge::default(),
            ),
            psi_some: register(
                r,
                "gpuguard_psi_memory_some_avg10_ratio",
                "Memory pressure stall information, some avg10, as a ratio (0 to 1; /proc gives percent)",
                Gauge::default(),
            ),
        }
    }
}

/// Per model: use, budgets, processes.
#[derive(Clone)]
pub(super) struct ModelFamilies {
    pub(super) usage: Family<ModelLabels, Gauge>,
    pub(super) budget: Family<ModelLabels, Gauge>,
    pub(super) processes: Family<NameLabels, Gauge>,
}

impl ModelFamilies {
    pub(super) fn register(r: &mut Registry) -> ModelFamilies {
        ModelFamilies {
            usage: register(
                r,
                "gpuguard_model_usage_bytes",
                "Memory used by a model's processes and their descendants: resource=ram (RSS) or gpu",
                Family::default(),
            ),
            budget: register(
                r,
                "gpuguard_model_budget_bytes",
                "A model's budget: resource=ram or gpu",
                Family::default(),
            ),
            processes: register(
                r,
                "gpuguard_model_processes",
                "Processes that make up a model",
                Family::default(),
            ),
        }
    }
}

/// Per model: its server's own figures.
#[derive(Clone)]
pub(super) struct EngineFamilies {
    pub(super) up: Family<NameLabels, Gauge>,
    pub(super) kv_usage: Family<NameLabels, FGauge>,
    pub(super) running: Family<NameLabels, Gauge>,
    pub(super) waiting: Family<NameLabels, Gauge>,
    pub(super) preemptions: Family<NameLabels, Gauge>,
    pub(super) kv_tokens: Family<NameLabels, Gauge>,
    pub(super) kv_planned_tokens: Family<NameLabels, Gauge>,
}

impl EngineFamilies {
    pub(super) fn register(r: &mut Registry) -> EngineFamilies {
        EngineFamilies {
            up: register(
                r,
                "gpuguard_engine_up",
                "1 if the model server's metrics URL answered with its metrics at the last scrape, 0 if not",
                Family::default(),
            ),
            kv_usage: register(
                r,
                "gpuguard_engine_kv_cache_usage_ratio",
                "Share of the model server's KV cache in use, 0 to 1 (vLLM's kv_cache_usage_perc)",
                Family::default(),
            ),
            running: register(
                r,
                "gpuguard_engine_requests_running",
                "Requests the model server is running (vLLM's num_requests_running)",
                Family::default(),
            ),
            waiting: register(
                r,
                "gpuguard_engine_requests_waiting",
                "Requests waiting in the model server's queue (vLLM's num_requests_waiting)",
                Family::default(),
            ),
            preemptions: register(
                r,
                "gpuguard_engine_preemptions",
                "Requests the model server has preempted since it started, as it last reported (vLLM's num_preemptions_total)",
                Family::default(),
            ),
            kv_tokens: register(
                r,
                "gpuguard_engine_kv_cache_tokens",
                "Tokens the model server's KV cache holds (vLLM's cache_config_info: num_gpu_blocks x block_size)",
                Family::default(),
            ),
            kv_planned_tokens: register(
                r,
                "gpuguard_engine_kv_cache_planned_tokens",
                "Tokens `gpuguard plan` planned for the model's KV cache (its [[model]] planned_kv_tokens)",
                Family::default(),
            ),
        }
    }
}

/// What happened: actions, events, events suppressed.
#[derive(Clone)]
pub(super) struct CountFamilies {
    pub(super) actions: Family<ActionLabels, Counter>,
    pub(super) events: Family<EventLabels, Counter>,
    pub(super) events_suppressed: Counter,
}

impl CountFamilies {
    pub(super) fn register(r: &mut Registry) -> CountFamilies {
        CountFamilies {
            actions: register(
                r,
                "gpuguard_actions",
                "Actions taken, by verb (stop, resume, terminate, kill, throttle...), reason and outcome",
                Family::default(),
            ),
            events: register(
                r,
                "gpuguard_events",
                "Events reported, by kind and severity",
                Family::default(),
            ),
            events_suppressed: register(
                r,
                "gpuguard_events_suppressed",
                "Events clients caused past the per-uid rate limit (20 per uid per minute): counted here and summed up in one events_suppressed event per uid and minute, not reported one by one",
                Counter::default(),
            ),
        }
    }
}

/// The loop's own state: launches, held processes, GPU protection, sampling.
#[derive(Clone)]
pub(super) struct LoopFamilies {
    pub(super) queue_length: Gauge,
    pub(super) leases: Family<StateLabels, Gauge>,
    pub(super) held: Gauge,
    pub(super) nvml_state: Family<StateLabels, Gauge>,
    pub(super) gpu_stale: Gauge,
    pub(super) cloud_notice: Family<StateLabels, Gauge>,
    pub(super) sample_duration: Histogram,
}

impl LoopFamilies {
    pub(super) fn register(r: &mut Registry) -> LoopFamilies {
        LoopFamilies {
            queue_length: register(
                r,
                "gpuguard_launch_queue_length",
                "Launches waiting in the queue",
                Gauge::default(),
            ),
            leases: register(
                r,
                "gpuguard_launch_leases",
                "Admitted launches by state (loading holds the launch lock)",
                Family::default(),
            ),
            held: register(
                r,
                "gpuguard_held_processes",
                "Processes gpuguard holds stopped or throttled",
                Gauge::default(),
            ),
            nvml_state: register(
                r,
                "gpuguard_nvml_state",
                "GPU protection state: 1 for the current state (ok, degraded, starting, unavailable, off), 0 for the others",
                Family::default(),
            ),
            gpu_stale: register(
                r,
                "gpuguard_gpu_sample_stale",
                "1 if the latest GPU sample is late (alerts only, no kills)",
                Gauge::default(),
            ),
            cloud_notice: register(
                r,
                "gpuguard_cloud_notice",
                "1 while the cloud announces it for this VM (GCE: state \"host_maintenance\" or \"preempted\"; the host drains), else 0",
                Family::default(),
            ),
            sample_duration: register(
                r,
                "gpuguard_sample_duration_seconds",
                "Time to sample host memory, processes and GPUs in one tick",
                // 10 µs × 4^i, i < 10: prometheus-client's exponential_buckets is the same
                // figures through `powf`, the one call that would link libm into the binary.
                Histogram::new(std::iter::successors(Some(0.000_01), |b| Some(b * 4.0)).take(10)),
            ),
        }
    }
}

/// Per alert sink, labelled `sink` and `format`.
#[derive(Clone)]
pub(super) struct AlertFamilies {
    pub(super) sent: Family<SinkLabels, Counter>,
    pub(super) failed: Family<SinkLabels, Counter>,
    pub(super) dropped: Family<SinkLabels, Counter>,
}

impl AlertFamilies {
    pub(super) fn register(r: &mut Registry) -> AlertFamilies {
        AlertFamilies {
            sent: register(
                r,
                "gpuguard_alerts_sent",
                "Notifications delivered, per sink",
                Family::default(),
            ),
            failed: register(
                r,
                "gpuguard_alerts_failed",
                "Notifications given up on after their retries, per sink",
                Family::default(),
            ),
            dropped: register(
                r,
                "gpuguard_alerts_dropped",
                "Notifications dropped because the sink's queue was full (the oldest of the lowest severity first; never a critical one for a lower one), per sink",
                Family::default(),
            ),
        }
    }
}

impl PermitFamilies {
    pub(super) fn register(r: &mut Registry) -> PermitFamilies {
        PermitFamilies {
            held: register(
                r,
                "gpuguard_permits_held",
                "Memory permits held, per model",
                Family::default(),
            ),
            waiting: register(
                r,
                "gpuguard_permits_waiting",
                "Permit requests waiting for memory, per model",
                Family::default(),
            ),
            reserved: register(
                r,
                "gpuguard_permit_reserved_bytes",
                "Memory the permits held reserve, per model: resource=ram or gpu",
                Family::default(),
            ),
            outcomes: register(
                r,
                "gpuguard_permits",
                "Permit requests by outcome (granted, refused, expired), per model",
                Family::default(),
            ),
            observed: register(
                r,
                "gpuguard_permit_observed_gpu_bytes",
                "GPU growth per permit observed while permits were held, per model: quantile=0.5 or 0.95",
                Family::default(),
            ),
        }
    }
}

/// Registers `metric` under `name` and returns it (a clone shares the same values).
pub(super) fn register<M: Metric + Clone>(
    r: &mut Registry,
    name: &str,
    help: &str,
    metric: M,
) -> M {
    r.register(name, help, metric.clone());
    metric
}
