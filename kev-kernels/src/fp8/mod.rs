//! FP8 products on Hopper: `x · Wᵀ` with `W` in e4m3, one f32 scale per 128 × 128 block (the
//! layout of Qwen's and DeepSeek's FP8 releases), and `x` quantized at each product to e4m3
//! with one f32 scale per token and block of 128 inputs, multiplied on FP8 tensor cores by
//! cuBLASLt's block-scaled matmul (cuBLAS 12.9 and later, compute capability 9.0 only), f32
//! accumulation, bf16 out.
//!
//! The weights are quantized here on the CPU from f32 (a checkpoint's weights with their LoRA
//! folded), so an FP8 base's weights are quantized again after the fold: the folded weight is
//! not the stored one. Scales are `amax / 448` per block (`448`: e4m3's largest finite value),
//! values rounded to nearest even and saturated, as `cvt.rn.satfinite.e4m3x2.f32` does.
//! [`fp8_linear_ref`] is the same product in f32 on the CPU, for the tests.

#[cfg(feature = "cuda")]
mod cuda;

use candle_core::{bail, DType, Device, Result, Tensor};
use rayon::prelude::*;

/// The side of a weight block and the length of an activation block.
pub const FP8_BLOCK: usize = crate::backend::cuda::sources::FP8_BLOCK;
/// e4m3's largest finite magnitude.
const E4M3_MAX: f32 = 448.0;
/// cuBLASLt reads a weight's scales in rows of a multiple of this many blocks.
const SCALE_ROW_MULTIPLE: usize = 4;

/// The e4m3 (`fn`: no infinities, one NaN per sign) byte nearest `x`: round to nearest even,
/// magnitudes past 448 saturated to 448, NaN to NaN. From the f32's bits: a load quantizes
/// every projection weight through it.
pub fn e4m3_from_f32(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let a = bits & 0x7fff_ffff;
    if a > 0x7f80_0000 {
        return 0x7f | sign;
    }
    if a >= E4M3_MAX.to_bits() {
        return 0x7e | sign;
    }
    if a < MIN_NORMAL.to_bits() {
        // Subnormal: units of 2⁻⁹ (scaling by a power of two is exact); 8 units is the
        // smallest normal, 0x08.
        return (f32::from_bits(a) * 512.0).round_ties_even() as u8 | sign;
    }
    // Three mantissa bits kept, the 20 dropped rounded to nearest even (a carry moves the
    // exponent); the exponent rebiased from 127 to 7.
    let rounded = a + 0x7_ffff + ((a >> 20) & 1);
    let exp = (rounded >> 23) - 127 + 7;
    let bits = ((exp << 3) | ((rounded >> 20) & 7)) as u8;
    bits.min(0x7e) | sign
}

/// e4m3's smallest normal magnitude, 2⁻⁶.
const MIN_NORMAL: f32 = 0.015625;

/// The value of the e4m3 byte `b`.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, man) = (((b >> 3) & 0xf) as i32, (b & 7) as f32);
    if exp == 0xf && b & 7 == 7 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        man * 2f32.powi(-9)
    } else {
        (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    };
    sign * magnitude
}

/// The scale of a block whose largest magnitude is `amax`: its values divided by it fill
/// e4m3's range. An all-zero block (or one too small for an f32 scale) gets 1; an infinite
/// one an infinite scale, which makes its values NaN.
fn block_scale(amax: f32) -> f32 {
    let scale = amax / E4M3_MAX;
    if scale > 0.0 {
        scale
    } else {
        1.0
    }
}

/// A weight `[n, k]` in e4m3 with its block scales, on its device.
#[derive(Clone)]
pub struct Fp8Weight {
    /// `[n, k]` u8, the e4m3 bytes.
    weight: Tensor,
    /// `[⌈n/128⌉, L]` f32: block (i, j)'s scale at `[i, j]`, rows padded to `L`, a multiple of
    /// four blocks (cuBLASLt's layout), with 1.
    scales: Tensor,
}

