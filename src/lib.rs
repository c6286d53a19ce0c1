//! **Kev**: the Rust runtime for Kev decision models.
//!
//! A Kev model answers multiple-choice questions about a shared *state*: a Qwen3.5 hybrid
//! backbone (Gated DeltaNet + gated full attention, an optional PEFT LoRA adapter folded in at
//! load) is read out by a small f32 pointer head, giving one probability distribution per
//! question. This crate is a facade over `kev-core` (formats, records, encoding, errors) and
//! `kev-candle` (the model on candle: CPU today, CUDA and Metal behind features).
//!
//! ```no_run
//! use kev::{DecisionModel, LoadOptions, Record};
//!
//! # fn main() -> kev::Result<()> {
//! let model = DecisionModel::load("tests/fixtures/kev-small", &LoadOptions::default())?;
//! let record = Record::from_json_str(
//!     r#"{"state": "It rains.", "questions": [{"prompt": "Umbrella?", "options": ["yes", "no"]}]}"#,
//!     None,
//! )?;
//! let probs = model.probs(&record)?; // one distribution per question
//! println!("{probs:?}");
//!
//! // Reuse the state's prefix for the next record with the same state.
//! let (_, prefix) = model.probs_and_prefix(&record)?;
//! let again = model.probs_with_prefix(&record, &prefix)?;
//! assert_eq!(probs, again);
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub mod score;

pub use kev_candle::device::keep_freed_memory;
pub use kev_candle::{
    qwen35, reference, DecisionModel, EncodedRecord, GraphStats, LoadBreakdown, ModelId,
    PointerHead, Prefix, PrefixCache, PrefixCacheStats, Scored, StateLoad,
};
pub use kev_core::json;
pub use kev_core::{
    Backend, BaseFiles, BaseRef, Checkpoint, DType, Encoder, Encoding, Error, JsonlRecords,
    KevConfig, LoadOptions, Question, Record, Result, Row, DEFAULT_CUDA_GRAPHS_KEPT,
};
