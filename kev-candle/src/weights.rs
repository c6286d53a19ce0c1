//! Reading the base weights: mmap'd safetensors (one file or shards), either checkpoint layout,
//! LoRA folded in at load, converted once to the backbone dtype and moved to the device.

use std::path::PathBuf;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use kev_core::{Error, Result};

use crate::lora::Adapter;

/// Prefixes of the text model in the published multimodal layout and the text-only layout.
const LAYOUTS: [&str; 2] = ["model.language_model.", "model."];

/// The base checkpoint's tensors with an optional adapter to fold in.
pub struct Weights {
    files: Vec<PathBuf>,
    st: MmapedSafetensors,
    prefix: &'static str,
    adapter: Option<Adapter>,
    lora_scale: f64,
    dtype: DType,
    /// The dtype of the projections' weights and the embedding table (`dtype` unless set).
    projections: DType,
    device: Device,
}

impl Weights {
    /// Maps the safetensors `files`, detects the layout, and checks that every adapter target
    /// exists in the base.
    pub fn open(
        files: &[PathBuf],
        adapter: Option<Adapter>,
        lora_scale: f64,
        dtype: DType,
        device: Device,
    ) -> Result<Self> {
        // SAFETY: the files are mapped read-only; like every mmap-based loader, we rely on them not
        // being truncated while the model is loading (weights are copied out during `get`).
        let st = unsafe { MmapedSafetensors::multi(files) }
            .map_err(|e| Error::backend(format!("reading safetensors {}", list(files)), e))?;
        let names: Vec<String> = st.tensors().into_iter().map(|(n, _)| n).collect();
        let prefix = LAYOUTS
            .into_iter()
            .find(|p| names.iter().any(|n| n.starts_with(p) && n.ends_with("embed_tokens.weight")))
            .ok_or_else(|| {
                // mlx-lm conversions rename the tree and fold +1 into the zero-centred norms.
                let mlx = names.iter().any(|n| n.starts_with("language_model.model."));
                Error::Tensor {
                    name: "model.language_model.embed_tokens.weight".into(),
                    message: if mlx {
                        format!("{} is an mlx-community conversion (norm weights with +1 folded in), not the Hugging Face format: use the original checkpoint", list(files))
                    } else {
                        format!("not found in {} (nor `model.embed_tokens.weight`): not a Qwen3.5 checkpoint", list(files))
                    },
                }
            })?;
        let weights = Self {
            files: files.to_vec(),
            st,
            prefix,
            adapter,
            lora_scale,
            dtype,
            projections: dtype,
            device,
        };
        if let Some(adapter) = &weights.adapter {
            for target in adapter.targets() {
                weights
                    .st
                    .get(&format!("{prefix}{target}"))
                    .map_err(|_| Error::Tensor {
                        name: target.to_string(),
                        message: format!(
                            "adapter `{}` modifies a weight the base does not have",
                            adapter.path().display()
                        ),
                    })?;
            }
        }
        Ok(weights)
    }

    /// The backbone dtype weights are converted to.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Keeps the projections' weights and the embedding table in `dtype` instead of the
    /// backbone's (the CPU's bf16 mode: bf16 weights, f32 activations).
    pub fn with_projection_dtype(mut self, dtype: DType) -> Self {
        self.projections = dtype;
        self
    }

    /// The dtype of the projections' weights and the embedding table.
    pub fn projection_dtype(&self) -> DType {
        self.projections
    }

    /// The device weights are moved to.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Text-model tensor `name` (e.g. `layers.0.mlp.up_proj.weight`) with `shape`, adapter folded
    /// in (f32, CPU), rounded once to the backbone dtype, on the device.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.get_as(name, shape, self.dtype)
    }

    /// Like [`Weights::get`] but in `dtype` (for the few tensors kept in f32).
    pub fn get_as(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let stored = self.stored(name)?;
        if stored.dims() != shape {
            return Err(Error::Tensor {
                name: format!("{}{name}", self.prefix),
                message: format!("expected shape {shape:?}, found {:?}", stored.dims()),
            });
        }
        // Only tensors the adapter changes are widened to f32 for the merge; the others go
        // straight to their dtype (the same values: bf16 → f32 is exact, f32 → bf16 rounds once).
        let w = match &self.adapter {
            Some(adapter) if adapter.touches(name) => {
                let w = stored.to_dtype(DType::F32).map_err(|e| self.err(name, e))?;
                adapter.apply(name, w, self.lora_scale)?
            }
            _ => stored,
        };
        w.to_dtype(dtype)
            .and_then(|w| w.to_device(&self.device))
            .map_err(|e| self.err(name, e))
    }

    /// The stored tensor, in its stored dtype, on the CPU.
    fn stored(&self, name: &str) -> Result<Tensor> {
        let full = format!("{}{name}", self.prefix);
        self.st
            .load(&full, &Device::Cpu)
            .map_err(|_| Error::Tensor {
                name: full.clone(),
                message: format!("missing from {}", list(&self.files)),
            })
    }

    fn err(&self, name: &str, e: candle_core::Error) -> Error {
        Error::backend(format!("loading tensor `{}{name}`", self.prefix), e)
    }
}

fn list(files: &[PathBuf]) -> String {
    let names: Vec<String> = files.iter().map(|f| format!("`{}`", f.display())).collect();
    names.join(", ")
}
