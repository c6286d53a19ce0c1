//! [`DecisionModel`]: a Kev checkpoint loaded for scoring (docs/CONTRACT.md §3, §6).
//!
//! Every score is computed in prefix form: a record's state runs once into a cache, then all
//! its branches as one right-padded batch on copies of that cache. [`DecisionModel::run`] is the
//! one entry point: it scores encoded records, each state computed now or continued from a given
//! [`Prefix`], and keeps the computed ones as prefixes when asked. Many records run together:
//! their distinct states in passes grouped by length, each pass with its records' branches
//! (in one pass over the layers where every state fits in one `prefill_chunk`,
//! [`SplitBatch`](kev_kernels::SplitBatch)). The row form, which runs `state ++ branch_j` for
//! each question, is the reference the tests check this against ([`crate::reference`]).
//!
//! This module is the public face: encoding, checking prefixes and results. Loading is in
//! `load`, what each pass runs in `plan`, running it in `executor` (replayed as a CUDA graph
//! where one serves, `graphs`).

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device};
use kev_core::{Checkpoint, Encoder, Encoding, Error, LoadOptions, Record, Result};
use rayon::prelude::*;

use crate::device::recovered;
use crate::executor::Executor;
use crate::graphs::GraphStats;
use crate::head::{softmax, PointerHead};
use crate::plan::Plan;
use crate::qwen35::{Cache, Model};
use crate::weights::Quantization;

mod load;

pub use crate::encoded::{EncodedRecord, Scored};
pub use crate::identity::ModelId;
pub use crate::plan::StateLoad;
pub use crate::prefix::Prefix;
pub use load::LoadBreakdown;

/// A Kev decision model: backbone (adapter folded in), pointer head and encoder.
///
/// Immutable after loading; every method takes `&self`, so one model can serve many threads.
pub struct DecisionModel {
    /// Runs plans: the backbone, the head, the piece length and the CUDA graphs.
    pub(crate) exec: Executor,
    encoder: Encoder,
    checkpoint: Checkpoint,
    breakdown: LoadBreakdown,
    id: ModelId,
    options: LoadOptions,
}

impl DecisionModel {
    /// Loads the checkpoint in `dir` (a folder with `kev.json`).
    pub fn load(dir: impl AsRef<Path>, options: &LoadOptions) -> Result<Self> {
        let loaded = load::load(dir.as_ref(), options)?;
        Ok(Self {
            exec: loaded.executor,
            encoder: loaded.encoder,
            checkpoint: loaded.checkpoint,
            breakdown: loaded.breakdown,
            id: loaded.id,
            options: options.clone(),
        })
    }

    /// This model's fingerprint: the same for two loads of the same files with the same numeric
    /// settings ([`ModelId`]). Prefixes carry it and are refused by other models.
    pub fn id(&self) -> ModelId {
        self.id
    }

    /// The options it was loaded with.
    pub fn options(&self) -> &LoadOptions {
        &self.options
    }

    /// Where the load's time went, for finding what makes a load slow.
    pub fn load_breakdown(&self) -> &LoadBreakdown {
        &self.breakdown
    }

    /// The checkpoint this model was loaded from.
    pub fn checkpoint(&self) -> &Checkpoint {
        &self.checkpoint
    }

    /// The pointer head.
    pub fn head(&self) -> &PointerHead {
        self.exec.head()
    }

    /// The dtype of the backbone's weights (projections and embedding table): the activations'
    /// but in the CPU's bf16 mode (on CPUs with AVX512-BF16), where bf16 weights run with f32
    /// activations, and in the `int8` dtype (int8 projections, f32 activations and embedding
    /// table).
    pub fn weights_dtype(&self) -> kev_core::DType {
        let model = self.exec.model();
        match model.weights_dtype() {
            _ if model.quantization() == Quantization::Int8 => kev_core::DType::Int8,
            _ if model.quantization() == Quantization::Fp8 => kev_core::DType::Fp8,
            DType::BF16 => kev_core::DType::BF16,
            DType::F16 => kev_core::DType::F16,
            _ => kev_core::DType::F32,
        }
    }

    /// The activations' dtype: [`DecisionModel::weights_dtype`] but in the CPU's bf16 and int8
    /// modes (f32).
    pub fn activation_dtype(&self) -> DType {
        self.exec.model().dtype()
    }

    /// The device everything runs on.
    pub fn device(&self) -> &Device {
        self.exec.device()
    }

    /// The backbone.
    pub fn backbone(&self) -> &Model {
        self.exec.model()
    }

    /// The encoder (tokenizer, template, markers).
    pub fn encoder(&self) -> &Encoder {
        &self.encoder
    }

    /// Token ids, segments and positions of `record` (docs/CONTRACT.md §2).
    pub fn encode(&self, record: &Record) -> Result<Encoding> {
        self.encoder.encode(record, None)
    }

