//! How the token rows of a one-pass prefix forward divide: `R` state rows right-padded to `S`
//! steps, then `B` branch rows right-padded to `T`, each branch row continuing one state row:
//! one of the `R`, or one of `G` given rows that are not in the batch (a cached prefix's).
//! The ops that look at the two parts apart ([`crate::causal_conv1d_split`],
//! [`crate::gated_delta_rule_split`], [`crate::conv_gated_delta_rule_split`]) take it, so several
//! records' states and branches run in one pass as one record's do.

use std::sync::OnceLock;

use candle_core::{bail, Device, Result, Tensor};

use crate::dispatch::CountedTensor;
use crate::gather::{gather_rows, join_rows, RowIndex};

/// The two parts' shapes, real lengths and the state row of each branch row, with the lengths
/// and owners also on the device ([`SplitBatch::host_table`], one tensor for every layer's kernels).
#[derive(Clone)]
pub struct SplitBatch {
    state_width: usize,
    state_lengths: Vec<usize>,
    branch_width: usize,
    branch_lengths: Vec<usize>,
    /// Given state rows, after the `R` computed ones (not among the packed rows).
    given: usize,
    owners: Vec<usize>,
    /// [`SplitBatch::host_table`] on the device: `[B + R + B]` u32.
    table: Tensor,
    owner_index: RowIndex,
    /// [`SplitBatch::state_ends`] for one window, uploaded by the first layer that asks.
    state_ends: OnceLock<(usize, RowIndex)>,
}

impl std::fmt::Debug for SplitBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SplitBatch")
            .field("state_width", &self.state_width)
            .field("state_lengths", &self.state_lengths)
            .field("branch_width", &self.branch_width)
            .field("branch_lengths", &self.branch_lengths)
            .field("given", &self.given)
            .field("owners", &self.owners)
            .finish()
    }
}

impl SplitBatch {
    /// `state_lengths` (one per state row, each at most `state_width`), `branch_lengths` (one
    /// per branch row, each at most `branch_width`) and `owners` (the state row each branch row
    /// continues, uploaded to `device`). Errors name what does not fit.
    pub fn new(
        state_width: usize,
        state_lengths: Vec<usize>,
        branch_width: usize,
        branch_lengths: Vec<usize>,
        owners: Vec<usize>,
        device: &Device,
    ) -> Result<Self> {
        Self::with_given(
            state_width,
            state_lengths,
            0,
            branch_width,
            branch_lengths,
            owners,
            device,
        )
    }

    /// [`SplitBatch::new`] where branch rows may also continue `given` state rows that are not
    /// computed here (owners `R..R+given`: a cached prefix's rows, which the caller supplies to
    /// the mixers). The split kernels compute every state they read, so they refuse such a split;
    /// the mixers compose their parts' calls instead.
    pub fn with_given(
        state_width: usize,
        state_lengths: Vec<usize>,
        given: usize,
        branch_width: usize,
        branch_lengths: Vec<usize>,
        owners: Vec<usize>,
        device: &Device,
    ) -> Result<Self> {
        let table = Self::host_table(&state_lengths, &branch_lengths, &owners)?;
        let n = table.len();
        let table = crate::uploads::upload(table, n, device)?;
        Self::on_device(
            state_width,
            state_lengths,
            given,
            branch_width,
            branch_lengths,
            owners,
            table,
        )
    }

    /// What the kernels read of a split's rows, as `[B + R + B]` u32: the owners, the state
    /// rows' lengths, the branch rows' lengths. A CUDA graph of a split forward has this as an
    /// input, so one graph serves every split of the same widths and row counts.
    pub fn host_table(
        state_lengths: &[usize],
        branch_lengths: &[usize],
        owners: &[usize],
    ) -> Result<Vec<u32>> {
        owners
            .iter()
            .chain(state_lengths)
            .chain(branch_lengths)
            .map(|&v| u32::try_from(v))
            .collect::<std::result::Result<Vec<u32>, _>>()
            .map_err(|_| candle_core::Error::Msg("split batch: a length or row over u32".into()))
    }

