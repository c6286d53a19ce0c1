//! A full-attention layer's steps between its projections: q/k norm + partial RoPE (with the
//! head transpose), the attention itself ([`causal_attention`]: the flash kernel or matmuls
//! around the scaled, causal softmax), and the sigmoid output gate (with the transpose back).
//! The elementwise steps are single ops: composed from candle ops they cost ~30 launches per
//! layer.
//!
//! The flash kernel and the matmuls round differently (the kernel keeps the scores in f32, the
//! matmuls round them to bf16, as HF's eager attention): a record's bf16 probabilities may
//! differ in their last bits between batch sizes, as cuBLAS's shape-dependent kernels already
//! make them.
//!
//! Rounding follows HF's PyTorch code (eager attention): the norm output, the rotation's
//! products and sum, the scaled scores and the gate are held in the activation dtype.

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(any(feature = "cuda", feature = "metal"))]
mod gate;
#[cfg(feature = "metal")]
mod metal;
mod reference;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::backend::cpu::{as_f32, from_f32};
use crate::backend::cuda::sources::ROPE_MAX_HEAD_DIM;
use crate::dispatch::{self, backend, counted_cat, record, Backend, CountedTensor, UNCOUNTED};
use crate::flash_attention::{self, flash_attention_fills_gpu, AttentionPast};
use crate::gather::{copy_rows, gather_cat};
use crate::layout::rows::{rounder, strided4, sum_of_squares, whole_f32};

pub use reference::{attention_gate_ref, causal_softmax_ref, qk_norm_rope_ref};

/// Zero-centred q/k norm, then RoPE on the first `rot` dims; `[B, T, H, hd]` → `[B, H, T, hd]`.
pub(crate) struct QkNormRope {
    pub(crate) eps: f32,
}

impl CustomOp3 for QkNormRope {
    fn name(&self) -> &'static str {
        "qk-norm-rope"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        cs: &CpuStorage,
        cl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b_sz, t_len, heads, hd) = xl.shape().dims4()?;
        let (off, [sb, st, sh]) = strided4(xl, "qk-norm-rope input")?;
        let x = whole_f32(xs, "qk-norm-rope input")?;
        let w1 = as_f32(ws, wl, "qk-norm-rope weight")?;
        let cos_sin = as_f32(cs, cl, "qk-norm-rope rotation")?;
        let rot = cl.dims()[3];
        let half = rot / 2;
        let sin_at = b_sz * t_len * rot;
        let round = rounder(xs.dtype());
        let mut out = vec![0f32; b_sz * heads * t_len * hd];
        out.par_chunks_mut(hd).enumerate().for_each(|(r, o)| {
            let (t, h, b) = (r % t_len, (r / t_len) % heads, r / (t_len * heads));
            let xr = &x[off + b * sb + t * st + h * sh..][..hd];
            let ms = sum_of_squares(xr) / hd as f64;
            let inv = (1.0 / (ms + f64::from(self.eps)).sqrt()) as f32;
            let n: Vec<f32> = xr
                .iter()
                .zip(w1.iter())
                .map(|(v, w)| round.round(v * inv * w))
                .collect();
            let rs = (b * t_len + t) * rot;
            for (c, o) in o.iter_mut().enumerate() {
                *o = if c < rot {
                    let rotated = if c < half { -n[c + half] } else { n[c - half] };
                    let (cos, sin) = (cos_sin[rs + c], cos_sin[sin_at + rs + c]);
                    round.round(round.round(n[c] * cos) + round.round(rotated * sin))
                } else {
                    n[c]
                };
            }
        });
        let shape = Shape::from((b_sz, heads, t_len, hd));
        Ok((from_f32(out, xs.dtype())?, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
        cs: &candle_core::CudaStorage,
        cl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (b_sz, t_len, heads, hd) = xl.shape().dims4()?;
        let out = cuda::qk_norm_rope(self.eps, xs, xl, ws, wl, cs, cl)?;
        Ok((out, Shape::from((b_sz, heads, t_len, hd))))
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        xs: &candle_core::MetalStorage,
        xl: &Layout,
        ws: &candle_core::MetalStorage,
        wl: &Layout,
        cs: &candle_core::MetalStorage,
        cl: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        let (b_sz, t_len, heads, hd) = xl.shape().dims4()?;
        let out = metal::qk_norm_rope(self.eps, xs, xl, ws, wl, cs, cl)?;
        Ok((out, Shape::from((b_sz, heads, t_len, hd))))
    }
}

