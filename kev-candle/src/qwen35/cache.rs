//! What a forward leaves behind so the next one can continue (docs/CONTRACT.md §3, prefix form).
//!
//! Per full-attention layer: K (after k_norm and RoPE) and V. Per DeltaNet layer: the last K−1
//! raw `in_proj_qkv` outputs (the conv window) and the f32 recurrent state. Rows of a batch may
//! hold different numbers of real tokens (right padding); the cache remembers, per row, which
//! cached key positions are real and where the next position starts.

use candle_core::{DType, Device, Result, Tensor};
use kev_kernels::dispatch::counted_zeros;
use kev_kernels::{gather_rows, RowIndex};

use super::config::{Config, LayerType};

/// One layer's cached state.
pub enum LayerCache {
    /// Full attention: `k`, `v`: `[B, Hkv, S, head_dim]`, `None` before the first token.
    Attention {
        /// Keys after k_norm and RoPE.
        k: Option<Tensor>,
        /// Values.
        v: Option<Tensor>,
    },
    /// Gated DeltaNet.
    DeltaNet {
        /// `[B, K−1, C]` in the backbone dtype: the previous raw `in_proj_qkv` outputs.
        conv: Tensor,
        /// `[B, Hv, Dk, Dv]` f32, updated in place by the next forward.
        state: Tensor,
    },
}

/// The cache of a whole model for a batch of rows.
pub struct Cache {
    pub(crate) layers: Vec<LayerCache>,
    /// Per row: whether each cached key position holds a real token (false: padding).
    pub(crate) key_valid: Vec<Vec<bool>>,
    /// Per row: the number of real tokens seen, i.e. the position of the next token.
    pub(crate) seen: Vec<usize>,
    device: Device,
}

impl Cache {
    /// An empty cache for `b_sz` rows (zero conv window and state).
    pub fn new(cfg: &Config, b_sz: usize, dtype: DType, device: &Device) -> Result<Self> {
        let c = cfg.linear_conv_dim();
        let layers = cfg
            .layer_types
            .iter()
            .map(|t| match t {
                LayerType::FullAttention => Ok(LayerCache::Attention { k: None, v: None }),
                LayerType::LinearAttention => Ok(LayerCache::DeltaNet {
                    conv: counted_zeros((b_sz, cfg.linear_conv_kernel_dim - 1, c), dtype, device)?,
                    state: counted_zeros(
                        (
                            b_sz,
                            cfg.linear_num_value_heads,
                            cfg.linear_key_head_dim,
                            cfg.linear_value_head_dim,
                        ),
                        DType::F32,
                        device,
                    )?,
                }),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            key_valid: vec![Vec::new(); b_sz],
            seen: vec![0; b_sz],
            device: device.clone(),
        })
    }

    /// Number of rows.
    pub fn batch_size(&self) -> usize {
        self.seen.len()
    }

    /// Real tokens seen per row.
    pub fn seen(&self) -> &[usize] {
        &self.seen
    }

    /// A new cache made of rows `rows` of this one (repeats allowed), with storage of its own:
    /// the recurrent states are updated in place, so rows must never share it.
    pub fn select_rows(&self, rows: &[usize]) -> Result<Self> {
        let idx = RowIndex::new(rows, &self.device)?;
        let pick = |t: &Tensor| gather_rows(t, &idx);
        let layers = self
            .layers
            .iter()
            .map(|l| match l {
                LayerCache::Attention { k, v } => Ok(LayerCache::Attention {
                    k: k.as_ref().map(pick).transpose()?,
                    v: v.as_ref().map(pick).transpose()?,
                }),
                LayerCache::DeltaNet { conv, state } => Ok(LayerCache::DeltaNet {
                    conv: pick(conv)?,
                    state: pick(state)?,
                }),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            key_valid: rows.iter().map(|&r| self.key_valid[r].clone()).collect(),
            seen: rows.iter().map(|&r| self.seen[r]).collect(),
            device: self.device.clone(),
        })
    }

    /// Number of cached key positions (including padding).
    pub(crate) fn kv_len(&self) -> usize {
        self.key_valid.first().map_or(0, Vec::len)
    }

    /// Records that a forward appended `seq_len` positions of which the first `lengths[b]` are real.
    pub(crate) fn advance(&mut self, seq_len: usize, lengths: &[usize]) {
        for ((valid, seen), &len) in self.key_valid.iter_mut().zip(&mut self.seen).zip(lengths) {
            valid.extend((0..seq_len).map(|t| t < len));
            *seen += len;
        }
    }
}
