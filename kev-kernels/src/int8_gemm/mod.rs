//! A CPU matmul for the `int8` dtype on CPUs with AVX-512 VNNI: `x · Wᵀ` with the weight
//! quantized once to int8 and each input row quantized on every call, multiplied with
//! `vpdpbusd` (four u8 · i8 products summed into each i32 lane per instruction: twice the
//! multiply-adds of `vdpbf16ps`, four times an f32 FMA's).
//!
//! Numbers: both operands are quantized symmetrically to integers in −127..=127 (round to
//! nearest even of `v · 127 / max|v|`, one f32 scale per group of values): the weight per output
//! column, each input row per block of [`BLOCK`] inputs, so that an outlier among the
//! activations costs precision only within its own block, as in llama.cpp's Q8_0. On the test
//! fixture input blocks of 128 drifted about twice as far from f32 as blocks of 32 (max |Δp|
//! 0.25 against 0.14); the weights' grouping mattered less. A block's products are summed
//! exactly in i32 and scaled by the input block's scale into f32 sums, which the column's scale
//! multiplies once. Inputs go in as `q + 128` (the instruction's unsigned operand), so each
//! block's sums start at `−128 · Σ q_w`.
//! Non-finite inputs give non-finite outputs (their block's scale is).

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::cpu_tiles::COLS;
#[cfg(target_arch = "x86_64")]
use crate::cpu_tiles::{column_tiles, store_row};

/// Inputs per quantization block of an input row (one scale each; the weight's per-block sums
/// follow the same blocks).
pub const BLOCK: usize = 32;
/// Groups of four inputs per quantization block (one `vpdpbusd` step each).
const QUADS: usize = BLOCK / 4;
/// Rows of the input per micro-tile: 2 × 6 i32 and 2 × 6 f32 accumulators of the 32 registers.
#[cfg(target_arch = "x86_64")]
const TILE: usize = 6;
/// The most column blocks a parallel task takes.
#[cfg(target_arch = "x86_64")]
const BLOCKS_PER_TASK: usize = 8;

/// Whether this CPU runs [`PackedInt8`] (AVX-512 F, BW and VNNI).
pub fn int8_gemm_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `v`'s symmetric int8 quantization: its scale (`max|v| / 127`) and its integers in
/// −127..=127, written to `out` (zeros for an all-zero `v`).
pub fn quantize_block(v: &[f32], out: &mut [i8]) -> f32 {
    let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    // A NaN is lost by `max`: found here so that its block's scale (and output) is NaN.
    if v.iter().any(|x| !x.is_finite()) {
        out.fill(0);
        return f32::NAN;
    }
    if amax == 0.0 {
        out.fill(0);
        return 0.0;
    }
    let inv = 127.0 / amax;
    // Round to nearest even by adding and taking away 1.5 · 2²³ (exact for |y| < 2²²), as the
    // vector conversion rounds: `round_ties_even` is a libm call on baseline x86-64.
    const MAGIC: f32 = 12_582_912.0;
    for (o, x) in out.iter_mut().zip(v) {
        let y = (x * inv).clamp(-127.0, 127.0);
        *o = ((y + MAGIC) - MAGIC) as i8;
    }
    amax / 127.0
}

/// A weight `[n, k]` quantized per output column and packed as
/// `[⌈n/32⌉][⌈k/4⌉ padded to whole blocks][32][4]` i8: per block of 32 output columns, for each
/// four inputs, the 32 columns' four values side by side (the operand layout of `vpdpbusd`).
/// Per column block, the 32 columns' scales, and per block of [`BLOCK`] inputs their `−128 · Σ q`.
#[derive(Clone)]
pub struct PackedInt8 {
    data: Arc<Vec<i8>>,
    /// `[⌈n/32⌉ × 32]`.
    scales: Arc<Vec<f32>>,
    /// `[⌈n/32⌉][k blocks][32]`: −128 × the block's integer sum, where a block's i32 sums
    /// start (the unsigned inputs' offset, taken away).
    starts: Arc<Vec<i32>>,
    n: usize,
    k: usize,
}

