//! Capacity planning (`gpuguard plan`): how much GPU memory a model server needs for a model, a
//! context length and a number of concurrent requests, and which GPUs hold it. Pure arithmetic:
//! the CLI (`src/cli/plan.rs`) reads the files and the live GPUs.
//!
//! The memory of a vLLM server on each GPU is `gpu_memory_utilization × total`, spent on the
//! weights, what its profile run peaks at (activations, the sampler, a vision encoder), memory
//! outside PyTorch and, from vLLM 0.20, CUDA graphs (where the model runner estimates them); the
//! rest is the KV cache, and what the KV cache holds is the number of concurrent requests. How
//! that is charged depends on the release (`engine`); `arch` reads a model's `config.json`,
//! `gpus` is the built-in card table, `advice` words the result as vLLM flags, a `[[model]]`
//! block and the assumptions.

mod advice;
pub mod arch;
pub mod engine;
pub mod gpus;

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use gpuguard_core::units::{self, fmt_bytes};

use advice::{general_assumptions, gpuguard_budget, vllm_args};
pub use arch::{Architecture, ParamCount};
pub use engine::Vllm;

const GIB: u64 = 1 << 30;
/// The KV cache is handed out in blocks of this many tokens (vLLM's default block size).
pub const BLOCK_TOKENS: u64 = 16;
/// Activations when the model gives no width to compute them from.
pub const FALLBACK_ACTIVATION_BYTES: u64 = 2 * GIB;
/// Slack on top of what the engine holds beyond its share (the CUDA context, CUDA graphs
/// captured after the KV cache): the gpuguard budget is the share plus those plus this.
pub const BUDGET_SLACK_BYTES: u64 = GIB / 2;
/// Host RAM of each server process (the API server, one worker per GPU) besides the weights.
pub const RAM_PER_PROCESS_BYTES: u64 = 3 * GIB;
/// Tensor-parallel sizes tried when a model does not fit one GPU.
const AUTO_TP: [u32; 3] = [2, 4, 8];

/// A weight or KV-cache data type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Fp32,
    Bf16,
    Fp16,
    Fp8,
    Int8,
    Int4,
}

impl Dtype {
    /// Bytes per parameter. int4 carries a 16-bit scale and zero point per group of 128
    /// (AWQ/GPTQ), 4 bytes per 128 parameters.
    pub fn bytes(self) -> f64 {
        match self {
            Dtype::Fp32 => 4.0,
            Dtype::Bf16 | Dtype::Fp16 => 2.0,
            Dtype::Fp8 | Dtype::Int8 => 1.0,
            Dtype::Int4 => 0.5 + 4.0 / 128.0,
        }
    }

    /// Quantized checkpoints keep embeddings, the output head and vision towers in 16 bits.
    pub fn quantized(self) -> bool {
        matches!(self, Dtype::Fp8 | Dtype::Int8 | Dtype::Int4)
    }

    /// `torch_dtype` in a config.json.
    pub fn from_torch(text: &str) -> Option<Dtype> {
        match text {
            "float32" => Some(Dtype::Fp32),
            "bfloat16" => Some(Dtype::Bf16),
            "float16" => Some(Dtype::Fp16),
            _ => None,
        }
    }
}

impl FromStr for Dtype {
    type Err = String;
    fn from_str(text: &str) -> Result<Dtype, String> {
        match text.to_ascii_lowercase().as_str() {
            "fp32" | "float32" => Ok(Dtype::Fp32),
            "bf16" | "bfloat16" => Ok(Dtype::Bf16),
            "fp16" | "float16" | "half" => Ok(Dtype::Fp16),
            "fp8" | "fp8_e4m3" | "fp8_e5m2" => Ok(Dtype::Fp8),
            "int8" => Ok(Dtype::Int8),
            "int4" | "awq" | "gptq" => Ok(Dtype::Int4),
            _ => Err(format!(
                "'{text}' is not a dtype (use fp32, bf16, fp16, fp8, int8 or int4)"
            )),
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dtype::Fp32 => "fp32",
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Fp8 => "fp8",
            Dtype::Int8 => "int8",
            Dtype::Int4 => "int4",
        })
    }
}

