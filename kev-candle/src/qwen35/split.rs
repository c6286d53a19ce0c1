//! Records' state rows and the branch rows that continue them, packed as one batch of token
//! rows ([`SplitBatch`]), so one forward runs both (the prefix form in a single pass over the
//! layers).
//!
//! Row-wise work (norms, projections, the MLP) takes all the rows at once: one launch and one
//! read of each weight instead of two, and taller matrix products. Only the sequence mixers look
//! at the two parts apart: within a layer, the states' part runs first and every branch row
//! continues from its state row's conv window, recurrent matrix and keys of that same layer,
//! exactly as a second forward on copies of the states' cache would.
//!
//! Between the layers the branch rows may be [`Packing`]: their real steps only, one row after
//! another. A batch's questions differ in length, and padding every branch row to the longest
//! made the row-wise work run on up to 1.7× the branches' tokens; packed, only the mixers'
//! kernels see the padded rows ([`SplitRows::parts`]), and their outputs are packed again.

use candle_core::{Device, Result, Tensor};
use kev_kernels::dispatch::CountedTensor;
use kev_kernels::{gather_rows, RowIndex, SplitBatch};

/// Which rows of a split batch a layer gives outputs for. The last layer's state rows feed the
/// branches only through their keys and values, conv window and recurrent matrix: nothing reads
/// their outputs, so the last layer skips them (its MLP, `o_proj` or `out_proj`, and the
/// states' own attention), about three quarters of that layer's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outputs {
    All,
    Branches,
}

/// Where a split's branch rows sit when packed: the rows the layers hold (the states' `R·S` as
/// the split pads them, then each branch row's real steps, `N_b` in all) against the padded
/// rows the mixers' kernels take (`R·S + B·T`, the split's own layout).
pub struct Packing {
    /// Each held row's padded row, `[R·S + N_b]`.
    held: RowIndex,
    /// Each held branch row's padded branch position, `[N_b]`.
    held_branches: RowIndex,
    /// Each padded row's held row, `[R·S + B·T]` (a pad: its row's last real step, whose
    /// values the mixers leave inert as they do any padding's).
    padded: RowIndex,
    /// Each padded branch position's held branch row, `[B·T]`.
    padded_branches: RowIndex,
    /// Each branch row's first held branch row, and its length.
    rows: Vec<(usize, usize)>,
    /// The padded branch rows' width (T).
    width: usize,
}

impl Packing {
    /// Whether packing `split`'s branch rows pays: where their padding is at least a sixteenth
    /// of the padded rows. Packing copies the mixers' inputs and outputs (about a twentieth of a
    /// layer's time over all rows at 0.8B) to spare the row-wise work on the padding (most of a
    /// layer's time a row).
    pub fn pays(split: &SplitBatch) -> bool {
        let real: usize = split.branch_lengths().iter().sum();
        let pads = split.branches() * split.branch_width() - real;
        pads.saturating_mul(16) >= split.tokens()
    }

    /// The packing of `split`'s branch rows; none where they hold no padding or an empty row
    /// (which has no step to stand for its padding).
    pub fn of(split: &SplitBatch, device: &Device) -> Result<Option<Self>> {
        let (s_tokens, width) = (split.states() * split.state_width(), split.branch_width());
        let lengths = split.branch_lengths();
        let real: usize = lengths.iter().sum();
        if real == lengths.len() * width || lengths.contains(&0) {
            return Ok(None);
        }
        let mut rows = Vec::with_capacity(lengths.len());
        let mut held_branches = Vec::with_capacity(real);
        let mut padded_branches = Vec::with_capacity(lengths.len() * width);
        for (b, &len) in lengths.iter().enumerate() {
            let start = held_branches.len();
            rows.push((start, len));
            held_branches.extend((0..len).map(|t| b * width + t));
            padded_branches.extend((0..width).map(|t| start + t.min(len - 1)));
        }
        let held: Vec<usize> = (0..s_tokens)
            .chain(held_branches.iter().map(|&p| s_tokens + p))
            .collect();
        let padded: Vec<usize> = (0..s_tokens)
            .chain(padded_branches.iter().map(|&r| s_tokens + r))
            .collect();
        Ok(Some(Self {
            held: RowIndex::new(&held, device)?,
            held_branches: RowIndex::new(&held_branches, device)?,
            padded: RowIndex::new(&padded, device)?,
            padded_branches: RowIndex::new(&padded_branches, device)?,
            rows,
            width,
        }))
    }

    /// The held branch row of padded branch position `p`; none for a position past its row's
    /// real steps, or past the rows (packed, it has no row of its own).
    pub fn branch_row(&self, p: usize) -> Option<usize> {
        let (start, len) = *self.rows.get(p.checked_div(self.width)?)?;
        let t = p % self.width;
        (t < len).then_some(start + t)
    }

    /// The held branch rows' count.
    pub fn branch_rows(&self) -> usize {
        self.held_branches.len()
    }
}

/// A split's token rows as the layers hold them: the split's own layout, or with its branch rows
/// packed ([`Packing`]).
#[derive(Clone, Copy)]
pub(crate) struct SplitRows<'a> {
    pub(crate) split: &'a SplitBatch,
    pub(crate) packing: Option<&'a Packing>,
}

