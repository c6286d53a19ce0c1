//! How the token rows of a one-pass prefix forward divide: `R` state rows right-padded to `S`
//! steps, then `B` branch rows right-padded to `T`, each branch row continuing one state row.
//! The ops that look at the two parts apart ([`crate::causal_conv1d_split`],
//! [`crate::gated_delta_rule_split`]) take it, so several records' states and branches run in
//! one pass as one record's do.

use candle_core::{bail, Result};

/// The two parts' shapes, real lengths and the state row of each branch row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitRows {
    state_width: usize,
    state_lengths: Vec<usize>,
    width: usize,
    lengths: Vec<usize>,
    owners: Vec<usize>,
}

impl SplitRows {
    /// `state_lengths` (one per state row, each at most `state_width`), branch `lengths` (one
    /// per branch row, each at most `width`) and `owners` (the state row each branch row
    /// continues). Errors name what does not fit.
    pub fn new(
        state_width: usize,
        state_lengths: Vec<usize>,
        width: usize,
        lengths: Vec<usize>,
        owners: Vec<usize>,
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
        Ok(Self {
            state_width,
            state_lengths,
            width,
            lengths,
            owners,
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

    /// Packed token rows: `R·S + B·T`.
    pub fn tokens(&self) -> usize {
        self.states() * self.state_width + self.rows() * self.width
    }

    /// The state rows' real steps as the kernels read them, `None` when none is padded.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn padded_state_lengths(&self) -> Option<Vec<u32>> {
        let padded = self.state_lengths.iter().any(|&l| l != self.state_width);
        padded.then(|| self.state_lengths.iter().map(|&l| l as u32).collect())
    }

    /// The owners as the kernels read them, `None` when there is one state row (all zeros).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn kernel_owners(&self) -> Option<Vec<u32>> {
        (self.states() > 1).then(|| self.owners.iter().map(|&o| o as u32).collect())
    }
}