    /// [`SplitBatch::with_given`] with its [`SplitBatch::host_table`] already on the device: `table`
    /// must hold it (only its shape is checked here).
    pub fn on_device(
        state_width: usize,
        state_lengths: Vec<usize>,
        given: usize,
        branch_width: usize,
        branch_lengths: Vec<usize>,
        owners: Vec<usize>,
        table: Tensor,
    ) -> Result<Self> {
        if u32::try_from(state_width.max(branch_width).max(state_lengths.len())).is_err() {
            bail!(
                "split batch: {state_width} or {branch_width} steps or {} rows are over u32",
                state_lengths.len()
            )
        }
        if let Some(l) = state_lengths.iter().find(|&&l| l > state_width) {
            bail!("split batch: a state row of {l} steps is longer than the width {state_width}")
        }
        if let Some(l) = branch_lengths.iter().find(|&&l| l > branch_width) {
            bail!("split batch: a branch row of {l} steps is longer than the width {branch_width}")
        }
        if owners.len() != branch_lengths.len() {
            bail!(
                "split batch: {} owners for {} branch rows",
                owners.len(),
                branch_lengths.len()
            )
        }
        if let Some(o) = owners.iter().find(|&&o| o >= state_lengths.len() + given) {
            bail!(
                "split batch: a branch row continues state row {o} of {}",
                state_lengths.len() + given
            )
        }
        let (b, r) = (branch_lengths.len(), state_lengths.len());
        if table.dtype() != candle_core::DType::U32 || table.dims() != [2 * b + r] {
            bail!(
                "split batch: a table of {:?} {:?} for {r} state and {b} branch rows",
                table.dtype(),
                table.dims()
            )
        }
        let owner_index = RowIndex::on_device(table.narrow(0, 0, b)?, &owners)?;
        Ok(Self {
            state_width,
            state_lengths,
            branch_width,
            branch_lengths,
            given,
            owners,
            table,
            owner_index,
            state_ends: OnceLock::new(),
        })
    }

    /// The state rows' last `window` steps as rows of the packed states `[R·S, ..]`, state by
    /// state: where each state's conv window ends. Uploaded once a batch, for every layer.
    pub fn state_ends(&self, window: usize, device: &Device) -> Result<RowIndex> {
        if let Some((_, index)) = self.state_ends.get().filter(|(w, _)| *w == window) {
            return Ok(index.clone());
        }
        if let Some(l) = self.state_lengths.iter().find(|&&l| l < window) {
            bail!("split batch: a state row of {l} steps is shorter than a window of {window}")
        }
        let s = self.state_width;
        let rows: Vec<usize> = self
            .state_lengths
            .iter()
            .enumerate()
            .flat_map(|(i, &len)| (len - window..len).map(move |p| i * s + p))
            .collect();
        let index = RowIndex::new(&rows, device)?;
        let _ = self.state_ends.set((window, index.clone()));
        Ok(index)
    }

    /// [`SplitBatch::host_table`] on the device.
    pub fn table(&self) -> &Tensor {
        &self.table
    }

    /// Given state rows (G), after the computed ones.
    pub fn given(&self) -> usize {
        self.given
    }

    /// State rows (R).
    pub fn states(&self) -> usize {
        self.state_lengths.len()
    }

    /// Steps per state row, padding included (S).
    pub fn state_width(&self) -> usize {
        self.state_width
    }

    /// The state rows' real steps.
    pub fn state_lengths(&self) -> &[usize] {
        &self.state_lengths
    }

    /// Branch rows (B).
    pub fn branches(&self) -> usize {
        self.branch_lengths.len()
    }

    /// Steps per branch row, padding included (T).
    pub fn branch_width(&self) -> usize {
        self.branch_width
    }

