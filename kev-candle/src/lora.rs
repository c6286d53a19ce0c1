//! Folding a PEFT LoRA adapter into the base weights (docs/CONTRACT.md §5).
//!
//! The merge happens once, at load, on the CPU in f32: `W' = W + (B·A)·s·lora_scale`, with `s`
//! from `adapter_config.json` (`alpha/r`, or `alpha/√r` with rsLoRA), and the result is rounded
//! once to the backbone dtype by the caller. Trained token embeddings
//! (`trainable_token_indices`) replace rows: `row' = (1 − s)·row + s·new_row`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use kev_core::{AdapterConfig, Error, Result};

/// Key prefixes PEFT writes, longest first: the text model wrapped directly, a causal-LM wrapper,
/// and the multimodal wrapper.
const PREFIXES: [&str; 3] = [
    "base_model.model.model.language_model.",
    "base_model.model.model.",
    "base_model.model.",
];

/// Where PEFT 0.21 stores the new rows of `trainable_token_indices` (relative to the text model).
const TOKENS_KEY: &str = "embed_tokens.token_adapter.trainable_tokens_delta";

/// One LoRA pair, f32 on the CPU.
struct LoraPair {
    a: Tensor,
    b: Tensor,
    scaling: f64,
}

/// A loaded adapter: LoRA pairs by base weight name (text-model relative, e.g.
/// `layers.0.mlp.up_proj.weight`) and the trained token rows.
pub struct Adapter {
    path: PathBuf,
    pairs: HashMap<String, LoraPair>,
    tokens: Option<(Vec<u32>, Tensor)>,
}

fn tensor_err(name: &str, message: impl Into<String>) -> Error {
    Error::Tensor {
        name: name.to_string(),
        message: message.into(),
    }
}

impl Adapter {
    /// Reads `adapter_config.json` and `adapter_model.safetensors`.
    ///
    /// Every problem found is reported, in one error and in the order of the tensor names (so the
    /// same broken adapter is always blamed on the same tensors): a key that matches no base
    /// weight, a lone `lora_A` or `lora_B`, shapes that do not agree with the configured rank,
    /// a module outside `layers_to_transform` or `target_modules`, a target module with no
    /// tensors, and an adapter with no tensors at all.
    pub fn load(config_path: &Path, weights_path: &Path) -> Result<Self> {
        let config = AdapterConfig::load(config_path)?;
        crate::safetensors_header::check_header(weights_path)?;
        let tensors = candle_core::safetensors::load(weights_path, &Device::Cpu)
            .map_err(|e| Error::backend(format!("reading `{}`", weights_path.display()), e))?;
        let tensors: BTreeMap<String, Tensor> = tensors.into_iter().collect();
        let file = weights_path.display();
        let mut errors = Vec::new();
        let mut halves: BTreeMap<String, (Option<Tensor>, Option<Tensor>)> = BTreeMap::new();
        let mut tokens = None;
        for (key, tensor) in tensors {
            let Some(rest) = PREFIXES.iter().find_map(|p| {
                key.strip_prefix(p)
                    .filter(|r| r.starts_with("layers.") || r.starts_with("embed_tokens."))
            }) else {
                errors.push(tensor_err(
                    &key,
                    format!("adapter tensor in `{file}` matches no base weight (unknown prefix)"),
                ));
                continue;
            };
            let tensor = tensor
                .to_dtype(DType::F32)
                .map_err(|e| Error::backend(format!("adapter tensor `{key}`"), e))?;
            if rest == TOKENS_KEY {
                let ids = &config.trainable_token_indices;
                let dims = tensor.dims().to_vec();
                if ids.is_empty() || dims.len() != 2 || dims[0] != ids.len() {
                    errors.push(tensor_err(&key, format!("shape {dims:?} does not match the {} `trainable_token_indices` of the adapter config", ids.len())));
                } else {
                    tokens = Some((ids.clone(), tensor));
                }
            } else if let Some(module) = rest.strip_suffix(".lora_A.weight") {
                halves.entry(module.to_string()).or_default().0 = Some(tensor);
            } else if let Some(module) = rest.strip_suffix(".lora_B.weight") {
                halves.entry(module.to_string()).or_default().1 = Some(tensor);
            } else {
                errors.push(tensor_err(
                    &key,
                    "adapter tensor is neither `lora_A`, `lora_B` nor trained token rows",
                ));
            }
        }
        if tokens.is_none() && !config.trainable_token_indices.is_empty() {
            errors.push(Error::Adapter {
                path: weights_path.to_path_buf(),
                message: format!(
                    "the config lists `trainable_token_indices` but `{TOKENS_KEY}` is missing"
                ),
            });
        }
        let mut pairs = HashMap::new();
        for (module, (a, b)) in halves {
            let (Some(a), Some(b)) = (a, b) else {
                errors.push(tensor_err(
                    &module,
                    "LoRA module has only one of `lora_A` / `lora_B`",
                ));
                continue;
            };
            if let Some(problem) = module_problem(&config, &module, &a, &b) {
                errors.push(tensor_err(&module, problem));
                continue;
            }
            pairs.insert(
                format!("{module}.weight"),
                LoraPair {
                    a,
                    b,
                    scaling: config.scaling(&module),
                },
            );
        }
        errors.extend(uncovered_targets(&config, &pairs, weights_path));
        if pairs.is_empty() && tokens.is_none() && errors.is_empty() {
            errors.push(Error::Adapter {
                path: weights_path.to_path_buf(),
                message: format!(
                    "holds no LoRA tensors, but its config targets {:?}",
                    config.target_modules
                ),
            });
        }
        Error::from_all(errors)?;
        Ok(Self {
            path: weights_path.to_path_buf(),
            pairs,
            tokens,
        })
    }

