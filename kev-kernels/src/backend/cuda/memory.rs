//! The device memory pool: keeping freed memory, handing it back, and its high-water mark.

use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, Result};

/// Keeps freed device memory in the device's default pool (where cudarc's stream-ordered
/// allocations come from) instead of handing it back to the driver at every synchronisation:
/// the pool's release threshold is 0 by default, so each request's first allocations after the
/// previous request's final sync mapped fresh memory. PyTorch's caching allocator keeps memory
/// the same way.
pub fn keep_device_memory(dev: &CudaDevice) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let cu_dev = dev.cuda_stream().context().cu_device();
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: plain driver calls on a valid device handle, with pointers to locals that
    // outlive them; the attribute takes a u64.
    let code = unsafe {
        match sys::cuDeviceGetDefaultMemPool(&mut pool, cu_dev) {
            sys::CUresult::CUDA_SUCCESS => sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            ),
            other => other,
        }
    };
    match code {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        other => bail!("setting the device memory pool's release threshold: {other:?}"),
    }
}

/// Hands the memory kept in the device's default pool ([`keep_device_memory`]) back to the
/// driver once the stream's work is done. Memory kept there serves only stream-ordered
/// allocations: after a forward ran out of memory, its freed intermediates held in the pool would
/// starve everything that allocates from the driver directly (cuBLAS's workspaces, module loads,
/// another library in the process), so a failed forward ends with this.
pub fn release_device_memory(dev: &CudaDevice) -> Result<()> {
    dev.cuda_stream().synchronize().w()?;
    trim_pool(dev.cuda_stream().context().cu_device())
}

/// [`release_device_memory`] for the GPU `ordinal` before a device is made on it: creating one
/// allocates cuBLAS's workspace from the driver, which fails while the pool holds the memory
/// that an earlier failure (or other tensors since freed) left there.
pub fn release_device_memory_of(ordinal: usize) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    let ctx = CudaContext::new(ordinal).w()?;
    ctx.synchronize().w()?;
    trim_pool(ctx.cu_device())
}

/// Trims the default pool of `cu_dev` to nothing kept.
fn trim_pool(cu_dev: candle_core::cuda_backend::cudarc::driver::sys::CUdevice) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: plain driver calls on a valid device handle, with a pointer to a local that
    // outlives them; trimming only returns memory no allocation holds.
    let code = unsafe {
        match sys::cuDeviceGetDefaultMemPool(&mut pool, cu_dev) {
            sys::CUresult::CUDA_SUCCESS => sys::cuMemPoolTrimTo(pool, 0),
            other => other,
        }
    };
    match code {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        other => bail!("handing the device memory pool's free memory back: {other:?}"),
    }
}

/// The most memory Kev's tensors had in use at once since the previous call with `reset` (or
/// since the pools were created), in bytes: the high-water mark of the device's default pool
/// (eager forwards) plus that of its graph pool (forwards replayed as CUDA graphs, whose memory
/// the driver keeps apart). The two peaks need not coincide, so their sum is an upper bound when
/// both kinds ran. With `reset`, the marks go to zero and the driver raises them again from the
/// next allocation on, to the memory in use then. This is what PyTorch's `max_memory_allocated`
/// measures: tensors only, not the CUDA context, cuBLAS's workspace or memory kept for reuse.
pub fn pool_peak_bytes(dev: &CudaDevice, reset: bool) -> Result<u64> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let cu_dev = dev.cuda_stream().context().cu_device();
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let (mut eager, mut graphs) = (0u64, 0u64);
    let check = |code: sys::CUresult, what: &str| match code {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(candle_core::Error::Msg(format!(
            "reading the {what} high-water mark: {other:?}"
        ))),
    };
    // SAFETY: plain driver calls on a valid device handle, with pointers to locals that outlive
    // them; both attributes are u64, and the driver accepts 0 to reset them.
    unsafe {
        check(
            sys::cuDeviceGetDefaultMemPool(&mut pool, cu_dev),
            "memory pool's",
        )?;
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        check(
            sys::cuMemPoolGetAttribute(pool, attr, (&mut eager as *mut u64).cast()),
            "memory pool's",
        )?;
        let graph_attr = sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH;
        check(
            sys::cuDeviceGetGraphMemAttribute(cu_dev, graph_attr, (&mut graphs as *mut u64).cast()),
            "graph memory's",
        )?;
        if reset {
            let mut zero = 0u64;
            check(
                sys::cuMemPoolSetAttribute(pool, attr, (&mut zero as *mut u64).cast()),
                "memory pool's",
            )?;
            check(
                sys::cuDeviceSetGraphMemAttribute(
                    cu_dev,
                    graph_attr,
                    (&mut zero as *mut u64).cast(),
                ),
                "graph memory's",
            )?;
        }
    }
    Ok(eager + graphs)
}
