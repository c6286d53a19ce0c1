//! [`Executor`]: runs plans — the backbone over each pass's pieces into caches, then the pointer
//! head at the pass's positions — eagerly, or replaying a CUDA graph where one serves.
//!
//! It holds only what running needs (no tokenizer, no checkpoint), so the CUDA graphs capture
//! and replay its passes without knowing the model they serve.

use candle_core::{Device, Tensor};
use kev_core::{Result, Row};
use kev_kernels::dispatch::{counted_cat, CountedTensor};
use kev_kernels::{gather_rows, RowIndex, SplitBatch};

use crate::device::backend_err;
use crate::graphs::GraphStats;
use crate::head::PointerHead;
use crate::plan::{head_positions, pieces, Grouping, Pass, Piece, Plan};
use crate::qwen35::{Cache, Model, Packing, SplitTables};

/// A pass's inputs on the device: everything its forward reads that was built on the host from
/// more than its shape (token ids, head positions, lengths, owners), as copies of their own, so
/// that a CUDA graph captured on one pass serves the others of its shape once these are
/// rewritten ([`Executor::write_inputs`]).
pub(crate) struct PassInputs {
    /// Each piece's token ids, [`Pass::pieces`] order.
    ids: Vec<Tensor>,
    /// Where the head reads ([`Pass::head_reads`]), `[N + M]` u32.
    heads: Tensor,
    /// Each option's question, `[M]` u32.
    owner: Tensor,
    /// A pass in one pass over the layers: its split (with its table on the device) and the
    /// backbone's tables for it.
    split: Option<SplitTables>,
}

/// What a pass gives: all its options' logits in row order, and with [`Pass::keep`] each
/// computed state's row of the cache (one-row caches, cut to the state's tokens).
pub(crate) struct PassOut {
    pub(crate) logits: Vec<f32>,
    pub(crate) kept: Vec<Cache>,
}

/// A pass issued to the device: its logits `[M]` still there (none: a pass with no branches),
/// so that the host goes on to issue the next pass while the device works (reading them back
/// waits for the device).
struct Issued {
    logits: Option<Tensor>,
    kept: Vec<Cache>,
}

/// The backbone and the head, the longest piece one forward pass runs, and the CUDA graphs of
/// its passes.
pub(crate) struct Executor {
    model: Model,
    head: PointerHead,
    /// Longest piece one forward pass runs ([`kev_core::LoadOptions::prefill_chunk`]).
    prefill_chunk: usize,
    /// Passes replayed as CUDA graphs ([`kev_core::LoadOptions::cuda_graphs`]).
    #[cfg(feature = "cuda")]
    graphs: Option<crate::graphs::Graphs<PassInputs>>,
}

impl Executor {
    /// `graphs`: replay plain passes as CUDA graphs, keeping up to that many (on a CUDA device
    /// only; 0: none).
    pub(crate) fn new(
        model: Model,
        head: PointerHead,
        prefill_chunk: usize,
        graphs: usize,
    ) -> Self {
        #[cfg(not(feature = "cuda"))]
        let _ = graphs;
        Self {
            #[cfg(feature = "cuda")]
            graphs: (graphs > 0 && model.device().is_cuda())
                .then(|| crate::graphs::Graphs::new(graphs)),
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

    /// Longest piece one forward pass runs.
    pub(crate) fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    /// How far a plan pads states into one pass here: a GPU's pass has a fixed cost (its few
    /// hundred kernels' own time, however few rows they take) that padding short states
    /// together saves; a CPU's hardly any.
    pub(crate) fn grouping(&self) -> Grouping {
        match self.device() {
            Device::Cpu => Grouping::CPU,
            _ => Grouping::GPU,
        }
    }

    /// Whether a plain pass in one pass over the layers pads its pieces to bucket widths `s`
    /// and `t`: where it replays as a CUDA graph that takes its lengths as inputs.
    pub(crate) fn pads_widths(&self, s: usize, t: usize) -> bool {
        #[cfg(feature = "cuda")]
        return self.graphs.is_some() && self.model.lengths_are_inputs(s, t);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (s, t);
            false
        }
    }

    /// Whether every input of `pass` that depends on more than its shape is in its
    /// [`PassInputs`]: one pass over the layers (`Executor::one_pass`) whose backbone reads its
    /// lengths from its tables ([`Model::lengths_are_inputs`]). Then one graph serves every
    /// pass of its widths and row counts.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn lengths_are_inputs(&self, pass: &Pass) -> bool {
        pass.is_one_piece()
            && self
                .model
                .lengths_are_inputs(pass.state[0].width, pass.branches[0].width)
    }

