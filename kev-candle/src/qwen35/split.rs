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
//! Between the layers the rows may be [`Packing`]: each row's real steps only, one row after
//! another. A batch's states and questions differ in length, and padding every row to its
//! part's longest made the row-wise work run on padding (on varied records 1.1× the tokens with
//! states grouped by length, up to 1.7× for the branch rows); packed, only the mixers' kernels
//! see the padded rows ([`SplitRows::parts`]), and their outputs are packed again.

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

/// One part of a split (its states, or its branch rows) with each row's real steps held one
/// after another, against the part's padded rows (`rows × width`, the split's layout).
struct Part {
    /// Each held row's padded position, `[N]`.
    held: RowIndex,
    /// Each padded position's held row, `[rows·width]` (a pad: its row's last real step, whose
    /// values the mixers leave inert as they do any padding's).
    padded: RowIndex,
    /// Each row's first held row, and its length.
    rows: Vec<(usize, usize)>,
    width: usize,
}

/// A part's host tables: each held row's padded position, each padded position's held row, and
/// each row's first held row and length. None where the part holds no padding, or an empty row
/// (which has no step to stand for its padding).
type PartHost = (Vec<usize>, Vec<usize>, Vec<(usize, usize)>);

fn part_host(lengths: &[usize], width: usize) -> Option<PartHost> {
    if lengths.iter().all(|&l| l == width) || lengths.contains(&0) {
        return None;
    }
    let real: usize = lengths.iter().sum();
    let (mut held, mut padded) = (Vec::with_capacity(real), Vec::new());
    padded.reserve(lengths.len() * width);
    let mut rows = Vec::with_capacity(lengths.len());
    for (r, &len) in lengths.iter().enumerate() {
        let start = held.len();
        rows.push((start, len));
        held.extend((0..len).map(|t| r * width + t));
        padded.extend((0..width).map(|t| start + t.min(len - 1)));
    }
    Some((held, padded, rows))
}

/// The pads [`Packing`] would take out of a part of rows of `lengths` padded to `width` (none
/// where it is not packed, [`part_host`]).
fn part_pads(lengths: &[usize], width: usize) -> usize {
    if lengths.contains(&0) {
        return 0;
    }
    lengths.len() * width - lengths.iter().sum::<usize>()
}

impl Part {
    fn upload((held, padded, rows): PartHost, width: usize, device: &Device) -> Result<Self> {
        Ok(Self {
            held: RowIndex::new(&held, device)?,
            padded: RowIndex::new(&padded, device)?,
            rows,
            width,
        })
    }

    /// The held row of padded position `p`; none for a position past its row's real steps, or
    /// past the rows.
    fn row(&self, p: usize) -> Option<usize> {
        let (start, len) = *self.rows.get(p.checked_div(self.width)?)?;
        let t = p % self.width;
        (t < len).then_some(start + t)
    }
}

/// Where a split's rows sit when packed: the rows the layers hold (each state's real steps,
/// `N_s`, then each branch row's, `N_b`; a part without padding stays as the split pads it)
/// against the padded rows the mixers' kernels take (`R·S + B·T`, the split's own layout).
pub struct Packing {
    /// Each held row's padded row, `[N_s + N_b]`.
    held: RowIndex,
    /// Each padded row's held row, `[R·S + B·T]`.
    padded: RowIndex,
    /// Each padded state position's held row, `[R·S]`, where the states are packed.
    states: Option<RowIndex>,
    /// The held state rows' count (`N_s`, or `R·S` unpacked).
    state_rows: usize,
    /// The branch rows, where packed.
    branches: Option<Part>,
    /// The branch rows' padded positions (`B·T`).
    branch_positions: usize,
}

impl Packing {
    /// Whether packing `split`'s rows pays: where their padding is at least a sixteenth of the
    /// padded rows. Packing copies the mixers' inputs and outputs (about a twentieth of a
    /// layer's time over all rows at 0.8B) to spare the row-wise work on the padding (most of a
    /// layer's time a row).
    pub fn pays(split: &SplitBatch) -> bool {
        let pads = part_pads(split.state_lengths(), split.state_width())
            + part_pads(split.branch_lengths(), split.branch_width());
        pads.saturating_mul(16) >= split.tokens()
    }

