//! Choosing the device and dtype from [`LoadOptions`] (KEV.md §6): Auto picks Metal on Apple
//! Silicon, CUDA where built and present, else the CPU; dtype Auto is f32 on the CPU and bf16 on
//! GPUs.

use candle_core::{DType, Device};
use kev_core::{Backend, Error, Result};

/// The candle device for `backend`.
pub fn select_device(backend: Backend) -> Result<Device> {
    let dev_err = |what: &str, e: candle_core::Error| Error::Device {
        message: format!("{what}: {e}"),
    };
    match backend {
        Backend::Cpu => Ok(Device::Cpu),
        Backend::Cuda(i) => {
            if !cfg!(feature = "cuda") {
                return Err(Error::Device { message: "`cuda` requested but this build has no CUDA support: rebuild with `--features cuda`".into() });
            }
            Device::new_cuda(i).map_err(|e| dev_err(&format!("cuda:{i}"), e))
        }
        Backend::Metal(i) => {
            if !cfg!(feature = "metal") {
                return Err(Error::Device { message: "`metal` requested but this build has no Metal support: rebuild with `--features metal` on macOS".into() });
            }
            Device::new_metal(i).map_err(|e| dev_err(&format!("metal:{i}"), e))
        }
        Backend::Auto => {
            if cfg!(feature = "metal") && candle_core::utils::metal_is_available() {
                if let Ok(d) = Device::new_metal(0) {
                    return Ok(d);
                }
            }
            if cfg!(feature = "cuda") && candle_core::utils::cuda_is_available() {
                if let Ok(d) = Device::new_cuda(0) {
                    return Ok(d);
                }
            }
            Ok(Device::Cpu)
        }
    }
}

/// The backbone dtype for `dtype` on `device`.
pub fn select_dtype(dtype: kev_core::DType, device: &Device) -> DType {
    match dtype {
        kev_core::DType::F32 => DType::F32,
        kev_core::DType::BF16 => DType::BF16,
        kev_core::DType::F16 => DType::F16,
        _ if device.is_cpu() => DType::F32,
        _ => DType::BF16,
    }
}