impl PackedInt8 {
    /// Quantizes and packs `weight: [n, k]` (a CPU tensor of any float dtype, read as f32).
    pub fn pack(weight: &Tensor) -> Result<Self> {
        let (n, k) = weight.dims2()?;
        if k == 0 {
            bail!("int8-linear: a weight of {n} × 0 has no input features")
        }
        let w = weight.to_dtype(DType::F32)?.contiguous()?;
        let (storage, layout) = w.storage_and_layout();
        let candle_core::Storage::Cpu(CpuStorage::F32(w)) = &*storage else {
            bail!("int8-linear: the weight must be on the CPU")
        };
        let w = &w[layout.start_offset()..][..n * k];
        if w.iter().any(|v| !v.is_finite()) {
            bail!("int8-linear: the weight has non-finite values")
        }
        let blocks = k.div_ceil(BLOCK);
        let col_block = blocks * QUADS * COLS * 4;
        let col_blocks = n.div_ceil(COLS);
        let mut data = vec![0i8; col_blocks * col_block];
        let mut scales = vec![0f32; col_blocks * COLS];
        let mut starts = vec![0i32; col_blocks * blocks * COLS];
        data.par_chunks_mut(col_block)
            .zip(scales.par_chunks_mut(COLS))
            .zip(starts.par_chunks_mut(blocks * COLS))
            .enumerate()
            .for_each(|(b, ((out, scales), starts))| {
                let mut q = vec![0i8; k];
                for c in 0..COLS.min(n - b * COLS) {
                    scales[c] = quantize_block(&w[(b * COLS + c) * k..][..k], &mut q);
                    for (blk, q) in q.chunks(BLOCK).enumerate() {
                        starts[blk * COLS + c] = -128 * q.iter().map(|&x| x as i32).sum::<i32>();
                    }
                    for (i, &x) in q.iter().enumerate() {
                        out[in_block(i, c)] = x;
                    }
                }
            });
        Ok(Self {
            data: Arc::new(data),
            scales: Arc::new(scales),
            starts: Arc::new(starts),
            n,
            k,
        })
    }

    /// Output features `start..start + len` (the weight's rows), packed on their own (their
    /// quantization unchanged).
    pub fn rows(&self, start: usize, len: usize) -> Result<Self> {
        if start.checked_add(len).is_none_or(|end| end > self.n) {
            bail!("int8-linear: rows {start} + {len} of {}", self.n)
        }
        let blocks = self.k.div_ceil(BLOCK);
        let col_block = blocks * QUADS * COLS * 4;
        let col_blocks = len.div_ceil(COLS);
        let mut data = vec![0i8; col_blocks * col_block];
        let mut scales = vec![0f32; col_blocks * COLS];
        let mut starts = vec![0i32; col_blocks * blocks * COLS];
        scales[..len].copy_from_slice(&self.scales[start..start + len]);
        for r in 0..len {
            let (from, c) = ((start + r) / COLS, (start + r) % COLS);
            let (to, d) = (r / COLS, r % COLS);
            for i in 0..blocks * BLOCK {
                data[to * col_block + in_block(i, d)] =
                    self.data[from * col_block + in_block(i, c)];
            }
            for blk in 0..blocks {
                starts[(to * blocks + blk) * COLS + d] =
                    self.starts[(from * blocks + blk) * COLS + c];
            }
        }
        Ok(Self {
            data: Arc::new(data),
            scales: Arc::new(scales),
            starts: Arc::new(starts),
            n: len,
            k: self.k,
        })
    }

    /// `x · Wᵀ` for `x: [.., k]` (CPU, f32), in f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.apply_op1_no_bwd(self)
    }

    /// `x`'s rows quantized: `[m][k blocks × QUADS]` groups of four `q + 128` bytes (zeros past k
    /// quantized as 0) and `[m][k blocks]` scales.
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BW ([`int8_gemm_available`]).
    unsafe fn quantize_rows(&self, x: &[f32]) -> (Vec<u32>, Vec<f32>, usize) {
        let k = self.k;
        let m = x.len() / k;
        let blocks = k.div_ceil(BLOCK);
        let mut a = vec![0x8080_8080u32; m * blocks * QUADS];
        let mut scales = vec![0f32; m * blocks];
        a.par_chunks_mut(blocks * QUADS)
            .zip(scales.par_chunks_mut(blocks))
            .zip(x.par_chunks(k))
            .for_each(|((a, scales), row)| {
                for (blk, v) in row.chunks(BLOCK).enumerate() {
                    let out = &mut a[blk * QUADS..][..QUADS];
                    // SAFETY: the CPU has AVX-512 F and BW (this fn's contract).
                    scales[blk] = unsafe { quantize_input_block(v, out) };
                }
            });
        (a, scales, m)
    }
}

