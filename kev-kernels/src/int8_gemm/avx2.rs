//! The int8 product on AVX2: `vpmaddubsw` multiplies u8 by i8 bytes and sums each pair into an
//! i16, which `vpmaddwd` by ones sums into the i32 lane of a column's four products, the lane
//! `vpdpbusd` fills. Its unsigned operand is |q_x| and the weights take the inputs' signs
//! (`vpsignb`), so each pair is at most 2 · 127² and never saturates: the sums are the exact
//! ones of the VNNI kernel, and so are the outputs. Sixteen registers hold a tile of 16 columns
//! (a half block) of up to four rows.

use std::arch::x86_64::*;

use super::{negligible, quantize_short_block, Tile, BLOCK, QUADS};
use crate::cpu_tiles::COLS;

/// Rows of the input per micro-tile: 2 × 4 i32 sums of the 16 registers, besides the weights,
/// the input and the ones.
pub(super) const TILE: usize = 4;

/// [`quantize_block`](super::quantize_block) of an input block `v` (≤ [`BLOCK`] values),
/// written as `q` bytes to `out` (its groups of four; past `v`'s end left as they are).
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn quantize_input_block(v: &[f32], out: &mut [u32]) -> f32 {
    let bytes = out.as_mut_ptr().cast::<u8>();
    if v.len() < BLOCK {
        return quantize_short_block(v, bytes, 0);
    }
    let p = v.as_ptr();
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let (mut amax, mut poison) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for i in 0..BLOCK / 8 {
        let x = _mm256_loadu_ps(p.add(8 * i));
        amax = _mm256_max_ps(amax, _mm256_and_ps(x, abs));
        // x · 0 is NaN for an infinite or NaN x, which `max` would not keep.
        poison = _mm256_fmadd_ps(x, _mm256_setzero_ps(), poison);
    }
    let half = _mm_max_ps(
        _mm256_castps256_ps128(amax),
        _mm256_extractf128_ps::<1>(amax),
    );
    let half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    let amax = _mm_cvtss_f32(_mm_max_ss(half, _mm_shuffle_ps::<1>(half, half)));
    if _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(poison, poison)) != 0 {
        std::ptr::write_bytes(bytes, 0, BLOCK);
        return f32::NAN;
    }
    if negligible(amax) {
        std::ptr::write_bytes(bytes, 0, BLOCK);
        return 0.0;
    }
    let inv = _mm256_set1_ps(127.0 / amax);
    let (lo, hi) = (_mm256_set1_epi32(-127), _mm256_set1_epi32(127));
    let q = |i: usize| {
        // Rounded to nearest even (the default MXCSR mode), then clamped.
        let q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p.add(8 * i)), inv));
        _mm256_min_epi32(_mm256_max_epi32(q, lo), hi)
    };
    // Packing interleaves the 128-bit lanes: four-byte groups come out as q0 q1 q2 q3 of the
    // low halves, then of the high halves; the permutation puts them back in order.
    let words = _mm256_packs_epi32(q(0), q(1));
    let words2 = _mm256_packs_epi32(q(2), q(3));
    let packed = _mm256_packs_epi16(words, words2);
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256(bytes.cast(), _mm256_permutevar8x32_epi32(packed, order));
    amax / 127.0
}

/// [`tile`] of `rows` (1..=[`TILE`]) rows, each half block of 16 columns in turn.
///
/// # Safety
/// As [`tile`]'s.
pub(super) unsafe fn tile_rows(t: &Tile, rows: usize) {
    for half in 0..2 {
        if t.w.cols <= 16 * half {
            break;
        }
        match rows {
            4 => tile::<4>(t, half),
            3 => tile::<3>(t, half),
            2 => tile::<2>(t, half),
            _ => tile::<1>(t, half),
        }
    }
}

/// R rows × columns `16·half ..+16` of the block: per block of inputs, the exact i32 sums of
/// the block's products, scaled by the input block's scale into f32 sums; then, times the
/// columns' scales, those of the first `w.cols` columns stored at `c` (row pitch `n`).
///
/// # Safety
/// The CPU has AVX2 and FMA; `t.a` holds R rows of `kb × QUADS` groups, `t.s` R rows of `kb`
/// scales, `t.w` `kb` blocks, and `t.c` R rows of `w.cols` floats.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<const R: usize>(t: &Tile, half: usize) {
    let Tile { w, a, s, c, n, kb } = t;
    let (c, n, kb) = (*c, *n, *kb);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let rows = kb * QUADS;
    for blk in 0..kb {
        let wp = w.data.as_ptr().add(blk * QUADS * COLS * 4 + 64 * half);
        let ap = a.as_ptr().add(blk * QUADS);
        let mut sums = [[_mm256_setzero_si256(); 2]; R];
        for g in 0..QUADS {
            let b0 = _mm256_loadu_si256(wp.add(g * COLS * 4).cast());
            let b1 = _mm256_loadu_si256(wp.add(g * COLS * 4 + 32).cast());
            for (r, sums) in sums.iter_mut().enumerate() {
                let x = _mm256_set1_epi32(*ap.add(r * rows + g) as i32);
                let magnitude = _mm256_sign_epi8(x, x);
                let p0 = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(b0, x));
                let p1 = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(b1, x));
                sums[0] = _mm256_add_epi32(sums[0], _mm256_madd_epi16(p0, ones));
                sums[1] = _mm256_add_epi32(sums[1], _mm256_madd_epi16(p1, ones));
            }
        }
        for r in 0..R {
            let sa = _mm256_set1_ps(s[r * kb + blk]);
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][0]), sa, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][1]), sa, acc[r][1]);
        }
    }
    let sc = w.scales.as_ptr().add(16 * half);
    let (sc0, sc1) = (_mm256_loadu_ps(sc), _mm256_loadu_ps(sc.add(8)));
    let cols = (w.cols - 16 * half).min(16);
    for (r, acc) in acc.iter().enumerate() {
        let row = c.add(r * n + 16 * half);
        let (lo, hi) = (_mm256_mul_ps(acc[0], sc0), _mm256_mul_ps(acc[1], sc1));
        if cols == 16 {
            _mm256_storeu_ps(row, lo);
            _mm256_storeu_ps(row.add(8), hi);
        } else {
            let mut tmp = [0f32; 16];
            _mm256_storeu_ps(tmp.as_mut_ptr(), lo);
            _mm256_storeu_ps(tmp.as_mut_ptr().add(8), hi);
            std::ptr::copy_nonoverlapping(tmp.as_ptr(), row, cols);
        }
    }
}
