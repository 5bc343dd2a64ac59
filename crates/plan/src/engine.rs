//! The engine a plan is for: how vLLM sizes its KV cache, release by release, and the defaults
//! it assumes. Read in vLLM's published wheels (0.4.3 to 0.33.0) and checked against startup
//! logs users published (`tests/fixtures/plan/engines/`, replayed by `plan::tests`) from 0.6.4
//! to 0.28:
//!
//! - vLLM profiles once at start: a dummy forward pass of `max_num_batched_tokens` tokens, then
//!   the sampler on one row per sequence (V1: `min(max_num_batched_tokens, max_num_seqs)`; V0:
//!   `max_num_seqs`), and multimodal models' vision encoder first (V1). The KV cache gets
//!   `total × gpu_memory_utilization` less the weights, that peak and the memory allocated
//!   outside PyTorch (NCCL, custom all-reduce buffers). The CUDA context that exists before the
//!   profile is not charged: it lives in the share left over.
//! - CUDA graphs are captured after the KV cache is allocated, beyond the share, until 0.20.0;
//!   from 0.20.0 an estimate of them is charged to the share (the profiler's switch defaults
//!   on, though its log line says "default since v0.21.0"; nothing with `--enforce-eager`),
//!   and the default share rose from 0.90 to 0.92 (vLLM PR 38284). The estimate comes from the
//!   V1 model runner: Model Runner V2, vLLM's default for more and more models from 0.22.0
//!   (`model_runner_v2`), returns 0 for it until 0.29.0, so those models have their graphs
//!   captured beyond the share as before 0.20.
//! - V0 (before 0.8.0, when V1 became the default) profiles `max(max_model_len, 2048)` tokens
//!   when chunked prefill is off (`max_model_len` up to 32768), so long contexts cost
//!   activations; V1 always chunks.
//! - From 0.10.2 the KV cache can be given in bytes (`--kv-cache-memory-bytes`, vLLM PR 21489):
//!   the share is then ignored and the KV space is exactly what the plan says.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// A vLLM release, `major.minor.patch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Vllm(pub u32, pub u32, pub u32);

impl Vllm {
    /// What `plan` assumes unless told: the behaviour of 0.20.0 and later (read in 0.20.0 to
    /// 0.33.0; replayed against 0.22.0 and 0.28 logs).
    pub const DEFAULT: Vllm = Vllm(0, 20, 0);
    /// The oldest release the model covers: earlier ones charged the CUDA context and measured
    /// the peak differently.
    pub const OLDEST: Vllm = Vllm(0, 6, 4);

    /// The V1 engine (the default from 0.8.0).
    pub fn v1(self) -> bool {
        self >= Vllm(0, 8, 0)
    }

    /// CUDA graphs are estimated and charged to the share, not captured beyond it: 0.20.0 on
    /// (`VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS` defaults to 1), but only where the model
    /// runner estimates them: Model Runner V2's `profile_cudagraph_memory` returns 0 until 0.29.0
    /// (`v1/worker/gpu/model_runner.py`, 0.20.0 to 0.28.0; 0.29.0 measures a capture into a
    /// throwaway pool, `v1/worker/gpu/cudagraph_utils.py`).
    pub fn charges_cuda_graphs(self, runner_v2: bool) -> bool {
        self >= Vllm(0, 20, 0) && !(runner_v2 && self < Vllm(0, 29, 0))
    }

