//! Gated full attention (docs/BACKBONE.md §4): per-head `[q | gate]` query projection, zero-centred
//! q/k norms, partial RoPE, GQA, causal softmax in f32, and a sigmoid output gate before `o_proj`.
//! The attention itself is kev-kernels' [`causal_attention`]: on CUDA, batches large enough to
//! fill the GPU run it as one flash-attention kernel, the rest as matmuls around the softmax
//! (the two round differently, so a record's bf16 probabilities may differ in their last bits
//! between batch sizes, as cuBLAS's shape-dependent kernels already make them).

use candle_core::{Module, Result, Tensor};
use kev_kernels::dispatch::{counted_cat, counted_zeros, CountedTensor};

use kev_kernels::{
    attention_gate, attention_gate_join, causal_attention, copy_rows, flash_attention_fills_gpu,
    qk_norm_rope, AttentionPast, SplitBatch,
};

use super::config::Config;
use super::linear::{linear, linear_cat, Projection};
use super::norm::ZeroCenteredRmsNorm;
use super::split::{Outputs, SplitRows};
use crate::weights::Weights;

/// The keys and values a step's queries see before its own.
enum Past<'a> {
    /// A cache of the same rows (`[B, Hkv, S, hd]` or none yet), extended by this step's.
    Cache(&'a mut Option<Tensor>, &'a mut Option<Tensor>),
    /// None; this step's keys and values (`[B, Hkv, T, hd]`, the values possibly a view of the
    /// projection) are handed back for the branches that follow.
    Fresh(&'a mut Option<(Tensor, Tensor)>),
    /// The states' keys and values of this layer (`[R + G, Hkv, S, hd]`, computed then given):
    /// branch row b sees its state row's ([`SplitBatch`]).
    States(&'a Tensor, &'a Tensor, &'a SplitBatch),
}

/// One full-attention layer.
pub struct Attention {
    /// `q_proj` (`[q | gate]` per head), `k_proj`, `v_proj` stacked.
    qkv_proj: Projection,
    /// The `k_proj`, `v_proj` rows of `qkv_proj` (a view, or a packed copy in the CPU's bf16
    /// mode): rows whose outputs nobody reads still give their keys and values.
    kv_proj: Projection,
    o_proj: Projection,
    q_norm: ZeroCenteredRmsNorm,
    k_norm: ZeroCenteredRmsNorm,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    eps: f64,
}

impl Attention {
    /// Loads `layers.{i}.self_attn.*`.
    pub fn new(cfg: &Config, w: &Weights, prefix: &str) -> kev_core::Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (nq, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let norm = |name: &str| -> kev_core::Result<ZeroCenteredRmsNorm> {
            let key = format!("{prefix}.{name}.weight");
            let wt = w.get(&key, &[hd])?;
            ZeroCenteredRmsNorm::new(&wt, cfg.rms_norm_eps)
                .map_err(|e| kev_core::Error::backend(format!("`{key}`"), e))
        };
        let qkv_proj = linear_cat(
            w,
            &[
                (&format!("{prefix}.q_proj"), nq * hd * 2),
                (&format!("{prefix}.k_proj"), nkv * hd),
                (&format!("{prefix}.v_proj"), nkv * hd),
            ],
            h,
        )?;
        let kv_proj = qkv_proj
            .rows(nq * hd * 2, 2 * nkv * hd)
            .map_err(|e| kev_core::Error::backend(format!("`{prefix}.k_proj`"), e))?;
        Ok(Self {
            qkv_proj,
            kv_proj,
            o_proj: linear(w, &format!("{prefix}.o_proj"), nq * hd, h)?,
            q_norm: norm("q_norm")?,
            k_norm: norm("k_norm")?,
            num_heads: nq,
            num_kv_heads: nkv,
            head_dim: hd,
            eps: cfg.rms_norm_eps,
        })
    }

    /// `xs: [B, T, H]`; `cos_sin`: this step's RoPE (`[2, B, T, rotary_dim]`); `key_bias`:
    /// additive f32 `[B, S+T]` over cached and new keys (causality is applied on top). Appends
    /// this step's K/V to `k_cache`/`v_cache`.
    pub fn forward(
        &self,
        xs: &Tensor,
        cos_sin: &Tensor,
        key_bias: &Tensor,
        k_cache: &mut Option<Tensor>,
        v_cache: &mut Option<Tensor>,
    ) -> Result<Tensor> {
        let proj = self.qkv_proj.forward(xs)?;
        let past = Past::Cache(k_cache, v_cache);
        let (o, gate) = self.attend(&proj, cos_sin, key_bias, past)?;
        self.o_proj.forward(&attention_gate(&o, &gate)?)
    }

    /// State rows and their branch rows as the layers hold them ([`SplitRows`]), with each
    /// part's RoPE and key bias: every branch row attends to its state row's keys of this layer.
    /// Returns all rows' outputs, or with `Outputs::Branches` the branch rows' only: then the
    /// state rows give only their keys and values.
    ///
    /// With `given` (a cached prefix's keys and values, `[G, Hkv, L, hd]`), branch rows may also
    /// continue those rows (rows `R..R+G` of the split's owners): the past is the states' keys
    /// and the given ones, both padded to the longer width, which the branches' key bias masks.
    /// With `keep`, the states' keys and values (their rows of a cache) come back too.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_split(
        &self,
        xs: &Tensor,
        rows: SplitRows,
        (cos_sin_s, key_bias_s): (&Tensor, &Tensor),
        (cos_sin_b, key_bias_b): (&Tensor, &Tensor),
        outputs: Outputs,
        given: Option<(&Tensor, &Tensor)>,
        keep: bool,
    ) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        let split = rows.split;
        let mut kv = None;
        // The attention runs on the split's padded rows; its output is held as the rows are.
        let (proj_b, out_s) = match outputs {
            Outputs::All => {
                let proj = rows.padded(&self.qkv_proj.forward(xs)?)?;
                let (proj_s, proj_b) = split.parts(&proj)?;
                let (o_s, _) = self.attend(&proj_s, cos_sin_s, key_bias_s, Past::Fresh(&mut kv))?;
                (proj_b, Some((o_s, proj)))
            }
            Outputs::Branches => {
                let (xs_s, xs_b) = rows.parts(xs)?;
                let (r, s, _) = xs_s.dims3()?;
                let kv_s = self.kv_proj.forward(&xs_s.counted_flatten(0, 1)?)?;
                let heads = kv_s.counted_reshape((r, s, 2 * self.num_kv_heads, self.head_dim))?;
                kv = Some(self.new_kv(&heads, 0, cos_sin_s)?);
                let (b, t, _) = xs_b.dims3()?;
                let proj_b = self.qkv_proj.forward(&xs_b.counted_flatten(0, 1)?)?;
                (proj_b.counted_reshape((b, t, proj_b.dim(1)?))?, None)
            }
        };
        let Some((k, v)) = kv else {
            candle_core::bail!("the states' keys and values are computed first")
        };
        // Kept values own their storage (not a view of the projection).
        let kept = keep
            .then(|| Ok::<_, candle_core::Error>((k.clone(), copy_rows(&v)?)))
            .transpose()?;
        let (k, v) = match split.given() {
            0 => (k, v),
            g => (
                with_given(&k, given.map(|p| p.0), g)?,
                with_given(&v, given.map(|p| p.1), g)?,
            ),
        };
        let past = Past::States(&k, &v, split);
        let (o_b, gate_b) = self.attend(&proj_b, cos_sin_b, key_bias_b, past)?;
        let out = match out_s {
            // Both parts' gated heads written into one tensor of the padded rows (no join copy
            // after).
            Some((o_s, proj)) => {
                let gate = self.gates(&proj)?;
                let out = self
                    .o_proj
                    .forward(&attention_gate_join(&o_s, &o_b, &gate)?)?;
                rows.kept_of_padded(outputs, &out)?
            }
            None => rows.held_branches(
                &self
                    .o_proj
                    .forward(&attention_gate(&o_b, &gate_b)?.counted_flatten(0, 1)?)?,
            )?,
        };
        Ok((out, kept))
    }

    /// The output gates of packed projection rows `proj: [N, ..]`, `[N, Hq, hd]` (a view).
    fn gates(&self, proj: &Tensor) -> Result<Tensor> {
        let (nq, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        proj.counted_reshape((proj.dim(0)?, nq + nkv, 2, hd))?
            .narrow(1, 0, nq)?
            .narrow(2, 1, 1)?
            .squeeze(2)
    }

    /// Everything between the projections, from `proj: [B, T, ..]` (the stacked q/gate, k, v
    /// outputs) to the attention's output heads `[B, Hq, T, hd]`, returned with their gates
    /// `[B, T, Hq, hd]` (a view of `proj`) for [`attention_gate`].
    fn attend(
        &self,
        proj: &Tensor,
        cos_sin: &Tensor,
        key_bias: &Tensor,
        past: Past,
    ) -> Result<(Tensor, Tensor)> {
        let (b_sz, seq_len, _) = proj.dims3()?;
        let (nq, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        // Views into the projection, no copies: per query head `[q | gate]`, then K, then V.
        let q_gate = proj
            .counted_reshape((b_sz, seq_len, nq + nkv, 2, hd))?
            .narrow(2, 0, nq)?;
        let q = q_gate.narrow(3, 0, 1)?.squeeze(3)?; // [B, T, Hq, hd]
        let gate = q_gate.narrow(3, 1, 1)?.squeeze(3)?;
        let heads = proj.counted_reshape((b_sz, seq_len, 2 * (nq + nkv), hd))?;
        let (k, v) = self.new_kv(&heads, 2 * nq, cos_sin)?;
        let q = qk_norm_rope(&q, self.q_norm.one_plus_w(), cos_sin, self.eps)?; // [B, Hq, T, hd]
        let scale = (hd as f64).powf(-0.5);
        let out = match past {
            Past::Cache(k_cache, v_cache) => {
                // The cache outlives the step: values of their own, not a view of `proj`
                // (`contiguous` would keep the view of a one-row, one-token step).
                let joined = |cache: &mut Option<Tensor>, new: Tensor| {
                    let all = match cache.take() {
                        Some(old) => counted_cat(&[&old, &new], 2)?,
                        None => new,
                    };
                    *cache = Some(all.clone());
                    Ok::<_, candle_core::Error>(all)
                };
                let v = if v.is_contiguous() {
                    v.counted_force_contiguous()?
                } else {
                    copy_rows(&v)?
                };
                let (k, v) = (joined(k_cache, k)?, joined(v_cache, v)?);
                causal_attention(&q, None, &k, &v, key_bias, scale)?
            }
            Past::Fresh(handed) => {
                // The matmuls read the values contiguous, and so will the branches' (one copy);
                // the flash kernel reads the view.
                let v = if flash_attention_fills_gpu(&q, nkv)? {
                    v
                } else {
                    copy_rows(&v)?
                };
                let out = causal_attention(&q, None, &k, &v, key_bias, scale)?;
                *handed = Some((k, v));
                out
            }
            Past::States(k_s, v_s, split) => {
                let past = AttentionPast {
                    k: k_s,
                    v: v_s,
                    owners: split.owner_index(),
                };
                causal_attention(&q, Some(past), &k, &v, key_bias, scale)?
            }
        };
        Ok((out, gate))
    }

    /// This step's keys (normed and rotated) and values, `[B, Hkv, T, hd]` each (the values a
    /// view of the projection's heads), from the projection's heads `[B, T, .., hd]` where the
    /// kv heads start at head `first_kv`.
    fn new_kv(
        &self,
        heads: &Tensor,
        first_kv: usize,
        cos_sin: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let nkv = self.num_kv_heads;
        let k = heads.narrow(2, first_kv, nkv)?;
        let v = heads.narrow(2, first_kv + nkv, nkv)?;
        let k = qk_norm_rope(&k, self.k_norm.one_plus_w(), cos_sin, self.eps)?;
        Ok((k, v.transpose(1, 2)?))
    }
}

/// The branch rows' past: the states' keys or values `t: [R, Hkv, S, hd]` then the `g` given
/// rows' (`None`: prefixes of empty states, which hold none: zero rows), both padded to the
/// longer width, which the branches' key bias masks.
fn with_given(t: &Tensor, given: Option<&Tensor>, g: usize) -> Result<Tensor> {
    let (_, heads, s, d) = t.dims4()?;
    let width = match given {
        Some(p) => s.max(p.dim(2)?),
        None => s,
    };
    let pad = |t: &Tensor| t.pad_with_zeros(2, 0, width - t.dim(2)?);
    let rows = match given {
        Some(p) => pad(p)?,
        None => counted_zeros((g, heads, width, d), t.dtype(), t.device())?,
    };
    counted_cat(&[&pad(t)?, &rows], 0)
}
