//! [`PrefixCache`]: prefixes of states seen before, kept for the next records with the same state.
//!
//! Keyed by the model that computed a prefix ([`ModelId`]) and the state's exact token ids (a
//! prefix is valid for exactly that model and those ids, at any length: no block alignment), so
//! models sharing one cache never see each other's prefixes; least recently used first out under a byte budget that counts the
//! prefixes' device bytes ([`Prefix::bytes`]). Entries are shared read-only (`Arc`): a batch
//! copies the rows it continues, so concurrent batches may use one entry.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use kev_core::Result;

use crate::decision::DecisionModel;
use crate::encoded::{EncodedRecord, Scored};
use crate::identity::ModelId;
use crate::prefix::Prefix;

/// An entry's key: the model that computed it, the state's token ids.
type Key = (ModelId, Vec<u32>);

/// Counters and sizes of a [`PrefixCache`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Lookups that found their state.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
    /// Entries dropped to make room.
    pub evictions: u64,
    /// Prefixes not kept because they alone exceed the budget.
    pub rejected: u64,
    /// Entries held.
    pub entries: usize,
    /// Device bytes held.
    pub bytes: usize,
    /// The byte budget.
    pub budget: usize,
}

/// An LRU cache of [`Prefix`]es under a byte budget; safe to share between threads.
pub struct PrefixCache {
    inner: Mutex<Inner>,
}

struct Inner {
    budget: usize,
    entries: HashMap<Key, Entry>,
    /// Last use → key: the oldest first.
    order: BTreeMap<u64, Key>,
    clock: u64,
    stats: PrefixCacheStats,
}

struct Entry {
    prefix: Arc<Prefix>,
    used: u64,
}

impl PrefixCache {
    /// A cache holding at most `budget_bytes` of prefix tensors (0: keeps nothing).
    pub fn new(budget_bytes: usize) -> Self {
        Self {
            inner: Mutex::new(Inner {
                budget: budget_bytes,
                entries: HashMap::new(),
                order: BTreeMap::new(),
                clock: 0,
                stats: PrefixCacheStats {
                    budget: budget_bytes,
                    ..Default::default()
                },
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The state is consistent after every statement, so a panic elsewhere leaves it usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The prefix `model` computed for the state with token ids `state_ids`, if held (it
    /// becomes the most recent).
    pub fn get(&self, model: ModelId, state_ids: &[u32]) -> Option<Arc<Prefix>> {
        let key = (model, state_ids.to_vec());
        let mut inner = self.lock();
        let inner = &mut *inner;
        inner.clock += 1;
        match inner.entries.get_mut(&key) {
            Some(e) => {
                let key = inner.order.remove(&e.used).expect("every entry is ordered");
                e.used = inner.clock;
                inner.order.insert(e.used, key);
                inner.stats.hits += 1;
                Some(Arc::clone(&e.prefix))
            }
            None => {
                inner.stats.misses += 1;
                None
            }
        }
    }

    /// Whether `model`'s prefix of the state with token ids `state_ids` is held (not a lookup:
    /// no counter moves).
    pub fn contains(&self, model: ModelId, state_ids: &[u32]) -> bool {
        self.lock()
            .entries
            .contains_key(&(model, state_ids.to_vec()))
    }

    /// Keeps `prefix` (keyed by its model and its state's ids), dropping the least recently used entries
    /// until it fits. A prefix larger than the whole budget is not kept; one already held for
    /// the same ids is kept and refreshed. Returns whether `prefix`'s state is held now.
    pub fn insert(&self, prefix: Arc<Prefix>) -> bool {
        let bytes = prefix.bytes();
        let key = (prefix.model(), prefix.state_ids().to_vec());
        let mut inner = self.lock();
        let inner = &mut *inner;
        inner.clock += 1;
        if let Some(e) = inner.entries.get_mut(&key) {
            let key = inner.order.remove(&e.used).expect("every entry is ordered");
            e.used = inner.clock;
            inner.order.insert(e.used, key);
            return true;
        }
        if bytes > inner.budget {
            inner.stats.rejected += 1;
            return false;
        }
        while inner.stats.bytes + bytes > inner.budget {
            let Some((_, key)) = inner.order.pop_first() else {
                break;
            };
            if let Some(old) = inner.entries.remove(&key) {
                inner.stats.bytes -= old.prefix.bytes();
                inner.stats.evictions += 1;
            }
        }
        inner.order.insert(inner.clock, key.clone());
        inner.entries.insert(
            key,
            Entry {
                prefix,
                used: inner.clock,
            },
        );
        inner.stats.bytes += bytes;
        true
    }

    /// Probabilities for encoded `records` as [`DecisionModel::run`] computes them, reusing
    /// the prefixes this cache holds for their states and keeping the new ones here.
    pub fn probs(
        &self,
        model: &DecisionModel,
        records: &[EncodedRecord],
    ) -> Result<Vec<Vec<Vec<f32>>>> {
        let prefixes: Vec<_> = records
            .iter()
            .map(|e| self.get(model.id(), e.state_ids()))
            .collect();
        Ok(self.keep(model.run(records, &prefixes, true)?))
    }

    /// Keeps the prefixes [`DecisionModel::run`] computed (those it did not reuse) and returns
    /// the probabilities, in order.
    pub fn keep(&self, scored: Vec<Scored>) -> Vec<Vec<Vec<f32>>> {
        scored
            .into_iter()
            .map(|s| {
                if let (Some(prefix), false) = (s.prefix, s.reused) {
                    self.insert(prefix);
                }
                s.probs
            })
            .collect()
    }

    /// Drops every entry (the counters stay).
    pub fn clear(&self) {
        let mut inner = self.lock();
        inner.entries.clear();
        inner.order.clear();
        inner.stats.bytes = 0;
    }

    /// Counters and sizes now.
    pub fn stats(&self) -> PrefixCacheStats {
        let inner = self.lock();
        PrefixCacheStats {
            entries: inner.entries.len(),
            ..inner.stats
        }
    }
}

impl std::fmt::Debug for PrefixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixCache")
            .field("stats", &self.stats())
            .finish()
    }
}