    /// The branch rows' real steps.
    pub fn branch_lengths(&self) -> &[usize] {
        &self.branch_lengths
    }

    /// The state row each branch row continues.
    pub fn owners(&self) -> &[usize] {
        &self.owners
    }

    /// The state row of each branch row, on the device.
    pub fn owner_index(&self) -> &RowIndex {
        &self.owner_index
    }

    /// Packed token rows: `R·S + B·T`.
    pub fn tokens(&self) -> usize {
        self.states() * self.state_width + self.branches() * self.branch_width
    }

    /// A tensor of the state rows (`[R + G, ..]`) copied to the branch rows (`[B, ..]`): row b
    /// is state row `owners[b]`.
    pub fn to_branches(&self, t: &Tensor) -> Result<Tensor> {
        gather_rows(t, &self.owner_index)
    }

    /// The branch rows of packed `t: [N, ..]` as `[B·T, ..]` (a view).
    pub fn branch_rows(&self, t: &Tensor) -> Result<Tensor> {
        let s_tokens = self.states() * self.state_width;
        t.narrow(0, s_tokens, self.branches() * self.branch_width)
    }

    /// Views of packed `t: [N, ..]` (rows contiguous) as the states `[R, S, ..]` and the
    /// branches `[B, T, ..]`; no copies.
    pub fn parts(&self, t: &Tensor) -> Result<(Tensor, Tensor)> {
        let rest = &t.dims()[1..];
        let shape = |b: usize, w: usize| [&[b, w][..], rest].concat();
        let s_tokens = self.states() * self.state_width;
        let state = t
            .narrow(0, 0, s_tokens)?
            .counted_reshape(shape(self.states(), self.state_width))?;
        let branches = self
            .branch_rows(t)?
            .counted_reshape(shape(self.branches(), self.branch_width))?;
        Ok((state, branches))
    }

    /// The inverse of [`SplitBatch::parts`] (a copy): `[R, S, ..]` and `[B, T, ..]` packed as
    /// `[N, ..]`.
    pub fn join(&self, state: &Tensor, branches: &Tensor) -> Result<Tensor> {
        let flat = |t: &Tensor| t.counted_flatten(0, 1);
        join_rows(&[&flat(state)?, &flat(branches)?])
    }

    /// An error naming `op` unless `state` is `[R, S, ..]` and `branches` `[B, T, ..]` and
    /// every state row is computed here (the split kernels read no given rows).
    pub(crate) fn check_parts(&self, op: &str, state: &Tensor, branches: &Tensor) -> Result<()> {
        if self.given > 0 {
            bail!(
                "{op}: {} given state rows: the split kernels compute every state they read",
                self.given
            )
        }
        let lead = |t: &Tensor| t.dims().get(..2).map(<[usize]>::to_vec);
        let want = |rows: usize, width: usize| Some(vec![rows, width]);
        if lead(state) != want(self.states(), self.state_width)
            || lead(branches) != want(self.branches(), self.branch_width)
        {
            bail!(
                "{op}: state {:?} and branches {:?} do not fit {} state rows of {} steps and {} branch rows of {}",
                state.dims(),
                branches.dims(),
                self.states(),
                self.state_width,
                self.branches(),
                self.branch_width
            )
        }
        Ok(())
    }

    /// The state rows' real steps as the kernels read them: a view of the table.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn state_lengths_on_device(&self) -> Result<Tensor> {
        self.table.narrow(0, self.branches(), self.states())
    }

    /// The branch rows' real steps as the kernels read them: a view of the table.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn branch_lengths_on_device(&self) -> Result<Tensor> {
        self.table
            .narrow(0, self.branches() + self.states(), self.branches())
    }

    /// The owners as the kernels read them: a view of the table.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn owners_on_device(&self) -> Result<Tensor> {
        self.table.narrow(0, 0, self.branches())
    }
}
