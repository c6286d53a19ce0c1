//! The causal conv1d on CUDA (`causal_conv1d.cu`): the plain conv, the cached one that also
//! returns the next cache, and the split form over records' states and their branches.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaStorage, DType, Layout, Result, Shape};

use crate::backend::cuda::kernel::{contiguous, device_lengths, device_table, grid_for, Kernel};
use crate::backend::cuda::sources::{CAUSAL_CONV1D, CONV_CACHED_BLOCK, CONV_RUN, CONV_VEC};
use crate::layout::rows::row_view;
use crate::layout::split::SplitBatch;

/// Threads per block of `conv_*` (a grid-stride loop).
const CONV_BLOCK: u32 = 256;

pub(crate) fn causal_conv1d(
    kernel_size: usize,
    xs: &CudaStorage,
    xl: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
) -> Result<(CudaStorage, Shape)> {
    if xs.dtype() != ws.dtype() {
        bail!(
            "causal-conv1d: input {:?} and weight {:?} dtypes differ",
            xs.dtype(),
            ws.dtype()
        )
    }
    let k = Kernel::for_dtype(
        &CAUSAL_CONV1D,
        xs.device(),
        "conv",
        xs.dtype(),
        "causal-conv1d",
    )?;
    let (b_sz, padded, channels) = xl.shape().dims3()?;
    let seq_len = padded + 1 - kernel_size;
    let (x0, x1) = contiguous(xl, "causal-conv1d input")?;
    let (w0, w1) = contiguous(wl, "causal-conv1d weight")?;
    let n = b_sz * seq_len * channels;
    let cfg = grid_for(n, CONV_BLOCK);
    let ints = [b_sz, seq_len, channels, kernel_size].map(|x| x as i32);
    macro_rules! launch {
        ($t:ty) => {{
            let x = xs.as_cuda_slice::<$t>()?.slice(x0..x1);
            let w = ws.as_cuda_slice::<$t>()?.slice(w0..w1);
            let y = k.output::<$t>(n)?;
            let mut b = k.stream.launch_builder(&k.func);
            b.arg(&x).arg(&w).arg(&y);
            for v in &ints {
                b.arg(v);
            }
            // SAFETY: argument types and order match `conv_*` in causal_conv1d.cu; the grid-stride loop
            // stays below `n`, the output size.
            unsafe { b.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(y, k.dev.clone())
        }};
    }
    let y = match xs.dtype() {
        DType::F32 => launch!(f32),
        DType::BF16 => launch!(half::bf16),
        _ => launch!(half::f16),
    };
    Ok((y, Shape::from((b_sz, seq_len, channels))))
}

/// The conv kernels' grid: a thread per CONV_VEC channels, `(rows, runs)` as y and z.
fn conv_launch(channels: usize, rows: usize, runs: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            (channels as u32).div_ceil(CONV_VEC * CONV_CACHED_BLOCK),
            rows as u32,
            runs as u32,
        ),
        block_dim: (CONV_CACHED_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The one-pass forward's conv (`conv_split_*`): `xs` `[R, S, C]` rows from zeros, `xb`
/// `[B, T, C]` rows continuing their owners' last K−1 real inputs; out `[R·S + B·T, C]`.
pub(crate) fn causal_conv1d_split(
    split: &SplitBatch,
    ss: &CudaStorage,
    sl: &Layout,
    bs: &CudaStorage,
    bl: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
) -> Result<CudaStorage> {
    let k = Kernel::for_dtype(
        &CAUSAL_CONV1D,
        ss.device(),
        "conv_split",
        ss.dtype(),
        "causal-conv1d",
    )?;
    let (states, s_len, channels) = sl.shape().dims3()?;
    let (b_sz, t_len, _) = bl.shape().dims3()?;
    let kernel = wl.dims()[1];
    let sv = row_view(sl, "causal-conv1d state")?;
    let bv = row_view(bl, "causal-conv1d branches")?;
    let (w0, w1) = contiguous(wl, "causal-conv1d weight")?;
    let n = split.tokens() * channels;
    // The grid is (channel blocks, 1, runs): CUDA caps z at 65535.
    let runs = states * s_len.div_ceil(CONV_RUN) + b_sz * t_len.div_ceil(CONV_RUN);
    if runs > 65535 {
        bail!(
            "causal-conv1d: {states} states of {s_len} steps and {b_sz} rows of {t_len} exceed one launch"
        )
    }
    let state_lengths = device_table(&k.dev, split.state_lengths_on_device()?)?;
    let owners = device_table(&k.dev, split.owners_on_device()?)?;
    by_dtype!(ss.dtype(), "causal-conv1d", |T| {
        let out = k.output::<T>(n)?;
        let xs = ss.as_cuda_slice::<T>()?.slice(sv.span());
        let xb = bs.as_cuda_slice::<T>()?.slice(bv.span());
        let w = ws.as_cuda_slice::<T>()?.slice(w0..w1);
        let mut b = k.stream.launch_builder(&k.func);
        let (s_stride, b_stride) = (sv.stride as i64, bv.stride as i64);
        let [r_, s_, b_, t_, c_, k_] =
            [states, s_len, b_sz, t_len, channels, kernel].map(|v| v as i32);
        b.arg(&xs)
            .arg(&s_stride)
            .arg(&r_)
            .arg(&s_)
            .arg(&state_lengths.ptr);
        b.arg(&xb).arg(&b_stride).arg(&b_).arg(&t_).arg(&owners.ptr);
        b.arg(&w).arg(&out).arg(&c_).arg(&k_);
        let cfg = conv_launch(channels, 1, runs);
        // SAFETY: argument types and order match `conv_split_*` in causal_conv1d.cu; a thread per CONV_VEC
        // channels below C and run of steps below S or T; reads stay inside the views the
        // layouts describe (the wrapper checked that both parts and the weight have C channels
        // and the parts fit `split`, whose lengths are at most S and owners below R).
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}

pub(crate) fn causal_conv1d_cached(
    lengths: Option<&[u32]>,
    xs: &CudaStorage,
    xl: &Layout,
    cs: &CudaStorage,
    cl: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
) -> Result<CudaStorage> {
    let k = Kernel::for_dtype(
        &CAUSAL_CONV1D,
        xs.device(),
        "conv_cached",
        xs.dtype(),
        "causal-conv1d",
    )?;
    let (b_sz, seq_len, channels) = xl.shape().dims3()?;
    let kernel = wl.dims()[1];
    let xv = row_view(xl, "causal-conv1d input")?;
    let (c0, c1) = contiguous(cl, "causal-conv1d cache")?;
    let (w0, w1) = contiguous(wl, "causal-conv1d weight")?;
    let n = b_sz * (seq_len + kernel - 1) * channels;
    // The grid is (channel blocks, rows, runs + 1): CUDA caps y and z at 65535.
    let runs = seq_len.div_ceil(CONV_RUN) + 1;
    if b_sz > 65535 || runs > 65535 {
        bail!("causal-conv1d: {b_sz} rows of {seq_len} steps exceed one launch; split the call")
    }
    let lengths = device_lengths(&k.dev, lengths)?;
    by_dtype!(xs.dtype(), "causal-conv1d", |T| {
        let out = k.output::<T>(n)?;
        if n == 0 {
            return Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()));
        }
        let x = xs.as_cuda_slice::<T>()?.slice(xv.span());
        let cache = cs.as_cuda_slice::<T>()?.slice(c0..c1);
        let w = ws.as_cuda_slice::<T>()?.slice(w0..w1);
        let mut b = k.stream.launch_builder(&k.func);
        let stride = xv.stride as i64;
        b.arg(&x).arg(&stride).arg(&cache).arg(&w);
        b.arg(&lengths.ptr);
        b.arg(&out);
        let ints = [b_sz, seq_len, channels, kernel].map(|v| v as i32);
        for v in &ints {
            b.arg(v);
        }
        let cfg = conv_launch(channels, b_sz, runs);
        // SAFETY: argument types and order match `conv_cached_*` in causal_conv1d.cu; a thread per CONV_VEC channels
        // below C and batch row, steps below T; reads stay inside the views the layouts describe.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}
