//! A model's architecture as the memory arithmetic needs it, read from a Hugging Face
//! `config.json` (already parsed; no file or network access here): layers, KV heads, head size,
//! sliding-window layers, the parameter count the config implies, and the dtype it was saved in.
//!
//! Today's configs are handled as they are written: grouped-query attention (`num_key_value_heads`),
//! an explicit `head_dim` that is not `hidden_size / num_attention_heads` (Gemma), sliding windows
//! on every layer (Mistral v0.1), on every other layer (Gemma-2), on 5 of 6 (Gemma-3) or as listed
//! in `layer_types`, multimodal configs whose language model sits in `text_config` with a vision
//! tower in `vision_config`, mixture-of-experts MLPs, and the q/k/v biases of Qwen2 (or any
//! `attention_bias`). Every default taken is said in `notes`.

use serde_json::Value;

use super::Dtype;

/// What the arithmetic needs to know about a model.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Architecture {
    /// `model_type` of the language model (`llama`, `gemma2`, `gemma3_text`...).
    pub model_type: String,
    /// The config's `architectures`, the model classes vLLM picks its implementation (and, from
    /// 0.22 to 0.28, its model runner) by: `Qwen2ForCausalLM`, `LlamaForCausalLM`...
    pub architectures: Vec<String>,
    /// Experts of a mixture-of-experts MLP (0: a dense model).
    pub experts: u64,
    pub layers: u64,
    pub attention_heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub hidden_size: Option<u64>,
    /// The MLP's width one token passes through (a MoE's expert width times experts per token).
    pub mlp_width: Option<u64>,
    pub vocab_size: Option<u64>,
    /// Tokens a sliding-window layer attends to, and how many layers have a window.
    pub sliding_window: Option<u64>,
    pub sliding_layers: u64,
    pub max_position_embeddings: Option<u64>,
    pub params: Option<ParamCount>,
    /// The dtype the checkpoint was saved in (`torch_dtype`).
    pub saved_dtype: Option<Dtype>,
    /// The weights' quantization (`quantization_config`), if any.
    pub quantized: Option<Dtype>,
}

/// Parameters by where they sit: quantized checkpoints keep embeddings, the output head and the
/// vision tower in 16 bits and quantize only the language model's linear layers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParamCount {
    /// Token embeddings plus the output head (once when tied).
    pub embeddings: u64,
    /// The transformer layers (attention, MLP, norms) and the final norm.
    pub layers: u64,
    /// A vision tower and its projector (multimodal models).
    pub vision: u64,
}

impl ParamCount {
    pub fn total(&self) -> u64 {
        self.embeddings
            .saturating_add(self.layers)
            .saturating_add(self.vision)
    }
}

/// Keys of the language model's config that transformers fills in when a config leaves them
/// out (its config classes' defaults): real configs rely on them (LLaVA's `text_config` names
/// only its `model_type`; Gemma-3's has no `vocab_size`).
const TRANSFORMERS_DEFAULTS: &[(&str, &[(&str, u64)])] = &[
    (
        "llama",
        &[
            ("hidden_size", 4096),
            ("intermediate_size", 11008),
            ("num_hidden_layers", 32),
            ("num_attention_heads", 32),
            ("vocab_size", 32000),
            ("max_position_embeddings", 2048),
        ],
    ),
    (
        "gemma3_text",
        &[
            ("hidden_size", 2304),
            ("intermediate_size", 9216),
            ("num_hidden_layers", 26),
            ("num_attention_heads", 8),
            ("num_key_value_heads", 4),
            ("head_dim", 256),
            ("vocab_size", 262_208),
            ("max_position_embeddings", 131_072),
            ("sliding_window", 4096),
        ],
    ),
];