/// [`quantize_block`] of an input block `v` (≤ [`BLOCK`] values), written as `q + 128` bytes to
/// `out` (its groups of four; past `v`'s end left as they are), with AVX-512 for a whole block.
///
/// # Safety
/// The CPU has AVX-512 F and BW ([`int8_gemm_available`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn quantize_input_block(v: &[f32], out: &mut [u32]) -> f32 {
    use std::arch::x86_64::*;
    let bytes = out.as_mut_ptr().cast::<u8>();
    if v.len() < BLOCK {
        let mut q = [0i8; BLOCK];
        let scale = quantize_block(v, &mut q[..v.len()]);
        for (i, &x) in q[..v.len()].iter().enumerate() {
            *bytes.add(i) = (x as i16 + 128) as u8;
        }
        return scale;
    }
    let p = v.as_ptr();
    let (mut amax, mut poison) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    for i in 0..BLOCK / 16 {
        let x = _mm512_loadu_ps(p.add(16 * i));
        amax = _mm512_max_ps(amax, _mm512_abs_ps(x));
        // x · 0 is NaN for an infinite or NaN x, which `max` would not keep.
        poison = _mm512_fmadd_ps(x, _mm512_setzero_ps(), poison);
    }
    let amax = _mm512_reduce_max_ps(amax);
    if _mm512_reduce_add_ps(poison).is_nan() {
        std::ptr::write_bytes(bytes, 128, BLOCK);
        return f32::NAN;
    }
    if amax == 0.0 {
        std::ptr::write_bytes(bytes, 128, BLOCK);
        return 0.0;
    }
    let inv = _mm512_set1_ps(127.0 / amax);
    let (lo, hi, offset) = (
        _mm512_set1_epi32(-127),
        _mm512_set1_epi32(127),
        _mm512_set1_epi32(128),
    );
    for i in 0..BLOCK / 16 {
        let y = _mm512_mul_ps(_mm512_loadu_ps(p.add(16 * i)), inv);
        let q = _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(y);
        let q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), offset);
        _mm_storeu_si128(bytes.add(16 * i).cast(), _mm512_cvtepi32_epi8(q));
    }
    amax / 127.0
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn quantize_input_block(_: &[f32], _: &mut [u32]) -> f32 {
    unreachable!("int8-linear runs on x86-64 only")
}

/// Where input `i` of output column `c` sits in its packed column block.
fn in_block(i: usize, c: usize) -> usize {
    (i / 4) * COLS * 4 + c * 4 + i % 4
}

impl CustomOp1 for PackedInt8 {
    fn name(&self) -> &'static str {
        "int8-linear"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = l.shape().dims();
        if dims.last() != Some(&self.k) {
            bail!(
                "int8-linear: input {dims:?} does not end in {} features",
                self.k
            )
        }
        if !int8_gemm_available() {
            bail!("int8-linear: this CPU has no AVX-512 VNNI")
        }
        let CpuStorage::F32(v) = s else {
            bail!("int8-linear: unsupported input dtype {:?}", s.dtype())
        };
        let Some((start, end)) = l.contiguous_offsets() else {
            bail!("int8-linear: the input must be contiguous")
        };
        // SAFETY: the CPU has AVX-512 F, BW and VNNI (checked above).
        let out = unsafe {
            let (a, a_scales, m) = self.quantize_rows(&v[start..end]);
            self.matmul(&a, &a_scales, m)
        };
        let mut shape = dims.to_vec();
        *shape.last_mut().expect("checked above") = self.n;
        Ok((CpuStorage::F32(out), Shape::from(shape)))
    }
}

