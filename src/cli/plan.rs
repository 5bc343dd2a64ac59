//! `gpuguard plan`: what a model needs and which GPUs hold it. Reads the config.json and, for
//! `--gpu host`, this host's GPUs (from the running daemon, else NVML directly); the arithmetic
//! is `crate::plan`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;

use super::{exit, wrapped, WIDTH};
use crate::config::DEFAULT_SOCKET;
use crate::history;
use crate::ipc::client::ask;
use crate::plan::{
    gpus, plan, Architecture, CapacityPlan, Dtype, GpuChoice, Observed, ParamCount, PlanRequest,
    Weights,
};
use crate::protocol::{Request, Response};
use crate::sample::nvml::{GpuSource, NvmlGpuSource};
use crate::status::ModelRow;
use crate::units::{fmt_bytes, Amount};

#[derive(Args)]
pub struct PlanArgs {
    /// The model's Hugging Face config.json (or the directory holding it). Without one, give
    /// --layers, --kv-heads, --head-dim and --params (or --weights).
    config: Option<PathBuf>,
    /// The model's name in the `[[model]]` block (default: the config's directory name).
    #[arg(long)]
    name: Option<String>,
    /// Parameter count, e.g. "8.03B", "70B" (default: what the config implies).
    #[arg(long, value_parser = parse_count)]
    params: Option<u64>,
    /// Transformer layers (overrides the config).
    #[arg(long)]
    layers: Option<u64>,
    /// Attention (query) heads.
    #[arg(long)]
    attention_heads: Option<u64>,
    /// Key/value heads (grouped-query attention).
    #[arg(long)]
    kv_heads: Option<u64>,
    /// Size of one attention head.
    #[arg(long)]
    head_dim: Option<u64>,
    /// Tokens a sliding-window layer keeps.
    #[arg(long)]
    sliding_window: Option<u64>,
    /// How many layers have the window (default: all).
    #[arg(long, requires = "sliding_window")]
    sliding_layers: Option<u64>,
    /// Weight dtype: fp32, bf16, fp16, fp8, int8, int4 (default: the config's quantization or
    /// torch_dtype; float32 checkpoints are served in bf16, as vLLM does).
    #[arg(long)]
    dtype: Option<Dtype>,
    /// The weights' size instead (e.g. a quantized checkpoint's size on disk: "4.9GiB"). With
    /// --dtype too, that is the dtype the model computes in (the KV cache's with --kv-dtype
    /// auto).
    #[arg(long, value_parser = parse_size)]
    weights: Option<u64>,
    /// KV-cache dtype: auto (the model's 16-bit dtype), fp16, bf16, fp8 or fp32.
    #[arg(long, default_value = "auto")]
    kv_dtype: String,
    /// Longest request in tokens, prompt and output (default: the model's
    /// max_position_embeddings).
    #[arg(long)]
    max_model_len: Option<u64>,
    /// Concurrent full-length requests wanted (default: say how many fit).
    #[arg(long)]
    concurrency: Option<u64>,
    /// Tensor-parallel sizes, e.g. "1,2" (default: 1, or the smallest of 2, 4, 8 that fits);
    /// `--count N` says the same: how many of the GPU the model is spread over.
    #[arg(long, visible_alias = "count", value_delimiter = ',')]
    tp: Vec<u32>,
    /// Plan in a cloud's terms: "gcp" lists the GPUs Google Compute Engine offers and the machine
    /// type that carries each option (N1 + T4/V100, G2, G4, A2, A3, A4, A4X).
    #[arg(long, value_parser = ["gcp"])]
    cloud: Option<String>,
    /// GPUs by name (see --help) or "host" for this host's GPUs; default: every card in the table.
    #[arg(long, value_delimiter = ',', long_help = gpu_help())]
    gpu: Vec<String>,
    /// The vLLM release to plan for, e.g. 0.19.0: how it charges memory (CUDA graphs inside the
    /// share from 0.20, but not for models on Model Runner V2 before 0.29), its defaults
    /// (--gpu-memory-utilization 0.92 from 0.20, else 0.90; batch sizes by GPU) and whether it
    /// takes the KV cache in bytes (0.10.2 on). Covers 0.6.4 and later.
    #[arg(long, default_value = "0.20.0")]
    vllm_version: crate::plan::Vllm,
    /// vLLM's --gpu-memory-utilization: the share of each GPU the engine may take (default: the
    /// release's).
    #[arg(long)]
    gpu_memory_utilization: Option<f64>,
    /// vLLM's --max-num-batched-tokens (sizes the activations it profiles; default: the
    /// release's for the GPU).
    #[arg(long)]
    max_num_batched_tokens: Option<u64>,
    /// vLLM's --max-num-seqs while it profiles (the sampler's rows; default: the release's for
    /// the GPU). The plan still recommends as many as fit.
    #[arg(long)]
    max_num_seqs: Option<u64>,
    /// Plan for vLLM's --enforce-eager: no CUDA graphs, none charged to the share or held beyond
    /// it.
    #[arg(long)]
    enforce_eager: bool,
    /// Print the plan as JSON.
    #[arg(long)]
    json: bool,
    /// The daemon's socket, asked for this host's GPUs.
    #[arg(long, env = "GPUGUARD_SOCKET", default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    /// Load NVML from this file when the daemon is not running (default: the library path).
    #[arg(long)]
    nvml_library: Option<PathBuf>,
    /// The daemon's flight recorder (`state_dir/history`): with `--gpu host`, a model that is
    /// not running now takes the overhead it was seen to take when it last ran here.
    #[arg(long, default_value_os_t = default_history_dir())]
    history_dir: PathBuf,
}