    /// The base weight names this adapter modifies (for the up-front coverage check).
    pub fn targets(&self) -> impl Iterator<Item = &str> {
        self.pairs.keys().map(String::as_str)
    }

    /// The adapter file, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the adapter changes base weight `name`.
    pub fn touches(&self, name: &str) -> bool {
        self.pairs.contains_key(name) || (name == "embed_tokens.weight" && self.tokens.is_some())
    }

    /// Applies the adapter to base weight `name` (f32, CPU) with interpolation `lora_scale`.
    pub fn apply(&self, name: &str, weight: Tensor, lora_scale: f64) -> Result<Tensor> {
        let ctx = |e| Error::backend(format!("merging the adapter into `{name}`"), e);
        if let Some(pair) = self.pairs.get(name) {
            let (out_f, in_f) = weight.dims2().map_err(ctx)?;
            if pair.b.dims()[0] != out_f || pair.a.dims()[1] != in_f {
                return Err(tensor_err(
                    name,
                    format!(
                        "LoRA A {:?} · B {:?} does not fit base weight [{out_f}, {in_f}]",
                        pair.a.dims(),
                        pair.b.dims()
                    ),
                ));
            }
            let delta = pair.b.matmul(&pair.a).map_err(ctx)?;
            return (weight + (delta * (pair.scaling * lora_scale)).map_err(ctx)?).map_err(ctx);
        }
        if name == "embed_tokens.weight" {
            if let Some((ids, rows)) = &self.tokens {
                return replace_rows(name, weight, ids, rows, lora_scale);
            }
        }
        Ok(weight)
    }
}

/// What is wrong with one LoRA pair, if anything: its shapes against the configured rank, its
/// layer against `layers_to_transform`, its name against a list of `target_modules`.
fn module_problem(config: &AdapterConfig, module: &str, a: &Tensor, b: &Tensor) -> Option<String> {
    let r = config.rank(module);
    if a.rank() != 2 || b.rank() != 2 || a.dims()[0] != r || b.dims()[1] != r {
        return Some(format!(
            "LoRA shapes A {:?}, B {:?} do not agree with rank {r} (A must be [{r}, in], B [out, {r}])",
            a.dims(),
            b.dims()
        ));
    }
    if let Some(layers) = &config.layers_to_transform {
        match layer_of(module) {
            Some(l) if layers.contains(&l) => {}
            _ => {
                return Some(format!(
                    "is outside `layers_to_transform` {layers:?} of the adapter config"
                ))
            }
        }
    }
    if !targets_are_regex(config) && !config.target_modules.is_empty() {
        let name = module.rsplit('.').next().unwrap_or(module);
        if !config
            .target_modules
            .iter()
            .any(|t| t == name || suffix_of(module, t))
        {
            return Some(format!(
                "is not among `target_modules` {:?} of the adapter config",
                config.target_modules
            ));
        }
    }
    None
}

/// PEFT's `target_modules` is either a list of names or one string holding a regular expression,
/// which this runtime does not evaluate (the adapter's tensors then decide).
fn targets_are_regex(config: &AdapterConfig) -> bool {
    config.target_modules.len() == 1
        && config.target_modules[0].contains(|c: char| "\\^$*+?()[]{}|".contains(c))
}

fn suffix_of(module: &str, target: &str) -> bool {
    module.ends_with(target) && module[..module.len() - target.len()].ends_with('.')
}

/// `layers.<n>.…` → n.
fn layer_of(module: &str) -> Option<usize> {
    module
        .strip_prefix("layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// A listed target module with no LoRA pair at all: the adapter file lost tensors.
fn uncovered_targets(
    config: &AdapterConfig,
    pairs: &HashMap<String, LoraPair>,
    path: &Path,
) -> Vec<Error> {
    if targets_are_regex(config) {
        return Vec::new();
    }
    config
        .target_modules
        .iter()
        .filter(|t| {
            !pairs.keys().any(|k| {
                let module = k.strip_suffix(".weight").unwrap_or(k);
                module.rsplit('.').next() == Some(t.as_str()) || suffix_of(module, t)
            })
        })
        .map(|t| Error::Adapter {
            path: path.to_path_buf(),
            message: format!(
                "`target_modules` names `{t}` but the adapter holds no LoRA tensors for it"
            ),
        })
        .collect()
}

fn replace_rows(name: &str, weight: Tensor, ids: &[u32], rows: &Tensor, s: f64) -> Result<Tensor> {
    let ctx = |e| Error::backend(format!("trained token rows of `{name}`"), e);
    let (vocab, hidden) = weight.dims2().map_err(ctx)?;
    if rows.dims() != [ids.len(), hidden] {
        return Err(tensor_err(
            name,
            format!(
                "trained token rows {:?} do not fit embeddings [{vocab}, {hidden}]",
                rows.dims()
            ),
        ));
    }
    let mut table = weight.to_vec2::<f32>().map_err(ctx)?;
    let new_rows = rows.to_vec2::<f32>().map_err(ctx)?;
    for (&id, new_row) in ids.iter().zip(&new_rows) {
        let row = table.get_mut(id as usize).ok_or_else(|| {
            tensor_err(
                name,
                format!("trainable token id {id} is outside the vocabulary of {vocab}"),
            )
        })?;
        for (x, n) in row.iter_mut().zip(new_row) {
            *x = ((1.0 - s) * f64::from(*x) + s * f64::from(*n)) as f32;
        }
    }
    Tensor::new(table, &Device::Cpu).map_err(ctx)
}