/// Model types whose output head is the embedding matrix unless the config says otherwise.
const TIED_BY_DEFAULT: &[&str] = &["gemma", "gemma2", "gemma3", "gemma3_text"];
/// Model types whose q, k and v projections carry biases though their configs do not say so
/// (transformers' Qwen2 and Qwen2-MoE attention: `bias=True` on q/k/v, none on o).
const QKV_BIAS: &[&str] = &["qwen2", "qwen2_moe"];
/// Model types with a plain two-matrix MLP (up, down); everything else is gated (gate, up, down).
const PLAIN_MLP: &[&str] = &[
    "gpt2",
    "gpt_neox",
    "gptj",
    "opt",
    "bloom",
    "falcon",
    "phi",
    "starcoder2",
];

/// A config key looked up in `text_config`, then the top level, then transformers' defaults.
struct Lookup<'a> {
    text: &'a Value,
    top: &'a Value,
    model_type: String,
    prefix: &'static str,
    notes: Vec<String>,
}

impl Lookup<'_> {
    fn value(&self, key: &str) -> Option<&Value> {
        [self.text, self.top]
            .into_iter()
            .filter_map(|v| v.get(key))
            .find(|v| !v.is_null())
    }

    fn number(&mut self, keys: &[&str]) -> Result<Option<u64>, String> {
        for key in keys {
            if let Some(v) = self.value(key) {
                return match v.as_u64() {
                    Some(n) if n > MAX_CONFIG_NUMBER => Err(format!(
                        "{}{key}: {n} is beyond any model (at most {MAX_CONFIG_NUMBER})",
                        self.prefix
                    )),
                    Some(n) => Ok(Some(n)),
                    None => Err(format!("{}{key}: '{v}' is not a whole number", self.prefix)),
                };
            }
        }
        let default = TRANSFORMERS_DEFAULTS
            .iter()
            .find(|(t, _)| *t == self.model_type)
            .and_then(|(_, d)| d.iter().find(|(k, _)| *k == keys[0]));
        Ok(default.map(|(key, n)| {
            self.notes.push(format!(
                "{}{key} not in the config: transformers' default for {} ({n})",
                self.prefix, self.model_type
            ));
            *n
        }))
    }

    fn required(&mut self, keys: &[&str], flag: &str) -> Result<u64, String> {
        self.number(keys)?.ok_or_else(|| {
            format!(
                "{}{} is missing (model_type '{}'): give it with {flag}",
                self.prefix, keys[0], self.model_type
            )
        })
    }

    fn flag(&self, key: &str) -> Option<bool> {
        self.value(key).and_then(Value::as_bool)
    }
}

