//! The Qwen3.5 text backbone: embeddings, decoder layers, final norm (no lm_head: Kev reads
//! hidden states).

use candle_core::{DType, Device, Result, Tensor};
use kev_kernels::dispatch::{self, counted, CountedTensor};
use kev_kernels::{gather_rows, RowIndex, SplitBatch};
use rayon::prelude::*;

use super::attention::Attention;
use super::cache::{Cache, LayerCache};
use super::config::{Config, LayerType, MlpShape};
use super::deltanet::GatedDeltaNet;
use super::mlp::Mlp;
use super::moe::SparseMoe;
use super::norm::ZeroCenteredRmsNorm;
use super::rope::Rope;
use super::split::{Outputs, Packing, SplitRows};
use crate::weights::{Quantization, Weights};

enum Mixer {
    Attention(Attention),
    DeltaNet(GatedDeltaNet),
}

struct DecoderLayer {
    input_layernorm: ZeroCenteredRmsNorm,
    mixer: Mixer,
    post_attention_layernorm: ZeroCenteredRmsNorm,
    mlp: Feedforward,
}

/// A decoder layer's MLP.
enum Feedforward {
    Dense(Mlp),
    Experts(SparseMoe),
}

impl Feedforward {
    fn new(cfg: &Config, w: &Weights, prefix: &str) -> kev_core::Result<Self> {
        Ok(match &cfg.mlp {
            MlpShape::Dense { width } => Self::Dense(Mlp::new(w, prefix, cfg.hidden_size, *width)?),
            MlpShape::Experts(shape) => {
                Self::Experts(SparseMoe::new(shape, cfg.hidden_size, w, prefix)?)
            }
        })
    }

    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(mlp) => mlp.forward(xs),
            Self::Experts(moe) => moe.forward(xs),
        }
    }
}

/// Inputs every layer of one forward shares.
struct Step<'a> {
    /// RoPE cos and sin, `[2, B, T, rotary_dim]`.
    cos_sin: Tensor,
    /// Attention's per-key bias, `[B, S+T]` (with attention layers only).
    key_bias: Option<Tensor>,
    lengths: &'a [usize],
}

/// What a split forward reads that depends on its rows' lengths and owners, not on its shape
/// alone, on the host ([`Model::split_host`]): where the branch rows' rotary rows sit in the
/// device's table (where the device gathers them: [`Rope::index`]) and their attention key
/// bias. A CUDA graph of a split forward has these as inputs, rewritten between replays.
pub struct SplitHost {
    /// `[2·B·T]` (a GPU), or none (the host computes the rows).
    pub rope_index: Option<Vec<u32>>,
    /// The states' `[R, S]`, then the branch rows' `[B, W+T]` (with attention layers only; W the
    /// past's width): past keys a row may not see, and every row's own padding (no real query
    /// sees it; a padded query whose own key is masked reads none on the flash kernel).
    pub key_bias: Option<Vec<f32>>,
    /// Positions the branch rows may reach: W + T.
    bound: usize,
}

/// A split and its [`SplitHost`] on the device (always copies of their own: a graph's inputs).
pub struct SplitTables {
    split: SplitBatch,
    /// Its branch rows packed between the layers (never in a CUDA graph: the packed row count
    /// is not a graph input).
    packing: Option<Packing>,
    rope_index: Option<Tensor>,
    key_bias: Option<Tensor>,
    /// Each branch row's first position (its state's length): for the host's rotary rows.
    owner_lengths: Vec<usize>,
    rope_rows: Vec<usize>,
    bound: usize,
}

impl SplitHost {
    /// The tables of `split` on `device`, its branch rows packed where `pack` says so
    /// ([`Packing::of`]).
    pub fn upload(
        self,
        split: SplitBatch,
        owner_lengths: Vec<usize>,
        pack: bool,
        device: &Device,
    ) -> Result<SplitTables> {
        let packing = if pack {
            Packing::of(&split, device)?
        } else {
            None
        };
        let rope_rows: Vec<usize> = self
            .rope_index
            .iter()
            .flatten()
            .map(|&i| i as usize)
            .collect();
        let put = |v: Vec<u32>| {
            let n = v.len();
            Tensor::from_vec(v, n, device)
        };
        Ok(SplitTables {
            split,
            packing,
            rope_index: self.rope_index.map(put).transpose()?,
            key_bias: self
                .key_bias
                .map(|b| {
                    let n = b.len();
                    Tensor::from_vec(b, n, device)
                })
                .transpose()?,
            owner_lengths,
            rope_rows,
            bound: self.bound,
        })
    }
}

