//! What a forward leaves behind so the next one can continue (docs/CONTRACT.md §3, prefix form).
//!
//! Per full-attention layer: K (after k_norm and RoPE) and V. Per DeltaNet layer: the last K−1
//! raw `in_proj_qkv` outputs (the conv window) and the f32 recurrent matrix. Rows of a batch may
//! hold different numbers of real tokens (right padding); the cache remembers, per row, which
//! cached key positions are real and where the next position starts. Rows are taken out, copied
//! and joined only through the cache's own methods, which keep those records true.

use candle_core::{DType, Device, Result, Tensor};
use kev_kernels::dispatch::counted_zeros;
use kev_kernels::{gather_rows, pack, RowIndex};

use super::config::{Config, LayerType};

/// What one layer keeps.
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
        /// `[B, Hv, Dk, Dv]` f32: the delta rule's recurrent matrix, updated in place by the
        /// next forward.
        recurrent: Tensor,
    },
}

/// The cache of a whole model for a batch of rows.
pub struct Cache {
    layers: Vec<LayerCache>,
    /// Per row: whether each cached key position holds a real token (false: padding).
    key_valid: Vec<Vec<bool>>,
    /// Per row: the number of real tokens seen, i.e. the position of the next token.
    seen: Vec<usize>,
    device: Device,
}

