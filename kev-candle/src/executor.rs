//! [`Executor`]: runs plans eagerly on the device — the backbone over a plan's pieces into caches,
//! then the pointer head at the plan's positions.
//!
//! It holds only what running needs (no tokenizer, no checkpoint), so the CUDA graphs capture
//! and replay its runs without knowing the model they serve.

use candle_core::{Device, Tensor};
use kev_core::{Result, Row};
use kev_kernels::dispatch::{counted_cat, CountedTensor};
use kev_kernels::{gather_rows, RowIndex, SplitBatch};

use crate::device::backend_err;
use crate::head::PointerHead;
use crate::plan::{head_positions, pieces, split_logits, Piece, Plan};
use crate::qwen35::{Cache, Model};

/// A plan's inputs on the device: what differs between plans of one shape, so that a CUDA graph
/// captured on one of them serves the others once these are rewritten.
pub(crate) struct PlanInputs {
    /// Each piece's token ids, [`Plan::pieces`] order.
    pub(crate) ids: Vec<Tensor>,
    /// Where the head reads ([`Plan::head_reads`]), `[N]` u32.
    pub(crate) heads: Tensor,
}

/// The backbone and the head, and the longest piece one forward pass runs.
pub(crate) struct Executor {
    model: Model,
    head: PointerHead,
    /// Longest piece one forward pass runs ([`kev_core::LoadOptions::prefill_chunk`]).
    prefill_chunk: usize,
}

impl Executor {
    pub(crate) fn new(model: Model, head: PointerHead, prefill_chunk: usize) -> Self {
        Self {
            model,
            head,
            prefill_chunk,
        }
    }

    /// The backbone.
    pub(crate) fn model(&self) -> &Model {
        &self.model
    }

    /// The pointer head.
    pub(crate) fn head(&self) -> &PointerHead {
        &self.head
    }

    /// The device everything runs on (the backbone's; the head was loaded onto it).
    pub(crate) fn device(&self) -> &Device {
        self.model.device()
    }

    /// The plan scoring `records` (each a state and its rows), cut to this executor's pieces.
    pub(crate) fn plan(&self, records: Vec<(Vec<u32>, Vec<Row>)>) -> Plan {
        Plan::new(records, self.prefill_chunk)
    }

    /// `seqs` right-padded into `[B, T]` and cut into pieces of at most `prefill_chunk` steps.
    pub(crate) fn pieces<S: AsRef<[u32]>>(&self, seqs: &[S]) -> Vec<Piece> {
        pieces(seqs, self.prefill_chunk)
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

    /// Every piece's token ids on the device.
    pub(crate) fn upload_all<'a>(
        &self,
        pieces: impl IntoIterator<Item = &'a Piece>,
    ) -> Result<Vec<Tensor>> {
        pieces.into_iter().map(|p| self.upload_ids(p)).collect()
    }

    /// Where `plan`'s head reads ([`Plan::head_reads`]) on the device, as u32 (always a copy: a
    /// graph's input). Checked within the branch rows here, since a graph's replay reads them
    /// without the gathers' own checks.
    pub(crate) fn upload_heads(&self, plan: &Plan) -> Result<Tensor> {
        let (reads, _) = plan.head_reads();
        let positions: usize = plan
            .branches
            .first()
            .map_or(0, |p| p.lengths.len() * plan.branch_width());
        if let Some(bad) = reads.iter().find(|&&r| r >= positions) {
            return Err(kev_core::Error::Device {
                message: format!("head position {bad} outside the {positions} branch positions"),
            });
        }
        let reads = reads
            .into_iter()
            .map(u32::try_from)
            .collect::<std::result::Result<Vec<u32>, _>>()
            .map_err(|_| kev_core::Error::Device {
                message: "head positions: a batch over 2^32 token positions".to_string(),
            })?;
        let n = reads.len();
        Tensor::from_vec(reads, n, self.device()).map_err(backend_err("head positions"))
    }

    /// `plan`'s inputs on the device.
    pub(crate) fn upload_inputs(&self, plan: &Plan) -> Result<PlanInputs> {
        Ok(PlanInputs {
            ids: self.upload_all(plan.pieces())?,
            heads: self.upload_heads(plan)?,
        })
    }

    /// [`Executor::plan_logits`] with fresh uploads, read back.
    pub(crate) fn plan_logits_eager(&self, plan: &Plan) -> Result<Vec<f32>> {
        self.plan_logits(plan, &self.upload_inputs(plan)?)?
            .to_vec1::<f32>()
            .map_err(backend_err("pointer head"))
    }