/// How the weights' size is known.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Weights {
    /// The parameter count (from the architecture) in this dtype.
    Dtype(Dtype),
    /// Given outright (a quantized checkpoint's size on disk).
    Bytes(u64),
}

/// A GPU to plan for: a card from the table, or the GPUs of this host.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuChoice {
    pub name: String,
    pub total_bytes: u64,
    /// Free now (this host only).
    pub free_bytes: Option<u64>,
    /// How many of them there are (this host), or may be (a card from the table: 8).
    pub count: u32,
    /// Read from this host's NVML.
    pub live: bool,
    /// The cloud machine types that carry it (`gpus::KnownGpu::gcp`), if planning for a cloud.
    pub machines: &'static [(u32, &'static str)],
}

/// Everything `plan` is asked.
#[derive(Clone, Debug)]
pub struct PlanRequest {
    /// The name for the `[[model]]` block.
    pub name: String,
    pub arch: Architecture,
    pub weights: Weights,
    pub kv_dtype: Dtype,
    pub max_model_len: u64,
    /// Concurrent full-length requests wanted; `None`: how many fit.
    pub concurrency: Option<u64>,
    /// Tensor-parallel sizes to show; empty: 1, or the smallest of 2, 4, 8 that fits.
    pub tp: Vec<u32>,
    pub gpus: Vec<GpuChoice>,
    /// The vLLM release planned for: how it charges memory and its defaults.
    pub engine: Vllm,
    /// The share of each GPU the engine may take (default: the release's).
    pub gpu_memory_utilization: Option<f64>,
    /// Tokens in one forward pass (`--max-num-batched-tokens`; default: the release's for the
    /// GPU): sizes the activations vLLM profiles.
    pub max_num_batched_tokens: Option<u64>,
    /// `--max-num-seqs` (default: the release's for the GPU): the sampler's rows in the profile.
    pub max_num_seqs: Option<u64>,
    /// `--enforce-eager`: no CUDA graphs, so none is charged to the share or held beyond it.
    pub enforce_eager: bool,
    /// What this host's daemon observed of the model (`--gpu host`, a model of that name with
    /// an engine that reports its KV cache): the overhead of this host's GPUs is taken from it.
    pub observed: Option<Observed>,
    /// What the architecture reader assumed, printed with the rest.
    pub notes: Vec<String>,
}

/// A running model as the daemon saw it: its GPU memory over `gpus` GPUs, the KV cache its
/// engine reported (`vllm:cache_config_info`), in tokens per engine, and the flags it ran with
/// that size the rest (`None`: the engine's default).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Observed {
    pub gpu_bytes: u64,
    pub gpus: u32,
    pub kv_tokens: u64,
    /// `None`: running now; else when the daemon's history last saw it so (Unix ms).
    pub seen_at_ms: Option<u64>,
    pub max_num_batched_tokens: Option<u64>,
    pub max_num_seqs: Option<u64>,
    pub enforce_eager: bool,
}

/// The model's own figures, independent of the GPU.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ModelFigures {
    pub name: String,
    pub model_type: String,
    pub params: Option<u64>,
    /// `None` when the size was given with `--weights`.
    pub weights_dtype: Option<Dtype>,
    pub weights_bytes: u64,
    pub kv_dtype: Dtype,
    pub layers: u64,
    pub attention_heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub sliding_window: Option<u64>,
    pub sliding_layers: u64,
    pub max_model_len: u64,
    /// KV bytes one token adds on every layer (before any window is full).
    pub kv_bytes_per_token: u64,
    /// KV bytes of one request at `max_model_len` (windows capped, whole blocks).
    pub kv_bytes_per_request: u64,
    /// The naive estimate: every attention head has its own KV and no layer has a window.
    pub naive_kv_bytes_per_token: u64,
    pub naive_kv_bytes_per_request: u64,
    pub concurrency: Option<u64>,
}

