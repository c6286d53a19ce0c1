//! `kev-core`: the formats and contract of the Kev runtime, with no tensor math.
//!
//! Kev models are multiple-choice decision models: a Qwen3.5 backbone read out by a small pointer
//! head. This crate holds everything that is not tensors, so it compiles fast and is tested without
//! a device:
//!
//! - [`record`]: records (one state, several questions) and the JSONL reader;
//! - [`checkpoint`]: `kev.json`, the checkpoint folder and where the base model's files are
//!   (a local folder or the Hugging Face cache, never downloading);
//! - [`adapter`]: the PEFT LoRA `adapter_config.json` and per-module scaling;
//! - [`template`] and [`encoding`]: the prompt template and the exact token positions the pointer
//!   head reads;
//! - [`options`]: [`LoadOptions`] with its [`Backend`] and [`DType`];
//! - [`error`]: the one [`Error`] type of the whole runtime.
//!
//! Two design decisions matter to readers. Inputs are validated by hand from JSON values, so every
//! error names the file or record line and the exact field, and nothing is silently dropped or
//! coerced. Text is tokenized one piece at a time without special tokens (docs/CONTRACT.md §2), so positions
//! do not depend on neighbouring text and the prefix form of the model equals its row form.
//!
//! ```no_run
//! use kev_core::{Checkpoint, JsonlRecords};
//!
//! # fn main() -> kev_core::Result<()> {
//! let ckpt = Checkpoint::open("my-kev")?;
//! let encoder = ckpt.encoder()?;
//! let file = std::fs::File::open("records.jsonl").map_err(|e| kev_core::Error::io("records.jsonl".as_ref(), e))?;
//! for (line, record) in JsonlRecords::new(std::io::BufReader::new(file), "records.jsonl") {
//!     let encoding = encoder.encode(&record?, Some(line))?;
//!     let (_state, rows) = encoding.rows();
//!     println!("{} questions", rows.len());
//! }
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub mod adapter;
pub mod checkpoint;
pub mod encoding;
pub mod error;
pub mod json;
pub mod options;
pub mod record;
pub mod template;

pub use adapter::AdapterConfig;
pub use checkpoint::{hub_cache_dir, BaseFiles, BaseRef, Checkpoint, HeadConfig, KevConfig};
pub use encoding::{BranchPositions, Encoder, Encoding, Row};
pub use error::{Error, Result};
pub use options::{Backend, DType, LoadOptions, DEFAULT_CUDA_GRAPHS_KEPT, DEFAULT_PREFILL_CHUNK};
pub use record::{JsonlRecords, Question, Record, DEFAULT_MAX_LINE_BYTES};
pub use template::Template;
/// The tokenizers crate, re-exported so callers build [`Encoder`]s with the same version.
pub use tokenizers;
