//! Row gathers on CUDA (`gather.cu`): whole 16-byte words, any dtype.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result};

use crate::backend::cuda::kernel::{contiguous, rows_grid, Kernel};
use crate::backend::cuda::sources::GATHER;

/// The rows of `ts` each part of indices picks, one part after another in a new buffer (16-byte
/// words; gather.rs checked the sizes, the alignment and the indices).
pub(crate) fn gather_parts(
    ts: &CudaStorage,
    tl: &Layout,
    parts: &[(&CudaStorage, &Layout)],
) -> Result<CudaStorage> {
    let n: usize = parts.iter().map(|(_, l)| l.shape().elem_count()).sum();
    let row_elems = tl.shape().elem_count() / tl.dims()[0].max(1);
    by_dtype!(ts.dtype(), "gather-rows", |T| {
        // SAFETY: `gather_into` writes all n rows.
        let mut out = unsafe { ts.device().alloc::<T>(n * row_elems) }?;
        gather_into::<T>(ts, tl, parts, &mut out)?;
        Ok(CudaStorage::wrap_cuda_slice(out, ts.device().clone()))
    })
}

/// [`gather_parts`] into `out`.
fn gather_into<T: DeviceRepr + CudaDType>(
    ts: &CudaStorage,
    tl: &Layout,
    parts: &[(&CudaStorage, &Layout)],
    out: &mut CudaSlice<T>,
) -> Result<()> {
    let k = Kernel::load(&GATHER, ts.device(), "gather_rows16")?;
    let (t0, t1) = contiguous(tl, "gather-rows input")?;
    let src_rows = tl.dims()[0];
    let row_elems = (t1 - t0) / src_rows.max(1);
    let units = row_elems * ts.dtype().size_in_bytes() / 16;
    let (units_, rows_) = (units as i64, src_rows as i32);
    let src = ts.as_cuda_slice::<T>()?.slice(t0..t1);
    let mut at = 0;
    for (is, il) in parts {
        let (i0, i1) = contiguous(il, "gather-rows index")?;
        let n = i1 - i0;
        if n == 0 {
            continue;
        }
        let idx = is.as_cuda_slice::<u32>()?.slice(i0..i1);
        let mut dst = out.slice_mut(at * row_elems..(at + n) * row_elems);
        let n_ = n as i32;
        let cfg = rows_grid(units, n);
        let mut b = k.stream.launch_builder(&k.func);
        b.arg(&src)
            .arg(&idx)
            .arg(&mut dst)
            .arg(&units_)
            .arg(&rows_)
            .arg(&n_);
        // SAFETY: argument types and order match `gather_rows16` in gather.cu; rows are whole
        // 16-byte words (the wrapper checked), the grid strides over the rows and a row's words.
        unsafe { b.launch(cfg) }.w()?;
        at += n;
    }
    Ok(())
}

