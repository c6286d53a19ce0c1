//! The text config of a Qwen3.5 checkpoint, read from a real `config.json` (QWEN35.md §1).
//!
//! Accepts the published multimodal wrapper (values under `text_config`) and text-only files,
//! RoPE settings under `rope_parameters` or the older top-level `rope_theta` /
//! `partial_rotary_factor`, and `layer_types` or `full_attention_interval`.

use serde::Deserialize;
use serde_json::Value;

/// The kind of mixer a decoder layer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerType {
    /// Gated DeltaNet (`linear_attention`).
    LinearAttention,
    /// Gated full attention (`full_attention`).
    FullAttention,
}

/// The subset of the config the text backbone needs, with derived sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Residual width H.
    pub hidden_size: usize,
    /// Number of decoder layers L.
    pub num_hidden_layers: usize,
    /// MLP width.
    pub intermediate_size: usize,
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

#[derive(Deserialize)]
struct RawText {
    hidden_size: usize,
    num_hidden_layers: usize,
    intermediate_size: usize,
    vocab_size: usize,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    layer_types: Option<Vec<String>>,
    #[serde(default = "default_interval")]
    full_attention_interval: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    head_dim: usize,
    rope_parameters: Option<RawRope>,
    rope_theta: Option<f64>,
    partial_rotary_factor: Option<f64>,
    linear_num_key_heads: usize,
    linear_num_value_heads: usize,
    linear_key_head_dim: usize,
    linear_value_head_dim: usize,
    linear_conv_kernel_dim: usize,
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
}

#[derive(Deserialize)]
struct RawRope {
    rope_theta: Option<f64>,
    partial_rotary_factor: Option<f64>,
    rope_type: Option<String>,
}

fn default_eps() -> f64 {
    1e-6
}

fn default_interval() -> usize {
    4
}

impl Config {
    /// Parses a `config.json` text. Errors name the offending field.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let root: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let text_part = root.get("text_config").cloned().unwrap_or(root);
        let raw: RawText = serde_json::from_value(text_part).map_err(|e| e.to_string())?;
        Self::from_raw(raw)
    }

    fn from_raw(raw: RawText) -> Result<Self, String> {
        if let Some(act) = raw.hidden_act.as_deref() {
            if act != "silu" {
                return Err(format!("`hidden_act` is `{act}`; only `silu` is supported"));
            }
        }
        if raw.attention_bias == Some(true) {
            return Err("`attention_bias` is true; Qwen3.5 has no biases".into());
        }
        let layer_types = match raw.layer_types {
            Some(types) => types
                .iter()
                .map(|t| match t.as_str() {
                    "linear_attention" => Ok(LayerType::LinearAttention),
                    "full_attention" => Ok(LayerType::FullAttention),
                    other => Err(format!("`layer_types` has unknown entry `{other}`")),
                })
                .collect::<Result<Vec<_>, _>>()?,
            None => {
                if raw.full_attention_interval == 0 {
                    return Err("`full_attention_interval` must be > 0".into());
                }
                (0..raw.num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % raw.full_attention_interval == 0 {
                            LayerType::FullAttention
                        } else {
                            LayerType::LinearAttention
                        }
                    })
                    .collect()
            }
        };
        if layer_types.len() != raw.num_hidden_layers {
            return Err(format!(
                "`layer_types` has {} entries for `num_hidden_layers` = {}",
                layer_types.len(),
                raw.num_hidden_layers
            ));
        }
        let rope = raw.rope_parameters.as_ref();
        if let Some(kind) = rope.and_then(|r| r.rope_type.as_deref()) {
            if kind != "default" {
                return Err(format!(
                    "`rope_parameters.rope_type` is `{kind}`; only `default` is supported"
                ));
            }
        }
        let rope_theta = rope
            .and_then(|r| r.rope_theta)
            .or(raw.rope_theta)
            .unwrap_or(10_000_000.0);
        let factor = rope
            .and_then(|r| r.partial_rotary_factor)
            .or(raw.partial_rotary_factor)
            .unwrap_or(0.25);
        let rotary_dim = (raw.head_dim as f64 * factor) as usize;
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) || rotary_dim > raw.head_dim {
            return Err(format!(
                "`partial_rotary_factor` {factor} gives rotary dim {rotary_dim} for head_dim {}",
                raw.head_dim
            ));
        }
        let heads_ok = raw.num_key_value_heads > 0
            && raw
                .num_attention_heads
                .is_multiple_of(raw.num_key_value_heads)
            && raw.linear_num_key_heads > 0
            && raw
                .linear_num_value_heads
                .is_multiple_of(raw.linear_num_key_heads);
        if !heads_ok {
            return Err("head counts must divide: attention heads by kv heads, linear value heads by linear key heads".into());
        }
        if raw.linear_conv_kernel_dim < 2 {
            return Err("`linear_conv_kernel_dim` must be at least 2".into());
        }
        Ok(Self {
            hidden_size: raw.hidden_size,
            num_hidden_layers: raw.num_hidden_layers,
            intermediate_size: raw.intermediate_size,
            vocab_size: raw.vocab_size,
            rms_norm_eps: raw.rms_norm_eps,
            layer_types,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads: raw.num_key_value_heads,
            head_dim: raw.head_dim,
            rope_theta,
            rotary_dim,
            linear_num_key_heads: raw.linear_num_key_heads,
            linear_num_value_heads: raw.linear_num_value_heads,
            linear_key_head_dim: raw.linear_key_head_dim,
            linear_value_head_dim: raw.linear_value_head_dim,
            linear_conv_kernel_dim: raw.linear_conv_kernel_dim,
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
        assert!(err.contains("`layer_types` has 1 entries"), "{err}");
    }
}