impl Fp8Weight {
    /// `w: [n, k]` (f32, on the CPU) quantized in 128 × 128 blocks, on `device`.
    pub fn quantize(w: &Tensor, device: &Device) -> Result<Self> {
        let (n, k) = w.dims2()?;
        if w.dtype() != DType::F32 {
            bail!("fp8 weight: expected f32 to quantize, got {:?}", w.dtype())
        }
        let values = w.flatten_all()?.to_vec1::<f32>()?;
        let (kb, nb) = (k.div_ceil(FP8_BLOCK), n.div_ceil(FP8_BLOCK));
        let row = kb.next_multiple_of(SCALE_ROW_MULTIPLE);
        let mut bytes = vec![0u8; n * k];
        let mut scales = vec![1f32; nb * row];
        bytes
            .par_chunks_mut(FP8_BLOCK * k.max(1))
            .zip(scales.par_chunks_mut(row))
            .enumerate()
            .for_each(|(i, (out, scale_row))| {
                let rows = out.len() / k.max(1);
                let source = &values[i * FP8_BLOCK * k..][..rows * k];
                for (j, scale) in scale_row.iter_mut().enumerate().take(kb) {
                    let cols = j * FP8_BLOCK..((j + 1) * FP8_BLOCK).min(k);
                    let amax = (0..rows)
                        .flat_map(|r| &source[r * k..][cols.clone()])
                        .fold(0f32, |m, v| m.max(v.abs()));
                    *scale = block_scale(amax);
                    for r in 0..rows {
                        for c in cols.clone() {
                            out[r * k + c] = e4m3_from_f32(source[r * k + c] / *scale);
                        }
                    }
                }
            });
        Ok(Self {
            weight: Tensor::from_vec(bytes, (n, k), device)?,
            scales: Tensor::from_vec(scales, (nb, row), device)?,
        })
    }

    /// `(n, k)`.
    pub fn dims(&self) -> (usize, usize) {
        self.weight.dims2().unwrap_or((0, 0))
    }

    /// Output features `start..start + len` as a weight of their own (views): `start` on a
    /// block boundary, and `len` too unless the rows reach the end.
    pub fn rows(&self, start: usize, len: usize) -> Result<Self> {
        let (n, _) = self.dims();
        if !start.is_multiple_of(FP8_BLOCK) || (!len.is_multiple_of(FP8_BLOCK) && start + len != n)
        {
            bail!(
                "fp8 weight: rows {start}..{} do not keep its 128-row blocks whole",
                start + len
            )
        }
        Ok(Self {
            weight: self.weight.narrow(0, start, len)?,
            scales: self
                .scales
                .narrow(0, start / FP8_BLOCK, len.div_ceil(FP8_BLOCK))?,
        })
    }

    /// The weight the products use, in f32 on the CPU: each byte's value times its block's
    /// scale.
    pub fn dequantized(&self) -> Result<Tensor> {
        let (n, k) = self.dims();
        let bytes = self.weight.flatten_all()?.to_vec1::<u8>()?;
        let scales = self.scales.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
        let values: Vec<f32> = bytes
            .iter()
            .enumerate()
            .map(|(i, &b)| e4m3_to_f32(b) * scales[i / k / FP8_BLOCK][i % k / FP8_BLOCK])
            .collect();
        Tensor::from_vec(values, (n, k), &Device::Cpu)
    }
}

/// Each row of `x: [m, k]` (f32) quantized in blocks of 128 inputs: the e4m3 bytes `[m, k]`
/// and the scales `[m, ⌈k/128⌉]`, as the CUDA kernel quantizes a product's input.
pub fn quantize_rows(x: &[f32], k: usize) -> (Vec<u8>, Vec<f32>) {
    let kb = k.div_ceil(FP8_BLOCK);
    let mut bytes = vec![0u8; x.len()];
    let mut scales = vec![0f32; x.len() / k.max(1) * kb];
    for (r, row) in x.chunks(k.max(1)).enumerate() {
        for (j, block) in row.chunks(FP8_BLOCK).enumerate() {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = block_scale(amax);
            scales[r * kb + j] = scale;
            for (c, v) in block.iter().enumerate() {
                bytes[r * k + j * FP8_BLOCK + c] = e4m3_from_f32(v / scale);
            }
        }
    }
    (bytes, scales)
}

