//! The two RMSNorms of Qwen3.5 (docs/BACKBONE.md §10 pitfall 1), each one kev-kernels op.

use candle_core::{DType, Result, Tensor};

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
            one_plus_w: crate::weights::on_host(weight, |w| w.to_dtype(DType::F32)? + 1.0)?,
            eps,
        })
    }

    /// `1 + w` in f32, for ops that fuse the norm with what follows.
    pub fn one_plus_w(&self) -> &Tensor {
        &self.one_plus_w
    }

    /// Normalises over the last dim.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        kev_kernels::rms_norm(xs, &self.one_plus_w, self.eps)
    }

    /// The residual add `xs + h` (the layer's output stream) and its norm, in one pass.
    pub fn forward_residual(&self, xs: &Tensor, h: &Tensor) -> Result<(Tensor, Tensor)> {
        kev_kernels::add_rms_norm(xs, h, &self.one_plus_w, self.eps)
    }
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

    /// `xs: [.., Hv, Dv]`, `z`: the same elements as `[.., Hv·Dv]`, both in the backbone dtype;
    /// returns the shape and dtype of `xs`.
    pub fn forward(&self, xs: &Tensor, z: &Tensor) -> Result<Tensor> {
        kev_kernels::gated_rms_norm(xs, z, &self.weight, self.eps)
    }
}
