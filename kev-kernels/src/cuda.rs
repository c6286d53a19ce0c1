//! CUDA implementations of the ops (work in progress: being written).

use candle_core::{bail, CUDAStorage, Layout, Result, Shape};

use crate::causal_conv1d::CausalConv1d;
use crate::gated_delta_rule::GatedDeltaRule;

pub(crate) fn gated_delta_rule(
    _op: &GatedDeltaRule,
    _state: &mut CUDAStorage,
    _sl: &Layout,
    _qkv: &CUDAStorage,
    _ql: &Layout,
    _gb: &CUDAStorage,
    _gl: &Layout,
) -> Result<()> {
    bail!("gated-delta-rule: CUDA kernel not written yet")
}

pub(crate) fn causal_conv1d(
    _op: &CausalConv1d,
    _xs: &CUDAStorage,
    _xl: &Layout,
    _ws: &CUDAStorage,
    _wl: &Layout,
) -> Result<(CUDAStorage, Shape)> {
    bail!("causal-conv1d: CUDA kernel not written yet")
}