impl SplitTables {
    /// The split.
    pub fn split(&self) -> &SplitBatch {
        &self.split
    }

    /// Its branch rows' packing, where they are packed.
    pub fn packing(&self) -> Option<&Packing> {
        self.packing.as_ref()
    }

    /// Its rows as the layers hold them.
    fn rows(&self) -> SplitRows<'_> {
        SplitRows {
            split: &self.split,
            packing: self.packing.as_ref(),
        }
    }

    /// Rewrites the tables with `host`'s (of a split of the same shape): a graph's next replay
    /// reads them. Packed tables are not rewritten: their row count is their lengths'.
    pub fn write(&self, host: &SplitHost, device: &Device) -> Result<()> {
        if self.packing.is_some() {
            candle_core::bail!("packed split tables are not rewritten")
        }
        fn put<T: candle_core::WithDType>(
            slot: Option<&Tensor>,
            values: Option<&Vec<T>>,
            device: &Device,
        ) -> Result<()> {
            match (slot, values) {
                (Some(slot), Some(v)) if slot.dims() == [v.len()] => {
                    slot.slice_set(&Tensor::from_slice(v, v.len(), device)?, 0, 0)
                }
                (None, None) => Ok(()),
                _ => candle_core::bail!("split tables of another shape"),
            }
        }
        put(self.rope_index.as_ref(), host.rope_index.as_ref(), device)?;
        put(self.key_bias.as_ref(), host.key_bias.as_ref(), device)
    }
}

/// Inputs every layer of one [`Model::forward_split`] shares: the states' and the branches' RoPE
/// and key bias.
struct SplitStep<'a> {
    rows: SplitRows<'a>,
    /// `[2, R, S, rotary_dim]`, `[2, B, T, rotary_dim]`.
    cos_sin: (Tensor, Tensor),
    /// `[R, S]`, `[B, W+T]` (with attention layers only; W the past's width: S, or the given
    /// rows' keys where longer).
    key_bias: Option<(Tensor, Tensor)>,
    /// Whether the states' rows of each layer's cache come back.
    keep: bool,
}

impl DecoderLayer {
    fn new(cfg: &Config, w: &Weights, i: usize) -> kev_core::Result<Self> {
        let prefix = format!("layers.{i}");
        let norm = |name: &str| -> kev_core::Result<ZeroCenteredRmsNorm> {
            let key = format!("{prefix}.{name}.weight");
            ZeroCenteredRmsNorm::new(&w.get(&key, &[cfg.hidden_size])?, cfg.rms_norm_eps)
                .map_err(|e| kev_core::Error::backend(format!("`{key}`"), e))
        };
        let mixer = match cfg.layer_types[i] {
            LayerType::FullAttention => {
                Mixer::Attention(Attention::new(cfg, w, &format!("{prefix}.self_attn"))?)
            }
            LayerType::LinearAttention => Mixer::DeltaNet(GatedDeltaNet::new(
                cfg,
                w,
                &format!("{prefix}.linear_attn"),
            )?),
        };
        Ok(Self {
            input_layernorm: norm("input_layernorm")?,
            mixer,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            mlp: Feedforward::new(cfg, w, &format!("{prefix}.mlp"))?,
        })
    }

