//! Depthwise causal conv1d with fused SiLU (the short convolution of a Gated DeltaNet layer).
//!
//! Written as an op because candle's `conv1d(groups = C)` loops over the groups and is hundreds
//! of times slower (CANDLE.md §5.3). The caller prepends the K−1 cached inputs (zeros at the start
//! of a sequence), so the op itself is stateless and continuation is exact.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use crate::cpu::{as_f32, from_f32};

/// The op; `kernel` is K (the weight's second dim).
pub(crate) struct CausalConv1d {
    pub(crate) kernel: usize,
}

impl CustomOp2 for CausalConv1d {
    fn name(&self) -> &'static str {
        "causal-conv1d"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b_sz, padded_len, channels) = xl.shape().dims3()?;
        let k = self.kernel;
        let seq_len = padded_len + 1 - k;
        let x = as_f32(xs, xl, "causal-conv1d x")?;
        let w = as_f32(ws, wl, "causal-conv1d weight")?;
        let mut out = vec![0f32; b_sz * seq_len * channels];
        out.par_chunks_mut(channels)
            .enumerate()
            .for_each(|(row, out_row)| {
                let (b, t) = (row / seq_len, row % seq_len);
                let base = (b * padded_len + t) * channels;
                for (c, o) in out_row.iter_mut().enumerate() {
                    let mut acc = 0f32;
                    for j in 0..k {
                        acc += w[c * k + j] * x[base + j * channels + c];
                    }
                    *o = acc / (1.0 + (-acc).exp());
                }
            });
        let storage = from_f32(out, xs.dtype())?;
        Ok((storage, Shape::from((b_sz, seq_len, channels))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::causal_conv1d(self, xs, xl, ws, wl)
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        xs: &candle_core::MetalStorage,
        xl: &Layout,
        ws: &candle_core::MetalStorage,
        wl: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        crate::metal::causal_conv1d(self, xs, xl, ws, wl)
    }
}

fn check(xs: &Tensor, weight: &Tensor) -> Result<usize> {
    let (_, padded_len, channels) = xs.dims3()?;
    let (w_channels, k) = weight.dims2()?;
    if w_channels != channels || k == 0 || padded_len < k {
        bail!(
            "causal-conv1d: input {:?} (with K-1 cached steps prepended) does not fit weight {:?}",
            xs.dims(),
            weight.dims()
        )
    }
    Ok(k)
}

/// Causal depthwise convolution followed by SiLU.
///
/// `xs`: `[B, K−1+T, C]`, the K−1 previous inputs followed by the T new ones (channels last);
/// `weight`: `[C, K]` (the checkpoint's `[C, 1, K]` squeezed; the last tap multiplies the current
/// step). Returns `[B, T, C]` in the dtype of `xs`, accumulated in f32.
pub fn causal_conv1d(xs: &Tensor, weight: &Tensor) -> Result<Tensor> {
    let kernel = check(xs, weight)?;
    xs.contiguous()?
        .apply_op2_no_bwd(&weight.contiguous()?, &CausalConv1d { kernel })
}

/// The same computation with plain tensor ops (the reference the op is tested against).
pub fn causal_conv1d_ref(xs: &Tensor, weight: &Tensor) -> Result<Tensor> {
    let k = check(xs, weight)?;
    let seq_len = xs.dim(1)? + 1 - k;
    let xs32 = xs.to_dtype(candle_core::DType::F32)?;
    let w32 = weight.to_dtype(candle_core::DType::F32)?;
    let mut acc = xs32
        .narrow(1, 0, seq_len)?
        .broadcast_mul(&w32.narrow(D::Minus1, 0, 1)?.t()?)?;
    for j in 1..k {
        let tap = w32.narrow(D::Minus1, j, 1)?.t()?;
        acc = (acc + xs32.narrow(1, j, seq_len)?.broadcast_mul(&tap)?)?;
    }
    candle_nn_silu(&acc)?.to_dtype(xs.dtype())
}

fn candle_nn_silu(xs: &Tensor) -> Result<Tensor> {
    xs / (xs.neg()?.exp()? + 1.0)?
}
