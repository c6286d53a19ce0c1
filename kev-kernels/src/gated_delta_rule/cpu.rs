//! The gated delta rule on the CPU: one (batch row, value head) at a time, step by step.
//!
//! Each column j of the state `S: [Dk, Dv]` evolves on its own (`δ_j` reads only column j,
//! and the rank-1 update writes `k·δ_j` into it), so the AVX2 path walks the state in strips
//! of columns: within each block of `STEP_BLOCK` steps, a strip of 32 columns (`Dk` × 32 f32,
//! 16 KB at Dk = 128) is copied out of its strided rows, runs every step of the block while it
//! stays in the L1 cache, and is copied back before the next strip. The whole state (64 KB at
//! 128 × 128) does not fit there, and walking it twice per step made this loop ~10 % of a CPU
//! request.

use candle_core::{bail, CpuStorage, Layout, Result, Storage};
use rayon::prelude::*;

use super::op::{GatedDeltaRule, GdrDims};
use crate::backend::cpu::{as_f32, from_f32};
use crate::backend::cuda::sources::L2NORM_EPS;

/// The op's CPU forward: every (row, value head) in parallel, `o` handed back through the op.
pub(crate) fn gated_delta_rule(
    op: &GatedDeltaRule,
    state: &mut CpuStorage,
    sl: &Layout,
    qkv: &CpuStorage,
    ql: &Layout,
    gates: &CpuStorage,
    gl: &Layout,
) -> Result<()> {
    let GdrDims {
        num_k_heads: hk,
        num_v_heads: hv,
        head_k_dim: dk,
        head_v_dim: dv,
    } = op.dims;
    let (b_sz, seq_len) = (op.b_sz, op.seq_len);
    let channels = op.dims.channels();
    let qkv = as_f32(qkv, ql, "gated-delta-rule qkv")?;
    let gates = as_f32(gates, gl, "gated-delta-rule gates")?;
    let Some((s_start, s_end)) = sl.contiguous_offsets() else {
        bail!("gated-delta-rule: state must be contiguous")
    };
    let CpuStorage::F32(state) = state else {
        bail!("gated-delta-rule: state must be f32")
    };
    let state = &mut state[s_start..s_end];
    let group = hv / hk;
    let scale = 1.0 / (dk as f32).sqrt();

    let outs: Vec<Vec<f32>> = state
        .par_chunks_mut(dk * dv)
        .enumerate()
        .map(|(bh, s)| {
            let (b, h) = (bh / hv, bh % hv);
            let head = Head {
                qkv: &qkv[b * seq_len * channels..][..seq_len * channels],
                gates: &gates[b * seq_len * hv * 2..][..seq_len * hv * 2],
                len: (op.lengths[b] as usize).min(seq_len),
                seq_len,
                channels,
                h,
                q_at: (h / group) * dk,
                k_at: (hk + h / group) * dk,
                v_at: 2 * hk * dk + h * dv,
                hv,
                dk,
                dv,
                scale,
            };
            head.run(s)
        })
        .collect();

    let mut out = vec![0f32; b_sz * seq_len * hv * dv];
    for (bh, o) in outs.iter().enumerate() {
        let (b, h) = (bh / hv, bh % hv);
        for t in 0..seq_len {
            out[((b * seq_len + t) * hv + h) * dv..][..dv].copy_from_slice(&o[t * dv..][..dv]);
        }
    }
    op.set_output(Storage::Cpu(from_f32(out, op.out_dtype)?));
    Ok(())
}

/// One (batch row, value head) of the CPU recurrence: its inputs and where its parts start.
pub(crate) struct Head<'a> {
    /// The row's `[T, C]` conv outputs, `[q | k | v]` per step.
    pub(crate) qkv: &'a [f32],
    /// The row's `[T, Hv, 2]` gates, `(g, β)` per step and value head.
    pub(crate) gates: &'a [f32],
    /// Real steps (the rest is padding: state untouched, output zero).
    pub(crate) len: usize,
    pub(crate) seq_len: usize,
    pub(crate) channels: usize,
    /// This value head.
    pub(crate) h: usize,
    pub(crate) q_at: usize,
    pub(crate) k_at: usize,
    pub(crate) v_at: usize,
    pub(crate) hv: usize,
    pub(crate) dk: usize,
    pub(crate) dv: usize,
    /// The query scale, 1/√Dk.
    pub(crate) scale: f32,
}

/// Steps whose normalised q and k are prepared together (2 × 64 × Dk f32, 64 KB at Dk = 128:
/// they stay in L2 while every strip walks them).
#[cfg(target_arch = "x86_64")]
const STEP_BLOCK: usize = 64;