    /// Runs the layer on the residual stream `xs` plus `pending`, the previous layer's MLP
    /// output not yet added (the add is fused into this layer's input norm). Returns the new
    /// stream and this layer's MLP output, likewise not yet added.
    fn forward(
        &self,
        xs: &Tensor,
        pending: Option<&Tensor>,
        cache: &mut LayerCache,
        step: &Step,
    ) -> Result<(Tensor, Tensor)> {
        let mix = |h: &Tensor| match (&self.mixer, cache) {
            (Mixer::Attention(attn), LayerCache::Attention { k, v }) => {
                let key_bias = step
                    .key_bias
                    .as_ref()
                    .expect("the key bias is built when attention layers exist");
                attn.forward(h, &step.cos_sin, key_bias, k, v)
            }
            (Mixer::DeltaNet(gdn), LayerCache::DeltaNet { conv, recurrent }) => {
                gdn.forward(h, conv, recurrent, step.lengths)
            }
            _ => candle_core::bail!("cache layer kind does not match the model layer"),
        };
        self.around_mixer(xs, pending, mix, Ok, None)
    }

    /// [`DecoderLayer::forward`] on a packed state and its branches ([`SplitBatch`]);
    /// with `Outputs::Branches`, the stream and MLP output of the branch rows only (`[B·T, H]`),
    /// and with `pick` too, of those branch rows only (`[P, H]`, after the mixer: the rows the
    /// head reads). `given`: this layer's part of the given state rows; with `step.keep`, the
    /// states' part of this layer's cache comes back in `kept`.
    #[allow(clippy::too_many_arguments)]
    fn forward_split(
        &self,
        xs: &Tensor,
        pending: Option<&Tensor>,
        step: &SplitStep,
        outputs: Outputs,
        pick: Option<&RowIndex>,
        given: Option<&LayerCache>,
        kept: &mut Option<LayerCache>,
    ) -> Result<(Tensor, Tensor)> {
        let mix = |h: &Tensor| match (&self.mixer, given) {
            (Mixer::Attention(attn), None | Some(LayerCache::Attention { .. })) => {
                let (bias_s, bias_b) = step
                    .key_bias
                    .as_ref()
                    .expect("the key bias is built when attention layers exist");
                let (cs_s, cs_b) = &step.cos_sin;
                let given = match given {
                    Some(LayerCache::Attention {
                        k: Some(k),
                        v: Some(v),
                    }) => Some((k, v)),
                    _ => None,
                };
                let parts = ((cs_s, bias_s), (cs_b, bias_b));
                let (out, kv) =
                    attn.forward_split(h, step.rows, parts.0, parts.1, outputs, given, step.keep)?;
                *kept = kv.map(|(k, v)| LayerCache::Attention {
                    k: Some(k),
                    v: Some(v),
                });
                Ok(out)
            }
            (Mixer::DeltaNet(gdn), None) if !step.keep => gdn.forward_split(h, step.rows, outputs),
            (Mixer::DeltaNet(gdn), None | Some(LayerCache::DeltaNet { .. })) => {
                let given = match given {
                    Some(LayerCache::DeltaNet { conv, recurrent }) => Some((conv, recurrent)),
                    _ => None,
                };
                let (out, state) =
                    gdn.forward_split_with(h, step.rows, outputs, given, step.keep)?;
                *kept = state.map(|(conv, recurrent)| LayerCache::DeltaNet { conv, recurrent });
                Ok(out)
            }
            _ => candle_core::bail!("given cache layer kind does not match the model layer"),
        };
        self.around_mixer(xs, pending, mix, |xs| step.rows.kept(outputs, &xs), pick)
    }

    /// The input norm (with the pending add), `mix`, the post-attention norm (with its add) and
    /// the MLP: the new stream and the MLP's output, not yet added. `mix` gives outputs for the
    /// rows of the stream that `kept` keeps (all of them: `Ok`); of those, only rows `pick` go
    /// on through the MLP (every row is per-token from here on).
    fn around_mixer(
        &self,
        xs: &Tensor,
        pending: Option<&Tensor>,
        mix: impl FnOnce(&Tensor) -> Result<Tensor>,
        kept: impl FnOnce(Tensor) -> Result<Tensor>,
        pick: Option<&RowIndex>,
    ) -> Result<(Tensor, Tensor)> {
        let (xs, h) = match pending {
            Some(p) => self.input_layernorm.forward_residual(xs, p)?,
            None => (xs.clone(), self.input_layernorm.forward(xs)?),
        };
        let (xs, h) = (kept(xs)?, mix(&h)?);
        let (xs, h) = match pick {
            Some(rows) => (gather_rows(&xs, rows)?, gather_rows(&h, rows)?),
            None => (xs, h),
        };
        let (xs, h) = self.post_attention_layernorm.forward_residual(&xs, &h)?;
        Ok((xs, self.mlp.forward(&h)?))
    }
}