    /// `record` encoded for [`DecisionModel::run`] (validated as [`DecisionModel::encode`]
    /// validates it); `line`: the input line it was read from, which its errors name.
    pub fn encode_record(&self, record: &Record, line: Option<usize>) -> Result<EncodedRecord> {
        let (state_ids, rows) = self.encoder.encode(record, line)?.rows();
        Ok(EncodedRecord {
            id: record.id.clone(),
            state: record.state.clone(),
            state_ids,
            rows,
        })
    }

    /// [`DecisionModel::encode_record`] for each of `records`, in parallel: tokenizing takes
    /// about 0.35 ms a record (0.8B on the H200's host), a tenth of an 8-record batch's time when
    /// done one after another. One record is encoded on this thread (waking the pool costs more
    /// than it saves). The error is the first failing record's in input order, with its index.
    pub fn encode_records(
        &self,
        records: &[Record],
    ) -> std::result::Result<Vec<EncodedRecord>, (usize, Error)> {
        let one = |(i, r): (usize, &Record)| self.encode_record(r, None).map_err(|e| (i, e));
        if records.len() == 1 {
            return records.iter().enumerate().map(one).collect();
        }
        // Collected whole, then the first error in order (rayon's collect into a Result would
        // give any one of several).
        let encoded: Vec<_> = records.par_iter().enumerate().map(one).collect();
        encoded.into_iter().collect()
    }

    /// The tokens [`DecisionModel::run`] computes for a batch, padding included: its computed
    /// states (`cold`, one [`StateLoad`] per distinct state, with the branch rows that continue
    /// it) in the passes this model groups them into, and the rows continuing given prefixes
    /// (`given`: how many, the longest's tokens) joining the last. What a batcher budgets.
    pub fn batch_tokens(&self, cold: &[StateLoad], given: (usize, usize)) -> usize {
        crate::plan::batch_tokens(cold, given, self.exec.grouping())
    }

    /// How the CUDA graphs have fared (all zero off CUDA).
    pub fn graph_stats(&self) -> GraphStats {
        self.exec.graph_stats()
    }

    /// Scores encoded `records`: the one entry point every other scoring method goes through.
    ///
    /// `prefixes` is empty (every state is computed) or has one entry per record: `Some` a
    /// prefix of the record's state (the same token ids, from this model), whose state then does
    /// not run again. The computed states run in passes grouped by length, each distinct state
    /// once ([`DecisionModel::batch_tokens`] counts them), each pass with its records' branches; the
    /// records with a given prefix join the last pass, their branches continuing the prefixes'
    /// rows (or make a pass of their own where no state is computed). With `keep`, each
    /// computed state comes back as a prefix for reuse. On CUDA, a pass whose token shapes were
    /// seen before and that keeps nothing replays a CUDA graph ([`LoadOptions::cuda_graphs`]).
    /// Equal to scoring the records one by one.
    ///
    /// Errors: [`Error::InvalidArgument`] when `prefixes` is neither empty nor one per record,
    /// [`Error::Prefix`] when a prefix is not of its record's state or another model computed
    /// it, [`Error::NonFinite`] naming the first record whose logits or probabilities are not
    /// finite.
    pub fn run(
        &self,
        records: &[EncodedRecord],
        prefixes: &[Option<Arc<Prefix>>],
        keep: bool,
    ) -> Result<Vec<Scored>> {
        if !prefixes.is_empty() && prefixes.len() != records.len() {
            return Err(Error::invalid_argument(
                "prefixes",
                format!("{} prefixes for {} records", prefixes.len(), records.len()),
            ));
        }
        for (i, (rec, prefix)) in records.iter().zip(prefixes).enumerate() {
            if let Some(p) = prefix {
                self.check_prefix(p, rec, i)?;
            }
        }
        if records.is_empty() {
            return Ok(Vec::new());
        }
        let exec = &self.exec;
        let pads = |s, t| exec.pads_widths(s, t);
        let plan = Plan::new(
            records,
            prefixes,
            keep,
            exec.prefill_chunk(),
            exec.grouping(),
            &pads,
        );
        let outs = recovered(self.device(), self.exec.run(&plan))?;
        let (logits, kept): (Vec<_>, Vec<_>) = outs.into_iter().map(|o| (o.logits, o.kept)).unzip();
        // Each kept state's cache, made a prefix once for the records that share it.
        let mut kept: Vec<Vec<Option<Cache>>> = kept
            .into_iter()
            .map(|k| k.into_iter().map(Some).collect())
            .collect();
        let mut made: Vec<Vec<Option<Arc<Prefix>>>> =
            kept.iter().map(|k| vec![None; k.len()]).collect();
        records
            .iter()
            .zip(plan.per_record(&logits))
            .enumerate()
            .map(|(i, (rec, out))| {
                let probs = finite_probs(rec, i, &out.logits)?;
                let (p, row) = out.state;
                let (prefix, reused) = match prefixes.get(i).and_then(Option::as_ref) {
                    Some(given) => (Some(Arc::clone(given)), true),
                    None if keep => {
                        let prefix = match &made[p][row] {
                            Some(prefix) => Arc::clone(prefix),
                            None => {
                                let cache = kept[p][row].take().expect("each kept row once");
                                let prefix = Arc::new(Prefix::new(
                                    self.id,
                                    rec.state.clone(),
                                    rec.state_ids.clone(),
                                    cache,
                                ));
                                made[p][row] = Some(Arc::clone(&prefix));
                                prefix
                            }
                        };
                        (Some(prefix), false)
                    }
                    None => (None, false),
                };
                Ok(Scored {
                    logits: out.logits,
                    probs,
                    prefix,
                    reused,
                })
            })
            .collect()
    }

