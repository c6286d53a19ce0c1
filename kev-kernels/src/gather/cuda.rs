//! Row gathers on CUDA (`gather.cu`): whole 16-byte words, any dtype.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, Layout, Result};

use crate::backend::cuda::kernel::{contiguous, Kernel};
use crate::backend::cuda::sources::GATHER;

/// Rows of 16-byte words (gather.rs checked the sizes, the alignment and the indices).
pub(crate) fn gather_rows(
    ts: &CudaStorage,
    tl: &Layout,
    is: &CudaStorage,
    il: &Layout,
) -> Result<CudaStorage> {
    let k = Kernel::load(&GATHER, ts.device(), "gather_rows16")?;
    let (t0, t1) = contiguous(tl, "gather-rows input")?;
    let (i0, i1) = contiguous(il, "gather-rows index")?;
    let (src_rows, n) = (tl.dims()[0], i1 - i0);
    let row_elems = (t1 - t0) / src_rows.max(1);
    let units = row_elems * ts.dtype().size_in_bytes() / 16;
    let idx = is.as_cuda_slice::<u32>()?.slice(i0..i1);
    let (units_, rows_) = (units as i64, src_rows as i32);
    let cfg = LaunchConfig {
        grid_dim: (units.div_ceil(256).clamp(1, 1024) as u32, n as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    by_dtype!(ts.dtype(), "gather-rows", |T| {
        let src = ts.as_cuda_slice::<T>()?.slice(t0..t1);
        let out = k.output::<T>(n * row_elems)?;
        let mut b = k.stream.launch_builder(&k.func);
        b.arg(&src).arg(&idx).arg(&out).arg(&units_).arg(&rows_);
        // SAFETY: argument types and order match `gather_rows16` in gather.cu; rows are whole
        // 16-byte words and n ≤ 65535 (the wrapper checked), the grid strides over a row.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}

/// `gather_cat16`: `src` `[R, H, S, d]` rows picked by `is`, each followed by its `tail`
/// `[B, H, T, d]` row along the steps: `[B, H, S + T, d]`.
pub(crate) fn gather_cat(
    ss: &CudaStorage,
    sl: &Layout,
    is: &CudaStorage,
    il: &Layout,
    ts: &CudaStorage,
    tl: &Layout,
) -> Result<CudaStorage> {
    let k = Kernel::load(&GATHER, ss.device(), "gather_cat16")?;
    let (s0, s1) = contiguous(sl, "gather-cat source")?;
    let (i0, i1) = contiguous(il, "gather-cat index")?;
    let (t0, t1) = contiguous(tl, "gather-cat tail")?;
    let (src_rows, heads, s_len, d) = sl.shape().dims4()?;
    let (n, _, t_len, _) = tl.shape().dims4()?;
    let size = ss.dtype().size_in_bytes();
    let (us, ut) = (s_len * d * size / 16, t_len * d * size / 16);
    let idx = is.as_cuda_slice::<u32>()?.slice(i0..i1);
    let (heads_, us_, ut_, rows_) = (heads as i32, us as i64, ut as i64, src_rows as i32);
    let cfg = LaunchConfig {
        grid_dim: (
            (us + ut).div_ceil(256).clamp(1, 1024) as u32,
            (n * heads) as u32,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    by_dtype!(ss.dtype(), "gather-cat", |T| {
        let src = ss.as_cuda_slice::<T>()?.slice(s0..s1);
        let tail = ts.as_cuda_slice::<T>()?.slice(t0..t1);
        let out = k.output::<T>(n * heads * (s_len + t_len) * d)?;
        let mut b = k.stream.launch_builder(&k.func);
        b.arg(&src).arg(&idx).arg(&tail).arg(&out);
        b.arg(&heads_).arg(&us_).arg(&ut_).arg(&rows_);
        // SAFETY: argument types and order match `gather_cat16` in gather.cu; both parts are whole
        // 16-byte words and n·heads ≤ 65535 (the wrapper checked), the grid strides over a row.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}