impl Architecture {
    /// Reads a parsed `config.json`. Returns the architecture and what was assumed on the way.
    pub fn from_hf_config(config: &Value) -> Result<(Architecture, Vec<String>), String> {
        if !config.is_object() {
            return Err("not a JSON object".into());
        }
        let text = config.get("text_config").filter(|t| t.is_object());
        let model_type = text
            .and_then(|t| t.get("model_type"))
            .or_else(|| config.get("model_type"))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let mut l = Lookup {
            text: text.unwrap_or(config),
            top: config,
            model_type: model_type.clone(),
            prefix: if text.is_some() { "text_config." } else { "" },
            notes: Vec::new(),
        };
        if text.is_some() {
            l.notes.push(format!(
                "multimodal config: the language model is text_config ({model_type})"
            ));
        }
        if l.value("kv_lora_rank").is_some() {
            return Err(
                "multi-head latent attention (kv_lora_rank, DeepSeek-V2/V3) is not modelled: \
                 give --layers, --kv-heads, --head-dim and --params for an equivalent"
                    .into(),
            );
        }
        let layers = l.required(&["num_hidden_layers", "n_layer", "num_layers"], "--layers")?;
        let heads = l.required(
            &["num_attention_heads", "n_head", "num_heads"],
            "--attention-heads",
        )?;
        let hidden = l.number(&["hidden_size", "n_embd", "d_model"])?;
        let kv_heads = match l.number(&["num_key_value_heads", "n_head_kv", "num_kv_heads"])? {
            Some(n) => n,
            None if l.flag("multi_query") == Some(true) => 1,
            None => {
                l.notes.push(format!(
                    "{}num_key_value_heads not in the config: every attention head has its own KV ({heads})",
                    l.prefix
                ));
                heads
            }
        };
        let head_dim = match l.number(&["head_dim"])? {
            Some(d) => d,
            None => match hidden {
                Some(h) if heads > 0 => h / heads,
                _ => {
                    return Err(format!(
                        "{}head_dim is missing and hidden_size too: give --head-dim",
                        l.prefix
                    ))
                }
            },
        };
        if layers == 0 || heads == 0 || kv_heads == 0 || head_dim == 0 {
            return Err(format!(
                "{}layers ({layers}), attention heads ({heads}), KV heads ({kv_heads}) and head_dim ({head_dim}) must be above 0",
                l.prefix
            ));
        }
        let (sliding_window, sliding_layers) = sliding(&mut l, layers)?;
        let mlp = mlp_shape(&mut l)?;
        let bias = match l.flag("attention_bias") {
            Some(true) => Bias::QkvO,
            Some(false) => Bias::None,
            None if QKV_BIAS.contains(&model_type.as_str()) => Bias::Qkv,
            None => Bias::None,
        };
        let architectures = config
            .get("architectures")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        let vocab = l.number(&["vocab_size"])?;
        let max_len = l.number(&["max_position_embeddings", "n_positions", "max_seq_len"])?;
        let params = match (hidden, mlp.width, vocab) {
            (Some(hidden), Some(_), Some(vocab)) => {
                let tied = match l.flag("tie_word_embeddings") {
                    Some(t) => t,
                    None => {
                        let tied = TIED_BY_DEFAULT.contains(&model_type.as_str());
                        l.notes.push(format!(
                            "tie_word_embeddings not in the config: {} for {model_type}",
                            if tied {
                                "tied (transformers' default)"
                            } else {
                                "untied assumed (counts the output head: conservative)"
                            }
                        ));
                        tied
                    }
                };
                let shape = Shape {
                    layers,
                    heads,
                    kv_heads,
                    head_dim,
                    hidden,
                    vocab,
                    tied,
                    bias,
                    mlp,
                };
                // A vision tower that cannot be counted leaves the count unknown (--params or
                // --weights then give it), not the config unreadable.
                match vision_params(config, hidden, &mut l.notes) {
                    Ok(vision) => Some(ParamCount {
                        embeddings: shape.embedding_params(),
                        layers: shape.layer_params(),
                        vision,
                    }),
                    Err(why) => {
                        l.notes.push(why);
                        None
                    }
                }
            }
            _ => None,
        };
        let saved_dtype = l
            .value("torch_dtype")
            .or_else(|| l.value("dtype"))
            .and_then(Value::as_str)
            .and_then(Dtype::from_torch);
        let quantized = l.value("quantization_config").and_then(quantization);
        let notes = l.notes;
        Ok((
            Architecture {
                model_type,
                architectures,
                experts: mlp.experts,
                layers,
                attention_heads: heads,
                kv_heads,
                head_dim,
                hidden_size: hidden,
                mlp_width: mlp
                    .width
                    .map(|w| w.saturating_mul(mlp.experts_per_token.max(1))),
                vocab_size: vocab,
                sliding_window,
                sliding_layers,
                max_position_embeddings: max_len,
                params,
                saved_dtype,
                quantized,
            },
            notes,
        ))
    }
}

/// The MLP: its width, and for mixture-of-experts the expert count, experts per token and a
/// shared expert.
#[derive(Clone, Copy, Debug, Default)]
struct Mlp {
    width: Option<u64>,
    gated: bool,
    experts: u64,
    experts_per_token: u64,
    shared_width: u64,
}

