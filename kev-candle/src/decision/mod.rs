//! [`DecisionModel`]: a Kev checkpoint loaded for scoring (docs/CONTRACT.md §3, §6).
//!
//! Two forms compute the same numbers. The row form runs `state ++ branch_j` for each question
//! (the reference). The prefix form runs the state once into a [`Cache`], then all branches as
//! one right-padded batch on copies of that cache; a [`Prefix`] can be kept and reused by the
//! next record with the same state. [`DecisionModel::probs_batch`] does the same for many
//! records at once: their states as one padded batch, then all their branches as one batch.
//! Where every state fits in one `prefill_chunk`, both parts run in a single pass over the
//! layers ([`SplitBatch`](kev_kernels::SplitBatch)), each branch row continuing its state row
//! within every layer.
//!
//! This module is the public face: encoding, grouping records and checking results. Loading is
//! in `load`, what each forward runs in `plan`, running it in `executor` (or as a CUDA graph,
//! `graphs`), and batches over cached prefixes in `prefixed`.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device};
use kev_core::{Checkpoint, Encoder, Encoding, Error, LoadOptions, Record, Result, Row};
use rayon::prelude::*;

use crate::device::recovered;
use crate::executor::{read_per_row, Executor};
use crate::graphs::GraphStats;
use crate::head::{softmax, PointerHead};
use crate::plan::{length_buckets, Plan};
use crate::qwen35::{Cache, Model};

mod identity;
mod load;
mod prefix;
mod prefixed;

pub use crate::plan::state_pass_tokens;
pub use identity::ModelId;
pub use load::LoadBreakdown;
pub use prefix::Prefix;
pub use prefixed::{EncodedRecord, Prefixed};

/// A Kev decision model: backbone (adapter folded in), pointer head and encoder.
///
/// Immutable after loading; every method takes `&self`, so one model can serve many threads.
pub struct DecisionModel {
    /// Runs plans: the backbone, the head and the piece length.
    exec: Executor,
    encoder: Encoder,
    checkpoint: Checkpoint,
    breakdown: LoadBreakdown,
    id: ModelId,
    options: LoadOptions,
    /// Forwards (one record or a batch) replayed as CUDA graphs ([`LoadOptions::cuda_graphs`]).
    #[cfg(feature = "cuda")]
    graphs: Option<crate::graphs::Graphs>,
}

