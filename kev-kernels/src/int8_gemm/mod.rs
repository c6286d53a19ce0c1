//! A CPU matmul for the `int8` dtype: `x · Wᵀ` with the weight quantized once to int8 and each
//! input row quantized on every call, multiplied in exact integer sums on one of two
//! instruction sets ([`Int8Isa`]): AVX-512 VNNI's `vpdpbusd` (four u8 · i8 products summed into
//! each i32 lane per instruction: twice the multiply-adds of `vdpbf16ps`, four times an f32
//! FMA's; `vnni.rs`), or AVX2's `vpmaddubsw` and `vpmaddwd` (`avx2.rs`), so that CPUs without
//! AVX-512 run the same dtype. Both give the same integer sums, so the same outputs bit for bit.
//!
//! Numbers: both operands are quantized symmetrically to integers in −127..=127 (round to
//! nearest even of `v · 127 / max|v|`, one f32 scale per group of values): the weight per output
//! column, each input row per block of [`BLOCK`] inputs, so that an outlier among the
//! activations costs precision only within its own block, as in llama.cpp's Q8_0. On the test
//! fixture input blocks of 128 drifted about twice as far from f32 as blocks of 32 (max |Δp|
//! 0.25 against 0.14); the weights' grouping mattered less. A block's products are summed
//! exactly in i32 and scaled by the input block's scale into f32 sums (an FMA a block, in block
//! order), which the column's scale multiplies once.
//! Non-finite inputs give non-finite outputs (their block's scale is).

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use crate::cpu_tiles::column_tiles;
use crate::cpu_tiles::COLS;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod vnni;

/// Inputs per quantization block of an input row (one scale each; the weight's per-block sums
/// follow the same blocks).
pub const BLOCK: usize = 32;
/// Groups of four inputs per quantization block (one `vpdpbusd` step each).
const QUADS: usize = BLOCK / 4;
/// The most column blocks a parallel task takes.
#[cfg(target_arch = "x86_64")]
const BLOCKS_PER_TASK: usize = 8;

/// The instruction set an int8 product runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int8Isa {
    /// AVX-512 F, BW and VNNI: `vpdpbusd` on the inputs as `q + 128` bytes.
    Avx512Vnni,
    /// AVX2 and FMA: `vpmaddubsw` on |input| and the weights given the inputs' signs, then
    /// `vpmaddwd` into i32 (no pair of products can saturate: 2 · 127² < 2¹⁵).
    Avx2,
}

