//! The attention steps with plain tensor ops: the test reference.

use candle_core::{DType, Result, Tensor, D};

/// [`qk_norm_rope`](super::qk_norm_rope) with plain tensor ops (the test reference).
pub fn qk_norm_rope_ref(x: &Tensor, w1: &Tensor, cos_sin: &Tensor, eps: f64) -> Result<Tensor> {
    let n = crate::norm::rms_norm_ref(x, w1, eps)?.transpose(1, 2)?; // [B, H, T, hd]
    let (hd, rot) = (n.dim(D::Minus1)?, cos_sin.dim(D::Minus1)?);
    let (cos, sin) = (cos_sin.get(0)?.unsqueeze(1)?, cos_sin.get(1)?.unsqueeze(1)?);
    let part = n.narrow(D::Minus1, 0, rot)?;
    let (x1, x2) = (
        part.narrow(D::Minus1, 0, rot / 2)?,
        part.narrow(D::Minus1, rot / 2, rot / 2)?,
    );
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    let out = (part.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?;
    let out = if rot == hd {
        out
    } else {
        Tensor::cat(&[&out, &n.narrow(D::Minus1, rot, hd - rot)?], D::Minus1)?
    };
    out.contiguous()
}

/// [`causal_softmax`](super::causal_softmax) with plain tensor ops (the test reference). The
/// causal part is built on the device from two index ranges (no `[T, S]` host
/// loop per layer); hidden keys get `f32::MIN`, whose exponential is exactly 0 as −∞'s is.
pub fn causal_softmax_ref(scores: &Tensor, key_bias: &Tensor, scale: f64) -> Result<Tensor> {
    let (_, _, t_len, s_len) = scores.dims4()?;
    let dev = scores.device();
    let keys = Tensor::arange(0u32, s_len as u32, dev)?.reshape((1, s_len))?;
    let last_seen =
        Tensor::arange((s_len - t_len) as u32, s_len as u32, dev)?.reshape((t_len, 1))?;
    let causal = (keys.broadcast_gt(&last_seen)?.to_dtype(DType::F32)? * f64::from(f32::MIN))?;
    let s = (scores * scale)?.to_dtype(DType::F32)?;
    let s = s
        .broadcast_add(&key_bias.unsqueeze(1)?.unsqueeze(1)?)?
        .broadcast_add(&causal)?;
    let max = s.max_keepdim(D::Minus1)?;
    let e = s.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?
        .to_dtype(scores.dtype())
}

/// [`attention_gate`](super::attention_gate) with plain tensor ops (the test reference).
pub fn attention_gate_ref(o: &Tensor, gate: &Tensor) -> Result<Tensor> {
    let (b_sz, heads, t_len, hd) = o.dims4()?;
    let g = gate.to_dtype(DType::F32)?;
    let sig = (g.neg()?.exp()? + 1.0)?.recip()?.to_dtype(o.dtype())?;
    let o = o.transpose(1, 2)?;
    (o * sig)?.reshape((b_sz, t_len, heads * hd))
}
