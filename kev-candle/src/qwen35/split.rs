//! A state row and the branch rows that continue it, packed as one batch of token rows, so one
//! forward runs both (the prefix form of one record in a single pass over the layers).
//!
//! Row-wise work (norms, projections, the MLP) takes all `state_len + rows·width` token rows at
//! once: one launch and one read of each weight instead of two, and taller matrix products. Only
//! the sequence mixers look at the two parts apart: within a layer, the state's part runs first
//! and every branch row continues from the state's conv window, recurrent state and keys of that
//! same layer, exactly as a second forward on copies of the state's cache would.

use candle_core::{Device, Result, Tensor};
use kev_kernels::RowIndex;

/// How the packed token rows divide: the state's `state_len` first, then `rows` branch rows of
/// `width` steps (right padding beyond `lengths[b]`).
pub struct Split {
    state_len: usize,
    rows: usize,
    width: usize,
    lengths: Vec<usize>,
    /// `rows` zeros: every branch row copies the state row's cache.
    owners: RowIndex,
}

impl Split {
    /// `lengths`: the branch rows' real steps (`None`: all `width`).
    pub fn new(
        state_len: usize,
        rows: usize,
        width: usize,
        lengths: Option<&[usize]>,
        device: &Device,
    ) -> Result<Self> {
        let lengths = lengths.map_or_else(|| vec![width; rows], <[usize]>::to_vec);
        if state_len == 0 || lengths.len() != rows || lengths.iter().any(|&l| l > width) {
            candle_core::bail!(
                "a split of a {state_len}-token state and {rows} rows of {width} steps with lengths {lengths:?}"
            )
        }
        Ok(Self {
            state_len,
            rows,
            width,
            lengths,
            owners: RowIndex::new(&vec![0; rows], device)?,
        })
    }

    /// The state's tokens (S).
    pub fn state_len(&self) -> usize {
        self.state_len
    }

    /// Branch rows (B).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Steps per branch row, padding included (T).
    pub fn width(&self) -> usize {
        self.width
    }

    /// The branch rows' real steps.
    pub fn lengths(&self) -> &[usize] {
        &self.lengths
    }

    /// A cache tensor of the state row (`[1, ..]`) copied to every branch row.
    pub fn to_branches(&self, t: &Tensor) -> Result<Tensor> {
        kev_kernels::gather_rows(t, &self.owners)
    }

    /// Views of packed `t: [N, ..]` (rows contiguous) as the state `[1, S, ..]` and the branches
    /// `[B, T, ..]`; no copies.
    pub fn parts(&self, t: &Tensor) -> Result<(Tensor, Tensor)> {
        let rest = &t.dims()[1..];
        let shape = |b: usize, w: usize| [&[b, w][..], rest].concat();
        let state = t
            .narrow(0, 0, self.state_len)?
            .reshape(shape(1, self.state_len))?;
        let branches = t
            .narrow(0, self.state_len, self.rows * self.width)?
            .reshape(shape(self.rows, self.width))?;
        Ok((state, branches))
    }

    /// The inverse of [`Split::parts`] (a copy): `[1, S, ..]` and `[B, T, ..]` packed as `[N, ..]`.
    pub fn join(&self, state: &Tensor, branches: &Tensor) -> Result<Tensor> {
        let flat = |t: &Tensor| t.flatten(0, 1);
        Tensor::cat(&[flat(state)?, flat(branches)?], 0)
    }
}
