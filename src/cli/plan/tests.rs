//! `gpuguard plan` in process: the command line parsed as the binary parses it and the text or
//! JSON it prints (or its exit code and error) for the published architectures in
//! tests/fixtures/plan, bad input naming the file, key and value, and explicit numbers without a
//! config. "This host" (the daemon's socket, NVML) is the host suite's (tests/integration/plan.rs).

use clap::Parser;
use serde_json::Value;

use super::*;
use crate::cli::{Cli, Command};

fn fixture(name: &str) -> String {
    format!(
        "{}/tests/fixtures/plan/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// `gpuguard plan ARGS`: the exit code, what it prints, and its error (clap's own for an
/// argument it refuses, with clap's exit code).
fn run(args: &[&str]) -> (u8, String, String) {
    let cli = match Cli::try_parse_from([&["gpuguard", "plan"], args].concat()) {
        Ok(cli) => cli,
        Err(e) => return (e.exit_code() as u8, String::new(), e.to_string()),
    };
    let Command::Plan(args) = cli.command else {
        unreachable!("parsed as plan")
    };
    match answer(&args) {
        Ok(out) => (exit::OK, out, String::new()),
        Err((code, err)) => (code, String::new(), err),
    }
}

fn json(args: &[&str]) -> Value {
    let (code, out, err) = run(&[args, &["--json"]].concat());
    assert_eq!(code, exit::OK, "{err}");
    serde_json::from_str(&out).unwrap()
}

#[test]
fn counts_take_suffixes() {
    assert_eq!(parse_count("8.03B"), Ok(8_030_000_000));
    assert_eq!(parse_count("70b"), Ok(70_000_000_000));
    assert_eq!(parse_count("560M"), Ok(560_000_000));
    assert_eq!(parse_count("7241732096"), Ok(7_241_732_096));
    assert!(parse_count("lots").unwrap_err().contains("'lots'"));
    assert!(parse_count("-1B").is_err());
}

#[test]
fn llama_3_8b_on_an_h100_table_says_how_many_fit_flags_budget_and_assumptions() {
    let (code, out, err) = run(&[&fixture("llama-3-8b"), "--gpu", "h100"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("Model llama-3-8b (llama): 8.03B parameters, weights 15.0 GiB (bf16)"),
        "{out}"
    );
    assert!(
        out.contains(
            "1.0 GiB per 8192-token request\n  (naive, all 32 heads and no window: 4.0 GiB)"
        ),
        "{out}"
    );
    assert!(out.contains("H100 80GB"), "{out}");
    assert!(
        out.contains("--max-model-len 8192 --kv-cache-memory-bytes 59252932608 --max-num-seqs 55"),
        "{out}"
    );
    assert!(out.contains("[[model]]\nname = \"llama-3-8b\"\n"), "{out}");
    assert!(
        out.contains("Assumptions:\n  - weights dtype bf16: the config's torch_dtype"),
        "{out}"
    );
    assert!(out.contains("engine: vLLM 0.20.0 and later (V1)"), "{out}");
    assert!(out.contains("CUDA graphs (1.0 GiB at TP 1"), "{out}");
}

/// `--cloud gcp`: only the GPUs Google Compute Engine offers, each option with the machine type
/// that carries it (the fewest GPUs that hold its TP: an H200 comes eight to a VM); `--gpu NAME
/// --count N` checks one choice; every line of the text fits 100 columns (why an option does not
/// fit is numbered under the table); `--json` keeps the machine type.
#[test]
fn gcp_machine_types_and_a_100_column_terminal() {
    let (code, out, err) = run(&[&fixture("mixtral-8x7b"), "--cloud", "gcp"]);
    assert_eq!(code, 0, "{err}");
    let row = |gpu: &str, tp: &str| {
        out.lines()
            .find(|l| {
                l.starts_with(gpu) && l.split_whitespace().nth(gpu.split(' ').count()) == Some(tp)
            })
            .unwrap_or_else(|| panic!("no {gpu} TP {tp} row: {out}"))
            .to_string()
    };
    assert!(
        row("H100 80GB", "2").ends_with("yes     a3-highgpu-2g"),
        "{out}"
    );
    assert!(row("L4 24GB", "8").ends_with("g2-standard-96"), "{out}");
    assert!(row("H200 141GB", "1").ends_with("a3-ultragpu-8g"), "{out}");
    assert!(row("GB200 186GB", "1").ends_with("a4x-highgpu-4g"), "{out}");
    assert!(row("B200 180GB", "1").ends_with("a4-highgpu-8g"), "{out}");
    // Four A100 40GB hold it (no FlashInfer all-reduce workspace on Ampere), so the H100's
    // note is the sixth.
    assert!(row("A100 40GB", "4").contains("yes"), "{out}");
    assert!(row("H100 80GB", "1").contains("no [6]"), "{out}");
    assert!(
        out.contains("\n[6] weights 87.0 GiB + overhead 3.1 GiB exceed 92% of 79.6 GiB\n"),
        "{out}"
    );
    assert!(
        !out.contains("A10G") && !out.contains("RTX 4090"),
        "not on GCE: {out}"
    );
    // The least GPU memory that holds it: eight V100s (128 GiB; their all-reduce allocates
    // little during the profile), not one H200.
    assert!(
        out.contains("Recommended: 8 × Tesla V100 16GB, on GCP n1 + 8 V100"),
        "{out}"
    );
    for args in [
        vec![fixture("mixtral-8x7b"), "--cloud".into(), "gcp".into()],
        vec![fixture("gemma-2-9b")],
        vec![
            fixture("llama-3-8b"),
            "--gpu".into(),
            "h100".into(),
            "--count".into(),
            "2".into(),
        ],
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, out, err) = run(&args);
        assert_eq!(code, 0, "{err}");
        let widest = out.lines().map(|l| l.chars().count()).max().unwrap();
        assert!(widest <= 100, "{widest} columns for {args:?}:\n{out}");
    }
    // Gemma-3-12B in fp16, 50 requests of 4096 tokens: one A100 40GB (a2-highgpu-1g) holds 18
    // of them, two (a2-highgpu-2g) hold 73; one L4 does not hold the weights, four do.
    let (code, gemma, err) = run(&[
        &fixture("gemma-3-12b-it"),
        "--dtype",
        "fp16",
        "--max-model-len",
        "4096",
        "--concurrency",
        "50",
        "--cloud",
        "gcp",
    ]);
    assert_eq!(code, 0, "{err}");
    let line = |machine: &str| {
        gemma
            .lines()
            .find(|l| l.ends_with(&format!("  {machine}")))
            .unwrap_or_else(|| panic!("no {machine} row: {gemma}"))
            .to_string()
    };
    assert!(
        line("a2-highgpu-1g").contains(" 18 ") && line("a2-highgpu-1g").contains("no ["),
        "{gemma}"
    );
    assert!(
        line("a2-highgpu-2g").contains(" 73 ") && line("a2-highgpu-2g").contains("yes"),
        "{gemma}"
    );
    assert!(line("g2-standard-4").contains("no ["), "{gemma}");
    assert!(line("g2-standard-48").contains("yes"), "{gemma}");
    assert!(gemma.lines().all(|l| l.chars().count() <= 100), "{gemma}");
    // One choice: 2 of one GPU.
    let one = json(&[
        &fixture("llama-3-8b"),
        "--gpu",
        "h100",
        "--count",
        "2",
        "--cloud",
        "gcp",
    ]);
    let options = one["options"].as_array().unwrap();
    assert_eq!(options.len(), 1, "{one}");
    assert_eq!(options[0]["tp"], 2);
    assert_eq!(options[0]["gcp_machine"], "a3-highgpu-2g");
    // A GPU GCE does not offer, asked for in its terms.
    let (code, _, err) = run(&[&fixture("llama-3-8b"), "--gpu", "a10g", "--cloud", "gcp"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("Google Compute Engine has no machine type with a A10G 24GB"),
        "{err}"
    );
}

#[test]
fn json_for_a_sliding_window_model_shows_the_window_against_the_naive_figure() {
    let p = json(&[
        &fixture("mistral-7b-v0.1"),
        "--gpu",
        "l4,a100-80",
        "--concurrency",
        "16",
    ]);
    let m = &p["model"];
    assert_eq!(m["params"], 7_241_732_096u64);
    assert_eq!(m["max_model_len"], 32768);
    assert_eq!(m["kv_bytes_per_request"], 514u64 << 20);
    assert_eq!(m["naive_kv_bytes_per_request"], 16u64 << 30);
    let options = p["options"].as_array().unwrap();
    // L4: weights 13.5 GiB + overhead leave about 3 GiB: 5 requests of 514 MiB, 16 wanted; TP 2
    // (2 × 24 GB) fits.
    assert_eq!(options[0]["gpu"], "L4 24GB");
    assert_eq!(options[0]["fits"], false);
    assert_eq!(
        (options[1]["tp"].as_u64(), options[1]["fits"].as_bool()),
        (Some(2), Some(true))
    );
    assert_eq!(options[2]["gpu"], "A100 80GB");
    assert_eq!(options[2]["fits"], true);
    assert_eq!(p["recommended"], 1);
    assert!(p["assumptions"].as_array().unwrap().iter().any(|a| a
        .as_str()
        .unwrap()
        .contains("sliding_window 4096 on every layer")));
}

/// A multimodal config whose vision tower lacks a size: the count is unknown and `plan` says to
/// give `--params`; given, the plan works. `--weights` goes with `--dtype` (the dtype the model
/// computes in, so the KV cache's under `--kv-dtype auto`).
#[test]
fn an_uncountable_vision_tower_takes_params_and_weights_take_a_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("gemma-3-4b-it")).unwrap()).unwrap();
    config["vision_config"]
        .as_object_mut()
        .unwrap()
        .remove("intermediate_size");
    let path = dir.path().join("config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    let path = path.to_str().unwrap();
    let (code, _, err) = run(&[path, "--gpu", "l4"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("give --params or --weights"), "{err}");
    let p = json(&[path, "--gpu", "l4", "--params", "4.3B"]);
    assert_eq!(p["model"]["params"], 4_300_000_000u64);
    let notes = p["assumptions"].to_string();
    assert!(notes.contains("vision_config lacks"), "{notes}");
    let p = json(&[path, "--gpu", "l4", "--weights", "3GiB", "--dtype", "fp16"]);
    assert_eq!(p["model"]["weights_bytes"], 3u64 << 30);
    assert_eq!(p["model"]["kv_dtype"], "fp16");
}

#[test]
fn bad_input_exits_2_naming_the_file_key_and_value() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("config.json");
    std::fs::write(
        &bad,
        r#"{"model_type": "llama", "num_hidden_layers": "many"}"#,
    )
    .unwrap();
    let bad = bad.to_string_lossy().into_owned();
    let not_json = dir.path().join("x.json");
    std::fs::write(&not_json, "{").unwrap();
    let not_json = not_json.to_string_lossy().into_owned();
    // Round three: hostile numbers wrapped silently (a u64::MAX hidden size gave "21.47B
    // parameters", 2^62 experts "1 x H100"); beyond any model is an error naming the key.
    let huge = dir.path().join("huge.json");
    std::fs::write(
        &huge,
        r#"{"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 18446744073709551615,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
            "intermediate_size": 14336}"#,
    )
    .unwrap();
    let huge = huge.to_string_lossy().into_owned();
    let experts = dir.path().join("experts.json");
    std::fs::write(
        &experts,
        r#"{"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
            "intermediate_size": 14336, "num_local_experts": 4611686018427387904,
            "num_experts_per_tok": 2}"#,
    )
    .unwrap();
    let experts = experts.to_string_lossy().into_owned();
    let llama = fixture("llama-3-8b");
    let cases: Vec<(Vec<&str>, String)> = vec![
        (
            vec![&huge],
            format!("{huge}: hidden_size: 18446744073709551615 is beyond any model"),
        ),
        (
            vec![&experts],
            format!("{experts}: num_local_experts: 4611686018427387904 is beyond any model"),
        ),
        (
            vec![&bad],
            format!("{bad}: num_hidden_layers: '\"many\"' is not a whole number"),
        ),
        (vec![&not_json], format!("{not_json}: not JSON")),
        (
            vec!["/nonexistent/config.json"],
            "/nonexistent/config.json: cannot read".into(),
        ),
        (
            vec![&llama, "--gpu", "h1000"],
            "--gpu 'h1000' is not in the table (t4, ".into(),
        ),
        (
            vec![&llama, "--max-model-len", "100000"],
            "--max-model-len 100000 is above the model's max_position_embeddings (8192)".into(),
        ),
        (
            vec![&llama, "--kv-dtype", "int4"],
            "the KV cache is fp32, bf16, fp16 or fp8".into(),
        ),
        (
            vec![&llama, "--dtype", "fp6"],
            "'fp6' is not a dtype".into(),
        ),
        (
            vec![],
            "give a config.json, or --layers, --kv-heads and --head-dim".into(),
        ),
    ];
    for (args, want) in cases {
        let (code, _, err) = run(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(&want), "{args:?}: got {err:?}, want {want:?}");
    }
}