fn mlp_shape(l: &mut Lookup) -> Result<Mlp, String> {
    let experts = l
        .number(&["num_local_experts", "num_experts", "n_routed_experts"])?
        .unwrap_or(0);
    let width = if experts > 0 {
        l.number(&["moe_intermediate_size", "intermediate_size"])?
    } else {
        l.number(&["intermediate_size", "n_inner", "ffn_dim"])?
    };
    let gated = !PLAIN_MLP.contains(&l.model_type.as_str());
    let experts_per_token = if experts > 0 {
        l.number(&["num_experts_per_tok", "num_experts_per_token"])?
            .unwrap_or(2)
    } else {
        0
    };
    if experts > 0 {
        l.notes.push(format!(
            "mixture of experts: {experts} experts, {experts_per_token} per token"
        ));
    }
    Ok(Mlp {
        width,
        gated,
        experts,
        experts_per_token,
        shared_width: l.number(&["shared_expert_intermediate_size"])?.unwrap_or(0),
    })
}

/// Which attention projections carry a bias vector.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Bias {
    None,
    /// q, k and v (Qwen2).
    Qkv,
    /// q, k, v and o (`attention_bias: true`, as Llama's config names it).
    QkvO,
}

/// The numbers the parameter count is made of.
struct Shape {
    layers: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    hidden: u64,
    vocab: u64,
    tied: bool,
    bias: Bias,
    mlp: Mlp,
}

/// A dimension, count or length in a config.json above this is nonsense (the largest models
/// have hidden sizes in the tens of thousands and contexts of ten million tokens).
const MAX_CONFIG_NUMBER: u64 = 1 << 32;

/// A parameter count worked out in 128 bits, saturated to 64 (a config within the bounds can
/// still multiply past 64 bits: never wrap around to a small model).
fn saturate(n: u128) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

impl Shape {
    fn embedding_params(&self) -> u64 {
        let tied: u128 = if self.tied { 1 } else { 2 };
        saturate(self.vocab as u128 * self.hidden as u128 * tied)
    }

    /// Every layer: q and o (heads × head_dim), k and v (KV heads × head_dim), their biases where
    /// the model has them, the MLP, two norm vectors; then the final norm.
    fn layer_params(&self) -> u64 {
        let m = &self.mlp;
        let d = self.hidden as u128;
        let (heads, kv_heads, head_dim) = (
            self.heads as u128,
            self.kv_heads as u128,
            self.head_dim as u128,
        );
        let attention = 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim;
        let qkv_bias = (heads + 2 * kv_heads) * head_dim;
        let bias = match self.bias {
            Bias::None => 0,
            Bias::Qkv => qkv_bias,
            Bias::QkvO => qkv_bias + d,
        };
        let matrices: u128 = if m.gated { 3 } else { 2 };
        let width = m.width.unwrap_or(0) as u128;
        let (experts, shared) = (m.experts as u128, m.shared_width as u128);
        let mlp = if experts > 0 {
            // Experts, the router, and a shared expert with its gate (Qwen-MoE).
            experts * matrices * d * width
                + d * experts
                + if shared > 0 {
                    matrices * d * shared + d
                } else {
                    0
                }
        } else {
            matrices * d * width
        };
        saturate(self.layers as u128 * (attention + bias + mlp + 2 * d) + d)
    }
}