impl Head<'_> {
    /// Runs the recurrence on state `s` (`[Dk, Dv]`), returning `o: [T, Dv]`: in strips with
    /// AVX2 and FMA where Dv is a multiple of 8, row by row elsewhere. The two round
    /// differently, within f32 noise: FMA, each column sum split in two halves, Sᵀk taken
    /// before the decay and scaled after, and the q/k norms summed on 16 lanes.
    pub(crate) fn run(&self, s: &mut [f32]) -> Vec<f32> {
        #[cfg(target_arch = "x86_64")]
        if self.dv.is_multiple_of(8)
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has both features (checked just above).
            return unsafe { self.run_strips(s) };
        }
        self.run_rows(s)
    }

    /// The step's normalised q and k (by `normalize`), decay and β.
    #[inline(always)]
    fn step(
        &self,
        t: usize,
        q: &mut [f32],
        k: &mut [f32],
        normalize: impl Fn(&[f32], f32, &mut [f32]),
    ) -> (f32, f32) {
        let row = &self.qkv[t * self.channels..][..self.channels];
        normalize(&row[self.q_at..][..self.dk], self.scale, q);
        normalize(&row[self.k_at..][..self.dk], 1.0, k);
        let gate = &self.gates[(t * self.hv + self.h) * 2..];
        (gate[0].exp(), gate[1])
    }

    /// The value `v_t` of this head.
    fn v(&self, t: usize) -> &[f32] {
        &self.qkv[t * self.channels + self.v_at..][..self.dv]
    }

    /// The portable form: per step, one pass decays the state and reads it with k, a second
    /// applies the rank-1 update and reads it with q.
    fn run_rows(&self, s: &mut [f32]) -> Vec<f32> {
        let (dk, dv) = (self.dk, self.dv);
        let mut o = vec![0f32; self.seq_len * dv];
        let (mut q, mut k, mut kv) = (vec![0f32; dk], vec![0f32; dk], vec![0f32; dv]);
        for t in 0..self.len {
            let (decay, beta) = self.step(t, &mut q, &mut k, l2_normalize);
            kv.iter_mut().for_each(|x| *x = 0.0);
            for (i, s_row) in s.chunks_exact_mut(dv).enumerate() {
                for (sj, kvj) in s_row.iter_mut().zip(kv.iter_mut()) {
                    *sj *= decay;
                    *kvj += *sj * k[i];
                }
            }
            kv.iter_mut()
                .zip(self.v(t))
                .for_each(|(x, vj)| *x = (vj - *x) * beta);
            let o_t = &mut o[t * dv..][..dv];
            for (i, s_row) in s.chunks_exact_mut(dv).enumerate() {
                for ((sj, dj), oj) in s_row.iter_mut().zip(kv.iter()).zip(o_t.iter_mut()) {
                    *sj += k[i] * dj;
                    *oj += *sj * q[i];
                }
            }
        }
        o
    }

    /// The strip form: steps in blocks of [`STEP_BLOCK`] (their q, k, decay and β prepared
    /// once), and within a block each strip of columns through all its steps.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_strips(&self, s: &mut [f32]) -> Vec<f32> {
        let (dk, dv) = (self.dk, self.dv);
        let mut o = vec![0f32; self.seq_len * dv];
        let block_steps = STEP_BLOCK.min(self.len);
        let mut q = vec![0f32; block_steps * dk];
        let mut k = vec![0f32; block_steps * dk];
        let mut gates = vec![(0f32, 0f32); block_steps];
        let mut strip = vec![0f32; dk * 32];
        for t0 in (0..self.len).step_by(STEP_BLOCK) {
            let steps = STEP_BLOCK.min(self.len - t0);
            for (i, g) in gates[..steps].iter_mut().enumerate() {
                let (q, k) = (&mut q[i * dk..][..dk], &mut k[i * dk..][..dk]);
                // SAFETY (the closure): AVX2 and FMA, as this function requires.
                *g = self.step(t0 + i, q, k, |x, scale, out| unsafe {
                    l2_normalize_avx2(x, scale, out)
                });
            }
            let block = Block {
                q: &q,
                k: &k,
                gates: &gates[..steps],
                t0,
            };
            let mut col = 0;
            while col < dv {
                let width = if dv - col >= 32 { 32 } else { 8 };
                let strip = &mut strip[..dk * width];
                for (i, row) in strip.chunks_exact_mut(width).enumerate() {
                    row.copy_from_slice(&s[i * dv + col..][..width]);
                }
                if width == 32 {
                    self.strip_steps::<4>(strip, col, &block, &mut o);
                } else {
                    self.strip_steps::<1>(strip, col, &block, &mut o);
                }
                for (i, row) in strip.chunks_exact(width).enumerate() {
                    s[i * dv + col..][..width].copy_from_slice(row);
                }
                col += width;
            }
        }
        o
    }

    /// Runs the block's steps on one strip of `8·N` columns starting at `col` (`strip`:
    /// `[Dk, 8·N]`, contiguous), writing those columns of `o`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn strip_steps<const N: usize>(
        &self,
        strip: &mut [f32],
        col: usize,
        block: &Block,
        o: &mut [f32],
    ) {
        use std::arch::x86_64::*;
        let (dk, dv) = (self.dk, self.dv);
        let w = 8 * N;
        // Every raw access below stays inside `strip` because of this.
        assert_eq!(strip.len(), dk * w, "gated-delta-rule strip of {w} columns");
        let p = strip.as_mut_ptr();
        for (i, &(decay, beta)) in block.gates.iter().enumerate() {
            let t = block.t0 + i;
            let (q, k) = (&block.q[i * dk..][..dk], &block.k[i * dk..][..dk]);
            // Sᵀk over the strip (before the decay), even and odd rows in two sums so that
            // the FMA chains overlap.
            let mut even = [_mm256_setzero_ps(); N];
            let mut odd = [_mm256_setzero_ps(); N];
            let pairs = dk / 2;
            for r in 0..pairs {
                let (ke, ko) = (_mm256_set1_ps(k[2 * r]), _mm256_set1_ps(k[2 * r + 1]));
                for n in 0..N {
                    // SAFETY: rows 2r and 2r + 1 < Dk, lanes 8n..8n + 8 < w: inside `strip`.
                    let se = _mm256_loadu_ps(p.add(2 * r * w + 8 * n));
                    let so = _mm256_loadu_ps(p.add((2 * r + 1) * w + 8 * n));
                    even[n] = _mm256_fmadd_ps(se, ke, even[n]);
                    odd[n] = _mm256_fmadd_ps(so, ko, odd[n]);
                }
            }
            if dk % 2 == 1 {
                let kl = _mm256_set1_ps(k[dk - 1]);
                for (n, e) in even.iter_mut().enumerate() {
                    // SAFETY: the last row, lanes inside `strip`.
                    *e = _mm256_fmadd_ps(_mm256_loadu_ps(p.add((dk - 1) * w + 8 * n)), kl, *e);
                }
            }
            // δ = β·(v − decay·Sᵀk)
            let (decay_v, beta_v) = (_mm256_set1_ps(decay), _mm256_set1_ps(beta));
            let v = &self.v(t)[col..][..w];
            let mut delta = [_mm256_setzero_ps(); N];
            for n in 0..N {
                let kv = _mm256_mul_ps(_mm256_add_ps(even[n], odd[n]), decay_v);
                // SAFETY: `v` holds w = 8N values.
                let vn = _mm256_loadu_ps(v.as_ptr().add(8 * n));
                delta[n] = _mm256_mul_ps(_mm256_sub_ps(vn, kv), beta_v);
            }
            // S ← decay·S + k ⊗ δ, and o = Sᵀq on the new rows.
            let mut out = [_mm256_setzero_ps(); N];
            for r in 0..dk {
                let (kr, qr) = (_mm256_set1_ps(k[r]), _mm256_set1_ps(q[r]));
                for n in 0..N {
                    // SAFETY: row r < Dk, lanes inside `strip`.
                    let at = p.add(r * w + 8 * n);
                    let sn =
                        _mm256_fmadd_ps(kr, delta[n], _mm256_mul_ps(_mm256_loadu_ps(at), decay_v));
                    _mm256_storeu_ps(at, sn);
                    out[n] = _mm256_fmadd_ps(sn, qr, out[n]);
                }
            }
            let o_t = &mut o[t * dv + col..][..w];
            for (n, x) in out.iter().enumerate() {
                // SAFETY: `o_t` holds w = 8N values.
                _mm256_storeu_ps(o_t.as_mut_ptr().add(8 * n), *x);
            }
        }
    }
}

