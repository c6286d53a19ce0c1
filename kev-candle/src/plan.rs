//! Planning prefix-form scoring: which token ids each forward runs, in which rows, and where the
//! head reads. Plans are host data only, so the eager executor and the CUDA graphs run the same
//! plan the same way.

use kev_core::Row;

/// Token id used to right-pad branches and states (never read: both layer kinds are causal and
/// padded positions are masked out of later attention).
const PAD_ID: u32 = 0;

/// One forward's token ids: `lengths.len()` rows right-padded to `width`, flattened.
pub(crate) struct Piece {
    pub(crate) ids: Vec<u32>,
    pub(crate) width: usize,
    pub(crate) lengths: Vec<usize>,
}

/// What scoring records in prefix form runs: the states' pieces (one row per record) into a
/// fresh cache, then all branches' pieces as one batch, each branch row on a copy of its
/// record's cache row, then the head at each row's positions. With one piece each, both run in
/// one pass over the layers instead ([`crate::qwen35::Split`]).
pub(crate) struct Plan {
    pub(crate) state: Vec<Piece>,
    /// Records, so rows of the state cache (its pieces are empty when every state is).
    pub(crate) records: usize,
    pub(crate) branches: Vec<Piece>,
    /// The record (state row) of each branch row.
    pub(crate) owners: Vec<usize>,
    pub(crate) rows: Vec<Row>,
}

impl Plan {
    /// The plan scoring `records` (each a state and its rows) in one go, in pieces of at most
    /// `chunk` steps.
    pub(crate) fn new(records: Vec<(Vec<u32>, Vec<Row>)>, chunk: usize) -> Self {
        let states: Vec<&[u32]> = records.iter().map(|(s, _)| s.as_slice()).collect();
        let state = pieces(&states, chunk);
        let owners: Vec<usize> = records
            .iter()
            .enumerate()
            .flat_map(|(i, (_, rows))| std::iter::repeat_n(i, rows.len()))
            .collect();
        let records_n = records.len();
        let rows: Vec<Row> = records.into_iter().flat_map(|(_, rows)| rows).collect();
        let branch_ids: Vec<&[u32]> = rows.iter().map(|r| r.ids.as_slice()).collect();
        Plan {
            state,
            records: records_n,
            branches: pieces(&branch_ids, chunk),
            owners,
            rows,
        }
    }

    /// The state's pieces, then the branches'.
    pub(crate) fn pieces(&self) -> impl Iterator<Item = &Piece> {
        self.state.iter().chain(&self.branches)
    }

    /// Where the head reads the branch rows (flat indices into their `B·width` positions,
    /// [`Plan::branch_width`]): every row's `[DECIDE]`, then every option in row order; and
    /// each option's row. The indices differ between plans of one shape, so a CUDA graph takes
    /// them as an input; each option's row depends on the shape alone.
    pub(crate) fn head_reads(&self) -> (Vec<usize>, Vec<u32>) {
        let (decide, opts, owner) = head_positions(&self.rows, self.branch_width());
        (decide.into_iter().chain(opts).collect(), owner)
    }

    /// The branch rows' width: their pieces' widths summed (the longest branch, padded).
    pub(crate) fn branch_width(&self) -> usize {
        self.branches.iter().map(|p| p.width).sum()
    }

    /// `flat` (all options' logits of the plan, in row order) cut per record and question.
    pub(crate) fn logits_per_record(&self, flat: &[f32]) -> Vec<Vec<Vec<f32>>> {
        let mut out: Vec<Vec<Vec<f32>>> = vec![Vec::new(); self.records];
        for (owner, l) in self.owners.iter().zip(split_logits(flat, &self.rows)) {
            out[*owner].push(l);
        }
        out
    }
}

/// Right-pads `seqs` into `[B, T]` and cuts it into pieces of at most `chunk` steps.
pub(crate) fn pieces<S: AsRef<[u32]>>(seqs: &[S], chunk: usize) -> Vec<Piece> {
    let width = seqs.iter().map(|s| s.as_ref().len()).max().unwrap_or(0);
    (0..width)
        .step_by(chunk)
        .map(|start| {
            let end = (start + chunk).min(width);
            let rows: Vec<&[u32]> = seqs
                .iter()
                .map(|s| {
                    let s = s.as_ref();
                    &s[start.min(s.len())..end.min(s.len())]
                })
                .collect();
            Piece {
                ids: rows
                    .iter()
                    .flat_map(|p| {
                        p.iter()
                            .copied()
                            .chain(std::iter::repeat_n(PAD_ID, end - start - p.len()))
                    })
                    .collect(),
                width: end - start,
                lengths: rows.iter().map(|p| p.len()).collect(),
            }
        })
        .collect()
}

