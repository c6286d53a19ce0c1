//! Flash attention on CUDA (`flash_attention.cu`, tensor cores).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, Layout, Result, Tensor};

use crate::backend::cuda::kernel::{contiguous, cuda_of, Kernel};
use crate::backend::cuda::sources::{FLASH_ATTENTION, FLASH_ROWS, FLASH_SMEM, FLASH_THREADS};

/// A flash-attention key or value source: a bf16 view from its start, and its strides (in
/// elements) of rows, heads and steps.
fn flash_source<'a>(
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<(CudaView<'a, half::bf16>, [i64; 3])> {
    let st = l.stride();
    let view = s.as_cuda_slice::<half::bf16>()?.slice(l.start_offset()..);
    Ok((view, [st[0], st[1], st[2]].map(|x| x as i64)))
}

/// `flash_attn_bf16` (flash_attention.cu): q `[B, Hq, T, 256]` contiguous, this step's k and v
/// `[B, Hkv, L, 256]` and the past's (k, v, owners) at their own strides (the wrapper checked
/// dtypes, shapes and 16-byte alignment), key bias `[B, S + L]` f32.
pub(crate) fn flash_attention(
    (qs, ql): (&CudaStorage, &Layout),
    (ks, kl): (&CudaStorage, &Layout),
    (vs, vl): (&CudaStorage, &Layout),
    past: Option<[&Tensor; 3]>,
    bias: &Tensor,
    scale: f32,
) -> Result<CudaStorage> {
    let k = Kernel::load(&FLASH_ATTENTION, qs.device(), "flash_attn_bf16")?;
    k.allow_shared_memory(FLASH_SMEM)?;
    let (b_sz, hq, t_len, hd) = ql.shape().dims4()?;
    let (_, hkv, l_len, _) = kl.shape().dims4()?;
    let (q0, q1) = contiguous(ql, "flash-attention queries")?;
    let (kn, kn_st) = flash_source(ks, kl)?;
    let (vn, vn_st) = flash_source(vs, vl)?;
    let past_in = past.map(|[pk, pv, owners]| {
        (
            pk.storage_and_layout(),
            pv.storage_and_layout(),
            owners.storage_and_layout(),
        )
    });
    let (b_bias, l_bias) = bias.storage_and_layout();
    let (m0, m1) = contiguous(l_bias, "flash-attention key bias")?;
    let bias_s = cuda_of(&b_bias, "flash-attention key bias")?
        .as_cuda_slice::<f32>()?
        .slice(m0..m1);
    let q = qs.as_cuda_slice::<half::bf16>()?.slice(q0..q1);
    let out = k.output::<half::bf16>(b_sz * hq * t_len * hd)?;
    let rep = hq / hkv;
    let cfg = LaunchConfig {
        grid_dim: (
            (rep * t_len).div_ceil(FLASH_ROWS) as u32,
            hkv as u32,
            b_sz as u32,
        ),
        block_dim: (FLASH_THREADS, 1, 1),
        shared_mem_bytes: FLASH_SMEM,
    };
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let mut b = k.stream.launch_builder(&k.func);
    b.arg(&q);
    // Without a past the kernel never reads these (S = 0): this step's tensors stand in.
    let (past_k, past_v, owners, s_len) = match &past_in {
        Some(((pk, pkl), (pv, pvl), (ow, owl))) => {
            let (i0, i1) = contiguous(owl, "flash-attention owners")?;
            let owners = cuda_of(ow, "flash-attention owners")?
                .as_cuda_slice::<u32>()?
                .slice(i0..i1);
            (
                flash_source(cuda_of(pk, "flash-attention past keys")?, pkl)?,
                flash_source(cuda_of(pv, "flash-attention past values")?, pvl)?,
                Some(owners),
                pkl.dims()[2] as i32,
            )
        }
        None => (flash_source(ks, kl)?, flash_source(vs, vl)?, None, 0),
    };
    let null: u64 = 0;
    b.arg(&past_k.0)
        .arg(&past_k.1[0])
        .arg(&past_k.1[1])
        .arg(&past_k.1[2]);
    b.arg(&past_v.0)
        .arg(&past_v.1[0])
        .arg(&past_v.1[1])
        .arg(&past_v.1[2]);
    match &owners {
        Some(o) => b.arg(o),
        None => b.arg(&null),
    };
    b.arg(&kn).arg(&kn_st[0]).arg(&kn_st[1]).arg(&kn_st[2]);
    b.arg(&vn).arg(&vn_st[0]).arg(&vn_st[1]).arg(&vn_st[2]);
    let ints = [hq, hkv, t_len].map(|x| x as i32);
    let l_i = l_len as i32;
    b.arg(&bias_s)
        .arg(&out)
        .arg(&ints[0])
        .arg(&ints[1])
        .arg(&ints[2])
        .arg(&s_len)
        .arg(&l_i)
        .arg(&scale_log2);
    // SAFETY: argument types and order match `flash_attn_bf16` in flash_attention.cu; the wrapper
    // checked shapes, dtypes (bf16, f32 bias, u32 owners within the past's rows), head dim 256
    // and 16-byte alignment of every row; the grid covers rep·T rows per (b, kv head).
    unsafe { b.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
}
