//! The two RMSNorms of Qwen3.5 (QWEN35.md §10 pitfall 1).

use candle_core::{DType, Result, Tensor, D};

/// `x̂ · (1 + w)` computed in f32 and cast back: the input, post-attention, final and q/k norms.
/// The checkpoint stores `w` zero-centred; forming `1 + w` in the weight dtype would round it.
pub struct ZeroCenteredRmsNorm {
    one_plus_w: Tensor,
    eps: f64,
}

impl ZeroCenteredRmsNorm {
    /// `weight` in the backbone dtype (as HF holds it), `[dim]`.
    pub fn new(weight: &Tensor, eps: f64) -> Result<Self> {
        Ok(Self {
            one_plus_w: (weight.to_dtype(DType::F32)? + 1.0)?,
            eps,
        })
    }

    /// Normalises over the last dim.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let x = xs.to_dtype(DType::F32)?;
        let x = rms_normalize(&x, self.eps)?;
        x.broadcast_mul(&self.one_plus_w)?.to_dtype(xs.dtype())
    }
}

/// `x / sqrt(mean(x²) + eps)` over the last dim (f32 in, f32 out).
pub fn rms_normalize(x: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)
}

/// The DeltaNet output norm: per value head, `w · x̂` (plain weight, in the activation dtype)
/// then times `silu(z)` in f32, as HF's `Qwen3_5RMSNormGated`.
pub struct GatedRmsNorm {
    weight: Tensor,
    eps: f64,
}

impl GatedRmsNorm {
    /// `weight`: `[Dv]` in the backbone dtype.
    pub fn new(weight: Tensor, eps: f64) -> Self {
        Self { weight, eps }
    }

    /// `xs`, `z`: `[.., Dv]` in the backbone dtype; returns the same shape and dtype.
    pub fn forward(&self, xs: &Tensor, z: &Tensor) -> Result<Tensor> {
        let dtype = xs.dtype();
        let x = rms_normalize(&xs.to_dtype(DType::F32)?, self.eps)?.to_dtype(dtype)?;
        let x = x.broadcast_mul(&self.weight)?.to_dtype(DType::F32)?;
        let z = z.to_dtype(DType::F32)?;
        (x * candle_nn::ops::silu(&z)?)?.to_dtype(dtype)
    }
}
