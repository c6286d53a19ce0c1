//! SwiGLU on a packed `[gate | up]` tensor: the MLP's gate and up projections run as one
//! matmul, and this op reads both halves in place.

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "metal")]
mod metal;
mod reference;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use crate::backend::cpu::{as_f32, from_f32, silu_in_place};
use crate::dispatch::{record, CountedTensor};
use crate::layout::rows::rounder;

pub use reference::swiglu_ref;

/// The op on a contiguous `[.., 2·I]` input.
pub(crate) struct SwiGlu;

fn out_shape(l: &Layout) -> Shape {
    let mut dims = l.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last /= 2;
    }
    Shape::from(dims)
}

impl CustomOp1 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let gu = as_f32(s, l, "swiglu input")?;
        let inter = l.dims().last().copied().unwrap_or(0) / 2;
        let round = rounder(s.dtype());
        let mut out = vec![0f32; gu.len() / 2];
        out.par_chunks_mut(inter)
            .zip(gu.par_chunks(2 * inter))
            .for_each(|(o, row)| {
                let (gate, up) = row.split_at(inter);
                o.copy_from_slice(gate);
                silu_in_place(o);
                for (o, &u) in o.iter_mut().zip(up) {
                    *o = round.round(*o) * u;
                }
            });
        Ok((from_f32(out, s.dtype())?, out_shape(l)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((cuda::swiglu(s, l)?, out_shape(l)))
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        s: &candle_core::MetalStorage,
        l: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        Ok((metal::swiglu(s, l)?, out_shape(l)))
    }
}

/// `silu(gate) · up` for `gate_up: [.., 2·I]` holding the gate projection in its first half
/// and the up projection in its second; returns `[.., I]` in the same dtype, rounded where HF's
/// `act_fn(gate_proj(x)) * up_proj(x)` rounds.
pub fn swiglu(gate_up: &Tensor) -> Result<Tensor> {
    let width = gate_up.dim(D::Minus1)?;
    if width % 2 != 0 {
        bail!("swiglu: last dim {width} is not [gate | up]")
    }
    let gate_up = gate_up.counted_contiguous()?;
    record("swiglu", 1);
    gate_up.apply_op1_no_bwd(&SwiGlu)
}
