//! How the token rows of a one-pass prefix forward divide: `R` state rows right-padded to `S`
//! steps, then `B` branch rows right-padded to `T`, each branch row continuing one state row.
//! The ops that look at the two parts apart ([`crate::causal_conv1d_split`],
//! [`crate::gated_delta_rule_split`], [`crate::conv_gated_delta_rule_split`]) take it, so several
//! records' states and branches run in one pass as one record's do.

use candle_core::{bail, Device, Result, Tensor};

use crate::gather::{gather_rows, RowIndex};

/// The two parts' shapes, real lengths and the state row of each branch row, with those owners
/// also on the device (uploaded once, for every layer's copies of state rows to branch rows).
#[derive(Clone)]
pub struct SplitRows {
    state_width: usize,
    state_lengths: Vec<usize>,
    width: usize,
    lengths: Vec<usize>,
    owners: Vec<usize>,
    owner_index: RowIndex,
}

impl std::fmt::Debug for SplitRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SplitRows")
            .field("state_width", &self.state_width)
            .field("state_lengths", &self.state_lengths)
            .field("width", &self.width)
            .field("lengths", &self.lengths)
            .field("owners", &self.owners)
            .finish()
    }
}

impl SplitRows {
    /// `state_lengths` (one per state row, each at most `state_width`), branch `lengths` (one
    /// per branch row, each at most `width`) and `owners` (the state row each branch row
    /// continues, uploaded to `device`). Errors name what does not fit.
    pub fn new(
        state_width: usize,
        state_lengths: Vec<usize>,
        width: usize,
        lengths: Vec<usize>,
        owners: Vec<usize>,
        device: &Device,
    ) -> Result<Self> {
        if u32::try_from(state_width.max(width).max(state_lengths.len())).is_err() {
            bail!(
                "split rows: {state_width} or {width} steps or {} rows are over u32",
                state_lengths.len()
            )
        }
        if let Some(l) = state_lengths.iter().find(|&&l| l > state_width) {
            bail!("split rows: a state row of {l} steps is longer than the width {state_width}")
        }
        if let Some(l) = lengths.iter().find(|&&l| l > width) {
            bail!("split rows: a branch row of {l} steps is longer than the width {width}")
        }
        if owners.len() != lengths.len() {
            bail!(
                "split rows: {} owners for {} branch rows",
                owners.len(),
                lengths.len()
            )
        }
        if let Some(o) = owners.iter().find(|&&o| o >= state_lengths.len()) {
            bail!(
                "split rows: a branch row continues state row {o} of {}",
                state_lengths.len()
            )
        }
        let owner_index = RowIndex::new(&owners, device)?;
        Ok(Self {
            state_width,
            state_lengths,
            width,
            lengths,
            owners,
            owner_index,
        })
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
    pub fn rows(&self) -> usize {
        self.lengths.len()
    }

    /// Steps per branch row, padding included (T).
    pub fn width(&self) -> usize {
        self.width
    }

    /// The branch rows' real steps.
    pub fn lengths(&self) -> &[usize] {
        &self.lengths
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
        self.states() * self.state_width + self.rows() * self.width
    }

    /// A tensor of the state rows (`[R, ..]`) copied to the branch rows (`[B, ..]`): row b is
    /// state row `owners[b]`.
    pub fn to_branches(&self, t: &Tensor) -> Result<Tensor> {
        gather_rows(t, &self.owner_index)
    }

    /// The branch rows of packed `t: [N, ..]` as `[B·T, ..]` (a view).
    pub fn branch_rows(&self, t: &Tensor) -> Result<Tensor> {
        let s_tokens = self.states() * self.state_width;
        t.narrow(0, s_tokens, self.rows() * self.width)
    }

    /// Views of packed `t: [N, ..]` (rows contiguous) as the states `[R, S, ..]` and the
    /// branches `[B, T, ..]`; no copies.
    pub fn parts(&self, t: &Tensor) -> Result<(Tensor, Tensor)> {
        let rest = &t.dims()[1..];
        let shape = |b: usize, w: usize| [&[b, w][..], rest].concat();
        let s_tokens = self.states() * self.state_width;
        let state = t
            .narrow(0, 0, s_tokens)?
            .reshape(shape(self.states(), self.state_width))?;
        let branches = self
            .branch_rows(t)?
            .reshape(shape(self.rows(), self.width))?;
        Ok((state, branches))
    }

    /// The inverse of [`SplitRows::parts`] (a copy): `[R, S, ..]` and `[B, T, ..]` packed as
    /// `[N, ..]`.
    pub fn join(&self, state: &Tensor, branches: &Tensor) -> Result<Tensor> {
        let flat = |t: &Tensor| t.flatten(0, 1);
        Tensor::cat(&[flat(state)?, flat(branches)?], 0)
    }

    /// An error naming `op` unless `state` is `[R, S, ..]` and `branches` `[B, T, ..]`.
    pub(crate) fn check_parts(&self, op: &str, state: &Tensor, branches: &Tensor) -> Result<()> {
        let lead = |t: &Tensor| t.dims().get(..2).map(<[usize]>::to_vec);
        let want = |rows: usize, width: usize| Some(vec![rows, width]);
        if lead(state) != want(self.states(), self.state_width)
            || lead(branches) != want(self.rows(), self.width)
        {
            bail!(
                "{op}: state {:?} and branches {:?} do not fit {} state rows of {} steps and {} branch rows of {}",
                state.dims(),
                branches.dims(),
                self.states(),
                self.state_width,
                self.rows(),
                self.width
            )
        }
        Ok(())
    }

    /// The state rows' real steps as the kernels read them, `None` when none is padded.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn padded_state_lengths(&self) -> Option<Vec<u32>> {
        padded(&self.state_lengths, self.state_width)
    }

    /// The branch rows' real steps as the kernels read them, `None` when none is padded.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn padded_lengths(&self) -> Option<Vec<u32>> {
        padded(&self.lengths, self.width)
    }

    /// The owners as the kernels read them, `None` when there is one state row (all zeros).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn kernel_owners(&self) -> Option<Vec<u32>> {
        (self.states() > 1).then(|| self.owners.iter().map(|&o| o as u32).collect())
    }
}

/// `lengths` as u32 (each fits: `SplitRows::new` checked the widths), `None` when all are `width`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn padded(lengths: &[usize], width: usize) -> Option<Vec<u32>> {
    let padded = lengths.iter().any(|&l| l != width);
    padded.then(|| lengths.iter().map(|&l| l as u32).collect())
}
