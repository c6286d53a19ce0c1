//! [`DecisionModel`]: a Kev checkpoint loaded for scoring (docs/CONTRACT.md §3, §6).
//!
//! Two forms compute the same numbers. The row form runs `state ++ branch_j` for each question
//! (the reference). The prefix form runs the state once into a [`Cache`], then all branches as
//! one right-padded batch on copies of that cache; a [`Prefix`] can be kept and reused by the
//! next record with the same state. [`DecisionModel::probs_batch`] does the same for many
//! records at once: their states as one padded batch, then all their branches as one batch.
//! Where every state fits in one `prefill_chunk`, both parts run in a single pass over the
//! layers ([`Split`]), each branch row continuing its state row within every layer.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use kev_core::{Checkpoint, Encoder, Encoding, Error, LoadOptions, Record, Result, Row};
use kev_kernels::{RowIndex, SplitRows};
use rayon::prelude::*;

use crate::device::{recovered, select_device, select_dtype, settle};
use crate::head::{softmax, PointerHead};
use crate::lora::Adapter;
use crate::qwen35::{Cache, Config, Model, Split};
use crate::weights::Weights;

mod prefixed;
pub use prefixed::{EncodedRecord, Prefixed};

/// Token id used to right-pad branches and states (never read: both layer kinds are causal and
/// padded positions are masked out of later attention).
const PAD_ID: u32 = 0;

/// A Kev decision model: backbone (adapter folded in), pointer head and encoder.
///
/// Immutable after loading; every method takes `&self`, so one model can serve many threads.
pub struct DecisionModel {
    model: Model,
    head: PointerHead,
    encoder: Encoder,
    checkpoint: Checkpoint,
    /// Longest piece one forward pass runs ([`LoadOptions::prefill_chunk`]).
    prefill_chunk: usize,
    /// Forwards (one record or a batch) replayed as CUDA graphs ([`LoadOptions::cuda_graphs`]).
    #[cfg(feature = "cuda")]
    graphs: Option<crate::graphs::Graphs>,
}

/// One forward's token ids: `lengths.len()` rows right-padded to `width`, flattened.
pub(crate) struct Piece {
    ids: Vec<u32>,
    width: usize,
    lengths: Vec<usize>,
}

/// What scoring records in prefix form runs: the states' pieces (one row per record) into a
/// fresh cache, then all branches' pieces as one batch, each branch row on a copy of its
/// record's cache row, then the head at each row's positions. With one piece each, both run in
/// one pass over the layers instead ([`Split`]).
pub(crate) struct Plan {
    state: Vec<Piece>,
    /// Records, so rows of the state cache (its pieces are empty when every state is).
    records: usize,
    branches: Vec<Piece>,
    /// The record (state row) of each branch row.
    owners: Vec<usize>,
    rows: Vec<Row>,
}

/// A [`Plan`] without its token ids: plans of equal shape run the same kernels on the same
/// shapes with the same host-built inputs, so one CUDA graph serves them all.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Clone, PartialEq, Eq, Hash)]
pub(crate) struct PlanShape {
    state_pieces: usize,
    records: usize,
    pieces: Vec<(usize, Vec<usize>)>,
    owners: Vec<usize>,
    heads: Vec<(usize, Vec<usize>)>,
}

impl Plan {
    /// The state's pieces, then the branches'.
    pub(crate) fn pieces(&self) -> impl Iterator<Item = &Piece> {
        self.state.iter().chain(&self.branches)
    }

    /// Token positions computed (padding included).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn tokens(&self) -> usize {
        self.pieces().map(|p| p.width * p.lengths.len()).sum()
    }

    /// Token positions of the longest row: a state (padded) and a branch (padded).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn row_positions(&self) -> usize {
        self.pieces().map(|p| p.width).sum()
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn shape(&self) -> PlanShape {
        PlanShape {
            state_pieces: self.state.len(),
            records: self.records,
            owners: self.owners.clone(),
            pieces: self
                .pieces()
                .map(|p| (p.width, p.lengths.clone()))
                .collect(),
            heads: self
                .rows
                .iter()
                .map(|r| (r.decide, r.opts.clone()))
                .collect(),
        }
    }
}

