//! The backbone's bias-free projections, laid out for the backend that runs them.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::Linear;
use kev_kernels::dispatch::{self, Backend};
use kev_kernels::{bf16_gemm_available, Fp8Weight, PackedBf16, PackedInt8};

use crate::weights::{Quantization, Weights};

/// `x · Wᵀ` for a weight `W: [out, in]`.
///
/// - On CUDA, [`kev_kernels::linear`] on the checkpoint's layout: per shape class, the
///   cuBLASLt algorithm that ran fastest, with cuBLAS's numbers.
/// - On Metal, candle's `Linear` on the checkpoint's layout, which its BLAS takes as it is.
/// - On the CPU in f32 (and f16), candle's `Linear` with the weight's storage transposed once
///   here (the same `[out, in]` tensor, laid out `[in, out]`). `Linear` multiplies by
///   `weight.t()`, which is then a row-major matrix that the `gemm` crate streams as it is;
///   with the checkpoint's layout it repacked every weight on every call (704 rows of the 0.8B
///   shapes, 2 threads, AVX-512: 330–390 → 420–460 GFLOP/s).
/// - On the CPU in bf16, where it has AVX512-BF16, Kev's packed bf16 matmul
///   ([`PackedBf16`]): candle has no CPU bf16 matmul of its own (it widens both operands to
///   f32 on every call). Its input and output are in the activation dtype (f32 in the CPU's
///   bf16 mode, see `Weights::projection_dtype`).
/// - On the CPU in the `int8` dtype, Kev's int8 matmul ([`PackedInt8`]): the f32 weight (LoRA
///   folded) quantized once, f32 activations in and out.
/// - On a Hopper GPU in the `fp8` dtype, FP8 products ([`kev_kernels::fp8_linear`]): the f32
///   weight (LoRA folded) quantized once on the CPU in 128 × 128 blocks, bf16 activations in
///   and out.
#[derive(Clone)]
pub enum Projection {
    Candle(Linear),
    Bf16(PackedBf16),
    Int8(PackedInt8),
    /// A CUDA weight `[out, in]` (or one counted as CUDA's, [`dispatch::backend`]).
    Cuda(Tensor),
    Fp8(Fp8Weight),
}

impl Projection {
    /// The layer of `weight: [out, in]`, on `weight`'s device and in its dtype (laid out as a
    /// GPU's while a dispatch count for one runs, [`dispatch::backend`]); on the CPU quantized to
    /// int8 where `int8` (the load refused it elsewhere).
    pub fn new(weight: Tensor, int8: bool) -> Result<Self> {
        match dispatch::backend(weight.device()) {
            Backend::Cuda => return Ok(Self::Cuda(weight)),
            Backend::Metal => return Ok(Self::Candle(Linear::new(weight, None))),
            Backend::Cpu => {}
        }
        if int8 {
            return Ok(Self::Int8(PackedInt8::pack(&weight)?));
        }
        if weight.dtype() == DType::BF16 && bf16_gemm_available() {
            return Ok(Self::Bf16(PackedBf16::pack(&weight)?));
        }
        let transposed = weight.t()?.contiguous()?.t()?;
        Ok(Self::Candle(Linear::new(transposed, None)))
    }

    /// Output features `start..start + len` (rows of the weight) as a layer of their own: a
    /// view of the weight for candle's layers, a packed copy of those rows for the bf16 one.
    pub fn rows(&self, start: usize, len: usize) -> Result<Self> {
        Ok(match self {
            // On the CPU a view of the transposed storage: its `t()` is a row-major matrix with
            // the whole weight's row pitch, which candle's `gemm` matmul takes as it is.
            Self::Candle(l) => Self::Candle(Linear::new(l.weight().narrow(0, start, len)?, None)),
            Self::Bf16(p) => Self::Bf16(p.rows(start, len)?),
            Self::Int8(p) => Self::Int8(p.rows(start, len)?),
            Self::Cuda(w) => Self::Cuda(w.narrow(0, start, len)?),
            Self::Fp8(w) => Self::Fp8(w.rows(start, len)?),
        })
    }
}

