//! The int8 product on AVX-512 VNNI: `vpdpbusd` sums four u8 · i8 products into each i32 lane,
//! the inputs fed as `q + 128` bytes, so each block's sums start at `−128 · Σ q_w`
//! ([`PackedInt8`](super::PackedInt8)'s `starts`).

use std::arch::x86_64::*;

use super::{negligible, quantize_short_block, Tile, BLOCK, QUADS};
use crate::cpu_tiles::{store_row, COLS};

/// Rows of the input per micro-tile: 2 × 6 i32 and 2 × 6 f32 accumulators of the 32 registers.
pub(super) const TILE: usize = 6;

/// [`quantize_block`](super::quantize_block) of an input block `v` (≤ [`BLOCK`] values),
/// written as `q + 128` bytes to `out` (its groups of four; past `v`'s end left as they are).
///
/// # Safety
/// The CPU has AVX-512 F and BW.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn quantize_input_block(v: &[f32], out: &mut [u32]) -> f32 {
    let bytes = out.as_mut_ptr().cast::<u8>();
    if v.len() < BLOCK {
        return quantize_short_block(v, bytes, 128);
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
    if negligible(amax) {
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

/// [`tile`] of `rows` (1..=[`TILE`]) rows.
///
/// # Safety
/// As [`tile`]'s.
pub(super) unsafe fn tile_rows(t: &Tile, rows: usize) {
    match rows {
        6 => tile::<6>(t),
        5 => tile::<5>(t),
        4 => tile::<4>(t),
        3 => tile::<3>(t),
        2 => tile::<2>(t),
        _ => tile::<1>(t),
    }
}

/// R rows × 32 columns: per block of inputs, the exact i32 sums of the block's products
/// (`vpdpbusd` over its groups of four, from the block's start, the unsigned offset taken
/// away), scaled by the input block's scale into f32 accumulators; then, times the columns'
/// scales, the first `w.cols` columns stored at `c` (row pitch `n`).
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; `t.a` holds R rows of `kb × QUADS` groups, `t.s` R rows
/// of `kb` scales, `t.w` `kb` blocks, and `t.c` R rows of `w.cols` floats.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile<const R: usize>(t: &Tile) {
    let Tile { w, a, s, c, n, kb } = t;
    let (c, n, kb) = (*c, *n, *kb);
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