impl Int8Isa {
    /// Whether this CPU has the instruction set.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            match self {
                Self::Avx512Vnni => has!("avx512f") && has!("avx512bw") && has!("avx512vnni"),
                Self::Avx2 => has!("avx2") && has!("fma"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// The fastest instruction set this CPU has, or the one `KEV_INT8_ISA` names (`avx2`,
    /// `avx512vnni`: to measure the AVX2 kernel on a CPU that has VNNI) where the CPU has it.
    pub fn best() -> Option<Self> {
        let named = match std::env::var("KEV_INT8_ISA").as_deref() {
            Ok("avx2") => Some(Self::Avx2),
            Ok("avx512vnni") => Some(Self::Avx512Vnni),
            _ => None,
        };
        named
            .into_iter()
            .chain([Self::Avx512Vnni, Self::Avx2])
            .find(|isa| isa.available())
    }

    /// The byte an input's integer `q` is fed as: `q + 128` for `vpdpbusd`'s unsigned operand,
    /// `q` itself for AVX2 (whose sign trick takes signed inputs).
    #[cfg(target_arch = "x86_64")]
    fn offset(self) -> i16 {
        match self {
            Self::Avx512Vnni => 128,
            Self::Avx2 => 0,
        }
    }
}

/// Whether this CPU runs [`PackedInt8`] (AVX-512 VNNI, or AVX2 with FMA).
pub fn int8_gemm_available() -> bool {
    Int8Isa::best().is_some()
}

/// `v`'s symmetric int8 quantization: its scale (`max|v| / 127`) and its integers in
/// −127..=127, written to `out` (zeros, scale 0, for a `v` whose largest magnitude is 0 or too
/// small for `127 / max|v|` to be finite, below about 3.7e-37: [`negligible`]).
pub fn quantize_block(v: &[f32], out: &mut [i8]) -> f32 {
    let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    // A NaN is lost by `max`: found here so that its block's scale (and output) is NaN.
    if v.iter().any(|x| !x.is_finite()) {
        out.fill(0);
        return f32::NAN;
    }
    if negligible(amax) {
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

/// Whether a block of largest magnitude `amax` quantizes to zeros: 0, or so small that the
/// reciprocal scale `127 / amax` overflows (it would turn every value into ±127 or NaN).
fn negligible(amax: f32) -> bool {
    !(127.0 / amax).is_finite()
}

/// [`quantize_block`] of a block `v` shorter than [`BLOCK`], written as `q + offset` bytes at
/// `bytes` (the vector forms' tail).
///
/// # Safety
/// `bytes` has room for `v.len()` bytes.
#[cfg(target_arch = "x86_64")]
unsafe fn quantize_short_block(v: &[f32], bytes: *mut u8, offset: i16) -> f32 {
    let mut q = [0i8; BLOCK];
    let scale = quantize_block(v, &mut q[..v.len()]);
    for (i, &x) in q[..v.len()].iter().enumerate() {
        *bytes.add(i) = (x as i16 + offset) as u8;
    }
    scale
}

/// A weight `[n, k]` quantized per output column and packed as
/// `[⌈n/32⌉][⌈k/4⌉ padded to whole blocks][32][4]` i8: per block of 32 output columns, for each
/// four inputs, the 32 columns' four values side by side (the operand layout of `vpdpbusd`, and
/// of `vpmaddubsw` then `vpmaddwd`). Per column block, the 32 columns' scales, and per block of
/// [`BLOCK`] inputs their `−128 · Σ q`.
#[derive(Clone)]
pub struct PackedInt8 {
    data: Arc<Vec<i8>>,
    /// `[⌈n/32⌉ × 32]`.
    scales: Arc<Vec<f32>>,
    /// `[⌈n/32⌉][k blocks][32]`: −128 × the block's integer sum, where a block's i32 sums
    /// start on VNNI (the unsigned inputs' offset, taken away).
    starts: Arc<Vec<i32>>,
    n: usize,
    k: usize,
    /// What its products run on ([`Int8Isa::best`] when packed; none on a CPU without either).
    isa: Option<Int8Isa>,
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
            isa: Int8Isa::best(),
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
            isa: self.isa,
        })
    }

    /// The same weight, its products run on `isa` (tests and measurements of one kernel); an
    /// error where this CPU lacks it.
    pub fn on(self, isa: Int8Isa) -> Result<Self> {
        if !isa.available() {
            bail!("int8-linear: this CPU has no {isa:?}")
        }
        Ok(Self {
            isa: Some(isa),
            ..self
        })
    }

