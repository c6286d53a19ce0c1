//! Planning prefix-form scoring: which states each pass computes, where every branch row's state
//! comes from (a state of the pass, or a given [`Prefix`]), which token ids each forward runs,
//! and where the head reads. Plans are host data only, so the eager executor and the CUDA graphs
//! run the same passes the same way.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use kev_core::Row;

use crate::encoded::EncodedRecord;
use crate::prefix::Prefix;

/// Token id used to right-pad branches and states (never read: both layer kinds are causal and
/// padded positions are masked out of later attention).
const PAD_ID: u32 = 0;

/// One forward's token ids: `lengths.len()` rows right-padded to `width`, flattened.
pub(crate) struct Piece {
    pub(crate) ids: Vec<u32>,
    pub(crate) width: usize,
    pub(crate) lengths: Vec<usize>,
}

/// What scoring a batch of records runs: the records whose state is computed, grouped into
/// passes by state length and branch length ([`state_groups`]: a pass pads its states to its
/// longest and its branch rows to theirs), each distinct state once; the records whose prefix is
/// given join the last pass (or make one).
pub(crate) struct Plan {
    pub(crate) passes: Vec<Pass>,
    /// Each record's pass and its slot there.
    at: Vec<(usize, usize)>,
}

/// One pass: its computed states' pieces (one row each) into a fresh cache, whose rows are
/// followed by the given prefixes' rows; then all its branch rows as one batch, each on a copy
/// of its state's row; then the head at each branch row's positions. A pass that computes its
/// states in one piece and neither keeps them nor is given any runs both parts in one pass over
/// the layers ([`crate::qwen35::Model::forward_split`]).
pub(crate) struct Pass {
    pub(crate) state: Vec<Piece>,
    /// State rows computed (its pieces are empty when every such state is).
    pub(crate) computed: usize,
    /// The prefixes whose rows follow the computed ones.
    pub(crate) given: Vec<Arc<Prefix>>,
    /// Whether the computed states' rows are cut out and kept, as prefixes.
    pub(crate) keep: bool,
    pub(crate) branches: Vec<Piece>,
    /// The state row (computed, then given) of each branch row.
    pub(crate) owners: Vec<usize>,
    pub(crate) rows: Vec<Row>,
    /// Option reads added after the real ones (each at the first branch position, of the first
    /// row; their logits are dropped), so that a padded pass's option count is a bucket
    /// ([`bucket_width`]) and records with other option counts share its CUDA graph.
    head_pad: usize,
    /// Per record of the pass: its state row, its branch rows and where its options' logits
    /// start in the pass's.
    slots: Vec<(usize, Range<usize>, usize)>,
}

/// One record's part of a run's output: its logits per question, and its state's row.
pub(crate) struct RecordOut {
    pub(crate) logits: Vec<Vec<f32>>,
    /// Its pass and the row of its state there.
    pub(crate) state: (usize, usize),
}