/// Which layers have a sliding window, and how long it is.
fn sliding(l: &mut Lookup, layers: u64) -> Result<(Option<u64>, u64), String> {
    let Some(window) = l.number(&["sliding_window"])? else {
        return Ok((None, 0));
    };
    if l.flag("use_sliding_window") == Some(false) {
        l.notes.push(format!(
            "{}sliding_window {window} is off (use_sliding_window = false)",
            l.prefix
        ));
        return Ok((None, 0));
    }
    let count = if let Some(types) = l.value("layer_types").and_then(Value::as_array) {
        let sliding = types
            .iter()
            .filter(|t| t.as_str().is_some_and(|s| s.contains("sliding")))
            .count() as u64;
        l.notes.push(format!(
            "{}layer_types: {sliding} of {} layers have the {window}-token window",
            l.prefix,
            types.len()
        ));
        sliding.min(layers)
    } else if l.model_type == "gemma2" {
        l.notes.push(format!(
            "gemma2: every other layer (the even ones) has the {window}-token window"
        ));
        layers.div_ceil(2)
    } else if l.model_type.starts_with("gemma3") {
        let pattern = l.number(&["sliding_window_pattern"])?.unwrap_or(6).max(1);
        l.notes.push(format!(
            "gemma3: {} of every {pattern} layers have the {window}-token window, the last is global",
            pattern - 1
        ));
        layers - layers / pattern
    } else if let (Some(true), Some(full)) = (
        l.flag("use_sliding_window"),
        l.number(&["max_window_layers"])?,
    ) {
        l.notes.push(format!(
            "use_sliding_window: layers from {full} on have the {window}-token window"
        ));
        layers.saturating_sub(full)
    } else {
        l.notes.push(format!(
            "sliding_window {window} on every layer (as Mistral v0.1)"
        ));
        layers
    };
    Ok((Some(window), count))
}

/// A vision tower (ViT/SigLIP/CLIP shape) and its projector into the language model, from
/// `vision_config`: per layer q, k, v, o and a two-matrix MLP (with biases and two LayerNorms),
/// the patch embedding, learned position embeddings, and one `vision × text` projection.
fn vision_params(config: &Value, text_hidden: u64, notes: &mut Vec<String>) -> Result<u64, String> {
    let Some(vision) = config.get("vision_config").filter(|v| v.is_object()) else {
        return Ok(0);
    };
    let get = |keys: &[&str]| {
        keys.iter()
            .find_map(|k| vision.get(*k).and_then(Value::as_u64))
            .map(|n| n.min(MAX_CONFIG_NUMBER))
    };
    let width = get(&["embed_dim", "hidden_size", "width"]);
    let layers = get(&["num_hidden_layers", "depth", "layers"]);
    let ffn = get(&["intermediate_size"]).or_else(|| {
        let ratio = vision.get("mlp_ratio").and_then(Value::as_f64)?;
        width.map(|w| (w as f64 * ratio) as u64)
    });
    let (Some(d), Some(layers), Some(ffn)) = (width, layers, ffn) else {
        return Err(
            "vision_config lacks hidden_size, num_hidden_layers or intermediate_size: \
             the vision tower cannot be counted; give --params (or --weights)"
                .into(),
        );
    };
    let patch = get(&["patch_size"]).unwrap_or(14);
    let channels = get(&["num_channels", "in_channels"]).unwrap_or(3);
    let positions = get(&["image_size"]).map_or(0, |size| ((size / patch.max(1)) as u128).pow(2));
    let [d, layers, ffn, patch, channels, text_hidden] =
        [d, layers, ffn, patch, channels, text_hidden].map(u128::from);
    let per_layer = 4 * d * d + 4 * d + 2 * d * ffn + ffn + d + 4 * d;
    let total = saturate(
        layers * per_layer
            + channels * patch * patch * d
            + d
            + positions * d
            + 2 * d
            + d * text_hidden,
    );
    notes.push(format!(
        "vision tower counted as a ViT from vision_config ({layers} layers of {d}, MLP {ffn}, patch {patch}): {:.2}B parameters, kept in 16 bits",
        total as f64 / 1e9
    ));
    Ok(total)
}

/// `quantization_config` -> the weights' dtype (AWQ/GPTQ bits, fp8).
fn quantization(q: &Value) -> Option<Dtype> {
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
    if method.contains("fp8") {
        return Some(Dtype::Fp8);
    }
    match q
        .get("bits")
        .or_else(|| q.get("w_bit"))
        .and_then(Value::as_u64)
    {
        Some(4) => Some(Dtype::Int4),
        Some(8) => Some(Dtype::Int8),
        _ => None,
    }
}
