//! Whole rows picked by index ([`gather_rows`]): the prefix cache copied once per branch; and
//! picked rows each followed by rows of their own ([`gather_cat`]): a branch's attention keys.
//! candle's CUDA `index_select` finds every element's source with 64-bit divisions; whole rows
//! can move as 16-byte words, a few times faster on the 4B model's f32 recurrent states.

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "metal")]
mod metal;

use candle_core::{bail, CustomOp2, CustomOp3, DType, Device, Result, Tensor};
#[cfg(any(feature = "cuda", feature = "metal"))]
use candle_core::{Layout, Shape};

use crate::dispatch::{self, backend, counted_cat, Backend, CountedTensor};

/// Row indices, checked and uploaded once for any number of [`gather_rows`] calls.
#[derive(Clone)]
pub struct RowIndex {
    /// `[N]` u32 on the device.
    idx: Tensor,
    /// The largest index, checked against each source's row count.
    max: Option<usize>,
}

impl RowIndex {
    /// Uploads `rows` to `device`.
    pub fn new(rows: &[usize], device: &Device) -> Result<Self> {
        let idx = rows
            .iter()
            .map(|&r| u32::try_from(r))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| {
                candle_core::Error::Msg(format!("gather-rows: row index over u32 in {rows:?}"))
            })?;
        Ok(Self {
            idx: crate::uploads::upload(idx, rows.len(), device)?,
            max: rows.iter().copied().max(),
        })
    }

    /// Number of rows picked.
    pub fn len(&self) -> usize {
        self.idx.elem_count()
    }

    /// The indices, `[N]` u32 on the device.
    pub(crate) fn tensor(&self) -> &Tensor {
        &self.idx
    }

    /// Whether no row is picked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fails when a row picked is not one of `t`'s `src_rows` (its first dim).
    pub(crate) fn check_within(&self, op: &str, t: &Tensor, src_rows: usize) -> Result<()> {
        if let Some(max) = self.max.filter(|&m| m >= src_rows) {
            bail!(
                "{op}: row {max} of a tensor with {src_rows} rows ({:?})",
                t.dims()
            )
        }
        Ok(())
    }
}

/// Whether the CUDA word kernels can copy `t`'s rows of `row_bytes` bytes: a CUDA float tensor,
/// contiguous, starting and breaking rows on 16-byte boundaries (CUDA: [`backend`]'s).
fn in_words(t: &Tensor, row_bytes: usize) -> bool {
    backend(t.device()) == Backend::Cuda
        && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && t.is_contiguous()
        && (t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(16)
        && row_bytes.is_multiple_of(16)
}

/// Whether the Metal kernels copy `t`'s rows of `row_bytes` bytes: a Metal float tensor,
/// contiguous, rows of whole 2-byte units (Metal: [`backend`]'s).
fn on_metal(t: &Tensor, row_bytes: usize) -> bool {
    backend(t.device()) == Backend::Metal
        && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && t.is_contiguous()
        && row_bytes.is_multiple_of(2)
}

/// The CUDA and Metal op; the CPU takes `index_select`.
struct GatherRows;

impl CustomOp2 for GatherRows {
    fn name(&self) -> &'static str {
        "gather-rows"
    }

    cuda_only_cpu_fwd!("gather-rows: the CPU takes index_select", _a _la, _b _lb);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ts: &candle_core::CudaStorage,
        tl: &Layout,
        is: &candle_core::CudaStorage,
        il: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let mut dims = tl.dims().to_vec();
        dims[0] = il.dims()[0];
        Ok((cuda::gather_rows(ts, tl, is, il)?, Shape::from(dims)))
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        ts: &candle_core::MetalStorage,
        tl: &Layout,
        is: &candle_core::MetalStorage,
        il: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        let mut dims = tl.dims().to_vec();
        dims[0] = il.dims()[0];
        Ok((metal::gather_rows(ts, tl, is, il)?, Shape::from(dims)))
    }
}