impl Plan {
    /// The plan scoring `records`, where `given[i]` (when `given` is not empty) is record i's
    /// prefix, already checked to be of its state; `keep`: the computed states' rows are kept.
    /// Pieces are at most `chunk` steps; computed states are grouped into passes by `grouping`
    /// ([`state_groups`]). A plain pass in one pass over the layers pads its two
    /// pieces to [`bucket_width`]s where `pads` says so for those widths (a CUDA graph of it
    /// would take its lengths as inputs) and it stays graph-sized, so that records of nearby
    /// lengths share a graph.
    pub(crate) fn new(
        records: &[EncodedRecord],
        given: &[Option<Arc<Prefix>>],
        keep: bool,
        chunk: usize,
        grouping: Grouping,
        pads: &dyn Fn(usize, usize) -> bool,
    ) -> Self {
        let given_of = |i: usize| given.get(i).and_then(Option::as_ref);
        // The distinct computed states, and each computed record's.
        let mut cold: Vec<&[u32]> = Vec::new();
        let mut cold_at: HashMap<&[u32], usize> = HashMap::new();
        let cold_of: Vec<Option<usize>> = records
            .iter()
            .enumerate()
            .map(|(i, rec)| {
                given_of(i).is_none().then(|| {
                    *cold_at.entry(rec.state_ids.as_slice()).or_insert_with(|| {
                        cold.push(&rec.state_ids);
                        cold.len() - 1
                    })
                })
            })
            .collect();
        let mut loads: Vec<StateLoad> = cold
            .iter()
            .map(|s| StateLoad {
                tokens: s.len(),
                ..StateLoad::default()
            })
            .collect();
        for (rec, j) in records.iter().zip(&cold_of) {
            if let Some(j) = *j {
                loads[j] =
                    loads[j].with_rows(rec.questions(), rec.longest_branch(), rec.branch_tokens());
            }
        }
        // Cold state j is row `cold_row[j].1` of pass `cold_row[j].0`.
        let mut cold_row = vec![(0, 0); cold.len()];
        let mut passes: Vec<Pass> = state_groups(&loads, grouping)
            .into_iter()
            .enumerate()
            .map(|(p, members)| {
                for (r, &j) in members.iter().enumerate() {
                    cold_row[j] = (p, r);
                }
                let states: Vec<&[u32]> = members.iter().map(|&j| cold[j]).collect();
                Pass::empty(pieces(&states, chunk), members.len(), keep)
            })
            .collect();
        // The given prefixes, each distinct one a row after the computed ones of the last pass
        // (the longest states: the given rows' keys pad the least there), so hits and misses
        // run in one pass; or of a pass of their own where no state is computed.
        let mut hits: Vec<Arc<Prefix>> = Vec::new();
        let mut hit_at: HashMap<*const Prefix, usize> = HashMap::new();
        let given_row: Vec<Option<usize>> = (0..records.len())
            .map(|i| {
                given_of(i).map(|p| {
                    *hit_at.entry(Arc::as_ptr(p)).or_insert_with(|| {
                        hits.push(Arc::clone(p));
                        hits.len() - 1
                    })
                })
            })
            .collect();
        let hits_pass = (!hits.is_empty()).then(|| {
            if passes.is_empty() {
                passes.push(Pass::empty(Vec::new(), 0, false));
            }
            let last = passes.len() - 1;
            passes[last].given = hits;
            last
        });
        let mut branch_rows: Vec<Vec<&Row>> = vec![Vec::new(); passes.len()];
        let mut options = vec![0usize; passes.len()];
        let at = records
            .iter()
            .enumerate()
            .map(|(i, rec)| {
                let (p, row) = match (cold_of[i], given_row[i]) {
                    (Some(j), _) => cold_row[j],
                    (None, Some(g)) => {
                        let p = hits_pass.expect("a given prefix has its pass");
                        (p, passes[p].computed + g)
                    }
                    (None, None) => unreachable!("a record's state is computed or given"),
                };
                let pass = &mut passes[p];
                let first = pass.owners.len();
                pass.owners.extend(std::iter::repeat_n(row, rec.rows.len()));
                branch_rows[p].extend(&rec.rows);
                pass.slots.push((row, first..pass.owners.len(), options[p]));
                options[p] += rec.rows.iter().map(|r| r.opts.len()).sum::<usize>();
                (p, pass.slots.len() - 1)
            })
            .collect();
        for (pass, rows) in passes.iter_mut().zip(branch_rows) {
            let ids: Vec<&[u32]> = rows.iter().map(|r| r.ids.as_slice()).collect();
            pass.branches = pieces(&ids, chunk);
            pass.rows = rows.into_iter().cloned().collect();
            if pass.is_plain() && pass.is_one_piece() {
                let widths = [&pass.state[0], &pass.branches[0]]
                    .map(|p| (p.lengths.len(), bucket_width(p.width, chunk)));
                let tokens = widths.iter().map(|(rows, w)| rows * w).sum();
                let (s, t) = (widths[0].1, widths[1].1);
                if crate::graphs::graph_sized(tokens, s + t) && pads(s, t) {
                    pass.state[0].pad_to(widths[0].1);
                    pass.branches[0].pad_to(widths[1].1);
                    let options = pass.options();
                    pass.head_pad = bucket_width(options, usize::MAX) - options;
                }
            }
        }
        Plan { passes, at }
    }

