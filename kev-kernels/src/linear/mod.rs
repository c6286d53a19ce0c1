//! `x · Wᵀ` for the backbone's projections on a GPU.
//!
//! On CUDA in bf16 and f16, a product of up to [`MAX_TUNED_ROWS`] rows runs the cuBLASLt
//! algorithm that was fastest for its shape in this process, timed once per shape class against
//! cuBLAS's own choice (candle's matmul, which `candle_nn::Linear` calls). On the H200 cuBLAS's
//! choice is up to 25 % slower on the few hundred rows of one request and 7–10 % on a few
//! thousand, where the tile shape decides how many SMs have work (`bench/gemm_probe.cu`);
//! on larger products it is at the peak already, and it stays. Only algorithms that sum each
//! output's products in the same order as cuBLAS's (no split-K) are candidates, so the choice
//! never changes a number. Elsewhere (other backends, dtypes, non-contiguous weights) this is
//! candle's matmul.

#[cfg(feature = "cuda")]
mod cuda;

use candle_core::{bail, Result, Tensor};

/// Products with more rows than this keep cuBLAS's choice: timing a shape class costs its first
/// product ~10–20 ms (loading the candidates' kernels included), which a batch file with many
/// shapes would pay again and again for 1–7 % at 11,264 rows; at 45,056 cuBLAS's was as fast or
/// faster (`bench/gemm_probe.cu`).
pub const MAX_TUNED_ROWS: usize = 8192;

/// `x · Wᵀ` for `x: [.., k]` and a weight `w: [n, k]`; returns `[.., n]` in `x`'s dtype.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (n, k) = w.dims2()?;
    let dims = x.dims();
    if dims.last() != Some(&k) {
        bail!(
            "linear: input {:?} does not end in the weight's {k} inputs",
            dims
        )
    }
    let rows = x.elem_count() / k.max(1);
    let mut out_dims = dims.to_vec();
    *out_dims.last_mut().expect("checked above") = n;
    let x = x.contiguous()?.reshape((rows, k))?;
    #[cfg(feature = "cuda")]
    if cuda::takes(&x, w, rows) {
        return x.apply_op2_no_bwd(w, &cuda::TunedLinear)?.reshape(out_dims);
    }
    x.matmul(&w.t()?)?.reshape(out_dims)
}