fn default_history_dir() -> PathBuf {
    crate::config::DaemonConfig::default()
        .state_dir
        .join(crate::history::DIR)
}

fn gpu_help() -> String {
    format!(
        "GPUs to plan for, comma-separated: {} (NVML's totals), or \"host\" for this host's GPUs \
         (asked from the running daemon, else read through NVML). Default: every card in the table.",
        gpus::keys()
    )
}

/// "8.03B", "70b", "560M", "7241732096".
fn parse_count(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let (number, scale) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let scale = match c.to_ascii_uppercase() {
                'K' => 1e3,
                'M' => 1e6,
                'B' | 'G' => 1e9,
                'T' => 1e12,
                _ => return Err(format!("'{text}' is not a count (e.g. \"8.03B\")")),
            };
            (&t[..i], scale)
        }
        _ => (t, 1.0),
    };
    match number.trim().parse::<f64>() {
        Ok(n) if n > 0.0 && n.is_finite() => Ok((n * scale).round() as u64),
        _ => Err(format!("'{text}' is not a count (e.g. \"8.03B\")")),
    }
}

fn parse_size(text: &str) -> Result<u64, String> {
    match text.parse::<Amount>()? {
        Amount::Bytes(b) => Ok(b),
        Amount::Percent(_) => Err(format!("'{text}': give a size (e.g. \"4.9GiB\")")),
    }
}

pub fn run(args: PlanArgs) -> u8 {
    match answer(&args) {
        Ok(text) => {
            print!("{text}");
            exit::OK
        }
        Err((code, e)) => {
            eprintln!("gpuguard: plan: {e}");
            code
        }
    }
}

/// What `plan` prints for `args` (the table, or JSON with `--json`), or its exit code and error.
fn answer(args: &PlanArgs) -> Result<String, (u8, String)> {
    let request = build_request(args).map_err(|f| match f {
        Failure::Usage(e) => (exit::CONFIG, e),
        Failure::Runtime(e) => (exit::FAILURE, e),
    })?;
    let p = plan(&request).map_err(|e| (exit::CONFIG, e))?;
    Ok(if args.json {
        serde_json::to_string_pretty(&p).expect("serialisable") + "\n"
    } else {
        render(&p)
    })
}

enum Failure {
    /// Bad arguments or config.json (exit 2).
    Usage(String),
    /// This host's GPUs could not be read (exit 1).
    Runtime(String),
}

