//! Records' state rows and the branch rows that continue them, packed as one batch of token
//! rows, so one forward runs both (the prefix form in a single pass over the layers).
//!
//! Row-wise work (norms, projections, the MLP) takes all `R·S + B·T` token rows at once: one
//! launch and one read of each weight instead of two, and taller matrix products. Only the
//! sequence mixers look at the two parts apart: within a layer, the states' part runs first and
//! every branch row continues from its state row's conv window, recurrent state and keys of that
//! same layer, exactly as a second forward on copies of the states' cache would.

use candle_core::{Device, Result, Tensor};
use kev_kernels::{RowIndex, SplitRows};

/// Which rows of a [`Split`] a layer gives outputs for. The last layer's state rows feed the
/// branches only through their keys and values, conv window and recurrent state: nothing reads
/// their outputs, so the last layer skips them (its MLP, `o_proj` or `out_proj`, and the
/// states' own attention), about three quarters of that layer's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rows {
    All,
    Branches,
}

/// How the packed token rows divide ([`SplitRows`]), with the branch rows' owners on the device
/// for copying state rows to them.
pub struct Split {
    rows: SplitRows,
    owners: RowIndex,
}

impl Split {
    pub fn new(rows: SplitRows, device: &Device) -> Result<Self> {
        if rows.states() == 0 || rows.state_width() == 0 {
            candle_core::bail!("a split needs at least one state step ({rows:?})")
        }
        let owners = RowIndex::new(rows.owners(), device)?;
        Ok(Self { rows, owners })
    }

    /// The shapes, lengths and owners.
    pub fn rows(&self) -> &SplitRows {
        &self.rows
    }

    /// The state row of each branch row, on the device.
    pub fn owners(&self) -> &RowIndex {
        &self.owners
    }

    /// A cache tensor of the state rows (`[R, ..]`) copied to the branch rows (`[B, ..]`).
    pub fn to_branches(&self, t: &Tensor) -> Result<Tensor> {
        kev_kernels::gather_rows(t, &self.owners)
    }

    /// The branch rows of packed `t: [N, ..]` as `[B·T, ..]` (a view).
    pub fn branch_rows(&self, t: &Tensor) -> Result<Tensor> {
        let r = &self.rows;
        let s_tokens = r.states() * r.state_width();
        t.narrow(0, s_tokens, r.rows() * r.width())
    }

    /// The rows of packed `t: [N, ..]` that a layer giving `out_rows` keeps: all of them, or the
    /// branch rows (a view).
    pub(crate) fn kept(&self, t: &Tensor, out_rows: Rows) -> Result<Tensor> {
        match out_rows {
            Rows::All => Ok(t.clone()),
            Rows::Branches => self.branch_rows(t),
        }
    }

    /// Views of packed `t: [N, ..]` (rows contiguous) as the states `[R, S, ..]` and the
    /// branches `[B, T, ..]`; no copies.
    pub fn parts(&self, t: &Tensor) -> Result<(Tensor, Tensor)> {
        let rest = &t.dims()[1..];
        let shape = |b: usize, w: usize| [&[b, w][..], rest].concat();
        let r = &self.rows;
        let s_tokens = r.states() * r.state_width();
        let state = t
            .narrow(0, 0, s_tokens)?
            .reshape(shape(r.states(), r.state_width()))?;
        let branches = self.branch_rows(t)?.reshape(shape(r.rows(), r.width()))?;
        Ok((state, branches))
    }

    /// The inverse of [`Split::parts`] (a copy): `[R, S, ..]` and `[B, T, ..]` packed as `[N, ..]`.
    pub fn join(&self, state: &Tensor, branches: &Tensor) -> Result<Tensor> {
        let flat = |t: &Tensor| t.flatten(0, 1);
        Tensor::cat(&[flat(state)?, flat(branches)?], 0)
    }
}
