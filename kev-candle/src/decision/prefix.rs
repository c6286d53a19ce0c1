//! [`Prefix`]: a state run once, kept to score later records with the same state.

use crate::qwen35::Cache;

/// A state run once through the backbone, reusable for any record with the same state.
pub struct Prefix {
    pub(super) state: String,
    pub(super) state_ids: Vec<u32>,
    pub(super) cache: Cache,
}

impl Prefix {
    /// The state text this prefix was computed from.
    pub fn state(&self) -> &str {
        &self.state
    }

    /// Number of state tokens.
    pub fn len(&self) -> usize {
        self.state_ids.len()
    }

    /// Whether the state encoded to no tokens at all.
    pub fn is_empty(&self) -> bool {
        self.state_ids.is_empty()
    }

    /// Bytes of the prefix's tensors on its device: the attention layers' keys and values, the
    /// DeltaNet layers' conv windows and recurrent matrices.
    pub fn bytes(&self) -> usize {
        self.cache.bytes()
    }

    /// The state's token ids.
    pub fn state_ids(&self) -> &[u32] {
        &self.state_ids
    }
}
