//! The text config of a Qwen3.5 checkpoint, read from a real `config.json` (docs/BACKBONE.md §1).
//!
//! Accepts the published multimodal wrapper (values under `text_config`) and text-only files,
//! RoPE settings under `rope_parameters` or the older top-level `rope_theta` /
//! `partial_rotary_factor`, and `layer_types` or `full_attention_interval`.

use std::path::Path;

use kev_core::Error;
use serde_json::{Map, Value};

/// The most decoder layers a config may state. The layer list is built from
/// `num_hidden_layers` before any tensor can confirm it (the weights are read later), so the
/// number alone must not size it: 2^40 layers asked for a terabyte. Real checkpoints have tens.
pub const MAX_LAYERS: usize = 1 << 16;

/// The kind of mixer a decoder layer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerType {
    /// Gated DeltaNet (`linear_attention`).
    LinearAttention,
    /// Gated full attention (`full_attention`).
    FullAttention,
}

/// What each decoder layer's MLP is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpShape {
    /// One SwiGLU MLP of `intermediate_size` (the dense Qwen3.5 backbones).
    Dense {
        /// `intermediate_size`.
        width: usize,
    },
    /// A mixture of experts (`qwen3_5_moe`): every layer's MLP is one.
    Experts(ExpertsShape),
}

/// A Qwen3.5 MoE layer's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertsShape {
    /// Routed experts (`num_experts`).
    pub experts: usize,
    /// Experts each token goes to (`num_experts_per_tok`, at most `experts`).
    pub per_token: usize,
    /// A routed expert's SwiGLU width (`moe_intermediate_size`).
    pub width: usize,
    /// The shared expert's SwiGLU width (`shared_expert_intermediate_size`).
    pub shared_width: usize,
}

/// The subset of the config the text backbone needs, with derived sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Residual width H.
    pub hidden_size: usize,
    /// Number of decoder layers L.
    pub num_hidden_layers: usize,
    /// Each decoder layer's MLP: one dense SwiGLU, or a mixture of experts.
    pub mlp: MlpShape,
    /// The FP8 weights' block (rows, columns) where `quantization_config` gives one: each
    /// weight's scale grid must be the block's (`None`: the block is read from each grid).
    pub fp8_block: Option<(usize, usize)>,
    /// Vocabulary size (rows of `embed_tokens`).
    pub vocab_size: usize,
    /// RMSNorm epsilon, used by every norm.
    pub rms_norm_eps: f64,
    /// Mixer kind per layer.
    pub layer_types: Vec<LayerType>,
    /// Attention query heads.
    pub num_attention_heads: usize,
    /// Attention key/value heads.
    pub num_key_value_heads: usize,
    /// Attention head size (explicit; not hidden / heads).
    pub head_dim: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// Number of leading head dims that are rotated (head_dim · partial_rotary_factor).
    pub rotary_dim: usize,
    /// DeltaNet query/key heads.
    pub linear_num_key_heads: usize,
    /// DeltaNet value heads.
    pub linear_num_value_heads: usize,
    /// DeltaNet query/key head size.
    pub linear_key_head_dim: usize,
    /// DeltaNet value head size.
    pub linear_value_head_dim: usize,
    /// Depthwise conv kernel size K.
    pub linear_conv_kernel_dim: usize,
}

/// A fault in `config.json`: the field's path in the file (`text_config.rope_theta`) and what is
/// wrong with it.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigFault {
    /// The dotted path of the field; empty for the file as a whole.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl std::fmt::Display for ConfigFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "field `{}`: {}", self.field, self.message)
        }
    }
}

/// The fields of the text config, read by hand so that every fault names its field.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    /// `text_config.` for the multimodal wrapper, empty for a text-only file.
    prefix: &'a str,
}