    /// Each record's logits per question (from each pass's flat logits, in its row order) and
    /// its state's row.
    pub(crate) fn per_record(&self, logits: &[Vec<f32>]) -> Vec<RecordOut> {
        self.at
            .iter()
            .map(|&(p, slot)| {
                let pass = &self.passes[p];
                let (row, ref range, before) = pass.slots[slot];
                let rows = &pass.rows[range.clone()];
                RecordOut {
                    logits: split_logits(&logits[p][before..], rows),
                    state: (p, row),
                }
            })
            .collect()
    }
}

impl Pass {
    fn empty(state: Vec<Piece>, computed: usize, keep: bool) -> Self {
        Pass {
            state,
            computed,
            given: Vec::new(),
            keep,
            branches: Vec::new(),
            owners: Vec::new(),
            rows: Vec::new(),
            head_pad: 0,
            slots: Vec::new(),
        }
    }

    /// Whether the pass computes every state it reads and keeps none: its output is its logits
    /// alone, so a CUDA graph can replay it.
    pub(crate) fn is_plain(&self) -> bool {
        self.given.is_empty() && !self.keep && !self.rows.is_empty()
    }

    /// Whether its computed states and its branches are one piece each: it runs in one pass
    /// over the layers ([`crate::qwen35::Model::forward_split`]).
    pub(crate) fn is_one_piece(&self) -> bool {
        self.state.len() == 1 && self.branches.len() == 1
    }

    /// The state's pieces, then the branches'.
    pub(crate) fn pieces(&self) -> impl Iterator<Item = &Piece> {
        self.state.iter().chain(&self.branches)
    }

    /// Where the head reads the branch rows (flat indices into their `B·width` positions,
    /// [`Pass::branch_width`]): every row's `[DECIDE]`, then every option in row order, then
    /// the padding's; and each option's row. The indices differ between passes of one shape, so
    /// a CUDA graph takes them as an input; each option's row depends on the shape alone.
    pub(crate) fn head_reads(&self) -> (Vec<usize>, Vec<u32>) {
        let (decide, opts, mut owner) = head_positions(&self.rows, self.branch_width());
        owner.resize(owner.len() + self.head_pad, 0);
        let pad = std::iter::repeat_n(0, self.head_pad);
        (decide.into_iter().chain(opts).chain(pad).collect(), owner)
    }

    /// The options the head reads: every row's, and the padding's.
    pub(crate) fn options(&self) -> usize {
        self.rows.iter().map(|r| r.opts.len()).sum::<usize>() + self.head_pad
    }

    /// The branch rows' width: their pieces' widths summed (the longest branch, padded).
    pub(crate) fn branch_width(&self) -> usize {
        self.branches.iter().map(|p| p.width).sum()
    }
}

impl Piece {
    /// The same rows right-padded to `width` (at least the piece's own).
    fn pad_to(&mut self, width: usize) {
        if width <= self.width {
            return;
        }
        let mut ids = Vec::with_capacity(self.lengths.len() * width);
        for row in self.ids.chunks(self.width.max(1)).take(self.lengths.len()) {
            ids.extend_from_slice(row);
            ids.extend(std::iter::repeat_n(PAD_ID, width - row.len()));
        }
        ids.resize(self.lengths.len() * width, PAD_ID);
        self.ids = ids;
        self.width = width;
    }
}

/// The width a CUDA-graphed piece of `width` steps pads to (at most `chunk`, the longest piece):
/// a multiple of 16 up to 128, then a quarter of the power of two below (4 widths an octave),
/// so padding adds at most a quarter of the steps, or 15, and a few graphs serve every length.
pub(crate) fn bucket_width(width: usize, chunk: usize) -> usize {
    let bucket = if width <= 128 {
        width.div_ceil(16) * 16
    } else {
        let step = (1usize << width.ilog2()) / 4;
        width.div_ceil(step) * step
    };
    bucket.min(chunk).max(width)
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

/// A distinct computed state's load on a pass: its tokens, and the branch rows that continue it
/// (how many, the longest one's tokens, and all their tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateLoad {
    /// The state's tokens.
    pub tokens: usize,
    /// The branch rows that continue it.
    pub rows: usize,
    /// The longest of those rows' tokens.
    pub longest_row: usize,
    /// All those rows' tokens.
    pub branch_tokens: usize,
}

