//! Records' state rows and the branch rows that continue them, packed as one batch of token
//! rows ([`SplitBatch`]), so one forward runs both (the prefix form in a single pass over the
//! layers).
//!
//! Row-wise work (norms, projections, the MLP) takes all `R·S + B·T` token rows at once: one
//! launch and one read of each weight instead of two, and taller matrix products. Only the
//! sequence mixers look at the two parts apart: within a layer, the states' part runs first and
//! every branch row continues from its state row's conv window, recurrent matrix and keys of that
//! same layer, exactly as a second forward on copies of the states' cache would.

use candle_core::{Result, Tensor};
use kev_kernels::SplitBatch;

/// Which rows of a split batch a layer gives outputs for. The last layer's state rows feed the
/// branches only through their keys and values, conv window and recurrent matrix: nothing reads
/// their outputs, so the last layer skips them (its MLP, `o_proj` or `out_proj`, and the
/// states' own attention), about three quarters of that layer's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outputs {
    All,
    Branches,
}

impl Outputs {
    /// The rows of packed `t: [N, ..]` that a layer giving these outputs keeps: all of them, or
    /// the branch rows (a view).
    pub(crate) fn kept(self, split: &SplitBatch, t: &Tensor) -> Result<Tensor> {
        match self {
            Outputs::All => Ok(t.clone()),
            Outputs::Branches => split.branch_rows(t),
        }
    }
}