impl Cache {
    /// An empty cache for `b_sz` rows (zero conv windows and recurrent matrices).
    pub fn new(cfg: &Config, b_sz: usize, dtype: DType, device: &Device) -> Result<Self> {
        let c = cfg.linear_conv_dim();
        let layers = cfg
            .layer_types
            .iter()
            .map(|t| match t {
                LayerType::FullAttention => Ok(LayerCache::Attention { k: None, v: None }),
                LayerType::LinearAttention => Ok(LayerCache::DeltaNet {
                    conv: counted_zeros((b_sz, cfg.linear_conv_kernel_dim - 1, c), dtype, device)?,
                    recurrent: counted_zeros(
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

    /// The cache of `lengths.len()` rows after one forward of `width` right-padded steps from
    /// empty, row b real for its first `lengths[b]`: `layers` as that forward left them (the
    /// state rows of a one-pass split, [`super::Model::forward_split`]).
    pub(crate) fn after_first_forward(
        layers: Vec<LayerCache>,
        width: usize,
        lengths: &[usize],
        device: &Device,
    ) -> Self {
        let mut cache = Self {
            layers,
            key_valid: vec![Vec::new(); lengths.len()],
            seen: vec![0; lengths.len()],
            device: device.clone(),
        };
        cache.advance(width, lengths);
        cache
    }

    /// Layer `i`'s part.
    pub(crate) fn layer(&self, i: usize) -> &LayerCache {
        &self.layers[i]
    }

    /// Every layer's part, for a forward to extend (then [`Cache::advance`]).
    pub(crate) fn layers_mut(&mut self) -> &mut [LayerCache] {
        &mut self.layers
    }

    /// Per row: whether each cached key position holds a real token.
    pub(crate) fn key_valid(&self) -> &[Vec<bool>] {
        &self.key_valid
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
    /// the recurrent matrices are updated in place, so rows must never share it.
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
                LayerCache::DeltaNet { conv, recurrent } => Ok(LayerCache::DeltaNet {
                    conv: pick(conv)?,
                    recurrent: pick(recurrent)?,
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

    /// The first `rows` rows, each a one-row cache of its own storage, cut to the row's real
    /// keys: rows are right-padded, so those are its first `seen` positions (what a kept prefix
    /// holds). A row's tensors of one dtype share one buffer ([`pack`]), all rows filled by one
    /// copy: a pass keeps its states in one launch, not one a tensor and state.
    pub fn rows_apart(&self, rows: usize) -> Result<Vec<Self>> {
        // Per row: its views grouped by dtype, and where each layer's tensor lies in its group.
        let mut groups: Vec<Vec<Tensor>> = Vec::new();
        let mut recipes = Vec::with_capacity(rows);
        for row in 0..rows {
            let len = self.seen[row];
            debug_assert!(self.key_valid[row].iter().take(len).all(|&v| v));
            let first = groups.len();
            let mut place = |t: Tensor| -> Placed {
                let g = match groups[first..]
                    .iter()
                    .position(|g: &Vec<Tensor>| g[0].dtype() == t.dtype())
                {
                    Some(g) => first + g,
                    None => {
                        groups.push(Vec::new());
                        groups.len() - 1
                    }
                };
                let at = groups[g].iter().map(Tensor::elem_count).sum();
                let placed = Placed {
                    group: g,
                    at,
                    dims: t.dims().to_vec(),
                };
                groups[g].push(t);
                placed
            };
            let recipe = self
                .layers
                .iter()
                .map(|l| match l {
                    LayerCache::Attention { k, v } => {
                        let mut keys = |t: &Option<Tensor>| -> Result<Option<Placed>> {
                            match t {
                                Some(x) if len > 0 => {
                                    Ok(Some(place(x.narrow(0, row, 1)?.narrow(2, 0, len)?)))
                                }
                                _ => Ok(None),
                            }
                        };
                        Ok(LayerRecipe::Attention(keys(k)?, keys(v)?))
                    }
                    LayerCache::DeltaNet { conv, recurrent } => Ok(LayerRecipe::DeltaNet(
                        place(conv.narrow(0, row, 1)?),
                        place(recurrent.narrow(0, row, 1)?),
                    )),
                })
                .collect::<Result<Vec<_>>>()?;
            recipes.push((len, recipe));
        }
        let packed = pack(&groups)?;
        let take = |p: &Placed| -> Result<Tensor> {
            let n = p.dims.iter().product();
            packed[p.group]
                .narrow(0, p.at, n)?
                .reshape(p.dims.as_slice())
        };
        recipes
            .into_iter()
            .map(|(len, recipe)| {
                let layers = recipe
                    .iter()
                    .map(|l| match l {
                        LayerRecipe::Attention(k, v) => Ok(LayerCache::Attention {
                            k: k.as_ref().map(take).transpose()?,
                            v: v.as_ref().map(take).transpose()?,
                        }),
                        LayerRecipe::DeltaNet(conv, recurrent) => Ok(LayerCache::DeltaNet {
                            conv: take(conv)?,
                            recurrent: take(recurrent)?,
                        }),
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(Self {
                    layers,
                    key_valid: vec![vec![true; len]],
                    seen: vec![len],
                    device: self.device.clone(),
                })
            })
            .collect()
    }

    /// The rows of `parts` one after the other as one cache, the attention layers' keys padded
    /// (and marked padding) to the longest part's. `parts` must be caches of one model.
    pub fn join(parts: &[&Cache]) -> Result<Self> {
        let Some(first) = parts.first() else {
            candle_core::bail!("joining no caches");
        };
        let kv_len = parts.iter().map(|c| c.kv_len()).max().unwrap_or(0);
        let layers = (0..first.layers.len())
            .map(|l| Self::join_layer(parts, l, kv_len))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            key_valid: parts
                .iter()
                .flat_map(|p| p.key_valid.iter())
                .map(|v| {
                    let mut v = v.clone();
                    v.resize(kv_len, false);
                    v
                })
                .collect(),
            seen: parts.iter().flat_map(|p| p.seen.iter().copied()).collect(),
            device: first.device.clone(),
        })
    }

    /// Layer `l` of every part, rows concatenated; keys padded with zeros to `kv_len`.
    fn join_layer(parts: &[&Cache], l: usize, kv_len: usize) -> Result<LayerCache> {
        match &parts[0].layers[l] {
            LayerCache::DeltaNet { .. } => {
                let (mut convs, mut recurrents) = (Vec::new(), Vec::new());
                for p in parts {
                    let LayerCache::DeltaNet { conv, recurrent } = &p.layers[l] else {
                        candle_core::bail!("joining caches of different layer kinds at layer {l}");
                    };
                    convs.push(conv.clone());
                    recurrents.push(recurrent.clone());
                }
                Ok(LayerCache::DeltaNet {
                    conv: Tensor::cat(&convs, 0)?,
                    recurrent: Tensor::cat(&recurrents, 0)?,
                })
            }
            LayerCache::Attention { .. } => {
                let like = parts.iter().find_map(|p| match &p.layers[l] {
                    LayerCache::Attention { k: Some(k), .. } => Some(k.clone()),
                    _ => None,
                });
                let Some(like) = like.filter(|_| kv_len > 0) else {
                    return Ok(LayerCache::Attention { k: None, v: None });
                };
                let (_, hkv, _, d) = like.dims4()?;
                let (mut ks, mut vs) = (Vec::new(), Vec::new());
                for p in parts {
                    let LayerCache::Attention { k, v } = &p.layers[l] else {
                        candle_core::bail!("joining caches of different layer kinds at layer {l}");
                    };
                    let rows = p.batch_size();
                    let pad = |t: &Option<Tensor>| match t {
                        Some(t) => t.pad_with_zeros(2, 0, kv_len - t.dim(2)?),
                        None => Tensor::zeros((rows, hkv, kv_len, d), like.dtype(), like.device()),
                    };
                    ks.push(pad(k)?);
                    vs.push(pad(v)?);
                }
                Ok(LayerCache::Attention {
                    k: Some(Tensor::cat(&ks, 0)?),
                    v: Some(Tensor::cat(&vs, 0)?),
                })
            }
        }
    }

    /// Bytes of the cache's tensors on its device: the attention layers' keys and values, the
    /// DeltaNet layers' conv windows and recurrent matrices.
    pub fn bytes(&self) -> usize {
        let size = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        self.layers
            .iter()
            .map(|l| match l {
                LayerCache::Attention { k, v } => k.iter().chain(v).map(size).sum(),
                LayerCache::DeltaNet { conv, recurrent } => size(conv) + size(recurrent),
            })
            .sum()
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

/// Where [`Cache::rows_apart`] put one tensor: its group's buffer, the element it starts at and
/// its dims.
struct Placed {
    group: usize,
    at: usize,
    dims: Vec<usize>,
}

/// A layer of one row in [`Cache::rows_apart`]'s buffers.
enum LayerRecipe {
    Attention(Option<Placed>, Option<Placed>),
    DeltaNet(Placed, Placed),
}