/// One GPU option at one tensor-parallel size. Sizes are per GPU.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct GpuPlan {
    pub gpu: String,
    pub live: bool,
    pub tp: u32,
    pub gpu_total_bytes: u64,
    pub gpu_free_bytes: Option<u64>,
    /// `gpu_memory_utilization × total`.
    pub usable_bytes: u64,
    pub weights_bytes: u64,
    /// The batch vLLM profiles: `--max-num-batched-tokens` and `--max-num-seqs` in force.
    pub max_num_batched_tokens: u64,
    pub max_num_seqs: u64,
    /// The profile's peak: the forward pass, the sampler and (multimodal, V1) the vision
    /// encoder.
    pub activation_bytes: u64,
    /// Memory allocated outside PyTorch while vLLM profiles (CUDA libraries; with tensor
    /// parallelism on Hopper and Blackwell, the all-reduce fusion's workspace).
    pub non_torch_bytes: u64,
    /// CUDA graphs (0 with `--enforce-eager`): charged to the share from vLLM 0.20 where the model
    /// runner estimates them, captured beyond it before and where it does not.
    pub cuda_graph_bytes: u64,
    pub cuda_graphs_charged: bool,
    /// vLLM runs the model with its Model Runner V2 (its default for more models from 0.22).
    pub model_runner_v2: bool,
    /// The CUDA context, never charged to the share: it needs the room the share leaves.
    pub cuda_context_bytes: u64,
    /// What the release charges to the share besides the weights: activations, non-torch
    /// memory and (0.20 on) CUDA graphs; or, on this host's GPUs, what the model running here
    /// was seen to take besides its weights and KV cache (`overhead_observed`).
    pub overhead_bytes: u64,
    pub overhead_observed: bool,
    /// What is left of the usable share for the KV cache (0 if nothing).
    pub kv_space_bytes: u64,
    pub kv_bytes_per_request: u64,
    /// Tokens the KV cache holds, per engine (whole blocks): the `[[model]]`'s
    /// `planned_kv_tokens`, to set beside what the engine reports.
    pub kv_tokens: u64,
    /// Concurrent full-length requests the KV cache holds.
    pub max_requests: u64,
    pub fits: bool,
    /// Why it does not fit, or what to watch for.
    pub problem: Option<String>,
    /// The share of each GPU to give the engine: just enough for `concurrency`, else the cap.
    pub gpu_memory_utilization: f64,
    /// The KV cache in bytes, for releases that take it (`--kv-cache-memory-bytes`, 0.10.2 on):
    /// the KV space is then exactly the plan's, whatever the profile finds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_cache_memory_bytes: Option<u64>,
    /// vLLM's flags for this option.
    pub vllm_args: Vec<String>,
    /// The `[[model]]` budget block for gpuguard's config.
    pub gpuguard_model: String,
    /// `gpuguard launch` flags that reserve the same memory.
    pub launch_args: Vec<String>,
    /// The GCE machine type that carries `tp` of these GPUs (`plan --cloud gcp`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gcp_machine: Option<String>,
}

/// The answer: the model's figures, one row per option, the recommended row, every assumption.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct CapacityPlan {
    /// The vLLM release planned for.
    pub engine: Vllm,
    pub model: ModelFigures,
    pub options: Vec<GpuPlan>,
    /// Index into `options` of the option that fits with the least GPU memory (this host's
    /// GPUs first).
    pub recommended: Option<usize>,
    /// When the observation an option's overhead came from was recorded, if the model is not
    /// running now (Unix ms, from the daemon's history); absent when none was used or it runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub observed_at_ms: Option<u64>,
    pub assumptions: Vec<String>,
}