/// A state run once through the backbone, reusable for any record with the same state.
pub struct Prefix {
    state: String,
    state_ids: Vec<u32>,
    cache: Cache,
}

impl Prefix {
    /// The state text this prefix was computed from.
    pub fn state(&self) -> &str {
        &self.state
    }

    /// Number of state tokens.
    pub fn len(&self) -> usize {
        self.state_ids.len()
    }

    /// Whether the state encoded to no tokens at all.
    pub fn is_empty(&self) -> bool {
        self.state_ids.is_empty()
    }
}

fn backend_err(context: &str) -> impl Fn(candle_core::Error) -> Error + '_ {
    move |e| Error::backend(context.to_string(), e)
}

impl DecisionModel {
    /// Loads the checkpoint in `dir` (a folder with `kev.json`).
    pub fn load(dir: impl AsRef<Path>, options: &LoadOptions) -> Result<Self> {
        options.validate()?;
        let checkpoint = Checkpoint::open(dir)?;
        let device = select_device(options.backend)?;
        let dtype = select_dtype(options.dtype, &device);
        // The CPU's bf16 mode where it has AVX512-BF16: the projections and the embedding table
        // in bf16, the activations in f32 between the matmuls (as llama.cpp's bf16 models),
        // since its bf16 matmul takes f32 rows and the rest of the forward is faster in f32.
        let (dtype, weights_dtype) =
            if device.is_cpu() && dtype == DType::BF16 && kev_kernels::bf16_gemm_available() {
                (DType::F32, DType::BF16)
            } else {
                (dtype, dtype)
            };
        let cfg = Config::from_file(&checkpoint.base.config)?;
        let adapter = match (
            checkpoint.adapter_config_path(),
            checkpoint.adapter_weights_path(),
        ) {
            (Some(c), Some(w)) => Some(Adapter::load(&c, &w)?),
            _ => None,
        };
        let weights = Weights::open(
            &checkpoint.base.weights,
            adapter,
            options.lora_scale,
            dtype,
            device.clone(),
        )?
        .with_projection_dtype(weights_dtype);
        let model = Model::new(&cfg, &weights)?;
        weights.check_all_used()?;
        let head_cfg = &checkpoint.config.head;
        let head = PointerHead::load(
            &checkpoint.head_path,
            head_cfg.dim,
            cfg.hidden_size,
            head_cfg.temperature,
            &device,
        )?;
        let encoder = checkpoint.encoder()?;
        // Every id the tokenizer can produce needs an embedding row; checked here, not when a
        // record first meets the token.
        let max_id = encoder.max_token_id() as usize;
        if max_id >= cfg.vocab_size {
            return Err(Error::Tokenizer {
                path: Some(encoder.tokenizer_path().to_path_buf()),
                message: format!(
                    "token id {max_id} has no embedding: the model's `vocab_size` is {} (`{}`)",
                    cfg.vocab_size,
                    checkpoint.base.config.display()
                ),
            });
        }
        settle(&device)?;
        crate::device::release_freed_memory();
        Ok(Self {
            #[cfg(feature = "cuda")]
            graphs: (options.cuda_graphs && device.is_cuda()).then(crate::graphs::Graphs::default),
            model,
            head,
            encoder,
            checkpoint,
            prefill_chunk: options.prefill_chunk,
        })
    }

    /// The checkpoint this model was loaded from.
    pub fn checkpoint(&self) -> &Checkpoint {
        &self.checkpoint
    }

    /// The pointer head.
    pub fn head(&self) -> &PointerHead {
        &self.head
    }

    /// The backbone dtype: of its weights and activations, but for the CPU's bf16 mode (on CPUs
    /// with AVX512-BF16), where bf16 weights run with f32 activations.
    pub fn dtype(&self) -> DType {
        self.model.weights_dtype()
    }

    /// The activations' dtype: [`DecisionModel::dtype`] but for the CPU's bf16 mode (f32).
    pub fn activation_dtype(&self) -> DType {
        self.model.dtype()
    }

    /// The device everything runs on.
    pub fn device(&self) -> &Device {
        self.model.device()
    }

    /// The backbone.
    pub fn backbone(&self) -> &Model {
        &self.model
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
            .logits_per_record(self.plan(vec![(state, rows)]))?
            .remove(0);
        check_finite(record, 0, &logits)?;
        Ok(logits)
    }

