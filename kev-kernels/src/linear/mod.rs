//! `x · Wᵀ` for the backbone's projections on a GPU.
//!
//! On CUDA in bf16 and f16, a product of up to [`MAX_TUNED_ROWS`] rows runs the cuBLASLt
//! algorithm that was fastest for its shape class (rows rounded up, columns, inputs, dtype) in
//! this process, timed once against cuBLAS's own choice (candle's matmul, which
//! `candle_nn::Linear` calls). On the H200 cuBLAS's choice is up to 25 % slower on the few
//! hundred rows of one request and 7–10 % on a few thousand, where the tile shape decides how
//! many SMs have work (`bench/gemm_probe.cu`); on larger products it is at the peak already,
//! and it stays. A candidate is timed only if it needs no workspace, does not split the sum
//! over k, and its output on the class's first product equals cuBLAS's bit for bit; every
//! other row count of the class is checked the same way once before it runs the choice. So
//! the choice (which timing noise may vary between processes) does not change a number.
//! Shapes are timed and checked only inside [`tuning`] (the eager pass before a CUDA graph
//! capture), and after the first class of a weight only candidates whose kernels the process
//! has run already: a kernel's first launch loads it, which made a class's timing cost ~10–30
//! ms instead of 1–3. Elsewhere (other backends, dtypes, non-contiguous weights, operands off
//! 256-byte boundaries, shapes not timed or checked) this is candle's matmul.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::{bail, Result, Tensor};

use crate::dispatch::CountedTensor;

/// Products with more rows than this keep cuBLAS's choice: at 11,264 rows the best candidate
/// was 1–7 % faster, at 45,056 cuBLAS's was as fast or faster (`bench/gemm_probe.cu`), and a
/// CUDA graph holds at most 8,192 positions.
pub const MAX_TUNED_ROWS: usize = 8192;

/// Runs `f` with the products it is the first of, per shape class, timed, and those of other
/// row counts checked (both kept for the process); outside it, a shape not timed or checked
/// runs cuBLAS's choice. The CUDA graphs run the eager pass before a capture inside it.
pub fn tuning<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(feature = "cuda")]
    return cuda::tuning(f);
    #[cfg(not(feature = "cuda"))]
    f()
}

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
    let x = x.counted_contiguous()?.reshape((rows, k))?;
    #[cfg(feature = "cuda")]
    if cuda::takes(&x, w, rows) {
        return x.apply_op2_no_bwd(w, &cuda::TunedLinear)?.reshape(out_dims);
    }
    x.matmul(&w.t()?)?.reshape(out_dims)
}