/// Works out the plan.
pub fn plan(r: &PlanRequest) -> Result<CapacityPlan, String> {
    validate(r)?;
    let a = &r.arch;
    let (weights_bytes, weights_note) = weights(r)?;
    let kv_b = r.kv_dtype.bytes() as u64;
    let per_layer_token = 2 * a.kv_heads * a.head_dim * kv_b;
    let naive_per_token = a.layers * 2 * a.attention_heads * a.head_dim * kv_b;
    let model = ModelFigures {
        name: r.name.clone(),
        model_type: a.model_type.clone(),
        params: a.params.map(|p| p.total()),
        weights_dtype: match r.weights {
            Weights::Dtype(d) => Some(d),
            Weights::Bytes(_) => None,
        },
        weights_bytes,
        kv_dtype: r.kv_dtype,
        layers: a.layers,
        attention_heads: a.attention_heads,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        sliding_window: a.sliding_window,
        sliding_layers: a.sliding_layers,
        max_model_len: r.max_model_len,
        kv_bytes_per_token: a.layers * per_layer_token,
        kv_bytes_per_request: kv_per_request(a, r.max_model_len, per_layer_token),
        naive_kv_bytes_per_token: naive_per_token,
        naive_kv_bytes_per_request: naive_per_token * r.max_model_len,
        concurrency: r.concurrency,
    };
    let mut options = Vec::new();
    for gpu in &r.gpus {
        if r.tp.is_empty() {
            options.extend(auto_tp(r, &model, gpu));
        } else {
            options.extend(r.tp.iter().map(|&tp| option(r, &model, gpu, tp)));
        }
    }
    let recommended = options
        .iter()
        .enumerate()
        .filter(|(_, o)| o.fits)
        .min_by_key(|(_, o)| (!o.live, o.gpu_total_bytes * u64::from(o.tp)))
        .map(|(i, _)| i);
    let mut assumptions = r.notes.clone();
    assumptions.push(weights_note);
    assumptions.extend(general_assumptions(r, &model));
    let used = r
        .observed
        .filter(|_| options.iter().any(|o| o.overhead_observed));
    if let (Some(o), Some(seen)) = (used, options.iter().find(|o| o.overhead_observed)) {
        // Running now, or remembered: the daemon's history's newest sample of it.
        let (when, at) = match o.seen_at_ms {
            None => ("running here", String::new()),
            Some(ms) => {
                let at = jiff::Timestamp::from_millisecond(ms as i64).map_or_else(
                    |_| format!("{ms} ms"),
                    |t| t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
                );
                (
                    "when it last ran here",
                    format!("; at {at}, in the daemon's history"),
                )
            }
        };
        let ran = |n: Option<u64>| n.map_or("default".to_string(), |n| n.to_string());
        let eager = if o.enforce_eager {
            ", --enforce-eager"
        } else {
            ""
        };
        assumptions.push(format!(
            "overhead on this host's GPUs: as seen of '{}' {when} ({} on {} GPU(s), its \
             engine's KV cache {} tokens{at}): {} per GPU besides its weights, KV cache and what \
             it holds beyond the share (it ran with --max-num-batched-tokens {}, --max-num-seqs \
             {}{eager}; what the planned flags cost beside those is modelled)",
            r.name,
            fmt_bytes(o.gpu_bytes),
            o.gpus,
            o.kv_tokens,
            fmt_bytes(seen.overhead_bytes),
            ran(o.max_num_batched_tokens),
            ran(o.max_num_seqs),
        ));
    }
    Ok(CapacityPlan {
        engine: r.engine,
        model,
        options,
        recommended,
        observed_at_ms: used.and_then(|o| o.seen_at_ms),
        assumptions,
    })
}

/// A model whose weights or KV cache of one request pass this (a pebibyte) is beyond any GPU
/// host: refused before any arithmetic, which then stays far from overflowing.
const MAX_FIGURE: u128 = 1 << 50;