/// `softmax(round(s·scale) + key_bias)` in f32 over the keys up to the query's own, rounded to
/// the dtype of `s`.
pub(crate) struct CausalSoftmax {
    pub(crate) scale: f32,
}

impl CustomOp2 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(
        &self,
        ss: &CpuStorage,
        sl: &Layout,
        ms: &CpuStorage,
        ml: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, groups, t_len, s_len) = sl.shape().dims4()?;
        let s = as_f32(ss, sl, "causal-softmax scores")?;
        let bias = as_f32(ms, ml, "causal-softmax key bias")?;
        let round = rounder(ss.dtype());
        let mut out = vec![0f32; s.len()];
        out.par_chunks_mut(s_len)
            .zip(s.par_chunks(s_len))
            .enumerate()
            .for_each(|(r, (p, row))| {
                let (t, b) = (r % t_len, r / (groups * t_len));
                // Keys after the query's own stay 0.
                let seen = s_len - t_len + t + 1;
                let m = &bias[b * s_len..][..seen];
                let p = &mut p[..seen];
                for ((p, &v), &m) in p.iter_mut().zip(row).zip(m) {
                    *p = round.round(v * self.scale) + m;
                }
                let mx = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for p in p.iter_mut() {
                    *p = (*p - mx).exp();
                    sum += *p;
                }
                p.iter_mut().for_each(|p| *p /= sum);
            });
        Ok((from_f32(out, ss.dtype())?, sl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
        ms: &candle_core::CudaStorage,
        ml: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::causal_softmax(self.scale, ss, sl, ms, ml)?;
        Ok((out, sl.shape().clone()))
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        ss: &candle_core::MetalStorage,
        sl: &Layout,
        ms: &candle_core::MetalStorage,
        ml: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        let out = metal::causal_softmax(self.scale, ss, sl, ms, ml)?;
        Ok((out, sl.shape().clone()))
    }
}

/// `o · round(sigmoid(gate))`, `o: [B, H, T, hd]`, gate `[B, T, H, hd]` → `[B, T, H·hd]`.
pub(crate) struct AttentionGate;

impl CustomOp2 for AttentionGate {
    fn name(&self) -> &'static str {
        "attention-gate"
    }

    fn cpu_fwd(
        &self,
        os: &CpuStorage,
        ol: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b_sz, t_len, heads, hd) = gl.shape().dims4()?;
        let o = as_f32(os, ol, "attention-gate input")?;
        let (off, [sb, st, sh]) = strided4(gl, "attention-gate gate")?;
        let g = whole_f32(gs, "attention-gate gate")?;
        let round = rounder(os.dtype());
        let mut out = vec![0f32; o.len()];
        out.par_chunks_mut(hd).enumerate().for_each(|(r, out)| {
            let (h, t, b) = (r % heads, (r / heads) % t_len, r / (heads * t_len));
            let gr = &g[off + b * sb + t * st + h * sh..][..hd];
            let or = &o[((b * heads + h) * t_len + t) * hd..][..hd];
            for ((out, &ov), &gv) in out.iter_mut().zip(or).zip(gr) {
                *out = ov * round.round(1.0 / (1.0 + (-gv).exp()));
            }
        });
        let shape = Shape::from((b_sz, t_len, heads * hd));
        Ok((from_f32(out, os.dtype())?, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        os: &candle_core::CudaStorage,
        ol: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (b_sz, t_len, heads, hd) = gl.shape().dims4()?;
        let runs = gate::single(os, ol, gl)?;
        let out = cuda::gate_launches(gs, &runs.parts, runs.heads, runs.hd)?;
        Ok((out, Shape::from((b_sz, t_len, heads * hd))))
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        os: &candle_core::MetalStorage,
        ol: &Layout,
        gs: &candle_core::MetalStorage,
        gl: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        let (b_sz, t_len, heads, hd) = gl.shape().dims4()?;
        let runs = gate::single(os, ol, gl)?;
        let out = metal::gate_dispatches(gs, &runs.parts, runs.heads, runs.hd)?;
        Ok((out, Shape::from((b_sz, t_len, heads * hd))))
    }
}