/// Rows `rows` of `t: [R, ..]` (repeats allowed) as a new `[N, ..]` tensor with storage of its
/// own, like `t.index_select(idx, 0)`. On CUDA a row moves as 16-byte words when its size and
/// start allow it (the cache tensors' always do); on Metal as 4- or 2-byte units (a float
/// tensor, contiguous); otherwise, and on the CPU, this is `index_select`.
pub fn gather_rows(t: &Tensor, rows: &RowIndex) -> Result<Tensor> {
    let src_rows = t.dims().first().copied().unwrap_or(0);
    rows.check_within("gather-rows", t, src_rows)?;
    let row_bytes = t
        .elem_count()
        .checked_div(src_rows)
        .map_or(0, |elems| elems * t.dtype().size_in_bytes());
    let fused = (in_words(t, row_bytes) && (1..=65535).contains(&rows.len()))
        || (on_metal(t, row_bytes) && !rows.is_empty());
    if row_bytes > 0 && fused {
        dispatch::launch(
            "gather-rows",
            1,
            t.device(),
            || t.apply_op2_no_bwd(&rows.idx, &GatherRows),
            || t.index_select(&rows.idx, 0),
        )
    } else {
        t.counted_index_select(&rows.idx, 0)
    }
}

/// The CUDA and Metal op of [`gather_cat`]; the CPU composes it.
struct GatherCat;

impl CustomOp3 for GatherCat {
    fn name(&self) -> &'static str {
        "gather-cat"
    }

    cuda_only_cpu_fwd!("gather-cat: the CPU composes index_select and cat", _a _la, _b _lb, _c _lc);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
        is: &candle_core::CudaStorage,
        il: &Layout,
        ts: &candle_core::CudaStorage,
        tl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (_, heads, s_len, d) = sl.shape().dims4()?;
        let (n, _, t_len, _) = tl.shape().dims4()?;
        let out = cuda::gather_cat(ss, sl, is, il, ts, tl)?;
        Ok((out, Shape::from((n, heads, s_len + t_len, d))))
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        ss: &candle_core::MetalStorage,
        sl: &Layout,
        is: &candle_core::MetalStorage,
        il: &Layout,
        ts: &candle_core::MetalStorage,
        tl: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        let (_, heads, s_len, d) = sl.shape().dims4()?;
        let (n, _, t_len, _) = tl.shape().dims4()?;
        let out = metal::gather_cat(ss, sl, is, il, ts, tl)?;
        Ok((out, Shape::from((n, heads, s_len + t_len, d))))
    }
}

/// Rows `rows` of `src: [R, H, S, d]`, row i followed by row i of `tail: [B, H, T, d]` along the
/// steps: `[B, H, S + T, d]`, equal to `cat([gather_rows(src, rows), tail], 2)`. Attention's
/// keys and values of a branch row: its state row's, then its own. On CUDA (16-byte words, where
/// both parts' rows allow them) and Metal (contiguous float tensors) one copy instead of two.
pub fn gather_cat(src: &Tensor, rows: &RowIndex, tail: &Tensor) -> Result<Tensor> {
    let (src_rows, heads, s_len, d) = src.dims4()?;
    let (n, t_heads, t_len, t_d) = tail.dims4()?;
    if (t_heads, t_d) != (heads, d) || n != rows.len() || src.dtype() != tail.dtype() {
        bail!(
            "gather-cat: {} rows of {:?} ({:?}) cannot head a tail of {:?} ({:?})",
            rows.len(),
            src.dims(),
            src.dtype(),
            tail.dims(),
            tail.dtype()
        )
    }
    rows.check_within("gather-cat", src, src_rows)?;
    let row_bytes = |steps: usize| steps * d * src.dtype().size_in_bytes();
    let cuda = in_words(src, row_bytes(s_len))
        && in_words(tail, row_bytes(t_len))
        && (1..=65535).contains(&(n * heads));
    let metal = on_metal(src, row_bytes(s_len)) && on_metal(tail, row_bytes(t_len)) && n > 0;
    if (s_len + t_len) * d > 0 && (cuda || metal) {
        dispatch::launch(
            "gather-cat",
            1,
            src.device(),
            || src.apply_op3_no_bwd(&rows.idx, tail, &GatherCat),
            || Tensor::cat(&[&gather_rows(src, rows)?, tail], 2),
        )
    } else {
        counted_cat(&[&gather_rows(src, rows)?, tail], 2)
    }
}
