//! The full-attention layers' `softmax(q·kᵀ·scale + bias)·v` as one kernel (flash attention;
//! CUDA's `flash_attention.cu`, Metal's `flash_attention.metal`): the scores stay on the GPU's
//! cores instead of making four passes through memory, a branch row reads its state row's keys
//! and values where they lie (no gathered copy), and the values are read as a view of the
//! projection (no transposing copy).
//!
//! Numerics: the scores and the softmax in f32; CUDA rounds the probabilities to bf16 as the
//! operand of `P·V` (PyTorch's flash and memory-efficient attention do the same), Metal keeps them
//! in f32 and rounds only the output; the matmul form rounds the scores to bf16 first, as HF's
//! eager attention. All are within bf16's noise of the f32 reference (the CUDA parity suite; on
//! Metal, the emulation harness and `tests/metal_ops.rs`).

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "metal")]
mod metal;

use candle_core::{bail, CustomOp3, DType, Result, Tensor};

use crate::backend::cuda::cuda_gpu;
use crate::backend::cuda::sources::FLASH_SMEM;
use crate::dispatch::{self, backend, Backend, CountedTensor};
use crate::gather::RowIndex;

/// The one head dim the CUDA kernel is built for (Qwen3.5's full attention).
pub use crate::backend::cuda::sources::FLASH_HEAD_DIM;

/// The largest head dim of the Metal kernel (8 values in each of a simdgroup's 32 lanes).
const FLASH_METAL_MAX_HEAD_DIM: usize = 256;

/// The keys and values a step's queries see before their own: `[R, Hkv, S, hd]` each (any
/// strides with contiguous head dims; the flash kernel reads them in place where rows start at
/// 16-byte boundaries), row `owners[b]` for batch row b.
#[derive(Clone, Copy)]
pub struct AttentionPast<'a> {
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub owners: &'a RowIndex,
}

/// The CUDA and Metal op: inputs q, this step's k and v; the rest travels in the op.
#[cfg_attr(not(any(feature = "cuda", feature = "metal")), allow(dead_code))]
struct FlashAttention {
    past: Option<(Tensor, Tensor, Tensor)>,
    bias: Tensor,
    scale: f32,
}

impl CustomOp3 for FlashAttention {
    fn name(&self) -> &'static str {
        "flash-attention"
    }

    cuda_only_cpu_fwd!("flash-attention: CUDA and Metal only (causal_attention composes on the CPU)", _a _la, _b _lb, _c _lc);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &candle_core::Layout,
        ks: &candle_core::CudaStorage,
        kl: &candle_core::Layout,
        vs: &candle_core::CudaStorage,
        vl: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        let past = self.past.as_ref().map(|(k, v, i)| [k, v, i]);
        let out =
            cuda::flash_attention((qs, ql), (ks, kl), (vs, vl), past, &self.bias, self.scale)?;
        Ok((out, ql.shape().clone()))
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        qs: &candle_core::MetalStorage,
        ql: &candle_core::Layout,
        ks: &candle_core::MetalStorage,
        kl: &candle_core::Layout,
        vs: &candle_core::MetalStorage,
        vl: &candle_core::Layout,
    ) -> Result<(candle_core::MetalStorage, candle_core::Shape)> {
        let past = self.past.as_ref().map(|(k, v, i)| [k, v, i]);
        let out =
            metal::flash_attention((qs, ql), (ks, kl), (vs, vl), past, &self.bias, self.scale)?;
        Ok((out, ql.shape().clone()))
    }
}

/// Whether the kernel reads `t` (`[rows, heads, steps, hd]`): bf16, head dims contiguous, every
/// start at a 16-byte boundary.
fn readable(t: &Tensor) -> bool {
    let (l, s) = (t.layout(), t.stride());
    t.dtype() == DType::BF16
        && t.rank() == 4
        && s[3] == 1
        && l.start_offset().is_multiple_of(8)
        && s[..3].iter().all(|s| s.is_multiple_of(8))
}

/// The shapes, dtypes and devices of [`crate::causal_attention`]'s inputs (errors named
/// `name`); returns the past's steps S (0 without a past).
pub(crate) fn check(
    name: &str,
    q: &Tensor,
    past: Option<&AttentionPast>,
    k: &Tensor,
    v: &Tensor,
    key_bias: &Tensor,
) -> Result<usize> {
    let (b_sz, hq, t_len, hd) = q.dims4()?;
    let (kb, hkv, l_len, khd) = k.dims4()?;
    if v.dims() != k.dims() || kb != b_sz || khd != hd || hkv == 0 || hq % hkv != 0 {
        bail!(
            "{name}: q {:?}, k {:?} and v {:?} do not fit (B, heads, steps, head dim)",
            q.dims(),
            k.dims(),
            v.dims()
        )
    }
    if t_len > l_len {
        bail!("{name}: {t_len} queries for {l_len} keys of their own")
    }
    let s_len = match past {
        Some(p) => {
            let (rows, h, s, d) = p.k.dims4()?;
            if p.v.dims() != p.k.dims() || h != hkv || d != hd {
                bail!(
                    "{name}: past k {:?} / v {:?} do not fit {hkv} heads of {hd}",
                    p.k.dims(),
                    p.v.dims()
                )
            }
            if p.owners.len() != b_sz {
                bail!("{name}: {} owners for {b_sz} rows", p.owners.len())
            }
            p.owners.check_within(name, p.k, rows)?;
            s
        }
        None => 0,
    };
    if key_bias.dims() != [b_sz, s_len + l_len] || key_bias.dtype() != DType::F32 {
        bail!(
            "{name}: key bias {:?} {:?}, expected [{b_sz}, {}] f32",
            key_bias.dims(),
            key_bias.dtype(),
            s_len + l_len
        )
    }
    let mut others = vec![k, v, key_bias];
    if let Some(p) = past {
        others.extend([p.k, p.v, p.owners.tensor()]);
    }
    if let Some(t) = others.iter().find(|t| !t.device().same_device(q.device())) {
        bail!(
            "{name}: a {:?} input on {:?} with queries on {:?}",
            t.dims(),
            t.device().location(),
            q.device().location()
        )
    }
    Ok(s_len)
}