/// `x · Wᵀ` for `x: [.., k]` (bf16) on a GPU that has FP8 products ([`fp8_available`]); `[.., n]`
/// in bf16.
pub fn fp8_linear(x: &Tensor, w: &Fp8Weight) -> Result<Tensor> {
    let (n, k) = w.dims();
    let dims = x.dims();
    if dims.last() != Some(&k) {
        bail!("fp8 linear: input {dims:?} does not end in the weight's {k} inputs")
    }
    let mut out_dims = dims.to_vec();
    *out_dims.last_mut().expect("checked above") = n;
    let rows = x.elem_count() / k.max(1);
    let x = x.contiguous()?.reshape((rows, k))?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = x.device() {
        return cuda::fp8_linear(dev, &x, w)?.reshape(out_dims);
    }
    bail!(
        "fp8 linear: FP8 products run on CUDA only, not on {:?}",
        x.device()
    )
}

/// What [`fp8_linear`] computes, in f32 on the CPU: `x` quantized per row ([`quantize_rows`])
/// and the weight dequantized, multiplied in f32. The GPU sums in another order and rounds
/// its output to bf16.
pub fn fp8_linear_ref(x: &Tensor, w: &Fp8Weight) -> Result<Tensor> {
    let (_, k) = w.dims();
    let x = x.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    let rows = x.elem_count() / k.max(1);
    let (bytes, scales) = quantize_rows(&x.flatten_all()?.to_vec1::<f32>()?, k);
    let kb = k.div_ceil(FP8_BLOCK);
    let values: Vec<f32> = bytes
        .iter()
        .enumerate()
        .map(|(i, &b)| e4m3_to_f32(b) * scales[i / k * kb + i % k / FP8_BLOCK])
        .collect();
    let xq = Tensor::from_vec(values, (rows, k), &Device::Cpu)?;
    xq.matmul(&w.dequantized()?.t()?)
}

/// Whether `device` runs FP8 products: a CUDA GPU of compute capability 9.0 (cuBLASLt's
/// block-scaled FP8 matmul runs there only).
pub fn fp8_available(device: &Device) -> bool {
    crate::backend::cuda::cuda_gpu(device).is_some_and(|g| g.compute_capability == (9, 0))
}

