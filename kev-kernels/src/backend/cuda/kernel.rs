//! Loading and launching Kev's kernels: each [`Source`] as machine code for the GPU at hand,
//! built with the crate for the GPUs the build named (build.rs) or compiled once per process by
//! NVRTC for any other (the driver has no PTX to translate at first use either way), and every
//! launcher loads its entry point through [`Kernel::load`] or [`Kernel::for_dtype`]. The
//! helpers below are what the launchers share.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Device, Layout, Result, Tensor};

use super::gpu::gpu;
use super::sources::{Source, ALL};

impl Source {
    /// The machine code (CUBIN) for the process's GPU, `arch` as `sm_XY`: built with the crate
    /// where the build named that GPU ([`PREBUILT`]), else compiled by NVRTC by the first
    /// caller. NVRTC's compile goes through the driver's cache, so a fresh machine pays it in
    /// full (~15 s for all sources on the H200 machine, 2.5 s with the cache filled).
    fn image(&self, arch: &str) -> Result<&[u8]> {
        if let Some((_, _, image)) = PREBUILT
            .iter()
            .find(|(module, built_for, _)| *module == self.module && *built_for == arch)
        {
            return Ok(image);
        }
        let compiled = self.image.get_or_init(|| {
            let started = Instant::now();
            let image = compile_cubin(&self.text(), self.file, arch, &self.define_options());
            COMPILE_NANOS.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            image
        });
        match compiled {
            Ok(image) => Ok(image),
            Err(e) => bail!(
                "compiling kev-kernels {} with NVRTC for {arch}: {e}",
                self.file
            ),
        }
    }
}

/// Machine code built with the crate (build.rs) per (module, `sm_XY`): loaded as it is, where
/// NVRTC would take a fresh machine ~15 s for all sources.
static PREBUILT: &[(&str, &str, &[u8])] = include!(concat!(env!("OUT_DIR"), "/cuda_images.rs"));

/// Nanoseconds this process spent compiling Kev's sources with NVRTC and loading their machine
/// code, summed over sources (they run on parallel threads).
static COMPILE_NANOS: AtomicU64 = AtomicU64::new(0);
static LOAD_NANOS: AtomicU64 = AtomicU64::new(0);

/// Seconds this process has spent compiling Kev's CUDA sources (NVRTC) and loading their
/// machine code into the driver, each summed over sources: where a slow [`prepare_kernels`]
/// went.
pub fn kernel_seconds() -> (f64, f64) {
    let seconds = |n: &AtomicU64| n.load(Ordering::Relaxed) as f64 * 1e-9;
    (seconds(&COMPILE_NANOS), seconds(&LOAD_NANOS))
}

/// NVRTC's CUBIN of `text` for `arch` (`sm_XY`) with `defines`, or NVRTC's error and log.
fn compile_cubin(
    text: &str,
    file: &str,
    arch: &str,
    defines: &[String],
) -> std::result::Result<Vec<u8>, String> {
    use candle_core::cuda_backend::cudarc::nvrtc::{result, sys};
    use std::ffi::{CStr, CString};

    let src = CString::new(text).map_err(|e| e.to_string())?;
    let name = CString::new(file).map_err(|e| e.to_string())?;
    let prog = result::create_program(&src, Some(&name)).map_err(|e| format!("{e:?}"))?;
    let mut options = vec![format!("--gpu-architecture={arch}")];
    options.extend_from_slice(defines);
    // SAFETY: `prog` is a live program until `destroy_program` below; every buffer handed to
    // NVRTC is as long as NVRTC said it must be.
    let out = unsafe {
        match result::compile_program(prog, &options) {
            Err(e) => {
                let log = result::get_program_log(prog)
                    .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
                    .unwrap_or_default();
                Err(format!("{e:?}: {log}"))
            }
            Ok(()) => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| format!("{e:?}"))?;
                let mut image = vec![0u8; size];
                sys::nvrtcGetCUBIN(prog, image.as_mut_ptr().cast())
                    .result()
                    .map_err(|e| format!("{e:?}"))?;
                Ok(image)
            }
        }
    };
    // SAFETY: `prog` came from `create_program` and is not used after this.
    unsafe { result::destroy_program(prog) }.map_err(|e| format!("{e:?}"))?;
    out
}

/// The loaded module of `source` on `dev`'s GPU. Modules are kept per GPU for the process
/// (holding its context): candle's own module cache takes PTX text, not machine code.
fn module(source: &Source, dev: &CudaDevice) -> Result<Arc<CudaModule>> {
    static MODULES: Mutex<Vec<(usize, &'static str, Arc<CudaModule>)>> = Mutex::new(Vec::new());
    let ctx = dev.cuda_stream().context().clone();
    let ordinal = ctx.ordinal();
    let find = |modules: &[(usize, &'static str, Arc<CudaModule>)]| {
        modules
            .iter()
            .find(|(o, m, _)| *o == ordinal && *m == source.module)
            .map(|(_, _, module)| module.clone())
    };
    if let Some(found) = find(&MODULES.lock().unwrap_or_else(|p| p.into_inner())) {
        return Ok(found);
    }
    // Compiled outside the lock: sources compile in parallel in `prepare`.
    let image = source.image(&gpu(dev)?.arch())?.to_vec();
    let mut modules = MODULES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(found) = find(&modules) {
        return Ok(found);
    }
    let started = Instant::now();
    let loaded = ctx.load_module(Ptx::from_binary(image)).w()?;
    LOAD_NANOS.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
    modules.push((ordinal, source.module, loaded.clone()));
    Ok(loaded)
}

/// Compiles and loads every Kev kernel on `dev` (NVRTC compiles the sources in parallel), so
/// that the first forward pays for none of it. A model load runs this beside reading its
/// weights. The forward launches no candle kernel: candle's modules are PTX, which the driver
/// would take seconds each to translate in a fresh process.
pub fn prepare_kernels(dev: &CudaDevice) -> Result<()> {
    std::thread::scope(|scope| {
        let ours: Vec<_> = ALL
            .iter()
            .filter(|s| !s.tensor_cores || gpu(dev).is_ok_and(|g| g.tensor_cores))
            .map(|&s| scope.spawn(move || module(s, dev).map(drop)))
            .collect();
        ours.into_iter().try_for_each(|h| {
            h.join()
                .unwrap_or_else(|_| bail!("a kernel compile panicked"))
        })
    })
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
        let func = module(source, dev)?.load_function(name).w()?;
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
    device_table(dev, t)
}

/// `t`, u32 already on the device (a view of a table, [`crate::SplitBatch::table`]), as a
/// kernel argument.
pub(crate) fn device_table(dev: &CudaDevice, t: Tensor) -> Result<DeviceLengths> {
    let ptr = {
        let (storage, layout) = t.storage_and_layout();
        let candle_core::Storage::Cuda(s) = &*storage else {
            bail!("row lengths are not on the CUDA device")
        };
        if !layout.is_contiguous() {
            bail!("row lengths must be contiguous")
        }
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

/// A row-striding launch: blocks of 256 threads over `units` per row (at most 1024 blocks,
/// striding), one block row per row up to CUDA's 65535 (the kernel strides over the rest).
pub(crate) fn rows_grid(units: usize, rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            units.div_ceil(256).clamp(1, 1024) as u32,
            rows.clamp(1, 65535) as u32,
            1,
        ),
        block_dim: (256, 1, 1),
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