fn validate(r: &PlanRequest) -> Result<(), String> {
    if r.max_model_len == 0 {
        return Err("--max-model-len must be above 0".into());
    }
    let a = &r.arch;
    let kv_per_request = a.layers as u128
        * 2
        * u128::from(a.attention_heads.max(a.kv_heads))
        * a.head_dim as u128
        * 4
        * r.max_model_len as u128;
    let weights = match r.weights {
        Weights::Bytes(b) => b as u128,
        Weights::Dtype(_) => a.params.map_or(0, |p| p.total() as u128 * 4),
    };
    if kv_per_request > MAX_FIGURE || weights > MAX_FIGURE {
        return Err(format!(
            "the model's weights or one request's KV cache come to more than {} (1 PiB): beyond any GPU host; check the sizes in its config",
            units::fmt_bytes(MAX_FIGURE as u64)
        ));
    }
    if let Some(u) = r
        .gpu_memory_utilization
        .filter(|u| !(*u > 0.0 && *u <= 1.0))
    {
        return Err(format!(
            "--gpu-memory-utilization '{u}' must be above 0 and at most 1"
        ));
    }
    let too_many = |n: Option<u64>| n.is_some_and(|n| n == 0 || n > 1 << 24);
    if too_many(r.max_num_batched_tokens) || too_many(r.max_num_seqs) {
        return Err(
            "--max-num-batched-tokens and --max-num-seqs must be between 1 and 16777216".into(),
        );
    }
    if let Some(max) = r.arch.max_position_embeddings {
        if r.max_model_len > max {
            return Err(format!(
                "--max-model-len {} is above the model's max_position_embeddings ({max})",
                r.max_model_len
            ));
        }
    }
    if r.tp.contains(&0) {
        return Err("--tp sizes must be above 0".into());
    }
    if matches!(r.kv_dtype, Dtype::Int8 | Dtype::Int4) {
        return Err(format!(
            "--kv-dtype {}: the KV cache is fp32, bf16, fp16 or fp8",
            r.kv_dtype
        ));
    }
    if r.concurrency == Some(0) {
        return Err("--concurrency must be above 0".into());
    }
    Ok(())
}

/// The weights in bytes, and how that was worked out.
fn weights(r: &PlanRequest) -> Result<(u64, String), String> {
    let dtype = match r.weights {
        Weights::Bytes(b) => return Ok((b, format!("weights: {} as given", fmt_bytes(b)))),
        Weights::Dtype(d) => d,
    };
    let Some(p) = r.arch.params else {
        return Err(
            "the parameter count is unknown (the config lacks hidden_size, intermediate_size or \
             vocab_size, or its vision_config the sizes of its layers): give --params or --weights"
                .into(),
        );
    };
    let high = if dtype.quantized() {
        2.0
    } else {
        dtype.bytes()
    };
    let bytes = p.layers as f64 * dtype.bytes() + (p.embeddings + p.vision) as f64 * high;
    let mut note = format!(
        "weights: {:.3}B parameters ({:.3}B in the layers, {:.3}B embeddings and output head{}) at {} ({} bytes per parameter)",
        p.total() as f64 / 1e9,
        p.layers as f64 / 1e9,
        p.embeddings as f64 / 1e9,
        if p.vision > 0 { format!(", {:.3}B vision", p.vision as f64 / 1e9) } else { String::new() },
        dtype,
        dtype.bytes()
    );
    if dtype.quantized() {
        note += if p.embeddings + p.vision > 0 {
            "; embeddings, output head and vision tower stay 16-bit"
        } else {
            "; all parameters taken as quantized (no breakdown: 16-bit embeddings would add more)"
        };
    }
    Ok((bytes.ceil() as u64, note))
}

/// KV bytes of one request of `len` tokens: full layers hold every token, sliding-window
/// layers at most the window plus one block; each layer's tokens fill whole blocks.
fn kv_per_request(a: &Architecture, len: u64, per_layer_token: u64) -> u64 {
    let blocks = |tokens: u64| tokens.div_ceil(BLOCK_TOKENS) * BLOCK_TOKENS;
    let full_layers = a.layers - a.sliding_layers;
    let window_tokens = a.sliding_window.map_or(len, |w| len.min(w + BLOCK_TOKENS));
    (full_layers * blocks(len) + a.sliding_layers * blocks(window_tokens)) * per_layer_token
}

