//! What a model server says of itself: the figures its metrics report (`EngineStats`, read
//! by the agent's scraper) and what its command line says of the memory it takes
//! (`EngineFlags`). Plain data, serialised as `status --json`'s `models[].engine`.

/// What an engine reported, in the units gpuguard uses. `None`: the engine did not say. Also
/// the figures of `status --json`'s `models[].engine` (`status::EngineRow`).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EngineStats {
    /// Share of the KV cache in use, 0 to 1 (the fullest engine, with data parallelism).
    #[serde(rename = "kv_cache_usage_ratio")]
    pub kv_cache_usage: Option<f64>,
    pub requests_running: Option<u64>,
    pub requests_waiting: Option<u64>,
    /// Requests preempted since the engine started (their KV cache was taken back).
    pub preemptions_total: Option<u64>,
    /// From `vllm:cache_config_info`: the KV cache's blocks, tokens per block, and the share of
    /// the GPU the engine was told to take.
    pub kv_cache_blocks: Option<u64>,
    pub block_size_tokens: Option<u64>,
    pub gpu_memory_utilization: Option<f64>,
}

/// What a vLLM server's command line says of the memory it takes besides weights and KV cache:
/// the batch it profiles (`--max-num-batched-tokens`, `--max-num-seqs`) and whether it captures
/// CUDA graphs (`--enforce-eager`). `None`: not given, the engine's default. `plan --gpu host`
/// carries what a model was seen to take over to the flags it plans.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EngineFlags {
    pub max_num_batched_tokens: Option<u64>,
    pub max_num_seqs: Option<u64>,
    pub enforce_eager: bool,
}

/// The largest value taken from a command line (anyone names their process as they like).
const MAX_FLAG_VALUE: u64 = 1 << 40;

impl EngineFlags {
    /// The flags of a vLLM server's command line (its arguments joined by spaces: `vllm serve
    /// ...` or `python -m vllm.entrypoints.openai.api_server ...`; `--flag N`, `--flag=N`, and
    /// vLLM's underscore spellings); None when it is not one.
    pub fn from_vllm_cmdline(cmdline: &str) -> Option<EngineFlags> {
        let args: Vec<&str> = cmdline.split_ascii_whitespace().collect();
        let serve = args
            .windows(2)
            .any(|w| w[0].rsplit('/').next() == Some("vllm") && w[1] == "serve");
        if !serve && !args.iter().any(|a| a.starts_with("vllm.entrypoints.")) {
            return None;
        }
        let mut flags = EngineFlags::default();
        for (i, arg) in args.iter().enumerate() {
            let (name, inline) = match arg.split_once('=') {
                Some((name, value)) => (name, Some(value)),
                None => (*arg, None),
            };
            let number = || {
                inline
                    .or_else(|| args.get(i + 1).copied())
                    .and_then(|v| v.parse::<u64>().ok())
                    .filter(|&v| (1..=MAX_FLAG_VALUE).contains(&v))
            };
            match name.replace('_', "-").as_str() {
                "--max-num-batched-tokens" => flags.max_num_batched_tokens = number(),
                "--max-num-seqs" => flags.max_num_seqs = number(),
                "--enforce-eager" => {
                    flags.enforce_eager = inline.is_none_or(|v| v.eq_ignore_ascii_case("true"))
                }
                _ => {}
            }
        }
        Some(flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flags that size a vLLM server's memory, in each spelling it accepts; anything else,
    /// or a value out of bounds, is the default.
    #[test]
    fn a_vllm_servers_flags_are_read_from_its_command_line() {
        let read = EngineFlags::from_vllm_cmdline;
        assert_eq!(
            read("/usr/bin/python3 /usr/local/bin/vllm serve Qwen/Qwen3-8B --max-num-seqs 64 --max-num-batched-tokens=2048 --enforce-eager"),
            Some(EngineFlags {
                max_num_batched_tokens: Some(2048),
                max_num_seqs: Some(64),
                enforce_eager: true,
            })
        );
        assert_eq!(
            read("python3 -m vllm.entrypoints.openai.api_server --model m --max_num_seqs=8 --enforce-eager=false"),
            Some(EngineFlags {
                max_num_seqs: Some(8),
                ..EngineFlags::default()
            })
        );
        assert_eq!(
            read("vllm serve m --max-num-seqs 0 --max-num-batched-tokens 18446744073709551615"),
            Some(EngineFlags::default())
        );
        assert_eq!(
            read("vllm serve m --max-num-seqs"),
            Some(EngineFlags::default())
        );
        for other in [
            "python3 -c from multiprocessing.spawn import spawn_main",
            "myvllm serve --max-num-seqs 4",
            "python3 server.py --max-num-seqs 4",
        ] {
            assert_eq!(read(other), None, "{other}");
        }
    }
}
