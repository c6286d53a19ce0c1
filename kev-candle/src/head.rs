//! The pointer head (docs/CONTRACT.md §3), always f32, on the backbone's device:
//! `q = Wq·h_decide + bq`, `k_i = Wk·h_opt_i + bk`, `logit_i = q·k_i / (√dim · temperature)`.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use kev_core::{Error, Result};
use kev_kernels::dispatch::CountedTensor;
use kev_kernels::RowIndex;

/// The head's weights and settings.
pub struct PointerHead {
    q_weight: Tensor,
    q_bias: Tensor,
    k_weight: Tensor,
    k_bias: Tensor,
    dim: usize,
    temperature: f64,
}

impl PointerHead {
    /// Reads `q.weight [dim, H]`, `q.bias [dim]`, `k.weight [dim, H]`, `k.bias [dim]` from `path`.
    pub fn load(
        path: &Path,
        dim: usize,
        hidden: usize,
        temperature: f64,
        device: &Device,
    ) -> Result<Self> {
        crate::safetensors_header::check_header(path)?;
        let tensors = candle_core::safetensors::load(path, &Device::Cpu)
            .map_err(|e| Error::backend(format!("reading head `{}`", path.display()), e))?;
        let get = |name: &str, shape: &[usize]| -> Result<Tensor> {
            let t = tensors.get(name).ok_or_else(|| Error::Tensor {
                name: name.to_string(),
                message: format!("missing from head `{}`", path.display()),
            })?;
            if t.dims() != shape {
                return Err(Error::Tensor {
                    name: name.to_string(),
                    message: format!("expected shape {shape:?} (head dim {dim}, hidden {hidden}), found {:?} in `{}`", t.dims(), path.display()),
                });
            }
            let ctx = |e| Error::backend(format!("head tensor `{name}`"), e);
            let t = t.to_dtype(DType::F32).map_err(ctx)?;
            // A NaN or infinity here would make every probability NaN: refused at load.
            let values = t
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(ctx)?;
            if let Some(bad) = values.iter().find(|x| !x.is_finite()) {
                return Err(Error::Tensor {
                    name: name.to_string(),
                    message: format!(
                        "holds {bad} in head `{}`: every value must be finite",
                        path.display()
                    ),
                });
            }
            t.to_device(device).map_err(ctx)
        };
        if let Some(extra) = tensors
            .keys()
            .find(|k| !["q.weight", "q.bias", "k.weight", "k.bias"].contains(&k.as_str()))
        {
            return Err(Error::Tensor {
                name: extra.clone(),
                message: format!("unexpected tensor in head `{}`", path.display()),
            });
        }
        Ok(Self {
            q_weight: get("q.weight", &[dim, hidden])?,
            q_bias: get("q.bias", &[dim])?,
            k_weight: get("k.weight", &[dim, hidden])?,
            k_bias: get("k.bias", &[dim])?,
            dim,
            temperature,
        })
    }

    /// The weights by their names in `head.safetensors`: `q.weight [dim, H]`, `q.bias [dim]`,
    /// `k.weight [dim, H]`, `k.bias [dim]` (f32, on the model's device).
    pub fn tensors(&self) -> [(&'static str, &Tensor); 4] {
        [
            ("q.weight", &self.q_weight),
            ("q.bias", &self.q_bias),
            ("k.weight", &self.k_weight),
            ("k.bias", &self.k_bias),
        ]
    }

    /// The projection size.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The softmax temperature.
    pub fn temperature(&self) -> f64 {
        self.temperature
    }

    /// `h_decide: [N, H]` (one per question), `h_opts: [M, H]` (all options), `owner[i]`: the
    /// question of option i, also on the device where `owner_on_device` holds it (a CUDA
    /// graph's input; else uploaded here). Returns the M logits (f32) in option order, on the
    /// device (nothing waits for it, so a CUDA graph can end here).
    pub fn logits_on_device(
        &self,
        h_decide: &Tensor,
        h_opts: &Tensor,
        owner: &[u32],
        owner_on_device: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        self.logits_of_f32(
            &kev_kernels::rows_f32(h_decide, None)?,
            &kev_kernels::rows_f32(h_opts, None)?,
            owner,
            owner_on_device,
        )
    }

    /// [`PointerHead::logits_on_device`] reading its rows from `hidden: [R, H]`: row
    /// `decide[j]` for question j, row `opts[i]` for option i.
    pub fn logits_at(
        &self,
        hidden: &Tensor,
        decide: &RowIndex,
        opts: &RowIndex,
        owner: &[u32],
    ) -> candle_core::Result<Tensor> {
        self.logits_of_f32(
            &kev_kernels::rows_f32(hidden, Some(decide))?,
            &kev_kernels::rows_f32(hidden, Some(opts))?,
            owner,
            None,
        )
    }

    /// The logits from the read rows, already f32.
    fn logits_of_f32(
        &self,
        h_decide: &Tensor,
        h_opts: &Tensor,
        owner: &[u32],
        owner_on_device: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let questions = h_decide.dim(0)?;
        if let Some(bad) = owner.iter().find(|&&o| o as usize >= questions) {
            candle_core::bail!("pointer head: option owned by question {bad} of {questions}")
        }
        let q = h_decide.counted_matmul(&self.q_weight.t()?)?;
        let k = h_opts.counted_matmul(&self.k_weight.t()?)?;
        let owner = match owner_on_device {
            Some(t) if t.dims() == [owner.len()] => t.clone(),
            Some(t) => candle_core::bail!(
                "pointer head: {:?} option owners on the device for {} options",
                t.dims(),
                owner.len()
            ),
            None => kev_kernels::uploads::upload(owner.to_vec(), owner.len(), q.device())?,
        };
        kev_kernels::pointer_logits(
            &q,
            &k,
            &self.q_bias,
            &self.k_bias,
            &owner,
            1.0 / ((self.dim as f64).sqrt() * self.temperature),
        )
    }

    /// [`PointerHead::logits_on_device`], read back.
    pub fn logits(
        &self,
        h_decide: &Tensor,
        h_opts: &Tensor,
        owner: &[u32],
    ) -> candle_core::Result<Vec<f32>> {
        self.logits_on_device(h_decide, h_opts, owner, None)?
            .to_vec1::<f32>()
    }
}

/// Softmax of one question's logits (f64 internally, as stable as torch's f32 softmax).
pub fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f64> = logits.iter().map(|&l| f64::from(l - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.iter().map(|e| (e / sum) as f32).collect()
}