/// KV heads on each GPU: an even share, or one replicated head per GPU when there are fewer
/// heads than GPUs. `None` when they do not split.
fn kv_heads_per_gpu(kv_heads: u64, tp: u64) -> Option<u64> {
    if kv_heads >= tp {
        (kv_heads % tp == 0).then_some(kv_heads / tp)
    } else {
        (tp % kv_heads == 0).then_some(1)
    }
}

/// TP 1, and when that does not fit the smallest of 2, 4, 8 that does (as many as there are);
/// if none does, TP 1 and the largest tried.
fn auto_tp(r: &PlanRequest, model: &ModelFigures, gpu: &GpuChoice) -> Vec<GpuPlan> {
    let one = option(r, model, gpu, 1);
    if one.fits {
        return vec![one];
    }
    let mut last = None;
    for tp in AUTO_TP.into_iter().filter(|&tp| tp <= gpu.count) {
        let o = option(r, model, gpu, tp);
        if o.fits {
            return vec![one, o];
        }
        last = Some(o);
    }
    std::iter::once(one).chain(last).collect()
}

/// Whether vLLM `r.engine` runs the model with its Model Runner V2, as it picks by default.
fn model_runner_v2(r: &PlanRequest) -> bool {
    let quantized =
        r.arch.quantized.is_some() || matches!(r.weights, Weights::Dtype(d) if d.quantized());
    r.engine
        .model_runner_v2(&r.arch.architectures, r.arch.experts > 0, quantized)
}

/// Whether the release charges the model's CUDA graphs to the share (none with
/// `--enforce-eager`).
fn cuda_graphs_charged(r: &PlanRequest) -> bool {
    !r.enforce_eager && r.engine.charges_cuda_graphs(model_runner_v2(r))
}

/// What an engine charges to its share of one GPU besides the weights, as the release sizes it
/// (or as a model running on this host was seen to take).
struct Charged {
    batched: u64,
    seqs: u64,
    activation: u64,
    non_torch: u64,
    graphs: u64,
    graphs_charged: bool,
    runner_v2: bool,
    context: u64,
    overhead: u64,
    observed: bool,
}

/// The overhead of one GPU at `tp`, for weights of `weights` and KV of `token_bytes` a token.
fn charged(r: &PlanRequest, gpu: &GpuChoice, tp: u32, weights: u64, token_bytes: u64) -> Charged {
    let (a, tp64) = (&r.arch, u64::from(tp));
    let (default_tokens, default_seqs) =
        r.engine
            .default_batch(gpu.total_bytes, &gpu.name, r.max_model_len);
    let batched = r.max_num_batched_tokens.unwrap_or(default_tokens);
    let seqs = r.max_num_seqs.unwrap_or(default_seqs);
    let activation = activation_bytes(r, tp64, batched, seqs);
    let non_torch = engine::non_torch_bytes(&gpu.name, tp64);
    // The graphs of a run that captures them, and whether the release charges them to the share
    // (else they are held beyond it).
    let captured = engine::cuda_graph_bytes(tp64);
    let runner_v2 = model_runner_v2(r);
    let charges = r.engine.charges_cuda_graphs(runner_v2);
    let graphs = if r.enforce_eager { 0 } else { captured };
    let context = engine::CUDA_CONTEXT_BYTES;
    // What the model says the overhead is, for a batch's activations and whether graphs are
    // captured.
    let modelled_with = |activation: u64, eager: bool| {
        activation
            .saturating_add(non_torch)
            .saturating_add(if charges && !eager { captured } else { 0 })
    };
    let modelled = modelled_with(activation, r.enforce_eager);
    // Seen on this host at this TP: what the model takes besides its weights and KV cache, less
    // what it holds beyond the share. It ran with flags of its own: the model's error seen there
    // is carried over to the planned flags (what the model says they cost, plus what it was
    // seen to miss). Not for sliding-window models: their engines count KV tokens per group of
    // layers.
    let seen = r
        .observed
        .filter(|o| gpu.live && o.gpus == tp && token_bytes > 0 && a.sliding_layers == 0)
        .map(|o| {
            let kv = o.kv_tokens.saturating_mul(token_bytes);
            let held = if o.enforce_eager { 0 } else { captured };
            let beyond = context + if charges { 0 } else { held };
            let seen = (o.gpu_bytes / u64::from(o.gpus))
                .saturating_sub(weights)
                .saturating_sub(kv)
                .saturating_sub(beyond);
            let ran_activation = activation_bytes(
                r,
                tp64,
                o.max_num_batched_tokens.unwrap_or(default_tokens),
                o.max_num_seqs.unwrap_or(default_seqs),
            );
            let ran = modelled_with(ran_activation, o.enforce_eager);
            seen.saturating_add(modelled).saturating_sub(ran)
        });
    Charged {
        batched,
        seqs,
        activation,
        non_torch,
        graphs,
        graphs_charged: charges && !r.enforce_eager,
        runner_v2,
        context,
        overhead: seen.unwrap_or(modelled),
        observed: seen.is_some(),
    }
}