    /// Runs `plan` with `inputs` ([`Executor::upload_inputs`]) and returns all options' logits
    /// `[M]` on the device, waiting for nothing.
    pub(crate) fn plan_logits(&self, plan: &Plan, inputs: &PlanInputs) -> Result<Tensor> {
        let (reads, owner) = plan.head_reads();
        let picked = RowIndex::on_device(inputs.heads.clone(), &reads)
            .map_err(backend_err("head positions"))?;
        let hidden = if let ([state], [branches]) = (&plan.state[..], &plan.branches[..]) {
            // One piece each (every state within `prefill_chunk`): one pass over the layers, the
            // last layer's MLP only on the rows the head reads.
            SplitBatch::new(
                state.width,
                state.lengths.clone(),
                branches.width,
                branches.lengths.clone(),
                plan.owners.clone(),
                self.device(),
            )
            .and_then(|split| {
                self.model
                    .forward_split(&inputs.ids[0], &inputs.ids[1], &split, Some(&picked))
            })
            .map_err(backend_err("backbone forward"))?
        } else {
            let (state_ids, branch_ids) = inputs.ids.split_at(plan.state.len());
            let cache = self.state_cache(plan.records, &plan.state, state_ids)?;
            let hidden = self.branch_hidden(&cache, &plan.owners, &plan.branches, branch_ids)?;
            let h = hidden.dim(2).map_err(backend_err("pointer head"))?;
            hidden
                .counted_reshape(((), h))
                .and_then(|flat| gather_rows(&flat, &picked))
                .map_err(backend_err("pointer head"))?
        };
        let err = backend_err("pointer head");
        let n = plan.rows.len();
        let decide = hidden.narrow(0, 0, n).map_err(&err)?;
        let opts = hidden.narrow(0, n, owner.len()).map_err(&err)?;
        self.head
            .logits_on_device(&decide, &opts, &owner)
            .map_err(&err)
    }

    /// A fresh cache of `rows` rows after `pieces` (the states; none: an empty state).
    pub(crate) fn state_cache(
        &self,
        rows: usize,
        pieces: &[Piece],
        ids: &[Tensor],
    ) -> Result<Cache> {
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
    pub(crate) fn branch_logits(
        &self,
        cache: &Cache,
        owners: &[usize],
        pieces: &[Piece],
        ids: &[Tensor],
        rows: &[Row],
    ) -> Result<Tensor> {
        let hidden = self.branch_hidden(cache, owners, pieces, ids)?;
        self.head_logits(&hidden, rows)
    }

    /// `pieces` (the branches), row i continuing row `owners[i]` of `cache` (on a copy): their
    /// hidden states `[B, T, H]`.
    fn branch_hidden(
        &self,
        cache: &Cache,
        owners: &[usize],
        pieces: &[Piece],
        ids: &[Tensor],
    ) -> Result<Tensor> {
        let mut branch_cache = cache
            .select_rows(owners)
            .map_err(backend_err("copying the prefix cache"))?;
        self.run_pieces(pieces, ids, &mut branch_cache)
    }

    /// Each of `rows` run in row form: `state ++ branch` on its own from an empty cache, the
    /// head read at its positions shifted past the state. The reference the prefix form is
    /// checked against.
    pub(crate) fn row_logits(&self, state: &[u32], rows: &[Row]) -> Result<Vec<Vec<f32>>> {
        rows.iter()
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
            .collect()
    }

    /// Runs `seqs` after `cache` ([`Executor::pieces`]); returns the hidden states `[B, T, H]`.
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
        counted_cat(&hidden, 1).map_err(backend_err("joining prefill pieces"))
    }

    /// Reads the head at each row's `decide` and `opts` positions of `hidden: [B, T, H]`.
    fn read_head(&self, hidden: &Tensor, rows: &[Row]) -> Result<Vec<Vec<f32>>> {
        read_per_row(&self.head_logits(hidden, rows)?, rows)
    }

    /// All rows' option logits `[M]` (f32, on the device) from `hidden: [B, T, H]`.
    fn head_logits(&self, hidden: &Tensor, rows: &[Row]) -> Result<Tensor> {
        let err = backend_err("pointer head");
        let (_, width, h) = hidden.dims3().map_err(&err)?;
        let flat = hidden.counted_reshape(((), h)).map_err(&err)?;
        let (decide, opts, owner) = head_positions(rows, width);
        let index = |idx: &[usize]| RowIndex::new(idx, self.device()).map_err(&err);
        let (decide, opts) = (index(&decide)?, index(&opts)?);
        self.head
            .logits_at(&flat, &decide, &opts, &owner)
            .map_err(&err)
    }
}

/// All options' logits `[M]` (on the device, in row order) read back and cut per row.
pub(crate) fn read_per_row(logits: &Tensor, rows: &[Row]) -> Result<Vec<Vec<f32>>> {
    let flat = logits
        .to_vec1::<f32>()
        .map_err(backend_err("pointer head"))?;
    Ok(split_logits(&flat, rows))
}