    /// vLLM runs the model with Model Runner V2 unless told (`VLLM_USE_V2_MODEL_RUNNER` unset):
    /// the model's `architectures`, whether it is a mixture of experts and whether its weights
    /// are quantized decide, release by release (`VllmConfig.use_v2_model_runner` and
    /// `_is_default_v2_model_runner_model` in `config/vllm.py`):
    ///
    /// - before 0.22.0: never (V2 only when asked for);
    /// - 0.22: Qwen3ForCausalLM, dense and not quantized;
    /// - 0.23: Llama, Mistral and Qwen3 ForCausalLM, dense and not quantized;
    /// - 0.24: those three and DeepseekV2, Qwen2Moe, GraniteMoe ForCausalLM, quantized or not;
    /// - 0.25 to 0.28: every dense model, and the MoE architectures listed (DeepseekV2, Qwen2Moe,
    ///   GraniteMoe; 0.26 on also Inkling, LongcatFlashNgram; 0.27 on KimiK3; 0.28 DeepseekV4);
    /// - 0.29 on: every model.
    ///
    /// Hybrid (Mamba, gated delta-net) and attention-free models and features V2 lacks (n-gram
    /// speculation, custom logits processors, prompt embeddings...) keep V1; `plan` models
    /// neither.
    pub fn model_runner_v2(self, architectures: &[String], moe: bool, quantized: bool) -> bool {
        let listed = |names: &[&str]| architectures.iter().any(|a| names.contains(&a.as_str()));
        let v = |minor| Vllm(0, minor, 0);
        match self {
            e if e < v(22) => false,
            e if e < v(23) => !moe && !quantized && listed(&["Qwen3ForCausalLM"]),
            e if e < v(24) => {
                !moe && !quantized
                    && listed(&["LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM"])
            }
            e if e < v(25) => listed(&[
                "LlamaForCausalLM",
                "MistralForCausalLM",
                "Qwen3ForCausalLM",
                "DeepseekV2ForCausalLM",
                "Qwen2MoeForCausalLM",
                "GraniteMoeForCausalLM",
            ]),
            e if e < v(29) => {
                let moe_listed = match e {
                    e if e < v(26) => 3,
                    e if e < v(27) => 6,
                    e if e < v(28) => 7,
                    _ => 8,
                };
                !moe || listed(&V2_MOE_ARCHITECTURES[..moe_listed])
            }
            _ => true,
        }
    }

    /// `--gpu-memory-utilization` when not given.
    pub fn default_utilization(self) -> f64 {
        if self >= Vllm(0, 20, 0) {
            0.92
        } else {
            0.90
        }
    }

    /// The KV cache can be sized in bytes: `--kv-cache-memory-bytes` (0.10.2 on).
    pub fn kv_cache_bytes_flag(self) -> bool {
        self >= Vllm(0, 10, 2)
    }

    /// `--max-num-batched-tokens` and `--max-num-seqs` when not given, on a GPU of `total` bytes
    /// named `gpu`, for requests of up to `max_model_len` tokens (the OpenAI server's defaults).
    pub fn default_batch(self, total: u64, gpu: &str, max_model_len: u64) -> (u64, u64) {
        if !self.v1() {
            // Chunked prefill is on by itself only past 32K tokens.
            let tokens = match max_model_len {
                len if len > 32_768 && self >= Vllm(0, 6, 5) => 2048,
                len if len > 32_768 => 512,
                len => len.max(2048),
            };
            return (tokens, 256);
        }
        let a100 = gpu.to_ascii_lowercase().contains("a100") && self >= Vllm(0, 9, 0);
        match total {
            t if t >= 160 * GIB && self >= Vllm(0, 33, 0) => (16_384, 1024),
            t if t >= 70 * GIB && !a100 => (8192, 1024),
            _ => (2048, 256),
        }
    }
}

impl fmt::Display for Vllm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

