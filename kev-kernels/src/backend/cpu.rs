//! Small helpers shared by the CPU implementations: reading any float storage as f32 and
//! writing results back in the caller's dtype.

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result};

/// The elements of a contiguous float storage as f32 (borrowed when it already is f32).
pub(crate) fn as_f32<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<Cow<'a, [f32]>> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("{what}: input must be contiguous")
    };
    Ok(match s {
        CpuStorage::F32(v) => Cow::Borrowed(&v[start..end]),
        CpuStorage::BF16(v) => Cow::Owned(v[start..end].iter().map(|x| x.to_f32()).collect()),
        CpuStorage::F16(v) => Cow::Owned(v[start..end].iter().map(|x| x.to_f32()).collect()),
        other => bail!("{what}: unsupported dtype {:?}", other.dtype()),
    })
}

/// Wraps f32 results into a storage of `dtype` (rounding once).
pub(crate) fn from_f32(v: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(v),
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(half::bf16::from_f32).collect()),
        DType::F16 => CpuStorage::F16(v.into_iter().map(half::f16::from_f32).collect()),
        other => bail!("unsupported output dtype {other:?}"),
    })
}

/// `x · sigmoid(x)` = `x / (1 + e^−x)` over `v`, in place: the SiLU of the SwiGLU, the conv and
/// the gated norm. With AVX2 and FMA, eight lanes at a time with [`exp8`]; `f32::exp` elsewhere
/// and for the tail. Element by element, the scalar `exp` calls were ~9 % of a CPU request.
pub(crate) fn silu_in_place(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has both features (checked just above).
        unsafe { silu_avx2(v) };
        return;
    }
    v.iter_mut().for_each(|x| *x = silu(*x));
}

/// The scalar SiLU, as the CPU ops computed it before [`silu_in_place`].
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_avx2(v: &mut [f32]) {
    use std::arch::x86_64::*;
    let one = _mm256_set1_ps(1.0);
    // Below this, e^−x overflows f32 and the scalar SiLU is −0; the clamped exp8 would leave
    // x / 2e38 instead, far from 0 for huge |x|.
    let overflow = _mm256_set1_ps(-88.72);
    let mut chunks = v.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: `c` holds 8 f32s; unaligned loads and stores.
        let x = _mm256_loadu_ps(c.as_ptr());
        let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
        let y = _mm256_div_ps(x, _mm256_add_ps(one, e));
        let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, overflow);
        let y = _mm256_blendv_ps(y, _mm256_mul_ps(x, _mm256_setzero_ps()), under);
        _mm256_storeu_ps(c.as_mut_ptr(), y);
    }
    chunks
        .into_remainder()
        .iter_mut()
        .for_each(|x| *x = silu(*x));
}

/// e^x on eight lanes (Cephes' `expf`: x = n·ln 2 + r with ln 2 split in two, a degree-6
/// polynomial in r, then 2^n from the exponent bits), within 2 ulp of `f32::exp` on
/// [−87.3, 88.3]. Inputs are clamped there first: beyond, `f32::exp` gives 0 or ∞ where this
/// gives the range's ends (≈ 1e-38 and 2e38; [`silu_avx2`] treats the overflowing side itself).
/// NaN stays NaN (the clamps keep their second operand, the input, when it is NaN).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp8(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let x = _mm256_max_ps(
        _mm256_set1_ps(-87.336_54),
        _mm256_min_ps(_mm256_set1_ps(88.376_26), x),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let p = _mm256_fmadd_ps(
        _mm256_mul_ps(p, r),
        r,
        _mm256_add_ps(r, _mm256_set1_ps(1.0)),
    );
    let two_n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    )));
    _mm256_mul_ps(p, two_n)
}

#[cfg(test)]
mod tests {
    use super::{silu, silu_in_place};

    #[test]
    fn vector_silu_matches_scalar() {
        // A sweep over the range that matters, both tails, the clamp's edges, and odd lengths
        // (the scalar tail).
        let mut xs: Vec<f32> = (-40_000..=40_000).map(|i| i as f32 * 1e-3).collect();
        xs.extend([
            -1e4, -200.0, -88.5, -87.4, -87.0, 87.0, 88.3, 88.5, 200.0, 1e4, 0.0, -0.0,
        ]);
        xs.extend([f32::MIN_POSITIVE, -f32::MIN_POSITIVE, 1e-30, -1e-30, 3.0]);
        let mut got = xs.clone();
        silu_in_place(&mut got);
        for (&x, &g) in xs.iter().zip(&got) {
            let want = silu(x);
            let tol = 4.0 * f32::EPSILON * want.abs() + 1e-36;
            assert!((g - want).abs() <= tol, "silu({x}) = {g}, scalar {want}");
        }
        let specials = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -1e38,
            -f32::MAX,
            1e38,
        ];
        let mut got: Vec<f32> = specials.iter().chain(&[1.0, 2.0]).copied().collect();
        silu_in_place(&mut got);
        for (&x, &g) in specials.iter().zip(&got) {
            let want = silu(x);
            assert!(
                g == want || (g.is_nan() && want.is_nan()),
                "silu({x}) = {g}, scalar {want}"
            );
        }
    }
}
