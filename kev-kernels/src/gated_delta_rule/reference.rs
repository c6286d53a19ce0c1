//! The gated delta rule with plain tensor ops, one step at a time: the test reference.

use candle_core::{DType, Result, Tensor, D};

use super::op::{check, GdrDims};
use crate::backend::cuda::sources::L2NORM_EPS;

/// The same recurrence with plain tensor ops, one step at a time (the test reference).
/// Returns `(o, new_state)` and leaves `state` untouched; `lengths` is not supported.
pub fn gated_delta_rule_ref(
    qkv: &Tensor,
    gates: &Tensor,
    state: &Tensor,
    dims: GdrDims,
) -> Result<(Tensor, Tensor)> {
    let (b_sz, seq_len) = check(qkv, gates, state, dims, None)?;
    let GdrDims {
        num_k_heads: hk,
        num_v_heads: hv,
        head_k_dim: dk,
        head_v_dim: dv,
    } = dims;
    let x = qkv.to_dtype(DType::F32)?;
    let l2 = |t: Tensor| -> Result<Tensor> {
        let n = (t.sqr()?.sum_keepdim(D::Minus1)? + L2NORM_EPS as f64)?.sqrt()?;
        t.broadcast_div(&n)
    };
    let group = hv / hk;
    let expand = |t: Tensor| -> Result<Tensor> {
        // [B, T, Hk, Dk] -> [B, T, Hv, Dk], value head h reading key head h / group.
        t.unsqueeze(3)?
            .repeat((1, 1, 1, group, 1))?
            .reshape((b_sz, seq_len, hv, dk))
    };
    let q = expand(
        (l2(x.narrow(2, 0, hk * dk)?.reshape((b_sz, seq_len, hk, dk))?)? / (dk as f64).sqrt())?,
    )?;
    let k = expand(l2(x
        .narrow(2, hk * dk, hk * dk)?
        .reshape((b_sz, seq_len, hk, dk))?)?)?;
    let v = x
        .narrow(2, 2 * hk * dk, hv * dv)?
        .reshape((b_sz, seq_len, hv, dv))?;
    let mut s = state.clone();
    let mut outs = Vec::with_capacity(seq_len);
    for t in 0..seq_len {
        let step = |x: &Tensor| x.narrow(1, t, 1).and_then(|x| x.squeeze(1));
        let (q_t, k_t, v_t) = (step(&q)?, step(&k)?, step(&v)?);
        let gb_t = step(gates)?;
        let decay = gb_t.narrow(D::Minus1, 0, 1)?.exp()?.unsqueeze(D::Minus1)?; // [B,Hv,1,1]
        let beta = gb_t.narrow(D::Minus1, 1, 1)?; // [B,Hv,1]
        s = s.broadcast_mul(&decay)?;
        let kv = s.broadcast_mul(&k_t.unsqueeze(D::Minus1)?)?.sum(2)?; // [B,Hv,Dv]
        let delta = (v_t - kv)?.broadcast_mul(&beta)?;
        s = (s + k_t
            .unsqueeze(D::Minus1)?
            .broadcast_mul(&delta.unsqueeze(2)?)?)?;
        outs.push(s.broadcast_mul(&q_t.unsqueeze(D::Minus1)?)?.sum(2)?);
    }
    let o = Tensor::stack(&outs, 1)?.to_dtype(qkv.dtype())?;
    Ok((o, s))
}