/// A `[B, T, H, hd]` tensor whose last dim is contiguous, as is or copied.
fn last_dim_contiguous(t: &Tensor) -> Result<Tensor> {
    if t.stride().last() == Some(&1) {
        Ok(t.clone())
    } else {
        t.counted_contiguous()
    }
}

/// The q or k path of a full-attention layer: zero-centred RMSNorm over `hd` (`w1 = 1 + w`,
/// f32), then NeoX RoPE on the first `rot` dims with `cos_sin: [2, B, T, rot]` (cos then sin,
/// in the dtype of `x`), returned head-major. `x: [B, T, H, hd]` (may be a slice of a wider
/// projection) → `[B, H, T, hd]`, contiguous.
pub fn qk_norm_rope(x: &Tensor, w1: &Tensor, cos_sin: &Tensor, eps: f64) -> Result<Tensor> {
    let (b_sz, t_len, _, hd) = x.dims4()?;
    let (two, cb, ct, rot) = cos_sin.dims4()?;
    if w1.dims() != [hd] || two != 2 || cb != b_sz || ct != t_len || rot > hd || rot % 2 != 0 {
        bail!(
            "qk-norm-rope: weight {:?} / rotation {:?} do not fit input {:?}",
            w1.dims(),
            cos_sin.dims(),
            x.dims()
        )
    }
    if cos_sin.dtype() != x.dtype() {
        bail!(
            "qk-norm-rope: rotation dtype {:?} is not {:?}",
            cos_sin.dtype(),
            x.dtype()
        )
    }
    if backend(x.device()) != Backend::Metal && hd > ROPE_MAX_HEAD_DIM {
        record(UNCOUNTED, 0);
        return qk_norm_rope_ref(x, w1, cos_sin, eps);
    }
    let (x, w1, cos_sin) = (
        last_dim_contiguous(x)?,
        w1.counted_to_dtype(DType::F32)?.counted_contiguous()?,
        cos_sin.counted_contiguous()?,
    );
    record("qk-norm-rope", 1);
    x.apply_op3_no_bwd(&w1, &cos_sin, &QkNormRope { eps: eps as f32 })
}

/// Causal attention probabilities: `softmax(round(scores·scale) + key_bias)` over the last dim
/// in f32, rounded to the dtype of `scores: [B, G, T, S]` (G head rows sharing one bias). The T
/// queries are the last T of the S keys, and query t sees keys `..= S − T + t`; `key_bias: [B, S]`
/// f32 is 0 where a key is visible to the row and −∞ where not (padding in a cache). A per-key
/// bias instead of a `[B, T, S]` mask: the host builds and uploads S values per row, not T·S.
pub fn causal_softmax(scores: &Tensor, key_bias: &Tensor, scale: f64) -> Result<Tensor> {
    let (b_sz, _, t_len, s_len) = scores.dims4()?;
    if key_bias.dims() != [b_sz, s_len] || key_bias.dtype() != DType::F32 || t_len > s_len {
        bail!(
            "causal-softmax: key bias {:?} {:?} does not fit scores {:?}",
            key_bias.dtype(),
            key_bias.dims(),
            scores.dims()
        )
    }
    let (scores, key_bias) = (scores.counted_contiguous()?, key_bias.counted_contiguous()?);
    record("causal-softmax", 1);
    scores.apply_op2_no_bwd(
        &key_bias,
        &CausalSoftmax {
            scale: scale as f32,
        },
    )
}

