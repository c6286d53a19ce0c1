//! What the launch choices need to know of the GPU.

#[cfg(feature = "cuda")]
use std::sync::OnceLock;

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::WrapErr;
use candle_core::Device;
#[cfg(feature = "cuda")]
use candle_core::{CudaDevice, Result};

/// What the launch choices need to know of the GPU. Asked once per process, by the first device,
/// like the machine code of each source (`Source`'s image): a process mixing GPU kinds is not
/// supported.
#[derive(Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Gpu {
    /// mma.sync on TF32 and bf16 operands (compute capability 8.0 and later).
    pub(crate) tensor_cores: bool,
    pub(crate) multiprocessors: usize,
    /// The most shared memory a block may ask for (227 KB on Hopper, 99 KB on sm_86/89).
    pub(crate) shared_memory_per_block: usize,
    /// Compute capability (major, minor): which machine code the GPU runs.
    pub(crate) compute_capability: (i32, i32),
}

impl Gpu {
    /// The name of the GPU's machine code, `sm_XY` (nvcc's and NVRTC's).
    #[cfg(feature = "cuda")]
    pub(crate) fn arch(&self) -> String {
        let (major, minor) = self.compute_capability;
        format!("sm_{major}{minor}")
    }
}

/// The H200 (sm_90): the GPU a dispatch count for CUDA chooses for (`dispatch::Backend::Cuda`).
const COUNTED_H200: Gpu = Gpu {
    tensor_cores: true,
    multiprocessors: 132,
    shared_memory_per_block: 227 * 1024,
    compute_capability: (9, 0),
};

/// The GPU of `device` where it is a CUDA one: `None` on the other backends, in a build without
/// CUDA, and where the driver does not answer; on the CPU while counting for CUDA, the H200.
/// The one question an op's wrapper asks to know whether a CUDA kernel of its can run (a
/// kernel's own launcher asks [`gpu`]).
pub(crate) fn cuda_gpu(device: &Device) -> Option<Gpu> {
    if device.is_cpu() && crate::dispatch::backend(device) == crate::dispatch::Backend::Cuda {
        return Some(COUNTED_H200);
    }
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        return gpu(dev).ok();
    }
    #[cfg(not(feature = "cuda"))]
    let _ = device;
    None
}

/// The GPU of `dev` (the first device asked, for the whole process).
#[cfg(feature = "cuda")]
pub(crate) fn gpu(dev: &CudaDevice) -> Result<Gpu> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    static GPU: OnceLock<Gpu> = OnceLock::new();
    if let Some(&known) = GPU.get() {
        return Ok(known);
    }
    let ctx = dev.cuda_stream().context().clone();
    let (major, minor) = ctx.compute_capability().w()?;
    let sms = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .w()?;
    let smem = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .w()?;
    Ok(*GPU.get_or_init(|| Gpu {
        tensor_cores: major >= 8,
        multiprocessors: sms.max(1) as usize,
        shared_memory_per_block: smem.max(0) as usize,
        compute_capability: (major, minor),
    }))
}
