//! What a plan tells the operator in their tools' terms: vLLM's flags, the `[[model]]` block and
//! the `gpuguard launch` flags that hold the engine to its budget, and the assumptions in words.

use gpuguard_core::units::fmt_bytes;

use super::*;

pub(super) fn vllm_args(r: &PlanRequest, o: &GpuPlan, seqs: u64) -> Vec<String> {
    let mut args = vec!["--max-model-len".to_string(), r.max_model_len.to_string()];
    match o.kv_cache_memory_bytes {
        Some(bytes) => args.extend(["--kv-cache-memory-bytes".into(), bytes.to_string()]),
        None => args.extend([
            "--gpu-memory-utilization".into(),
            format!("{:.2}", o.gpu_memory_utilization),
        ]),
    }
    args.extend([
        "--max-num-seqs".into(),
        seqs.to_string(),
        "--max-num-batched-tokens".into(),
        o.max_num_batched_tokens.to_string(),
    ]);
    if o.tp > 1 {
        args.extend(["--tensor-parallel-size".into(), o.tp.to_string()]);
    }
    if r.kv_dtype == Dtype::Fp8 {
        args.extend(["--kv-cache-dtype".into(), "fp8".into()]);
    }
    if r.enforce_eager {
        args.push("--enforce-eager".into());
    }
    args
}

/// What the engine takes of each GPU: weights, overhead and the KV cache in bytes where the
/// release takes them, else its share.
fn engine_bytes(o: &GpuPlan) -> u64 {
    match o.kv_cache_memory_bytes {
        Some(kv) => o.weights_bytes + o.overhead_bytes + kv,
        None => (o.gpu_total_bytes as f64 * o.gpu_memory_utilization) as u64,
    }
}

/// What the engine holds of each GPU beyond what it charges: the CUDA context, and CUDA graphs
/// where they are captured after the KV cache.
fn beyond_share(o: &GpuPlan) -> u64 {
    o.cuda_context_bytes
        + if o.cuda_graphs_charged {
            0
        } else {
            o.cuda_graph_bytes
        }
}

/// Whole GiB, rounded up, as the config writes sizes.
fn gib_ceil(bytes: u64) -> String {
    format!("{}GiB", bytes.div_ceil(GIB))
}

/// The `[[model]]` block and the matching `gpuguard launch` flags.
pub(super) fn gpuguard_budget(
    r: &PlanRequest,
    model: &ModelFigures,
    o: &GpuPlan,
) -> (String, Vec<String>) {
    let engine = engine_bytes(o);
    let gpu = gib_ceil((engine + beyond_share(o) + BUDGET_SLACK_BYTES) * u64::from(o.tp));
    // The launch reserves what the engine takes, so GPUGUARD_GPU_MEMORY_FRACTION comes out as
    // the engine's --gpu-memory-utilization.
    let launch_gpu = format!("{}MiB", (engine * u64::from(o.tp)) >> 20);
    let ram = gib_ceil(model.weights_bytes + RAM_PER_PROCESS_BYTES * (u64::from(o.tp) + 1));
    let name = toml::Value::String(r.name.clone());
    let block = format!(
        "[[model]]\n\
         name = {name}\n\
         # {tp} × {gpu_name}, {share}; started with\n\
         # `gpuguard launch --model {raw} ...`, or match a running server:\n\
         # match = {{ cmdline = \"vllm serve .*{raw}\" }}\n\
         # run by a user who is not root or a system account? users = [\"NAME\"]\n\
         gpu_memory = \"{gpu}\"\n\
         ram = \"{ram}\"\n\
         action = \"alert\"\n\
         {planned}",
        tp = o.tp,
        gpu_name = o.gpu,
        share = match o.kv_cache_memory_bytes {
            Some(kv) => format!("KV cache {}", fmt_bytes(kv)),
            None => format!("gpu_memory_utilization {:.2}", o.gpu_memory_utilization),
        },
        raw = r.name.replace(['\n', '"'], ""),
        planned = match o.kv_tokens {
            0 => String::new(),
            t => format!(
                "# the KV cache planned, in tokens per engine: `status --model` sets the engine's beside it\n\
                 planned_kv_tokens = {t}\n"
            ),
        },
    );
    let mut launch = vec![
        "--model".to_string(),
        r.name.clone(),
        "--gpu-mem".into(),
        launch_gpu,
        "--ram".into(),
        ram,
    ];
    if o.tp > 1 {
        launch.extend(["--gpus".into(), o.tp.to_string()]);
    }
    if o.kv_tokens > 0 {
        launch.extend(["--planned-kv-tokens".into(), o.kv_tokens.to_string()]);
    }
    (block, launch)
}

