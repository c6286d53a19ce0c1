//! The SwiGLU MLP: `down(silu(gate(x)) · up(x))`.

use candle_core::{Module, Result, Tensor};

use super::config::Config;
use super::linear::{linear, linear_cat, Projection};
use crate::weights::Weights;

/// One layer's MLP.
pub struct Mlp {
    /// `gate_proj` and `up_proj` stacked: `[2·I, H]`.
    gate_up_proj: Projection,
    down_proj: Projection,
}

impl Mlp {
    /// Loads `layers.{i}.mlp.*`.
    pub fn new(cfg: &Config, w: &Weights, prefix: &str) -> kev_core::Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
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