    /// `x · Wᵀ` for `x: [.., k]` (CPU, f32), in f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.apply_op1_no_bwd(self)
    }

    /// `x`'s rows quantized for `isa`: `[m][k blocks × QUADS]` groups of four `q + offset`
    /// bytes ([`Int8Isa::offset`]; past k, 0 as such a byte) and `[m][k blocks]` scales.
    ///
    /// # Safety
    /// The CPU has `isa`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn quantize_rows(&self, x: &[f32], isa: Int8Isa) -> (Vec<u32>, Vec<f32>, usize) {
        let k = self.k;
        let m = x.len() / k;
        let blocks = k.div_ceil(BLOCK);
        let zero = u32::from_ne_bytes([isa.offset() as u8; 4]);
        let mut a = vec![zero; m * blocks * QUADS];
        let mut scales = vec![0f32; m * blocks];
        a.par_chunks_mut(blocks * QUADS)
            .zip(scales.par_chunks_mut(blocks))
            .zip(x.par_chunks(k))
            .for_each(|((a, scales), row)| {
                for (blk, v) in row.chunks(BLOCK).enumerate() {
                    let out = &mut a[blk * QUADS..][..QUADS];
                    // SAFETY: the CPU has `isa` (this fn's contract).
                    scales[blk] = unsafe {
                        match isa {
                            Int8Isa::Avx512Vnni => vnni::quantize_input_block(v, out),
                            Int8Isa::Avx2 => avx2::quantize_input_block(v, out),
                        }
                    };
                }
            });
        (a, scales, m)
    }
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
        let Some(isa) = self.isa else {
            bail!("int8-linear: this CPU has neither AVX-512 VNNI nor AVX2")
        };
        let CpuStorage::F32(v) = s else {
            bail!("int8-linear: unsupported input dtype {:?}", s.dtype())
        };
        let Some((start, end)) = l.contiguous_offsets() else {
            bail!("int8-linear: the input must be contiguous")
        };
        let out = self.matmul(&v[start..end], isa);
        let mut shape = dims.to_vec();
        *shape.last_mut().expect("checked above") = self.n;
        Ok((CpuStorage::F32(out), Shape::from(shape)))
    }
}

impl PackedInt8 {
    /// `x` (rows of k) times the packed weight, in f32, on `isa` ([`column_tiles`]).
    #[cfg(target_arch = "x86_64")]
    fn matmul(&self, x: &[f32], isa: Int8Isa) -> Vec<f32> {
        let (n, kb) = (self.n, self.k.div_ceil(BLOCK));
        // SAFETY: `isa` is this CPU's (`PackedInt8::isa` is only ever an available one).
        let (a, a_scales, m) = unsafe { self.quantize_rows(x, isa) };
        // Column block `b`, rows `r0..r0 + r`.
        let tile = |b: usize, r0: usize, r: usize, c: *mut f32| Tile {
            w: Weights {
                data: &self.data[b * kb * QUADS * COLS * 4..][..kb * QUADS * COLS * 4],
                scales: &self.scales[b * COLS..][..COLS],
                starts: &self.starts[b * kb * COLS..][..kb * COLS],
                cols: COLS.min(n - b * COLS),
            },
            a: &a[r0 * kb * QUADS..][..r * kb * QUADS],
            s: &a_scales[r0 * kb..][..r * kb],
            c,
            n,
            kb,
        };
        // SAFETY (both arms): the CPU has `isa`; each tile's `a` and `s` hold its rows, `w` the
        // block's `kb` blocks, `c` its rows of `w.cols` floats (`column_tiles`), as the tiles
        // store them.
        match isa {
            Int8Isa::Avx512Vnni => unsafe {
                column_tiles(m, n, vnni::TILE, BLOCKS_PER_TASK, |b, r0, r, c| {
                    vnni::tile_rows(&tile(b, r0, r, c), r)
                })
            },
            Int8Isa::Avx2 => unsafe {
                column_tiles(m, n, avx2::TILE, BLOCKS_PER_TASK, |b, r0, r, c| {
                    avx2::tile_rows(&tile(b, r0, r, c), r)
                })
            },
        }
    }

    /// Elsewhere no [`Int8Isa`] is available and `cpu_fwd` refuses before this.
    #[cfg(not(target_arch = "x86_64"))]
    fn matmul(&self, _: &[f32], _: Int8Isa) -> Vec<f32> {
        unreachable!("int8-linear runs on x86-64 only")
    }
}

/// A micro-tile's operands: a column block of the weight, its rows' quantized inputs and their
/// scales, and where its outputs go.
#[cfg(target_arch = "x86_64")]
struct Tile<'a> {
    w: Weights<'a>,
    /// The rows' `kb` quantized blocks each ([`QUADS`] words a block).
    a: &'a [u32],
    /// The rows' `kb` scales each.
    s: &'a [f32],
    /// The tile's first output (rows `n` floats apart).
    c: *mut f32,
    n: usize,
    /// Input blocks a row.
    kb: usize,
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
