//! The profiler's collection range.

use candle_core::{CudaDevice, Result};

/// Starts (`on`) or stops the profiler's collection, so that `ncu --profile-from-start off`
/// profiles only the work in between: a benchmark's timed runs without the load and warm-ups.
pub fn profiler_range(dev: &CudaDevice, on: bool) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    dev.cuda_stream()
        .context()
        .bind_to_thread()
        .map_err(candle_core::Error::wrap)?;
    // SAFETY: argument-free driver calls, made with the device's context current.
    let code = unsafe {
        if on {
            sys::cuProfilerStart()
        } else {
            sys::cuProfilerStop()
        }
    };
    match code {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(candle_core::Error::Msg(format!(
            "profiler range: {other:?}"
        ))),
    }
}