/// The text backbone.
pub struct Model {
    cfg: Config,
    /// `[vocab, H]`.
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: ZeroCenteredRmsNorm,
    rope: Rope,
    dtype: DType,
    /// Of the projections and the embedding table (`dtype` but in the CPU's bf16 mode).
    weights_dtype: DType,
    /// How the projections are quantized ([`crate::weights::Weights::quantization`]).
    quantization: Quantization,
    device: Device,
}

impl Model {
    /// Builds the model from `weights` (names relative to the text model).
    pub fn new(cfg: &Config, w: &Weights) -> kev_core::Result<Self> {
        // Layers load in parallel: widening, LoRA folding and rounding are CPU work per tensor,
        // and one thread per layer keeps every core busy (the 4B load is mostly this). The
        // embedding table, the largest single tensor, loads beside them rather than before. A
        // dispatch count's backend goes with the layers (it picks the projections' layout).
        let backend = dispatch::counting_for();
        let (embed, layers) = rayon::join(
            || {
                w.get_as(
                    "embed_tokens.weight",
                    &[cfg.vocab_size, cfg.hidden_size],
                    w.projection_dtype(),
                )
            },
            || {
                (0..cfg.num_hidden_layers)
                    .into_par_iter()
                    .map(|i| dispatch::choose_as(backend, || DecoderLayer::new(cfg, w, i)))
                    .collect::<kev_core::Result<Vec<_>>>()
            },
        );
        let (embed, layers) = (embed?, layers?);
        let norm =
            ZeroCenteredRmsNorm::new(&w.get("norm.weight", &[cfg.hidden_size])?, cfg.rms_norm_eps)
                .map_err(|e| kev_core::Error::backend("`norm.weight`", e))?;
        // RoPE serves the attention layers only, whose q/k norms confirmed `head_dim` against
        // their tensors. Without one, no tensor checks `head_dim`, so it must size nothing (a
        // config stating 2^40 made this table half a terabyte).
        let rotary_dim = if cfg.layer_types.contains(&LayerType::FullAttention) {
            cfg.rotary_dim
        } else {
            0
        };
        Ok(Self {
            cfg: cfg.clone(),
            embed_tokens: embed,
            layers,
            norm,
            rope: Rope::new(cfg.rope_theta, rotary_dim),
            dtype: w.dtype(),
            weights_dtype: w.projection_dtype(),
            quantization: w.quantization(),
            device: w.device().clone(),
        })
    }

    /// The config the model was built from.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The activation dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The dtype of the projections' weights and the embedding table: the activations' but in
    /// the CPU's bf16 mode (bf16 weights, f32 activations).
    pub fn weights_dtype(&self) -> DType {
        self.weights_dtype
    }

    /// How the projections' weights are quantized (the `int8` and `fp8` dtypes; the embedding
    /// table is in [`Model::weights_dtype`]).
    pub fn quantization(&self) -> Quantization {
        self.quantization
    }

