//! The CUDA layer under the ops' launchers: the kernel sources and their constants
//! ([`sources`]), loading their machine code or compiling them with NVRTC ([`kernel`]), the GPU's capabilities, the
//! device memory pool and the profiler. It knows no op.

pub(crate) mod gpu;
pub(crate) mod sources;

#[cfg(feature = "cuda")]
pub(crate) mod kernel;
#[cfg(feature = "cuda")]
mod memory;
#[cfg(feature = "cuda")]
mod profiler;

#[cfg(feature = "cuda")]
pub use kernel::{kernel_seconds, prepare_kernels};
#[cfg(feature = "cuda")]
pub use memory::{
    keep_device_memory, pool_peak_bytes, release_device_memory, release_device_memory_of,
};
#[cfg(feature = "cuda")]
pub use profiler::profiler_range;

pub(crate) use gpu::cuda_gpu;
