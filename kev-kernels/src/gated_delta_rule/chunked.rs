//! The chunked (UT/WY) form of the gated delta rule, docs/BACKBONE.md §8.2, written with batched
//! matmuls so the GPU's matrix units do the work instead of a step-by-step scan.
//!
//! Per (row, value head) and chunk of C = 64 steps with state S at the chunk start:
//! ```text
//! γ_r = Σ_{s≤r} g_s,  Γ[r,s] = exp(γ_r − γ_s) for s ≤ r else 0     (masked before exp)
//! L = strict_lower((βK)Kᵀ ⊙ Γ),  T = (I + L)⁻¹
//! U = T(βV),  W = T(βK ⊙ exp(γ))
//! V' = U − W·S
//! O  = (Q ⊙ exp(γ))·S + (QKᵀ ⊙ Γ)·V'                               (Γ with its diagonal)
//! S ← exp(γ_last)·S + (K ⊙ exp(γ_last − γ))ᵀ·V'
//! ```
//! L is strictly lower triangular (L⁶⁴ = 0), so `(I + L)⁻¹ = (I − L)(I + L²)(I + L⁴)…(I + L³²)`:
//! five squarings and products of 64×64 matrices, no triangular solve. Padded steps (past a
//! row's length, and up to a multiple of C) get g = 0, β = 0, q = k = 0: they neither decay nor
//! update the state and output zero.

use candle_core::{DType, Device, Result, Tensor, D};

use super::op::GdrDims;
#[cfg(doc)]
use crate::backend::cuda::sources::CHUNK;
use crate::backend::cuda::sources::L2NORM_EPS;

/// Chunk length of this form (HF, FLA and llama.cpp use 64; the CUDA kernels' chunks are
/// [`CHUNK`] long).
const TENSOR_OP_CHUNK: usize = 64;

/// Same contract as [`crate::gated_delta_rule`]: `state` (`[B, Hv, Dk, Dv]` f32, contiguous) is
/// overwritten with the final state; returns `o: [B, T, Hv, Dv]` in the dtype of `qkv`.
pub fn gated_delta_rule_chunked(
    qkv: &Tensor,
    gates: &Tensor,
    state: &Tensor,
    dims: GdrDims,
    lengths: Option<&[usize]>,
) -> Result<Tensor> {
    let (b_sz, seq_len, _) = qkv.dims3()?;
    let GdrDims {
        num_k_heads: hk,
        num_v_heads: hv,
        head_k_dim: dk,
        head_v_dim: dv,
    } = dims;
    let dev = qkv.device();
    let n = seq_len.div_ceil(TENSOR_OP_CHUNK);
    let padded = n * TENSOR_OP_CHUNK;

    // Steps that count: 1 for real steps, 0 for padding (per row length and up to `padded`).
    let real: Vec<f32> = (0..b_sz)
        .flat_map(|b| {
            let len = lengths.map_or(seq_len, |l| l[b].min(seq_len));
            (0..padded).map(move |t| f32::from(u8::from(t < len)))
        })
        .collect();
    let real = Tensor::from_vec(real, (b_sz, padded), dev)?;

    let x = pad_time(&qkv.to_dtype(DType::F32)?, padded)?; // [B, P, C]
    let gates = pad_time(gates, padded)?; // [B, P, Hv, 2]
    let l2 = |t: Tensor| -> Result<Tensor> {
        let norm = (t.sqr()?.sum_keepdim(D::Minus1)? + f64::from(L2NORM_EPS))?.sqrt()?;
        t.broadcast_div(&norm)
    };
    let group = hv / hk;
    // [B, P, Hk, Dk] -> [B·Hv, N, C, Dk] (value head h reads key head h / group). candle's
    // matmul takes at most two batch dims, hence B·Hv.
    let heads = |t: Tensor, d: usize| -> Result<Tensor> {
        let t = if t.dim(2)? == hv {
            t
        } else {
            t.unsqueeze(3)?
                .repeat((1, 1, 1, group, 1))?
                .reshape((b_sz, padded, hv, d))?
        };
        t.transpose(1, 2)?
            .reshape((b_sz * hv, n, TENSOR_OP_CHUNK, d))?
            .contiguous()
    };
    let mask_steps = real.reshape((b_sz, padded, 1, 1))?;
    let q = l2(x.narrow(2, 0, hk * dk)?.reshape((b_sz, padded, hk, dk))?)?;
    let q = heads((q.broadcast_mul(&mask_steps)? / (dk as f64).sqrt())?, dk)?;
    let k = l2(x
        .narrow(2, hk * dk, hk * dk)?
        .reshape((b_sz, padded, hk, dk))?)?;
    let k = heads(k.broadcast_mul(&mask_steps)?, dk)?;
    let v = heads(
        x.narrow(2, 2 * hk * dk, hv * dv)?
            .reshape((b_sz, padded, hv, dv))?,
        dv,
    )?;
    let step_gate = |i: usize| -> Result<Tensor> {
        // [B, P, Hv] -> [B·Hv, N, C], zero on padding.
        gates
            .narrow(3, i, 1)?
            .squeeze(3)?
            .broadcast_mul(&real.unsqueeze(2)?)?
            .transpose(1, 2)?
            .reshape((b_sz * hv, n, TENSOR_OP_CHUNK))?
            .contiguous()
    };
    let (g, beta) = (step_gate(0)?, step_gate(1)?);

    let gamma = g.cumsum(D::Minus1)?; // [B·Hv, N, C]
    let (lower, strict) = masks(dev)?;
    let diff = gamma
        .unsqueeze(D::Minus1)?
        .broadcast_sub(&gamma.unsqueeze(2)?)?; // γ_r − γ_s
    let decay = diff.broadcast_add(&lower)?.exp()?; // Γ, zero above the diagonal
    let beta_col = beta.unsqueeze(D::Minus1)?;
    let k_beta = k.broadcast_mul(&beta_col)?;
    let l = k_beta
        .matmul(&k.t()?)?
        .mul(&decay)?
        .broadcast_mul(&strict)?;
    let t_inv = unit_lower_inverse(&l)?;
    let u = t_inv.matmul(&v.broadcast_mul(&beta_col)?)?; // [B·Hv, N, C, Dv]
    let w = t_inv.matmul(&k_beta.broadcast_mul(&gamma.exp()?.unsqueeze(D::Minus1)?)?)?;
    let q_decayed = q.broadcast_mul(&gamma.exp()?.unsqueeze(D::Minus1)?)?;
    let qk = q.matmul(&k.t()?)?.mul(&decay)?;
    let last = gamma.narrow(2, TENSOR_OP_CHUNK - 1, 1)?; // [B·Hv, N, 1]
    let k_tail = k.broadcast_mul(&last.broadcast_sub(&gamma)?.exp()?.unsqueeze(D::Minus1)?)?;
    let last_decay = last.exp()?.unsqueeze(D::Minus1)?; // [B·Hv, N, 1, 1]

    // Chunk-major copies, so each chunk's operands are contiguous slices (`get(c)`): the loop
    // below is the only sequential part and runs 9 small kernels per chunk.
    let by_chunk = |t: &Tensor| t.transpose(0, 1).and_then(|t| t.contiguous());
    let (u, w, q_decayed) = (by_chunk(&u)?, by_chunk(&w)?, by_chunk(&q_decayed)?);
    let (qk, k_tail, last_decay) = (by_chunk(&qk)?, by_chunk(&k_tail)?, by_chunk(&last_decay)?);
    let mut s = state.reshape((b_sz * hv, dk, dv))?;
    let mut outs = Vec::with_capacity(n);
    for c in 0..n {
        let v_new = (u.get(c)? - w.get(c)?.matmul(&s)?)?;
        outs.push((q_decayed.get(c)?.matmul(&s)? + qk.get(c)?.matmul(&v_new)?)?);
        s = (s.broadcast_mul(&last_decay.get(c)?)? + k_tail.get(c)?.t()?.matmul(&v_new)?)?;
    }
    state.slice_set(&s.reshape((b_sz, hv, dk, dv))?, 0, 0)?;
    // [B·Hv, N·C, Dv] -> [B, T, Hv, Dv]
    let o = Tensor::cat(&outs, 1)?
        .reshape((b_sz, hv, padded, dv))?
        .transpose(1, 2)?
        .narrow(1, 0, seq_len)?;
    let o = o.broadcast_mul(&real.narrow(1, 0, seq_len)?.reshape((b_sz, seq_len, 1, 1))?)?;
    o.contiguous()?.to_dtype(qkv.dtype())
}

