//! The norms with plain tensor ops: the test reference.

use candle_core::{DType, Result, Tensor, D};

/// `x / sqrt(mean(x²) + eps)` over the last dim (f32 in, f32 out).
fn normalize(x: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)
}

/// [`rms_norm`](super::rms_norm) with plain tensor ops (the test reference).
pub fn rms_norm_ref(x: &Tensor, w1: &Tensor, eps: f64) -> Result<Tensor> {
    let n = normalize(&x.to_dtype(DType::F32)?, eps)?;
    n.broadcast_mul(&w1.to_dtype(DType::F32)?)?
        .to_dtype(x.dtype())
}

/// [`gated_rms_norm`](super::gated_rms_norm) with plain tensor ops (the test reference).
pub fn gated_rms_norm_ref(x: &Tensor, z: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let n = normalize(&x.to_dtype(DType::F32)?, eps)?.to_dtype(dtype)?;
    let n = n.broadcast_mul(w)?.to_dtype(DType::F32)?;
    let z = z.reshape(x.shape())?.to_dtype(DType::F32)?;
    let silu = (&z / (z.neg()?.exp()? + 1.0)?)?;
    (n * silu)?.to_dtype(dtype)
}