impl Module for Projection {
    /// One GEMM on a GPU.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        dispatch::record_matmul(xs.device());
        match self {
            Self::Candle(l) => l.forward(xs),
            Self::Bf16(p) => p.forward(&xs.contiguous()?),
            Self::Int8(p) => p.forward(&xs.contiguous()?),
            Self::Cuda(w) => kev_kernels::linear(xs, w),
            Self::Fp8(w) => kev_kernels::fp8_linear(xs, w),
        }
    }
}

/// Several bias-free linear layers reading the same input, as one `[Σ out, in]` matmul (one
/// launch instead of several); the caller slices the output. `parts`: `(prefix, out)` pairs.
pub(super) fn linear_cat(
    w: &Weights,
    parts: &[(&str, usize)],
    in_dim: usize,
) -> kev_core::Result<Projection> {
    let out: usize = parts.iter().map(|p| p.1).sum();
    let fp8 = in_fp8(w, out, in_dim);
    let weights = parts
        .iter()
        .map(|&(prefix, out)| weight(w, &format!("{prefix}.weight"), out, in_dim, fp8))
        .collect::<kev_core::Result<Vec<_>>>()?;
    let names = || parts.iter().map(|p| p.0).collect::<Vec<_>>();
    // Device-to-device copies on CUDA: candle's `cat` would launch a kernel of its own.
    let weights: Vec<&Tensor> = weights.iter().collect();
    kev_kernels::join_rows(&weights)
        .and_then(|weight| projection(w, weight, fp8))
        .map_err(|e| kev_core::Error::backend(format!("merging {:?}", names()), e))
}

/// A bias-free linear layer `{prefix}.weight: [out, in]`, quantized as the projections are
/// ([`Weights::quantization`]).
pub(super) fn linear(
    w: &Weights,
    prefix: &str,
    in_dim: usize,
    out_dim: usize,
) -> kev_core::Result<Projection> {
    layer(w, prefix, in_dim, out_dim, in_fp8(w, out_dim, in_dim))
}

/// [`linear`], but never in FP8 (int8 in the `int8` dtype, as every projection): the MoE router
/// and the shared expert's gate, whose picks and gate FP8 noise would move (Qwen's FP8
/// releases keep them in bf16 too).
pub(super) fn linear_router(
    w: &Weights,
    prefix: &str,
    in_dim: usize,
    out_dim: usize,
) -> kev_core::Result<Projection> {
    layer(w, prefix, in_dim, out_dim, false)
}

/// The layer of `{prefix}.weight: [out, in]`, in FP8 where `fp8`.
fn layer(
    w: &Weights,
    prefix: &str,
    in_dim: usize,
    out_dim: usize,
    fp8: bool,
) -> kev_core::Result<Projection> {
    let key = format!("{prefix}.weight");
    let weight = weight(w, &key, out_dim, in_dim, fp8)?;
    projection(w, weight, fp8).map_err(|e| kev_core::Error::backend(key, e))
}

/// Whether a projection `[out, in]` is held in FP8: the `fp8` dtype and a shape FP8 products
/// take.
fn in_fp8(w: &Weights, out: usize, input: usize) -> bool {
    w.quantization() == Quantization::Fp8 && out.is_multiple_of(8) && input.is_multiple_of(16)
}

/// Weight `key` as its projection needs it: in f32 on the CPU where it is quantized to FP8
/// there, else in the projection dtype on the model's device.
fn weight(w: &Weights, key: &str, out: usize, input: usize, fp8: bool) -> kev_core::Result<Tensor> {
    if fp8 {
        w.get_on(key, &[out, input], DType::F32, &Device::Cpu)
    } else {
        w.get_as(key, &[out, input], w.projection_dtype())
    }
}

fn projection(w: &Weights, weight: Tensor, fp8: bool) -> Result<Projection> {
    if fp8 {
        return Ok(Projection::Fp8(Fp8Weight::quantize(&weight, w.device())?));
    }
    Projection::new(weight, w.quantization() == Quantization::Int8)
}