/// `softmax(q·kᵀ·scale + key_bias)·v` with causality, for `q: [B, Hq, T, hd]` and this step's
/// `k`, `v: [B, Hkv, L, hd]` (any strides with contiguous head dims; Hq a multiple of Hkv, query
/// head h reading kv head h / (Hq/Hkv)): query t sees the past's S keys (branch row b: its
/// state row's, [`AttentionPast`]) and its own first L − T + t + 1; `key_bias: [B, S + L]` f32 is
/// added to the scaled scores (0 where a key is visible, −∞ over padding). Returns
/// `[B, Hq, T, hd]`.
///
/// On CUDA where [`flash_attention_fills_gpu`] the flash kernel (scores, softmax and weighted
/// sum on the multiprocessor, the past read where it lies), where it runs (bf16, hd = 256,
/// 16-byte aligned views); elsewhere the past's keys and values gathered per row ahead of this
/// step's, then matmuls around [`causal_softmax`]. Errors name shapes, dtypes or devices that do
/// not fit.
pub fn causal_attention(
    q: &Tensor,
    past: Option<AttentionPast>,
    k: &Tensor,
    v: &Tensor,
    key_bias: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let s_len = flash_attention::check("causal-attention", q, past.as_ref(), k, v, key_bias)?;
    let num_kv_heads = k.dim(1)?;
    if flash_attention_fills_gpu(q, num_kv_heads)? {
        let flash = flash_attention::flash_attention_checked(
            q,
            past,
            k,
            v,
            key_bias,
            scale,
            s_len,
            || composed_attention(q, past, k, v, key_bias, scale),
        )?;
        if let Some(out) = flash {
            return Ok(out);
        }
    }
    composed_attention(q, past, k, v, key_bias, scale)
}

/// The flash kernel alone on the inputs of [`causal_attention`], or `None` where it does not
/// run (see `flash_attention_checked`). Public through [`crate::testing`], for the tests that
/// it runs where it should.
pub fn flash_attention(
    q: &Tensor,
    past: Option<AttentionPast>,
    k: &Tensor,
    v: &Tensor,
    key_bias: &Tensor,
    scale: f64,
) -> Result<Option<Tensor>> {
    let s_len = flash_attention::check("flash-attention", q, past.as_ref(), k, v, key_bias)?;
    flash_attention::flash_attention_checked(q, past, k, v, key_bias, scale, s_len, || {
        composed_attention(q, past, k, v, key_bias, scale)
    })
}

/// [`causal_attention`] off the flash kernel: the past's keys and values gathered per row
/// ahead of this step's, then [`attention_matmuls`].
pub(crate) fn composed_attention(
    q: &Tensor,
    past: Option<AttentionPast>,
    k: &Tensor,
    v: &Tensor,
    key_bias: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let (k, v) = match past {
        Some(p) => (
            gather_cat(&copy_rows(p.k)?, p.owners, k)?,
            gather_cat(&copy_rows(p.v)?, p.owners, &copy_rows(v)?)?,
        ),
        None => (k.clone(), copy_rows(v)?),
    };
    attention_matmuls(q, &k, &v, key_bias, scale)
}

/// The attention as matmuls around [`causal_softmax`]: `q: [B, Hq, T, hd]`, `k`, `v: [B, Hkv,
/// S, hd]` contiguous → `[B, Hq, T, hd]`.
fn attention_matmuls(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    key_bias: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let (b_sz, nq, seq_len, hd) = q.dims4()?;
    let nkv = k.dim(1)?;
    // GQA without copying K/V: query head h reads kv head h / rep, so group the query heads
    // of one kv head along the rows: [B, Hkv, rep·T, hd].
    let rep = nq / nkv;
    let kv_len = k.dim(2)?;
    let q = q.counted_reshape((b_sz, nkv, rep * seq_len, hd))?;
    let scores = q
        .counted_matmul(&k.t()?)?
        .counted_reshape((b_sz, nq, seq_len, kv_len))?;
    let probs = causal_softmax(&scores, key_bias, scale)?.counted_reshape((
        b_sz,
        nkv,
        rep * seq_len,
        kv_len,
    ))?;
    probs
        .counted_matmul(v)?
        .counted_reshape((b_sz, nq, seq_len, hd))
}

/// The attention output gate: `o · sigmoid(gate)` with `o: [B, H, T, hd]` (head-major, as the
/// attention matmul leaves it) and `gate: [B, T, H, hd]` (may be a slice of a wider projection);
/// returns `[B, T, H·hd]`, the layout `o_proj` reads.
pub fn attention_gate(o: &Tensor, gate: &Tensor) -> Result<Tensor> {
    let (b_sz, heads, t_len, hd) = o.dims4()?;
    if gate.dims() != [b_sz, t_len, heads, hd] || gate.dtype() != o.dtype() {
        bail!(
            "attention-gate: gate {:?} {:?} does not fit {:?} {:?}",
            gate.dtype(),
            gate.dims(),
            o.dtype(),
            o.dims()
        )
    }
    let (o, gate) = (o.counted_contiguous()?, last_dim_contiguous(gate)?);
    record("attention-gate", 1);
    o.apply_op2_no_bwd(&gate, &AttentionGate)
}