fn build_request(args: &PlanArgs) -> Result<PlanRequest, Failure> {
    let (mut arch, mut notes, name) = match &args.config {
        Some(path) => read_config(path).map_err(Failure::Usage)?,
        None => (Architecture::default(), Vec::new(), None),
    };
    override_arch(args, &mut arch, &mut notes).map_err(Failure::Usage)?;
    let weights = match (args.weights, args.dtype) {
        (Some(b), _) => Weights::Bytes(b),
        (None, Some(d)) => Weights::Dtype(d),
        (None, None) => Weights::Dtype(default_dtype(&arch, &mut notes)),
    };
    let compute = match weights {
        Weights::Dtype(d) => Some(d),
        Weights::Bytes(_) => args.dtype,
    };
    let kv_dtype = kv_dtype(&args.kv_dtype, &arch, compute).map_err(Failure::Usage)?;
    let max_model_len = match (args.max_model_len, arch.max_position_embeddings) {
        (Some(n), _) => n,
        (None, Some(n)) => {
            notes.push(format!(
                "max model length: the model's max_position_embeddings ({n})"
            ));
            n
        }
        (None, None) => {
            return Err(Failure::Usage(
                "the config gives no max_position_embeddings: give --max-model-len".into(),
            ))
        }
    };
    let name = args.name.clone().or(name).unwrap_or_else(|| "model".into());
    let (gpus, models) = gpu_choices(args)?;
    let on_host = gpus.iter().any(|g| g.live);
    let observed = models
        .iter()
        .find(|m| m.name == name)
        .and_then(observed)
        .or_else(|| {
            on_host
                .then(|| last_observed(&args.history_dir, &name))
                .flatten()
        });
    Ok(PlanRequest {
        name,
        arch,
        weights,
        kv_dtype,
        max_model_len,
        concurrency: args.concurrency,
        tp: args.tp.clone(),
        gpus,
        observed,
        engine: args.vllm_version,
        gpu_memory_utilization: args.gpu_memory_utilization,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_num_seqs: args.max_num_seqs,
        enforce_eager: args.enforce_eager,
        notes,
    })
}