impl StateLoad {
    /// This state's load with `rows` more branch rows of `tokens` tokens, the longest of them
    /// `longest`.
    pub fn with_rows(self, rows: usize, longest: usize, tokens: usize) -> Self {
        Self {
            rows: self.rows + rows,
            longest_row: self.longest_row.max(longest),
            branch_tokens: self.branch_tokens + tokens,
            ..self
        }
    }

    /// Its tokens as a pass of its own holds them between the layers: its branch rows packed.
    fn alone(&self) -> usize {
        self.tokens + self.branch_tokens
    }

    /// Its branch rows as a pass of its own pads them for the mixers.
    fn padded_rows(&self) -> usize {
        self.rows * self.longest_row
    }
}

/// How far a backend pads states into one pass ([`state_groups`]): a pass's held tokens (its
/// states padded to its longest, its branch rows packed: their own tokens) may exceed what its
/// states would hold alone ([`StateLoad::alone`]) by `waste` of those plus `slack` tokens, and
/// the branch rows padded for its mixers (each to the pass's longest) at most twice theirs
/// padded alone plus `slack` (their memory), before a longer state starts a new pass.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Grouping {
    waste: f64,
    slack: usize,
}

impl Grouping {
    /// A GPU's: a pass there costs about 1,000 tokens' time of its own (its few hundred
    /// kernels' time on small rows, which issuing passes ahead does not hide; the H100 at
    /// 0.8B), so short states are worth padding into one pass (14–26 % faster on varied records
    /// than the CPU's rule, 8–13 % than 25 % + 4,096; counting held tokens, not the branch rows
    /// padded, 1.5–2 %; BENCHMARKS.md).
    pub(crate) const GPU: Self = Self {
        waste: 0.1,
        slack: 1024,
    };
    /// A CPU's: a pass costs little beyond its tokens, so padding stays near the records' own
    /// (on varied records 1.29× the GPU's rule; counting the branch rows held rather than
    /// padded measured within the noise on Zen 4; BENCHMARKS.md).
    pub(crate) const CPU: Self = Self {
        waste: 0.05,
        slack: 32,
    };
}

/// A pass's states and branch rows as it pads them: how many of each, and the longest of each.
#[derive(Debug, Clone, Copy, Default)]
struct Padded {
    states: usize,
    longest: usize,
    rows: usize,
    longest_row: usize,
    /// The computed states' branch rows' own tokens.
    branch_tokens: usize,
}

impl Padded {
    /// The pass with `load`'s state and its branch rows added.
    fn with(self, load: &StateLoad) -> Self {
        Self {
            states: self.states + 1,
            longest: self.longest.max(load.tokens),
            branch_tokens: self.branch_tokens + load.branch_tokens,
            ..self.with_rows(load.rows, load.longest_row)
        }
    }

    /// The pass with `rows` more branch rows, the longest of them `longest` tokens.
    fn with_rows(self, rows: usize, longest: usize) -> Self {
        Self {
            rows: self.rows + rows,
            longest_row: if rows > 0 {
                self.longest_row.max(longest)
            } else {
                self.longest_row
            },
            ..self
        }
    }

    /// Its tokens: each state padded to the longest, each branch row to the longest row.
    fn tokens(&self) -> usize {
        self.states * self.longest + self.padded_rows()
    }

    /// Its branch rows padded to the longest.
    fn padded_rows(&self) -> usize {
        self.rows * self.longest_row
    }

    /// Its tokens between the layers: each state padded to the longest, the computed states'
    /// branch rows packed.
    fn held(&self) -> usize {
        self.states * self.longest + self.branch_tokens
    }
}

/// The padded tokens of a pass of these states ([`Padded::tokens`]).
fn pass_tokens<'a>(loads: impl IntoIterator<Item = &'a StateLoad>) -> usize {
    loads
        .into_iter()
        .fold(Padded::default(), |p, l| p.with(l))
        .tokens()
}