/// The CUDA and Metal op of [`attention_gate_join`]; the CPU composes it.
struct AttentionGateJoin;

impl CustomOp3 for AttentionGateJoin {
    fn name(&self) -> &'static str {
        "attention-gate-join"
    }

    cuda_only_cpu_fwd!(
        "attention-gate-join: the CPU composes attention_gate and cat",
        _a _la, _b _lb, _c _lc
    );

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
        bs: &candle_core::CudaStorage,
        bl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, heads, hd) = gl.shape().dims3()?;
        let runs = gate::join(ss, sl, bs, bl, gl)?;
        let out = cuda::gate_launches(gs, &runs.parts, runs.heads, runs.hd)?;
        Ok((out, Shape::from((n, heads * hd))))
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        ss: &candle_core::MetalStorage,
        sl: &Layout,
        bs: &candle_core::MetalStorage,
        bl: &Layout,
        gs: &candle_core::MetalStorage,
        gl: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        let (n, heads, hd) = gl.shape().dims3()?;
        let runs = gate::join(ss, sl, bs, bl, gl)?;
        let out = metal::gate_dispatches(gs, &runs.parts, runs.heads, runs.hd)?;
        Ok((out, Shape::from((n, heads * hd))))
    }
}

/// [`attention_gate`] of a packed batch's two parts, records' states `o_s: [R, H, S, hd]` and
/// branches `o_b: [B, H, T, hd]`, with their gates packed as the rows are, `gate: [R·S + B·T, H,
/// hd]` (may be a slice of a wider projection). Returns the packed `[R·S + B·T, H·hd]`: equal to
/// joining the two parts' [`attention_gate`] outputs, but on CUDA and Metal written in place by two
/// launches instead of copied after.
pub fn attention_gate_join(o_s: &Tensor, o_b: &Tensor, gate: &Tensor) -> Result<Tensor> {
    let (r, heads, s_len, hd) = o_s.dims4()?;
    let (b, b_heads, t_len, b_hd) = o_b.dims4()?;
    let rows = r * s_len + b * t_len;
    if (b_heads, b_hd) != (heads, hd)
        || gate.dims() != [rows, heads, hd]
        || o_b.dtype() != o_s.dtype()
        || gate.dtype() != o_s.dtype()
    {
        bail!(
            "attention-gate-join: states {:?} {:?}, branches {:?} {:?} and gate {:?} {:?} do not fit",
            o_s.dtype(),
            o_s.dims(),
            o_b.dtype(),
            o_b.dims(),
            gate.dtype(),
            gate.dims()
        )
    }
    let gate = if gate.stride().last() == Some(&1) {
        gate.clone()
    } else {
        gate.counted_contiguous()?
    };
    let part = |o: &Tensor, start: usize, b_sz: usize, len: usize| -> Result<Tensor> {
        let g = gate
            .narrow(0, start, b_sz * len)?
            .counted_contiguous()?
            .counted_reshape((b_sz, len, heads, hd))?;
        attention_gate(o, &g)?.counted_reshape((b_sz * len, heads * hd))
    };
    let composed = || match (r * s_len, b * t_len) {
        (0, _) => part(o_b, 0, b, t_len),
        (_, 0) => part(o_s, 0, r, s_len),
        _ => counted_cat(
            &[part(o_s, 0, r, s_len)?, part(o_b, r * s_len, b, t_len)?],
            0,
        ),
    };
    let gpu = matches!(backend(o_s.device()), Backend::Cuda | Backend::Metal);
    if gpu && r * s_len > 0 && b * t_len > 0 {
        let (o_s, o_b) = (o_s.counted_contiguous()?, o_b.counted_contiguous()?);
        // One launch per part (`gate_launches`, `gate_dispatches`).
        return dispatch::launch(
            "attention-gate-join",
            2,
            o_s.device(),
            || o_s.apply_op3_no_bwd(&o_b, &gate, &AttentionGateJoin),
            composed,
        );
    }
    composed()
}
