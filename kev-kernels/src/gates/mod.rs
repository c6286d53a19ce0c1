//! The per-step gates of a Gated DeltaNet layer in one op: from the `b` and `a` projections to
//! the `(g, β)` pairs the delta rule reads (docs/BACKBONE.md §3 step 4), instead of ~13 tensor ops.

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "metal")]
mod metal;
mod reference;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use crate::backend::cpu::as_f32;
use crate::dispatch::{record, CountedTensor};
use crate::layout::rows::{as_row_view, rounder, row_view};

pub use reference::deltanet_gates_ref;

/// The op: inputs `ba` (`[.., 2·Hv]` rows, `b` then `a`), `dt_bias` and `neg_a` (f32 `[Hv]`).
pub(crate) struct Gates;

fn out_shape(l: &Layout) -> Result<Shape> {
    let mut dims = l.dims().to_vec();
    let last = dims.pop().unwrap_or(0);
    dims.extend([last / 2, 2]);
    Ok(Shape::from(dims))
}

/// torch's softplus (threshold 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

impl CustomOp3 for Gates {
    fn name(&self) -> &'static str {
        "deltanet-gates"
    }

    fn cpu_fwd(
        &self,
        bas: &CpuStorage,
        bal: &Layout,
        ds: &CpuStorage,
        dl: &Layout,
        ns: &CpuStorage,
        nl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let view = row_view(bal, "deltanet-gates input")?;
        let ba = view.read_f32(bas, "deltanet-gates input")?;
        let dt_bias = as_f32(ds, dl, "deltanet-gates dt_bias")?;
        let neg_a = as_f32(ns, nl, "deltanet-gates neg_a")?;
        let (hv, round) = (dt_bias.len(), rounder(bas.dtype()));
        let mut gates = vec![0f32; view.rows * hv * 2];
        gates
            .par_chunks_mut(2 * hv)
            .zip(ba.par_chunks(2 * hv))
            .for_each(|(out, row)| {
                for h in 0..hv {
                    out[2 * h] = neg_a[h] * softplus(row[hv + h] + dt_bias[h]);
                    out[2 * h + 1] = round.round(1.0 / (1.0 + (-row[h]).exp()));
                }
            });
        Ok((CpuStorage::F32(gates), out_shape(bal)?))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        bas: &candle_core::CudaStorage,
        bal: &Layout,
        ds: &candle_core::CudaStorage,
        dl: &Layout,
        ns: &candle_core::CudaStorage,
        nl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::gates(bas, bal, ds, dl, ns, nl)?;
        Ok((out, out_shape(bal)?))
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        bas: &candle_core::MetalStorage,
        bal: &Layout,
        ds: &candle_core::MetalStorage,
        dl: &Layout,
        ns: &candle_core::MetalStorage,
        nl: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        let out = metal::gates(bas, bal, ds, dl, ns, nl)?;
        Ok((out, out_shape(bal)?))
    }
}

/// `(g, β)` per step and value head, f32 `[.., Hv, 2]`, from `ba: [.., 2·Hv]` (`b` then `a`, in
/// the activation dtype; may be a slice of a wider projection):
/// `g = neg_a · softplus(a + dt_bias)` in f32 and `β = sigmoid(b)` rounded to the activation
/// dtype, as HF computes them. `dt_bias`, `neg_a` (= −exp(A_log)): f32 `[Hv]`.
pub fn deltanet_gates(ba: &Tensor, dt_bias: &Tensor, neg_a: &Tensor) -> Result<Tensor> {
    let hv = dt_bias.elem_count();
    if ba.dim(D::Minus1)? != 2 * hv
        || neg_a.dims() != [hv]
        || dt_bias.dims() != [hv]
        || dt_bias.dtype() != DType::F32
        || neg_a.dtype() != DType::F32
    {
        bail!(
            "deltanet-gates: input {:?} does not fit f32 dt_bias {:?} / neg_a {:?}",
            ba.dims(),
            dt_bias.dims(),
            neg_a.dims()
        )
    }
    let (ba, dt_bias, neg_a) = (
        as_row_view(ba)?,
        dt_bias.counted_contiguous()?,
        neg_a.counted_contiguous()?,
    );
    record("deltanet-gates", 1);
    ba.apply_op3_no_bwd(&dt_bias, &neg_a, &Gates)
}