    /// The embeddings of every id of `ids`, one part after another, `[N, H]` in the
    /// activation dtype.
    fn embed(&self, ids: &[&Tensor]) -> Result<Tensor> {
        kev_kernels::embed(&self.embed_tokens, ids)?.counted_to_dtype(self.dtype)
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// An empty cache for `b_sz` rows.
    pub fn new_cache(&self, b_sz: usize) -> Result<Cache> {
        Cache::new(&self.cfg, b_sz, self.dtype, &self.device)
    }

    /// Runs `ids: [B, T]` (u32) after what `cache` holds; row b has `lengths[b]` real tokens,
    /// the rest is right padding (`None`: all real). Returns the final-norm hidden states
    /// `[B, T, H]` and updates `cache`.
    pub fn forward(
        &self,
        ids: &Tensor,
        cache: &mut Cache,
        lengths: Option<&[usize]>,
    ) -> Result<Tensor> {
        self.run(ids, cache, lengths, None)
    }

    /// Like [`Model::forward`], also returning each decoder layer's output (for parity tests).
    pub fn forward_with_layers(
        &self,
        ids: &Tensor,
        cache: &mut Cache,
        lengths: Option<&[usize]>,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let mut outs = Vec::with_capacity(self.layers.len());
        let final_ = self.run(ids, cache, lengths, Some(&mut outs))?;
        Ok((final_, outs))
    }

    fn run(
        &self,
        ids: &Tensor,
        cache: &mut Cache,
        lengths: Option<&[usize]>,
        mut layer_outs: Option<&mut Vec<Tensor>>,
    ) -> Result<Tensor> {
        let (b_sz, seq_len) = ids.dims2()?;
        if cache.batch_size() != b_sz {
            candle_core::bail!(
                "cache has {} rows for a batch of {b_sz}",
                cache.batch_size()
            )
        }
        let full = vec![seq_len; b_sz];
        let lengths = lengths.unwrap_or(&full);
        if lengths.len() != b_sz || lengths.iter().any(|&l| l > seq_len) {
            candle_core::bail!("lengths {lengths:?} do not fit ids {:?}", ids.dims())
        }
        let cos_sin = self
            .rope
            .at(cache.seen(), seq_len, self.dtype, &self.device)?;
        let has_attention = self.cfg.layer_types.contains(&LayerType::FullAttention);
        let key_bias = has_attention
            .then(|| self.key_bias(cache, seq_len))
            .transpose()?;
        let step = Step {
            cos_sin,
            key_bias,
            lengths,
        };
        let mut xs = self.embed(&[ids])?.counted_reshape((b_sz, seq_len, ()))?;
        let mut pending = None;
        for (i, (layer, layer_cache)) in self.layers.iter().zip(cache.layers_mut()).enumerate() {
            let (stream, mlp_out) = dispatch::in_layer(i, || {
                layer.forward(&xs, pending.as_ref(), layer_cache, &step)
            })?;
            match layer_outs.as_mut() {
                Some(outs) => {
                    xs = counted("add", || stream + mlp_out)?;
                    outs.push(xs.clone());
                }
                None => {
                    xs = stream;
                    pending = Some(mlp_out);
                }
            }
        }
        cache.advance(seq_len, lengths);
        self.final_norm(&xs, pending.as_ref())
    }

    /// The final norm of the stream `xs` plus the last layer's MLP output if not yet added.
    fn final_norm(&self, xs: &Tensor, pending: Option<&Tensor>) -> Result<Tensor> {
        match pending {
            Some(h) => Ok(self.norm.forward_residual(xs, h)?.1),
            None => self.norm.forward(xs),
        }
    }

    /// State rows `state_ids: [R, S]` and branch rows `branch_ids: [B, T]` that continue them,
    /// in one pass over the layers ([`SplitBatch`]); returns the branch rows' final-norm hidden states
    /// `[B, T, H]`, or with `picked` (flat indices into the branch rows as `tables` holds them:
    /// the `B·T` positions, or where packed the real steps' rows, [`Packing::branch_row`]) those
    /// rows only, `[P, H]`: the last layer runs its post-attention norm and MLP on them alone. The
    /// same as [`Model::forward`] on the states, then on the branches with copies of their state
    /// rows' cache, except for the order of sums inside the taller matrix products.
    ///
    /// Branch rows may also continue the rows of `given` (a cache of the split's
    /// [`SplitBatch::given`] rows, owners `R..R+G`: cached prefixes), and with `keep` the states'
    /// cache comes back too (`R` rows, as [`Model::forward`] on the states would leave it).
    pub fn forward_split(
        &self,
        state_ids: &Tensor,
        branch_ids: &Tensor,
        tables: &SplitTables,
        picked: Option<&RowIndex>,
        given: Option<&Cache>,
        keep: bool,
    ) -> Result<(Tensor, Option<Cache>)> {
        let split = &tables.split;
        let (states, s_len) = (split.states(), split.state_width());
        if states == 0 || s_len == 0 {
            candle_core::bail!("a split needs at least one state step ({split:?})")
        }
        let (b_rows, width) = (split.branches(), split.branch_width());
        if state_ids.dims() != [states, s_len] || branch_ids.dims() != [b_rows, width] {
            candle_core::bail!(
                "ids {:?} and {:?} do not fit {states} states of {s_len} and {b_rows} rows of {width}",
                state_ids.dims(),
                branch_ids.dims()
            )
        }
        let given_rows = given.map_or(0, Cache::batch_size);
        if given_rows != split.given() {
            candle_core::bail!(
                "{given_rows} given state rows for a split of {} ({split:?})",
                split.given()
            )
        }
        let has_attention = self.cfg.layer_types.contains(&LayerType::FullAttention);
        let cos_sin_b = match &tables.rope_index {
            Some(index) => {
                let index = RowIndex::on_device(index.clone(), &tables.rope_rows)?;
                let (rows, bound) = (b_rows, tables.bound);
                self.rope
                    .gathered(&index, rows, width, bound, self.dtype, &self.device)?
            }
            None => self
                .rope
                .at(&tables.owner_lengths, width, self.dtype, &self.device)?,
        };
        let key_bias = match (has_attention, &tables.key_bias) {
            (false, _) => None,
            (true, Some(bias)) => {
                let past_width = tables.bound - width;
                let s_keys = states * s_len;
                Some((
                    bias.narrow(0, 0, s_keys)?
                        .counted_reshape((states, s_len))?,
                    bias.narrow(0, s_keys, b_rows * (past_width + width))?
                        .counted_reshape((b_rows, past_width + width))?,
                ))
            }
            (true, None) => candle_core::bail!("split tables without the key bias"),
        };
        let rows = tables.rows();
        let step = SplitStep {
            rows,
            cos_sin: (
                self.rope
                    .at(&vec![0; states], s_len, self.dtype, &self.device)?,
                cos_sin_b,
            ),
            key_bias,
            keep,
        };
        // [R·S + B·T, H], the branch rows packed where they are.
        let mut xs = rows.kept_of_padded(Outputs::All, &self.embed(&[state_ids, branch_ids])?)?;
        let mut pending = None;
        let mut kept_layers = Vec::with_capacity(if keep { self.layers.len() } else { 0 });
        let last = self.layers.len().saturating_sub(1);
        for (i, layer) in self.layers.iter().enumerate() {
            let (outputs, pick) = if i == last {
                (Outputs::Branches, picked)
            } else {
                (Outputs::All, None)
            };
            let mut kept = None;
            let (stream, mlp_out) = dispatch::in_layer(i, || {
                let given = given.map(|c| c.layer(i));
                layer.forward_split(
                    &xs,
                    pending.as_ref(),
                    &step,
                    outputs,
                    pick,
                    given,
                    &mut kept,
                )
            })?;
            if keep {
                kept_layers.push(kept.ok_or_else(|| {
                    candle_core::Error::Msg(format!("layer {i} kept no state rows"))
                })?);
            }
            xs = stream;
            pending = Some(mlp_out);
        }
        if self.layers.is_empty() {
            xs = rows.branch_rows(&xs)?;
            if let Some(rows) = picked {
                xs = gather_rows(&xs, rows)?;
            }
        }
        let hidden = self.final_norm(&xs, pending.as_ref())?;
        let hidden = match picked {
            Some(_) => hidden,
            None => rows.padded_branches(&hidden)?.counted_reshape((
                b_rows,
                width,
                self.cfg.hidden_size,
            ))?,
        };
        let kept = keep.then(|| {
            Cache::after_first_forward(kept_layers, s_len, split.state_lengths(), &self.device)
        });
        Ok((hidden, kept))
    }

    /// [`SplitHost`] of `split` (whose given rows are `given`'s), and each branch row's first
    /// position (its state's length).
    pub fn split_host(&self, split: &SplitBatch, given: Option<&Cache>) -> (SplitHost, Vec<usize>) {
        let states = split.states();
        let (s_len, width) = (split.state_width(), split.branch_width());
        // A state's padding is seen only by its own later pads (causality); a branch row sees
        // its state row's real keys (computed or given) and its own. Each row's own padding is
        // masked too (past its first step, so that no query sees no key): the flash kernel
        // skips a padded query.
        let owner_lengths: Vec<usize> = split
            .owners()
            .iter()
            .map(|&o| match o.checked_sub(states) {
                None => split.state_lengths()[o],
                Some(g) => given.map_or(0, |c| c.seen()[g]),
            })
            .collect();
        let past_width = s_len.max(given.map_or(0, Cache::kv_len));
        let has_attention = self.cfg.layer_types.contains(&LayerType::FullAttention);
        let key_bias = has_attention.then(|| {
            let visible = |o: usize, p: usize| match o.checked_sub(states) {
                None => p < split.state_lengths()[o],
                Some(g) => given.is_some_and(|c| c.key_valid()[g].get(p) == Some(&true)),
            };
            let mask = |seen: bool| if seen { 0f32 } else { f32::NEG_INFINITY };
            let states_bias = split
                .state_lengths()
                .iter()
                .flat_map(|&len| (0..s_len).map(move |p| mask(p < len.max(1))));
            let branches_bias =
                split
                    .owners()
                    .iter()
                    .zip(split.branch_lengths())
                    .flat_map(|(&o, &len)| {
                        (0..past_width + width).map(move |p| match p.checked_sub(past_width) {
                            None => mask(visible(o, p)),
                            Some(t) => mask(t < len.max(1)),
                        })
                    });
            states_bias.chain(branches_bias).collect()
        });
        let rope_index = self
            .rope
            .index(&owner_lengths, width, self.dtype, &self.device);
        let host = SplitHost {
            rope_index,
            key_bias,
            bound: past_width + width,
        };
        (host, owner_lengths)
    }

    /// Whether a split forward of `s_len` state and `width` branch steps reads its rows'
    /// lengths and owners only from its split's table and its [`SplitTables`]: the device
    /// gathers the rotary rows ([`SplitHost::rope_index`]) and the DeltaNet layers run the split
    /// kernels that read the table ([`kev_kernels::split_reads_table`]). Then a CUDA graph of
    /// it serves splits of other lengths.
    pub fn lengths_are_inputs(&self, s_len: usize, width: usize) -> bool {
        let has = |kind| self.cfg.layer_types.contains(&kind);
        let rope = !has(LayerType::FullAttention)
            || self.rope.index(&[0], 1, self.dtype, &self.device).is_some();
        let deltanet = !has(LayerType::LinearAttention) || {
            let c = &self.cfg;
            let dims = kev_kernels::GdrDims {
                num_k_heads: c.linear_num_key_heads,
                num_v_heads: c.linear_num_value_heads,
                head_k_dim: c.linear_key_head_dim,
                head_v_dim: c.linear_value_head_dim,
            };
            kev_kernels::split_reads_table(self.dtype, &self.device, dims, s_len, width)
        };
        rope && deltanet
    }

    /// `split` with [`Model::split_host`] on the device, its branch rows packed between the
    /// layers where `pack` says so ([`Packing::of`]).
    pub fn split_tables(
        &self,
        split: SplitBatch,
        given: Option<&Cache>,
        pack: bool,
    ) -> Result<SplitTables> {
        let (host, owner_lengths) = self.split_host(&split, given);
        host.upload(split, owner_lengths, pack, &self.device)
    }

    /// Per-key additive f32 bias `[B, S+T]` for the attention layers' causal softmax: cached
    /// keys are visible where real (−∞ over a row's padding), new keys always (causality is the
    /// softmax's own). Pads after a row's real tokens are only ever seen by later pads.
    fn key_bias(&self, cache: &Cache, seq_len: usize) -> Result<Tensor> {
        let width = cache.kv_len() + seq_len;
        let mut m = Vec::with_capacity(cache.batch_size() * width);
        for valid in cache.key_valid() {
            m.extend(
                valid
                    .iter()
                    .map(|&ok| if ok { 0f32 } else { f32::NEG_INFINITY }),
            );
            m.extend(std::iter::repeat_n(0f32, seq_len));
        }
        kev_kernels::uploads::upload(m, (cache.batch_size(), width), &self.device)
    }
}
