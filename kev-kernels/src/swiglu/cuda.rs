//! SwiGLU on CUDA (`swiglu.cu`).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, Layout, Result};

use crate::backend::cuda::kernel::{contiguous, grid_for, Kernel};
use crate::backend::cuda::sources::SWIGLU;

pub(crate) fn swiglu(s: &CudaStorage, l: &Layout) -> Result<CudaStorage> {
    let k = Kernel::for_dtype(&SWIGLU, s.device(), "swiglu", s.dtype(), "swiglu")?;
    let (a, e) = contiguous(l, "swiglu input")?;
    let inter = l.dims().last().copied().unwrap_or(0) / 2;
    let n = (e - a) / 2;
    let rows_ = (n / inter.max(1)) as i32;
    by_dtype!(s.dtype(), "swiglu", |T| {
        let gu = s.as_cuda_slice::<T>()?.slice(a..e);
        let out = k.output::<T>(n)?;
        let mut b = k.stream.launch_builder(&k.func);
        let inter_ = inter as i32;
        b.arg(&gu).arg(&out).arg(&rows_).arg(&inter_);
        // SAFETY: argument types and order match `swiglu_*` in swiglu.cu; blocks stride over rows.
        unsafe { b.launch(grid_for(rows_ as usize * 256, 256)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}