    /// The plan scoring `records` (each a state and its rows) in one go.
    fn plan(&self, records: Vec<(Vec<u32>, Vec<Row>)>) -> Plan {
        let states: Vec<&[u32]> = records.iter().map(|(s, _)| s.as_slice()).collect();
        let state = self.pieces(&states);
        let owners: Vec<usize> = records
            .iter()
            .enumerate()
            .flat_map(|(i, (_, rows))| std::iter::repeat_n(i, rows.len()))
            .collect();
        let records_n = records.len();
        let rows: Vec<Row> = records.into_iter().flat_map(|(_, rows)| rows).collect();
        let branch_ids: Vec<&[u32]> = rows.iter().map(|r| r.ids.as_slice()).collect();
        Plan {
            state,
            records: records_n,
            branches: self.pieces(&branch_ids),
            owners,
            rows,
        }
    }

    /// Runs `plan` (replaying a CUDA graph where one serves) and cuts its logits per record and
    /// question.
    fn logits_per_record(&self, plan: Plan) -> Result<Vec<Vec<Vec<f32>>>> {
        #[cfg(feature = "cuda")]
        let flat = match (&self.graphs, self.device()) {
            (Some(graphs), Device::Cuda(dev)) => graphs.logits(self, &plan, dev),
            _ => self.plan_logits_eager(&plan),
        };
        #[cfg(not(feature = "cuda"))]
        let flat = self.plan_logits_eager(&plan);
        let flat = recovered(self.device(), flat)?;
        let mut out: Vec<Vec<Vec<f32>>> = vec![Vec::new(); plan.records];
        for (owner, l) in plan.owners.iter().zip(split_logits(&flat, &plan.rows)) {
            out[*owner].push(l);
        }
        Ok(out)
    }

    /// How the CUDA graphs of [`DecisionModel::forward`] have fared (all zero off CUDA).
    pub fn graph_stats(&self) -> crate::graphs::GraphStats {
        #[cfg(feature = "cuda")]
        if let Some(graphs) = &self.graphs {
            return graphs.stats();
        }
        crate::graphs::GraphStats::default()
    }

    /// The token ids of `piece` on the device (always a copy: they are a graph's inputs).
    pub(crate) fn upload_ids(&self, piece: &Piece) -> Result<Tensor> {
        Tensor::from_vec(
            piece.ids.clone(),
            (piece.lengths.len(), piece.width),
            self.device(),
        )
        .map_err(backend_err("token ids"))
    }

    /// [`DecisionModel::plan_logits`] with fresh uploads, read back.
    pub(crate) fn plan_logits_eager(&self, plan: &Plan) -> Result<Vec<f32>> {
        self.plan_logits(plan, &self.upload_all(plan.pieces())?)?
            .to_vec1::<f32>()
            .map_err(backend_err("pointer head"))
    }

    /// Runs `plan` with `ids` (one tensor per piece, [`Plan::pieces`] order) and returns all
    /// options' logits `[M]` on the device, waiting for nothing.
    pub(crate) fn plan_logits(&self, plan: &Plan, ids: &[Tensor]) -> Result<Tensor> {
        if let ([state], [branches]) = (&plan.state[..], &plan.branches[..]) {
            // One piece each (every state within `prefill_chunk`): one pass over the layers, the
            // last layer's MLP only on the rows the head reads.
            let (decide, opts, owner) = head_positions(&plan.rows, branches.width);
            let picked: Vec<usize> = decide.iter().chain(&opts).map(|&i| i as usize).collect();
            let hidden = SplitRows::new(
                state.width,
                state.lengths.clone(),
                branches.width,
                branches.lengths.clone(),
                plan.owners.clone(),
            )
            .and_then(|rows| Split::new(rows, self.device()))
            .and_then(|split| {
                let picked = RowIndex::new(&picked, self.device())?;
                self.model
                    .forward_split(&ids[0], &ids[1], &split, Some(&picked))
            })
            .map_err(backend_err("backbone forward"))?;
            let err = backend_err("pointer head");
            let n = decide.len();
            let decide = hidden.narrow(0, 0, n).map_err(&err)?;
            let opts = hidden.narrow(0, n, opts.len()).map_err(&err)?;
            return self
                .head
                .logits_on_device(&decide, &opts, &owner)
                .map_err(&err);
        }
        let (state_ids, branch_ids) = ids.split_at(plan.state.len());
        let cache = self.state_cache(plan.records, &plan.state, state_ids)?;
        self.branch_logits(&cache, &plan.owners, &plan.branches, branch_ids, &plan.rows)
    }

