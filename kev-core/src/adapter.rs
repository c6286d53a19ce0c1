//! PEFT LoRA `adapter_config.json` (docs/CONTRACT.md §5): rank, alpha and the per-module scaling.
//!
//! Only what changes the merged weights is read; the many other PEFT keys are ignored. Settings
//! the runtime cannot honour (DoRA, LoRA biases, `fan_in_fan_out`, `modules_to_save`, a PEFT type
//! other than LoRA) are refused at load, naming the key, rather than giving wrong numbers.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::json::{self, fault, FieldResult};

/// The parts of a PEFT LoRA `adapter_config.json` that the runtime uses.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterConfig {
    /// Default LoRA rank `r` (PEFT default 8).
    pub r: usize,
    /// Default `lora_alpha` (PEFT default 8).
    pub lora_alpha: f64,
    /// Rank-stabilized LoRA: scaling `alpha / sqrt(r)` instead of `alpha / r`.
    pub use_rslora: bool,
    /// Targeted modules as written: a list of names, or one entry holding PEFT's regex string.
    /// Informational; the adapter's tensors decide what is merged.
    pub target_modules: Vec<String>,
    /// Per-module rank overrides, keyed by module-name suffix (see [`AdapterConfig::scaling`]).
    pub rank_pattern: HashMap<String, usize>,
    /// Per-module alpha overrides, keyed by module-name suffix.
    pub alpha_pattern: HashMap<String, f64>,
    /// Token ids whose `embed_tokens` rows the adapter retrains (`trainable_token_indices`);
    /// empty when there are none.
    pub trainable_token_indices: Vec<u32>,
    /// The layers PEFT put adapters on (`layers_to_transform`), `None` for every layer. The
    /// adapter's tensors must keep to them.
    pub layers_to_transform: Option<Vec<usize>>,
    /// The parameters PEFT adapts directly (`target_parameters`), in the config's order, as the
    /// parameter's name: only a MoE layer's fused routed experts, `gate_up_proj` and
    /// `down_proj` of `mlp.experts`. PEFT nests one wrapper per parameter, the first innermost.
    pub target_parameters: Vec<String>,
}

impl AdapterConfig {
    /// Reads and checks an `adapter_config.json`.
    ///
    /// Errors: [`Error::Io`], [`Error::Json`] for a file that does not parse, and
    /// [`Error::Config`] naming the key for a wrong or unsupported value.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_json_str(&text, path)
    }

    /// Parses the text of an `adapter_config.json`; `path` is named in errors.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let value = json::parse_json_text(text, path)?;
        parse(&value).map_err(|f| Error::config(path, f.field, f.message))
    }

    /// Rank for a module: the matching `rank_pattern` entry, else `r`.
    ///
    /// `module_key` is the module's dotted name, e.g. `layers.3.self_attn.q_proj` or
    /// `model.layers.3.self_attn.q_proj`. A pattern key matches when it equals the name or is a
    /// suffix of it on a dot boundary (`q_proj`, `self_attn.q_proj` and `layers.3.self_attn.q_proj`
    /// all match the example). PEFT treats keys as regular expressions anchored the same way; plain
    /// names, what PEFT writes, behave identically here. When several keys match, the longest
    /// (most specific) wins.
    pub fn rank(&self, module_key: &str) -> usize {
        best_match(&self.rank_pattern, module_key).map_or(self.r, |(_, r)| *r)
    }

    /// Alpha for a module: the matching `alpha_pattern` entry, else `lora_alpha`; matching as in
    /// [`AdapterConfig::rank`].
    pub fn alpha(&self, module_key: &str) -> f64 {
        best_match(&self.alpha_pattern, module_key).map_or(self.lora_alpha, |(_, a)| *a)
    }

    /// LoRA scaling `s` for a module: `alpha / r`, or `alpha / sqrt(r)` with `use_rslora`, with
    /// rank and alpha from [`AdapterConfig::rank`] and [`AdapterConfig::alpha`]. The merged weight is
    /// `W + (B·A) · s · lora_scale`.
    pub fn scaling(&self, module_key: &str) -> f64 {
        let r = self.rank(module_key) as f64;
        let alpha = self.alpha(module_key);
        if self.use_rslora {
            alpha / r.sqrt()
        } else {
            alpha / r
        }
    }
}

/// Whether `key` names `module` or a dotted suffix of it.
fn suffix_matches(module: &str, key: &str) -> bool {
    module == key || (module.ends_with(key) && module[..module.len() - key.len()].ends_with('.'))
}

