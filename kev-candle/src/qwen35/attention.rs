//! Gated full attention (QWEN35.md §4): per-head `[q | gate]` query projection, zero-centred
//! q/k norms, partial RoPE, GQA, causal softmax in f32, and a sigmoid output gate before `o_proj`.

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::Linear;

use super::norm::ZeroCenteredRmsNorm;
use super::rope::Rotation;
use super::{linear, linear_cat, Config};
use crate::weights::Weights;

/// One full-attention layer.
pub struct Attention {
    /// `q_proj` (`[q | gate]` per head), `k_proj`, `v_proj` stacked.
    qkv_proj: Linear,
    o_proj: Linear,
    q_norm: ZeroCenteredRmsNorm,
    k_norm: ZeroCenteredRmsNorm,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
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
        Ok(Self {
            qkv_proj: linear_cat(
                w,
                &[
                    (&format!("{prefix}.q_proj"), nq * hd * 2),
                    (&format!("{prefix}.k_proj"), nkv * hd),
                    (&format!("{prefix}.v_proj"), nkv * hd),
                ],
                h,
            )?,
            o_proj: linear(w, &format!("{prefix}.o_proj"), nq * hd, h)?,
            q_norm: norm("q_norm")?,
            k_norm: norm("k_norm")?,
            num_heads: nq,
            num_kv_heads: nkv,
            head_dim: hd,
        })
    }

    /// `xs: [B, T, H]`; `rotation`: this step's RoPE; `mask`: additive f32
    /// `[B, 1, 1, T, S+T]` over cached and new keys. Appends this step's K/V to `k_cache`/`v_cache`.
    pub fn forward(
        &self,
        xs: &Tensor,
        rotation: &Rotation,
        mask: &Tensor,
        k_cache: &mut Option<Tensor>,
        v_cache: &mut Option<Tensor>,
    ) -> Result<Tensor> {
        let (b_sz, seq_len, _) = xs.dims3()?;
        let (nq, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let proj = self.qkv_proj.forward(xs)?;
        let q_gate =
            proj.narrow(D::Minus1, 0, nq * 2 * hd)?
                .reshape((b_sz, seq_len, nq, 2 * hd))?;
        let q = self.q_norm.forward(&q_gate.narrow(D::Minus1, 0, hd)?)?;
        let gate = q_gate
            .narrow(D::Minus1, hd, hd)?
            .reshape((b_sz, seq_len, nq * hd))?;
        let k = proj
            .narrow(D::Minus1, nq * 2 * hd, nkv * hd)?
            .reshape((b_sz, seq_len, nkv, hd))?;
        let k = self.k_norm.forward(&k)?;
        let v = proj
            .narrow(D::Minus1, (nq * 2 + nkv) * hd, nkv * hd)?
            .reshape((b_sz, seq_len, nkv, hd))?;

        let q = rotation.apply(&q.transpose(1, 2)?)?; // [B, Hq, T, hd]
        let k = rotation.apply(&k.transpose(1, 2)?)?.contiguous()?; // [B, Hkv, T, hd]
        let v = v.transpose(1, 2)?.contiguous()?;
        let k = match k_cache.take() {
            Some(old) => Tensor::cat(&[&old, &k], 2)?,
            None => k,
        };
        let v = match v_cache.take() {
            Some(old) => Tensor::cat(&[&old, &v], 2)?,
            None => v,
        };
        *k_cache = Some(k.clone());
        *v_cache = Some(v.clone());

        // GQA without copying K/V: query head h reads kv head h / rep, so group the query heads
        // of one kv head along the rows: [B, Hkv, rep·T, hd].
        let rep = nq / nkv;
        let kv_len = k.dim(2)?;
        let q = q.contiguous()?.reshape((b_sz, nkv, rep * seq_len, hd))?;
        let scores = (q.matmul(&k.t()?)? * (hd as f64).powf(-0.5))?;
        let scores = scores
            .to_dtype(DType::F32)?
            .reshape((b_sz, nkv, rep, seq_len, kv_len))?
            .broadcast_add(mask)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?
            .to_dtype(v.dtype())?
            .reshape((b_sz, nkv, rep * seq_len, kv_len))?;
        let out = probs.matmul(&v)?.reshape((b_sz, nq, seq_len, hd))?;
        let out = out.transpose(1, 2)?.reshape((b_sz, seq_len, nq * hd))?;
        let out = (out * candle_nn::ops::sigmoid(&gate)?)?;
        self.o_proj.forward(&out)
    }
}