/// A block of prepared steps: normalised q and k (`[steps, Dk]` each), `(decay, β)` per step,
/// and the first step's index.
#[cfg(target_arch = "x86_64")]
struct Block<'a> {
    q: &'a [f32],
    k: &'a [f32],
    gates: &'a [(f32, f32)],
    t0: usize,
}

/// `out = scale · x / ‖x‖` (eps inside the root), summing in order.
fn l2_normalize(x: &[f32], scale: f32, out: &mut [f32]) {
    let sum_sq: f32 = x.iter().map(|v| v * v).sum();
    let inv = scale / (sum_sq + L2NORM_EPS).sqrt();
    out.iter_mut().zip(x).for_each(|(o, v)| *o = v * inv);
}

/// [`l2_normalize`] with the squares summed on 16 lanes (the in-order scalar sum is a chain of
/// Dk dependent adds, as long as a strip's whole step).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn l2_normalize_avx2(x: &[f32], scale: f32, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let (mut a, mut b) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut pairs = x.chunks_exact(16);
    for c in &mut pairs {
        // SAFETY: `c` holds 16 f32s.
        let (lo, hi) = (
            _mm256_loadu_ps(c.as_ptr()),
            _mm256_loadu_ps(c.as_ptr().add(8)),
        );
        a = _mm256_fmadd_ps(lo, lo, a);
        b = _mm256_fmadd_ps(hi, hi, b);
    }
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds 8 f32s.
    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(a, b));
    let tail: f32 = pairs.remainder().iter().map(|v| v * v).sum();
    let sum_sq = lanes.iter().sum::<f32>() + tail;
    let inv = scale / (sum_sq + L2NORM_EPS).sqrt();
    out.iter_mut().zip(x).for_each(|(o, v)| *o = v * inv);
}
