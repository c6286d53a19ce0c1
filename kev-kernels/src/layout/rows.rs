//! Row views: the elementwise ops read `[rows, cols]` slices of wider tensors (one part of a
//! merged projection) in place instead of copying them out first.

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Layout, Result, Tensor};

use crate::dispatch::CountedTensor;

/// A `[rows, cols]` view of a storage: row r starts at `offset + r·stride`, columns are contiguous.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowView {
    pub(crate) offset: usize,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) stride: usize,
}

impl RowView {
    /// The view of `l` with its last dim as columns, or `None` when the leading dims do not
    /// collapse into evenly spaced rows.
    pub(crate) fn of(l: &Layout) -> Option<Self> {
        let (dims, strides) = (l.dims(), l.stride());
        let (&cols, lead) = dims.split_last()?;
        if cols > 1 && strides[dims.len() - 1] != 1 {
            return None;
        }
        // Size-1 dims have no meaningful stride; the others must nest exactly.
        let spans: Vec<(usize, usize)> = lead
            .iter()
            .zip(strides)
            .filter(|(&d, _)| d > 1)
            .map(|(&d, &s)| (d, s))
            .collect();
        let stride = spans.last().map_or(cols, |&(_, s)| s);
        if stride < cols || spans.windows(2).any(|w| w[0].1 != w[1].0 * w[1].1) {
            return None;
        }
        Some(Self {
            offset: l.start_offset(),
            rows: lead.iter().product(),
            cols,
            stride,
        })
    }

    /// The storage range the view touches.
    #[cfg_attr(not(any(feature = "cuda", feature = "metal")), allow(dead_code))]
    pub(crate) fn span(&self) -> std::ops::Range<usize> {
        let len = if self.rows == 0 {
            0
        } else {
            (self.rows - 1) * self.stride + self.cols
        };
        self.offset..self.offset + len
    }

    /// The view's elements as f32, packed `[rows, cols]`: borrowed when they already are (f32
    /// rows with no gap between them), else copied.
    pub(crate) fn read_f32<'a>(&self, s: &'a CpuStorage, what: &str) -> Result<Cow<'a, [f32]>> {
        fn pack<T: Copy>(v: &[T], r: &RowView, f: impl Fn(T) -> f32) -> Vec<f32> {
            let mut out = Vec::with_capacity(r.rows * r.cols);
            for i in 0..r.rows {
                out.extend(v[r.offset + i * r.stride..][..r.cols].iter().map(|&x| f(x)));
            }
            out
        }
        Ok(match s {
            CpuStorage::F32(v) if self.stride == self.cols || self.rows <= 1 => {
                Cow::Borrowed(&v[self.offset..][..self.rows * self.cols])
            }
            CpuStorage::F32(v) => Cow::Owned(pack(v, self, |x| x)),
            CpuStorage::BF16(v) => Cow::Owned(pack(v, self, |x| x.to_f32())),
            CpuStorage::F16(v) => Cow::Owned(pack(v, self, |x| x.to_f32())),
            other => bail!("{what}: unsupported dtype {:?}", other.dtype()),
        })
    }
}

/// `t` itself when it is a row view, else a contiguous copy.
pub(crate) fn as_row_view(t: &Tensor) -> Result<Tensor> {
    if RowView::of(t.layout()).is_some() {
        Ok(t.clone())
    } else {
        t.counted_contiguous()
    }
}

/// The view of `l`, as an error when it is not one (the wrappers made sure it is).
pub(crate) fn row_view(l: &Layout, what: &str) -> Result<RowView> {
    match RowView::of(l) {
        Some(r) => Ok(r),
        None => bail!("{what}: expected evenly spaced rows, got {l:?}"),
    }
}

/// Rounds through a dtype the way storing and reloading would. A copyable tag whose method is
/// always inlined (not a function pointer), so that each loop's optimizer compiles one loop per
/// dtype, unswitched on the tag, and vectorises it.
#[derive(Clone, Copy)]
pub(crate) enum Rounder {
    Bf16,
    F16,
    Exact,
}

impl Rounder {
    /// `v` rounded to the dtype.
    #[inline(always)]
    pub(crate) fn round(self, v: f32) -> f32 {
        match self {
            Rounder::Bf16 => half::bf16::from_f32(v).to_f32(),
            Rounder::F16 => half::f16::from_f32(v).to_f32(),
            Rounder::Exact => v,
        }
    }
}

/// The rounding of `dtype`.
pub(crate) fn rounder(dtype: candle_core::DType) -> Rounder {
    match dtype {
        candle_core::DType::BF16 => Rounder::Bf16,
        candle_core::DType::F16 => Rounder::F16,
        _ => Rounder::Exact,
    }
}

/// `Σ a²` over `v` in f64 (the norms' mean square), in eight independent sums so that the
/// additions pipeline and vectorise rather than wait on one another.
pub(crate) fn sum_of_squares(v: &[f32]) -> f64 {
    let mut acc = [0f64; 8];
    let chunks = v.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += f64::from(x * x);
        }
    }
    for (a, &x) in acc.iter_mut().zip(rest) {
        *a += f64::from(x * x);
    }
    acc.iter().sum()
}

/// Offset and the three leading strides of a 4-d layout whose last dim is contiguous.
pub(crate) fn strided4(l: &Layout, what: &str) -> Result<(usize, [usize; 3])> {
    let s = l.stride();
    if l.dims().len() != 4 || (l.dims()[3] > 1 && s[3] != 1) {
        bail!("{what}: expected a 4-d view with a contiguous last dim, got {l:?}")
    }
    Ok((l.start_offset(), [s[0], s[1], s[2]]))
}

/// A whole storage as f32 (a strided view indexes into it with its own offsets).
pub(crate) fn whole_f32<'a>(s: &'a CpuStorage, what: &str) -> Result<std::borrow::Cow<'a, [f32]>> {
    use std::borrow::Cow;
    Ok(match s {
        CpuStorage::F32(v) => Cow::Borrowed(v.as_slice()),
        CpuStorage::BF16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
        CpuStorage::F16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
        other => bail!("{what}: unsupported dtype {:?}", other.dtype()),
    })
}
