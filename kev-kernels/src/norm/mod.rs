//! The RMSNorms of a Qwen3.5 layer as single ops: the zero-centred norm (optionally fused with
//! the residual add before it) and the DeltaNet's gated output norm. Composed from candle ops
//! they cost 8 to 13 kernel launches each; the forward is launch-bound on a GPU.
//!
//! Rounding follows HF's PyTorch code: statistics and products in f32, results rounded to the
//! activation dtype where PyTorch holds a tensor in it.

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "metal")]
mod metal;
mod reference;

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, D,
};
use rayon::prelude::*;

use crate::backend::cpu::{as_f32, from_f32, silu_in_place};
use crate::dispatch::{record, CountedTensor};
use crate::layout::rows::{as_row_view, rounder, row_view, sum_of_squares};

pub use reference::{gated_rms_norm_ref, rms_norm_ref};

/// Zero-centred RMSNorm, `x̂·w1` with `w1 = 1 + w` (f32), optionally after a residual add.
pub(crate) struct RmsNorm {
    pub(crate) eps: f32,
}

impl RmsNorm {
    /// `[x̂·w1]`, or with a residual `h` `[x + h, its norm]` packed: one pass over each row.
    fn cpu(&self, x: &[f32], h: Option<&[f32]>, w1: &[f32], dtype: DType) -> Vec<f32> {
        let cols = w1.len();
        let round = rounder(dtype);
        let norm_row = |o: &mut [f32], v: &[f32]| {
            let ms = sum_of_squares(v) / cols as f64;
            let inv = (1.0 / (ms + f64::from(self.eps)).sqrt()) as f32;
            o.iter_mut()
                .zip(v.iter().zip(w1))
                .for_each(|(o, (a, w))| *o = a * inv * w);
        };
        let Some(h) = h else {
            let mut normed = vec![0f32; x.len()];
            normed
                .par_chunks_mut(cols)
                .zip(x.par_chunks(cols))
                .for_each(|(o, v)| norm_row(o, v));
            return normed;
        };
        let mut out = vec![0f32; 2 * x.len()];
        let (sum, normed) = out.split_at_mut(x.len());
        sum.par_chunks_mut(cols)
            .zip(normed.par_chunks_mut(cols))
            .zip(x.par_chunks(cols).zip(h.par_chunks(cols)))
            .for_each(|((s, o), (x, h))| {
                s.iter_mut()
                    .zip(x.iter().zip(h))
                    .for_each(|(s, (a, b))| *s = round.round(a + b));
                norm_row(o, s);
            });
        out
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = row_view(xl, "rms-norm input")?.read_f32(xs, "rms-norm input")?;
        let w1 = as_f32(ws, wl, "rms-norm weight")?;
        let out = self.cpu(&x, None, &w1, xs.dtype());
        Ok((from_f32(out, xs.dtype())?, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::rms_norm(self.eps, xs, xl, None, ws, wl)?;
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        xs: &candle_core::MetalStorage,
        xl: &Layout,
        ws: &candle_core::MetalStorage,
        wl: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        let out = metal::rms_norm(self.eps, xs, xl, None, ws, wl)?;
        Ok((out, xl.shape().clone()))
    }
}

/// The residual form: inputs `x`, `h`, `w1`; output `[2, ..]` = (x + h, its norm).
pub(crate) struct AddRmsNorm(pub(crate) RmsNorm);

impl CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        hs: &CpuStorage,
        hl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = row_view(xl, "add-rms-norm input")?.read_f32(xs, "add-rms-norm input")?;
        let h = row_view(hl, "add-rms-norm residual")?.read_f32(hs, "add-rms-norm residual")?;
        let w1 = as_f32(ws, wl, "rms-norm weight")?;
        let out = self.0.cpu(&x, Some(&h), &w1, xs.dtype());
        Ok((from_f32(out, xs.dtype())?, stacked(xl)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        hs: &candle_core::CudaStorage,
        hl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::rms_norm(self.0.eps, xs, xl, Some((hs, hl)), ws, wl)?;
        Ok((out, stacked(xl)))
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        xs: &candle_core::MetalStorage,
        xl: &Layout,
        hs: &candle_core::MetalStorage,
        hl: &Layout,
        ws: &candle_core::MetalStorage,
        wl: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        let out = metal::rms_norm(self.0.eps, xs, xl, Some((hs, hl)), ws, wl)?;
        Ok((out, stacked(xl)))
    }
}

fn stacked(l: &Layout) -> Shape {
    let mut dims = vec![2];
    dims.extend_from_slice(l.dims());
    Shape::from(dims)
}

/// The gated output norm of a DeltaNet layer (HF `Qwen3_5RMSNormGated`).
pub(crate) struct GatedRmsNorm {
    pub(crate) eps: f32,
}

impl CustomOp3 for GatedRmsNorm {
    fn name(&self) -> &'static str {
        "gated-rms-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        zs: &CpuStorage,
        zl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = as_f32(xs, xl, "gated-rms-norm input")?;
        let z = row_view(zl, "gated-rms-norm gate")?.read_f32(zs, "gated-rms-norm gate")?;
        let w = as_f32(ws, wl, "gated-rms-norm weight")?;
        let (dv, round) = (w.len(), rounder(xs.dtype()));
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(dv)
            .zip(x.par_chunks(dv).zip(z.par_chunks(dv)))
            .for_each(|(o, (x, z))| {
                let ms = sum_of_squares(x) / dv as f64;
                let inv = (1.0 / (ms + f64::from(self.eps)).sqrt()) as f32;
                o.copy_from_slice(z);
                silu_in_place(o);
                for ((o, &a), &w) in o.iter_mut().zip(x).zip(w.iter()) {
                    *o *= round.round(round.round(a * inv) * w);
                }
            });
        Ok((from_f32(out, xs.dtype())?, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        zs: &candle_core::CudaStorage,
        zl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::gated_rms_norm(self.eps, xs, xl, zs, zl, ws, wl)?;
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        xs: &candle_core::MetalStorage,
        xl: &Layout,
        zs: &candle_core::MetalStorage,
        zl: &Layout,
        ws: &candle_core::MetalStorage,
        wl: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        let out = metal::gated_rms_norm(self.eps, xs, xl, zs, zl, ws, wl)?;
        Ok((out, xl.shape().clone()))
    }
}

/// `w1` as the f32 contiguous weight the kernels read.
fn weight_f32(w1: &Tensor) -> Result<Tensor> {
    w1.counted_to_dtype(DType::F32)?.counted_contiguous()
}

fn check_weight(x: &Tensor, w: &Tensor, what: &str) -> Result<()> {
    if w.dims() != [x.dim(D::Minus1)?] {
        bail!(
            "{what}: weight {:?} does not match input {:?}",
            w.dims(),
            x.dims()
        )
    }
    Ok(())
}

/// Zero-centred RMSNorm over the last dim: `x / sqrt(mean(x²) + eps) · w1` in f32, returned in
/// the dtype of `x`. `w1` is `1 + w`, f32 (forming it in a 16-bit dtype would round it).
/// `x` may be a slice of a wider tensor (evenly spaced rows); anything else is copied first.
pub fn rms_norm(x: &Tensor, w1: &Tensor, eps: f64) -> Result<Tensor> {
    check_weight(x, w1, "rms-norm")?;
    let (x, w1) = (as_row_view(x)?, weight_f32(w1)?);
    record("rms-norm", 1);
    x.apply_op2_no_bwd(&w1, &RmsNorm { eps: eps as f32 })
}

/// The residual add `x + h` (in their dtype, as the model's residual stream) and its
/// [`rms_norm`], in one pass. Returns `(sum, normed)`.
pub fn add_rms_norm(x: &Tensor, h: &Tensor, w1: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    check_weight(x, w1, "add-rms-norm")?;
    if x.dims() != h.dims() || x.dtype() != h.dtype() {
        bail!(
            "add-rms-norm: residual {:?} {:?} does not match {:?} {:?}",
            h.dtype(),
            h.dims(),
            x.dtype(),
            x.dims()
        )
    }
    let (x, h, w1) = (as_row_view(x)?, as_row_view(h)?, weight_f32(w1)?);
    record("add-rms-norm", 1);
    let both = x.apply_op3_no_bwd(&h, &w1, &AddRmsNorm(RmsNorm { eps: eps as f32 }))?;
    Ok((both.get(0)?, both.get(1)?))
}

/// The gated norm: per group of `Dv` values, `round(round(x̂)·w) · silu(z)` with x̂ in f32
/// (HF `Qwen3_5RMSNormGated`). `x: [.., Hv, Dv]`, `z`: the same elements as `[.., Hv·Dv]` (may
/// be a slice of a wider projection), `w: [Dv]` in the dtype of `x`.
pub fn gated_rms_norm(x: &Tensor, z: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    check_weight(x, w, "gated-rms-norm")?;
    if x.elem_count() != z.elem_count() || x.dtype() != z.dtype() || w.dtype() != x.dtype() {
        bail!(
            "gated-rms-norm: gate {:?} {:?} / weight {:?} do not match input {:?} {:?}",
            z.dtype(),
            z.dims(),
            w.dtype(),
            x.dtype(),
            x.dims()
        )
    }
    let (x, z, w) = (
        x.counted_contiguous()?,
        as_row_view(z)?,
        w.counted_contiguous()?,
    );
    record("gated-rms-norm", 1);
    x.apply_op3_no_bwd(&z, &w, &GatedRmsNorm { eps: eps as f32 })
}
