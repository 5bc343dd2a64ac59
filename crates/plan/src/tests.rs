//! The arithmetic against values worked out by hand from public architectures' published numbers
//! (the fixtures in tests/fixtures/plan are their config.json files), and where the naive
//! estimate (every attention head, no window) is off.

use super::*;

const MIB: u64 = 1 << 20;

fn fixture(name: &str) -> serde_json::Value {
    let path = format!(
        "{}/../../tests/fixtures/plan/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn arch(name: &str) -> (Architecture, Vec<String>) {
    Architecture::from_hf_config(&fixture(name)).unwrap()
}

fn h100() -> GpuChoice {
    let g = gpus::find("h100").unwrap();
    GpuChoice {
        name: g.name.into(),
        total_bytes: g.total_bytes(),
        free_bytes: None,
        count: 8,
        live: false,
        machines: &[],
    }
}

fn request(name: &str, max_model_len: u64) -> PlanRequest {
    let (arch, notes) = arch(name);
    PlanRequest {
        name: name.into(),
        arch,
        weights: Weights::Dtype(Dtype::Bf16),
        kv_dtype: Dtype::Bf16,
        max_model_len,
        concurrency: None,
        tp: vec![1],
        gpus: vec![h100()],
        engine: Vllm::DEFAULT,
        gpu_memory_utilization: Some(0.9),
        max_num_batched_tokens: Some(8192),
        max_num_seqs: Some(256),
        enforce_eager: false,
        observed: None,
        notes,
    }
}

#[test]
fn llama_3_8b_gqa_matches_the_published_counts() {
    let (a, _) = arch("llama-3-8b");
    assert_eq!(
        (a.layers, a.attention_heads, a.kv_heads, a.head_dim),
        (32, 32, 8, 128)
    );
    // 128256 × 4096 twice (untied) + 32 × (q,o 4096² + k,v 4096×1024 + MLP 3×4096×14336 + norms)
    // + final norm = 8,030,261,248: Meta's "8.03B".
    assert_eq!(a.params.unwrap().total(), 8_030_261_248);
    let p = plan(&request("llama-3-8b", 8192)).unwrap();
    let m = &p.model;
    assert_eq!(m.weights_bytes, 16_060_522_496);
    // 32 layers × 2 × 8 KV heads × 128 × 2 bytes = 128 KiB a token, 1 GiB at 8192 tokens.
    assert_eq!(m.kv_bytes_per_token, 128 << 10);
    assert_eq!(m.kv_bytes_per_request, 1 << 30);
    // Counting all 32 heads (no GQA) is 4× too much.
    assert_eq!(m.naive_kv_bytes_per_request, 4 << 30);
}

#[test]
fn llama_3_8b_on_one_h100_holds_54_full_length_requests() {
    let p = plan(&request("llama-3-8b", 8192)).unwrap();
    let o = &p.options[0];
    // 81,559 MiB × 0.9 = 76,968,728,985 bytes for the engine.
    assert_eq!(o.usable_bytes, 76_968_728_985);
    // The profile's peak: 8192 × (4×4096 + 6×14336) + 256 × 128256 × 8 = 1,101,529,088;
    // + 384 MiB outside PyTorch + 1 GiB of CUDA graphs, charged from vLLM 0.20.
    assert_eq!(o.activation_bytes, 1_101_529_088);
    assert_eq!(
        (o.non_torch_bytes, o.cuda_graph_bytes, o.cuda_graphs_charged),
        (384 * MIB, 1 << 30, true)
    );
    assert_eq!(o.overhead_bytes, 2_577_924_096);
    assert_eq!(
        o.kv_space_bytes,
        76_968_728_985 - 16_060_522_496 - 2_577_924_096
    );
    // 58,330,282,393 / 1 GiB = 54.3; the naive 4 GiB per request would say 13.
    assert_eq!(o.max_requests, 54);
    assert_eq!(o.kv_space_bytes / p.model.naive_kv_bytes_per_request, 13);
    assert!(o.fits);
    let flag = |o: &GpuPlan, pair: [&str; 2]| o.vllm_args.windows(2).any(|w| w == pair);
    assert!(flag(o, ["--max-num-seqs", "54"]), "{:?}", o.vllm_args);
    // vLLM 0.10.2 on takes the KV cache in bytes (whole MiB: 55,629 MiB), not a share.
    assert!(
        flag(o, ["--kv-cache-memory-bytes", "58331234304"]),
        "{:?}",
        o.vllm_args
    );
    assert!(!o.vllm_args.iter().any(|a| a == "--gpu-memory-utilization"));
    // Before it, the share; and before 0.20 CUDA graphs are not charged: 1 GiB more KV space.
    let mut older = request("llama-3-8b", 8192);
    older.engine = "0.10.1".parse().unwrap();
    let o = plan(&older).unwrap().options.remove(0);
    assert!(
        flag(&o, ["--gpu-memory-utilization", "0.90"]),
        "{:?}",
        o.vllm_args
    );
    assert_eq!(o.kv_cache_memory_bytes, None);
    assert_eq!(o.kv_space_bytes, 58_330_282_393 + (1 << 30));
}

#[test]
fn asking_for_a_concurrency_sizes_the_engine_and_the_budget() {
    let mut r = request("llama-3-8b", 8192);
    r.concurrency = Some(20);
    let o = plan(&r).unwrap().options.remove(0);
    // 16,060,522,496 + 2,577,924,096 + 20 GiB = 40,113,283,072 of 85,520,809,984 = 0.469 -> 0.47.
    assert_eq!(o.gpu_memory_utilization, 0.47);
    assert_eq!(o.kv_cache_memory_bytes, Some(20 << 30));
    assert!(o
        .vllm_args
        .windows(2)
        .any(|w| w == ["--max-num-seqs", "20"]));
    // Budget: the engine's 40,113,283,072 + the CUDA context (640 MiB) + 512 MiB = 38.48 GiB ->
    // 39GiB; RAM 14.96 GiB + 2 × 3 GiB -> 21GiB.
    assert!(
        o.gpuguard_model.contains("gpu_memory = \"39GiB\""),
        "{}",
        o.gpuguard_model
    );
    assert!(
        o.gpuguard_model.contains("ram = \"21GiB\""),
        "{}",
        o.gpuguard_model
    );
    let parsed: toml::Table = toml::from_str(&o.gpuguard_model).unwrap();
    assert_eq!(parsed["model"][0]["name"].as_str(), Some("llama-3-8b"));
    // The launch reserves what the engine takes (40,113,283,072 bytes = 38,255 MiB).
    // It carries the KV cache planned, for `status --model` to set the engine's beside.
    let planned = o.kv_tokens.to_string();
    let want = [
        "--model",
        "llama-3-8b",
        "--gpu-mem",
        "38255MiB",
        "--ram",
        "21GiB",
        "--planned-kv-tokens",
        &planned,
    ];
    assert_eq!(o.launch_args, want);
    assert!(o.kv_tokens > 0);
    // vLLM 0.19 captures CUDA graphs beyond its share: the budget holds them too (+1 GiB).
    r.engine = "0.19.0".parse().unwrap();
    let o = plan(&r).unwrap().options.remove(0);
    // 16,060,522,496 + 1,504,182,272 + 20 GiB + 640 MiB + 1 GiB + 512 MiB = 41,321,242,624.
    assert!(
        o.gpuguard_model.contains("gpu_memory = \"39GiB\""),
        "{}",
        o.gpuguard_model
    );

    r.engine = Vllm::DEFAULT;
    r.concurrency = Some(55);
    let o = plan(&r).unwrap().options.remove(0);
    assert!(!o.fits);
    assert!(o
        .problem
        .unwrap()
        .contains("holds 54 full-length request(s)"));
}

#[test]
fn mistral_sliding_window_caps_every_layer() {
    let (a, notes) = arch("mistral-7b-v0.1");
    assert_eq!(a.params.unwrap().total(), 7_241_732_096, "Mistral's 7.24B");
    assert_eq!((a.sliding_window, a.sliding_layers), (Some(4096), 32));
    assert!(notes.iter().any(|n| n.contains("every layer")), "{notes:?}");
    let m = plan(&request("mistral-7b-v0.1", 32768)).unwrap().model;
    // Each layer keeps 4096 + one 16-token block: 32 × 4112 × 4 KiB = 514 MiB, not the 4 GiB
    // of 32768 tokens, nor the naive (all heads, no window) 16 GiB.
    assert_eq!(m.kv_bytes_per_request, 32 * 4112 * 4096);
    assert_eq!(m.kv_bytes_per_request, 514 * MIB);
    assert_eq!(m.kv_bytes_per_token * 32768, 4 << 30);
    assert_eq!(m.naive_kv_bytes_per_request, 16 << 30);
    // Shorter than the window: no cap applies.
    let short = plan(&request("mistral-7b-v0.1", 2048)).unwrap().model;
    assert_eq!(short.kv_bytes_per_request, 256 * MIB);
}

#[test]
fn gemma_2_head_dim_and_every_other_layer_windowed() {
    let (a, _) = arch("gemma-2-9b");
    // head_dim 256 explicit: 16 heads × 256 = 4096, not hidden_size 3584.
    assert_eq!(
        (a.head_dim, a.kv_heads, a.layers, a.sliding_layers),
        (256, 8, 42, 21)
    );
    // Tied embeddings (transformers' default for gemma2): 9.241B, Google's "9.24B".
    assert_eq!(a.params.unwrap().total(), 9_241_404_928);
    let mut r = request("gemma-2-9b", 8192);
    // Saved as float32: the plan is for what the engine loads (here bf16 as asked).
    assert_eq!(r.arch.saved_dtype, Some(Dtype::Fp32));
    r.weights = Weights::Dtype(Dtype::Bf16);
    let m = plan(&r).unwrap().model;
    // 21 global layers × 8192 + 21 windowed × 4112 tokens, × 2 × 8 × 256 × 2 bytes.
    assert_eq!(m.kv_bytes_per_request, (21 * 8192 + 21 * 4112) * 8192);
    assert_eq!(m.kv_bytes_per_request, 2_116_681_728);
    // Naive: 42 layers × 16 heads × 256, no window: 5.25 GiB, 2.66× too much.
    assert_eq!(m.naive_kv_bytes_per_request, 42 * 2 * 16 * 256 * 2 * 8192);
    // hidden_size-based (2 × layers × hidden): 4.6 GiB, also wrong.
    assert_ne!(m.kv_bytes_per_token, 2 * 42 * 3584 * 2);
}

#[test]
fn gemma_3_multimodal_reads_text_config_and_counts_the_vision_tower() {
    let (a, notes) = arch("gemma-3-4b-it");
    assert_eq!(a.model_type, "gemma3_text");
    assert_eq!((a.layers, a.kv_heads, a.head_dim), (34, 4, 256));
    // 5 of every 6 layers windowed (1024 tokens): 34 - 34/6 = 29.
    assert_eq!((a.sliding_window, a.sliding_layers), (Some(1024), 29));
    // vocab_size and max_position_embeddings are transformers' defaults, and said so.
    assert_eq!(a.vocab_size, Some(262_208));
    assert_eq!(a.max_position_embeddings, Some(131_072));
    assert!(
        notes
            .iter()
            .any(|n| n.contains("vocab_size not in the config")),
        "{notes:?}"
    );
    let p = a.params.unwrap();
    // Text: 262208 × 2560 (tied) + 34 layers = 3.880B; vision (SigLIP 27 × 1152) = 0.420B:
    // 4.30B, Google's "4B" card says 4.3B.
    assert_eq!(p.embeddings + p.layers, 3_880_071_680);
    assert_eq!(p.vision, 419_815_152);
    let m = plan(&request("gemma-3-4b-it", 131_072)).unwrap().model;
    // 5 global layers × 131072 + 29 windowed × 1040 tokens, × 2 × 4 × 256 × 2 bytes = 2.6 GiB;
    // the naive figure (8 heads, no window) is 34 GiB, 13× too much.
    assert_eq!(m.kv_bytes_per_request, (5 * 131_072 + 29 * 1040) * 4096);
    assert_eq!(m.naive_kv_bytes_per_request, 34 << 30);
    assert_eq!(m.weights_bytes, 4_299_886_832 * 2);
}

#[test]
fn qwen2_counts_its_qkv_biases_and_ties_small_models() {
    let (a, notes) = arch("qwen2.5-7b-instruct");
    assert_eq!(a.architectures, ["Qwen2ForCausalLM"]);
    assert_eq!(
        (
            a.layers,
            a.attention_heads,
            a.kv_heads,
            a.head_dim,
            a.experts
        ),
        (28, 28, 4, 128, 0)
    );
    // sliding_window 131072 is off (use_sliding_window false): every layer is full.
    assert_eq!((a.sliding_window, a.sliding_layers), (None, 0));
    assert!(notes.iter().any(|n| n.contains("is off")), "{notes:?}");
    // 152064 × 3584 twice (untied) + 28 × (attention, q/k/v biases (28 + 2 × 4) × 128, MLP,
    // norms) + final norm: 7,615,616,512, Qwen's published count; 129,024 of it biases.
    assert_eq!(a.params.unwrap().total(), 7_615_616_512);
    // The 1.5B ties its output head to the embeddings (as its config says): 1,543,714,304.
    let (small, _) = arch("qwen2.5-1.5b-instruct");
    assert_eq!((small.kv_heads, small.head_dim), (2, 128));
    assert_eq!(small.params.unwrap().total(), 1_543_714_304);
    assert_eq!(small.params.unwrap().embeddings, 151_936 * 1536);
    // 28 layers × 2 × 2 KV heads × 128 × 2 bytes: 28 KiB a token, as vLLM's logs divide.
    let m = plan(&request("qwen2.5-1.5b-instruct", 4096)).unwrap().model;
    assert_eq!(m.kv_bytes_per_token, 28 << 10);
}

/// vLLM 0.22 to 0.28 runs more and more models with Model Runner V2, which charges no estimate
/// of the CUDA graphs (they are captured beyond the share, as before 0.20); 0.29 estimates them
/// again. A dense Qwen2 is on V1 in 0.24 (not listed), on V2 in 0.25 (every dense model); a
/// mixture of experts such as Mixtral stays on V1 until 0.29.
#[test]
fn model_runner_v2_charges_no_cuda_graphs_until_0_29() {
    let at = |name: &str, version: &str| {
        let mut r = request(name, 4096);
        r.engine = version.parse().unwrap();
        plan(&r).unwrap()
    };
    let v1 = at("qwen2.5-7b-instruct", "0.24.0");
    let v2 = at("qwen2.5-7b-instruct", "0.26.0");
    let again = at("qwen2.5-7b-instruct", "0.29.0");
    let (o1, o2, o3) = (&v1.options[0], &v2.options[0], &again.options[0]);
    assert!(!o1.model_runner_v2 && o1.cuda_graphs_charged);
    assert!(o2.model_runner_v2 && !o2.cuda_graphs_charged);
    assert!(o3.model_runner_v2 && o3.cuda_graphs_charged);
    assert_eq!(o1.overhead_bytes - o2.overhead_bytes, o1.cuda_graph_bytes);
    assert_eq!(o2.kv_space_bytes - o1.kv_space_bytes, 1 << 30);
    assert_eq!(o3.overhead_bytes, o1.overhead_bytes);
    // The KV cache takes that room and the graphs are held beyond the share: the budget is 1 GiB
    // more (76,969,290,752 bytes of share + 640 MiB of context + 512 MiB, and 1 GiB of graphs).
    let budget = |o: &GpuPlan| {
        let line = o
            .gpuguard_model
            .lines()
            .find(|l| l.starts_with("gpu_memory"));
        line.unwrap().to_string()
    };
    assert_eq!(budget(o1), "gpu_memory = \"73GiB\"");
    assert_eq!(budget(o2), "gpu_memory = \"74GiB\"");
    assert!(
        v2.assumptions
            .iter()
            .any(|a| a.contains("Model Runner V2, its default for Qwen2ForCausalLM")),
        "{:?}",
        v2.assumptions
    );
    assert!(
        v2.assumptions
            .iter()
            .any(|a| a.contains("Model Runner V2 charges no estimate")),
        "{:?}",
        v2.assumptions
    );
    let mixtral = at("mixtral-8x7b", "0.26.0");
    assert!(!mixtral.options[0].model_runner_v2 && mixtral.options[0].cuda_graphs_charged);
}

/// `--enforce-eager`: no CUDA graphs, charged or held beyond the share, and the flag in the
/// command.
#[test]
fn enforce_eager_plans_no_cuda_graphs() {
    let mut r = request("llama-3-8b", 8192);
    let graphs = plan(&r).unwrap().options.remove(0);
    r.enforce_eager = true;
    let p = plan(&r).unwrap();
    let eager = &p.options[0];
    assert_eq!(
        (eager.cuda_graph_bytes, eager.cuda_graphs_charged),
        (0, false)
    );
    assert_eq!(graphs.overhead_bytes - eager.overhead_bytes, 1 << 30);
    assert_eq!(
        eager.vllm_args.last().map(String::as_str),
        Some("--enforce-eager")
    );
    assert!(p.assumptions.iter().any(|a| a.contains("--enforce-eager")));
    // Before 0.20 the graphs were never charged: eager leaves the KV space as it was and takes
    // them out of what is held beyond the share.
    r.engine = "0.19.0".parse().unwrap();
    r.concurrency = Some(20);
    let eager = plan(&r).unwrap().options.remove(0);
    r.enforce_eager = false;
    let graphs = plan(&r).unwrap().options.remove(0);
    assert_eq!(eager.kv_space_bytes, graphs.kv_space_bytes);
    assert_eq!(graphs.cuda_graph_bytes, 1 << 30);
    assert_eq!(eager.cuda_graph_bytes, 0);
}

#[test]
fn mixtral_counts_every_expert_for_weights() {
    let (a, _) = arch("mixtral-8x7b");
    assert_eq!(a.params.unwrap().total(), 46_702_792_704, "Mistral's 46.7B");
    assert_eq!(a.sliding_window, None, "sliding_window: null");
    // 93 GB of bf16 weights: one 80 GB card never holds it; the plan goes to TP 2.
    let mut r = request("mixtral-8x7b", 32768);
    r.tp = Vec::new();
    let p = plan(&r).unwrap();
    assert_eq!(p.options.len(), 2);
    assert!(!p.options[0].fits);
    assert!(p.options[0]
        .problem
        .as_ref()
        .unwrap()
        .contains("exceed 90%"));
    assert_eq!((p.options[1].tp, p.options[1].fits), (2, true));
    assert_eq!(p.recommended, Some(1));
    assert!(p.options[1]
        .vllm_args
        .windows(2)
        .any(|w| w == ["--tensor-parallel-size", "2"]));
}

#[test]
fn quantized_weights_keep_embeddings_in_16_bits() {
    let mut r = request("llama-3-8b", 8192);
    r.weights = Weights::Dtype(Dtype::Int4);
    let p = plan(&r).unwrap();
    let layers = 8_030_261_248u64 - 2 * 128_256 * 4096;
    let want = layers as f64 * (0.5 + 4.0 / 128.0) + (2 * 128_256 * 4096) as f64 * 2.0;
    assert_eq!(p.model.weights_bytes, want.ceil() as u64);
    assert!(p.assumptions.iter().any(|a| a.contains("stay 16-bit")));
}

#[test]
fn fp8_kv_cache_halves_the_kv_and_adds_the_flag() {
    let mut r = request("llama-3-8b", 8192);
    r.kv_dtype = Dtype::Fp8;
    let p = plan(&r).unwrap();
    assert_eq!(p.model.kv_bytes_per_request, 512 * MIB);
    assert!(p.options[0]
        .vllm_args
        .ends_with(&["--kv-cache-dtype".into(), "fp8".into()]));
}

#[test]
fn tensor_parallel_splits_weights_and_kv_heads_or_replicates_them() {
    let mut r = request("llama-3-8b", 8192);
    r.tp = vec![2, 3, 16];
    let p = plan(&r).unwrap();
    let (two, three, sixteen) = (&p.options[0], &p.options[1], &p.options[2]);
    assert_eq!(two.weights_bytes, 16_060_522_496 / 2);
    assert_eq!(two.kv_bytes_per_request, 512 * MIB);
    assert!(three
        .problem
        .as_ref()
        .unwrap()
        .contains("do not split over 3"));
    assert!(!three.fits);
    // 8 KV heads over 16 GPUs: one (replicated) head each, so 1/8 of the KV, not 1/16.
    assert_eq!(sixteen.kv_bytes_per_request, 128 * MIB);
    assert!(sixteen
        .problem
        .as_ref()
        .unwrap()
        .contains("no machine has more than 8 of these"));
}

#[test]
fn this_hosts_free_memory_is_checked() {
    let mut r = request("llama-3-8b", 8192);
    r.gpus = vec![GpuChoice {
        free_bytes: Some(30 << 30),
        live: true,
        count: 1,
        ..h100()
    }];
    let o = plan(&r).unwrap().options.remove(0);
    assert!(o.fits);
    assert_eq!(o.problem.as_deref(), Some("only 30.0 GiB free now"));
}

#[test]
fn explicit_numbers_and_given_weights_need_no_config() {
    let a = Architecture {
        model_type: "custom".into(),
        layers: 40,
        attention_heads: 32,
        kv_heads: 8,
        head_dim: 128,
        ..Default::default()
    };
    let mut r = request("llama-3-8b", 4096);
    r.arch = a;
    r.weights = Weights::Bytes(24 << 30);
    let p = plan(&r).unwrap();
    // 40 × 2 × 8 × 128 × 2 = 160 KiB a token, 640 MiB at 4096.
    assert_eq!(p.model.kv_bytes_per_request, 640 * MIB);
    assert_eq!(p.options[0].activation_bytes, FALLBACK_ACTIVATION_BYTES);
    r.weights = Weights::Dtype(Dtype::Fp16);
    assert!(plan(&r).unwrap_err().contains("give --params or --weights"));
}

#[test]
fn bad_inputs_are_refused_with_the_value() {
    let mut r = request("llama-3-8b", 16384);
    assert!(plan(&r)
        .unwrap_err()
        .contains("16384 is above the model's max_position_embeddings (8192)"));
    r.max_model_len = 8192;
    r.gpu_memory_utilization = Some(1.5);
    assert!(plan(&r).unwrap_err().contains("'1.5'"));
    let err = Architecture::from_hf_config(
        &serde_json::json!({"model_type": "x", "num_hidden_layers": "many"}),
    )
    .unwrap_err();
    assert_eq!(err, "num_hidden_layers: '\"many\"' is not a whole number");
    let err = Architecture::from_hf_config(&serde_json::json!({"model_type": "x"})).unwrap_err();
    assert!(err.contains("num_hidden_layers is missing"), "{err}");
    assert!(err.contains("--layers"), "{err}");
    let err = Architecture::from_hf_config(
        &serde_json::json!({"kv_lora_rank": 512, "num_hidden_layers": 61}),
    )
    .unwrap_err();
    assert!(err.contains("multi-head latent attention"), "{err}");
}

#[test]
fn layer_types_list_which_layers_are_windowed() {
    let mut config = fixture("llama-3-8b");
    config["sliding_window"] = 4096.into();
    let types: Vec<&str> = (0..32)
        .map(|i| {
            if i % 4 == 3 {
                "full_attention"
            } else {
                "sliding_attention"
            }
        })
        .collect();
    config["layer_types"] = serde_json::json!(types);
    let (a, _) = Architecture::from_hf_config(&config).unwrap();
    assert_eq!(a.sliding_layers, 24);
    config["use_sliding_window"] = false.into();
    let (a, notes) = Architecture::from_hf_config(&config).unwrap();
    assert_eq!((a.sliding_window, a.sliding_layers), (None, 0));
    assert!(notes
        .iter()
        .any(|n| n.contains("use_sliding_window = false")));
}

/// Round three: huge values in a config.json wrapped silently (a u64::MAX hidden size gave
/// "21.47B parameters"; 2^62 experts "Recommended: 1 × H100"). A value beyond any model is an
/// error naming the key; products within the bounds saturate, never wrap to a small model.
#[test]
fn huge_config_values_are_refused_or_saturate_never_wrap() {
    let mut config = fixture("llama-3-8b");
    config["hidden_size"] = serde_json::json!(u64::MAX);
    let err = Architecture::from_hf_config(&config).unwrap_err();
    assert!(
        err.contains("hidden_size") && err.contains("beyond any model"),
        "{err}"
    );
    let mut config = fixture("llama-3-8b");
    config["num_local_experts"] = serde_json::json!(1u64 << 62);
    config["num_experts_per_tok"] = serde_json::json!(2);
    let err = Architecture::from_hf_config(&config).unwrap_err();
    assert!(err.contains("num_local_experts"), "{err}");
    // Every number at the bound: the count saturates, it does not wrap.
    let mut config = fixture("llama-3-8b");
    for key in [
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "vocab_size",
    ] {
        config[key] = serde_json::json!(1u64 << 32);
    }
    config["num_attention_heads"] = serde_json::json!(1);
    config["num_key_value_heads"] = serde_json::json!(1);
    let (a, notes) = Architecture::from_hf_config(&config).unwrap();
    assert_eq!(a.params.unwrap().total(), u64::MAX);
    // And a plan for it says it fits nowhere, without overflowing on the way.
    let mut r = request("llama-3-8b", 8192);
    (r.arch, r.notes) = (a, notes);
    let err = plan(&r).unwrap_err();
    assert!(err.contains("beyond any GPU host"), "{err}");
}

/// One published startup log of `tests/fixtures/plan/engines/calibration.csv`.
struct Logged {
    id: String,
    request: PlanRequest,
    kv_cache_bytes: u64,
    kv_tokens: Option<u64>,
}

fn calibration() -> Vec<Logged> {
    let path = format!(
        "{}/../../tests/fixtures/plan/engines/calibration.csv",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(path).unwrap();
    let gib = |s: &str| (s.parse::<f64>().unwrap() * (1u64 << 30) as f64) as u64;
    let number = |s: &str| (!s.is_empty()).then(|| s.parse::<u64>().unwrap());
    let mut lines = text.lines().filter(|l| !l.starts_with('#'));
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    lines
        .map(|line| {
            let cells: Vec<&str> = line.split(',').collect();
            assert_eq!(cells.len(), header.len(), "{line}");
            let at = |key: &str| cells[header.iter().position(|h| *h == key).unwrap()];
            let (arch, notes) = arch(at("config"));
            let tp: u32 = at("tp").parse().unwrap();
            let gpu = GpuChoice {
                name: at("gpu").into(),
                total_bytes: gib(at("gpu_total_gib")),
                free_bytes: None,
                count: 8,
                live: false,
                machines: &[],
            };
            Logged {
                id: at("id").into(),
                request: PlanRequest {
                    name: at("config").into(),
                    arch,
                    weights: Weights::Bytes(gib(at("weights_gib")) * u64::from(tp)),
                    kv_dtype: Dtype::Bf16,
                    max_model_len: number(at("max_model_len")).unwrap(),
                    concurrency: None,
                    tp: vec![tp],
                    gpus: vec![gpu],
                    engine: at("vllm").parse().unwrap(),
                    gpu_memory_utilization: Some(at("gpu_memory_utilization").parse().unwrap()),
                    max_num_batched_tokens: number(at("max_num_batched_tokens")),
                    max_num_seqs: number(at("max_num_seqs")),
                    enforce_eager: match at("enforce_eager") {
                        "" | "false" => false,
                        "true" => true,
                        other => panic!("enforce_eager '{other}' in {line}"),
                    },
                    observed: None,
                    notes,
                },
                kv_cache_bytes: gib(at("kv_cache_gib")),
                kv_tokens: number(at("kv_tokens")),
            }
        })
        .collect()
}

/// The plan against what vLLM really gave the KV cache, on every published startup log the table
/// keeps: within 10 % of it, and never more than 5 % above it (a plan that promises more KV space
/// than the engine gets causes the preemption or OOM it exists to prevent). The weights are the
/// logged ones: what is checked is the rest of the engine's memory, which the plan models.
#[test]
fn the_kv_space_agrees_with_published_engine_logs() {
    let rows = calibration();
    assert!(rows.len() >= 10, "{} rows", rows.len());
    let mut report = Vec::new();
    let mut wrong = Vec::new();
    for row in &rows {
        let p = plan(&row.request).unwrap();
        let o = &p.options[0];
        // Tokens the KV space holds whether or not a full-length request fits (vLLM refused to
        // start on one row: the plan says it does not fit; the space is still compared).
        let a = &row.request.arch;
        let heads = kv_heads_per_gpu(a.kv_heads, u64::from(o.tp)).unwrap();
        let per_token = a.layers * 2 * heads * a.head_dim * 2;
        let planned_tokens = o.kv_space_bytes / per_token / BLOCK_TOKENS * BLOCK_TOKENS;
        let mut check = |what: &str, planned: u64, logged: u64| {
            let error = planned as f64 / logged as f64 - 1.0;
            report.push(format!(
                "{:<36} {what:<6} planned {planned:>12} logged {logged:>12} {:+6.1}%",
                row.id,
                error * 100.0
            ));
            if !(-0.10..=0.05).contains(&error) {
                wrong.push(report.last().unwrap().clone());
            }
        };
        check("KV", o.kv_space_bytes, row.kv_cache_bytes);
        if let Some(tokens) = row.kv_tokens {
            check("tokens", planned_tokens, tokens);
        }
    }
    println!("{}", report.join("\n"));
    assert!(
        wrong.is_empty(),
        "{}\n\nall:\n{}",
        wrong.join("\n"),
        report.join("\n")
    );
}

/// `--json` carries the engine release and each part of the overhead, so a script can see what
/// the plan charged and what it left beyond the share.
#[test]
fn the_json_names_the_engine_and_each_part_of_the_overhead() {
    let mut r = request("llama-3-8b", 8192);
    r.engine = "0.19.0".parse().unwrap();
    let json = serde_json::to_value(plan(&r).unwrap()).unwrap();
    assert_eq!(json["engine"], "0.19.0");
    let o = &json["options"][0];
    assert_eq!(o["max_num_batched_tokens"], 8192);
    assert_eq!(o["max_num_seqs"], 256);
    assert_eq!(o["activation_bytes"], 1_101_529_088u64);
    assert_eq!(o["non_torch_bytes"], 384 * MIB);
    assert_eq!(o["cuda_graph_bytes"], 1u64 << 30);
    assert_eq!(o["cuda_graphs_charged"], false);
    assert_eq!(o["cuda_context_bytes"], 640 * MIB);
    // 0.19 does not charge the graphs: the overhead is the peak and non-torch memory alone.
    assert_eq!(o["overhead_bytes"], 1_101_529_088u64 + 384 * MIB);
    assert!(o["kv_cache_memory_bytes"].as_u64().is_some());
    // Left to the release's defaults, the batch follows the card (an H100: 8192 and 1024).
    r.max_num_seqs = None;
    r.max_num_batched_tokens = None;
    let o = plan(&r).unwrap().options.remove(0);
    assert_eq!((o.max_num_batched_tokens, o.max_num_seqs), (8192, 1024));
}

/// On this host's GPUs, what the model running here was seen to take replaces the modelled
/// overhead: an engine whose KV cache came out smaller than planned (more overhead than the
/// model says) makes the plan for this host smaller too, and only for the TP it runs at.
#[test]
fn what_a_model_was_seen_to_take_here_replaces_the_modelled_overhead() {
    let mut r = on_this_hosts_h100(request("llama-3-8b", 8192));
    let modelled = plan(&r).unwrap().options.remove(0);
    assert!(!modelled.overhead_observed);
    assert_eq!(modelled.kv_tokens, 58_330_282_393 / (128 << 10) / 16 * 16);
    assert!(
        modelled
            .gpuguard_model
            .contains(&format!("planned_kv_tokens = {}\n", modelled.kv_tokens)),
        "{}",
        modelled.gpuguard_model
    );
    // Seen here: 72 GiB on one GPU with 400,000 tokens of KV cache (50,000 MiB): 72 GiB - 14.96
    // GiB of weights - 48.83 GiB - the 640 MiB context = 7.59 GiB of overhead, not 2.4. (It ran
    // with the planned flags.)
    r.observed = Some(seen_with_the_planned_flags(&r));
    let p = plan(&r).unwrap();
    let seen = &p.options[0];
    assert!(seen.overhead_observed);
    let overhead = (72u64 << 30) - 16_060_522_496 - 400_000 * (128 << 10) - 640 * MIB;
    assert_eq!(seen.overhead_bytes, overhead);
    assert_eq!(
        seen.kv_space_bytes,
        76_968_728_985 - 16_060_522_496 - overhead
    );
    assert!(seen.max_requests < modelled.max_requests);
    assert!(p
        .assumptions
        .iter()
        .any(|a| a.contains("as seen of 'llama-3-8b' running here")));
    assert_eq!(p.observed_at_ms, None);
    // Remembered from the daemon's history: the same overhead, said with when it was seen.
    let mut remembered = r.clone();
    remembered.observed = r.observed.map(|o| Observed {
        seen_at_ms: Some(1_795_000_000_000),
        ..o
    });
    let p = plan(&remembered).unwrap();
    assert_eq!(p.options[0].overhead_bytes, overhead);
    assert_eq!(p.observed_at_ms, Some(1_795_000_000_000));
    assert!(
        p.assumptions.iter().any(|a| a.contains(
            "as seen of 'llama-3-8b' when it last ran here (72.0 GiB on 1 GPU(s), its engine's KV cache 400000 tokens; at 2026-11-18T11:06:40Z, in the daemon's history)"
        )),
        "{:?}",
        p.assumptions
    );
    // At another TP, or on a card from the table, the model is what it was.
    r.tp = vec![2];
    assert!(!plan(&r).unwrap().options[0].overhead_observed);
    r.tp = vec![1];
    r.gpus = vec![h100()];
    assert!(!plan(&r).unwrap().options[0].overhead_observed);
    // Nor for a sliding-window model: its engine counts KV tokens per group of layers.
    let mut gemma = on_this_hosts_h100(request("gemma-2-9b", 8192));
    gemma.observed = r.observed;
    assert!(!plan(&gemma).unwrap().options[0].overhead_observed);
}

/// The model seen running here with `r`'s flags: 72 GiB on one GPU, 400,000 tokens of KV cache.
fn seen_with_the_planned_flags(r: &PlanRequest) -> Observed {
    Observed {
        gpu_bytes: 72 << 30,
        gpus: 1,
        kv_tokens: 400_000,
        max_num_batched_tokens: r.max_num_batched_tokens,
        max_num_seqs: r.max_num_seqs,
        ..Observed::default()
    }
}

/// `r` planned for this host's GPUs: one H100, seen live (where an observation applies).
fn on_this_hosts_h100(mut r: PlanRequest) -> PlanRequest {
    let mut host = h100();
    host.live = true;
    r.gpus = vec![host];
    r
}

/// A model seen running with flags of its own (a smaller batch, eager): what it was seen to take
/// is carried over to the planned flags, the model's error there kept and what the flags
/// change modelled: the planned batch's activations for the seen one's, and the CUDA graphs the
/// eager run never captured.
#[test]
fn what_a_model_took_with_other_flags_is_carried_over_to_the_planned_ones() {
    let mut r = on_this_hosts_h100(request("llama-3-8b", 8192));
    let seen_as_planned = seen_with_the_planned_flags(&r);
    r.observed = Some(seen_as_planned);
    let planned = plan(&r).unwrap().options.remove(0);
    assert!(planned.overhead_observed);
    // The same memory seen with a batch of 512 tokens and 16 sequences: its activations were
    // smaller, so the same total says the rest (the model's error) was larger by that much.
    let (batch, seqs) = (planned.max_num_batched_tokens, planned.max_num_seqs);
    let small = |o: Observed| Observed {
        max_num_batched_tokens: Some(512),
        max_num_seqs: Some(16),
        ..o
    };
    r.observed = Some(small(seen_as_planned));
    let carried = plan(&r).unwrap().options.remove(0);
    let mut at_small = r.clone();
    at_small.max_num_batched_tokens = Some(512);
    at_small.max_num_seqs = Some(16);
    at_small.observed = None;
    let mut at_planned = r.clone();
    at_planned.max_num_batched_tokens = Some(batch);
    at_planned.max_num_seqs = Some(seqs);
    at_planned.observed = None;
    let modelled = |r: &PlanRequest| plan(r).unwrap().options[0].overhead_bytes;
    let difference = modelled(&at_planned) - modelled(&at_small);
    assert!(difference > 0);
    assert_eq!(
        carried.overhead_bytes,
        planned.overhead_bytes + difference,
        "{carried:?}"
    );
    // Seen eager (no CUDA graphs): the graphs the planned flags capture are added.
    r.observed = Some(Observed {
        enforce_eager: true,
        ..seen_as_planned
    });
    let eager = plan(&r).unwrap();
    assert_eq!(
        eager.options[0].overhead_bytes,
        planned.overhead_bytes + planned.cuda_graph_bytes,
        "{:?}",
        eager.options[0]
    );
    assert!(
        eager
            .assumptions
            .iter()
            .any(|a| a.contains("--enforce-eager")),
        "{:?}",
        eager.assumptions
    );
}

/// The `[[model]]`'s planned_kv_tokens is the KV cache the recommended flags give: with
/// --concurrency, what those requests need (not the whole share's); none for an option that
/// does not fit. And a hostile MoE config whose experts per token multiply past 2^64 gives a
/// plan that does not fit, not a panic or a wrapped figure.
#[test]
fn planned_kv_tokens_follow_the_flags_and_hostile_sizes_saturate() {
    let mut r = request("llama-3-8b", 8192);
    r.concurrency = Some(20);
    let o = plan(&r).unwrap().options.remove(0);
    // 20 requests of 8192 tokens.
    assert_eq!(o.kv_tokens, 20 * 8192);
    assert!(o.gpuguard_model.contains("planned_kv_tokens = 163840\n"));
    r.concurrency = Some(500);
    let o = plan(&r).unwrap().options.remove(0);
    assert!(!o.fits);
    assert_eq!(o.kv_tokens, 0);
    assert!(!o.gpuguard_model.contains("planned_kv_tokens"));

    let mut config = fixture("mixtral-8x7b");
    config["num_experts_per_tok"] = serde_json::json!(1u64 << 31);
    config["intermediate_size"] = serde_json::json!(1u64 << 31);
    let (arch, notes) = Architecture::from_hf_config(&config).unwrap();
    let mut r = request("mixtral-8x7b", 4096);
    r.arch = arch;
    r.notes = notes;
    r.weights = Weights::Bytes(90 << 30);
    let o = plan(&r).unwrap().options.remove(0);
    assert!(!o.fits, "{o:?}");
    assert_eq!(o.activation_bytes, u64::MAX);
}