/// Computed states grouped into passes (indices into `loads`, each group one pass): a pass pads
/// every state to its longest and every branch row, for the mixers, to its longest, so mixing a
/// 10-token state with a 1,000-token one, or a 2,000-token branch with 20-token ones, would make
/// the pass slower, or larger, than scoring them apart. Sorted by state length, a state joins the
/// current group while the group stays within `rule` ([`Grouping`]).
pub(crate) fn state_groups(loads: &[StateLoad], rule: Grouping) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..loads.len()).collect();
    // Equal states' loads are interchangeable, so the groups' tokens do not depend on the order
    // the states came in (a batcher's count is the plan's).
    order.sort_by_key(|&i| {
        let l = &loads[i];
        (l.tokens, l.longest_row, l.rows, l.branch_tokens)
    });
    let mut groups: Vec<Vec<usize>> = Vec::new();
    // The current group, padded; what its states would hold alone; and their branch rows
    // padded alone.
    let (mut padded, mut alone, mut rows_alone) = (Padded::default(), 0, 0);
    for i in order {
        let load = &loads[i];
        let padded_then = padded.with(load);
        let (alone_then, rows_then) = (alone + load.alone(), rows_alone + load.padded_rows());
        if let Some(group) = groups.last_mut() {
            let bound = (1.0 + rule.waste) * alone_then as f64 + rule.slack as f64;
            if padded_then.held() as f64 <= bound
                && padded_then.padded_rows() <= 2 * rows_then + rule.slack
            {
                group.push(i);
                (padded, alone, rows_alone) = (padded_then, alone_then, rows_then);
                continue;
            }
        }
        groups.push(vec![i]);
        (padded, alone, rows_alone) = (
            Padded::default().with(load),
            load.alone(),
            load.padded_rows(),
        );
    }
    groups
}