    /// The packing of `split`'s rows; none where neither part holds padding without an empty
    /// row ([`part_host`]).
    pub fn of(split: &SplitBatch, device: &Device) -> Result<Option<Self>> {
        let (s_width, b_width) = (split.state_width(), split.branch_width());
        let s_tokens = split.states() * s_width;
        let branch_positions = split.branches() * b_width;
        let states = part_host(split.state_lengths(), s_width);
        let branches = part_host(split.branch_lengths(), b_width);
        if states.is_none() && branches.is_none() {
            return Ok(None);
        }
        let identity = |n: usize| -> PartHost { ((0..n).collect(), (0..n).collect(), Vec::new()) };
        let (s_held, s_padded, _) = states.clone().unwrap_or_else(|| identity(s_tokens));
        let (b_held, b_padded, _) = branches
            .clone()
            .unwrap_or_else(|| identity(branch_positions));
        let state_rows = s_held.len();
        let held: Vec<usize> = s_held
            .into_iter()
            .chain(b_held.into_iter().map(|p| s_tokens + p))
            .collect();
        let padded: Vec<usize> = s_padded
            .into_iter()
            .chain(b_padded.into_iter().map(|r| state_rows + r))
            .collect();
        Ok(Some(Self {
            held: RowIndex::new(&held, device)?,
            padded: RowIndex::new(&padded, device)?,
            states: states
                .map(|(_, padded, _)| RowIndex::new(&padded, device))
                .transpose()?,
            state_rows,
            branches: branches
                .map(|h| Part::upload(h, b_width, device))
                .transpose()?,
            branch_positions,
        }))
    }

    /// The held branch row of padded branch position `p`; none for a position past its row's
    /// real steps, or past the rows (packed, it has no row of its own).
    pub fn branch_row(&self, p: usize) -> Option<usize> {
        match &self.branches {
            Some(part) => part.row(p),
            None => (p < self.branch_positions).then_some(p),
        }
    }

    /// The held branch rows' count.
    pub fn branch_rows(&self) -> usize {
        self.branches
            .as_ref()
            .map_or(self.branch_positions, |p| p.held.len())
    }
}

/// A split's token rows as the layers hold them: the split's own layout, or packed
/// ([`Packing`]).
#[derive(Clone, Copy)]
pub(crate) struct SplitRows<'a> {
    pub(crate) split: &'a SplitBatch,
    pub(crate) packing: Option<&'a Packing>,
}