    /// A fresh cache of `rows` rows after `pieces` (the states; none: an empty state).
    fn state_cache(&self, rows: usize, pieces: &[Piece], ids: &[Tensor]) -> Result<Cache> {
        let mut cache = self
            .model
            .new_cache(rows)
            .map_err(backend_err("state cache"))?;
        if !pieces.is_empty() {
            self.run_pieces(pieces, ids, &mut cache)?;
        }
        Ok(cache)
    }

    /// `pieces` (the branches), row i continuing row `owners[i]` of `cache` (on a copy), then
    /// the head: all options' logits `[M]` on the device.
    fn branch_logits(
        &self,
        cache: &Cache,
        owners: &[usize],
        pieces: &[Piece],
        ids: &[Tensor],
        rows: &[Row],
    ) -> Result<Tensor> {
        let mut branch_cache = cache
            .select_rows(owners)
            .map_err(backend_err("copying the prefix cache"))?;
        let hidden = self.run_pieces(pieces, ids, &mut branch_cache)?;
        self.head_logits(&hidden, rows)
    }

    /// Every piece's token ids on the device.
    pub(crate) fn upload_all<'a>(
        &self,
        pieces: impl IntoIterator<Item = &'a Piece>,
    ) -> Result<Vec<Tensor>> {
        pieces.into_iter().map(|p| self.upload_ids(p)).collect()
    }

    /// Logits per question in row form: `state ++ branch_j` run on its own for each question.
    /// Slower; this is the reference the prefix form is checked against.
    pub fn forward_rows(&self, record: &Record) -> Result<Vec<Vec<f32>>> {
        let (state, rows) = self.encode(record)?.rows();
        let logits = rows
            .iter()
            .map(|row| {
                let ids: Vec<u32> = state.iter().chain(&row.ids).copied().collect();
                let mut cache = self.model.new_cache(1).map_err(backend_err("row form"))?;
                let hidden = self.run(&[ids], &mut cache)?;
                let shifted = Row {
                    ids: row.ids.clone(),
                    decide: row.decide + state.len(),
                    opts: row.opts.iter().map(|o| o + state.len()).collect(),
                };
                Ok(self.read_head(&hidden, &[shifted])?.remove(0))
            })
            .collect();
        recovered(self.device(), logits)
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
        let pieces = self.pieces(std::slice::from_ref(&state_ids));
        let cache = recovered(
            self.device(),
            self.upload_all(&pieces)
                .and_then(|ids| self.state_cache(1, &pieces, &ids)),
        )?;
        Ok(Prefix {
            state: state.to_string(),
            state_ids,
            cache,
        })
    }

    /// Probabilities for many records at once: states of similar length as one padded batch
    /// ([`length_buckets`]), then their branches as one padded batch (in one pass over the layers
    /// where every state fits in one `prefill_chunk`). Equal to scoring them one by one. On CUDA, a batch whose token shapes
    /// were seen before replays a CUDA graph, as [`DecisionModel::forward`] does.
    pub fn probs_batch(&self, records: &[Record]) -> Result<Vec<Vec<Vec<f32>>>> {
        if records.is_empty() {
            return Ok(Vec::new());
        }
        // Records are encoded in parallel: tokenizing takes about 0.35 ms per record (0.8B on
        // the H200's host), a tenth of the 8-record batch's time when done one after another.
        // A single record's pieces stay sequential: waking the pool cost more than it saved.
        // The first failing record in input order is the error.
        let encoded: Vec<Result<(Vec<u32>, Vec<Row>)>> = records
            .par_iter()
            .map(|r| self.encode(r).map(|e| e.rows()))
            .collect();
        let encoded = encoded.into_iter().collect::<Result<Vec<_>>>()?;
        let logits = self.grouped_logits(encoded)?;
        records
            .iter()
            .zip(&logits)
            .enumerate()
            .map(|(i, (record, questions))| probabilities(record, i, questions))
            .collect()
    }

    /// Logits per record and question of `records` (each a state and its rows), records of
    /// similar state length run as one plan ([`length_buckets`]).
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
            for (i, l) in bucket.iter().zip(self.logits_per_record(self.plan(group))?) {
                logits[*i] = l;
            }
        }
        Ok(logits)
    }

    fn logits_and_prefix(
        &self,
        record: &Record,
        given: Option<&Prefix>,
    ) -> Result<(Vec<Vec<f32>>, Option<Prefix>)> {
        let (state, rows) = self.encode(record)?.rows();
        let computed = match given {
            Some(prefix) => {
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
        let pieces = self.pieces(&ids);
        let owners = vec![0; rows.len()];
        let logits = self
            .upload_all(&pieces)
            .and_then(|ids| self.branch_logits(cache, &owners, &pieces, &ids, rows))
            .and_then(|logits| read_per_row(&logits, rows));
        recovered(self.device(), logits)
    }

    /// Right-pads `seqs` into `[B, T]` and cuts it into pieces of at most `prefill_chunk` steps.
    fn pieces<S: AsRef<[u32]>>(&self, seqs: &[S]) -> Vec<Piece> {
        let width = seqs.iter().map(|s| s.as_ref().len()).max().unwrap_or(0);
        (0..width)
            .step_by(self.prefill_chunk)
            .map(|start| {
                let end = (start + self.prefill_chunk).min(width);
                let rows: Vec<&[u32]> = seqs
                    .iter()
                    .map(|s| {
                        let s = s.as_ref();
                        &s[start.min(s.len())..end.min(s.len())]
                    })
                    .collect();
                Piece {
                    ids: rows
                        .iter()
                        .flat_map(|p| {
                            p.iter()
                                .copied()
                                .chain(std::iter::repeat_n(PAD_ID, end - start - p.len()))
                        })
                        .collect(),
                    width: end - start,
                    lengths: rows.iter().map(|p| p.len()).collect(),
                }
            })
            .collect()
    }

    /// Runs `seqs` after `cache` ([`DecisionModel::pieces`]); returns the hidden states `[B, T, H]`.
    fn run(&self, seqs: &[Vec<u32>], cache: &mut Cache) -> Result<Tensor> {
        let pieces = self.pieces(seqs);
        self.run_pieces(&pieces, &self.upload_all(&pieces)?, cache)
    }

    /// Runs `pieces` (their ids on the device in `ids`) one after the other through `cache`.
    fn run_pieces(&self, pieces: &[Piece], ids: &[Tensor], cache: &mut Cache) -> Result<Tensor> {
        let mut hidden = Vec::with_capacity(pieces.len());
        for (piece, ids) in pieces.iter().zip(ids) {
            let padded = piece.lengths.iter().any(|&l| l != piece.width);
            let h = self
                .model
                .forward(ids, cache, padded.then_some(piece.lengths.as_slice()))
                .map_err(backend_err("backbone forward"))?;
            hidden.push(h);
        }
        if hidden.len() == 1 {
            return Ok(hidden.remove(0));
        }
        Tensor::cat(&hidden, 1).map_err(backend_err("joining prefill pieces"))
    }

    /// Reads the head at each row's `decide` and `opts` positions of `hidden: [B, T, H]`.
    fn read_head(&self, hidden: &Tensor, rows: &[Row]) -> Result<Vec<Vec<f32>>> {
        read_per_row(&self.head_logits(hidden, rows)?, rows)
    }

    /// All rows' option logits `[M]` (f32, on the device) from `hidden: [B, T, H]`.
    fn head_logits(&self, hidden: &Tensor, rows: &[Row]) -> Result<Tensor> {
        let err = backend_err("pointer head");
        let (_, width, h) = hidden.dims3().map_err(&err)?;
        let flat = hidden.reshape(((), h)).map_err(&err)?;
        let (decide, opts, owner) = head_positions(rows, width);
        let pick = |idx: Vec<u32>| -> candle_core::Result<Tensor> {
            let n = idx.len();
            flat.index_select(&kev_kernels::uploads::upload(idx, n, self.device())?, 0)
        };
        self.head
            .logits_on_device(
                &pick(decide).map_err(&err)?,
                &pick(opts).map_err(&err)?,
                &owner,
            )
            .map_err(&err)
    }
}

/// Padding a bucket's states to its longest may cost at most this fraction of its real tokens
/// (plus [`PAD_SLACK`]) before a longer state starts a new bucket.
const PAD_WASTE: f64 = 0.25;
/// Padding always allowed per bucket, in tokens: short states are cheap to pad and a pass has a
/// fixed cost of its own.
const PAD_SLACK: usize = 64;

/// Records grouped by state length (indices into `lengths`, each group one pass): a batch pads
/// every state to its longest, so mixing a 10-token state with a 1,000-token one would make the
/// batch slower than scoring one by one. Sorted by length, a record joins the current group while
/// the group's padded tokens stay within [`PAD_WASTE`] of its real ones plus [`PAD_SLACK`].
fn length_buckets(lengths: &[usize]) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by_key(|&i| lengths[i]);
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut real = 0usize;
    for i in order {
        let len = lengths[i];
        if let Some(bucket) = buckets.last_mut() {
            let padded = (bucket.len() + 1) * len;
            let real_then = real + len;
            if padded as f64 <= (1.0 + PAD_WASTE) * real_then as f64 + PAD_SLACK as f64 {
                bucket.push(i);
                real = real_then;
                continue;
            }
        }
        buckets.push(vec![i]);
        real = len;
    }
    buckets
}