/// Zero-pads dim 1 (time) up to `len`.
fn pad_time(t: &Tensor, len: usize) -> Result<Tensor> {
    let have = t.dim(1)?;
    if have == len {
        return Ok(t.clone());
    }
    let mut shape = t.dims().to_vec();
    shape[1] = len - have;
    Tensor::cat(&[t, &Tensor::zeros(shape, t.dtype(), t.device())?], 1)
}

/// Additive mask (0 on and below the diagonal, −∞ above) and the strict-lower 0/1 mask, C×C.
fn masks(dev: &Device) -> Result<(Tensor, Tensor)> {
    let mut add = vec![0f32; TENSOR_OP_CHUNK * TENSOR_OP_CHUNK];
    let mut strict = vec![0f32; TENSOR_OP_CHUNK * TENSOR_OP_CHUNK];
    for r in 0..TENSOR_OP_CHUNK {
        for s in 0..TENSOR_OP_CHUNK {
            if s > r {
                add[r * TENSOR_OP_CHUNK + s] = f32::NEG_INFINITY;
            }
            if s < r {
                strict[r * TENSOR_OP_CHUNK + s] = 1.0;
            }
        }
    }
    Ok((
        Tensor::from_vec(add, (TENSOR_OP_CHUNK, TENSOR_OP_CHUNK), dev)?,
        Tensor::from_vec(strict, (TENSOR_OP_CHUNK, TENSOR_OP_CHUNK), dev)?,
    ))
}

/// `(I + L)⁻¹` for strictly lower `L: [.., C, C]` by doubling: `(I − L)(I + L²)…(I + L³²)`.
fn unit_lower_inverse(l: &Tensor) -> Result<Tensor> {
    let eye = Tensor::eye(TENSOR_OP_CHUNK, DType::F32, l.device())?;
    let mut inv = eye.broadcast_sub(l)?;
    let mut power = l.clone();
    let mut span = 1;
    while span * 2 < TENSOR_OP_CHUNK {
        power = power.matmul(&power)?;
        inv = inv.matmul(&power.broadcast_add(&eye)?)?;
        span *= 2;
    }
    Ok(inv)
}
