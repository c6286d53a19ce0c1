//! [`EncodedRecord`], what [`crate::DecisionModel::run`] scores, and [`Scored`], what it gives.

use std::sync::Arc;

use kev_core::Row;

use crate::prefix::Prefix;

/// A record encoded for scoring: its state's token ids (the key of its prefix) and one branch
/// row per question.
#[derive(Debug, Clone)]
pub struct EncodedRecord {
    pub(crate) id: Option<String>,
    pub(crate) state: String,
    pub(crate) state_ids: Vec<u32>,
    pub(crate) rows: Vec<Row>,
}

impl EncodedRecord {
    /// The record's id, if it has one.
    pub fn id(&self) -> Option<&str> {
        self.id.as_deref()
    }

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

    /// Tokens of its branches alone (what it runs when its prefix is given).
    pub fn branch_tokens(&self) -> usize {
        self.rows.iter().map(|r| r.ids.len()).sum()
    }
}

/// One record's result from [`crate::DecisionModel::run`].
#[derive(Clone)]
pub struct Scored {
    /// Logits per question (one per option).
    pub logits: Vec<Vec<f32>>,
    /// Probabilities per question: each question's softmax.
    pub probs: Vec<Vec<f32>>,
    /// The prefix of the record's state: the one given, or with `keep` the one computed for it
    /// (shared by the records of the batch with the same state); `None` otherwise.
    pub prefix: Option<Arc<Prefix>>,
    /// Whether the prefix was given (the state did not run).
    pub reused: bool,
}