/// The architecture from a config.json (a file or its directory), and a name from its directory.
fn read_config(path: &Path) -> Result<(Architecture, Vec<String>, Option<String>), String> {
    let file = if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    };
    let text = std::fs::read_to_string(&file)
        .map_err(|e| format!("{}: cannot read: {e}", file.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", file.display()))?;
    let (arch, notes) =
        Architecture::from_hf_config(&json).map_err(|e| format!("{}: {e}", file.display()))?;
    // `Meta-Llama-3-8B/config.json` names the model by its directory, `llama.json` by itself.
    let file_name = file.canonicalize().unwrap_or_else(|_| file.clone());
    let name = if file_name.file_name().is_some_and(|n| n == "config.json") {
        file_name.parent().and_then(Path::file_name)
    } else {
        file_name.file_stem()
    }
    .map(|n| n.to_string_lossy().into_owned());
    Ok((arch, notes, name))
}

/// Explicit numbers win over the config's (and are said to).
fn override_arch(
    args: &PlanArgs,
    arch: &mut Architecture,
    notes: &mut Vec<String>,
) -> Result<(), String> {
    let mut set = |field: &mut u64, value: Option<u64>, flag: &str| {
        if let Some(v) = value {
            if args.config.is_some() && *field != v {
                notes.push(format!("{flag} {v} instead of the config's {field}"));
            }
            *field = v;
        }
    };
    set(&mut arch.layers, args.layers, "--layers");
    set(
        &mut arch.attention_heads,
        args.attention_heads,
        "--attention-heads",
    );
    set(&mut arch.kv_heads, args.kv_heads, "--kv-heads");
    set(&mut arch.head_dim, args.head_dim, "--head-dim");
    if arch.attention_heads == 0 {
        arch.attention_heads = arch.kv_heads;
    }
    if let Some(w) = args.sliding_window {
        arch.sliding_window = Some(w);
        arch.sliding_layers = args.sliding_layers.unwrap_or(arch.layers).min(arch.layers);
    }
    if let Some(p) = args.params {
        notes.push(format!("parameters: {p} as given (--params)"));
        arch.params = Some(ParamCount {
            layers: p,
            ..ParamCount::default()
        });
    }
    if arch.model_type.is_empty() {
        arch.model_type = "custom".into();
    }
    if arch.layers == 0 || arch.kv_heads == 0 || arch.head_dim == 0 {
        return Err(
            "give a config.json, or --layers, --kv-heads and --head-dim (and --params or --weights)"
                .into(),
        );
    }
    Ok(())
}

/// The weights' dtype when not given: the quantization, else what the checkpoint was saved in
/// (float32 served as bf16, as vLLM's `--dtype auto` does), else bf16.
fn default_dtype(arch: &Architecture, notes: &mut Vec<String>) -> Dtype {
    let (dtype, why) = match (arch.quantized, arch.saved_dtype) {
        (Some(q), _) => (q, "the config's quantization_config"),
        (None, Some(Dtype::Fp32)) => (
            Dtype::Bf16,
            "saved as float32, served as bf16 (vLLM's --dtype auto)",
        ),
        (None, Some(d)) => (d, "the config's torch_dtype"),
        (None, None) => (Dtype::Bf16, "not in the config: bf16 assumed"),
    };
    notes.push(format!("weights dtype {dtype}: {why}"));
    dtype
}

/// `auto`: the model's 16-bit compute dtype (what vLLM's `--kv-cache-dtype auto` uses).
fn kv_dtype(text: &str, arch: &Architecture, compute: Option<Dtype>) -> Result<Dtype, String> {
    if text != "auto" {
        return text.parse();
    }
    Ok(match (compute, arch.saved_dtype) {
        (Some(d @ (Dtype::Bf16 | Dtype::Fp16)), _) => d,
        (_, Some(d @ (Dtype::Bf16 | Dtype::Fp16))) => d,
        _ => Dtype::Bf16,
    })
}

fn gpu_choices(args: &PlanArgs) -> Result<(Vec<GpuChoice>, Vec<ModelRow>), Failure> {
    let gcp = args.cloud.is_some();
    let table = |g: &gpus::KnownGpu| GpuChoice {
        name: g.name.into(),
        total_bytes: g.total_bytes(),
        free_bytes: None,
        // In a cloud, as many as its largest machine type carries.
        count: match (gcp, g.gcp.last()) {
            (true, Some((n, _))) => *n,
            _ => 8,
        },
        live: false,
        machines: if gcp { g.gcp } else { &[] },
    };
    if args.gpu.is_empty() {
        let all = gpus::KNOWN_GPUS
            .iter()
            .filter(|g| !gcp || !g.gcp.is_empty())
            .map(table)
            .collect();
        return Ok((all, Vec::new()));
    }
    let mut out = Vec::new();
    let mut models = Vec::new();
    for name in &args.gpu {
        if name.eq_ignore_ascii_case("host") {
            let (host, seen) =
                host_gpus(&args.socket, args.nvml_library.clone()).map_err(Failure::Runtime)?;
            out.extend(host);
            models = seen;
            continue;
        }
        let gpu = gpus::find(name).ok_or_else(|| {
            Failure::Usage(format!(
                "--gpu '{name}' is not in the table ({}, or host)",
                gpus::keys()
            ))
        })?;
        if gcp && gpu.gcp.is_empty() {
            return Err(Failure::Usage(format!(
                "--gpu '{name}': Google Compute Engine has no machine type with a {}",
                gpu.name
            )));
        }
        out.push(table(gpu));
    }
    Ok((out, models))
}

/// What the daemon observed of a model: its GPU memory, its engine's KV cache in tokens and the
/// flags its server ran with.
fn observed(m: &ModelRow) -> Option<Observed> {
    let e = m
        .engine
        .as_ref()
        .filter(|e| e.state == crate::kinds::EngineState::Ok)?;
    let flags = m.engine_flags.unwrap_or_default();
    Some(Observed {
        gpu_bytes: m.gpu_bytes?,
        gpus: m.gpu_count,
        kv_tokens: e
            .stats
            .kv_cache_blocks?
            .checked_mul(e.stats.block_size_tokens?)?,
        seen_at_ms: None,
        max_num_batched_tokens: flags.max_num_batched_tokens,
        max_num_seqs: flags.max_num_seqs,
        enforce_eager: flags.enforce_eager,
    })
    .filter(|o| o.gpus > 0)
}

/// The newest observation of model `name` in the daemon's history (`None` without one, or
/// without a history this user can read): what it took when it last ran here.
fn last_observed(dir: &Path, name: &str) -> Option<Observed> {
    let mut last = None;
    let _ = history::visit(dir, |record| {
        if let history::Record::Sample { at_ms, status, .. } = record {
            let seen = status
                .models
                .iter()
                .find(|m| m.name == name)
                .and_then(observed);
            if let Some(o) = seen {
                last = Some(Observed {
                    seen_at_ms: Some(at_ms),
                    ..o
                });
            }
        }
    });
    last
}

/// One row per kind of GPU on this host: from the daemon's status if it is running, else from
/// NVML (on a thread, so a stalled driver cannot hang the command).
/// With the daemon, also the models it sees (what it observed of each).
fn host_gpus(
    socket: &Path,
    library: Option<PathBuf>,
) -> Result<(Vec<GpuChoice>, Vec<ModelRow>), String> {
    let mut models = Vec::new();
    let rows: Vec<(String, Option<u64>, Option<u64>)> = match ask(socket, Request::Status) {
        Ok(Response::Status(r)) if r.gpu_protection.state == crate::kinds::Protection::Ok => {
            models = r.models;
            r.gpus
                .iter()
                .map(|g| (g.name.clone(), g.total_bytes, g.free_bytes))
                .collect()
        }
        _ => {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let reading = NvmlGpuSource::new(library, Duration::ZERO).sample(false);
                let _ = tx.send(reading);
            });
            let reading = rx
                .recv_timeout(Duration::from_secs(20))
                .map_err(|_| "NVML did not answer within 20s".to_string())?;
            if let crate::snapshot::GpuStatus::Unavailable(why) = reading.status {
                return Err(format!("this host's GPUs: {why}"));
            }
            reading
                .devices
                .iter()
                .map(|g| (g.name.clone(), g.total_bytes, g.free_bytes))
                .collect()
        }
    };
    let mut out: Vec<GpuChoice> = Vec::new();
    for (name, total, free) in rows {
        let Some(total) = total else { continue };
        match out
            .iter_mut()
            .find(|g| g.name == name && g.total_bytes == total)
        {
            Some(g) => {
                g.count += 1;
                g.free_bytes = g.free_bytes.min(free);
            }
            None => out.push(GpuChoice {
                name,
                total_bytes: total,
                free_bytes: free,
                count: 1,
                live: true,
                machines: &[],
            }),
        }
    }
    if out.is_empty() {
        return Err("this host has no GPU with a known memory total".into());
    }
    for g in &mut out {
        g.name = format!("host: {}", g.name);
    }
    Ok((out, models))
}

