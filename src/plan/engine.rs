//! The engine a plan is for: how vLLM sizes its KV cache, release by release, and the defaults
//! it assumes. Read in vLLM's published wheels (0.4.3 to 0.33.0, 0.21.0 among them) and checked
//! against startup logs users published (`tests/fixtures/plan/engines/`, replayed by
//! `plan::tests`) from 0.6.4 to 0.19.0; no complete published log of 0.20.0 or later has been
//! found yet, so the default below is read in source and only partly seen in logs (0.20.0 to
//! 0.27.1 logs all charge the graph estimate):
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
//!   and the default share rose from 0.90 to 0.92 (vLLM PR 38284).
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
    /// What `plan` assumes unless told: the behaviour of 0.20.0 and later (read in 0.20.0, 0.21.0,
    /// 0.22.0 and 0.33.0; not yet replayed against a complete log).
    pub const DEFAULT: Vllm = Vllm(0, 20, 0);
    /// The oldest release the model covers: earlier ones charged the CUDA context and measured
    /// the peak differently.
    pub const OLDEST: Vllm = Vllm(0, 6, 4);

    /// The V1 engine (the default from 0.8.0).
    pub fn v1(self) -> bool {
        self >= Vllm(0, 8, 0)
    }

    /// CUDA graphs are estimated and charged to the share (0.20.0 on), not captured beyond it.
    pub fn charges_cuda_graphs(self) -> bool {
        self >= Vllm(0, 20, 0)
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

/// Memory allocated outside PyTorch on each GPU at tensor-parallel size 1 (the logs: 0.16-0.35
/// GiB).
pub const NON_TORCH_BYTES: u64 = 384 * MIB;
/// The same with tensor parallelism on GPUs that talk peer to peer (NCCL and vLLM's custom
/// all-reduce buffers; the logs: 2.10 GiB at TP 2, 2.17 at TP 4 on H100).
pub const NON_TORCH_TP_BYTES: u64 = 2304 * MIB;
/// The CUDA context and library workspaces, there before vLLM profiles: never charged to the
/// share, it needs the room the share leaves (about 0.5 GiB on an H100).
pub const CUDA_CONTEXT_BYTES: u64 = 640 * MIB;
/// CUDA graphs for the default capture sizes (the logs: 0.91-1.14 GiB at TP 1, 1.79 at TP 2).
pub const CUDA_GRAPH_BYTES: u64 = GIB;
pub const CUDA_GRAPH_TP_BYTES: u64 = 2 * GIB;
/// A multimodal model's vision encoder, profiled first with a dummy batch of images (V1).
pub const VISION_PROFILE_BYTES: u64 = 3 * GIB / 2;

/// GPUs whose tensor-parallel traffic goes peer to peer (data-centre cards): GeForce cards have
/// no P2P, so vLLM leaves its custom all-reduce off and allocates little outside PyTorch.
pub fn peer_to_peer(gpu: &str) -> bool {
    !gpu.to_ascii_lowercase().contains("geforce")
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
    if tp > 1 && peer_to_peer(gpu) {
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

    #[test]
    fn defaults_follow_the_release() {
        assert_eq!(Vllm(0, 19, 0).default_utilization(), 0.90);
        assert_eq!(Vllm(0, 20, 0).default_utilization(), 0.92);
        assert!(!Vllm(0, 19, 0).charges_cuda_graphs() && Vllm(0, 20, 0).charges_cuda_graphs());
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