impl Fields<'_> {
    fn fault(&self, key: &str, message: impl Into<String>) -> ConfigFault {
        ConfigFault {
            field: format!("{}{key}", self.prefix),
            message: message.into(),
        }
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>, ConfigFault> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| {
                    self.fault(key, format!("must be a non-negative integer, found {v}"))
                }),
        }
    }

    /// A required integer > 0 (every size of the backbone).
    fn size(&self, key: &str) -> Result<usize, ConfigFault> {
        match self.opt_usize(key)? {
            None => Err(self.fault(key, "missing (a positive integer is required)")),
            Some(0) => Err(self.fault(key, "must be positive")),
            Some(n) => Ok(n),
        }
    }

    /// The MLP: a mixture of experts where `num_experts` is set (transformers' `qwen3_5_moe`,
    /// whose every layer is sparse and whose router always renormalises its top-k: a
    /// `norm_topk_prob` there is not read, as transformers does not), else dense. The Qwen3 MoE
    /// fields that would make some layers dense are refused unless they say none is.
    fn mlp_shape(&self) -> Result<MlpShape, ConfigFault> {
        let Some(experts) = self.opt_usize("num_experts")? else {
            return Ok(MlpShape::Dense {
                width: self.size("intermediate_size")?,
            });
        };
        if experts == 0 {
            return Err(self.fault("num_experts", "must be positive"));
        }
        let per_token = self.size("num_experts_per_tok")?;
        if per_token > experts {
            return Err(self.fault(
                "num_experts_per_tok",
                format!("{per_token} is more than `num_experts` = {experts}"),
            ));
        }
        if let Some(step) = self.opt_usize("decoder_sparse_step")? {
            if step != 1 {
                return Err(self.fault(
                    "decoder_sparse_step",
                    format!("{step} is not supported: every Qwen3.5 MoE layer is sparse (1)"),
                ));
            }
        }
        match self.obj.get("mlp_only_layers") {
            None | Some(Value::Null) => {}
            Some(Value::Array(a)) if a.is_empty() => {}
            Some(v) => {
                return Err(self.fault(
                    "mlp_only_layers",
                    format!("{v} is not supported: every Qwen3.5 MoE layer is sparse ([])"),
                ))
            }
        }
        Ok(MlpShape::Experts(ExpertsShape {
            experts,
            per_token,
            width: self.size("moe_intermediate_size")?,
            shared_width: self.size("shared_expert_intermediate_size")?,
        }))
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>, ConfigFault> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.fault(key, format!("must be a number, found {v}"))),
        }
    }

    fn opt_str(&self, key: &str) -> Result<Option<&str>, ConfigFault> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.fault(key, format!("must be a string, found {v}"))),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>, ConfigFault> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.fault(key, format!("must be a boolean, found {v}"))),
        }
    }
}

/// Accepts the one quantization Kev reads: Qwen's FP8 releases (`quant_method` `fp8`, e4m3
/// weights with block scales, activations quantized on the fly), which load dequantized
/// (docs/BACKBONE.md §2.1). Any other method would leave weights Kev cannot read.
fn check_quantization(q: &Value, field: &str) -> Result<Option<(usize, usize)>, ConfigFault> {
    let fault = |key: &str, message: String| ConfigFault {
        field: format!("{field}.{key}"),
        message,
    };
    let Some(obj) = q.as_object() else {
        return Err(ConfigFault {
            field: field.to_string(),
            message: format!("must be an object, found {q}"),
        });
    };
    let text = |key: &str| obj.get(key).filter(|v| !v.is_null());
    match text("quant_method") {
        Some(Value::String(m)) if m == "fp8" => {}
        Some(v) => {
            return Err(fault(
                "quant_method",
                format!("{v} is not supported: only \"fp8\" (Qwen's block-scaled e4m3 releases)"),
            ))
        }
        None => return Err(fault("quant_method", "missing".into())),
    }
    if let Some(fmt) = text("fmt") {
        if fmt.as_str() != Some("e4m3") {
            return Err(fault("fmt", format!("{fmt} is not supported: only `e4m3`")));
        }
    }
    if let Some(scheme) = text("activation_scheme") {
        if scheme.as_str() != Some("dynamic") {
            return Err(fault(
                "activation_scheme",
                format!("{scheme} is not supported: only `dynamic` (no stored activation scales)"),
            ));
        }
    }
    let Some(block) = text("weight_block_size") else {
        return Ok(None);
    };
    let size = |x: &Value| {
        x.as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .filter(|&n| n > 0)
    };
    if let Some([bm, bn]) = block.as_array().map(Vec::as_slice) {
        if let (Some(bm), Some(bn)) = (size(bm), size(bn)) {
            return Ok(Some((bm, bn)));
        }
    }
    Err(fault(
        "weight_block_size",
        format!("must be two positive integers, found {block}"),
    ))
}

