//! Partial rotary position embedding (docs/BACKBONE.md §10 pitfall 3): only the first `rotary_dim`
//! dims of each head rotate, NeoX style (`rotate_half`). For text, the interleaved mRoPE of the
//! checkpoint reduces to plain 1-D RoPE because all three position axes are equal.

use candle_core::{DType, Device, Result, Tensor};

/// Inverse frequencies for the rotary dims.
pub struct Rope {
    inv_freq: Vec<f32>,
    rotary_dim: usize,
}

impl Rope {
    /// `inv_freq[i] = 1 / theta^(2i / rotary_dim)`, computed in f32 like HF.
    pub fn new(theta: f64, rotary_dim: usize) -> Self {
        let inv_freq = (0..rotary_dim / 2)
            .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / rotary_dim as f32))
            .collect();
        Self {
            inv_freq,
            rotary_dim,
        }
    }

    /// cos and sin for per-row positions `start[b] + t`, t < `seq_len`, computed in f32 and
    /// held in `dtype` (HF rotates in the activation dtype): `[2, B, T, rotary_dim]`, the layout
    /// [`kev_kernels::qk_norm_rope`] reads.
    pub fn at(
        &self,
        start: &[usize],
        seq_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let n = start.len() * seq_len * self.rotary_dim;
        let mut cos_sin = vec![0f32; 2 * n];
        let (cos, sin) = cos_sin.split_at_mut(n);
        let angles = start.iter().flat_map(|&s| {
            (0..seq_len).flat_map(move |t| {
                // HF concatenates the frequencies twice: cos/sin cover both rotate halves.
                let pos = (s + t) as f32;
                self.inv_freq
                    .iter()
                    .chain(&self.inv_freq)
                    .map(move |f| pos * f)
            })
        });
        for ((c, s), angle) in cos.iter_mut().zip(sin.iter_mut()).zip(angles) {
            (*c, *s) = (angle.cos(), angle.sin());
        }
        let shape = (2, start.len(), seq_len, self.rotary_dim);
        kev_kernels::uploads::upload_f32_as(cos_sin, shape, dtype, device)
    }
}
