//! A CPU matmul for bf16 models on CPUs with AVX512-BF16: `x · Wᵀ` with the weight packed once
//! for `vdpbf16ps`, which multiplies two bf16 pairs into each f32 lane per instruction, twice
//! the multiply-adds of an f32 FMA. candle's CPU matmul has no bf16 kernel (it widens both
//! operands to f32 on every call), and an f32 GEMM peaks at half this rate (probe on a Zen 5
//! VM, 512 × 1024 × 8224, 2 threads: ~910 against ~440 GFLOP/s for the `gemm` crate's f32).
//!
//! Numbers: the products of bf16 values are exact in f32 and are summed in f32 (a pair per step,
//! in k order), then rounded once to the output dtype, as a bf16 matmul that accumulates in f32.
//! The instruction treats bf16 subnormals as zero.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::cpu_tiles::COLS;
#[cfg(target_arch = "x86_64")]
use crate::cpu_tiles::{column_tiles, store_row};

/// Rows of the input per micro-tile (16 accumulators of the 32 registers).
#[cfg(target_arch = "x86_64")]
const TILE: usize = 8;
/// The most column blocks a parallel task takes (each block of the weight, `k × 32` bf16 =
/// 64 KB at k = 1024, is read once while all rows stream past it).
#[cfg(target_arch = "x86_64")]
const BLOCKS_PER_TASK: usize = 8;

/// Where input `i` of output column `c` sits in its packed block.
fn in_block(i: usize, c: usize) -> usize {
    (i / 2) * COLS * 2 + c * 2 + i % 2
}

/// Whether this CPU runs [`PackedBf16`] (AVX-512F and AVX512-BF16).
pub fn bf16_gemm_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// A weight `[n, k]` in bf16, packed as `[⌈n/32⌉][⌈k/2⌉][32][2]`: per block of 32 output
/// columns, for each pair of inputs (k, k+1), the 32 columns' two values side by side (the
/// operand layout of `vdpbf16ps`). Columns past n and an odd k's last input are zeros.
#[derive(Clone)]
pub struct PackedBf16 {
    data: Arc<Vec<u16>>,
    n: usize,
    k: usize,
}

impl PackedBf16 {
    /// Packs `weight: [n, k]` (a CPU tensor of any float dtype, rounded to bf16).
    pub fn pack(weight: &Tensor) -> Result<Self> {
        let (n, k) = weight.dims2()?;
        if k == 0 {
            bail!("bf16-linear: a weight of {n} × 0 has no input features")
        }
        let w = weight.to_dtype(DType::BF16)?.contiguous()?;
        // Read in place (a copy per weight left the load's peak memory higher).
        let (storage, layout) = w.storage_and_layout();
        let candle_core::Storage::Cpu(CpuStorage::BF16(w)) = &*storage else {
            bail!("bf16-linear: the weight must be on the CPU")
        };
        let w = &w[layout.start_offset()..][..n * k];
        let pairs = k.div_ceil(2);
        let block = pairs * COLS * 2;
        let mut data = vec![0u16; n.div_ceil(COLS) * block];
        data.par_chunks_mut(block).enumerate().for_each(|(b, out)| {
            for c in 0..COLS.min(n - b * COLS) {
                let row = &w[(b * COLS + c) * k..][..k];
                for (i, v) in row.iter().enumerate() {
                    out[in_block(i, c)] = v.to_bits();
                }
            }
        });
        Ok(Self {
            data: Arc::new(data),
            n,
            k,
        })
    }

    /// Output features `start..start + len` (the weight's rows), packed on their own.
    pub fn rows(&self, start: usize, len: usize) -> Result<Self> {
        if start.checked_add(len).is_none_or(|end| end > self.n) {
            bail!("bf16-linear: rows {start} + {len} of {}", self.n)
        }
        let (k, pairs) = (self.k, self.k.div_ceil(2));
        let mut w = vec![half::bf16::ZERO; len * k];
        for (r, row) in w.chunks_mut(k).enumerate() {
            let (block, c) = ((start + r) / COLS, (start + r) % COLS);
            let b = &self.data[block * pairs * COLS * 2..];
            for (i, v) in row.iter_mut().enumerate() {
                *v = half::bf16::from_bits(b[in_block(i, c)]);
            }
        }
        Self::pack(&Tensor::from_vec(w, (len, k), &candle_core::Device::Cpu)?)
    }