fn option(r: &PlanRequest, model: &ModelFigures, gpu: &GpuChoice, tp: u32) -> GpuPlan {
    let a = &r.arch;
    let tp64 = u64::from(tp);
    let cap = r
        .gpu_memory_utilization
        .unwrap_or(r.engine.default_utilization());
    let usable = (gpu.total_bytes as f64 * cap) as u64;
    let weights = model.weights_bytes.div_ceil(tp64);
    let heads = kv_heads_per_gpu(a.kv_heads, tp64);
    let token_bytes = heads.map_or(0, |h| {
        a.layers * 2 * h * a.head_dim * r.kv_dtype.bytes() as u64
    });
    let c = charged(r, gpu, tp, weights, token_bytes);
    let overhead = c.overhead;
    let kv_request = heads.map_or(0, |h| {
        kv_per_request(
            a,
            r.max_model_len,
            2 * h * a.head_dim * r.kv_dtype.bytes() as u64,
        )
    });
    let kv_space = usable.saturating_sub(weights.saturating_add(overhead));
    let max_requests = kv_space.checked_div(kv_request).unwrap_or(0);
    let wanted = r.concurrency.unwrap_or(1);
    let problem = if tp > gpu.count {
        Some(if gpu.live {
            format!("this host has {} of these GPUs", gpu.count)
        } else {
            format!("no machine has more than {} of these GPUs", gpu.count)
        })
    } else if a.attention_heads % tp64 != 0 || heads.is_none() {
        Some(format!(
            "{} attention heads and {} KV heads do not split over {tp} GPUs",
            a.attention_heads, a.kv_heads
        ))
    } else if weights.saturating_add(overhead) >= usable {
        Some(format!(
            "weights {} + overhead {} exceed {:.0}% of {}",
            fmt_bytes(weights),
            fmt_bytes(overhead),
            cap * 100.0,
            fmt_bytes(gpu.total_bytes)
        ))
    } else if max_requests < wanted {
        Some(format!(
            "the KV cache ({}) holds {max_requests} full-length request(s) of {}, {wanted} wanted",
            fmt_bytes(kv_space),
            fmt_bytes(kv_request)
        ))
    } else {
        None
    };
    let fits = problem.is_none();
    let utilization = match r.concurrency {
        Some(n) if fits => {
            let need = weights + overhead + n * kv_request;
            ((need as f64 / gpu.total_bytes as f64) * 100.0).ceil() / 100.0
        }
        _ => cap,
    }
    .min(cap);
    let seqs = r.concurrency.unwrap_or(max_requests).max(1);
    // Exact where the release allows it: the KV cache for the concurrency asked (whole MiB),
    // else the space the share leaves.
    let kv_cache_memory_bytes = (fits && r.engine.kv_cache_bytes_flag()).then(|| {
        let kv = match r.concurrency {
            Some(n) => n * kv_request,
            None => kv_space,
        };
        kv.div_ceil(1 << 20) << 20
    });
    // What the engine's KV cache will be with the flags recommended: the bytes given, or what
    // the share asked leaves; nothing where the option does not fit.
    let planned_kv = match kv_cache_memory_bytes {
        _ if !fits => 0,
        Some(bytes) => bytes,
        None => ((gpu.total_bytes as f64 * utilization) as u64)
            .saturating_sub(weights)
            .saturating_sub(overhead),
    };
    let problem = problem.or_else(|| {
        let engine = (gpu.total_bytes as f64 * utilization) as u64;
        gpu.free_bytes
            .filter(|free| *free < engine + c.context)
            .map(|free| format!("only {} free now", fmt_bytes(free)))
    });
    let mut o = GpuPlan {
        gpu: gpu.name.clone(),
        live: gpu.live,
        tp,
        gpu_total_bytes: gpu.total_bytes,
        gpu_free_bytes: gpu.free_bytes,
        usable_bytes: usable,
        weights_bytes: weights,
        max_num_batched_tokens: c.batched,
        max_num_seqs: c.seqs,
        activation_bytes: c.activation,
        non_torch_bytes: c.non_torch,
        cuda_graph_bytes: c.graphs,
        cuda_graphs_charged: c.graphs_charged,
        model_runner_v2: c.runner_v2,
        cuda_context_bytes: c.context,
        overhead_bytes: overhead,
        overhead_observed: c.observed,
        kv_space_bytes: kv_space,
        kv_bytes_per_request: kv_request,
        kv_tokens: planned_kv
            .checked_div(token_bytes)
            .map_or(0, |t| t / BLOCK_TOKENS * BLOCK_TOKENS),
        max_requests,
        fits,
        problem,
        gpu_memory_utilization: utilization,
        kv_cache_memory_bytes,
        vllm_args: Vec::new(),
        gpuguard_model: String::new(),
        launch_args: Vec::new(),
        gcp_machine: gpus::gcp_machine(gpu.machines, tp),
    };
    o.vllm_args = vllm_args(r, &o, seqs);
    let (block, launch) = gpuguard_budget(r, model, &o);
    o.gpuguard_model = block;
    o.launch_args = launch;
    o
}