fn best_match<'a, T>(
    patterns: &'a HashMap<String, T>,
    module: &str,
) -> Option<(&'a String, &'a T)> {
    patterns
        .iter()
        .filter(|(k, _)| suffix_matches(module, k))
        .max_by(|(a, _), (b, _)| a.len().cmp(&b.len()).then_with(|| b.cmp(a)))
}

fn parse(value: &Value) -> FieldResult<AdapterConfig> {
    let obj = json::as_object(value, "")?;
    if let Some(t) = json::opt_str(obj, "peft_type", "")? {
        if t != "LORA" {
            return Err(fault(
                "peft_type",
                format!("`{t}` is not supported: only `LORA` adapters are"),
            ));
        }
    }
    if let Some(b) = json::opt_str(obj, "bias", "")? {
        if b != "none" {
            return Err(fault(
                "bias",
                format!("`{b}` is not supported: only `none`"),
            ));
        }
    }
    for key in ["fan_in_fan_out", "use_dora", "lora_bias"] {
        if json::opt_bool(obj, key, "")? == Some(true) {
            return Err(fault(key, "`true` is not supported"));
        }
    }
    // PEFT variants that change the merged weights and that this runtime does not implement.
    for key in ["use_qalora", "use_bdlora"] {
        if json::opt_bool(obj, key, "")? == Some(true) {
            return Err(fault(key, "`true` is not supported"));
        }
    }
    match obj.get("alora_invocation_tokens") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(v) => {
            return Err(fault(
                "alora_invocation_tokens",
                format!("is not supported (got {})", json::show(v)),
            ));
        }
    }
    let target_parameters = expert_parameters(obj)?;
    match obj.get("layer_replication") {
        None | Some(Value::Null) => {}
        Some(v) => {
            return Err(fault(
                "layer_replication",
                format!(
                "is not supported (got {}): the runtime folds adapters into the base's own layers",
                json::show(v)
            ),
            ))
        }
    }
    match obj.get("modules_to_save") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(v) => {
            return Err(fault(
                "modules_to_save",
                format!(
                    "is not supported (got {}): fully trained modules are not part of a LoRA merge",
                    json::show(v)
                ),
            ))
        }
    }

    let r = json::opt_usize(obj, "r", "")?.unwrap_or(8);
    if r == 0 {
        return Err(fault("r", "must be positive"));
    }
    let lora_alpha = json::opt_f64(obj, "lora_alpha", "")?.unwrap_or(8.0);
    check_alpha(lora_alpha, "lora_alpha")?;
    let use_rslora = json::opt_bool(obj, "use_rslora", "")?.unwrap_or(false);

    let target_modules = match obj.get("target_modules") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str().map(str::to_owned).ok_or_else(|| {
                    fault(
                        format!("target_modules[{i}]"),
                        format!("must be a string, found {}", json::type_name(v)),
                    )
                })
            })
            .collect::<FieldResult<_>>()?,
        Some(v) => {
            return Err(fault(
                "target_modules",
                format!(
                    "must be a list of strings or a string, found {}",
                    json::type_name(v)
                ),
            ))
        }
    };

    let mut rank_pattern = HashMap::new();
    for (k, v) in pattern_map(obj, "rank_pattern")? {
        let field = format!("rank_pattern.{k}");
        let rank = json::as_usize(v, &field)?;
        if rank == 0 {
            return Err(fault(field, "must be positive"));
        }
        rank_pattern.insert(k.clone(), rank);
    }
    let mut alpha_pattern = HashMap::new();
    for (k, v) in pattern_map(obj, "alpha_pattern")? {
        let alpha = v.as_f64().ok_or_else(|| {
            fault(
                format!("alpha_pattern.{k}"),
                format!("must be a number, found {}", json::type_name(v)),
            )
        })?;
        check_alpha(alpha, &format!("alpha_pattern.{k}"))?;
        alpha_pattern.insert(k.clone(), alpha);
    }

    let trainable_token_indices = match obj.get("trainable_token_indices") {
        None | Some(Value::Null) => Vec::new(),
        Some(v @ Value::Array(_)) => token_ids(v, "trainable_token_indices")?,
        Some(Value::Object(m)) => {
            let mut ids = Vec::new();
            for (k, v) in m {
                let field = format!("trainable_token_indices.{k}");
                if !suffix_matches(k, "embed_tokens") {
                    return Err(fault(
                        field,
                        "only `embed_tokens` is supported for trained token embeddings",
                    ));
                }
                ids.extend(token_ids(v, &field)?);
            }
            ids
        }
        Some(v) => {
            return Err(fault(
                "trainable_token_indices",
                format!(
                "must be a list of token ids or an object `{{\"embed_tokens\": [...]}}`, found {}",
                json::type_name(v)
            ),
            ))
        }
    };

    let layers_to_transform = match obj.get("layers_to_transform") {
        None | Some(Value::Null) => None,
        Some(v @ Value::Number(_)) => Some(vec![json::as_usize(v, "layers_to_transform")?]),
        Some(Value::Array(a)) => Some(
            a.iter()
                .enumerate()
                .map(|(i, v)| json::as_usize(v, &format!("layers_to_transform[{i}]")))
                .collect::<FieldResult<_>>()?,
        ),
        Some(v) => {
            return Err(fault(
                "layers_to_transform",
                format!(
                    "must be a layer index or a list of them, found {}",
                    json::type_name(v)
                ),
            ))
        }
    };

    let mut seen = std::collections::BTreeSet::new();
    if let Some(dup) = trainable_token_indices.iter().find(|id| !seen.insert(**id)) {
        return Err(fault(
            "trainable_token_indices",
            format!("lists token id {dup} twice: its trained row would be ambiguous"),
        ));
    }

    let patterns = !rank_pattern.is_empty() || !alpha_pattern.is_empty();
    if !target_parameters.is_empty() && patterns {
        return Err(fault(
            "target_parameters",
            "with `rank_pattern` or `alpha_pattern` is not supported: the experts' rank would be ambiguous",
        ));
    }

    Ok(AdapterConfig {
        r,
        lora_alpha,
        use_rslora,
        target_modules,
        rank_pattern,
        alpha_pattern,
        trainable_token_indices,
        layers_to_transform,
        target_parameters,
    })
}