    /// How the CUDA graphs have fared (all zero off CUDA or without them).
    pub(crate) fn graph_stats(&self) -> GraphStats {
        #[cfg(feature = "cuda")]
        if let Some(graphs) = &self.graphs {
            return graphs.stats();
        }
        GraphStats::default()
    }

    /// Runs every pass of `plan`: the only way a forward happens. Every pass is issued before
    /// any logits are read back: a pass's host work (its launches) then overlaps the device's
    /// work on the passes before it, where reading each back first would leave the device idle
    /// while the host issues the next. They are issued last first (the plan's passes go from
    /// the shortest states to the longest), so that the host is ahead of the device by a long
    /// pass when it reaches the short ones, whose launches take longer than their kernels. (On
    /// the H100 at 0.8B this gains about 1 % on varied records: what a short pass costs there
    /// is mostly its kernels' own time.)
    pub(crate) fn run(&self, plan: &Plan) -> Result<Vec<PassOut>> {
        let outs = self.issue_all(plan);
        if outs.is_err() {
            // Passes issued before the error may still be running, reading given prefixes
            // that another thread may free on its own stream once this call returns.
            let _ = self.device().synchronize();
        }
        outs
    }

    /// [`Executor::run`] but for waiting on an error.
    fn issue_all(&self, plan: &Plan) -> Result<Vec<PassOut>> {
        let mut issued = plan
            .passes
            .iter()
            .rev()
            .map(|pass| self.issue(pass))
            .collect::<Result<Vec<_>>>()?;
        issued.reverse();
        let outs = issued
            .into_iter()
            .map(|Issued { logits, kept }| {
                let logits = match logits {
                    Some(logits) => logits
                        .to_vec1::<f32>()
                        .map_err(backend_err("pointer head"))?,
                    None => Vec::new(),
                };
                Ok(PassOut { logits, kept })
            })
            .collect::<Result<Vec<_>>>()?;
        // Kept states become prefixes that other threads read on their own streams: their
        // copies must have landed, whether or not a read-back came after them.
        if plan.passes.iter().any(|p| p.keep) {
            self.device()
                .synchronize()
                .map_err(backend_err("waiting for the kept states"))?;
        }
        Ok(outs)
    }

    fn issue(&self, pass: &Pass) -> Result<Issued> {
        if !pass.is_plain() {
            return self.pass_keeping(pass);
        }
        #[cfg(feature = "cuda")]
        let logits = match (&self.graphs, self.device()) {
            (Some(graphs), Device::Cuda(dev)) => graphs.logits(self, pass, dev),
            _ => self.pass_logits_eager(pass),
        };
        #[cfg(not(feature = "cuda"))]
        let logits = self.pass_logits_eager(pass);
        Ok(Issued {
            logits: Some(logits?),
            kept: Vec::new(),
        })
    }

    /// `seqs` right-padded into `[B, T]` and cut into pieces of at most `prefill_chunk` steps.
    pub(crate) fn pieces<S: AsRef<[u32]>>(&self, seqs: &[S]) -> Vec<Piece> {
        pieces(seqs, self.prefill_chunk)
    }

    /// The token ids of `piece` on the device.
    fn upload_ids(&self, piece: &Piece) -> Result<Tensor> {
        Tensor::from_slice(
            &piece.ids,
            (piece.lengths.len(), piece.width),
            self.device(),
        )
        .map_err(backend_err("token ids"))
    }