impl Serialize for Vllm {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl FromStr for Vllm {
    type Err = String;
    /// "0.19", "0.19.0", "v0.10.2", "0.6.4.post1".
    fn from_str(text: &str) -> Result<Vllm, String> {
        let bad = || format!("'{text}' is not a vLLM version (e.g. 0.19.0)");
        let t = text.trim().trim_start_matches('v');
        let mut parts = t.split('.').map(|p| {
            let digits: String = p.chars().take_while(char::is_ascii_digit).collect();
            (!digits.is_empty())
                .then_some(digits)
                .and_then(|d| d.parse::<u32>().ok())
        });
        let major = parts.next().flatten().ok_or_else(bad)?;
        let minor = parts.next().flatten().ok_or_else(bad)?;
        let patch = parts.next().flatten().unwrap_or(0);
        let v = Vllm(major, minor, patch);
        if v < Vllm::OLDEST {
            return Err(format!(
                "vLLM {v}: plan models {} and later (earlier releases measured memory differently)",
                Vllm::OLDEST
            ));
        }
        Ok(v)
    }
}

/// The mixture-of-experts architectures Model Runner V2 is the default for, in the order vLLM
/// added them (`DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES`): 0.25 has the first three, 0.26 six, 0.27
/// seven, 0.28 eight.
const V2_MOE_ARCHITECTURES: [&str; 8] = [
    "DeepseekV2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "GraniteMoeForCausalLM",
    "InklingForCausalLM",
    "InklingForConditionalGeneration",
    "LongcatFlashNgramForCausalLM",
    "KimiK3ForConditionalGeneration",
    "DeepseekV4ForCausalLM",
];

/// Memory allocated outside PyTorch on each GPU at tensor-parallel size 1 (the logs: 0.07-0.35
/// GiB).
pub const NON_TORCH_BYTES: u64 = 384 * MIB;
/// The same with tensor parallelism on Hopper and Blackwell data-centre GPUs, where vLLM fuses
/// the all-reduce with the RMS norm through FlashInfer, whose workspace is allocated while the
/// profile compiles the model (the logs: 2.10 GiB at TP 2, 2.17 at TP 4 on H100; on a Turing
/// pair, where that fusion is off, 0.21 GiB at TP 2).
pub const NON_TORCH_TP_BYTES: u64 = 2304 * MIB;
/// The CUDA context and library workspaces, there before vLLM profiles: never charged to the
/// share, it needs the room the share leaves (about 0.5 GiB on an H100).
pub const CUDA_CONTEXT_BYTES: u64 = 640 * MIB;
/// CUDA graphs for the default capture sizes (the logs: 0.91-1.14 GiB at TP 1, 1.79 at TP 2).
pub const CUDA_GRAPH_BYTES: u64 = GIB;
pub const CUDA_GRAPH_TP_BYTES: u64 = 2 * GIB;
/// A multimodal model's vision encoder, profiled first with a dummy batch of images (V1).
pub const VISION_PROFILE_BYTES: u64 = 3 * GIB / 2;

/// Hopper and Blackwell data-centre GPUs (compute capability 9.0 and the 10.x family: H100,
/// H200, H800, H20, GH200, B100, B200, B300, GB200, GB300). With tensor parallelism vLLM fuses
/// the all-reduce and the RMS norm on these only (`enable_allreduce_rms_fusion`, "TP > 1 and
/// Hopper/Blackwell and flashinfer installed", `config/vllm.py` 0.20.0 to 0.33.0; the 0.19.0 H100
/// logs print "Enabled custom fusions: allreduce_rms"); its FlashInfer workspace is created while
/// the profile compiles, so it is charged as memory outside PyTorch.
/// NCCL's own buffers and the custom all-reduce's are allocated before the start snapshot
/// (vLLM warms NCCL up when it connects), so elsewhere tensor parallelism adds little.
pub fn hopper_or_blackwell(gpu: &str) -> bool {
    let name = gpu.to_ascii_lowercase();
    ["h100", "h200", "h800", "h20", "b100", "b200", "b300"]
        .iter()
        .any(|chip| name.contains(chip))
}

/// CUDA graphs' memory at `tp`.
pub fn cuda_graph_bytes(tp: u64) -> u64 {
    if tp > 1 {
        CUDA_GRAPH_TP_BYTES
    } else {
        CUDA_GRAPH_BYTES
    }
}

/// Memory allocated outside PyTorch on each GPU of `gpu` at `tp`.
pub fn non_torch_bytes(gpu: &str, tp: u64) -> u64 {
    if tp > 1 && hopper_or_blackwell(gpu) {
        NON_TORCH_TP_BYTES
    } else {
        NON_TORCH_BYTES
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_the_oldest_is_enforced() {
        assert_eq!("0.19".parse(), Ok(Vllm(0, 19, 0)));
        assert_eq!("v0.10.2".parse(), Ok(Vllm(0, 10, 2)));
        assert_eq!("0.6.4.post1".parse(), Ok(Vllm(0, 6, 4)));
        assert!("0.5.5"
            .parse::<Vllm>()
            .unwrap_err()
            .contains("0.6.4 and later"));
        assert!("latest".parse::<Vllm>().is_err());
        assert!("0".parse::<Vllm>().is_err());
    }

    /// Model Runner V2 became vLLM's default architecture by architecture (0.22 to 0.24), then
    /// for every dense model (0.25) and every model (0.29); until 0.29 it charges no estimate of
    /// the CUDA graphs (read in the wheels of 0.20.0 to 0.33.0).
    #[test]
    fn model_runner_v2_and_the_graph_estimate_follow_the_release() {
        let arch = |name: &str| vec![name.to_string()];
        let (qwen2, qwen3, llama) = (
            arch("Qwen2ForCausalLM"),
            arch("Qwen3ForCausalLM"),
            arch("LlamaForCausalLM"),
        );
        let (mixtral, qwen2_moe, inkling, dsv4) = (
            arch("MixtralForCausalLM"),
            arch("Qwen2MoeForCausalLM"),
            arch("InklingForCausalLM"),
            arch("DeepseekV4ForCausalLM"),
        );
        let v2 = |minor, a: &[String], moe, quantized| {
            Vllm(0, minor, 0).model_runner_v2(a, moe, quantized)
        };
        assert!(!v2(21, &qwen3, false, false));
        assert!(v2(22, &qwen3, false, false));
        assert!(!v2(22, &qwen3, false, true) && !v2(22, &llama, false, false));
        assert!(v2(23, &llama, false, false) && !v2(23, &llama, false, true));
        assert!(!v2(23, &qwen2, false, false));
        assert!(v2(24, &llama, false, true) && v2(24, &qwen2_moe, true, false));
        assert!(!v2(24, &qwen2, false, false));
        assert!(v2(25, &qwen2, false, false) && v2(25, &qwen2, false, true));
        assert!(v2(25, &qwen2_moe, true, false) && !v2(25, &mixtral, true, false));
        assert!(!v2(25, &inkling, true, false) && v2(26, &inkling, true, false));
        assert!(!v2(27, &dsv4, true, false) && v2(28, &dsv4, true, false));
        assert!(!v2(28, &mixtral, true, false) && v2(29, &mixtral, true, false));
        assert!(Vllm(0, 28, 1).model_runner_v2(&qwen2, false, false));
        // The estimate: from 0.20, but not by Model Runner V2 before 0.29.
        let charges = |minor, runner_v2| Vllm(0, minor, 0).charges_cuda_graphs(runner_v2);
        assert!(!charges(19, false) && charges(20, false) && charges(28, false));
        assert!(!charges(22, true) && !charges(28, true) && charges(29, true));
    }

    /// Only Hopper and Blackwell data-centre GPUs allocate the all-reduce fusion's workspace
    /// while vLLM profiles; elsewhere tensor parallelism adds nothing charged outside PyTorch.
    #[test]
    fn tensor_parallel_memory_outside_pytorch_follows_the_chip() {
        for gpu in [
            "H100 80GB",
            "NVIDIA H200",
            "NVIDIA H20",
            "B200 180GB",
            "GB200 186GB",
        ] {
            assert_eq!(non_torch_bytes(gpu, 2), NON_TORCH_TP_BYTES, "{gpu}");
            assert_eq!(non_torch_bytes(gpu, 1), NON_TORCH_BYTES, "{gpu}");
        }
        for gpu in [
            "A100 80GB",
            "L40S 48GB",
            "GeForce RTX 4090 24GB",
            "RTX PRO 6000 96GB",
            "Quadro RTX 6000",
        ] {
            assert_eq!(non_torch_bytes(gpu, 4), NON_TORCH_BYTES, "{gpu}");
        }
    }

    #[test]
    fn defaults_follow_the_release() {
        assert_eq!(Vllm(0, 19, 0).default_utilization(), 0.90);
        assert_eq!(Vllm(0, 20, 0).default_utilization(), 0.92);
        assert!(!Vllm(0, 19, 0).charges_cuda_graphs(false));
        assert!(Vllm(0, 20, 0).charges_cuda_graphs(false));
        assert!(!Vllm(0, 10, 1).kv_cache_bytes_flag() && Vllm(0, 10, 2).kv_cache_bytes_flag());
        let h100 = 79 * GIB;
        let v19 = Vllm(0, 19, 0);
        assert_eq!(v19.default_batch(h100, "H100 80GB", 8192), (8192, 1024));
        assert_eq!(v19.default_batch(h100, "A100 80GB", 8192), (2048, 256));
        assert_eq!(v19.default_batch(22 * GIB, "L4 24GB", 8192), (2048, 256));
        assert_eq!(v19.default_batch(180 * GIB, "B200", 8192), (8192, 1024));
        assert_eq!(
            Vllm(0, 33, 0).default_batch(180 * GIB, "B200", 8192),
            (16_384, 1024)
        );
        // V0: the whole context in one pass up to 32K, chunked beyond.
        let v0 = Vllm(0, 6, 4);
        assert_eq!(
            v0.default_batch(22 * GIB, "GeForce RTX 3090", 20_000),
            (20_000, 256)
        );
        assert_eq!(
            v0.default_batch(22 * GIB, "GeForce RTX 3090", 1024),
            (2048, 256)
        );
        assert_eq!(
            v0.default_batch(22 * GIB, "GeForce RTX 3090", 65_536),
            (512, 256)
        );
        assert_eq!(
            Vllm(0, 7, 3).default_batch(22 * GIB, "x", 65_536),
            (2048, 256)
        );
    }
}
