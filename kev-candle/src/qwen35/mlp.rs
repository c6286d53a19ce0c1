//! The SwiGLU MLP: `down(silu(gate(x)) · up(x))`.

use candle_core::{Module, Result, Tensor};
use candle_nn::Linear;

use super::{linear, Config};
use crate::weights::Weights;

/// One layer's MLP.
pub struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    /// Loads `layers.{i}.mlp.*`.
    pub fn new(cfg: &Config, w: &Weights, prefix: &str) -> kev_core::Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            gate_proj: linear(w, &format!("{prefix}.gate_proj"), h, i)?,
            up_proj: linear(w, &format!("{prefix}.up_proj"), h, i)?,
            down_proj: linear(w, &format!("{prefix}.down_proj"), i, h)?,
        })
    }

    /// `xs: [B, T, H]`.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let gate = candle_nn::ops::silu(&self.gate_proj.forward(xs)?)?;
        self.down_proj.forward(&(gate * self.up_proj.forward(xs)?)?)
    }
}
