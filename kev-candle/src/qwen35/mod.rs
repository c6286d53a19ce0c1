//! The Qwen3.5 hybrid text backbone (Gated DeltaNet + gated full attention), prefill only, with a
//! cache that lets a forward continue from a prefix. QWEN35.md has the math and weight names.

mod attention;
mod cache;
mod config;
mod deltanet;
mod mlp;
mod model;
mod norm;
mod rope;

pub use cache::{Cache, LayerCache};
pub use config::{Config, LayerType};
pub use model::Model;

use candle_nn::Linear;

use crate::weights::Weights;

/// A bias-free linear layer `{prefix}.weight: [out, in]`.
fn linear(w: &Weights, prefix: &str, in_dim: usize, out_dim: usize) -> kev_core::Result<Linear> {
    Ok(Linear::new(
        w.get(&format!("{prefix}.weight"), &[out_dim, in_dim])?,
        None,
    ))
}
