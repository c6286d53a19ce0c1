//! The SwiGLU MLP: `down(silu(gate(x)) · up(x))`: a dense layer's, or a MoE layer's shared
//! expert.

use candle_core::{Module, Result, Tensor};

use super::linear::{linear, linear_cat, Projection};
use crate::weights::Weights;

/// One layer's MLP.
pub struct Mlp {
    /// `gate_proj` and `up_proj` stacked: `[2·I, H]`.
    gate_up_proj: Projection,
    down_proj: Projection,
}

impl Mlp {
    /// Loads `{prefix}.*` (`layers.{i}.mlp`, or a MoE layer's `mlp.shared_expert`): `h` wide,
    /// `i` inside.
    pub fn new(w: &Weights, prefix: &str, h: usize, i: usize) -> kev_core::Result<Self> {
        Ok(Self {
            gate_up_proj: linear_cat(
                w,
                &[
                    (&format!("{prefix}.gate_proj"), i),
                    (&format!("{prefix}.up_proj"), i),
                ],
                h,
            )?,
            down_proj: linear(w, &format!("{prefix}.down_proj"), i, h)?,
        })
    }

    /// `xs: [B, T, H]`.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let gate_up = self.gate_up_proj.forward(xs)?;
        self.down_proj.forward(&kev_kernels::swiglu(&gate_up)?)
    }
}