/// `target_parameters`: each entry a MoE layer's fused routed experts' `gate_up_proj` or
/// `down_proj` (`mlp.experts.gate_up_proj`, `experts.down_proj` or the bare name), each at
/// most once; anything else PEFT could wrap is refused, naming the entry.
fn expert_parameters(obj: &Map<String, Value>) -> FieldResult<Vec<String>> {
    let entries = match obj.get("target_parameters") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(v) => {
            return Err(fault(
                "target_parameters",
                format!("must be a list of strings, found {}", json::type_name(v)),
            ))
        }
    };
    let mut params: Vec<String> = Vec::new();
    for (i, v) in entries.iter().enumerate() {
        let field = format!("target_parameters[{i}]");
        let Some(entry) = v.as_str() else {
            return Err(fault(
                field,
                format!("must be a string, found {}", json::type_name(v)),
            ));
        };
        let param = ["gate_up_proj", "down_proj"]
            .into_iter()
            .find(|p| entry == *p || suffix_matches(entry, &format!("experts.{p}")));
        let Some(param) = param else {
            return Err(fault(
                field,
                format!("`{entry}` is not supported: only a MoE layer's fused routed experts (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) are folded"),
            ));
        };
        if params.iter().any(|p| p == param) {
            return Err(fault(field, format!("names `{param}` twice")));
        }
        params.push(param.to_string());
    }
    Ok(params)
}

/// Alpha scales every merged delta: it must be finite (a huge one overflows the folded weights,
/// which the loader also checks).
fn check_alpha(alpha: f64, field: &str) -> FieldResult<()> {
    if alpha.is_finite() {
        Ok(())
    } else {
        Err(fault(field, format!("must be finite, got {alpha}")))
    }
}

/// An optional object (absent or null: empty).
fn pattern_map<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
) -> FieldResult<Vec<(&'a String, &'a Value)>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Object(m)) => Ok(m.iter().collect()),
        Some(v) => Err(fault(
            key,
            format!("must be an object, found {}", json::type_name(v)),
        )),
    }
}

