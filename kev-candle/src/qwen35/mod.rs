//! The Qwen3.5 hybrid text backbone (Gated DeltaNet + gated full attention), prefill only, with a
//! cache that lets a forward continue from a prefix. docs/BACKBONE.md: the math and weight names.

mod attention;
mod cache;
mod config;
mod deltanet;
mod linear;
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

use crate::weights::Weights;
use linear::Projection;

/// Several bias-free linear layers reading the same input, as one `[Σ out, in]` matmul (one
/// launch instead of several); the caller slices the output. `parts`: `(prefix, out)` pairs.
fn linear_cat(w: &Weights, parts: &[(&str, usize)], in_dim: usize) -> kev_core::Result<Projection> {
    let weights = parts
        .iter()
        .map(|&(prefix, out)| {
            w.get_as(
                &format!("{prefix}.weight"),
                &[out, in_dim],
                w.projection_dtype(),
            )
        })
        .collect::<kev_core::Result<Vec<_>>>()?;
    let names = || parts.iter().map(|p| p.0).collect::<Vec<_>>();
    candle_core::Tensor::cat(&weights, 0)
        .and_then(Projection::new)
        .map_err(|e| kev_core::Error::backend(format!("merging {:?}", names()), e))
}

/// A bias-free linear layer `{prefix}.weight: [out, in]`.
fn linear(
    w: &Weights,
    prefix: &str,
    in_dim: usize,
    out_dim: usize,
) -> kev_core::Result<Projection> {
    let key = format!("{prefix}.weight");
    let weight = w.get_as(&key, &[out_dim, in_dim], w.projection_dtype())?;
    Projection::new(weight).map_err(|e| kev_core::Error::backend(key, e))
}