/// The plan as text: the model's figures, a table of options, the recommendation, assumptions.
pub fn render(p: &CapacityPlan) -> String {
    let m = &p.model;
    let mut out = String::new();
    out += &wrapped(
        &format!(
            "Model {} ({}): {}weights {}{}",
            m.name,
            m.model_type,
            m.params.map_or(String::new(), |n| format!(
                "{:.2}B parameters, ",
                n as f64 / 1e9
            )),
            fmt_bytes(m.weights_bytes),
            m.weights_dtype.map_or(String::new(), |d| format!(" ({d})")),
        ),
        "",
        "  ",
    );
    out += &format!(
        "KV cache ({}): {} per token; {} per {}-token request\n  (naive, all {} heads and no window: {})\n",
        m.kv_dtype,
        fmt_bytes(m.kv_bytes_per_token),
        fmt_bytes(m.kv_bytes_per_request),
        m.max_model_len,
        m.attention_heads,
        fmt_bytes(m.naive_kv_bytes_per_request),
    );
    out += &match m.concurrency {
        Some(n) => format!("Wanted: {n} concurrent full-length requests\n\n"),
        None => "Wanted: as many concurrent full-length requests as fit\n\n".into(),
    };
    out += &options_table(p);
    out += &recommendation(p);
    out += "\nAssumptions:\n";
    for a in &p.assumptions {
        out += &wrapped(a, "  -", "    ");
    }
    out
}