impl Config {
    /// Reads a `config.json` strictly (a repeated key is an error, a byte order mark is
    /// skipped); every fault is an [`Error::Config`] naming the field, or an [`Error::Json`].
    pub fn from_file(path: &Path) -> kev_core::Result<Self> {
        let root = kev_core::json::read_json_file(path)?;
        Self::from_value(&root).map_err(|f| Error::config(path, f.field, f.message))
    }

    /// Parses a `config.json` text (for tests and tools; [`Config::from_file`] names the file).
    pub fn from_json(text: &str) -> Result<Self, ConfigFault> {
        let root = kev_core::json::parse_strict(text).map_err(|e| ConfigFault {
            field: String::new(),
            message: format!("not valid JSON: {e}"),
        })?;
        Self::from_value(&root)
    }

    /// Reads the text config from a parsed `config.json`: the `text_config` object of the
    /// multimodal wrapper, else the root.
    pub fn from_value(root: &Value) -> Result<Self, ConfigFault> {
        let root_obj = root.as_object().ok_or_else(|| ConfigFault {
            field: String::new(),
            message: "must be a JSON object".into(),
        })?;
        let f = match root_obj.get("text_config") {
            None => Fields {
                obj: root_obj,
                prefix: "",
            },
            Some(Value::Object(obj)) => Fields {
                obj,
                prefix: "text_config.",
            },
            Some(v) => {
                return Err(ConfigFault {
                    field: "text_config".into(),
                    message: format!("must be an object, found {v}"),
                })
            }
        };
        // Qwen's FP8 releases put it at the top; a text-only save may carry it either way (both
        // are checked; they must then agree).
        let mut fp8_block = None;
        for (obj, prefix) in [(root_obj, ""), (f.obj, f.prefix)] {
            let Some(q) = obj.get("quantization_config").filter(|q| !q.is_null()) else {
                continue;
            };
            let field = format!("{prefix}quantization_config");
            let block = check_quantization(q, &field)?;
            if fp8_block.is_some_and(|b| Some(b) != block) {
                return Err(ConfigFault {
                    field: format!("{field}.weight_block_size"),
                    message: "differs from the top-level `quantization_config`'s".into(),
                });
            }
            fp8_block = fp8_block.or(block);
        }
        if let Some(act) = f.opt_str("hidden_act")? {
            if act != "silu" {
                return Err(f.fault(
                    "hidden_act",
                    format!("`{act}` is not supported: only `silu`"),
                ));
            }
        }
        if f.opt_bool("attention_bias")? == Some(true) {
            return Err(f.fault(
                "attention_bias",
                "`true` is not supported: Qwen3.5 has no biases",
            ));
        }
        let num_hidden_layers = f.size("num_hidden_layers")?;
        if num_hidden_layers > MAX_LAYERS {
            return Err(f.fault(
                "num_hidden_layers",
                format!(
                    "{num_hidden_layers} is more than the {MAX_LAYERS} layers a config may have"
                ),
            ));
        }
        if f.opt_bool("attn_output_gate")? == Some(false) {
            return Err(f.fault(
                "attn_output_gate",
                "`false` is not supported: Qwen3.5's attention is gated",
            ));
        }
        let interval = f.opt_usize("full_attention_interval")?;
        let layer_types = match f.obj.get("layer_types") {
            None | Some(Value::Null) => {
                let interval = interval.unwrap_or(4);
                if interval == 0 {
                    return Err(f.fault("full_attention_interval", "must be positive"));
                }
                (0..num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % interval == 0 {
                            LayerType::FullAttention
                        } else {
                            LayerType::LinearAttention
                        }
                    })
                    .collect()
            }
            Some(Value::Array(types)) => types
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    Some("linear_attention") => Ok(LayerType::LinearAttention),
                    Some("full_attention") => Ok(LayerType::FullAttention),
                    _ => Err(f.fault(
                        &format!("layer_types[{i}]"),
                        format!(
                            "`{t}` is unknown: expected `linear_attention` or `full_attention`"
                        ),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(v) => return Err(f.fault("layer_types", format!("must be a list, found {v}"))),
        };
        if layer_types.len() != num_hidden_layers {
            return Err(f.fault(
                "layer_types",
                format!(
                    "has {} entries for `num_hidden_layers` = {num_hidden_layers}",
                    layer_types.len()
                ),
            ));
        }
        if let (Some(interval), Some(_)) = (interval, f.obj.get("layer_types")) {
            let agrees = interval > 0
                && layer_types
                    .iter()
                    .enumerate()
                    .all(|(i, t)| (*t == LayerType::FullAttention) == ((i + 1) % interval == 0));
            if !agrees {
                return Err(f.fault(
                    "full_attention_interval",
                    format!("{interval} contradicts `layer_types`"),
                ));
            }
        }
        let rope = match f.obj.get("rope_parameters") {
            None | Some(Value::Null) => None,
            Some(Value::Object(obj)) => Some(Fields {
                obj,
                prefix: if f.prefix.is_empty() {
                    "rope_parameters."
                } else {
                    "text_config.rope_parameters."
                },
            }),
            Some(v) => {
                return Err(f.fault("rope_parameters", format!("must be an object, found {v}")))
            }
        };
        if let Some(rope) = &rope {
            if let Some(kind) = rope.opt_str("rope_type")? {
                if kind != "default" {
                    return Err(rope.fault(
                        "rope_type",
                        format!("`{kind}` is not supported: only `default`"),
                    ));
                }
            }
        }
        // A setting under `rope_parameters` wins over the older top-level one; the fault names
        // the field that was read.
        let pick = |key: &str| -> Result<Option<(f64, ConfigFault)>, ConfigFault> {
            if let Some(rope) = &rope {
                if let Some(x) = rope.opt_f64(key)? {
                    return Ok(Some((x, rope.fault(key, ""))));
                }
            }
            Ok(f.opt_f64(key)?.map(|x| (x, f.fault(key, ""))))
        };
        let with = |mut fault: ConfigFault, message: String| {
            fault.message = message;
            fault
        };
        let rope_theta = match pick("rope_theta")? {
            None => 10_000_000.0,
            Some((x, _)) if x.is_finite() && x > 0.0 => x,
            Some((x, fault)) => {
                return Err(with(fault, format!("must be finite and > 0, got {x}")))
            }
        };
        let head_dim = f.size("head_dim")?;
        let (factor, factor_fault) = pick("partial_rotary_factor")?
            .unwrap_or_else(|| (0.25, f.fault("partial_rotary_factor", "")));
        let rotary = head_dim as f64 * factor;
        let rotary_dim = rotary as usize;
        if !(factor > 0.0 && factor <= 1.0)
            || rotary != rotary_dim as f64
            || rotary_dim == 0
            || !rotary_dim.is_multiple_of(2)
        {
            return Err(with(
                factor_fault,
                format!("{factor} gives rotary dim {rotary} for head_dim {head_dim}: it must be an even whole number in 2..=head_dim"),
            ));
        }
        let rms_norm_eps = f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6);
        if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0 && (rms_norm_eps as f32) > 0.0) {
            return Err(f.fault(
                "rms_norm_eps",
                format!("must be finite and > 0 (in f32), got {rms_norm_eps}"),
            ));
        }
        let num_attention_heads = f.size("num_attention_heads")?;
        let num_key_value_heads = f.size("num_key_value_heads")?;
        if !num_attention_heads.is_multiple_of(num_key_value_heads) {
            return Err(f.fault(
                "num_key_value_heads",
                format!("{num_key_value_heads} does not divide `num_attention_heads` = {num_attention_heads}"),
            ));
        }
        let linear_num_key_heads = f.size("linear_num_key_heads")?;
        let linear_num_value_heads = f.size("linear_num_value_heads")?;
        if !linear_num_value_heads.is_multiple_of(linear_num_key_heads) {
            return Err(f.fault(
                "linear_num_key_heads",
                format!("{linear_num_key_heads} does not divide `linear_num_value_heads` = {linear_num_value_heads}"),
            ));
        }
        let linear_conv_kernel_dim = f.size("linear_conv_kernel_dim")?;
        if linear_conv_kernel_dim < 2 {
            return Err(f.fault("linear_conv_kernel_dim", "must be at least 2"));
        }
        let mlp = f.mlp_shape()?;
        Ok(Self {
            hidden_size: f.size("hidden_size")?,
            num_hidden_layers,
            mlp,
            fp8_block,
            vocab_size: f.size("vocab_size")?,
            rms_norm_eps,
            layer_types,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rope_theta,
            rotary_dim,
            linear_num_key_heads,
            linear_num_value_heads,
            linear_key_head_dim: f.size("linear_key_head_dim")?,
            linear_value_head_dim: f.size("linear_value_head_dim")?,
            linear_conv_kernel_dim,
        })
    }

    /// Channels of the DeltaNet conv input `[q | k | v]`.
    pub fn linear_conv_dim(&self) -> usize {
        2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"{"hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
        "vocab_size": 300, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4"#;

    #[test]
    fn interval_builds_layer_pattern() {
        let cfg = Config::from_json(&format!("{TEXT}, \"rope_theta\": 1e6}}")).unwrap();
        use LayerType::*;
        assert_eq!(
            cfg.layer_types,
            vec![
                LinearAttention,
                LinearAttention,
                LinearAttention,
                FullAttention
            ]
        );
        assert_eq!(cfg.rope_theta, 1e6);
        assert_eq!(cfg.rotary_dim, 8);
    }

    #[test]
    fn nested_text_config_and_rope_parameters() {
        let json = format!(
            "{{\"model_type\": \"qwen3_5\", \"text_config\": {TEXT}, \"rope_parameters\": {{\"rope_theta\": 5.0, \"partial_rotary_factor\": 0.5}}}}}}"
        );
        let cfg = Config::from_json(&json).unwrap();
        assert_eq!((cfg.rope_theta, cfg.rotary_dim), (5.0, 16));
    }

    #[test]
    fn layer_types_length_mismatch_is_an_error() {
        let err = Config::from_json(&format!("{TEXT}, \"layer_types\": [\"full_attention\"]}}"))
            .unwrap_err();
        assert_eq!(err.field, "layer_types");
        assert!(err.message.contains("has 1 entries"), "{err}");
    }

    /// Each fault names its own field, under `text_config.` when the file nests it.
    #[test]
    fn faults_name_their_field() {
        let nested = |extra: &str| format!("{{\"text_config\": {TEXT}{extra}}}}}");
        let flat = |extra: &str| format!("{TEXT}{extra}}}");
        let cases = [
            (nested(", \"rope_theta\": 0"), "text_config.rope_theta"),
            (nested(", \"rope_theta\": -5"), "text_config.rope_theta"),
            (
                nested(", \"rope_parameters\": {\"rope_theta\": 0}"),
                "text_config.rope_parameters.rope_theta",
            ),
            (flat(", \"rms_norm_eps\": -1e-6"), "rms_norm_eps"),
            (flat(", \"rms_norm_eps\": 1e-60"), "rms_norm_eps"),
            (
                nested(", \"hidden_act\": \"gelu\""),
                "text_config.hidden_act",
            ),
            (
                nested(", \"layer_types\": [\"x\", 1, 2, 3]"),
                "text_config.layer_types[0]",
            ),
            (
                flat(", \"partial_rotary_factor\": 0.3"),
                "partial_rotary_factor",
            ),
            (
                flat(", \"partial_rotary_factor\": 2"),
                "partial_rotary_factor",
            ),
            (
                TEXT.replace("\"hidden_size\": 64", "\"hidden_size\": 0") + "}",
                "hidden_size",
            ),
            (
                TEXT.replace("\"head_dim\": 32", "\"head_dim\": \"32\"") + "}",
                "head_dim",
            ),
            (TEXT.replace("\"vocab_size\": 300,", "") + "}", "vocab_size"),
        ];
        for (json, field) in cases {
            let err = Config::from_json(&json).unwrap_err();
            assert_eq!(err.field, field, "{json}: {err}");
        }
        let dup = Config::from_json(&flat(", \"head_dim\": 16")).unwrap_err();
        assert!(dup.message.contains("duplicate key `head_dim`"), "{dup}");
    }

    const MOE: &str = r#", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48"#;

    /// `num_experts` makes every layer's MLP a mixture of experts, with the other MoE sizes
    /// required; `intermediate_size` is then not read.
    #[test]
    fn moe_config_reads_its_sizes() {
        let cfg = Config::from_json(&format!("{{\"text_config\": {TEXT}{MOE}}}}}")).unwrap();
        let want = ExpertsShape {
            experts: 4,
            per_token: 2,
            width: 32,
            shared_width: 48,
        };
        assert_eq!(cfg.mlp, MlpShape::Experts(want));
        let dense = Config::from_json(&format!("{TEXT}}}")).unwrap();
        assert_eq!(dense.mlp, MlpShape::Dense { width: 128 });
        let without = TEXT.replace("\"intermediate_size\": 128,", "");
        assert!(Config::from_json(&format!("{without}{MOE}}}")).is_ok());
    }

    /// Qwen's FP8 quantization is accepted (its weights load dequantized); any other, or FP8
    /// settings Kev does not read, are refused naming the field, at the top or in text_config.
    #[test]
    fn quantization_other_than_qwens_fp8_is_refused() {
        let fp8 = r#""quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]"#;
        let top =
            |q: &str| format!("{{\"quantization_config\": {{{q}}}, \"text_config\": {TEXT}}}}}");
        assert!(Config::from_json(&top(fp8)).is_ok());
        let cases = [
            (
                top(r#""quant_method": "awq""#),
                "quantization_config.quant_method",
            ),
            (top(r#""fmt": "e4m3""#), "quantization_config.quant_method"),
            (top(&fp8.replace("e4m3", "e5m2")), "quantization_config.fmt"),
            (
                top(&fp8.replace("dynamic", "static")),
                "quantization_config.activation_scheme",
            ),
            (
                top(&fp8.replace("[128, 128]", "[128]")),
                "quantization_config.weight_block_size",
            ),
            (
                format!("{TEXT}, \"quantization_config\": {{\"quant_method\": \"gptq\"}}}}"),
                "quantization_config.quant_method",
            ),
        ];
        for (json, field) in cases {
            let err = Config::from_json(&json).unwrap_err();
            assert_eq!(err.field, field, "{json}: {err}");
        }
    }

    /// A MoE config that cannot describe a Qwen3.5 MoE layer names the field at fault.
    #[test]
    fn moe_faults_name_their_field() {
        let with = |extra: &str| format!("{{\"text_config\": {TEXT}{MOE}{extra}}}}}");
        let replaced = |from: &str, to: &str| {
            format!("{{\"text_config\": {TEXT}{}}}}}", MOE.replace(from, to))
        };
        let cases = [
            (
                replaced("\"num_experts\": 4", "\"num_experts\": 0"),
                "num_experts",
            ),
            (
                replaced("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 5"),
                "num_experts_per_tok",
            ),
            (
                replaced("\"num_experts_per_tok\": 2,", ""),
                "num_experts_per_tok",
            ),
            (
                replaced("\"moe_intermediate_size\": 32,", ""),
                "moe_intermediate_size",
            ),
            (
                replaced(
                    "\"shared_expert_intermediate_size\": 48",
                    "\"shared_expert_intermediate_size\": 0",
                ),
                "shared_expert_intermediate_size",
            ),
            (
                replaced("\"num_experts\": 4", "\"num_experts\": -4"),
                "num_experts",
            ),
            (with(", \"decoder_sparse_step\": 2"), "decoder_sparse_step"),
            (with(", \"mlp_only_layers\": [0]"), "mlp_only_layers"),
        ];
        for (json, field) in cases {
            let err = Config::from_json(&json).unwrap_err();
            assert_eq!(err.field, format!("text_config.{field}"), "{json}: {err}");
        }
        assert!(Config::from_json(&with(
            ", \"decoder_sparse_step\": 1, \"mlp_only_layers\": []"
        ))
        .is_ok());
    }
}