impl DecisionModel {
    /// Loads the checkpoint in `dir` (a folder with `kev.json`).
    pub fn load(dir: impl AsRef<Path>, options: &LoadOptions) -> Result<Self> {
        let loaded = load::load(dir.as_ref(), options)?;
        Ok(Self {
            #[cfg(feature = "cuda")]
            graphs: (options.cuda_graphs && loaded.executor.device().is_cuda())
                .then(crate::graphs::Graphs::default),
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
    /// activations.
    pub fn weights_dtype(&self) -> DType {
        self.exec.model().weights_dtype()
    }

    /// The activations' dtype: [`DecisionModel::weights_dtype`] but in the CPU's bf16 mode (f32).
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

    /// Logits per question (prefix form). On CUDA, a record whose token shapes were seen before
    /// replays a CUDA graph ([`LoadOptions::cuda_graphs`]).
    pub fn forward(&self, record: &Record) -> Result<Vec<Vec<f32>>> {
        let (state, rows) = self.encode(record)?.rows();
        let logits = self
            .logits_per_record(self.exec.plan(vec![(state, rows)]))?
            .remove(0);
        check_finite(record, 0, &logits)?;
        Ok(logits)
    }

    /// Runs `plan` (replaying a CUDA graph where one serves) and cuts its logits per record and
    /// question.
    fn logits_per_record(&self, plan: Plan) -> Result<Vec<Vec<Vec<f32>>>> {
        #[cfg(feature = "cuda")]
        let flat = match (&self.graphs, self.device()) {
            (Some(graphs), Device::Cuda(dev)) => graphs.logits(&self.exec, &plan, dev),
            _ => self.exec.plan_logits_eager(&plan),
        };
        #[cfg(not(feature = "cuda"))]
        let flat = self.exec.plan_logits_eager(&plan);
        let flat = recovered(self.device(), flat)?;
        Ok(plan.logits_per_record(&flat))
    }

    /// How the CUDA graphs of [`DecisionModel::forward`] have fared (all zero off CUDA).
    pub fn graph_stats(&self) -> GraphStats {
        #[cfg(feature = "cuda")]
        if let Some(graphs) = &self.graphs {
            return graphs.stats();
        }
        GraphStats::default()
    }

    /// Logits per question in row form: `state ++ branch_j` run on its own for each question.
    /// Slower; this is the reference the prefix form is checked against.
    pub fn forward_rows(&self, record: &Record) -> Result<Vec<Vec<f32>>> {
        let (state, rows) = self.encode(record)?.rows();
        recovered(self.device(), self.exec.row_logits(&state, &rows))
    }

    /// Probabilities per question (prefix form).
    pub fn probs(&self, record: &Record) -> Result<Vec<Vec<f32>>> {
        probabilities(record, 0, &self.forward(record)?)
    }

    /// Probabilities per question, and the state's prefix for reuse.
    pub fn probs_and_prefix(&self, record: &Record) -> Result<(Vec<Vec<f32>>, Prefix)> {
        let (logits, prefix) = self.logits_and_prefix(record, None)?;
        let prefix = prefix.expect("a prefix is computed when none is given");
        Ok((probabilities(record, 0, &logits)?, prefix))
    }

    /// Probabilities per question, reusing `prefix` (which must come from the same state).
    pub fn probs_with_prefix(&self, record: &Record, prefix: &Prefix) -> Result<Vec<Vec<f32>>> {
        let (logits, _) = self.logits_and_prefix(record, Some(prefix))?;
        probabilities(record, 0, &logits)
    }

    /// Runs `record.state` once into a prefix.
    pub fn prefix(&self, state: &str) -> Result<Prefix> {
        self.prefix_of(state, self.encoder.encode_state(state)?)
    }

    /// Runs already-encoded state ids into a prefix.
    fn prefix_of(&self, state: &str, state_ids: Vec<u32>) -> Result<Prefix> {
        let pieces = self.exec.pieces(std::slice::from_ref(&state_ids));
        let cache = recovered(
            self.device(),
            self.exec
                .upload_all(&pieces)
                .and_then(|ids| self.exec.state_cache(1, &pieces, &ids)),
        )?;
        Ok(Prefix {
            model: self.id,
            state: state.to_string(),
            state_ids,
            cache,
        })
    }

    /// Probabilities for many records at once: states of similar length as one padded batch
    /// (`length_buckets`), then their branches as one padded batch (in one pass over the layers
    /// where every state fits in one `prefill_chunk`). Equal to scoring them one by one. On CUDA,
    /// a batch whose token shapes were seen before replays a CUDA graph, as
    /// [`DecisionModel::forward`] does.
    pub fn probs_batch(&self, records: &[Record]) -> Result<Vec<Vec<Vec<f32>>>> {
        if records.is_empty() {
            return Ok(Vec::new());
        }
        let encoded = self.encode_records(records).map_err(|(_, e)| e)?;
        let logits =
            self.grouped_logits(encoded.into_iter().map(|e| (e.state_ids, e.rows)).collect())?;
        records
            .iter()
            .zip(&logits)
            .enumerate()
            .map(|(i, (record, questions))| probabilities(record, i, questions))
            .collect()
    }

    /// Logits per record and question of `records` (each a state and its rows), records of
    /// similar state length run as one plan (`length_buckets`).
    fn grouped_logits(&self, records: Vec<(Vec<u32>, Vec<Row>)>) -> Result<Vec<Vec<Vec<f32>>>> {
        let lengths: Vec<usize> = records.iter().map(|(state, _)| state.len()).collect();
        let mut records: Vec<Option<(Vec<u32>, Vec<Row>)>> =
            records.into_iter().map(Some).collect();
        let mut logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(); records.len()];
        for bucket in length_buckets(&lengths) {
            let group = bucket
                .iter()
                .map(|&i| records[i].take().expect("each record is in one bucket"))
                .collect();
            for (i, l) in bucket
                .iter()
                .zip(self.logits_per_record(self.exec.plan(group))?)
            {
                logits[*i] = l;
            }
        }
        Ok(logits)
    }

    /// [`DecisionModel::encode_record`] for each of `records`, in parallel: tokenizing takes
    /// about 0.35 ms a record (0.8B on the H200's host), a tenth of an 8-record batch's time when
    /// done one after another. One record is encoded on this thread (waking the pool costs more
    /// than it saves). The error is the first failing record's in input order, with its index.
    pub fn encode_records(
        &self,
        records: &[Record],
    ) -> std::result::Result<Vec<EncodedRecord>, (usize, Error)> {
        let one = |(i, r): (usize, &Record)| self.encode_record(r).map_err(|e| (i, e));
        if records.len() == 1 {
            return records.iter().enumerate().map(one).collect();
        }
        // Collected whole, then the first error in order (rayon's collect into a Result would
        // give any one of several).
        let encoded: Vec<_> = records.par_iter().enumerate().map(one).collect();
        encoded.into_iter().collect()
    }

    /// Encodes `record` for [`DecisionModel::probs_prefixed`] (validating it as
    /// [`DecisionModel::encode`] does).
    pub fn encode_record(&self, record: &Record) -> Result<EncodedRecord> {
        self.encode_record_at(record, None)
    }

    /// [`DecisionModel::encode_record`] for a record read from input line `line`, which its
    /// errors name.
    pub fn encode_record_at(&self, record: &Record, line: Option<usize>) -> Result<EncodedRecord> {
        let (state_ids, rows) = self.encoder.encode(record, line)?.rows();
        Ok(EncodedRecord {
            id: record.id.clone(),
            state: record.state.clone(),
            state_ids,
            rows,
        })
    }

    /// Probabilities for encoded records as [`DecisionModel::probs_batch`] computes them (grouped
    /// by state length, each group in one pass where its states fit, replayed as a CUDA graph
    /// where one serves), keeping no prefix.
    pub fn probs_encoded(&self, records: &[EncodedRecord]) -> Result<Vec<Vec<Vec<f32>>>> {
        if records.is_empty() {
            return Ok(Vec::new());
        }
        let encoded = records
            .iter()
            .map(|r| (r.state_ids.clone(), r.rows.clone()))
            .collect();
        self.grouped_logits(encoded)?
            .iter()
            .zip(records)
            .enumerate()
            .map(|(i, (logits, rec))| prefixed::finite_probs(rec, i, logits))
            .collect()
    }

    /// Probabilities for `records`, where `prefixes[i]`, if given, is a prefix of record i's
    /// state (same token ids) and its state does not run again. The other records' states run
    /// in passes grouped by length (each distinct state once; [`state_pass_tokens`] counts them),
    /// then every record's branches run as one batch continuing their prefixes. Each result
    /// carries the record's prefix for reuse. Equal to scoring the records one by one.
    ///
    /// Errors: [`Error::InvalidArgument`] when the two slices differ in length,
    /// [`Error::Prefix`] when a prefix's token ids are not its record's state's or another model
    /// computed it.
    pub fn probs_prefixed(
        &self,
        records: &[EncodedRecord],
        prefixes: &[Option<Arc<Prefix>>],
    ) -> Result<Vec<Prefixed>> {
        if records.len() != prefixes.len() {
            return Err(Error::invalid_argument(
                "prefixes",
                format!("{} prefixes for {} records", prefixes.len(), records.len()),
            ));
        }
        if records.is_empty() {
            return Ok(Vec::new());
        }
        recovered(
            self.device(),
            prefixed::run_prefixed(&self.exec, self.id, records, prefixes),
        )
    }

    fn logits_and_prefix(
        &self,
        record: &Record,
        given: Option<&Prefix>,
    ) -> Result<(Vec<Vec<f32>>, Option<Prefix>)> {
        let (state, rows) = self.encode(record)?.rows();
        let computed = match given {
            Some(prefix) => {
                prefix.check_model(self.id, "the prefix")?;
                if prefix.state != record.state || prefix.state_ids != state {
                    return Err(Error::Prefix {
                        message: format!(
                            "the prefix was computed for another state ({} tokens) than record `{}`'s ({} tokens)",
                            prefix.state_ids.len(),
                            record.id.as_deref().unwrap_or("<no id>"),
                            state.len()
                        ),
                    });
                }
                None
            }
            None => Some(self.prefix_of(&record.state, state.clone())?),
        };
        let prefix = given.or(computed.as_ref()).expect("one of the two is set");
        let logits = self.branches(&prefix.cache, &rows)?;
        Ok((logits, computed))
    }

    /// Runs `rows` as one right-padded batch, each continuing (a copy of) the one state row of
    /// `cache`, and returns each row's logits.
    fn branches(&self, cache: &Cache, rows: &[Row]) -> Result<Vec<Vec<f32>>> {
        let ids: Vec<&[u32]> = rows.iter().map(|r| r.ids.as_slice()).collect();
        let pieces = self.exec.pieces(&ids);
        let owners = vec![0; rows.len()];
        let logits = self
            .exec
            .upload_all(&pieces)
            .and_then(|ids| self.exec.branch_logits(cache, &owners, &pieces, &ids, rows))
            .and_then(|logits| read_per_row(&logits, rows));
        recovered(self.device(), logits)
    }
}

/// Refuses logits that are not finite (NaN or infinity from the weights or the activations):
/// an [`Error::NonFinite`] naming the record, never output.
fn check_finite(record: &Record, index: usize, logits: &[Vec<f32>]) -> Result<()> {
    match logits.iter().position(|l| !l.iter().all(|x| x.is_finite())) {
        None => Ok(()),
        Some(question) => Err(Error::NonFinite {
            id: record.id.clone(),
            index,
            question,
        }),
    }
}

/// Each question's softmax, checked finite with its logits (see [`check_finite`]).
fn probabilities(record: &Record, index: usize, logits: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
    check_finite(record, index, logits)?;
    let probs: Vec<Vec<f32>> = logits.iter().map(|l| softmax(l)).collect();
    check_finite(record, index, &probs)?;
    Ok(probs)
}