    /// Every piece's token ids on the device.
    fn upload_all<'a>(&self, pieces: impl IntoIterator<Item = &'a Piece>) -> Result<Vec<Tensor>> {
        pieces.into_iter().map(|p| self.upload_ids(p)).collect()
    }

    /// Where `pass`'s head reads ([`Pass::head_reads`]) among its branch rows as `split` holds
    /// them (packed: [`Packing::branch_row`]); an error names a read that a packing does not hold.
    fn held_reads(pass: &Pass, split: Option<&SplitTables>) -> Result<Vec<usize>> {
        let (reads, _) = pass.head_reads();
        let Some(packing) = split.and_then(SplitTables::packing) else {
            return Ok(reads);
        };
        reads
            .into_iter()
            .map(|p| {
                packing
                    .branch_row(p)
                    .ok_or_else(|| kev_core::Error::Device {
                        message: format!("head position {p} on a branch row's padding"),
                    })
            })
            .collect()
    }

    /// [`Executor::held_reads`] as u32, checked within the branch rows here, since a graph's
    /// replay reads them without the gathers' own checks.
    fn head_reads(pass: &Pass, split: Option<&SplitTables>) -> Result<Vec<u32>> {
        let reads = Self::held_reads(pass, split)?;
        let positions = match split.and_then(SplitTables::packing) {
            Some(packing) => packing.branch_rows(),
            None => pass
                .branches
                .first()
                .map_or(0, |p| p.lengths.len() * pass.branch_width()),
        };
        if let Some(bad) = reads.iter().find(|&&r| r >= positions) {
            return Err(kev_core::Error::Device {
                message: format!("head position {bad} outside the {positions} branch positions"),
            });
        }
        reads
            .into_iter()
            .map(u32::try_from)
            .collect::<std::result::Result<Vec<u32>, _>>()
            .map_err(|_| kev_core::Error::Device {
                message: "head positions: a batch over 2^32 token positions".to_string(),
            })
    }

    /// `values` on the device as `[n]` u32 (a copy of its own).
    fn upload_u32(&self, values: &[u32], what: &'static str) -> Result<Tensor> {
        Tensor::from_slice(values, values.len(), self.device()).map_err(backend_err(what))
    }

    /// `pass`'s inputs on the device, its given prefixes' rows `given` (one cache) where it has
    /// some; its branch rows packed between the layers where `pack` says so (never for a CUDA
    /// graph) and it pays ([`Packing::pays`]).
    fn upload_inputs(&self, pass: &Pass, given: Option<&Cache>, pack: bool) -> Result<PassInputs> {
        let (_, owner) = pass.head_reads();
        let split = match self.one_pass(pass)? {
            Some(split) => Some({
                let pack = pack && Packing::pays(&split);
                self.model
                    .split_tables(split, given, pack)
                    .map_err(backend_err("split tables"))?
            }),
            None => None,
        };
        Ok(PassInputs {
            ids: self.upload_all(pass.pieces())?,
            heads: self.upload_u32(&Self::head_reads(pass, split.as_ref())?, "head positions")?,
            owner: self.upload_u32(&owner, "option owners")?,
            split,
        })
    }

    /// Rewrites `inputs` (of a pass of `pass`'s shape, [`Executor::lengths_are_inputs`] where
    /// their lengths differ) with `pass`'s: a CUDA graph's next replay reads them.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn write_inputs(&self, pass: &Pass, inputs: &PassInputs) -> Result<()> {
        let write = |slot: &Tensor, values: Tensor, what: &'static str| {
            slot.slice_set(&values, 0, 0).map_err(backend_err(what))
        };
        for (slot, piece) in inputs.ids.iter().zip(pass.pieces()) {
            write(slot, self.upload_ids(piece)?, "writing the token ids")?;
        }
        let reads = Self::head_reads(pass, inputs.split.as_ref())?;
        write(
            &inputs.heads,
            self.upload_u32(&reads, "head positions")?,
            "writing the head positions",
        )?;
        let (_, owner) = pass.head_reads();
        write(
            &inputs.owner,
            self.upload_u32(&owner, "option owners")?,
            "writing the option owners",
        )?;
        if let Some(tables) = &inputs.split {
            let split = self.split_of(pass, tables.split().table().clone())?;
            let table = SplitBatch::host_table(
                split.state_lengths(),
                split.branch_lengths(),
                split.owners(),
            )
            .map_err(backend_err("split table"))?;
            write(
                split.table(),
                self.upload_u32(&table, "split table")?,
                "writing the split table",
            )?;
            let (host, _) = self.model.split_host(&split, None);
            tables
                .write(&host, self.device())
                .map_err(backend_err("writing the split tables"))?;
        }
        Ok(())
    }

    /// [`Executor::pass_logits`] with fresh uploads.
    pub(crate) fn pass_logits_eager(&self, pass: &Pass) -> Result<Tensor> {
        self.pass_logits(pass, &self.upload_inputs(pass, None, true)?)
    }

    /// Runs the plain `pass` ([`Pass::is_plain`]) with `inputs` ([`Executor::upload_inputs`])
    /// and returns all options' logits `[M]` on the device, waiting for nothing.
    pub(crate) fn pass_logits(&self, pass: &Pass, inputs: &PassInputs) -> Result<Tensor> {
        let (_, owner) = pass.head_reads();
        let reads = Self::held_reads(pass, inputs.split.as_ref())?;
        let picked = RowIndex::on_device(inputs.heads.clone(), &reads)
            .map_err(backend_err("head positions"))?;
        let hidden = if let Some(tables) = &inputs.split {
            // One piece each (every state within `prefill_chunk`): one pass over the layers, the
            // last layer's MLP only on the rows the head reads.
            self.model
                .forward_split(
                    &inputs.ids[0],
                    &inputs.ids[1],
                    tables,
                    Some(&picked),
                    None,
                    false,
                )
                .map_err(backend_err("backbone forward"))?
                .0
        } else {
            let (state_ids, branch_ids) = inputs.ids.split_at(pass.state.len());
            let cache = self.state_cache(pass.computed, &pass.state, state_ids)?;
            let hidden = self.branch_hidden(&cache, &pass.owners, &pass.branches, branch_ids)?;
            let h = hidden.dim(2).map_err(backend_err("pointer head"))?;
            hidden
                .counted_reshape(((), h))
                .and_then(|flat| gather_rows(&flat, &picked))
                .map_err(backend_err("pointer head"))?
        };
        self.head_at_reads(pass, &hidden, &owner, &inputs.owner)
    }

    /// The head on `hidden: [P, H]`, the rows `pass` reads ([`Pass::head_reads`], whose option
    /// owners are `owner`, on the device `owner_on_device`): all options' logits `[M]` on the
    /// device.
    fn head_at_reads(
        &self,
        pass: &Pass,
        hidden: &Tensor,
        owner: &[u32],
        owner_on_device: &Tensor,
    ) -> Result<Tensor> {
        let err = backend_err("pointer head");
        let n = pass.rows.len();
        let decide = hidden.narrow(0, 0, n).map_err(&err)?;
        let opts = hidden.narrow(0, n, owner.len()).map_err(&err)?;
        self.head
            .logits_on_device(&decide, &opts, owner, Some(owner_on_device))
            .map_err(&err)
    }

    /// The split of `pass` when it runs in one pass over the layers ([`Pass::is_one_piece`]:
    /// its computed states and its branches are one piece each; the given prefixes' rows follow
    /// the computed ones), with its table on the device (a copy of its own).
    fn one_pass(&self, pass: &Pass) -> Result<Option<SplitBatch>> {
        if !pass.is_one_piece() {
            return Ok(None);
        }
        let (state, branches) = (&pass.state[0], &pass.branches[0]);
        let table = SplitBatch::host_table(&state.lengths, &branches.lengths, &pass.owners)
            .map_err(backend_err("split table"))?;
        let table = self.upload_u32(&table, "split table")?;
        self.split_of(pass, table).map(Some)
    }

    /// The split of the one-piece `pass` on `table` (holding its [`SplitBatch::host_table`], or to be
    /// rewritten with it).
    fn split_of(&self, pass: &Pass, table: Tensor) -> Result<SplitBatch> {
        let (state, branches) = (&pass.state[0], &pass.branches[0]);
        SplitBatch::on_device(
            state.width,
            state.lengths.clone(),
            pass.given.len(),
            branches.width,
            branches.lengths.clone(),
            pass.owners.clone(),
            table,
        )
        .map_err(backend_err("backbone forward"))
    }

    /// A pass that keeps its computed states or continues given prefixes, in one pass over the
    /// layers where it fits ([`Executor::one_pass`]), else [`Executor::pass_with_prefixes`].
    fn pass_keeping(&self, pass: &Pass) -> Result<Issued> {
        if !pass.is_one_piece() {
            return self.pass_with_prefixes(pass);
        }
        let given = self.given_rows(pass)?;
        let inputs = self.upload_inputs(pass, given.as_ref(), true)?;
        let Some(tables) = &inputs.split else {
            unreachable!("a one-piece pass has its split")
        };
        let (_, owner) = pass.head_reads();
        let reads = Self::held_reads(pass, Some(tables))?;
        let picked = RowIndex::on_device(inputs.heads.clone(), &reads)
            .map_err(backend_err("head positions"))?;
        let (hidden, kept) = self
            .model
            .forward_split(
                &inputs.ids[0],
                &inputs.ids[1],
                tables,
                Some(&picked),
                given.as_ref(),
                pass.keep,
            )
            .map_err(backend_err("backbone forward"))?;
        let logits = Some(self.head_at_reads(pass, &hidden, &owner, &inputs.owner)?);
        let kept = match kept {
            Some(cache) => cut_rows(&cache, pass.computed)?,
            None => Vec::new(),
        };
        Ok(Issued { logits, kept })
    }

    /// The given prefixes' rows of `pass` as one cache (none given: `None`).
    fn given_rows(&self, pass: &Pass) -> Result<Option<Cache>> {
        let parts: Vec<&Cache> = pass.given.iter().map(|p| p.cache()).collect();
        if parts.is_empty() {
            return Ok(None);
        }
        Cache::join(&parts)
            .map(Some)
            .map_err(backend_err("joining prefixes"))
    }

    /// A pass that keeps its computed states or continues given prefixes, in two passes over the
    /// layers (a state or branch over `prefill_chunk`, an empty state, no state computed, no
    /// branch): the states into a fresh cache (their rows cut out where kept), that cache's rows
    /// joined with the given prefixes', then the branches on copies of their rows, then the head.
    /// Given prefixes are only read, so one prefix can serve concurrent passes.
    fn pass_with_prefixes(&self, pass: &Pass) -> Result<Issued> {
        let computed = (pass.computed > 0)
            .then(|| {
                let ids = self.upload_all(&pass.state)?;
                self.state_cache(pass.computed, &pass.state, &ids)
            })
            .transpose()?;
        let kept = match (&computed, pass.keep) {
            (Some(cache), true) => cut_rows(cache, pass.computed)?,
            _ => Vec::new(),
        };
        if pass.rows.is_empty() {
            return Ok(Issued { logits: None, kept });
        }
        let parts: Vec<&Cache> = computed
            .iter()
            .chain(pass.given.iter().map(|p| p.cache()))
            .collect();
        let joined;
        let states = match parts.as_slice() {
            [one] => *one,
            _ => {
                joined = Cache::join(&parts).map_err(backend_err("joining prefixes"))?;
                &joined
            }
        };
        let ids = self.upload_all(&pass.branches)?;
        let hidden = self.branch_hidden(states, &pass.owners, &pass.branches, &ids)?;
        let logits = Some(self.head_logits(&hidden, &pass.rows)?);
        Ok(Issued { logits, kept })
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

    /// Runs `seqs` after `cache` ([`Executor::pieces`]); returns the hidden states `[B, T, H]`.
    pub(crate) fn hidden(&self, seqs: &[Vec<u32>], cache: &mut Cache) -> Result<Tensor> {
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

    /// All rows' option logits `[M]` (f32, on the device, in row order) from
    /// `hidden: [B, T, H]`, reading each row's `decide` and `opts` positions.
    pub(crate) fn head_logits(&self, hidden: &Tensor, rows: &[Row]) -> Result<Tensor> {
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

/// The first `rows` rows of `cache`, each a one-row cache of its own ([`Cache::rows_apart`]):
/// the kept states of a pass.
fn cut_rows(cache: &Cache, rows: usize) -> Result<Vec<Cache>> {
    cache
        .rows_apart(rows)
        .map_err(backend_err("cutting prefixes out of the state pass"))
}

#[cfg(feature = "cuda")]
impl crate::graphs::Replays for Executor {
    type Inputs = PassInputs;

    fn upload_inputs(&self, pass: &Pass) -> Result<PassInputs> {
        Executor::upload_inputs(self, pass, None, false)
    }

    fn write_inputs(&self, pass: &Pass, inputs: &PassInputs) -> Result<()> {
        Executor::write_inputs(self, pass, inputs)
    }

    fn lengths_are_inputs(&self, pass: &Pass) -> bool {
        Executor::lengths_are_inputs(self, pass)
    }

    fn pass_logits(&self, pass: &Pass, inputs: &PassInputs) -> Result<Tensor> {
        Executor::pass_logits(self, pass, inputs)
    }

    fn pass_logits_eager(&self, pass: &Pass) -> Result<Tensor> {
        Executor::pass_logits_eager(self, pass)
    }
}
