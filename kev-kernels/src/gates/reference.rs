//! The DeltaNet gates with plain tensor ops: the test reference.

use candle_core::{DType, Result, Tensor, D};

/// [`deltanet_gates`](super::deltanet_gates) with plain tensor ops (the test reference).
pub fn deltanet_gates_ref(ba: &Tensor, dt_bias: &Tensor, neg_a: &Tensor) -> Result<Tensor> {
    let hv = dt_bias.elem_count();
    let b = ba.narrow(D::Minus1, 0, hv)?;
    let a = ba.narrow(D::Minus1, hv, hv)?.to_dtype(DType::F32)?;
    let beta = b
        .to_dtype(DType::F32)?
        .neg()?
        .exp()?
        .affine(1.0, 1.0)?
        .recip()?
        .to_dtype(ba.dtype())?
        .to_dtype(DType::F32)?;
    let x = a.broadcast_add(dt_bias)?;
    // softplus(x) = max(x, 0) + log(1 + exp(−|x|)), equal to torch's form within f32 rounding.
    let softplus = (x.relu()? + (x.abs()?.neg()?.exp()? + 1.0)?.log()?)?;
    let g = softplus.broadcast_mul(neg_a)?;
    Tensor::stack(&[&g, &beta], D::Minus1)
}
