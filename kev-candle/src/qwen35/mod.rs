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
    let names = || parts.iter().map(|p| p.0).collect::<Vec<_>>();
    candle_core::Tensor::cat(&weights, 0)
        .and_then(linear_of)
        .map_err(|e| kev_core::Error::backend(format!("merging {:?}", names()), e))
}

/// A bias-free linear layer `{prefix}.weight: [out, in]`.
fn linear(w: &Weights, prefix: &str, in_dim: usize, out_dim: usize) -> kev_core::Result<Linear> {
    let key = format!("{prefix}.weight");
    linear_of(w.get(&key, &[out_dim, in_dim])?).map_err(|e| kev_core::Error::backend(key, e))
}

/// The layer of `weight: [out, in]`. On the CPU its storage is transposed once here (the same
/// `[out, in]` tensor, laid out `[in, out]`): `Linear` multiplies by `weight.t()`, which is then
/// a row-major matrix that the `gemm` crate streams as it is, where the checkpoint's layout made
/// it repack every weight on every call (704 rows of the 0.8B shapes, 2 threads, AVX-512:
/// 330–390 → 420–460 GFLOP/s). GPUs keep the checkpoint's layout, which their BLAS takes as it is.
fn linear_of(weight: candle_core::Tensor) -> candle_core::Result<Linear> {
    let weight = if weight.device().is_cpu() {
        weight.t()?.contiguous()?.t()?
    } else {
        weight
    };
    Ok(Linear::new(weight, None))
}
