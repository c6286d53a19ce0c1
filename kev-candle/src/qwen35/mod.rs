//! The Qwen3.5 hybrid text backbone (Gated DeltaNet + gated full attention), prefill only, with a
//! cache that lets a forward continue from a prefix. docs/BACKBONE.md: the math and weight names.

mod attention;
mod cache;
mod config;
mod deltanet;
mod linear;
mod mlp;
mod model;
mod moe;
mod norm;
mod rope;
mod split;

pub use cache::{Cache, LayerCache};
pub use config::{Config, ExpertsShape, LayerType, MlpShape};
pub use model::{Model, SplitHost, SplitTables};
pub use split::Packing;