/// Runs one small FP8 product on `device` ([`fp8_available`] there): the error of the first
/// call where this process's cuBLASLt lacks the block-scaled FP8 matmul (cuBLAS 12.9 and later),
/// so a load can refuse the dtype rather than every forward fail.
pub fn fp8_check(device: &Device) -> Result<()> {
    let w = Fp8Weight::quantize(&Tensor::ones((8, 16), DType::F32, &Device::Cpu)?, device)?;
    let x = Tensor::ones((1, 16), DType::BF16, device)?;
    let y = fp8_linear(&x, &w)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    if y[0].iter().any(|&v| v != 16.0) {
        bail!("fp8 linear: a product of ones gave {:?}, not 16", y[0])
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every byte decodes and encodes back (NaN to NaN); every value between two neighbours
    /// rounds to the nearer, ties to the even byte; past 448 saturates.
    #[test]
    fn e4m3_rounds_to_nearest_even_and_saturates() {
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if v.is_nan() {
                assert_eq!(e4m3_from_f32(v) & 0x7f, 0x7f);
                continue;
            }
            if b == 0x80 {
                assert_eq!(e4m3_from_f32(-0.0), 0x80);
                continue;
            }
            assert_eq!(e4m3_from_f32(v), b, "{b:#x} = {v}");
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        for b in 0..0x7eu8 {
            let (lo, hi) = (e4m3_to_f32(b), e4m3_to_f32(b + 1));
            let mid = (lo + hi) / 2.0;
            let even = if b % 2 == 0 { b } else { b + 1 };
            assert_eq!(e4m3_from_f32(mid), even, "tie between {lo} and {hi}");
            assert_eq!(e4m3_from_f32(lo + (hi - lo) * 0.25), b);
            assert_eq!(e4m3_from_f32(lo + (hi - lo) * 0.75), b + 1);
            assert_eq!(e4m3_from_f32(-mid), even | 0x80);
        }
        assert_eq!(e4m3_from_f32(1e9), 0x7e);
        assert_eq!(e4m3_from_f32(f32::NEG_INFINITY), 0xfe);
        assert_eq!(
            e4m3_from_f32(2f32.powi(-11)),
            0,
            "below half the least subnormal"
        );
    }

    /// Against the nearest byte found by search (ties to the even byte), over magnitudes from
    /// below the least subnormal to past 448.
    #[test]
    fn e4m3_matches_the_nearest_byte() {
        let finite: Vec<(u8, f32)> = (0..0x7fu8).map(|b| (b, e4m3_to_f32(b))).collect();
        let nearest = |a: f32| {
            let mut best = (0u8, f32::MAX);
            for &(b, v) in &finite {
                let d = (v - a).abs();
                if d < best.1 || (d == best.1 && b % 2 == 0) {
                    best = (b, d);
                }
            }
            best.0
        };
        let mut state = 0x9e37_79b9u32;
        for i in 0..200_000 {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            // Exponents 2⁻¹² to 2⁹ and any mantissa.
            let a = f32::from_bits((state & 0x007f_ffff) | ((115 + (state >> 24) % 22) << 23));
            let x = if i % 2 == 0 { a } else { -a };
            let want = if a >= E4M3_MAX { 0x7e } else { nearest(a) };
            assert_eq!(e4m3_from_f32(x) & 0x7f, want, "{x}");
            assert_eq!(e4m3_from_f32(x) & 0x80, if i % 2 == 0 { 0 } else { 0x80 });
        }
    }

    /// A block's largest value maps to 448, so every value is within half a step of e4m3 of
    /// its block's range; the scales' rows are padded to four blocks; row views keep blocks.
    #[test]
    fn weights_quantize_per_block_within_half_a_step() {
        let (n, k) = (200, 300);
        let values: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * if i % 128 < 64 { 1e-3 } else { 5.0 })
            .collect();
        let w = Tensor::from_vec(values.clone(), (n, k), &Device::Cpu).unwrap();
        let q = Fp8Weight::quantize(&w, &Device::Cpu).unwrap();
        assert_eq!(q.scales.dims(), &[2, 4]);
        let back = q
            .dequantized()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let scales = q.scales.to_vec2::<f32>().unwrap();
        for (i, (&v, &b)) in values.iter().zip(&back).enumerate() {
            let s = scales[i / k / FP8_BLOCK][i % k / FP8_BLOCK];
            // e4m3 keeps 3 mantissa bits: relative error ≤ 2⁻⁴ above the subnormals.
            let bound = (v.abs() / 16.0).max(s * 2f32.powi(-10));
            assert!((v - b).abs() <= bound, "{i}: {v} -> {b} (scale {s})");
        }
        assert_eq!(scales[0][3], 1.0, "padding");
        let tail = q.rows(128, 72).unwrap();
        assert_eq!(tail.dims(), (72, k));
        assert_eq!(tail.scales.dims(), &[1, 4]);
        assert!(q.rows(64, 64).is_err());
    }

    /// The reference product is within e4m3's resolution of the f32 product: each term's
    /// factors within 2⁻⁴ of theirs (above the subnormals of their blocks).
    #[test]
    fn reference_product_is_within_e4m3_of_f32() {
        let (m, n, k) = (5, 130, 260);
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 31 % 97) as f32 - 48.0) / 17.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 13 % 89) as f32 - 44.0) / 50.0)
            .collect();
        let xt = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu).unwrap();
        let wt = Tensor::from_vec(w.clone(), (n, k), &Device::Cpu).unwrap();
        let q = Fp8Weight::quantize(&wt, &Device::Cpu).unwrap();
        let got = fp8_linear_ref(&xt, &q).unwrap().to_vec2::<f32>().unwrap();
        let want = xt
            .matmul(&wt.t().unwrap())
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let mut moved = false;
        for r in 0..m {
            for c in 0..n {
                let magnitude: f32 = (0..k).map(|i| (x[r * k + i] * w[c * k + i]).abs()).sum();
                let (a, b) = (got[r][c], want[r][c]);
                assert!(
                    (a - b).abs() <= magnitude / 7.0,
                    "[{r}, {c}]: {a} against {b}"
                );
                moved |= a != b;
            }
        }
        assert!(
            moved,
            "quantization changed nothing: the test checks nothing"
        );
    }
}