/// The options as a table no wider than 100 columns: what does not fit in a cell (why an option
/// does not fit, or what to watch) is numbered and said under the table.
fn options_table(p: &CapacityPlan) -> String {
    let gcp = p.options.iter().any(|o| o.gcp_machine.is_some());
    let mut header = vec![
        "GPU", "TP", "usable", "weights", "overhead", "KV cache", "requests", "fits",
    ];
    if gcp {
        header.push("GCP machine type");
    }
    let mut notes: Vec<String> = Vec::new();
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for o in &p.options {
        let fits = match &o.problem {
            None => "yes".to_string(),
            Some(problem) => {
                notes.push(problem.clone());
                format!("{} [{}]", if o.fits { "yes" } else { "no" }, notes.len())
            }
        };
        let mut row = vec![
            o.gpu.clone(),
            o.tp.to_string(),
            fmt_bytes(o.usable_bytes),
            fmt_bytes(o.weights_bytes),
            fmt_bytes(o.overhead_bytes),
            fmt_bytes(o.kv_space_bytes),
            o.max_requests.to_string(),
            fits,
        ];
        if gcp {
            row.push(o.gcp_machine.clone().unwrap_or_else(|| "-".into()));
        }
        rows.push(row);
    }
    let share = p.options.first().map_or(String::new(), |o| {
        format!(
            "usable = {:.0}% of each GPU (--gpu-memory-utilization); overhead = profile peak, \
             non-torch{}; ",
            o.usable_bytes as f64 / o.gpu_total_bytes as f64 * 100.0,
            if o.cuda_graphs_charged {
                ", CUDA graphs"
            } else {
                ""
            }
        )
    });
    let mut out = wrapped(
        &format!("Per GPU ({share}sizes per GPU; requests = concurrent full-length requests):"),
        "",
        "",
    );
    out.push('\n');
    out.push_str(&columns(&rows));
    if !notes.is_empty() {
        out.push('\n');
        for (n, note) in notes.iter().enumerate() {
            out.push_str(&wrapped(note, &format!("[{}]", n + 1), "    "));
        }
    }
    out
}

/// A command line wrapped to `WIDTH` with shell continuations, its flags kept with their values.
fn command(indent: &str, words: &[String]) -> String {
    let mut parts: Vec<String> = Vec::new();
    for w in words {
        match parts.last_mut() {
            Some(last) if last.starts_with("--") && !w.starts_with("--") && !last.contains(' ') => {
                last.push(' ');
                last.push_str(w);
            }
            _ => parts.push(w.clone()),
        }
    }
    let mut out = String::new();
    let mut line = indent.to_string();
    for (i, part) in parts.iter().enumerate() {
        if i > 0 && line.chars().count() + 1 + part.chars().count() + 2 > WIDTH {
            out.push_str(&line);
            out.push_str(" \\\n");
            line = format!("{indent}    ");
        } else if i > 0 {
            line.push(' ');
        }
        line.push_str(part);
    }
    out.push_str(&line);
    out.push('\n');
    out
}

/// Rows as left-aligned columns two spaces apart (the first row is the header).
fn columns(rows: &[Vec<String>]) -> String {
    let count = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..count)
        .map(|i| {
            rows.iter()
                .filter_map(|r| r.get(i))
                .map(|c| c.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

fn recommendation(p: &CapacityPlan) -> String {
    let Some(o) = p.recommended.map(|i| &p.options[i]) else {
        return "\nNothing listed fits: try a larger --tp, a shorter --max-model-len, fp8 \
                (--kv-dtype fp8, --dtype fp8) or fewer --concurrency.\n"
            .into();
    };
    let vllm: Vec<String> = ["vllm", "serve", &p.model.name]
        .iter()
        .map(|w| w.to_string())
        .chain(o.vllm_args.iter().cloned())
        .collect();
    let launch: Vec<String> = ["gpuguard", "launch"]
        .iter()
        .map(|w| w.to_string())
        .chain(o.launch_args.iter().cloned())
        .chain(["--", "vllm", "serve", "..."].map(String::from))
        .collect();
    let machine = o
        .gcp_machine
        .as_ref()
        .map_or(String::new(), |m| format!(", on GCP {m}"));
    format!(
        "\nRecommended: {} × {}{machine} (the least GPU memory that fits)\n{}{}\nFor gpuguard's config:\n{}",
        o.tp,
        o.gpu,
        command("  ", &vllm),
        command("  ", &launch),
        o.gpuguard_model
    )
}

#[cfg(test)]
mod tests;
