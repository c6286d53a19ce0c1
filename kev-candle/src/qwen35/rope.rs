//! Partial rotary position embedding (docs/BACKBONE.md §10 pitfall 3): only the first `rotary_dim`
//! dims of each head rotate, NeoX style (`rotate_half`). For text, the interleaved mRoPE of the
//! checkpoint reduces to plain 1-D RoPE because all three position axes are equal.

use std::sync::{Arc, RwLock};

use candle_core::{DType, Device, Result, Tensor};
use kev_kernels::uploads::{upload, Upload};
use rayon::prelude::*;

/// Inverse frequencies for the rotary dims, and the cos and sin of every position asked for so
/// far.
pub struct Rope {
    inv_freq: Vec<f32>,
    rotary_dim: usize,
    /// cos and sin of positions `0..len` (`[len, rotary_dim]` each), grown on demand. A batch's
    /// rows repeat the same positions (every state starts at 0): computing cos and sin per row
    /// and step held back a 64-record batch's first kernel on the H200 by ~18 ms (1/8 of it).
    table: RwLock<Arc<Table>>,
}

/// cos and sin of positions `0..len`, `[len, rotary_dim]` each.
#[derive(Default)]
struct Table {
    len: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
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
            table: RwLock::default(),
        }
    }

    /// The table, holding at least positions `0..len`.
    fn table(&self, len: usize) -> Arc<Table> {
        let have = Arc::clone(&self.table.read().unwrap_or_else(|e| e.into_inner()));
        if have.len >= len {
            return have;
        }
        let mut slot = self.table.write().unwrap_or_else(|e| e.into_inner());
        if slot.len >= len {
            return Arc::clone(&slot);
        }
        // Doubling (up to 64k positions), so a growing stream of lengths computes each position
        // a few times at most.
        let len = len.max((2 * slot.len).min(1 << 16));
        let rd = self.rotary_dim;
        let (mut cos, mut sin) = (vec![0f32; len * rd], vec![0f32; len * rd]);
        // (`max(1)`: a head with no rotary dims has empty tables, and chunks must not be empty.)
        cos.par_chunks_mut(rd.max(1))
            .zip(sin.par_chunks_mut(rd.max(1)))
            .enumerate()
            .for_each(|(pos, (c, s))| {
                // HF concatenates the frequencies twice: cos/sin cover both rotate halves.
                let freqs = self.inv_freq.iter().chain(&self.inv_freq);
                for ((c, s), f) in c.iter_mut().zip(s.iter_mut()).zip(freqs) {
                    let angle = pos as f32 * f;
                    (*c, *s) = (angle.cos(), angle.sin());
                }
            });
        *slot = Arc::new(Table { len, cos, sin });
        Arc::clone(&slot)
    }

    /// cos and sin for per-row positions `start[b] + t`, t < `seq_len`, computed in f32 and
    /// held in `dtype` (HF rotates in the activation dtype): `[2, B, T, rotary_dim]`, the layout
    /// [`kev_kernels::qk_norm_rope`] reads. Rounded on the host (to nearest, ties to even, as
    /// candle's casts round), so the device runs no cast kernel for them.
    pub fn at(
        &self,
        start: &[usize],
        seq_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let end = start.iter().map(|&s| s + seq_len).max().unwrap_or(0);
        let table = self.table(end);
        let shape = (2, start.len(), seq_len, self.rotary_dim);
        match dtype {
            DType::F32 => upload(self.rows(&table, start, seq_len, |x| x), shape, device),
            DType::BF16 => upload(
                self.rows(&table, start, seq_len, half::bf16::from_f32),
                shape,
                device,
            ),
            DType::F16 => upload(
                self.rows(&table, start, seq_len, half::f16::from_f32),
                shape,
                device,
            ),
            other => candle_core::bail!("rotary tables in {other:?}"),
        }
    }

    /// The cos rows of positions `start[b]..start[b] + seq_len` for every b, then the sin rows,
    /// each value through `cast` (rows filled on rayon's threads).
    fn rows<T: Upload + Send>(
        &self,
        table: &Table,
        start: &[usize],
        seq_len: usize,
        cast: impl Fn(f32) -> T + Sync,
    ) -> Vec<T> {
        let row = seq_len * self.rotary_dim;
        let mut out = vec![cast(0.0); 2 * start.len() * row];
        if row == 0 {
            return out;
        }
        let (cos, sin) = out.split_at_mut(start.len() * row);
        for (part, src) in [(cos, &table.cos), (sin, &table.sin)] {
            part.par_chunks_mut(row).zip(start).for_each(|(dst, &s)| {
                let src = &src[s * self.rotary_dim..][..row];
                for (d, &v) in dst.iter_mut().zip(src) {
                    *d = cast(v);
                }
            });
        }
        out
    }
}
