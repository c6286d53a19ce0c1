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