/// `copy_rows16`: the strided view `sl` of `ss` made contiguous, rows of 16-byte words
/// (gather.rs checked the last dim's stride, the row size and the alignment).
pub(crate) fn copy_rows(ss: &CudaStorage, sl: &Layout) -> Result<CudaStorage> {
    let k = Kernel::load(&GATHER, ss.device(), "copy_rows16")?;
    let size = ss.dtype().size_in_bytes();
    let dims = sl.dims();
    let rank = dims.len();
    if !(1..=4).contains(&rank) {
        candle_core::bail!("copy-rows: rank {rank} is not 1 to 4")
    }
    let row_elems = dims[rank - 1];
    let units = row_elems * size / 16;
    let words = |stride: usize| (stride * size / 16) as i64;
    // The outer dims as (d0, d1, d2) with their strides in words, leading ones of size 1.
    let (mut d, mut st) = ([1usize; 3], [0i64; 3]);
    for (i, j) in (0..rank - 1).rev().zip((0..3).rev()) {
        d[j] = dims[i];
        st[j] = words(sl.stride()[i]);
    }
    let rows = d.iter().product::<usize>();
    let start = sl.start_offset();
    let cfg = rows_grid(units, rows);
    let (units_, d1, d2, rows_) = (units as i64, d[1] as i32, d[2] as i32, rows as i64);
    by_dtype!(ss.dtype(), "copy-rows", |T| {
        let src = ss.as_cuda_slice::<T>()?.slice(start..);
        let out = k.output::<T>(rows * row_elems)?;
        let mut b = k.stream.launch_builder(&k.func);
        b.arg(&src).arg(&out).arg(&units_).arg(&d1).arg(&d2);
        b.arg(&st[0]).arg(&st[1]).arg(&st[2]).arg(&rows_);
        // SAFETY: argument types and order match `copy_rows16` in gather.cu; every row read lies
        // in the view `sl` of `ss` (its strides and dims), the grid strides over the rows.
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

/// Contiguous `parts` one after another in a new buffer, by device-to-device copies on the
/// stream (gather.rs checked the dtypes and the trailing dims).
pub(crate) fn join_rows(parts: &[(&CudaStorage, &Layout)]) -> Result<CudaStorage> {
    let dev = parts[0].0.device().clone();
    match parts[0].0.dtype() {
        candle_core::DType::U32 => Ok(CudaStorage::wrap_cuda_slice(copy_parts::<u32>(parts)?, dev)),
        dtype => by_dtype!(dtype, "join-rows", |T| Ok(CudaStorage::wrap_cuda_slice(
            copy_parts::<T>(parts)?,
            dev
        ))),
    }
}

fn copy_parts<T: DeviceRepr + CudaDType>(
    parts: &[(&CudaStorage, &Layout)],
) -> Result<CudaSlice<T>> {
    let dev = parts[0].0.device();
    let stream = dev.cuda_stream();
    let total: usize = parts.iter().map(|(_, l)| l.shape().elem_count()).sum();
    // SAFETY: the copies below fill all `total` elements.
    let mut out = unsafe { dev.alloc::<T>(total) }?;
    let mut at = 0;
    for (s, l) in parts {
        let (a, e) = contiguous(l, "join-rows part")?;
        if e > a {
            let src = s.as_cuda_slice::<T>()?.slice(a..e);
            let mut dst = out.slice_mut(at..e - a + at);
            stream.memcpy_dtod(&src, &mut dst).w()?;
        }
        at += e - a;
    }
    Ok(out)
}

/// One group of [`pack`]: each view's storage and its `(start, elements)` runs in it.
pub(crate) type GroupSources<'a> = Vec<(&'a CudaStorage, Vec<(usize, usize)>)>;

/// `copy_runs16`: per group a new buffer of the group's elements, its sources' runs one after
/// another (each source's `(start, elements)` runs in its storage, in order), all groups in one
/// launch from one table of addresses (gather.rs checked the dtype and that every run starts and
/// ends on 16-byte words).
pub(crate) fn pack(
    dev: &CudaDevice,
    dtype: DType,
    groups: &[GroupSources],
) -> Result<Vec<CudaStorage>> {
    let k = Kernel::load(&GATHER, dev, "copy_runs16")?;
    let size = dtype.size_in_bytes();
    by_dtype!(dtype, "pack", |T| {
        let mut outs = groups
            .iter()
            .map(|group| {
                let total = group.iter().flat_map(|(_, r)| r).map(|&(_, n)| n).sum();
                // SAFETY: the launch below writes every element: the runs cover the total.
                unsafe { dev.alloc::<T>(total) }
            })
            .collect::<Result<Vec<_>>>()?;
        {
            // The address guards live until the launch is queued.
            let dst: Vec<_> = outs
                .iter_mut()
                .map(|o| o.device_ptr_mut(&k.stream))
                .collect();
            let sources: Vec<Vec<_>> = groups
                .iter()
                .map(|g| {
                    g.iter()
                        .map(|(storage, _)| Ok(storage.as_cuda_slice::<T>()?.device_ptr(&k.stream)))
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<_>>()?;
            let (mut from, mut to, mut units) = (Vec::new(), Vec::new(), Vec::new());
            for ((group, srcs), (base, _)) in groups.iter().zip(&sources).zip(&dst) {
                let mut at = 0;
                for ((_, runs), (src, _)) in group.iter().zip(srcs) {
                    for &(start, n) in runs {
                        from.push(src + (start * size) as u64);
                        to.push(base + (at * size) as u64);
                        units.push((n * size / 16) as u64);
                        at += n;
                    }
                }
            }
            let n = from.len();
            if n > 0 {
                let widest = units.iter().copied().max().unwrap_or(0) as usize;
                let table: Vec<u64> = from.into_iter().chain(to).chain(units).collect();
                let table = k.stream.clone_htod(&table).w()?;
                let cfg = LaunchConfig {
                    grid_dim: (
                        widest.div_ceil(256).clamp(1, 64) as u32,
                        n.clamp(1, 65535) as u32,
                        1,
                    ),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let n_ = n as i32;
                let mut b = k.stream.launch_builder(&k.func);
                b.arg(&table).arg(&n_);
                // SAFETY: argument types and order match `copy_runs16` in gather.cu; every
                // address in the table lies in a live buffer (the sources are borrowed by the
                // caller, the outputs held here) for the run's whole length.
                unsafe { b.launch(cfg) }.w()?;
            }
        }
        Ok(outs
            .into_iter()
            .map(|out| CudaStorage::wrap_cuda_slice(out, dev.clone()))
            .collect())
    })
}