fn token_ids(v: &Value, field: &str) -> FieldResult<Vec<u32>> {
    let Value::Array(a) = v else {
        return Err(fault(
            field,
            format!("must be a list of token ids, found {}", json::type_name(v)),
        ));
    };
    a.iter()
        .enumerate()
        .map(|(i, id)| {
            id.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    fault(
                        format!("{field}[{i}]"),
                        format!("must be a token id, found {}", json::show(id)),
                    )
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trimmed PEFT 0.21 config, as `save_pretrained` writes it.
    const PEFT: &str = r#"{
      "alpha_pattern": {}, "auto_mapping": null, "base_model_name_or_path": "Qwen/Qwen3.5-0.8B",
      "bias": "none", "fan_in_fan_out": false, "inference_mode": true, "init_lora_weights": true,
      "layers_to_transform": null, "lora_alpha": 32, "lora_bias": false, "lora_dropout": 0.05,
      "modules_to_save": null, "peft_type": "LORA", "r": 16, "rank_pattern": {},
      "target_modules": ["q_proj", "v_proj", "in_proj_qkv"], "task_type": null,
      "trainable_token_indices": {"embed_tokens": [151669, 151670]},
      "use_dora": false, "use_rslora": false}"#;

    fn load(text: &str) -> Result<AdapterConfig> {
        AdapterConfig::from_json_str(text, Path::new("ad/adapter_config.json"))
    }

    fn with(key: &str, value: &str) -> String {
        let mut v: Value = serde_json::from_str(PEFT).unwrap();
        v[key] = serde_json::from_str(value).unwrap();
        v.to_string()
    }

    fn config_field(r: Result<AdapterConfig>) -> String {
        match r {
            Err(e @ Error::Config { .. }) => {
                let msg = e.to_string();
                assert!(
                    msg.starts_with("`ad/adapter_config.json`: field `"),
                    "{msg}"
                );
                let Error::Config { field, .. } = e else {
                    unreachable!()
                };
                field
            }
            other => panic!("expected Error::Config, got {other:?}"),
        }
    }

    #[test]
    fn parses_peft_config() {
        let c = load(PEFT).unwrap();
        assert_eq!(c.r, 16);
        assert_eq!(c.lora_alpha, 32.0);
        assert!(!c.use_rslora);
        assert_eq!(c.target_modules, vec!["q_proj", "v_proj", "in_proj_qkv"]);
        assert_eq!(c.trainable_token_indices, vec![151669, 151670]);
        assert_eq!(c.scaling("layers.0.self_attn.q_proj"), 2.0);
    }

    #[test]
    fn trainable_tokens_as_list_absent_or_null() {
        assert_eq!(
            load(&with("trainable_token_indices", "[5, 6]"))
                .unwrap()
                .trainable_token_indices,
            vec![5, 6]
        );
        assert!(load(&with("trainable_token_indices", "null"))
            .unwrap()
            .trainable_token_indices
            .is_empty());
        let mut v: Value = serde_json::from_str(PEFT).unwrap();
        v.as_object_mut().unwrap().remove("trainable_token_indices");
        assert!(load(&v.to_string())
            .unwrap()
            .trainable_token_indices
            .is_empty());
        let c = load(&with(
            "trainable_token_indices",
            r#"{"model.embed_tokens": [1]}"#,
        ))
        .unwrap();
        assert_eq!(c.trainable_token_indices, vec![1]);
    }

    #[test]
    fn trainable_tokens_other_module_is_refused() {
        let field = config_field(load(&with(
            "trainable_token_indices",
            r#"{"lm_head": [1]}"#,
        )));
        assert_eq!(field, "trainable_token_indices.lm_head");
        let field = config_field(load(&with("trainable_token_indices", "[1, -2]")));
        assert_eq!(field, "trainable_token_indices[1]");
        let field = config_field(load(&with("trainable_token_indices", "3")));
        assert_eq!(field, "trainable_token_indices");
    }

    #[test]
    fn target_modules_as_regex_string() {
        let c = load(&with("target_modules", r#"".*\\.(q_proj|v_proj)""#)).unwrap();
        assert_eq!(c.target_modules, vec![r".*\.(q_proj|v_proj)"]);
        assert_eq!(
            config_field(load(&with("target_modules", "[1]"))),
            "target_modules[0]"
        );
    }

    #[test]
    fn rslora_scaling() {
        let c = load(&with("use_rslora", "true")).unwrap();
        assert_eq!(c.scaling("layers.1.mlp.up_proj"), 32.0 / 4.0);
    }

    #[test]
    fn rank_and_alpha_patterns() {
        let text = with(
            "rank_pattern",
            r#"{"q_proj": 4, "layers.3.self_attn.q_proj": 64}"#,
        );
        let mut v: Value = serde_json::from_str(&text).unwrap();
        v["alpha_pattern"] = serde_json::json!({"v_proj": 8});
        let c = load(&v.to_string()).unwrap();
        assert_eq!(c.rank("layers.0.self_attn.q_proj"), 4);
        assert_eq!(c.scaling("layers.0.self_attn.q_proj"), 32.0 / 4.0);
        // Longest matching key wins.
        assert_eq!(c.rank("model.layers.3.self_attn.q_proj"), 64);
        // A suffix must start at a dot: `xq_proj` is not `q_proj`.
        assert_eq!(c.rank("layers.0.self_attn.xq_proj"), 16);
        assert_eq!(c.scaling("layers.0.self_attn.v_proj"), 8.0 / 16.0);
        assert_eq!(c.scaling("layers.0.mlp.down_proj"), 2.0);
    }

    #[test]
    fn rank_pattern_errors() {
        assert_eq!(
            config_field(load(&with("rank_pattern", r#"{"q_proj": 0}"#))),
            "rank_pattern.q_proj"
        );
        assert_eq!(
            config_field(load(&with("alpha_pattern", r#"{"q_proj": "x"}"#))),
            "alpha_pattern.q_proj"
        );
        assert_eq!(
            config_field(load(&with("rank_pattern", "[]"))),
            "rank_pattern"
        );
    }

    #[test]
    fn unsupported_settings_are_refused() {
        assert_eq!(
            config_field(load(&with("peft_type", r#""IA3""#))),
            "peft_type"
        );
        assert_eq!(config_field(load(&with("bias", r#""all""#))), "bias");
        assert_eq!(
            config_field(load(&with("fan_in_fan_out", "true"))),
            "fan_in_fan_out"
        );
        assert_eq!(config_field(load(&with("use_dora", "true"))), "use_dora");
        assert_eq!(config_field(load(&with("lora_bias", "true"))), "lora_bias");
        assert_eq!(
            config_field(load(&with("modules_to_save", r#"["score"]"#))),
            "modules_to_save"
        );
        assert!(load(&with("modules_to_save", "[]")).is_ok());
        assert_eq!(config_field(load(&with("r", "0"))), "r");
        assert_eq!(config_field(load(&with("r", "2.5"))), "r");
        assert_eq!(
            config_field(load(&with("lora_alpha", r#""x""#))),
            "lora_alpha"
        );
    }

    #[test]
    fn layers_to_transform_as_index_list_or_null() {
        assert_eq!(load(PEFT).unwrap().layers_to_transform, None);
        let c = load(&with("layers_to_transform", "[0, 3]")).unwrap();
        assert_eq!(c.layers_to_transform, Some(vec![0, 3]));
        let c = load(&with("layers_to_transform", "2")).unwrap();
        assert_eq!(c.layers_to_transform, Some(vec![2]));
        assert_eq!(
            config_field(load(&with("layers_to_transform", "[1, -1]"))),
            "layers_to_transform[1]"
        );
    }

    #[test]
    fn unsupported_peft_variants_are_refused() {
        assert_eq!(
            config_field(load(&with("use_qalora", "true"))),
            "use_qalora"
        );
        assert_eq!(
            config_field(load(&with("use_bdlora", "true"))),
            "use_bdlora"
        );
        assert_eq!(
            config_field(load(&with("alora_invocation_tokens", "[5]"))),
            "alora_invocation_tokens"
        );
        assert_eq!(
            config_field(load(&with("target_parameters", r#"["mlp.experts"]"#))),
            "target_parameters[0]"
        );
        assert_eq!(
            config_field(load(&with(
                "target_parameters",
                r#"["mlp.experts.down_proj", "experts.down_proj"]"#
            ))),
            "target_parameters[1]"
        );
        assert_eq!(
            config_field(load(&with("target_parameters", r#"{"a": 1}"#))),
            "target_parameters"
        );
        let c = load(&with(
            "target_parameters",
            r#"["mlp.experts.gate_up_proj", "down_proj"]"#,
        ))
        .unwrap();
        assert_eq!(c.target_parameters, ["gate_up_proj", "down_proj"]);
        let mut v: Value = serde_json::from_str(PEFT).unwrap();
        v["target_parameters"] = serde_json::json!(["down_proj"]);
        v["rank_pattern"] = serde_json::json!({"q_proj": 4});
        assert_eq!(config_field(load(&v.to_string())), "target_parameters");
        assert!(load(&with("alora_invocation_tokens", "null")).is_ok());
        assert_eq!(
            config_field(load(&with("trainable_token_indices", "[3, 3]"))),
            "trainable_token_indices"
        );
    }

    #[test]
    fn duplicate_keys_and_bom() {
        let dup = PEFT.replacen(r#""r": 16,"#, r#""r": 16, "r": 4,"#, 1);
        match load(&dup) {
            Err(e @ Error::Json { .. }) => {
                let src = std::error::Error::source(&e).unwrap().to_string();
                assert!(src.contains("duplicate key `r`"), "{src}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(load(&format!("\u{feff}{PEFT}")).unwrap().r, 16);
    }

    #[test]
    fn not_json_and_missing_file() {
        assert!(matches!(load("{"), Err(Error::Json { .. })));
        let missing = std::env::temp_dir().join("kev-core-no-such-dir/adapter_config.json");
        assert!(
            matches!(AdapterConfig::load(&missing), Err(Error::Io { path, .. }) if path == missing)
        );
    }
}
