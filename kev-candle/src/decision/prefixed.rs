//! Scoring records of which some continue cached prefixes
//! ([`DecisionModel::probs_prefixed`](super::DecisionModel::probs_prefixed)).
//!
//! A server keeps the prefixes of the states it has seen; a batch then mixes records whose state
//! is cached with records whose state is new. The new (cold) states run first, distinct states
//! once, as right-padded state passes grouped by length (as `probs_batch` groups them), then the
//! branches of *every* record run as one batch, each branch row continuing its record's prefix:
//! a cold state's row of that pass or a cached prefix. Cached prefixes are only read (their rows
//! are copied into the branch batch), so one prefix can serve concurrent batches. The cold
//! states' prefixes are cut out of the state pass (their own storage, no padding) and returned
//! for the caller to keep.

use std::collections::HashMap;
use std::sync::Arc;

use kev_core::{Error, Result, Row};

use super::identity::ModelId;
use super::prefix::Prefix;
use crate::device::backend_err;
use crate::executor::{read_per_row, Executor};
use crate::head::softmax;
use crate::plan::length_buckets;
use crate::qwen35::Cache;

/// A record encoded for scoring: its state's token ids (the key of its prefix) and one branch
/// row per question.
#[derive(Debug, Clone)]
pub struct EncodedRecord {
    pub(super) id: Option<String>,
    pub(super) state: String,
    pub(super) state_ids: Vec<u32>,
    pub(super) rows: Vec<Row>,
}

impl EncodedRecord {
    /// The state's token ids: equal ids give equal prefixes, so they key a prefix cache.
    pub fn state_ids(&self) -> &[u32] {
        &self.state_ids
    }

    /// Number of questions (branch rows).
    pub fn questions(&self) -> usize {
        self.rows.len()
    }

    /// Tokens the record runs cold: its state plus all its branches.
    pub fn tokens(&self) -> usize {
        self.state_ids.len() + self.branch_tokens()
    }

    /// Tokens of its longest branch.
    pub fn longest_branch(&self) -> usize {
        self.rows.iter().map(|r| r.ids.len()).max().unwrap_or(0)
    }

    /// Tokens of its branches alone (what it runs when its prefix is cached).
    pub fn branch_tokens(&self) -> usize {
        self.rows.iter().map(|r| r.ids.len()).sum()
    }
}

/// One record's result from
/// [`DecisionModel::probs_prefixed`](super::DecisionModel::probs_prefixed).
pub struct Prefixed {
    /// Probabilities per question.
    pub probs: Vec<Vec<f32>>,
    /// The prefix of the record's state: the one given, or the one computed for it (shared by
    /// the records of the batch with the same state).
    pub prefix: Arc<Prefix>,
    /// Whether the prefix was given (the state did not run).
    pub reused: bool,
}

