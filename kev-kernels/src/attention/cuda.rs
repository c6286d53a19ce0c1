//! The full-attention steps on CUDA (`attention.cu`).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaStorage, Layout, Result};

use super::gate::GatePart;
use crate::backend::cuda::kernel::{contiguous, grid_for, Kernel};
use crate::backend::cuda::sources::{ATTENTION, ROPE_WARPS};
use crate::layout::rows::strided4;

pub(crate) fn qk_norm_rope(
    eps: f32,
    xs: &CudaStorage,
    xl: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
    cs: &CudaStorage,
    cl: &Layout,
) -> Result<CudaStorage> {
    let k = Kernel::for_dtype(
        &ATTENTION,
        xs.device(),
        "qknorm_rope",
        xs.dtype(),
        "qk-norm-rope",
    )?;
    let (b_sz, t_len, heads, hd) = xl.shape().dims4()?;
    let (off, [sb, st, sh]) = strided4(xl, "qk-norm-rope input")?;
    let (w0, w1) = contiguous(wl, "qk-norm-rope weight")?;
    let (c0, c1) = contiguous(cl, "qk-norm-rope rotation")?;
    let rot = cl.dims()[3];
    let rows_ = b_sz * heads * t_len;
    let cfg = LaunchConfig {
        grid_dim: (rows_.div_ceil(ROPE_WARPS) as u32, 1, 1),
        block_dim: ((32 * ROPE_WARPS) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let w = ws.as_cuda_slice::<f32>()?.slice(w0..w1);
    by_dtype!(xs.dtype(), "qk-norm-rope", |T| {
        let x = xs.as_cuda_slice::<T>()?.slice(off..);
        let cos_sin = cs.as_cuda_slice::<T>()?;
        let cos = cos_sin.slice(c0..c0 + (c1 - c0) / 2);
        let sin = cos_sin.slice(c0 + (c1 - c0) / 2..c1);
        let out = k.output::<T>(rows_ * hd)?;
        let mut b = k.stream.launch_builder(&k.func);
        let strides = [sb, st, sh].map(|s| s as i64);
        let ints = [b_sz, t_len, heads, hd, rot].map(|v| v as i32);
        b.arg(&x).arg(&strides[0]).arg(&strides[1]).arg(&strides[2]);
        b.arg(&w).arg(&cos).arg(&sin).arg(&out);
        for v in &ints {
            b.arg(v);
        }
        b.arg(&eps);
        // SAFETY: argument types and order match `qknorm_rope_*` in attention.cu; hd ≤ 512 was
        // checked by the wrapper; indices follow the layout's own strides.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}

pub(crate) fn causal_softmax(
    scale: f32,
    ss: &CudaStorage,
    sl: &Layout,
    ms: &CudaStorage,
    ml: &Layout,
) -> Result<CudaStorage> {
    let k = Kernel::for_dtype(
        &ATTENTION,
        ss.device(),
        "causal_softmax",
        ss.dtype(),
        "causal-softmax",
    )?;
    let (b_sz, groups, t_len, s_len) = sl.shape().dims4()?;
    let (s0, s1) = contiguous(sl, "causal-softmax scores")?;
    let (m0, m1) = contiguous(ml, "causal-softmax key bias")?;
    // A warp per row, 8 rows per block (attention.cu).
    const ROWS_PER_BLOCK: usize = 8;
    let rows = b_sz * groups * t_len;
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(ROWS_PER_BLOCK) as u32, 1, 1),
        block_dim: (32 * ROWS_PER_BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let bias = ms.as_cuda_slice::<f32>()?.slice(m0..m1);
    by_dtype!(ss.dtype(), "causal-softmax", |T| {
        let s = ss.as_cuda_slice::<T>()?.slice(s0..s1);
        let out = k.output::<T>(s1 - s0)?;
        let mut b = k.stream.launch_builder(&k.func);
        let ints = [groups, t_len, s_len].map(|v| v as i32);
        let rows_ = rows as i64;
        b.arg(&s)
            .arg(&bias)
            .arg(&out)
            .arg(&ints[0])
            .arg(&ints[1])
            .arg(&ints[2])
            .arg(&scale)
            .arg(&rows_);
        // SAFETY: argument types and order match `causal_softmax_*` in attention.cu; a warp per row.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}

/// `attn_gate_*` once per part, into one output holding each part's `[B·T, H·hd]` rows in turn.
pub(super) fn gate_launches(
    gs: &CudaStorage,
    parts: &[GatePart<CudaStorage>],
    heads: usize,
    hd: usize,
) -> Result<CudaStorage> {
    let dtype = gs.dtype();
    let k = Kernel::for_dtype(
        &ATTENTION,
        gs.device(),
        "attn_gate",
        dtype,
        "attention-gate",
    )?;
    let row = heads * hd;
    let total: usize = parts.iter().map(|p| p.rows.0 * p.rows.1 * row).sum();
    by_dtype!(dtype, "attention-gate", |T| {
        let mut out = k.output::<T>(total)?;
        let mut at = 0;
        for part in parts {
            let (o0, o1) = contiguous(part.o, "attention-gate input")?;
            let (b_sz, t_len) = part.rows;
            let n = b_sz * t_len * row;
            if o1 - o0 != n {
                bail!(
                    "attention-gate: input {:?} does not hold {b_sz} × {t_len} rows",
                    part.o
                )
            }
            if n == 0 {
                continue;
            }
            let o = part.storage.as_cuda_slice::<T>()?.slice(o0..o1);
            let g = gs.as_cuda_slice::<T>()?.slice(part.gate_at..);
            let mut dst = out.slice_mut(at..at + n);
            let strides = part.strides.map(|s| s as i64);
            let ints = [b_sz, t_len, heads, hd].map(|v| v as i32);
            let mut b = k.stream.launch_builder(&k.func);
            b.arg(&o)
                .arg(&g)
                .arg(&strides[0])
                .arg(&strides[1])
                .arg(&strides[2])
                .arg(&mut dst);
            for v in &ints {
                b.arg(v);
            }
            // SAFETY: argument types and order match `attn_gate_*` in attention.cu; blocks stride
            // over the part's B·T rows, writing only its slice of `out`.
            unsafe { b.launch(grid_for(b_sz * t_len * 256, 256)) }.w()?;
            at += n;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}