/// The tokens the state passes of states of these `lengths` run, padding included: each group
/// of [`length_buckets`] padded to its longest. What a batch costs, for callers that budget
/// batches (a server's batcher).
pub fn state_pass_tokens(lengths: &[usize]) -> usize {
    length_buckets(lengths)
        .iter()
        .map(|group| group.len() * group.iter().map(|&i| lengths[i]).max().unwrap_or(0))
        .sum()
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

/// Where the head reads rows `rows` of width `width` (flat indices into their `B·width`
/// positions): each row's `[DECIDE]`, every row's options in order, and each option's row.
fn head_positions(rows: &[Row], width: usize) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let decide = rows
        .iter()
        .enumerate()
        .map(|(i, r)| (i * width + r.decide) as u32)
        .collect();
    let mut opts = Vec::new();
    let mut owner = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        opts.extend(r.opts.iter().map(|&o| (i * width + o) as u32));
        owner.extend(std::iter::repeat_n(i as u32, r.opts.len()));
    }
    (decide, opts, owner)
}

/// All options' logits `[M]` (on the device, in row order) read back and cut per row.
fn read_per_row(logits: &Tensor, rows: &[Row]) -> Result<Vec<Vec<f32>>> {
    let flat = logits
        .to_vec1::<f32>()
        .map_err(backend_err("pointer head"))?;
    Ok(split_logits(&flat, rows))
}

