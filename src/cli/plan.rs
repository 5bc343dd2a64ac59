//! `gpuguard plan`: what a model needs and which GPUs hold it. Reads the config.json and, for
//! `--gpu host`, this host's GPUs (from the running daemon, else NVML directly); the arithmetic
//! is `crate::plan`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use comfy_table::presets::UTF8_BORDERS_ONLY;
use comfy_table::{Cell, Table};

use super::exit;
use crate::config::DEFAULT_SOCKET;
use crate::ipc::client::ask;
use crate::plan::{
    gpus, plan, Architecture, CapacityPlan, Dtype, GpuChoice, ParamCount, PlanRequest, Weights,
};
use crate::protocol::{Request, Response};
use crate::sample::nvml::{GpuSource, NvmlGpuSource};
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
    /// The weights' size instead (e.g. a quantized checkpoint's size on disk: "4.9GiB").
    #[arg(long, value_parser = parse_size, conflicts_with = "dtype")]
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
    /// Tensor-parallel sizes, e.g. "1,2" (default: 1, or the smallest of 2, 4, 8 that fits).
    #[arg(long, value_delimiter = ',')]
    tp: Vec<u32>,
    /// GPUs by name (see --help) or "host" for this host's GPUs; default: every card in the table.
    #[arg(long, value_delimiter = ',', long_help = gpu_help())]
    gpu: Vec<String>,
    /// vLLM's --gpu-memory-utilization: the share of each GPU the engine may take.
    #[arg(long, default_value_t = 0.9)]
    gpu_memory_utilization: f64,
    /// vLLM's --max-num-batched-tokens (sizes the activations).
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: u64,
    /// Print the plan as JSON.
    #[arg(long)]
    json: bool,
    /// The daemon's socket, asked for this host's GPUs.
    #[arg(long, env = "GPUGUARD_SOCKET", default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    /// Load NVML from this file when the daemon is not running (default: the library path).
    #[arg(long)]
    nvml_library: Option<PathBuf>,
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
    let request = match build_request(&args) {
        Ok(r) => r,
        Err(Failure::Usage(e)) => {
            eprintln!("gpuguard: plan: {e}");
            return exit::CONFIG;
        }
        Err(Failure::Runtime(e)) => {
            eprintln!("gpuguard: plan: {e}");
            return exit::FAILURE;
        }
    };
    match plan(&request) {
        Ok(p) if args.json => {
            println!(
                "{}",
                serde_json::to_string_pretty(&p).expect("serialisable")
            );
            exit::OK
        }
        Ok(p) => {
            print!("{}", render(&p));
            exit::OK
        }
        Err(e) => {
            eprintln!("gpuguard: plan: {e}");
            exit::CONFIG
        }
    }
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
    let kv_dtype = kv_dtype(&args.kv_dtype, &arch, weights).map_err(Failure::Usage)?;
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
    Ok(PlanRequest {
        name: args.name.clone().or(name).unwrap_or_else(|| "model".into()),
        arch,
        weights,
        kv_dtype,
        max_model_len,
        concurrency: args.concurrency,
        tp: args.tp.clone(),
        gpus: gpu_choices(args)?,
        gpu_memory_utilization: args.gpu_memory_utilization,
        max_num_batched_tokens: args.max_num_batched_tokens,
        profile_num_seqs: 256,
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
fn kv_dtype(text: &str, arch: &Architecture, weights: Weights) -> Result<Dtype, String> {
    if text != "auto" {
        return text.parse();
    }
    Ok(match (weights, arch.saved_dtype) {
        (Weights::Dtype(d @ (Dtype::Bf16 | Dtype::Fp16)), _) => d,
        (_, Some(d @ (Dtype::Bf16 | Dtype::Fp16))) => d,
        _ => Dtype::Bf16,
    })
}

fn gpu_choices(args: &PlanArgs) -> Result<Vec<GpuChoice>, Failure> {
    let table = |g: &gpus::KnownGpu| GpuChoice {
        name: g.name.into(),
        total_bytes: g.total_bytes(),
        free_bytes: None,
        count: 8,
        live: false,
    };
    if args.gpu.is_empty() {
        return Ok(gpus::KNOWN_GPUS.iter().map(table).collect());
    }
    let mut out = Vec::new();
    for name in &args.gpu {
        if name.eq_ignore_ascii_case("host") {
            out.extend(
                host_gpus(&args.socket, args.nvml_library.clone()).map_err(Failure::Runtime)?,
            );
            continue;
        }
        let gpu = gpus::find(name).ok_or_else(|| {
            Failure::Usage(format!(
                "--gpu '{name}' is not in the table ({}, or host)",
                gpus::keys()
            ))
        })?;
        out.push(table(gpu));
    }
    Ok(out)
}

/// One row per kind of GPU on this host: from the daemon's status if it is running, else from
/// NVML (on a thread, so a stalled driver cannot hang the command).
fn host_gpus(socket: &Path, library: Option<PathBuf>) -> Result<Vec<GpuChoice>, String> {
    let rows: Vec<(String, Option<u64>, Option<u64>)> = match ask(socket, Request::Status) {
        Ok(Response::Status(r)) if r.gpu_protection.state == "ok" => r
            .gpus
            .iter()
            .map(|g| (g.name.clone(), g.total_bytes, g.free_bytes))
            .collect(),
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
            }),
        }
    }
    if out.is_empty() {
        return Err("this host has no GPU with a known memory total".into());
    }
    for g in &mut out {
        g.name = format!("host: {}", g.name);
    }
    Ok(out)
}