impl SplitRows<'_> {
    fn state_tokens(&self) -> usize {
        match self.packing {
            Some(p) => p.state_rows,
            None => self.split.states() * self.split.state_width(),
        }
    }

    fn branch_tokens(&self) -> usize {
        match self.packing {
            Some(p) => p.branch_rows(),
            None => self.split.branches() * self.split.branch_width(),
        }
    }

    fn branch_part(&self) -> Option<&Part> {
        self.packing.and_then(|p| p.branches.as_ref())
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
        match self.branch_part() {
            Some(part) => gather_rows(t, &part.held),
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

    /// Held `t: [N, ..]` (rows contiguous) as the states `[R, S, ..]` and the branches padded,
    /// `[B, T, ..]` (each a view, or a copy where its part is packed).
    pub(crate) fn parts(&self, t: &Tensor) -> Result<(Tensor, Tensor)> {
        let Some(packing) = self.packing else {
            return self.split.parts(t);
        };
        let split = self.split;
        let rest = &t.dims()[1..];
        let shape = |b: usize, w: usize| [&[b, w][..], rest].concat();
        let states = t.narrow(0, 0, self.state_tokens())?;
        let states = match &packing.states {
            Some(padded) => gather_rows(&states, padded)?,
            None => states,
        };
        let states = states.counted_reshape(shape(split.states(), split.state_width()))?;
        let branches = self
            .padded_branches(&self.branch_rows(t)?)?
            .counted_reshape(shape(split.branches(), split.branch_width()))?;
        Ok((states, branches))
    }

    /// Held branch rows `t: [N_b, ..]` as the split pads them, `[B·T, ..]`.
    pub(crate) fn padded_branches(&self, t: &Tensor) -> Result<Tensor> {
        match self.branch_part() {
            Some(part) => gather_rows(t, &part.padded),
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
    fn packed_rows_hold_real_steps_and_pad_with_their_last() {
        // Two states of 3 steps (one padded), branch rows of 2 and 1 real steps padded to 3.
        let dev = Device::Cpu;
        let split = SplitBatch::new(3, vec![3, 2], 3, vec![2, 1], vec![0, 1], &dev).unwrap();
        let packing = Packing::of(&split, &dev).unwrap().expect("padded rows");
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
        assert_eq!(rows_of(&held), [0., 1., 2., 3., 4., 6., 7., 9.]);
        let branches = rows.kept_of_padded(Outputs::Branches, &padded).unwrap();
        assert_eq!(rows_of(&branches), [6., 7., 9.]);
        assert_eq!(rows_of(&rows.branch_rows(&held).unwrap()), [6., 7., 9.]);
        // Back to the padded rows: a pad repeats its row's last real step.
        let (states, branches) = rows.parts(&held).unwrap();
        assert_eq!(states.dims(), [2, 3, 1]);
        assert_eq!(rows_of(&states), [0., 1., 2., 3., 4., 4.]);
        assert_eq!(branches.dims(), [2, 3, 1]);
        assert_eq!(rows_of(&branches), [6., 7., 7., 9., 9., 9.]);
        assert_eq!(
            rows_of(&rows.padded(&held).unwrap()),
            [0., 1., 2., 3., 4., 4., 6., 7., 7., 9., 9., 9.]
        );
        // The head's positions: real steps map to their held rows, pads and strays to none.
        let held_rows: Vec<Option<usize>> = (0..7).map(|p| packing.branch_row(p)).collect();
        assert_eq!(
            held_rows,
            [Some(0), Some(1), None, Some(2), None, None, None]
        );
        assert_eq!(packing.branch_rows(), 3);
        assert!(Packing::pays(&split), "4 pads of 12 rows");
        // Unpadded rows are not packed.
        let full = SplitBatch::new(3, vec![3, 3], 2, vec![2, 2], vec![0, 1], &dev).unwrap();
        assert!(Packing::of(&full, &dev).unwrap().is_none());
        assert!(!Packing::pays(&full));
    }

    /// A part without padding, or with an empty row, stays as the split pads it while the other
    /// part is packed.
    #[test]
    fn a_part_that_cannot_pack_stays_padded() {
        let dev = Device::Cpu;
        let padded = Tensor::arange(0f32, 10., &dev)
            .unwrap()
            .reshape((10, 1))
            .unwrap();
        // States packed (3 and 1 of 3 steps), branch rows 2 and 0 steps of 2: unpacked.
        let split = SplitBatch::new(3, vec![3, 1], 2, vec![2, 0], vec![0, 1], &dev).unwrap();
        let packing = Packing::of(&split, &dev).unwrap().expect("padded states");
        let rows = SplitRows {
            split: &split,
            packing: Some(&packing),
        };
        let held = rows.kept_of_padded(Outputs::All, &padded).unwrap();
        assert_eq!(rows_of(&held), [0., 1., 2., 3., 6., 7., 8., 9.]);
        let (states, branches) = rows.parts(&held).unwrap();
        assert_eq!(rows_of(&states), [0., 1., 2., 3., 3., 3.]);
        assert_eq!(rows_of(&branches), [6., 7., 8., 9.]);
        assert_eq!(packing.branch_rows(), 4);
        assert_eq!(packing.branch_row(3), Some(3));
        assert_eq!(packing.branch_row(4), None);
        // Branch rows packed (2 and 1 of 2 steps), states of an empty row: unpacked.
        let split = SplitBatch::new(2, vec![2, 0], 2, vec![2, 1], vec![0, 1], &dev).unwrap();
        let packing = Packing::of(&split, &dev)
            .unwrap()
            .expect("padded branch rows");
        let rows = SplitRows {
            split: &split,
            packing: Some(&packing),
        };
        let padded = padded.narrow(0, 0, 8).unwrap();
        let held = rows.kept_of_padded(Outputs::All, &padded).unwrap();
        assert_eq!(rows_of(&held), [0., 1., 2., 3., 4., 5., 6.]);
        let (states, branches) = rows.parts(&held).unwrap();
        assert_eq!(rows_of(&states), [0., 1., 2., 3.]);
        assert_eq!(rows_of(&branches), [4., 5., 6., 6.]);
        // The empty state's pads are not counted as the packing's.
        let empty = SplitBatch::new(3, vec![3, 0], 2, vec![2, 2], vec![0, 1], &dev).unwrap();
        assert!(Packing::of(&empty, &dev).unwrap().is_none());
        assert!(!Packing::pays(&empty));
    }
}
