//! The norms on CUDA (`norm.cu`).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, Layout, Result};

use crate::backend::cuda::kernel::{contiguous, Kernel};
use crate::backend::cuda::sources::NORM;
use crate::layout::rows::row_view;

pub(crate) fn rms_norm(
    eps: f32,
    xs: &CudaStorage,
    xl: &Layout,
    residual: Option<(&CudaStorage, &Layout)>,
    ws: &CudaStorage,
    wl: &Layout,
) -> Result<CudaStorage> {
    let k = Kernel::for_dtype(&NORM, xs.device(), "rmsnorm", xs.dtype(), "rms-norm")?;
    let xv = row_view(xl, "rms-norm input")?;
    let (w0, w1) = contiguous(wl, "rms-norm weight")?;
    let w = ws.as_cuda_slice::<f32>()?.slice(w0..w1);
    let n_out = xv.rows * xv.cols * if residual.is_some() { 2 } else { 1 };
    // A thread per 16-byte vector of a row (the kernel's usual path: 8 values in 16 bits).
    let per_thread = 16 / xs.dtype().size_in_bytes();
    let block = (xv.cols.div_ceil(per_thread).next_multiple_of(32)).clamp(32, 1024) as u32;
    let cfg = LaunchConfig {
        grid_dim: (xv.rows as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    let hv = residual
        .map(|(_, l)| row_view(l, "rms-norm residual"))
        .transpose()?;
    by_dtype!(xs.dtype(), "rms-norm", |T| {
        let x = xs.as_cuda_slice::<T>()?.slice(xv.span());
        let out = k.output::<T>(n_out)?;
        let mut b = k.stream.launch_builder(&k.func);
        let (xs_, null) = (xv.stride as i64, 0u64);
        b.arg(&x).arg(&xs_);
        let h = match (residual, hv) {
            (Some((hs, _)), Some(hv)) => {
                Some((hs.as_cuda_slice::<T>()?.slice(hv.span()), hv.stride as i64))
            }
            _ => None,
        };
        match &h {
            Some((h, stride)) => b.arg(h).arg(stride),
            None => b.arg(&null).arg(&null),
        };
        let (rows_, cols_, eps) = (xv.rows as i32, xv.cols as i32, eps);
        b.arg(&w).arg(&out).arg(&rows_).arg(&cols_).arg(&eps);
        // SAFETY: argument types and order match `rmsnorm_*` in norm.cu; one block per row,
        // every index stays inside the views the layouts describe.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}

pub(crate) fn gated_rms_norm(
    eps: f32,
    xs: &CudaStorage,
    xl: &Layout,
    zs: &CudaStorage,
    zl: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
) -> Result<CudaStorage> {
    let k = Kernel::for_dtype(&NORM, xs.device(), "gnorm", xs.dtype(), "gated-rms-norm")?;
    let (x0, x1) = contiguous(xl, "gated-rms-norm input")?;
    let (w0, w1) = contiguous(wl, "gated-rms-norm weight")?;
    let zv = row_view(zl, "gated-rms-norm gate")?;
    let dv = w1 - w0;
    let groups = (x1 - x0) / dv;
    let heads = zv.cols / dv;
    // Half a warp per group (norm.cu): 16 groups per block of 8 warps.
    const WARPS_PER_BLOCK: usize = 8;
    let cfg = LaunchConfig {
        grid_dim: (groups.div_ceil(2 * WARPS_PER_BLOCK) as u32, 1, 1),
        block_dim: ((32 * WARPS_PER_BLOCK) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    by_dtype!(xs.dtype(), "gated-rms-norm", |T| {
        let x = xs.as_cuda_slice::<T>()?.slice(x0..x1);
        let z = zs.as_cuda_slice::<T>()?.slice(zv.span());
        let w = ws.as_cuda_slice::<T>()?.slice(w0..w1);
        let out = k.output::<T>(x1 - x0)?;
        let mut b = k.stream.launch_builder(&k.func);
        let ints = [groups as i32, heads as i32, dv as i32];
        let (zs_, eps) = (zv.stride as i64, eps);
        b.arg(&x).arg(&z).arg(&zs_).arg(&w).arg(&out);
        b.arg(&ints[0]).arg(&ints[1]).arg(&ints[2]).arg(&eps);
        // SAFETY: argument types and order match `gnorm_*` in norm.cu; half a warp per group.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}