    /// `x · Wᵀ` for `x: [.., k]` (CPU, bf16, f16 or f32; rounded to bf16 first), in x's dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.apply_op1_no_bwd(self)
    }

    /// `x` rows as bf16 pairs `[m][⌈k/2⌉]` (an odd k padded with a zero).
    ///
    /// # Safety
    /// The CPU has AVX-512F and AVX512-BF16 ([`bf16_gemm_available`]): f32 rows are converted
    /// with its instructions.
    unsafe fn input_pairs(&self, s: &CpuStorage, l: &Layout) -> Result<(Vec<u32>, usize)> {
        let Some((start, end)) = l.contiguous_offsets() else {
            bail!("bf16-linear: the input must be contiguous")
        };
        let k = self.k; // > 0: `pack` refuses an empty input dimension
        let m = (end - start) / k;
        let pairs = k.div_ceil(2);
        let mut a = vec![0u32; m * pairs];
        // Each row's pairs by `row` (on rayon's threads).
        fn fill<T: Sync>(
            a: &mut [u32],
            src: &[T],
            k: usize,
            row: impl Fn(&mut [u32], &[T]) + Sync,
        ) {
            a.par_chunks_mut(k.div_ceil(2))
                .zip(src.par_chunks(k))
                .for_each(|(out, r)| row(out, r));
        }
        match s {
            CpuStorage::BF16(v) => fill(&mut a, &v[start..end], k, |o, r| {
                pairs_of(o, r, |x| x.to_bits())
            }),
            // SAFETY: the CPU has AVX512-BF16 (this fn's contract).
            CpuStorage::F32(v) => fill(&mut a, &v[start..end], k, |o, r| unsafe {
                f32_row_pairs(o, r)
            }),
            CpuStorage::F16(v) => fill(&mut a, &v[start..end], k, |o, r| {
                pairs_of(o, r, |x| half::bf16::from_f32(x.to_f32()).to_bits())
            }),
            other => bail!("bf16-linear: unsupported input dtype {:?}", other.dtype()),
        }
        Ok((a, m))
    }
}

/// One row's values as bf16 pairs (`out[p]` = element 2p in the low half, 2p + 1 in the high
/// half, zero past the row's end).
fn pairs_of<T: Copy>(out: &mut [u32], row: &[T], bits: impl Fn(T) -> u16) {
    for (p, o) in out.iter_mut().enumerate() {
        let lo = bits(row[2 * p]) as u32;
        let hi = row.get(2 * p + 1).map_or(0, |&v| bits(v) as u32);
        *o = lo | (hi << 16);
    }
}

/// [`pairs_of`] for an f32 row, 32 values at a time with `vcvtne2ps2bf16` (round to nearest
/// even, as `half`'s conversion; it reads subnormal inputs as zero, which activations never
/// are in practice).
///
/// # Safety
/// The CPU has AVX-512F and AVX512-BF16 ([`bf16_gemm_available`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn f32_row_pairs(out: &mut [u32], row: &[f32]) {
    use std::arch::x86_64::*;
    let full = row.len() / 32;
    for i in 0..full {
        let lo = _mm512_loadu_ps(row.as_ptr().add(32 * i));
        let hi = _mm512_loadu_ps(row.as_ptr().add(32 * i + 16));
        // The second operand fills the low 16 lanes.
        let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
        _mm512_storeu_si512(out.as_mut_ptr().add(16 * i).cast(), v);
    }
    pairs_of(&mut out[16 * full..], &row[32 * full..], |x| {
        half::bf16::from_f32(x).to_bits()
    });
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn f32_row_pairs(out: &mut [u32], row: &[f32]) {
    pairs_of(out, row, |x| half::bf16::from_f32(x).to_bits());
}