/// `flat` (all options' logits in row order) cut per row.
fn split_logits(flat: &[f32], rows: &[Row]) -> Vec<Vec<f32>> {
    let mut at = 0;
    rows.iter()
        .map(|r| {
            at += r.opts.len();
            flat[at - r.opts.len()..at].to_vec()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::length_buckets;

    #[test]
    fn buckets_keep_padding_bounded_and_cover_every_record_once() {
        assert!(length_buckets(&[]).is_empty());
        assert_eq!(length_buckets(&[100, 100, 100]), vec![vec![0, 1, 2]]);
        // Short states share a bucket (the slack); a long one does not join them.
        assert_eq!(
            length_buckets(&[10, 1000, 20, 30]),
            vec![vec![0, 2, 3], vec![1]]
        );
        let lengths: Vec<usize> = (0..200).map(|i| (i * 37) % 1100).collect();
        let buckets = length_buckets(&lengths);
        let mut seen: Vec<usize> = buckets.iter().flatten().copied().collect();
        seen.sort();
        assert_eq!(seen, (0..200).collect::<Vec<_>>());
        for b in &buckets {
            let real: usize = b.iter().map(|&i| lengths[i]).sum();
            let padded = b.len() * b.iter().map(|&i| lengths[i]).max().unwrap();
            assert!(padded as f64 <= 1.25 * real as f64 + 64.0, "{b:?}");
        }
    }
}
