//! The pointer head's kernels on CUDA (`head.cu`).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, Layout, Result};

use crate::backend::cuda::kernel::{contiguous, rows_grid, Kernel};
use crate::backend::cuda::sources::HEAD;

/// Warps per block of `pointer_logits`, one option each.
const LOGIT_WARPS: usize = 8;

/// `rows_f32_*`: rows `idx` of `ts` (all rows without it) widened to f32 (head.rs checked the
/// indices).
pub(crate) fn rows_f32(
    ts: &CudaStorage,
    tl: &Layout,
    idx: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    let k = Kernel::for_dtype(&HEAD, ts.device(), "rows_f32", ts.dtype(), "rows-f32")?;
    let (t0, t1) = contiguous(tl, "rows-f32 input")?;
    let (src_rows, cols) = tl.shape().dims2()?;
    let idx = idx
        .map(|(s, l)| {
            let (i0, i1) = contiguous(l, "rows-f32 rows")?;
            Ok::<_, candle_core::Error>(s.as_cuda_slice::<u32>()?.slice(i0..i1))
        })
        .transpose()?;
    let n = idx.as_ref().map_or(src_rows, |i| i.len());
    let cfg = rows_grid(cols, n);
    let (n_, cols_, rows_) = (n as i32, cols as i64, src_rows as i32);
    let out = k.output::<f32>(n * cols)?;
    by_dtype!(ts.dtype(), "rows-f32", |T| {
        let src = ts.as_cuda_slice::<T>()?.slice(t0..t1);
        let mut b = k.stream.launch_builder(&k.func);
        b.arg(&src);
        // A null index pointer reads rows in order.
        let null = 0u64;
        match &idx {
            Some(i) => b.arg(i),
            None => b.arg(&null),
        };
        b.arg(&out).arg(&n_).arg(&cols_).arg(&rows_);
        // SAFETY: argument types and order match `rows_f32_*` in head.cu (a device pointer or
        // null for the indices); the grid strides over the rows and a row's columns.
        unsafe { b.launch(cfg) }.w()?;
        Ok::<_, candle_core::Error>(())
    })?;
    Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
}

/// `pointer_logits`: one logit per row of `k` (head.rs checked the shapes and dtypes).
pub(crate) fn pointer_logits(
    (qs, ql): (&CudaStorage, &Layout),
    (ks, kl): (&CudaStorage, &Layout),
    (qbs, qbl): (&CudaStorage, &Layout),
    (kbs, kbl): (&CudaStorage, &Layout),
    (os, ol): (&CudaStorage, &Layout),
    scale: f32,
) -> Result<CudaStorage> {
    let k = Kernel::load(&HEAD, qs.device(), "pointer_logits")?;
    fn slice<'a>(s: &'a CudaStorage, l: &Layout, what: &str) -> Result<CudaView<'a, f32>> {
        let (a, e) = contiguous(l, what)?;
        Ok(s.as_cuda_slice::<f32>()?.slice(a..e))
    }
    let (questions, dim) = ql.shape().dims2()?;
    let options = kl.dims()[0];
    let q = slice(qs, ql, "pointer-logits q")?;
    let keys = slice(ks, kl, "pointer-logits k")?;
    let q_bias = slice(qbs, qbl, "pointer-logits q bias")?;
    let k_bias = slice(kbs, kbl, "pointer-logits k bias")?;
    let (o0, o1) = contiguous(ol, "pointer-logits owners")?;
    let owner = os.as_cuda_slice::<u32>()?.slice(o0..o1);
    let out = k.output::<f32>(options)?;
    let (options_, dim_, questions_) = (options as i32, dim as i32, questions as i32);
    let cfg = LaunchConfig {
        grid_dim: (options.div_ceil(LOGIT_WARPS) as u32, 1, 1),
        block_dim: (32 * LOGIT_WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = k.stream.launch_builder(&k.func);
    b.arg(&q)
        .arg(&keys)
        .arg(&q_bias)
        .arg(&k_bias)
        .arg(&owner)
        .arg(&out);
    b.arg(&options_).arg(&dim_).arg(&questions_).arg(&scale);
    // SAFETY: argument types and order match `pointer_logits` in head.cu; one warp per option,
    // the grid covers all of them and the kernel returns past the last.
    unsafe { b.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
}