/// The plan as text: the model's figures, a table of options, the recommendation, assumptions.
pub fn render(p: &CapacityPlan) -> String {
    let m = &p.model;
    let mut out = format!(
        "Model {} ({}): {}weights {}{}\n",
        m.name,
        m.model_type,
        m.params.map_or(String::new(), |n| format!(
            "{:.2}B parameters, ",
            n as f64 / 1e9
        )),
        fmt_bytes(m.weights_bytes),
        m.weights_dtype.map_or(String::new(), |d| format!(" ({d})")),
    );
    out += &format!(
        "KV cache ({}): {} per token; {} per {}-token request (naive, all {} heads and no window: {})\n",
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
        out += &format!("  - {a}\n");
    }
    out
}

fn options_table(p: &CapacityPlan) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_BORDERS_ONLY).set_header(
        [
            "GPU",
            "TP",
            "total",
            "engine share",
            "weights",
            "overhead",
            "KV cache",
            "requests",
            "fits",
        ]
        .map(Cell::new),
    );
    for o in &p.options {
        t.add_row(vec![
            o.gpu.clone(),
            o.tp.to_string(),
            fmt_bytes(o.gpu_total_bytes),
            format!(
                "{} ({:.0}%)",
                fmt_bytes(o.usable_bytes),
                o.usable_bytes as f64 / o.gpu_total_bytes as f64 * 100.0
            ),
            fmt_bytes(o.weights_bytes),
            fmt_bytes(o.overhead_bytes),
            fmt_bytes(o.kv_space_bytes),
            o.max_requests.to_string(),
            match (&o.problem, o.fits) {
                (None, _) => "yes".into(),
                (Some(p), true) => format!("yes ({p})"),
                (Some(p), false) => format!("no: {p}"),
            },
        ]);
    }
    format!("Per GPU (sizes per GPU; requests = concurrent full-length requests):\n{t}\n")
}

fn recommendation(p: &CapacityPlan) -> String {
    let Some(o) = p.recommended.map(|i| &p.options[i]) else {
        return "\nNothing listed fits: try a larger --tp, a shorter --max-model-len, fp8 \
                (--kv-dtype fp8, --dtype fp8) or fewer --concurrency.\n"
            .into();
    };
    format!(
        "\nRecommended: {} × {} (the least GPU memory that fits)\n  vllm serve {} {}\n  gpuguard launch {} -- vllm serve ...\n\nFor gpuguard's config:\n{}",
        o.tp,
        o.gpu,
        p.model.name,
        o.vllm_args.join(" "),
        o.launch_args.join(" "),
        o.gpuguard_model
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_take_suffixes() {
        assert_eq!(parse_count("8.03B"), Ok(8_030_000_000));
        assert_eq!(parse_count("70b"), Ok(70_000_000_000));
        assert_eq!(parse_count("560M"), Ok(560_000_000));
        assert_eq!(parse_count("7241732096"), Ok(7_241_732_096));
        assert!(parse_count("lots").unwrap_err().contains("'lots'"));
        assert!(parse_count("-1B").is_err());
    }
}
