//! The pointer head's device work around its two f32 matmuls (docs/CONTRACT.md §3): the rows it
//! reads, widened to f32 ([`rows_f32`]), and the logits from the projections ([`pointer_logits`]).
//! On CUDA each is one Kev kernel, so that a forward launches no candle kernel: candle ships its
//! kernels as PTX modules that the driver takes seconds each to translate in a fresh process.
//! Elsewhere candle's ops compose them.

#[cfg(feature = "cuda")]
mod cuda;

use candle_core::{bail, CustomOp1, CustomOp2, DType, Result, Tensor, D};
#[cfg(feature = "cuda")]
use candle_core::{Layout, Shape};

use crate::dispatch::{self, backend, counted, Backend, CountedTensor};
use crate::gather::RowIndex;

/// Whether the CUDA kernels take `t`: a CUDA float tensor, contiguous ([`backend`]'s CUDA).
fn on_cuda(t: &Tensor) -> bool {
    backend(t.device()) == Backend::Cuda
        && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && t.is_contiguous()
}

/// The CUDA op of [`rows_f32`]; the indices ride along.
// Read by the CUDA launch only.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct RowsF32 {
    idx: Option<Tensor>,
}

impl CustomOp1 for RowsF32 {
    fn name(&self) -> &'static str {
        "rows-f32"
    }

    cuda_only_cpu_fwd!("rows-f32: the CPU takes index_select and to_dtype", _a _la);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ts: &candle_core::CudaStorage,
        tl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let guard = self.idx.as_ref().map(|t| t.storage_and_layout());
        let idx = match &guard {
            Some((s, l)) => Some((
                crate::backend::cuda::kernel::cuda_of(s, "rows-f32: rows")?,
                *l,
            )),
            None => None,
        };
        let (rows, cols) = tl.shape().dims2()?;
        let n = idx.map_or(rows, |(_, l)| l.shape().elem_count());
        Ok((cuda::rows_f32(ts, tl, idx)?, Shape::from((n, cols))))
    }
}

/// Rows `rows` of `t: [R, H]` (all of them for `None`) as a new f32 `[N, H]` tensor: the hidden
/// states the head reads, widened exactly. `t.index_select(rows, 0)?.to_dtype(F32)` in one
/// kernel on CUDA.
pub fn rows_f32(t: &Tensor, rows: Option<&RowIndex>) -> Result<Tensor> {
    let (src_rows, _) = t.dims2()?;
    if let Some(rows) = rows {
        rows.check_within("rows-f32", t, src_rows)?;
    }
    let composed = || {
        let picked = match rows {
            Some(rows) => t.counted_index_select(rows.tensor(), 0)?,
            None => t.clone(),
        };
        picked.counted_to_dtype(DType::F32)
    };
    let n = rows.map_or(src_rows, RowIndex::len);
    if on_cuda(t) && n > 0 && t.elem_count() > 0 {
        let op = RowsF32 {
            idx: rows.map(|r| r.tensor().clone()),
        };
        dispatch::launch(
            "rows-f32",
            1,
            t.device(),
            || t.apply_op1_no_bwd(&op),
            composed,
        )
    } else {
        composed()
    }
}

/// The CUDA op of [`pointer_logits`]: `q` and `k` are its operands, the rest rides along.
// Read by the CUDA launch only.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct PointerLogits {
    q_bias: Tensor,
    k_bias: Tensor,
    owner: Tensor,
    scale: f32,
}

impl CustomOp2 for PointerLogits {
    fn name(&self) -> &'static str {
        "pointer-logits"
    }

    cuda_only_cpu_fwd!("pointer-logits: the CPU composes candle ops", _a _la, _b _lb);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &Layout,
        ks: &candle_core::CudaStorage,
        kl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::backend::cuda::kernel::cuda_of;
        let (qb, qbl) = self.q_bias.storage_and_layout();
        let (kb, kbl) = self.k_bias.storage_and_layout();
        let (ow, owl) = self.owner.storage_and_layout();
        let out = cuda::pointer_logits(
            (qs, ql),
            (ks, kl),
            (cuda_of(&qb, "pointer-logits: q bias")?, qbl),
            (cuda_of(&kb, "pointer-logits: k bias")?, kbl),
            (cuda_of(&ow, "pointer-logits: owners")?, owl),
            self.scale,
        )?;
        Ok((out, Shape::from(kl.dims()[0])))
    }
}

/// The head's logits: for option i, `(q[owner[i]] + q_bias) · (k[i] + k_bias) · scale` with `q:
/// [N, dim]` (one row per question), `k: [M, dim]` (one per option), the biases `[dim]`, all f32,
/// and `owner: [M]` u32. Returns `[M]` f32. On CUDA one kernel (a warp per option); elsewhere
/// candle's broadcast adds, index select, product, sum and scale.
pub fn pointer_logits(
    q: &Tensor,
    k: &Tensor,
    q_bias: &Tensor,
    k_bias: &Tensor,
    owner: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let (questions, dim) = q.dims2()?;
    let (options, k_dim) = k.dims2()?;
    let f32s = [q, k, q_bias, k_bias]
        .iter()
        .all(|t| t.dtype() == DType::F32);
    if k_dim != dim
        || q_bias.dims() != [dim]
        || k_bias.dims() != [dim]
        || owner.dims() != [options]
        || owner.dtype() != DType::U32
        || !f32s
    {
        bail!(
            "pointer-logits: q {:?} {:?}, k {:?} {:?}, biases {:?} {:?}, owners {:?} {:?} do not fit",
            q.dims(),
            q.dtype(),
            k.dims(),
            k.dtype(),
            q_bias.dims(),
            k_bias.dims(),
            owner.dims(),
            owner.dtype()
        )
    }
    let composed = || {
        let q = counted("broadcast-add", || q.broadcast_add(q_bias))?;
        let k = counted("broadcast-add", || k.broadcast_add(k_bias))?;
        let q = q.counted_index_select(owner, 0)?;
        let products = counted("mul", || q * k)?;
        let sums = counted("sum", || products.sum(D::Minus1))?;
        counted("affine", || sums * scale)
    };
    let all_on_cuda = [q, k, q_bias, k_bias].iter().all(|t| on_cuda(t)) && owner.is_contiguous();
    if all_on_cuda && options > 0 && questions > 0 && dim > 0 {
        let op = PointerLogits {
            q_bias: q_bias.clone(),
            k_bias: k_bias.clone(),
            owner: owner.clone(),
            scale: scale as f32,
        };
        dispatch::launch(
            "pointer-logits",
            1,
            q.device(),
            || q.apply_op2_no_bwd(k, &op),
            composed,
        )
    } else {
        composed()
    }
}
