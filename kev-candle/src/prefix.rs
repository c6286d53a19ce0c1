//! [`Prefix`]: a state run once, kept to score later records with the same state.

use kev_core::{Error, Result};

use crate::identity::ModelId;
use crate::qwen35::Cache;

/// A state run once through the backbone, reusable for any record with the same state by the
/// model that made it ([`Prefix::model`]: another model's prefix is refused, since its cache
/// holds that model's activations).
pub struct Prefix {
    model: ModelId,
    state: String,
    state_ids: Vec<u32>,
    cache: Cache,
}

impl Prefix {
    /// The prefix `model` computed for `state` (its token ids `state_ids`): `cache`, one row.
    pub(crate) fn new(model: ModelId, state: String, state_ids: Vec<u32>, cache: Cache) -> Self {
        Self {
            model,
            state,
            state_ids,
            cache,
        }
    }

    /// The backbone's cache after the state, one row (only read: rows are copied to continue).
    pub(crate) fn cache(&self) -> &Cache {
        &self.cache
    }

    /// The model that computed it ([`crate::DecisionModel::id`]).
    pub fn model(&self) -> ModelId {
        self.model
    }

    /// [`Error::Prefix`] unless this prefix was computed by the model `model`; `whose` names the
    /// prefix in the message.
    pub(crate) fn check_model(&self, model: ModelId, whose: &str) -> Result<()> {
        if self.model == model {
            return Ok(());
        }
        Err(Error::Prefix {
            message: format!(
                "{whose} was computed by another model (id {}) than this one (id {model}): a prefix is valid only for the model that made it (the same checkpoint files, lora_scale, dtype, device and prefill_chunk)",
                self.model
            ),
        })
    }

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