    /// [`Error::Prefix`] unless `prefix` was computed by this model for `rec`'s state (record
    /// `index` of a batch).
    fn check_prefix(&self, prefix: &Prefix, rec: &EncodedRecord, index: usize) -> Result<()> {
        prefix.check_model(self.id, &format!("the prefix given for record {index}"))?;
        if prefix.state_ids() != rec.state_ids {
            return Err(Error::Prefix {
                message: format!(
                    "the prefix given for record {index} (`{}`) was computed for another state ({} tokens) than the record's ({} tokens)",
                    rec.id.as_deref().unwrap_or("<no id>"),
                    prefix.len(),
                    rec.state_ids.len()
                ),
            });
        }
        Ok(())
    }

    /// [`DecisionModel::run`] on one record.
    fn run_one(&self, record: &Record, prefix: Option<&Arc<Prefix>>, keep: bool) -> Result<Scored> {
        let encoded = self.encode_record(record, None)?;
        let prefixes = prefix
            .map(|p| vec![Some(Arc::clone(p))])
            .unwrap_or_default();
        Ok(self.run(&[encoded], &prefixes, keep)?.remove(0))
    }

    /// Probabilities per question.
    pub fn probs(&self, record: &Record) -> Result<Vec<Vec<f32>>> {
        Ok(self.run_one(record, None, false)?.probs)
    }

    /// Probabilities per question, and the state's prefix for reuse.
    pub fn probs_and_prefix(&self, record: &Record) -> Result<(Vec<Vec<f32>>, Arc<Prefix>)> {
        let scored = self.run_one(record, None, true)?;
        let prefix = scored.prefix.expect("a kept state comes back as a prefix");
        Ok((scored.probs, prefix))
    }

    /// Probabilities per question, reusing `prefix` (which must come from the same state).
    pub fn probs_with_prefix(
        &self,
        record: &Record,
        prefix: &Arc<Prefix>,
    ) -> Result<Vec<Vec<f32>>> {
        Ok(self.run_one(record, Some(prefix), false)?.probs)
    }

    /// Runs the state text `state` once into a prefix.
    pub fn prefix(&self, state: &str) -> Result<Arc<Prefix>> {
        let encoded = EncodedRecord {
            id: None,
            state: state.to_string(),
            state_ids: self.encoder.encode_state(state)?,
            rows: Vec::new(),
        };
        let scored = self.run(&[encoded], &[], true)?.remove(0);
        Ok(scored.prefix.expect("a kept state comes back as a prefix"))
    }

    /// Probabilities for many records at once, as [`DecisionModel::run`] computes them (the
    /// records encoded in parallel first; the first invalid one in input order is refused before
    /// any runs). Equal to scoring them one by one.
    pub fn probs_batch(&self, records: &[Record]) -> Result<Vec<Vec<Vec<f32>>>> {
        let encoded = self.encode_records(records).map_err(|(_, e)| e)?;
        Ok(self
            .run(&encoded, &[], false)?
            .into_iter()
            .map(|s| s.probs)
            .collect())
    }
}

/// Each question's softmax, refusing logits or probabilities that are not finite (NaN or
/// infinity from the weights or the activations): an [`Error::NonFinite`] naming the record,
/// never output.
fn finite_probs(rec: &EncodedRecord, index: usize, logits: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
    let probs: Vec<Vec<f32>> = logits.iter().map(|l| softmax(l)).collect();
    let bad = |x: &[Vec<f32>]| x.iter().position(|l| !l.iter().all(|v| v.is_finite()));
    match bad(logits).or_else(|| bad(&probs)) {
        None => Ok(probs),
        Some(question) => Err(Error::NonFinite {
            id: rec.id.clone(),
            index,
            question,
        }),
    }
}
