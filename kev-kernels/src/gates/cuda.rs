//! The DeltaNet gates on CUDA (`gates.cu`).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, Layout, Result};

use crate::backend::cuda::kernel::{contiguous, grid_for, Kernel};
use crate::backend::cuda::sources::GATES;
use crate::layout::rows::row_view;

pub(crate) fn gates(
    bas: &CudaStorage,
    bal: &Layout,
    ds: &CudaStorage,
    dl: &Layout,
    ns: &CudaStorage,
    nl: &Layout,
) -> Result<CudaStorage> {
    let k = Kernel::for_dtype(&GATES, bas.device(), "gates", bas.dtype(), "deltanet-gates")?;
    let v = row_view(bal, "deltanet-gates input")?;
    let (d0, d1) = contiguous(dl, "deltanet-gates dt_bias")?;
    let (n0, n1) = contiguous(nl, "deltanet-gates neg_a")?;
    let hv = d1 - d0;
    let n = v.rows * hv;
    let dt = ds.as_cuda_slice::<f32>()?.slice(d0..d1);
    let neg_a = ns.as_cuda_slice::<f32>()?.slice(n0..n1);
    by_dtype!(bas.dtype(), "deltanet-gates", |T| {
        let ba = bas.as_cuda_slice::<T>()?.slice(v.span());
        let out = k.output::<f32>(2 * n)?;
        let mut b = k.stream.launch_builder(&k.func);
        let (stride, rows_, hv_) = (v.stride as i64, v.rows as i32, hv as i32);
        b.arg(&ba)
            .arg(&stride)
            .arg(&dt)
            .arg(&neg_a)
            .arg(&out)
            .arg(&rows_)
            .arg(&hv_);
        // SAFETY: argument types and order match `gates_*` in gates.cu; grid-stride below n.
        unsafe { b.launch(grid_for(n, 256)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}