pub(super) fn general_assumptions(r: &PlanRequest, m: &ModelFigures) -> Vec<String> {
    let a = &r.arch;
    let mut out = vec![format!(
        "KV cache: per layer and token 2 (K and V) × {} KV heads × head_dim {} × {} byte(s) ({}) = {}; \
         handed out in blocks of {BLOCK_TOKENS} tokens",
        a.kv_heads,
        a.head_dim,
        r.kv_dtype.bytes(),
        r.kv_dtype,
        fmt_bytes(2 * a.kv_heads * a.head_dim * r.kv_dtype.bytes() as u64)
    )];
    if let Some(w) = a.sliding_window {
        out.push(format!(
            "sliding-window layers ({} of {}) keep at most {w} + {BLOCK_TOKENS} tokens per request \
             (vLLM's hybrid KV-cache manager; an engine that gives every layer the full length \
             needs the naive figure)",
            a.sliding_layers, a.layers
        ));
    }
    out.push(format!(
        "naive estimate for comparison: all {} attention heads keep KV, no window: {} per request",
        a.attention_heads,
        fmt_bytes(m.naive_kv_bytes_per_request)
    ));
    let e = r.engine;
    let runner_v2 = model_runner_v2(r);
    out.push(format!(
        "engine: vLLM {e}{} ({}{}); --vllm-version for another release",
        if e == Vllm::DEFAULT { " and later" } else { "" },
        if e.v1() { "V1" } else { "V0" },
        if runner_v2 {
            format!(
                ", Model Runner V2, its default for {}",
                a.architectures.first().map_or("this model", String::as_str)
            )
        } else {
            String::new()
        },
    ));
    let graphs = if r.enforce_eager {
        "none (--enforce-eager)".to_string()
    } else {
        format!(
            "{} at TP 1, {} with TP",
            fmt_bytes(engine::CUDA_GRAPH_BYTES),
            fmt_bytes(engine::CUDA_GRAPH_TP_BYTES)
        )
    };
    let charged = cuda_graphs_charged(r);
    out.push(format!(
        "charged to the share besides the weights, per GPU: the profile run's peak (for the \
         batch in force: tokens × (4 × hidden + 6 × MLP width / TP) bytes, plus fp32 logits and \
         probabilities of {} sampler rows{}; 2 GiB when the config gives no widths), memory \
         outside PyTorch ({} at TP 1, {} with tensor parallelism across Hopper or Blackwell \
         data-centre GPUs, where vLLM fuses the all-reduce through FlashInfer){}",
        if e.v1() {
            "min(max_num_seqs, tokens)"
        } else {
            "max_num_seqs"
        },
        if e.v1() {
            format!(
                ", plus {} for a multimodal model's vision encoder",
                fmt_bytes(engine::VISION_PROFILE_BYTES)
            )
        } else {
            String::new()
        },
        fmt_bytes(engine::NON_TORCH_BYTES),
        fmt_bytes(engine::NON_TORCH_TP_BYTES),
        if charged {
            format!(", and CUDA graphs ({graphs})")
        } else {
            String::new()
        }
    ));
    out.push(format!(
        "beyond the share, per GPU: the CUDA context ({}){}",
        fmt_bytes(engine::CUDA_CONTEXT_BYTES),
        if charged {
            String::new()
        } else if r.enforce_eager {
            " (no CUDA graphs: --enforce-eager)".to_string()
        } else {
            format!(
                " and CUDA graphs ({graphs}), captured after the KV cache is sized{}",
                if e.charges_cuda_graphs(false) {
                    " (Model Runner V2 charges no estimate of them before vLLM 0.29)"
                } else {
                    ""
                }
            )
        }
    ));
    let cap = r.gpu_memory_utilization.unwrap_or(e.default_utilization());
    out.push(if e.kv_cache_bytes_flag() {
        format!(
            "the KV cache is given in bytes (--kv-cache-memory-bytes): the KV space is exactly the \
             plan's; without --concurrency it is what {cap:.2} of each GPU leaves{}",
            if r.gpu_memory_utilization.is_none() {
                format!(" (vLLM {e}'s default share)")
            } else {
                String::new()
            }
        )
    } else {
        format!(
            "the engine takes gpu_memory_utilization ({cap:.2}) × each GPU's total for weights, \
             overhead and KV cache; with --concurrency the flags ask for just enough"
        )
    });
    out.push(
        "tensor parallelism splits the weights and KV heads evenly (KV heads are replicated when \
         fewer than GPUs)"
            .into(),
    );
    out.push(
        "a full-length request holds max_model_len tokens; --max-num-seqs is how many of those \
         fit, so none is ever preempted (raise it when requests are usually shorter)"
            .into(),
    );
    out.push(format!(
        "gpuguard budget: what the engine takes of each GPU + what it holds beyond it + {}, \
         while `gpuguard launch --gpu-mem` reserves what it takes, so \
         --gpu-memory-utilization $GPUGUARD_GPU_MEMORY_FRACTION gives the engine the same; \
         RAM: the weights (read through the page cache while loading) + {} per process (API \
         server and one worker per GPU)",
        fmt_bytes(BUDGET_SLACK_BYTES),
        fmt_bytes(RAM_PER_PROCESS_BYTES)
    ));
    out.push("GPU totals are NVML's: the built-in table's, or this host's as read live".into());
    out
}
