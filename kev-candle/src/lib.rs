//! `kev-candle`: the Kev runtime on candle — the Qwen3.5 backbone, LoRA folding, the pointer
//! head, prefix caches and the [`DecisionModel`].
//!
//! Weights are read once (adapter folded in f32 on the CPU, rounded once to the backbone dtype);
//! the model is immutable afterwards and all state lives in explicit [`qwen35::Cache`] values, so
//! one model serves many threads.

pub mod decision;
pub mod device;
mod encoded;
mod executor;
pub mod graphs;
pub mod head;
mod identity;
pub mod lora;
mod plan;
mod prefix;
pub mod prefix_cache;
pub mod qwen35;
pub mod reference;
mod safetensors_header;
pub mod weights;

pub use decision::{
    DecisionModel, EncodedRecord, LoadBreakdown, ModelId, Prefix, Scored, StateLoad,
};
pub use graphs::GraphStats;
pub use head::PointerHead;
pub use prefix_cache::{PrefixCache, PrefixCacheStats};
