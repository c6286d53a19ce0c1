//! Loading and launching Kev's kernels: NVRTC compiles each [`Source`] once per process (so
//! building needs no nvcc for our own code and head sizes stay runtime values), and every
//! launcher loads its entry point through [`Kernel::load`] or [`Kernel::for_dtype`], which
//! pick the PTX target. The helpers below are what the launchers share.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
};
use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Device, Layout, Result, Tensor};

use super::gpu::gpu;
use super::sources::Source;

impl Source {
    /// The PTX, compiled for `arch` (NVRTC's default target where None) by the first caller.
    fn ptx(&self, arch: Option<&'static str>) -> Result<&str> {
        let compiled = self.ptx.get_or_init(|| {
            let opts = CompileOptions {
                name: Some(self.file.into()),
                arch,
                options: self.define_options(),
                ..Default::default()
            };
            compile_ptx_with_opts(self.text(), opts)
                .map(|p| p.to_src())
                .map_err(|e| e.to_string())
        });
        match compiled {
            Ok(p) => Ok(p.as_str()),
            Err(e) => bail!("compiling kev-kernels {} with NVRTC: {e}", self.file),
        }
    }
}

/// A loaded kernel and the stream it runs on.
pub(crate) struct Kernel {
    pub(crate) dev: CudaDevice,
    pub(crate) func: CudaFunction,
    pub(crate) stream: Arc<CudaStream>,
}

impl Kernel {
    /// Entry point `name` of `source` on `dev`.
    pub(crate) fn load(source: &Source, dev: &CudaDevice, name: &str) -> Result<Self> {
        // The tensor-core sources (the chunked delta rule, flash attention) need compute_80 PTX
        // (mma.sync, ldmatrix, cp.async); everything else compiles for NVRTC's default target
        // and runs on any CUDA GPU.
        let arch = (source.tensor_cores && gpu(dev)?.tensor_cores).then_some("compute_80");
        let func = dev
            .get_or_load_custom_func(name, source.module, source.ptx(arch)?)?
            .into_cuda_function();
        Ok(Self {
            dev: dev.clone(),
            func,
            stream: dev.cuda_stream(),
        })
    }

    /// The `dtype` variant `<stem>_<f32|bf16|f16>` of an entry point; `op` names the op in the
    /// error for another dtype.
    pub(crate) fn for_dtype(
        source: &Source,
        dev: &CudaDevice,
        stem: &str,
        dtype: DType,
        op: &str,
    ) -> Result<Self> {
        Self::load(source, dev, &format!("{stem}_{}", tag(dtype, op)?))
    }

    /// Lets the kernel ask for `bytes` of dynamic shared memory, more than the 48 KiB a kernel
    /// gets without asking. Set on every launch: candle loads modules per `CudaDevice`, so a
    /// cache of "already set" would have to follow its module cache; one driver call is cheap.
    pub(crate) fn allow_shared_memory(&self, bytes: u32) -> Result<()> {
        self.func
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .w()?;
        Ok(())
    }

    /// An output buffer of `n` elements every launch fully overwrites.
    pub(crate) fn output<T: DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: every kernel of ours writes every element of its output (padding included).
        unsafe { self.dev.alloc::<T>(n) }
    }
}

/// The entry-point suffix of a dtype.
pub(crate) fn tag(dtype: DType, op: &str) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => bail!("{op}: unsupported dtype {other:?} on CUDA"),
    })
}

pub(crate) fn contiguous(l: &Layout, what: &str) -> Result<(usize, usize)> {
    match l.contiguous_offsets() {
        Some(r) => Ok(r),
        None => bail!("{what} must be contiguous"),
    }
}

/// Per-row lengths as a kernel argument: their device address, or 0 (the kernels' "no row is
/// padded"). They go up through [`crate::uploads`], so a CUDA graph capture reuses the copy its
/// recording pass made; `_keep` holds that copy until the launch is queued.
pub(crate) struct DeviceLengths {
    _keep: Option<Tensor>,
    pub(crate) ptr: u64,
}

pub(crate) fn device_lengths(dev: &CudaDevice, lengths: Option<&[u32]>) -> Result<DeviceLengths> {
    let Some(lengths) = lengths else {
        return Ok(DeviceLengths {
            _keep: None,
            ptr: 0,
        });
    };
    let t = crate::uploads::upload(lengths.to_vec(), lengths.len(), &Device::Cuda(dev.clone()))?;
    let ptr = {
        let (storage, layout) = t.storage_and_layout();
        let candle_core::Storage::Cuda(s) = &*storage else {
            bail!("row lengths were not uploaded to the CUDA device")
        };
        let stream = dev.cuda_stream();
        let slice = s.as_cuda_slice::<u32>()?.slice(layout.start_offset()..);
        let (ptr, _sync) = slice.device_ptr(&stream);
        ptr
    };
    Ok(DeviceLengths {
        _keep: Some(t),
        ptr,
    })
}

/// Blocks of a grid-stride launch: a few waves on a large GPU, instead of one block per 256
/// elements (~100k short blocks for a batch's activations; ncu on the 0.8B batch: SwiGLU
/// 2.18 → 2.04 ms with the cap).
const STRIDE_BLOCKS: usize = 2048;

/// A 1-D grid-stride launch over `n` elements.
pub(crate) fn grid_for(n: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            n.div_ceil(block as usize).clamp(1, STRIDE_BLOCKS) as u32,
            1,
            1,
        ),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The CUDA storage of an input an op carries beside its operands.
pub(crate) fn cuda_of<'a>(s: &'a candle_core::Storage, what: &str) -> Result<&'a CudaStorage> {
    match s {
        candle_core::Storage::Cuda(c) => Ok(c),
        _ => bail!("{what} is not on the GPU"),
    }
}
