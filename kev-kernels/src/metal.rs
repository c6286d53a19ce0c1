//! Metal implementations of the ops (work in progress: being written).

use candle_core::{bail, Layout, MetalStorage, Result, Shape};

use crate::causal_conv1d::CausalConv1d;
use crate::gated_delta_rule::GatedDeltaRule;

pub(crate) fn gated_delta_rule(
    _op: &GatedDeltaRule,
    _state: &mut MetalStorage,
    _sl: &Layout,
    _qkv: &MetalStorage,
    _ql: &Layout,
    _gb: &MetalStorage,
    _gl: &Layout,
) -> Result<()> {
    bail!("gated-delta-rule: Metal kernel not written yet")
}

pub(crate) fn causal_conv1d(
    _op: &CausalConv1d,
    _xs: &MetalStorage,
    _xl: &Layout,
    _ws: &MetalStorage,
    _wl: &Layout,
) -> Result<(MetalStorage, Shape)> {
    bail!("causal-conv1d: Metal kernel not written yet")
}
