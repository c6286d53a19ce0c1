//! Partial rotary position embedding (QWEN35.md §10 pitfall 3): only the first `rotary_dim`
//! dims of each head rotate, NeoX style (`rotate_half`). For text, the interleaved mRoPE of the
//! checkpoint reduces to plain 1-D RoPE because all three position axes are equal.

use candle_core::{DType, Device, Result, Tensor, D};

/// Inverse frequencies for the rotary dims, and the helpers that apply them.
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

    /// The rotation for per-row positions `start[b] + t`, t < `seq_len`, in `dtype`.
    pub fn at(
        &self,
        start: &[usize],
        seq_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Rotation> {
        let half = self.inv_freq.len();
        let n = start.len() * seq_len * self.rotary_dim;
        let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for &s in start {
            for t in 0..seq_len {
                let pos = (s + t) as f32;
                // HF concatenates the frequencies twice: cos/sin cover both rotate halves.
                for _ in 0..2 {
                    for f in &self.inv_freq {
                        let angle = pos * f;
                        cos.push(angle.cos());
                        sin.push(angle.sin());
                    }
                }
            }
        }
        debug_assert_eq!(cos.len(), start.len() * seq_len * 2 * half);
        let shape = (start.len(), 1, seq_len, self.rotary_dim);
        let cos = Tensor::from_vec(cos, shape, device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, shape, device)?.to_dtype(dtype)?;
        Ok(Rotation {
            cos,
            sin,
            rotary_dim: self.rotary_dim,
        })
    }
}

/// cos and sin `[B, 1, T, rotary_dim]` for one forward's positions.
pub struct Rotation {
    cos: Tensor,
    sin: Tensor,
    rotary_dim: usize,
}

impl Rotation {
    /// Rotates the first `rotary_dim` dims of `xs: [B, H, T, head_dim]` (in its dtype, as HF).
    pub fn apply(&self, xs: &Tensor) -> Result<Tensor> {
        let (cos, sin) = (&self.cos, &self.sin);
        let head_dim = xs.dim(D::Minus1)?;
        let rot = xs.narrow(D::Minus1, 0, self.rotary_dim)?;
        let half = self.rotary_dim / 2;
        let x1 = rot.narrow(D::Minus1, 0, half)?;
        let x2 = rot.narrow(D::Minus1, half, half)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        let out = (rot.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?;
        if self.rotary_dim == head_dim {
            return Ok(out);
        }
        let pass = xs.narrow(D::Minus1, self.rotary_dim, head_dim - self.rotary_dim)?;
        Tensor::cat(&[&out, &pass], D::Minus1)
    }
}