impl PackedInt8 {
    /// `a` (`m` quantized rows, their scales `a_scales`) times the packed weight, in f32
    /// ([`column_tiles`]).
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and VNNI ([`int8_gemm_available`]).
    #[cfg(target_arch = "x86_64")]
    unsafe fn matmul(&self, a: &[u32], a_scales: &[f32], m: usize) -> Vec<f32> {
        let n = self.n;
        let kb = self.k.div_ceil(BLOCK);
        let run_tile = |block: usize, r0: usize, rows: usize, c: *mut f32| {
            let w = Weights {
                data: &self.data[block * kb * QUADS * COLS * 4..][..kb * QUADS * COLS * 4],
                scales: &self.scales[block * COLS..][..COLS],
                starts: &self.starts[block * kb * COLS..][..kb * COLS],
                cols: COLS.min(n - block * COLS),
            };
            let a = &a[r0 * kb * QUADS..][..rows * kb * QUADS];
            let s = &a_scales[r0 * kb..][..rows * kb];
            // SAFETY: the CPU has the features (this fn's contract); `a` and `s` hold the
            // tile's rows, `w` the block's `kb` blocks, `c` the tile's rows of `w.cols`.
            unsafe {
                match rows {
                    6 => tile::<6>(&w, a, s, c, n, kb),
                    5 => tile::<5>(&w, a, s, c, n, kb),
                    4 => tile::<4>(&w, a, s, c, n, kb),
                    3 => tile::<3>(&w, a, s, c, n, kb),
                    2 => tile::<2>(&w, a, s, c, n, kb),
                    _ => tile::<1>(&w, a, s, c, n, kb),
                }
            }
        };
        // SAFETY: each tile stores its rows × columns.
        unsafe { column_tiles(m, n, TILE, BLOCKS_PER_TASK, run_tile) }
    }

    /// Elsewhere [`int8_gemm_available`] is false and `cpu_fwd` refuses before this.
    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn matmul(&self, _: &[u32], _: &[f32], _: usize) -> Vec<f32> {
        unreachable!("int8-linear runs on x86-64 only")
    }
}

/// One column block of the packed weight.
#[cfg(target_arch = "x86_64")]
struct Weights<'a> {
    data: &'a [i8],
    scales: &'a [f32],
    starts: &'a [i32],
    /// Columns of the block that exist (≤ 32).
    cols: usize,
}

/// R rows × 32 columns: per block of inputs, the exact i32 sums of the block's products
/// (`vpdpbusd` over its groups of four, from the block's start, the unsigned offset taken away), scaled by the
/// input block's scale into f32 accumulators; then, times the columns' scales, the first
/// `w.cols` columns stored at `c` (row pitch `n`).
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; `a` holds R rows of `kb × QUADS` groups, `s` R rows of `kb`
/// scales, `w` `kb` blocks, and `c` R rows of `w.cols` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile<const R: usize>(
    w: &Weights,
    a: &[u32],
    s: &[f32],
    c: *mut f32,
    n: usize,
    kb: usize,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    let rows = kb * QUADS;
    for blk in 0..kb {
        let wp = w.data.as_ptr().add(blk * QUADS * COLS * 4);
        let ap = a.as_ptr().add(blk * QUADS);
        // The sums start at −128 · Σ q_w, which the unsigned inputs add back.
        let start = w.starts.as_ptr().add(blk * COLS);
        let start = [
            _mm512_loadu_si512(start.cast()),
            _mm512_loadu_si512(start.add(16).cast()),
        ];
        let mut sums = [start; R];
        for g in 0..QUADS {
            let b0 = _mm512_loadu_si512(wp.add(g * COLS * 4).cast());
            let b1 = _mm512_loadu_si512(wp.add(g * COLS * 4 + 64).cast());
            for (r, sums) in sums.iter_mut().enumerate() {
                let x = _mm512_set1_epi32(*ap.add(r * rows + g) as i32);
                sums[0] = _mm512_dpbusd_epi32(sums[0], x, b0);
                sums[1] = _mm512_dpbusd_epi32(sums[1], x, b1);
            }
        }
        for r in 0..R {
            let sa = _mm512_set1_ps(s[r * kb + blk]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][0]), sa, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][1]), sa, acc[r][1]);
        }
    }
    let sc = w.scales.as_ptr();
    let (sc0, sc1) = (_mm512_loadu_ps(sc), _mm512_loadu_ps(sc.add(16)));
    for (r, acc) in acc.iter().enumerate() {
        let acc = [_mm512_mul_ps(acc[0], sc0), _mm512_mul_ps(acc[1], sc1)];
        store_row(c.add(r * n), acc, w.cols);
    }
}