impl SplitRows<'_> {
    fn state_tokens(&self) -> usize {
        self.split.states() * self.split.state_width()
    }

    fn branch_tokens(&self) -> usize {
        match self.packing {
            Some(p) => p.branch_rows(),
            None => self.split.branches() * self.split.branch_width(),
        }
    }

    /// The branch rows of held rows `t: [N, ..]` (a view).
    pub(crate) fn branch_rows(&self, t: &Tensor) -> Result<Tensor> {
        t.narrow(0, self.state_tokens(), self.branch_tokens())
    }

    /// The rows of held `t: [N, ..]` that a layer giving `outputs` keeps: all of them, or the
    /// branch rows (a view).
    pub(crate) fn kept(&self, outputs: Outputs, t: &Tensor) -> Result<Tensor> {
        match outputs {
            Outputs::All => Ok(t.clone()),
            Outputs::Branches => self.branch_rows(t),
        }
    }

    /// The kept rows ([`SplitRows::kept`]) of `t`, given in the split's padded rows `[R·S + B·T,
    /// ..]`: a view, or packed (a copy).
    pub(crate) fn kept_of_padded(&self, outputs: Outputs, t: &Tensor) -> Result<Tensor> {
        match (outputs, self.packing) {
            (Outputs::All, None) => Ok(t.clone()),
            (Outputs::All, Some(p)) => gather_rows(t, &p.held),
            (Outputs::Branches, _) => self.held_branches(&self.split.branch_rows(t)?),
        }
    }

    /// Padded branch rows `t: [B·T, ..]` as the layers hold them (itself, or packed: a copy).
    pub(crate) fn held_branches(&self, t: &Tensor) -> Result<Tensor> {
        match self.packing {
            Some(p) => gather_rows(t, &p.held_branches),
            None => Ok(t.clone()),
        }
    }

    /// Held `t: [N, ..]` in the split's padded rows `[R·S + B·T, ..]` (itself, or a copy).
    pub(crate) fn padded(&self, t: &Tensor) -> Result<Tensor> {
        match self.packing {
            Some(p) => gather_rows(t, &p.padded),
            None => Ok(t.clone()),
        }
    }

    /// Held `t: [N, ..]` (rows contiguous) as the states `[R, S, ..]` (a view) and the branches
    /// padded, `[B, T, ..]` (a view, or a copy where packed).
    pub(crate) fn parts(&self, t: &Tensor) -> Result<(Tensor, Tensor)> {
        if self.packing.is_none() {
            return self.split.parts(t);
        }
        let split = self.split;
        let rest = &t.dims()[1..];
        let shape = |b: usize, w: usize| [&[b, w][..], rest].concat();
        let states = t
            .narrow(0, 0, self.state_tokens())?
            .counted_reshape(shape(split.states(), split.state_width()))?;
        let branches = self
            .padded_branches(&self.branch_rows(t)?)?
            .counted_reshape(shape(split.branches(), split.branch_width()))?;
        Ok((states, branches))
    }

    /// Held branch rows `t: [N_b, ..]` as the split pads them, `[B·T, ..]`.
    pub(crate) fn padded_branches(&self, t: &Tensor) -> Result<Tensor> {
        match self.packing {
            Some(p) => gather_rows(t, &p.padded_branches),
            None => Ok(t.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows_of(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    #[test]
    fn packed_branch_rows_hold_real_steps_and_pad_with_their_last() {
        // Two states of 3 steps (one padded), branch rows of 2 and 1 real steps padded to 3.
        let dev = Device::Cpu;
        let split = SplitBatch::new(3, vec![3, 2], 3, vec![2, 1], vec![0, 1], &dev).unwrap();
        let packing = Packing::of(&split, &dev)
            .unwrap()
            .expect("padded branch rows");
        let rows = SplitRows {
            split: &split,
            packing: Some(&packing),
        };
        // Each padded row's own number: states 0..6, branch positions 6..12.
        let padded = Tensor::arange(0f32, 12., &dev)
            .unwrap()
            .reshape((12, 1))
            .unwrap();
        let held = rows.kept_of_padded(Outputs::All, &padded).unwrap();
        assert_eq!(rows_of(&held), [0., 1., 2., 3., 4., 5., 6., 7., 9.]);
        let branches = rows.kept_of_padded(Outputs::Branches, &padded).unwrap();
        assert_eq!(rows_of(&branches), [6., 7., 9.]);
        assert_eq!(rows_of(&rows.branch_rows(&held).unwrap()), [6., 7., 9.]);
        // Back to the padded rows: a pad repeats its row's last real step.
        let (states, branches) = rows.parts(&held).unwrap();
        assert_eq!(states.dims(), [2, 3, 1]);
        assert_eq!(rows_of(&branches), [6., 7., 7., 9., 9., 9.]);
        assert_eq!(
            rows_of(&rows.padded(&held).unwrap()),
            [0., 1., 2., 3., 4., 5., 6., 7., 7., 9., 9., 9.]
        );
        // The head's positions: real steps map to their held rows, pads and strays to none.
        let held_rows: Vec<Option<usize>> = (0..7).map(|p| packing.branch_row(p)).collect();
        assert_eq!(
            held_rows,
            [Some(0), Some(1), None, Some(2), None, None, None]
        );
        assert_eq!(packing.branch_rows(), 3);
        assert!(Packing::pays(&split), "3 pads of 12 rows");
        // Unpadded branch rows, or an empty one, are not packed.
        let full = SplitBatch::new(3, vec![3, 2], 2, vec![2, 2], vec![0, 1], &dev).unwrap();
        assert!(Packing::of(&full, &dev).unwrap().is_none());
        assert!(!Packing::pays(&full));
        let empty = SplitBatch::new(3, vec![3, 2], 2, vec![2, 0], vec![0, 1], &dev).unwrap();
        assert!(Packing::of(&empty, &dev).unwrap().is_none());
    }
}