/// Padding a bucket's states to its longest may cost at most this fraction of its real tokens
/// (plus [`PAD_SLACK`]) before a longer state starts a new bucket.
const PAD_WASTE: f64 = 0.25;
/// Padding always allowed per bucket, in tokens: short states are cheap to pad and a pass has a
/// fixed cost of its own.
const PAD_SLACK: usize = 64;

/// Records grouped by state length (indices into `lengths`, each group one pass): a batch pads
/// every state to its longest, so mixing a 10-token state with a 1,000-token one would make the
/// batch slower than scoring one by one. Sorted by length, a record joins the current group while
/// the group's padded tokens stay within [`PAD_WASTE`] of its real ones plus [`PAD_SLACK`].
pub(crate) fn length_buckets(lengths: &[usize]) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by_key(|&i| lengths[i]);
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut real = 0usize;
    for i in order {
        let len = lengths[i];
        if let Some(bucket) = buckets.last_mut() {
            let padded = (bucket.len() + 1) * len;
            let real_then = real + len;
            if padded as f64 <= (1.0 + PAD_WASTE) * real_then as f64 + PAD_SLACK as f64 {
                bucket.push(i);
                real = real_then;
                continue;
            }
        }
        buckets.push(vec![i]);
        real = len;
    }
    buckets
}

/// The tokens the state passes of states of these `lengths` run, padding included: each group
/// of `length_buckets` padded to its longest. What a batch costs, for callers that budget
/// batches (a server's batcher).
pub fn state_pass_tokens(lengths: &[usize]) -> usize {
    length_buckets(lengths)
        .iter()
        .map(|group| group.len() * group.iter().map(|&i| lengths[i]).max().unwrap_or(0))
        .sum()
}

/// Where the head reads rows `rows` of width `width` (flat indices into their `B·width`
/// positions): each row's `[DECIDE]`, every row's options in order, and each option's row.
pub(crate) fn head_positions(rows: &[Row], width: usize) -> (Vec<usize>, Vec<usize>, Vec<u32>) {
    let decide = rows
        .iter()
        .enumerate()
        .map(|(i, r)| i * width + r.decide)
        .collect();
    let mut opts = Vec::new();
    let mut owner = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        opts.extend(r.opts.iter().map(|&o| i * width + o));
        owner.extend(std::iter::repeat_n(i as u32, r.opts.len()));
    }
    (decide, opts, owner)
}

/// `flat` (all options' logits in row order) cut per row.
pub(crate) fn split_logits(flat: &[f32], rows: &[Row]) -> Vec<Vec<f32>> {
    let mut at = 0;
    rows.iter()
        .map(|r| {
            at += r.opts.len();
            flat[at - r.opts.len()..at].to_vec()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::length_buckets;

    #[test]
    fn buckets_keep_padding_bounded_and_cover_every_record_once() {
        assert!(length_buckets(&[]).is_empty());
        assert_eq!(length_buckets(&[100, 100, 100]), vec![vec![0, 1, 2]]);
        // Short states share a bucket (the slack); a long one does not join them.
        assert_eq!(
            length_buckets(&[10, 1000, 20, 30]),
            vec![vec![0, 2, 3], vec![1]]
        );
        let lengths: Vec<usize> = (0..200).map(|i| (i * 37) % 1100).collect();
        let buckets = length_buckets(&lengths);
        let mut seen: Vec<usize> = buckets.iter().flatten().copied().collect();
        seen.sort();
        assert_eq!(seen, (0..200).collect::<Vec<_>>());
        for b in &buckets {
            let real: usize = b.iter().map(|&i| lengths[i]).sum();
            let padded = b.len() * b.iter().map(|&i| lengths[i]).max().unwrap();
            assert!(padded as f64 <= 1.25 * real as f64 + 64.0, "{b:?}");
        }
    }
}