/// `softmax(q·kᵀ·scale + key_bias)·v` with causality in one kernel, for the inputs of
/// [`crate::causal_attention`] (which says what they are) that [`check`] passed with the past's
/// `s_len` steps, or `None` where the kernel does not run (not a CUDA GPU with tensor cores and
/// 101 KB of shared memory a block, not bf16, hd ≠ 256, q not contiguous, views not at 16-byte
/// boundaries, no rows or queries, a grid over CUDA's limits). A query row that sees no key (all
/// masked) gets zeros, where the softmax would give NaN; Kev's rows always hold a real token.
/// `composed` computes the same from tensor ops, for [`dispatch::launch`]'s emulated runs.
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_attention_checked(
    q: &Tensor,
    past: Option<AttentionPast>,
    k: &Tensor,
    v: &Tensor,
    key_bias: &Tensor,
    scale: f64,
    s_len: usize,
    composed: impl FnOnce() -> Result<Tensor>,
) -> Result<Option<Tensor>> {
    let (b_sz, hq, t_len, hd) = q.dims4()?;
    let (_, hkv, l_len, _) = k.dims4()?;
    let mut operands = vec![q, k, v];
    if let Some(p) = &past {
        operands.extend([p.k, p.v]);
    }
    let cuda_runs = flash_multiprocessors(q).is_some()
        && hd == FLASH_HEAD_DIM
        && q.is_contiguous()
        && operands.iter().all(|t| readable(t))
        && b_sz > 0
        && t_len > 0
        && b_sz <= 65535
        && hkv <= 65535
        && i32::try_from(hq / hkv * t_len).is_ok()
        && i32::try_from(s_len + l_len).is_ok();
    let runs = if backend(q.device()) == Backend::Metal {
        // Metal: any float dtype shared by the operands, head dims contiguous, hd ≤ 256.
        matches!(q.dtype(), DType::F32 | DType::BF16 | DType::F16)
            && hd <= FLASH_METAL_MAX_HEAD_DIM
            && q.is_contiguous()
            && operands
                .iter()
                .all(|t| t.dtype() == q.dtype() && t.stride()[3] == 1)
            && b_sz > 0
            && t_len > 0
    } else {
        cuda_runs
    };
    if !runs {
        return Ok(None);
    }
    let op = FlashAttention {
        past: past.map(|p| (p.k.clone(), p.v.clone(), p.owners.tensor().clone())),
        bias: key_bias.counted_contiguous()?,
        scale: scale as f32,
    };
    let out = dispatch::launch(
        "flash-attention",
        1,
        q.device(),
        || q.apply_op3_no_bwd(k, v, &op),
        composed,
    )?;
    Ok(Some(out))
}

/// The multiprocessor count of `t`'s device where it runs the kernel: a CUDA GPU with tensor
/// cores and the kernel's shared memory (101 KB a block; sm_86/89 allow 99 KB).
fn flash_multiprocessors(t: &Tensor) -> Option<usize> {
    cuda_gpu(t.device())
        .filter(|g| g.tensor_cores && g.shared_memory_per_block >= FLASH_SMEM as usize)
        .map(|g| g.multiprocessors)
}

/// Whether the flash kernel on `q: [B, Hq, T, hd]` over `num_kv_heads` is worth running: a
/// CUDA GPU with tensor cores, given at least as many of the kernel's blocks (64 query rows of
/// one kv head) as it has multiprocessors. A block walks its keys one tile after another, so a
/// small grid leaves multiprocessors idle where the matmuls spread the same work: one 0.8B
/// request (64 and 24 blocks) measured 4.01–4.05 ms with the matmuls and 4.10–4.14 with the
/// kernel, eight records (512 and 768 blocks) 19.3–19.6 and 18.7–19.0.
/// [`crate::causal_attention`] takes the kernel where this holds; a caller keeping values for
/// later calls asks it too: the kernel reads them as views, the matmuls contiguous.
///
/// On Metal: always (where the kernel runs), one dispatch in place of the two matmuls, the
/// softmax and the copies between them; not measured against them on Apple hardware.
pub fn flash_attention_fills_gpu(q: &Tensor, num_kv_heads: usize) -> Result<bool> {
    if backend(q.device()) == Backend::Metal {
        return Ok(true);
    }
    let (b_sz, hq, t_len, _) = q.dims4()?;
    let blocks = (hq / num_kv_heads.max(1) * t_len).div_ceil(64) * num_kv_heads * b_sz;
    Ok(flash_multiprocessors(q).is_some_and(|sms| blocks >= sms))
}