/// The peak of vLLM's profile run on one GPU: a forward pass of `batched` tokens, per token the
/// hidden state and residual (4 × hidden bytes) and the MLP's gate/up output and activation
/// (6 × its width / TP bytes), in 16 bits; the sampler's fp32 logits and probabilities for its
/// rows (V1: one per sequence, at most one per token; V0: `max_num_seqs`); and, in V1, a
/// multimodal model's vision encoder, profiled first.
fn activation_bytes(r: &PlanRequest, tp: u64, batched: u64, seqs: u64) -> u64 {
    let a = &r.arch;
    let (Some(hidden), Some(width)) = (a.hidden_size, a.mlp_width) else {
        return FALLBACK_ACTIVATION_BYTES;
    };
    // Saturating: a config's sizes are each bounded, their products need not be (a hostile
    // MoE's experts per token); a saturated figure does not fit anywhere, which is the answer.
    let per_token = hidden
        .saturating_mul(4)
        .saturating_add(width.saturating_mul(6) / tp);
    let rows = if r.engine.v1() {
        seqs.min(batched)
    } else {
        seqs
    };
    let logits = rows
        .saturating_mul(a.vocab_size.unwrap_or(0))
        .saturating_mul(8);
    let multimodal = a.params.is_some_and(|p| p.vision > 0);
    let vision = if multimodal && r.engine.v1() {
        engine::VISION_PROFILE_BYTES
    } else {
        0
    };
    batched
        .saturating_mul(per_token)
        .saturating_add(logits)
        .saturating_add(vision)
}

#[cfg(test)]
mod tests;