impl PackedBf16 {
    /// `a` (`m` rows of bf16 pairs) times the packed weight, in f32 ([`column_tiles`]: the
    /// rows, shared, stream past each block of the weight from L2).
    ///
    /// # Safety
    /// The CPU has AVX-512F and AVX512-BF16 ([`bf16_gemm_available`]).
    #[cfg(target_arch = "x86_64")]
    unsafe fn matmul(&self, a: &[u32], m: usize) -> Vec<f32> {
        let (n, pairs) = (self.n, self.k.div_ceil(2));
        let run_tile = |block: usize, r0: usize, rows: usize, c: *mut f32| {
            let b = &self.data[block * pairs * COLS * 2..][..pairs * COLS * 2];
            let cols = COLS.min(n - block * COLS);
            let a = &a[r0 * pairs..][..rows * pairs];
            // SAFETY: the CPU has AVX-512F and AVX512-BF16 (this fn's contract); `a` holds
            // the tile's rows of `pairs` pairs, `b` the block's `pairs` × 32 pairs, `c` the
            // tile's rows of `cols` floats.
            unsafe {
                match rows {
                    8 => tile::<8>(b, a, c, n, pairs, cols),
                    7 => tile::<7>(b, a, c, n, pairs, cols),
                    6 => tile::<6>(b, a, c, n, pairs, cols),
                    5 => tile::<5>(b, a, c, n, pairs, cols),
                    4 => tile::<4>(b, a, c, n, pairs, cols),
                    3 => tile::<3>(b, a, c, n, pairs, cols),
                    2 => tile::<2>(b, a, c, n, pairs, cols),
                    _ => tile::<1>(b, a, c, n, pairs, cols),
                }
            }
        };
        // SAFETY: each tile stores its rows × columns (pairs > 0: `pack` refuses k = 0).
        unsafe { column_tiles(m, n, TILE, BLOCKS_PER_TASK, run_tile) }
    }

    /// Elsewhere [`bf16_gemm_available`] is false and `cpu_fwd` refuses before this.
    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn matmul(&self, _: &[u32], _: usize) -> Vec<f32> {
        unreachable!("bf16-linear runs on x86-64 only")
    }
}

impl CustomOp1 for PackedBf16 {
    fn name(&self) -> &'static str {
        "bf16-linear"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = l.shape().dims();
        if dims.last() != Some(&self.k) {
            bail!(
                "bf16-linear: input {dims:?} does not end in {} features",
                self.k
            )
        }
        if !bf16_gemm_available() {
            bail!("bf16-linear: this CPU has no AVX512-BF16")
        }
        // SAFETY: the CPU has AVX-512F and AVX512-BF16 (checked above).
        let (a, m) = unsafe { self.input_pairs(s, l) }?;
        // SAFETY: the CPU has AVX-512F and AVX512-BF16 (checked above).
        let (n, out) = (self.n, unsafe { self.matmul(&a, m) });
        let mut shape = dims.to_vec();
        *shape.last_mut().expect("checked above") = n;
        // Rounded on rayon's threads: one thread took a tenth of a bf16 forward.
        let out = match s.dtype() {
            DType::BF16 => {
                CpuStorage::BF16(out.par_iter().map(|&v| half::bf16::from_f32(v)).collect())
            }
            DType::F16 => {
                CpuStorage::F16(out.par_iter().map(|&v| half::f16::from_f32(v)).collect())
            }
            _ => CpuStorage::F32(out),
        };
        Ok((out, Shape::from(shape)))
    }
}

/// R rows × 32 columns: for each input pair, the block's 32 columns' pairs (two vectors) times
/// each row's pair broadcast, accumulated in f32; then the first `cols` columns stored at `c`
/// (row pitch `n`; the caller guarantees R rows of `cols` floats there).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile<const R: usize>(
    b: &[u16],
    a: &[u32],
    c: *mut f32,
    n: usize,
    pairs: usize,
    cols: usize,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    for p in 0..pairs {
        let bp = b.as_ptr().add(p * COLS * 2);
        let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.cast()));
        let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.add(COLS).cast()));
        for (r, acc) in acc.iter_mut().enumerate() {
            let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(a[r * pairs + p] as i32));
            acc[0] = _mm512_dpbf16_ps(acc[0], x, b0);
            acc[1] = _mm512_dpbf16_ps(acc[1], x, b1);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        store_row(c.add(r * n), *acc, cols);
    }
}