#[test]
fn explicit_numbers_without_a_config() {
    // A 12B model in fp16 at 4096 tokens, 50 concurrent requests: which GPUs?
    let p = json(&[
        "--layers",
        "40",
        "--kv-heads",
        "8",
        "--head-dim",
        "128",
        "--params",
        "12.2B",
        "--dtype",
        "fp16",
        "--max-model-len",
        "4096",
        "--concurrency",
        "50",
        "--name",
        "nemo",
    ]);
    // 40 × 2 × 8 × 128 × 2 bytes = 160 KiB a token; 640 MiB a request; 24.4 GB of weights.
    assert_eq!(p["model"]["kv_bytes_per_request"], 640u64 << 20);
    assert_eq!(p["model"]["weights_bytes"], 24_400_000_000u64);
    let fits: Vec<&str> = p["options"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["fits"] == true && o["tp"] == 1)
        .map(|o| o["gpu"].as_str().unwrap())
        .collect();
    // 24.4 GB + 4 GB overhead + 50 × 640 MiB = 62 GB: only the 80 GB and larger cards, alone.
    assert_eq!(
        fits,
        [
            "H100 80GB",
            "A100 80GB",
            "H100 NVL 94GB",
            "RTX PRO 6000 96GB",
            "H200 141GB",
            "B200 180GB",
            "GB200 186GB"
        ]
    );
}
