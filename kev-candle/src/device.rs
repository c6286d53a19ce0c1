//! Choosing the device and dtype from [`LoadOptions`](kev_core::LoadOptions) (docs/CONTRACT.md §6): Auto picks Metal on Apple
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
            let dev = new_cuda(i).map_err(|e| dev_err(&format!("cuda:{i}"), e))?;
            single_stream(&dev);
            Ok(dev)
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
                if let Ok(d) = new_cuda(0) {
                    single_stream(&d);
                    return Ok(d);
                }
            }
            Ok(Device::Cpu)
        }
    }
}

/// A CUDA device on GPU `ordinal`, after the GPU's pool has handed its free memory back
/// ([`kev_kernels::release_device_memory_of`]): the device's cuBLAS workspace comes from the
/// driver, not the pool.
fn new_cuda(ordinal: usize) -> candle_core::Result<Device> {
    #[cfg(feature = "cuda")]
    kev_kernels::release_device_memory_of(ordinal)?;
    Device::new_cuda(ordinal)
}

/// cudarc's per-buffer event tracking (two CUDA events created and destroyed with every
/// allocation) costs time on every op of a launch-bound forward, and Kev orders its few
/// cross-thread tensors itself (docs/DESIGN.md, "Event tracking"). Freed memory stays in the
/// device's pool for the next request ([`kev_kernels::keep_device_memory`]); where the driver
/// refuses, it is only slower.
fn single_stream(dev: &Device) {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        // SAFETY: a tensor is used on another thread's stream only once complete (the weights
        // after the load's `settle`, a prefix after its logits were read back, the rotary
        // tables after their upload's synchronisation; docs/DESIGN.md, "Event tracking").
        unsafe { d.disable_event_tracking() }
        let _ = kev_kernels::keep_device_memory(d);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = dev;
}

/// `result`, after handing the device pool's free memory back to the driver where it is a
/// backend error on CUDA ([`kev_kernels::release_device_memory`]): a forward that ran out of
/// device memory leaves its freed intermediates in the pool, where only stream-ordered
/// allocations can use them, and the model must stay usable after the error.
pub(crate) fn recovered<T>(dev: &Device, result: Result<T>) -> Result<T> {
    #[cfg(feature = "cuda")]
    if let (Device::Cuda(d), Err(Error::Backend { .. })) = (dev, &result) {
        // Best effort: the forward's own error is the one to report.
        let _ = kev_kernels::release_device_memory(d);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = dev;
    result
}

/// The device's memory in bytes, where the backend says (the CUDA driver's total for the card);
/// `None` elsewhere.
pub fn total_memory(dev: &Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        return d.cuda_stream().context().total_mem().ok().map(|b| b as u64);
    }
    let _ = dev;
    None
}

/// Waits until everything issued on `dev` so far has completed. candle's CUDA device issues
/// work on the calling thread's per-thread stream, so weights uploaded while loading on one
/// thread have no ordering with a forward started on another: the load ends with a context-wide
/// synchronisation instead.
pub fn settle(dev: &Device) -> Result<()> {
    let err = |e: String| Error::Device {
        message: format!("waiting for the device after loading: {e}"),
    };
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        return d
            .cuda_stream()
            .context()
            .synchronize()
            .map_err(|e| err(e.to_string()));
    }
    dev.synchronize().map_err(|e| err(e.to_string()))
}

/// The backbone dtype for `dtype` on `device` (`int8`'s activations are f32).
pub fn select_dtype(dtype: kev_core::DType, device: &Device) -> DType {
    match dtype {
        kev_core::DType::F32 | kev_core::DType::Int8 => DType::F32,
        kev_core::DType::BF16 => DType::BF16,
        kev_core::DType::F16 => DType::F16,
        _ if device.is_cpu() => DType::F32,
        _ => DType::BF16,
    }
}

/// Hands the memory the load freed back to the system. glibc keeps freed blocks in its arenas
/// (one per thread that allocated), and the load's transient copies (the LoRA fold's f32
/// tensors, packing buffers, the safetensors' pages) would otherwise stay resident for the
/// process's life.
pub fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only returns free memory of glibc's arenas to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Keeps the memory a forward frees for the next one, for the whole process (glibc: large
/// blocks from the heap instead of fresh `mmap`s, and the heap's top never trimmed). A CPU
/// forward allocates activations of tens of MB per op; glibc maps each one anew and unmaps it
/// when freed, so every batch page-faults its working set again (BENCHMARKS.md, "CPU: `score`
/// at scale": a third of the system time, a fifth of the faults, the same peak RSS).
/// Process-wide, so for programs that are the scorer
/// (`score`, `kev-serve`); the library never calls it. A model load still hands its transient
/// copies back ([`release_freed_memory`] trims explicitly).
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets glibc's allocation parameters; called before the threads that
    // allocate start, as its manual asks.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

/// A candle error as [`Error::Backend`], naming what was being done (`context`).
pub(crate) fn backend_err(context: &str) -> impl Fn(candle_core::Error) -> Error + '_ {
    move |e| Error::backend(context.to_string(), e)
}