/// Probabilities for `records`, where `prefixes[i]`, if given, is a prefix of record i's state
/// and its state does not run again (as
/// [`DecisionModel::probs_prefixed`](super::DecisionModel::probs_prefixed), past its argument
/// checks).
pub(super) fn run_prefixed(
    exec: &Executor,
    model: ModelId,
    records: &[EncodedRecord],
    prefixes: &[Option<Arc<Prefix>>],
) -> Result<Vec<Prefixed>> {
    // Where each record's prefix comes from: a row of the cold states' pass, or a given one.
    let mut cold: Vec<&[u32]> = Vec::new();
    let mut cold_at: HashMap<&[u32], usize> = HashMap::new();
    let mut given: Vec<&Arc<Prefix>> = Vec::new();
    let mut source = Vec::with_capacity(records.len());
    for (i, (rec, prefix)) in records.iter().zip(prefixes).enumerate() {
        match prefix {
            Some(p) => {
                p.check_model(model, &format!("the prefix given for record {i}"))?;
                if p.state_ids != rec.state_ids {
                    return Err(Error::Prefix {
                        message: format!(
                            "the prefix given for record {i} was computed for another state ({} tokens) than the record's ({} tokens)",
                            p.state_ids.len(),
                            rec.state_ids.len()
                        ),
                    });
                }
                let at = match given.iter().position(|g| Arc::ptr_eq(g, p)) {
                    Some(at) => at,
                    None => {
                        given.push(p);
                        given.len() - 1
                    }
                };
                source.push(Source::Given(at));
            }
            None => {
                let next = cold.len();
                let at = *cold_at.entry(rec.state_ids.as_slice()).or_insert(next);
                if at == next {
                    cold.push(&rec.state_ids);
                }
                source.push(Source::Cold(at));
            }
        }
    }

    // The cold states grouped by length, each group one state pass (as `probs_batch` groups
    // them): a batch pads every state to its longest.
    let lengths: Vec<usize> = cold.iter().map(|s| s.len()).collect();
    let mut cold_caches = Vec::new();
    // Cold state j is row `cold_row[j].1` of group `cold_row[j].0`.
    let mut cold_row = vec![(0, 0); cold.len()];
    let mut group_start = Vec::new();
    let mut rows_before = 0;
    for (g, members) in length_buckets(&lengths).into_iter().enumerate() {
        let states: Vec<&[u32]> = members.iter().map(|&j| cold[j]).collect();
        let pieces = exec.pieces(&states);
        cold_caches.push(exec.state_cache(states.len(), &pieces, &exec.upload_all(&pieces)?)?);
        for (r, &j) in members.iter().enumerate() {
            cold_row[j] = (g, r);
        }
        group_start.push(rows_before);
        rows_before += members.len();
    }
    // The prefixes' rows: the cold groups' rows in order, then each given prefix's row.
    let parts: Vec<&Cache> = cold_caches
        .iter()
        .chain(given.iter().map(|p| &p.cache))
        .collect();
    let joined;
    let prefix_rows: &Cache = match parts.as_slice() {
        [one] => one,
        _ => {
            joined = Cache::join(&parts).map_err(backend_err("joining prefixes"))?;
            &joined
        }
    };
    let row_of = |s: &Source| match *s {
        Source::Cold(j) => group_start[cold_row[j].0] + cold_row[j].1,
        Source::Given(g) => cold.len() + g,
    };
    let owners: Vec<usize> = records
        .iter()
        .zip(&source)
        .flat_map(|(r, s)| std::iter::repeat_n(row_of(s), r.rows.len()))
        .collect();
    let rows: Vec<Row> = records.iter().flat_map(|r| r.rows.clone()).collect();
    let branch_ids: Vec<&[u32]> = rows.iter().map(|r| r.ids.as_slice()).collect();
    let pieces = exec.pieces(&branch_ids);
    let logits = exec.branch_logits(
        prefix_rows,
        &owners,
        &pieces,
        &exec.upload_all(&pieces)?,
        &rows,
    )?;
    let mut logits = read_per_row(&logits, &rows)?.into_iter();

    let mut computed: Vec<Option<Arc<Prefix>>> = vec![None; cold.len()];
    let mut out = Vec::with_capacity(records.len());
    for (i, (rec, s)) in records.iter().zip(&source).enumerate() {
        let mine: Vec<Vec<f32>> = logits.by_ref().take(rec.rows.len()).collect();
        let probs = finite_probs(rec, i, &mine)?;
        let (prefix, reused) = match *s {
            Source::Given(g) => (Arc::clone(given[g]), true),
            Source::Cold(j) => {
                let prefix = match &computed[j] {
                    Some(p) => Arc::clone(p),
                    None => {
                        let (g, row) = cold_row[j];
                        let p = Arc::new(Prefix {
                            model,
                            state: rec.state.clone(),
                            state_ids: rec.state_ids.clone(),
                            cache: cold_caches[g]
                                .row(row)
                                .map_err(backend_err("cutting a prefix out of the state pass"))?,
                        });
                        computed[j] = Some(Arc::clone(&p));
                        p
                    }
                };
                (prefix, false)
            }
        };
        out.push(Prefixed {
            probs,
            prefix,
            reused,
        });
    }
    Ok(out)
}

/// Each question's softmax, refusing logits or probabilities that are not finite as
/// [`DecisionModel::probs`](super::DecisionModel::probs) does ([`Error::NonFinite`]).
pub(super) fn finite_probs(
    rec: &EncodedRecord,
    index: usize,
    logits: &[Vec<f32>],
) -> Result<Vec<Vec<f32>>> {
    let probs: Vec<Vec<f32>> = logits.iter().map(|l| softmax(l)).collect();
    let bad = |x: &[Vec<f32>]| x.iter().position(|l| !l.iter().all(|v| v.is_finite()));
    match bad(logits).or_else(|| bad(&probs)) {
        None => Ok(probs),
        Some(question) => Err(Error::NonFinite {
            id: rec.id.clone(),
            index,
            question,
        }),
    }
}

/// Where a record's prefix comes from in [`run_prefixed`].
enum Source {
    /// Row j of the cold states' pass.
    Cold(usize),
    /// The g-th distinct given prefix.
    Given(usize),
}
