//! Folding a PEFT LoRA adapter into the base weights (KEV.md §5).
//!
//! The merge happens once, at load, on the CPU in f32: `W' = W + (B·A)·s·lora_scale`, with `s`
//! from `adapter_config.json` (`alpha/r`, or `alpha/√r` with rsLoRA), and the result is rounded
//! once to the backbone dtype by the caller. Trained token embeddings
//! (`trainable_token_indices`) replace rows: `row' = (1 − s)·row + s·new_row`.

use std::collections::HashMap;
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
    /// Reads `adapter_config.json` and `adapter_model.safetensors` from `dir`.
    pub fn load(config_path: &Path, weights_path: &Path) -> Result<Self> {
        let config = AdapterConfig::load(config_path)?;
        let tensors = candle_core::safetensors::load(weights_path, &Device::Cpu)
            .map_err(|e| Error::backend(format!("reading `{}`", weights_path.display()), e))?;
        let mut halves: HashMap<String, (Option<Tensor>, Option<Tensor>)> = HashMap::new();
        let mut tokens = None;
        for (key, tensor) in tensors {
            let rest = PREFIXES
                .iter()
                .find_map(|p| {
                    key.strip_prefix(p)
                        .filter(|r| r.starts_with("layers.") || r.starts_with("embed_tokens."))
                })
                .ok_or_else(|| {
                    tensor_err(
                        &key,
                        format!(
                            "adapter tensor in `{}` matches no base weight (unknown prefix)",
                            weights_path.display()
                        ),
                    )
                })?;
            let tensor = tensor
                .to_dtype(DType::F32)
                .map_err(|e| Error::backend(format!("adapter tensor `{key}`"), e))?;
            if rest == TOKENS_KEY {
                let ids = config.trainable_token_indices.clone();
                let dims = tensor.dims().to_vec();
                if ids.is_empty() || dims.len() != 2 || dims[0] != ids.len() {
                    return Err(tensor_err(&key, format!("shape {dims:?} does not match the {} `trainable_token_indices` of the adapter config", ids.len())));
                }
                tokens = Some((ids, tensor));
            } else if let Some(module) = rest.strip_suffix(".lora_A.weight") {
                halves.entry(module.to_string()).or_default().0 = Some(tensor);
            } else if let Some(module) = rest.strip_suffix(".lora_B.weight") {
                halves.entry(module.to_string()).or_default().1 = Some(tensor);
            } else {
                return Err(tensor_err(
                    &key,
                    "adapter tensor is neither `lora_A`, `lora_B` nor trained token rows",
                ));
            }
        }
        if tokens.is_none() && !config.trainable_token_indices.is_empty() {
            return Err(Error::Adapter {
                path: weights_path.to_path_buf(),
                message: format!(
                    "the config lists `trainable_token_indices` but `{TOKENS_KEY}` is missing"
                ),
            });
        }
        let mut pairs = HashMap::new();
        for (module, (a, b)) in halves {
            let (Some(a), Some(b)) = (a, b) else {
                return Err(tensor_err(
                    &module,
                    "LoRA module has only one of `lora_A` / `lora_B`",
                ));
            };
            let r = config.rank(&module);
            let (ra, rb) = (a.dims()[0], b.dims().get(1).copied().unwrap_or(0));
            if a.rank() != 2 || b.rank() != 2 || ra != rb || ra != r {
                return Err(tensor_err(
                    &module,
                    format!(
                        "LoRA shapes A {:?}, B {:?} do not agree with rank {r}",
                        a.dims(),
                        b.dims()
                    ),
                ));
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