/// The tokens a batch runs, padding included, as [`Plan`] runs it: its computed states (`cold`,
/// one load each distinct state) grouped into passes by `rule` ([`state_groups`]), and the
/// branch rows continuing given prefixes (`given`: how many rows, the longest's tokens) joining
/// the last pass's rows (or a pass of their own).
pub(crate) fn batch_tokens(cold: &[StateLoad], given: (usize, usize), rule: Grouping) -> usize {
    let groups = state_groups(cold, rule);
    let (last, rest) = groups
        .split_last()
        .map_or((&[][..], &[][..]), |(last, rest)| (&last[..], rest));
    let before: usize = rest
        .iter()
        .map(|g| pass_tokens(g.iter().map(|&i| &cold[i])))
        .sum();
    // The given rows join the last pass's (or, no state computed, make one): its states as they
    // are, its rows padded to the longest of both.
    let last = last
        .iter()
        .fold(Padded::default(), |p, &i| p.with(&cold[i]));
    before + last.with_rows(given.0, given.1).tokens()
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
    use kev_core::Row;

    use super::{batch_tokens, bucket_width, pieces, state_groups, Grouping, Plan, StateLoad};
    use crate::encoded::EncodedRecord;

    fn record(state: usize, options: &[usize]) -> EncodedRecord {
        let rows = options.iter().map(|&n| Row {
            ids: (1..=n as u32 + 2).collect(),
            decide: 1,
            opts: (2..n + 2).collect(),
        });
        encoded(state, rows.collect())
    }

    /// A record of a `state`-token state and these branch rows.
    fn encoded(state: usize, rows: Vec<Row>) -> EncodedRecord {
        EncodedRecord {
            id: None,
            state: String::new(),
            state_ids: (1..=state as u32).collect(),
            rows,
        }
    }

    /// A padded pass reads its options where the unpadded one does, then padding that a
    /// record's logits never include, up to a bucket; records of other option counts and
    /// nearby lengths then have the same shape.
    #[test]
    fn padded_passes_share_shapes_and_keep_their_reads() {
        let recs = [record(36, &[2, 3]), record(44, &[4, 6])];
        let plain = |r: &EncodedRecord| {
            Plan::new(std::slice::from_ref(r), &[], false, 512, GPU, &|_, _| false)
        };
        let padded = |r: &EncodedRecord| {
            Plan::new(std::slice::from_ref(r), &[], false, 512, GPU, &|_, _| true)
        };
        let shape = |plan: &Plan| {
            let p = &plan.passes[0];
            (
                p.state[0].width,
                p.branches[0].width,
                p.rows.len(),
                p.options(),
            )
        };
        assert_eq!(shape(&padded(&recs[0])), shape(&padded(&recs[1])));
        assert_eq!(shape(&padded(&recs[0])), (48, 16, 2, 16));
        assert_ne!(shape(&plain(&recs[0])), shape(&plain(&recs[1])));
        for r in &recs {
            let (a, b) = (plain(r), padded(r));
            let ((reads, owner), (reads_p, owner_p)) =
                (a.passes[0].head_reads(), b.passes[0].head_reads());
            let options: usize = r.rows.iter().map(|row| row.opts.len()).sum();
            assert_eq!((reads.len(), owner.len()), (2 + options, options));
            // The branch width grows, so the real reads move to the padded rows' positions.
            let (w, w_p) = (a.passes[0].branch_width(), b.passes[0].branch_width());
            let moved: Vec<usize> = reads.iter().map(|&i| i / w * w_p + i % w).collect();
            assert_eq!(reads_p[..reads.len()], moved[..]);
            assert_eq!(owner_p[..owner.len()], owner[..]);
            assert!(reads_p[reads.len()..].iter().all(|&i| i == 0));
            assert!(owner_p[owner.len()..].iter().all(|&o| o == 0));
            assert_eq!(owner_p.len(), 16);
            // Each record's logits are its own options', whatever follows them.
            let flat: Vec<f32> = (0..owner_p.len()).map(|i| i as f32).collect();
            let got = &b.per_record(&[flat])[0].logits;
            assert_eq!(got.iter().map(Vec::len).sum::<usize>(), options);
            assert_eq!(
                got.concat(),
                (0..options).map(|i| i as f32).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn bucket_widths_bound_the_padding() {
        assert_eq!(bucket_width(0, 512), 0);
        assert_eq!(bucket_width(1, 512), 16);
        assert_eq!(bucket_width(48, 512), 48);
        assert_eq!(bucket_width(128, 512), 128);
        assert_eq!(bucket_width(129, 512), 160);
        assert_eq!(bucket_width(700, 2048), 768);
        assert_eq!(bucket_width(700, 720), 720, "never past the chunk");
        assert_eq!(bucket_width(900, 720), 900, "never below the width");
        let mut widths = std::collections::BTreeSet::new();
        for w in 1..=2048 {
            let b = bucket_width(w, 4096);
            assert!(b >= w && (b - w) * 4 <= w.max(60), "{w} -> {b}");
            widths.insert(b);
        }
        assert_eq!(widths.len(), 8 + 4 * 4, "{widths:?}");
    }

    #[test]
    fn padded_pieces_keep_their_rows() {
        let mut piece = pieces(&[vec![1u32, 2, 3], vec![4]], 8).remove(0);
        piece.pad_to(5);
        assert_eq!(piece.ids, [1, 2, 3, 0, 0, 4, 0, 0, 0, 0]);
        assert_eq!((piece.width, piece.lengths.clone()), (5, vec![3, 1]));
    }

    const GPU: Grouping = Grouping::GPU;

    /// A state of `tokens` and `rows` branch rows of `longest_row` tokens each.
    fn load(tokens: usize, rows: usize, longest_row: usize) -> StateLoad {
        StateLoad {
            tokens,
            rows,
            longest_row,
            branch_tokens: rows * longest_row,
        }
    }

    #[test]
    fn groups_keep_padding_bounded_and_cover_every_state_once() {
        assert!(state_groups(&[], GPU).is_empty());
        let groups = |loads: &[(usize, usize, usize)]| {
            let loads: Vec<StateLoad> = loads.iter().map(|&(t, r, l)| load(t, r, l)).collect();
            state_groups(&loads, GPU)
        };
        assert_eq!(groups(&[(100, 2, 30); 3]), vec![vec![0, 1, 2]]);
        // Short states share a pass (the slack); a long one does not join them.
        let mixed = [(10, 1, 20), (1000, 1, 20), (20, 1, 20), (30, 1, 20)];
        assert_eq!(groups(&mixed), vec![vec![0, 2, 3], vec![1]]);
        // Nor does a state whose branch rows are ten times theirs (padded for the mixers, theirs
        // would more than double).
        let rows = [(100, 4, 20), (100, 4, 20), (100, 4, 200), (100, 4, 20)];
        assert_eq!(groups(&rows), vec![vec![0, 1, 3], vec![2]]);
        let loads: Vec<StateLoad> = (0..300)
            .map(|i| {
                let (rows, longest) = (i % 6 + 1, (i * 13) % 90 + 5);
                // Ragged rows: one at the longest, the others shorter.
                let branch_tokens = longest + (rows - 1) * (longest / (i % 3 + 1));
                StateLoad {
                    branch_tokens,
                    ..load((i * 37) % 1100 + 1, rows, longest)
                }
            })
            .collect();
        let mut padded_by = Vec::new();
        for (rule, bound) in [(GPU, (1.1, 1024.0)), (Grouping::CPU, (1.05, 32.0))] {
            let groups = state_groups(&loads, rule);
            let mut seen: Vec<usize> = groups.iter().flatten().copied().collect();
            seen.sort();
            assert_eq!(seen, (0..300).collect::<Vec<_>>());
            let mut total = 0;
            for g in &groups {
                let alone: usize = g.iter().map(|&i| loads[i].alone()).sum();
                let padded = g
                    .iter()
                    .fold(super::Padded::default(), |p, &i| p.with(&loads[i]));
                let held = padded.held();
                assert!(held as f64 <= bound.0 * alone as f64 + bound.1, "{g:?}");
                let rows_alone: usize = g.iter().map(|&i| loads[i].padded_rows()).sum();
                assert!(padded.padded_rows() as f64 <= 2.0 * rows_alone as f64 + bound.1);
                total += held;
            }
            padded_by.push((groups.len(), total));
        }
        // The CPU's rule runs more passes and fewer tokens.
        assert!(padded_by[1].0 > padded_by[0].0 && padded_by[1].1 < padded_by[0].1);
    }

    fn with_branches(state: usize, branches: &[usize]) -> EncodedRecord {
        let rows = branches.iter().map(|&n| Row {
            ids: (1..=n as u32).collect(),
            decide: n - 1,
            opts: vec![0],
        });
        encoded(state, rows.collect())
    }

    /// A batch's budget is what its plan runs: every piece's rows times its width.
    #[test]
    fn batch_tokens_count_what_the_plan_runs() {
        let records: Vec<EncodedRecord> = (0..40)
            .map(|i| {
                let branches: Vec<usize> =
                    (0..i % 5 + 1).map(|q| 5 + (i * 7 + q * 11) % 60).collect();
                // Every fourth record shares the state of the one before it.
                let state = if i % 4 == 3 {
                    (i - 1) * 29 % 700 + 3
                } else {
                    i * 29 % 700 + 3
                };
                with_branches(state, &branches)
            })
            .collect();
        let mut cold: Vec<(&[u32], StateLoad)> = Vec::new();
        for r in &records {
            let at = match cold.iter().position(|(s, _)| *s == r.state_ids.as_slice()) {
                Some(at) => at,
                None => {
                    cold.push((&r.state_ids, load(r.state_ids.len(), 0, 0)));
                    cold.len() - 1
                }
            };
            cold[at].1 = cold[at]
                .1
                .with_rows(r.questions(), r.longest_branch(), r.branch_tokens());
        }
        let loads: Vec<StateLoad> = cold.iter().map(|c| c.1).collect();
        for rule in [GPU, Grouping::CPU] {
            let plan = Plan::new(&records, &[], false, 1 << 20, rule, &|_, _| false);
            let run: usize = plan
                .passes
                .iter()
                .flat_map(|p| p.pieces())
                .map(|p| p.lengths.len() * p.width)
                .sum();
            assert!(plan.passes.len() > 1, "the records span several passes");
            assert_eq!(batch_tokens(&loads, (0, 0), rule), run);
        }
        // Given rows join the last pass: its rows padded to the longest of both.
        let two = [load(10, 2, 8), load(3000, 1, 20)];
        assert_eq!(batch_tokens(&two, (0, 0), GPU), 10 + 2 * 8 + 3000 + 20);
        assert_eq!(batch_tokens(&two, (3, 30), GPU), 10 + 2 * 8 + 3000 + 4 * 30);
        assert_eq!(batch_tokens(&[], (3, 30), GPU), 90);
    }
}
