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
mod split;

pub use cache::{Cache, LayerCache};
pub use config::{Config, LayerType};
pub use model::Model;
use split::Rows;
pub use split::Split;

use candle_nn::Linear;

use crate::weights::Weights;

/// Several bias-free linear layers reading the same input, as one `[Σ out, in]` matmul (one
/// launch instead of several); the caller slices the output. `parts`: `(prefix, out)` pairs.
fn linear_cat(w: &Weights, parts: &[(&str, usize)], in_dim: usize) -> kev_core::Result<Linear> {
    let weights = parts
        .iter()
        .map(|&(prefix, out)| w.get(&format!("{prefix}.weight"), &[out, in_dim]))
        .collect::<kev_core::Result<Vec<_>>>()?;
    let merged = candle_core::Tensor::cat(&weights, 0).map_err(|e| {
        let names: Vec<_> = parts.iter().map(|p| p.0).collect();
        kev_core::Error::backend(format!("merging {names:?}"), e)
    })?;
    Ok(Linear::new(merged, None))
}

/// A bias-free linear layer `{prefix}.weight: [out, in]`.
fn linear(w: &Weights, prefix: &str, in_dim: usize, out_dim: usize) -> kev_core::Result<Linear> {
    Ok(Linear::new(
        w.get(&format!("{prefix}.weight"), &[out_dim, in_dim])?,
        None,
    ))
}
