//! CUDA implementations of the ops. The kernels (`kernels/ops.cu`) are compiled once per
//! process with NVRTC, so building needs no nvcc for our own code and head sizes stay runtime
//! values; see the source for grids, ownership and layouts.

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtr, DeviceRepr, LaunchConfig,
    PushKernelArg,
};
use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Device, Layout, Result, Shape, Tensor};

use crate::causal_conv1d::CausalConv1d;
use crate::gated_delta_rule::{GatedDeltaRule, GdrSplit};
use crate::rows::{rows, strided4};
use crate::split::SplitRows;

/// A CUDA source file (`common.cuh` prepended), compiled to PTX with NVRTC on first use and
/// loaded as its own module, so a process pays only for the sources it runs.
struct Source {
    file: &'static str,
    module: &'static str,
    text: &'static str,
    ptx: OnceLock<std::result::Result<String, String>>,
}

static OPS: Source = Source {
    file: "ops.cu",
    module: "kev_ops",
    text: concat!(
        include_str!("kernels/common.cuh"),
        include_str!("kernels/ops.cu")
    ),
    ptx: OnceLock::new(),
};

static GDR_CHUNKED: Source = Source {
    file: "gdr_chunked.cu",
    module: "kev_gdr_chunked",
    text: concat!(
        include_str!("kernels/common.cuh"),
        include_str!("kernels/mma.cuh"),
        include_str!("kernels/gdr_chunked.cu")
    ),
    ptx: OnceLock::new(),
};

static FLASH_ATTN: Source = Source {
    file: "flash_attn.cu",
    module: "kev_flash_attn",
    text: concat!(
        include_str!("kernels/common.cuh"),
        include_str!("kernels/mma.cuh"),
        include_str!("kernels/flash_attn.cu")
    ),
    ptx: OnceLock::new(),
};

/// Query rows per block, threads and dynamic shared memory of `flash_attn_bf16` (`FA_BM`,
/// `FA_THREADS`, `FA_SMEM` in flash_attn.cu).
const FLASH_ROWS: usize = 64;
const FLASH_THREADS: u32 = 128;
const FLASH_SMEM: u32 = 101632;

/// Warps per block of the recurrence kernel (`WARPS` in ops.cu).
const GDR_WARPS: usize = 8;
/// Steps per chunk, threads per block, the largest Dk and Dv, and the dynamic shared memory of the
/// chunked kernels (`CH`, `CH_THREADS`, `DM`, `PREP_SMEM`, `SCAN_SMEM`, `PREP_TC_SMEM`,
/// `ScanTc<NCOL>::BYTES` in gdr_chunked.cu).
const GDRC_CHUNK: usize = 32;
const GDRC_THREADS: u32 = 128;
/// Threads per block of the tensor-core pair (`TC_THREADS`).
const GDRC_TC_THREADS: u32 = 256;
const GDRC_MAX_DIM: usize = 128;
const GDRC_PREP_SMEM: u32 = 70016;
const GDRC_SCAN_SMEM: u32 = 77824;
const GDRC_PREP_TC_SMEM: u32 = 48512;
/// The tensor-core scans' columns per block (`NCOL`), widest first, with their shared memory.
const GDRC_SCAN_TC: [(usize, &str, u32); 3] = [
    (64, "gdrc_scan_tc64_", 101376),
    (32, "gdrc_scan_tc_", 82944),
    (16, "gdrc_scan_tc16_", 73728),
];
/// `mode` bits of the tensor-core scans (`SCAN_*` in gdr_chunked.cu): read the state first (else
/// start at zero), write it at the end, read each row's state from its owner's (row 0's without
/// an owner list).
const SCAN_READ: i32 = 1;
const SCAN_WRITE: i32 = 2;
const SCAN_SHARED: i32 = 4;
const CONV_BLOCK: u32 = 256;
/// Steps per thread of the cached conv (`CONV_RUN` in ops.cu).
const CONV_RUN: usize = 4;
/// Channels per thread of the cached conv (`CONV_VEC` in ops.cu).
const CONV_VEC: u32 = 8;
/// Threads per block of the cached conv: each moves CONV_VEC channels (ops.cu's launch bounds
/// for `conv_cached_*` and `conv_split_*` assume 128).
const CONV_CACHED_BLOCK: u32 = 128;

impl Source {
    /// The PTX, compiled for `arch` (NVRTC's default target where None) by the first caller.
    fn ptx(&self, arch: Option<&'static str>) -> Result<&str> {
        let compiled = self.ptx.get_or_init(|| {
            let opts = CompileOptions {
                name: Some(self.file.into()),
                arch,
                ..Default::default()
            };
            compile_ptx_with_opts(self.text, opts)
                .map(|p| p.to_src())
                .map_err(|e| e.to_string())
        });
        match compiled {
            Ok(p) => Ok(p.as_str()),
            Err(e) => bail!("compiling kev-kernels {} with NVRTC: {e}", self.file),
        }
    }
}

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
    use candle_core::cuda_backend::cudarc::driver::sys;
    dev.cuda_stream().synchronize().w()?;
    let cu_dev = dev.cuda_stream().context().cu_device();
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

/// What the launch choices need to know of the GPU. Asked once per process, by the first device,
/// like the PTX target of each source (`Source::ptx`): a process mixing GPU kinds is not
/// supported.
#[derive(Clone, Copy)]
struct Gpu {
    /// mma.sync on TF32 and bf16 operands (compute capability 8.0 and later).
    tensor_cores: bool,
    multiprocessors: usize,
    /// The most shared memory a block may ask for (227 KB on Hopper, 99 KB on sm_86/89).
    shared_memory_per_block: usize,
}

/// Whether `device` is a CUDA GPU with the tensor cores the chunked kernels use.
pub(crate) fn has_tensor_cores(device: &Device) -> bool {
    match device {
        Device::Cuda(dev) => gpu(dev).is_ok_and(|g| g.tensor_cores),
        _ => false,
    }
}

/// The multiprocessor count of `device` where it runs [`flash_attention`]'s kernel: a CUDA GPU
/// with tensor cores and room for the kernel's shared memory in a block.
pub(crate) fn flash_multiprocessors(device: &Device) -> Option<usize> {
    match device {
        Device::Cuda(dev) => gpu(dev)
            .ok()
            .filter(|g| g.tensor_cores && g.shared_memory_per_block >= FLASH_SMEM as usize)
            .map(|g| g.multiprocessors),
        _ => None,
    }
}

fn gpu(dev: &CudaDevice) -> Result<Gpu> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    static GPU: OnceLock<Gpu> = OnceLock::new();
    if let Some(&known) = GPU.get() {
        return Ok(known);
    }
    let ctx = dev.cuda_stream().context().clone();
    let (major, _) = ctx.compute_capability().w()?;
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
    }))
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

/// A loaded kernel and the stream it runs on.
struct Kernel {
    dev: CudaDevice,
    func: CudaFunction,
    stream: std::sync::Arc<CudaStream>,
}

impl Kernel {
    fn load(dev: &CudaDevice, name: &str) -> Result<Self> {
        Self::load_from(&OPS, dev, name)
    }

    fn load_from(src: &Source, dev: &CudaDevice, name: &str) -> Result<Self> {
        // The chunked delta rule's and flash attention's tensor-core kernels need compute_80 PTX
        // (mma.sync, ldmatrix, cp.async); everything else compiles for NVRTC's default target
        // and runs on any CUDA GPU.
        let mma = std::ptr::eq(src, &GDR_CHUNKED) || std::ptr::eq(src, &FLASH_ATTN);
        let arch = (mma && gpu(dev)?.tensor_cores).then_some("compute_80");
        let func = dev
            .get_or_load_custom_func(name, src.module, src.ptx(arch)?)?
            .into_cuda_function();
        Ok(Self {
            dev: dev.clone(),
            func,
            stream: dev.cuda_stream(),
        })
    }

    /// Lets the kernel ask for `bytes` of dynamic shared memory, more than the 48 KiB a kernel
    /// gets without asking. Set on every launch: candle loads modules per `CudaDevice`, so a
    /// cache of "already set" would have to follow its module cache; one driver call is cheap.
    fn allow_shared_memory(&self, bytes: u32) -> Result<()> {
        self.func
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .w()?;
        Ok(())
    }

    /// An output buffer of `n` elements every launch fully overwrites.
    fn output<T: DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: every kernel of ours writes every element of its output (padding included).
        unsafe { self.dev.alloc::<T>(n) }
    }
}

fn tag(dtype: DType, op: &str) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => bail!("{op}: unsupported dtype {other:?} on CUDA"),
    })
}

fn contiguous(l: &Layout, what: &str) -> Result<(usize, usize)> {
    match l.contiguous_offsets() {
        Some(r) => Ok(r),
        None => bail!("{what} must be contiguous"),
    }
}

/// State columns per warp in the recurrence: more columns share each step's staged q/k and
/// make fewer blocks, fewer give more warps to a short batch. `gdr_bench` on the H200: 4 columns
/// win from 128 (row, head) pairs, 1 column below 64.
fn gdr_cols(heads: usize, dv: usize) -> usize {
    let cols = match heads {
        128.. => 4,
        64.. => 2,
        _ => 1,
    };
    if dv.is_multiple_of(cols) {
        cols
    } else {
        1
    }
}

/// Launches `name_<dtype>` on `dtype` storages: `$body` runs with `$t` bound to the element type.
macro_rules! by_dtype {
    ($dtype:expr, $op:expr, |$t:ident| $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            DType::F16 => {
                type $t = half::f16;
                $body
            }
            other => bail!("{}: unsupported dtype {other:?} on CUDA", $op),
        }
    };
}

/// Per-row lengths as a kernel argument: their device address, or 0 (the kernels' "no row is
/// padded"). They go up through [`crate::uploads`], so a CUDA graph capture reuses the copy its
/// recording pass made; `_keep` holds that copy until the launch is queued.
struct DeviceLengths {
    _keep: Option<Tensor>,
    ptr: u64,
}

fn device_lengths(dev: &CudaDevice, lengths: Option<&[u32]>) -> Result<DeviceLengths> {
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

/// The delta rule's lengths (rows of `steps` steps), or none when no row is padded (most calls:
/// one upload fewer).
fn gdr_lengths(dev: &CudaDevice, lengths: &[u32], steps: usize) -> Result<DeviceLengths> {
    let padded = lengths.iter().any(|&l| l as usize != steps);
    device_lengths(dev, padded.then_some(lengths))
}

pub(crate) fn gated_delta_rule(
    op: &GatedDeltaRule,
    state: &mut CudaStorage,
    sl: &Layout,
    qkv: &CudaStorage,
    ql: &Layout,
    gb: &CudaStorage,
    gl: &Layout,
) -> Result<()> {
    let dims = op.dims;
    // (An empty sequence has no chunk to launch a grid over.)
    if op.chunked() && op.seq_len > 0 && dims.head_k_dim.max(dims.head_v_dim) <= GDRC_MAX_DIM {
        return gated_delta_rule_chunked(op, state, sl, qkv, ql, gb, gl);
    }
    let nk = dims.head_k_dim.div_ceil(32).next_power_of_two();
    if nk > 8 {
        bail!(
            "gated-delta-rule: head_k_dim {} > 256 is not supported on CUDA",
            dims.head_k_dim
        )
    }
    let cols = gdr_cols(op.b_sz * dims.num_v_heads, dims.head_v_dim);
    let k = Kernel::load(
        qkv.device(),
        &format!(
            "gdr_{}_nk{nk}_c{cols}",
            tag(qkv.dtype(), "gated-delta-rule")?
        ),
    )?;
    let (q0, q1) = contiguous(ql, "gated-delta-rule qkv")?;
    let (g0, g1) = contiguous(gl, "gated-delta-rule gates")?;
    let (s0, s1) = contiguous(sl, "gated-delta-rule state")?;
    let lengths = gdr_lengths(&k.dev, &op.lengths, op.seq_len)?;
    let gb = gb.as_cuda_slice::<f32>()?.slice(g0..g1);
    let mut st = state.as_cuda_slice_mut::<f32>()?.slice_mut(s0..s1);
    let n_out = op.b_sz * op.seq_len * dims.num_v_heads * dims.head_v_dim;
    let cfg = LaunchConfig {
        grid_dim: (
            dims.head_v_dim.div_ceil(GDR_WARPS * cols) as u32,
            (op.b_sz * dims.num_v_heads) as u32,
            1,
        ),
        block_dim: ((32 * GDR_WARPS) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let ints = [
        op.seq_len,
        dims.num_k_heads,
        dims.num_v_heads,
        dims.head_k_dim,
        dims.head_v_dim,
    ]
    .map(|x| x as i32);
    by_dtype!(qkv.dtype(), "gated-delta-rule", |T| {
        let x = qkv.as_cuda_slice::<T>()?.slice(q0..q1);
        let out = k.output::<T>(n_out)?;
        let mut b = k.stream.launch_builder(&k.func);
        b.arg(&x).arg(&gb).arg(&mut st).arg(&out);
        b.arg(&lengths.ptr);
        for v in &ints {
            b.arg(v);
        }
        // SAFETY: argument types and order match `gdr_*` in ops.cu; the wrapper checked
        // every shape, so all indices stay inside the buffers.
        unsafe { b.launch(cfg) }.w()?;
        op.set_output(candle_core::Storage::Cuda(CudaStorage::wrap_cuda_slice(
            out,
            k.dev.clone(),
        )));
        Ok(())
    })
}

/// The chunked form (gdr_chunked.cu): a preparation kernel per chunk writes the state-free
/// products to f32 scratch, then a scan kernel per 32 state columns walks the chunks.
fn gated_delta_rule_chunked(
    op: &GatedDeltaRule,
    state: &mut CudaStorage,
    sl: &Layout,
    qkv: &CudaStorage,
    ql: &Layout,
    gb: &CudaStorage,
    gl: &Layout,
) -> Result<()> {
    let dims = op.dims;
    let dtag = tag(qkv.dtype(), "gated-delta-rule")?;
    // bf16/f16 on tensor cores (TF32 products in the preparation, bf16 in the scan) where the GPU
    // has them; f32 models keep full f32 products. The two pairs lay out W, Q', K' and Aqk
    // differently, so they never mix.
    let tc = qkv.dtype() != DType::F32 && gpu(qkv.device())?.tensor_cores;
    let heads = op.b_sz * dims.num_v_heads;
    let load = |name: &str| Kernel::load_from(&GDR_CHUNKED, qkv.device(), &format!("{name}{dtag}"));
    let prep_smem = if tc {
        GDRC_PREP_TC_SMEM
    } else {
        GDRC_PREP_SMEM
    };
    let prep = load(if tc { "gdrc_prep_tc_" } else { "gdrc_prep_" })?;
    prep.allow_shared_memory(prep_smem)?;
    let (scan, scan_cols, scan_smem) = if tc {
        tc_scan(qkv.device(), dtag, heads, dims.head_v_dim)?
    } else {
        let scan = load("gdrc_scan_")?;
        scan.allow_shared_memory(GDRC_SCAN_SMEM)?;
        (scan, 32, GDRC_SCAN_SMEM)
    };
    let (q0, q1) = contiguous(ql, "gated-delta-rule qkv")?;
    let (g0, g1) = contiguous(gl, "gated-delta-rule gates")?;
    let (s0, s1) = contiguous(sl, "gated-delta-rule state")?;
    let lengths = gdr_lengths(&prep.dev, &op.lengths, op.seq_len)?;
    let gb = gb.as_cuda_slice::<f32>()?.slice(g0..g1);
    let mut st = state.as_cuda_slice_mut::<f32>()?.slice_mut(s0..s1);
    let chunks = op.seq_len.div_ceil(GDRC_CHUNK);
    let layout = ScratchLayout::new(heads * chunks, dims.head_v_dim, tc);
    let scratch = prep.output::<f32>(layout.total())?;
    let [wt, qt, kd, at, u, gtot] = layout.parts(&scratch, 0);
    let [t, hk, hv, dk, dv, nc] = [
        op.seq_len,
        dims.num_k_heads,
        dims.num_v_heads,
        dims.head_k_dim,
        dims.head_v_dim,
        chunks,
    ]
    .map(|x| x as i32);
    let block = (if tc { GDRC_TC_THREADS } else { GDRC_THREADS }, 1, 1);
    by_dtype!(qkv.dtype(), "gated-delta-rule", |T| {
        let x = qkv.as_cuda_slice::<T>()?.slice(q0..q1);
        let mut b = prep.stream.launch_builder(&prep.func);
        b.arg(&x).arg(&gb);
        b.arg(&lengths.ptr);
        b.arg(&wt).arg(&u).arg(&qt).arg(&kd).arg(&at).arg(&gtot);
        b.arg(&t).arg(&hk).arg(&hv).arg(&dk).arg(&dv);
        let cfg = LaunchConfig {
            grid_dim: (chunks as u32, heads as u32, 1),
            block_dim: block,
            shared_mem_bytes: prep_smem,
        };
        // SAFETY: argument types and order match `gdrc_prep_*`; the scratch sizes follow the
        // grid (one block per chunk and head, Dk, Dv ≤ 128 checked by the caller).
        unsafe { b.launch(cfg) }.w()?;

        let out = scan.output::<T>(op.b_sz * op.seq_len * dims.num_v_heads * dims.head_v_dim)?;
        let mut b = scan.stream.launch_builder(&scan.func);
        b.arg(&wt).arg(&u).arg(&qt).arg(&kd).arg(&at).arg(&gtot);
        b.arg(&mut st);
        let no_owners = 0u64;
        if tc {
            b.arg(&no_owners);
        }
        b.arg(&out);
        b.arg(&t).arg(&hv).arg(&dk).arg(&dv).arg(&nc);
        let mode = SCAN_READ | SCAN_WRITE;
        if tc {
            b.arg(&mode);
        }
        let cfg = LaunchConfig {
            grid_dim: (dims.head_v_dim.div_ceil(scan_cols) as u32, heads as u32, 1),
            block_dim: block,
            shared_mem_bytes: scan_smem,
        };
        // SAFETY: argument types and order match `gdrc_scan_*`; reads stay inside the scratch
        // written above, the state and output have the shapes the wrapper checked.
        unsafe { b.launch(cfg) }.w()?;
        op.set_output(candle_core::Storage::Cuda(CudaStorage::wrap_cuda_slice(
            out,
            scan.dev.clone(),
        )));
        Ok(())
    })
}

/// The tensor-core scan for `heads` (row · head) pairs: the most state columns per block that
/// still give every multiprocessor a block (a batch's states: 64, one wave of two blocks per
/// multiprocessor; a long state's few pairs: 16). Wider blocks read each chunk's operands fewer
/// times and do more work per round of latency. The kernel, its columns and shared memory.
fn tc_scan(dev: &CudaDevice, dtag: &str, heads: usize, dv: usize) -> Result<(Kernel, usize, u32)> {
    let gpu = gpu(dev)?;
    let [.., narrowest] = GDRC_SCAN_TC;
    // 64 columns ask for more shared memory than sm_86/89 give a block.
    let (cols, name, smem) = GDRC_SCAN_TC
        .into_iter()
        .find(|&(cols, _, smem)| {
            smem as usize <= gpu.shared_memory_per_block
                && heads * dv.div_ceil(cols) >= gpu.multiprocessors
        })
        .unwrap_or(narrowest);
    let scan = Kernel::load_from(&GDR_CHUNKED, dev, &format!("{name}{dtag}"))?;
    scan.allow_shared_memory(smem)?;
    Ok((scan, cols, smem))
}

/// Where the chunked kernels' scratch parts lie, for `blocks` (row · head, chunk) blocks: W, Q',
/// K', Aqk (each transposed or not, as the kernel pair reads it), U (f32, or bf16 in half as many
/// floats for the tensor-core pair), e^{G_CH}, each `blocks ×` its per-block size.
/// Every element is written by a preparation kernel before a scan reads it. One allocation cut
/// into parts (a short call is host-bound, and every allocation and free costs host time), the
/// float4-read parts first so they stay aligned.
struct ScratchLayout {
    blocks: usize,
    per_block: [usize; 6],
}

impl ScratchLayout {
    fn new(blocks: usize, dv: usize, bf16_operands: bool) -> Self {
        let (c, d) = (GDRC_CHUNK, GDRC_MAX_DIM);
        let per_float = if bf16_operands { 2 } else { 1 };
        let [cd, cc, cu] = [c * d, c * c, c * dv].map(|n| n.div_ceil(per_float));
        Self {
            blocks,
            per_block: [cd, cd, cd, cc, cu, 1],
        }
    }

    fn total(&self) -> usize {
        self.blocks * self.per_block.iter().sum::<usize>()
    }

    /// The parts from block `first` on.
    fn parts<'a>(&self, scratch: &'a CudaSlice<f32>, first: usize) -> [CudaView<'a, f32>; 6] {
        let mut start = 0;
        self.per_block.map(|n| {
            start += self.blocks * n;
            scratch.slice(start - (self.blocks - first) * n..start)
        })
    }
}

/// [`crate::gated_delta_rule_split`]: records' state rows and their branch rows, on the
/// tensor-core kernels in three launches. One preparation grid takes both parts' chunks (they
/// do not depend on the states); the states' scan starts from zero and writes their final
/// states; the branches' scan reads its owner's state in place (shared by that record's branch
/// rows, written by none). Both scans write into one packed output, `[R·S + B·T, Hv, Dv]`.
/// With `op.conv` ([`crate::conv_gated_delta_rule_split`]) the inputs are raw row views and the
/// preparation (`gdrc_prep2c_tc_*`) runs the conv on them first.
pub(crate) fn gated_delta_rule_split(
    op: &GdrSplit,
    qa: &CudaStorage,
    la: &Layout,
    qb: &CudaStorage,
    lb: &Layout,
    gb: &CudaStorage,
    lg: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dims = op.dims;
    let dev = qa.device();
    let dtag = tag(qa.dtype(), "gated-delta-rule")?;
    if !gpu(dev)?.tensor_cores || qa.dtype() == DType::F32 || qb.dtype() != qa.dtype() {
        bail!("gated-delta-rule-split: needs bf16/f16 inputs and tensor cores")
    }
    let (hv, dv) = (dims.num_v_heads, dims.head_v_dim);
    let split = &op.rows;
    let (states, s_len) = (split.states(), split.state_width());
    let (rows, width) = (split.rows(), split.width());
    let (nc_a, nc_b) = (s_len.div_ceil(GDRC_CHUNK), width.div_ceil(GDRC_CHUNK));
    let (blocks_a, blocks_b) = (nc_a * states * hv, nc_b * rows * hv);
    let prep_name = if op.conv.is_some() {
        "gdrc_prep2c_tc_"
    } else {
        "gdrc_prep2_tc_"
    };
    let prep = Kernel::load_from(&GDR_CHUNKED, dev, &format!("{prep_name}{dtag}"))?;
    prep.allow_shared_memory(GDRC_PREP_TC_SMEM)?;
    let (scan_a, cols_a, smem_a) = tc_scan(dev, dtag, states * hv, dv)?;
    let (scan_b, cols_b, smem_b) = tc_scan(dev, dtag, rows * hv, dv)?;
    // Conv outputs, contiguous; or (conv) raw rows at their own pitch.
    let sa = crate::rows::rows(la, "gated-delta-rule-split state rows")?;
    let sb = crate::rows::rows(lb, "gated-delta-rule-split branch rows")?;
    if op.conv.is_none() && (sa.stride != sa.cols || sb.stride != sb.cols) {
        bail!("gated-delta-rule-split: expected contiguous rows, got {la:?} and {lb:?}")
    }
    let conv_w = op.conv.as_ref().map(|w| w.storage_and_layout());
    let (g0, g1) = contiguous(lg, "gated-delta-rule-split gates")?;
    let gates = gb.as_cuda_slice::<f32>()?;
    let s_tokens = states * s_len;
    let g_split = g0 + s_tokens * hv * 2;
    let (gb_a, gb_b) = (gates.slice(g0..g_split), gates.slice(g_split..g1));
    let lengths = device_lengths(&prep.dev, split.padded_lengths().as_deref())?;
    let state_lengths = device_lengths(&prep.dev, split.padded_state_lengths().as_deref())?;
    let owners = device_lengths(&prep.dev, split.kernel_owners().as_deref())?;
    let layout = ScratchLayout::new(blocks_a + blocks_b, dv, true);
    let scratch = prep.output::<f32>(layout.total())?;
    let [wt, qt, kd, at, u, gtot] = layout.parts(&scratch, 0);
    // Written whole by the states' scan before the branches' scan reads it.
    let mut state = prep.output::<f32>(states * hv * dims.head_k_dim * dv)?;
    let [hk_i, hv_i, dk_i, dv_i] = [dims.num_k_heads, hv, dims.head_k_dim, dv].map(|x| x as i32);
    let [s_i, nc_a_i, w_i, nc_b_i, bh_a_i] =
        [s_len, nc_a, width, nc_b, states * hv].map(|x| x as i32);
    by_dtype!(qa.dtype(), "gated-delta-rule-split", |T| {
        let xa = qa.as_cuda_slice::<T>()?.slice(sa.span());
        let xb = qb.as_cuda_slice::<T>()?.slice(sb.span());
        let w = match &conv_w {
            Some((storage, layout)) => match &**storage {
                candle_core::Storage::Cuda(w) => {
                    Some(w.as_cuda_slice::<T>()?.slice(layout.start_offset()..))
                }
                _ => bail!("conv-gated-delta-rule-split: the conv weight is not on the GPU"),
            },
            None => None,
        };
        let (pitch_a, pitch_b) = (sa.stride as i64, sb.stride as i64);
        let mut b = prep.stream.launch_builder(&prep.func);
        // The states: R rows of hv heads.
        b.arg(&xa)
            .arg(&gb_a)
            .arg(&state_lengths.ptr)
            .arg(&s_i)
            .arg(&nc_a_i)
            .arg(&bh_a_i);
        b.arg(&xb)
            .arg(&gb_b)
            .arg(&lengths.ptr)
            .arg(&w_i)
            .arg(&nc_b_i);
        if let Some(w) = &w {
            b.arg(&owners.ptr).arg(w).arg(&pitch_a).arg(&pitch_b);
        }
        b.arg(&wt).arg(&u).arg(&qt).arg(&kd).arg(&at).arg(&gtot);
        b.arg(&hk_i).arg(&hv_i).arg(&dk_i).arg(&dv_i);
        let cfg = LaunchConfig {
            grid_dim: ((blocks_a + blocks_b) as u32, 1, 1),
            block_dim: (GDRC_TC_THREADS, 1, 1),
            shared_mem_bytes: GDRC_PREP_TC_SMEM,
        };
        // SAFETY: argument types and order match `gdrc_prep2_tc_*` (with the conv's owners,
        // weight and pitches, `gdrc_prep2c_tc_*`); the scratch holds one block per launched
        // block, the inputs have the shapes the wrapper checked (Dk, Dv ≤ 128; rows of C
        // channels at their pitch; owners below R, lengths at most S and T, as `SplitRows`
        // checks; a contiguous [C, 4] weight).
        unsafe { b.launch(cfg) }.w()?;

        let out = scan_a.output::<T>(split.tokens() * hv * dv)?;
        let out_a = out.slice(0..s_tokens * hv * dv);
        let out_b = out.slice(s_tokens * hv * dv..);
        let [wt_b, qt_b, kd_b, at_b, u_b, gtot_b] = layout.parts(&scratch, blocks_a);
        let no_owners = 0u64;
        for (scan, cols, smem, parts, owners, o, t, nc, heads, mode) in [
            (
                &scan_a,
                cols_a,
                smem_a,
                [&wt, &u, &qt, &kd, &at, &gtot],
                &no_owners,
                &out_a,
                s_len,
                nc_a,
                states * hv,
                SCAN_WRITE,
            ),
            (
                &scan_b,
                cols_b,
                smem_b,
                [&wt_b, &u_b, &qt_b, &kd_b, &at_b, &gtot_b],
                &owners.ptr,
                &out_b,
                width,
                nc_b,
                rows * hv,
                SCAN_READ | SCAN_SHARED,
            ),
        ] {
            let [t_i, nc_i] = [t, nc].map(|x| x as i32);
            let mut b = scan.stream.launch_builder(&scan.func);
            for p in parts {
                b.arg(p);
            }
            b.arg(&mut state).arg(owners).arg(o);
            b.arg(&t_i)
                .arg(&hv_i)
                .arg(&dk_i)
                .arg(&dv_i)
                .arg(&nc_i)
                .arg(&mode);
            let cfg = LaunchConfig {
                grid_dim: (dv.div_ceil(cols) as u32, heads as u32, 1),
                block_dim: (GDRC_TC_THREADS, 1, 1),
                shared_mem_bytes: smem,
            };
            // SAFETY: argument types and order match `gdrc_scan_tc*`; each scan reads the scratch
            // blocks of its own part, writes its own rows of `out`; the branches' scan only
            // reads the states (SCAN_SHARED without SCAN_WRITE, owners below R as `SplitRows`
            // checks), after the states' scan on the same stream wrote them.
            unsafe { b.launch(cfg) }.w()?;
        }
        let shape = Shape::from((split.tokens(), hv, dv));
        Ok((CudaStorage::wrap_cuda_slice(out, prep.dev.clone()), shape))
    })
}

pub(crate) fn causal_conv1d(
    op: &CausalConv1d,
    xs: &CudaStorage,
    xl: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
) -> Result<(CudaStorage, Shape)> {
    if xs.dtype() != ws.dtype() {
        bail!(
            "causal-conv1d: input {:?} and weight {:?} dtypes differ",
            xs.dtype(),
            ws.dtype()
        )
    }
    let k = Kernel::load(
        xs.device(),
        &format!("conv_{}", tag(xs.dtype(), "causal-conv1d")?),
    )?;
    let (b_sz, padded, channels) = xl.shape().dims3()?;
    let seq_len = padded + 1 - op.kernel;
    let (x0, x1) = contiguous(xl, "causal-conv1d input")?;
    let (w0, w1) = contiguous(wl, "causal-conv1d weight")?;
    let n = b_sz * seq_len * channels;
    let cfg = grid_for(n, CONV_BLOCK);
    let ints = [b_sz, seq_len, channels, op.kernel].map(|x| x as i32);
    macro_rules! launch {
        ($t:ty) => {{
            let x = xs.as_cuda_slice::<$t>()?.slice(x0..x1);
            let w = ws.as_cuda_slice::<$t>()?.slice(w0..w1);
            let y = k.output::<$t>(n)?;
            let mut b = k.stream.launch_builder(&k.func);
            b.arg(&x).arg(&w).arg(&y);
            for v in &ints {
                b.arg(v);
            }
            // SAFETY: argument types and order match `conv_*` in ops.cu; the grid-stride loop
            // stays below `n`, the output size.
            unsafe { b.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(y, k.dev.clone())
        }};
    }
    let y = match xs.dtype() {
        DType::F32 => launch!(f32),
        DType::BF16 => launch!(half::bf16),
        _ => launch!(half::f16),
    };
    Ok((y, Shape::from((b_sz, seq_len, channels))))
}

/// Blocks of a grid-stride launch: a few waves on a large GPU, instead of one block per 256
/// elements (~100k short blocks for a batch's activations; ncu on the 0.8B batch: SwiGLU
/// 2.18 → 2.04 ms with the cap).
const STRIDE_BLOCKS: usize = 2048;

/// A 1-D grid-stride launch over `n` elements.
fn grid_for(n: usize, block: u32) -> LaunchConfig {
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

pub(crate) fn rms_norm(
    op: &crate::norm::RmsNorm,
    xs: &CudaStorage,
    xl: &Layout,
    residual: Option<(&CudaStorage, &Layout)>,
    ws: &CudaStorage,
    wl: &Layout,
) -> Result<CudaStorage> {
    let name = format!("rmsnorm_{}", tag(xs.dtype(), "rms-norm")?);
    let k = Kernel::load(xs.device(), &name)?;
    let xv = rows(xl, "rms-norm input")?;
    let (w0, w1) = contiguous(wl, "rms-norm weight")?;
    let w = ws.as_cuda_slice::<f32>()?.slice(w0..w1);
    let n_out = xv.rows * xv.cols * if residual.is_some() { 2 } else { 1 };
    // A thread per 16-byte vector of a row (the kernel's usual path: 8 values in 16 bits).
    let per_thread = 16 / xs.dtype().size_in_bytes();
    let block = (xv.cols.div_ceil(per_thread).next_multiple_of(32)).clamp(32, 1024) as u32;
    let cfg = LaunchConfig {
        grid_dim: (xv.rows as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    let hv = residual
        .map(|(_, l)| rows(l, "rms-norm residual"))
        .transpose()?;
    by_dtype!(xs.dtype(), "rms-norm", |T| {
        let x = xs.as_cuda_slice::<T>()?.slice(xv.span());
        let out = k.output::<T>(n_out)?;
        let mut b = k.stream.launch_builder(&k.func);
        let (xs_, null) = (xv.stride as i64, 0u64);
        b.arg(&x).arg(&xs_);
        let h = match (residual, hv) {
            (Some((hs, _)), Some(hv)) => {
                Some((hs.as_cuda_slice::<T>()?.slice(hv.span()), hv.stride as i64))
            }
            _ => None,
        };
        match &h {
            Some((h, stride)) => b.arg(h).arg(stride),
            None => b.arg(&null).arg(&null),
        };
        let (rows_, cols_, eps) = (xv.rows as i32, xv.cols as i32, op.eps);
        b.arg(&w).arg(&out).arg(&rows_).arg(&cols_).arg(&eps);
        // SAFETY: argument types and order match `rmsnorm_*` in ops.cu; one block per row,
        // every index stays inside the views the layouts describe.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}

pub(crate) fn gated_rms_norm(
    op: &crate::norm::GatedRmsNorm,
    xs: &CudaStorage,
    xl: &Layout,
    zs: &CudaStorage,
    zl: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
) -> Result<CudaStorage> {
    let name = format!("gnorm_{}", tag(xs.dtype(), "gated-rms-norm")?);
    let k = Kernel::load(xs.device(), &name)?;
    let (x0, x1) = contiguous(xl, "gated-rms-norm input")?;
    let (w0, w1) = contiguous(wl, "gated-rms-norm weight")?;
    let zv = rows(zl, "gated-rms-norm gate")?;
    let dv = w1 - w0;
    let groups = (x1 - x0) / dv;
    let heads = zv.cols / dv;
    // Half a warp per group (ops.cu): 16 groups per block of 8 warps.
    const WARPS_PER_BLOCK: usize = 8;
    let cfg = LaunchConfig {
        grid_dim: (groups.div_ceil(2 * WARPS_PER_BLOCK) as u32, 1, 1),
        block_dim: ((32 * WARPS_PER_BLOCK) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    by_dtype!(xs.dtype(), "gated-rms-norm", |T| {
        let x = xs.as_cuda_slice::<T>()?.slice(x0..x1);
        let z = zs.as_cuda_slice::<T>()?.slice(zv.span());
        let w = ws.as_cuda_slice::<T>()?.slice(w0..w1);
        let out = k.output::<T>(x1 - x0)?;
        let mut b = k.stream.launch_builder(&k.func);
        let ints = [groups as i32, heads as i32, dv as i32];
        let (zs_, eps) = (zv.stride as i64, op.eps);
        b.arg(&x).arg(&z).arg(&zs_).arg(&w).arg(&out);
        b.arg(&ints[0]).arg(&ints[1]).arg(&ints[2]).arg(&eps);
        // SAFETY: argument types and order match `gnorm_*` in ops.cu; half a warp per group.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}

pub(crate) fn gates(
    bas: &CudaStorage,
    bal: &Layout,
    ds: &CudaStorage,
    dl: &Layout,
    ns: &CudaStorage,
    nl: &Layout,
) -> Result<CudaStorage> {
    let name = format!("gates_{}", tag(bas.dtype(), "deltanet-gates")?);
    let k = Kernel::load(bas.device(), &name)?;
    let v = rows(bal, "deltanet-gates input")?;
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
        // SAFETY: argument types and order match `gates_*` in ops.cu; grid-stride below n.
        unsafe { b.launch(grid_for(n, 256)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}

pub(crate) fn swiglu(s: &CudaStorage, l: &Layout) -> Result<CudaStorage> {
    let name = format!("swiglu_{}", tag(s.dtype(), "swiglu")?);
    let k = Kernel::load(s.device(), &name)?;
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
        // SAFETY: argument types and order match `swiglu_*` in ops.cu; blocks stride over rows.
        unsafe { b.launch(grid_for(rows_ as usize * 256, 256)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}

pub(crate) fn qk_norm_rope(
    op: &crate::attention::QkNormRope,
    xs: &CudaStorage,
    xl: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
    cs: &CudaStorage,
    cl: &Layout,
) -> Result<CudaStorage> {
    const ROPE_WARPS: usize = 4; // ops.cu
    let k = Kernel::load(
        xs.device(),
        &format!("qknorm_rope_{}", tag(xs.dtype(), "qk-norm-rope")?),
    )?;
    let (b_sz, t_len, heads, hd) = xl.shape().dims4()?;
    let (off, [sb, st, sh]) = strided4(xl, "qk-norm-rope input")?;
    let (w0, w1) = contiguous(wl, "qk-norm-rope weight")?;
    let (c0, c1) = contiguous(cl, "qk-norm-rope rotation")?;
    let rot = cl.dims()[3];
    let rows_ = b_sz * heads * t_len;
    let cfg = LaunchConfig {
        grid_dim: (rows_.div_ceil(ROPE_WARPS) as u32, 1, 1),
        block_dim: ((32 * ROPE_WARPS) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let w = ws.as_cuda_slice::<f32>()?.slice(w0..w1);
    by_dtype!(xs.dtype(), "qk-norm-rope", |T| {
        let x = xs.as_cuda_slice::<T>()?.slice(off..);
        let cos_sin = cs.as_cuda_slice::<T>()?;
        let cos = cos_sin.slice(c0..c0 + (c1 - c0) / 2);
        let sin = cos_sin.slice(c0 + (c1 - c0) / 2..c1);
        let out = k.output::<T>(rows_ * hd)?;
        let mut b = k.stream.launch_builder(&k.func);
        let strides = [sb, st, sh].map(|s| s as i64);
        let ints = [b_sz, t_len, heads, hd, rot].map(|v| v as i32);
        b.arg(&x).arg(&strides[0]).arg(&strides[1]).arg(&strides[2]);
        b.arg(&w).arg(&cos).arg(&sin).arg(&out);
        for v in &ints {
            b.arg(v);
        }
        b.arg(&op.eps);
        // SAFETY: argument types and order match `qknorm_rope_*` in ops.cu; hd ≤ 512 was
        // checked by the wrapper; indices follow the layout's own strides.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}

pub(crate) fn causal_softmax(
    op: &crate::attention::CausalSoftmax,
    ss: &CudaStorage,
    sl: &Layout,
    ms: &CudaStorage,
    ml: &Layout,
) -> Result<CudaStorage> {
    let k = Kernel::load(
        ss.device(),
        &format!("causal_softmax_{}", tag(ss.dtype(), "causal-softmax")?),
    )?;
    let (b_sz, groups, t_len, s_len) = sl.shape().dims4()?;
    let (s0, s1) = contiguous(sl, "causal-softmax scores")?;
    let (m0, m1) = contiguous(ml, "causal-softmax key bias")?;
    // A warp per row, 8 rows per block (ops.cu).
    const ROWS_PER_BLOCK: usize = 8;
    let rows = b_sz * groups * t_len;
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(ROWS_PER_BLOCK) as u32, 1, 1),
        block_dim: (32 * ROWS_PER_BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let bias = ms.as_cuda_slice::<f32>()?.slice(m0..m1);
    by_dtype!(ss.dtype(), "causal-softmax", |T| {
        let s = ss.as_cuda_slice::<T>()?.slice(s0..s1);
        let out = k.output::<T>(s1 - s0)?;
        let mut b = k.stream.launch_builder(&k.func);
        let ints = [groups, t_len, s_len].map(|v| v as i32);
        let rows_ = rows as i64;
        b.arg(&s)
            .arg(&bias)
            .arg(&out)
            .arg(&ints[0])
            .arg(&ints[1])
            .arg(&ints[2])
            .arg(&op.scale)
            .arg(&rows_);
        // SAFETY: argument types and order match `causal_softmax_*` in ops.cu; a warp per row.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}

pub(crate) fn attention_gate(
    os: &CudaStorage,
    ol: &Layout,
    gs: &CudaStorage,
    gl: &Layout,
) -> Result<CudaStorage> {
    let (b_sz, t_len, heads, hd) = gl.shape().dims4()?;
    let (off, [sb, st, sh]) = strided4(gl, "attention-gate gate")?;
    let part = GatePart {
        storage: os,
        o: ol,
        rows: (b_sz, t_len),
        gate_at: off,
        strides: [sb, st, sh],
    };
    gate_launches(gs, &[part], heads, hd)
}

/// [`crate::attention_gate_join`]: the states' part, then the branches', into one output.
/// `gl`: the packed gate `[R·S + B·T, H, hd]` (last dim contiguous).
pub(crate) fn attention_gate_join(
    ss: &CudaStorage,
    sl: &Layout,
    bs: &CudaStorage,
    bl: &Layout,
    gs: &CudaStorage,
    gl: &Layout,
) -> Result<CudaStorage> {
    let (r, heads, s_len, hd) = sl.shape().dims4()?;
    let (b, _, t_len, _) = bl.shape().dims4()?;
    let g = gl.stride();
    if gl.dims().len() != 3 || (hd > 1 && g[2] != 1) {
        bail!("attention-gate-join: the gate must be [N, H, hd] with a contiguous last dim, got {gl:?}")
    }
    let (sn, sh) = (g[0], g[1]);
    let parts = [
        GatePart {
            storage: ss,
            o: sl,
            rows: (r, s_len),
            gate_at: gl.start_offset(),
            strides: [s_len * sn, sn, sh],
        },
        GatePart {
            storage: bs,
            o: bl,
            rows: (b, t_len),
            gate_at: gl.start_offset() + r * s_len * sn,
            strides: [t_len * sn, sn, sh],
        },
    ];
    gate_launches(gs, &parts, heads, hd)
}

/// One `attn_gate_*` launch's inputs: `o` (contiguous `[B, H, T, hd]`, in `storage`), its
/// `(B, T)`, and where its gate rows start in the gate storage, with their strides (b, t, h).
struct GatePart<'a> {
    storage: &'a CudaStorage,
    o: &'a Layout,
    rows: (usize, usize),
    gate_at: usize,
    strides: [usize; 3],
}

/// `attn_gate_*` once per part, into one output holding each part's `[B·T, H·hd]` rows in turn.
fn gate_launches(
    gs: &CudaStorage,
    parts: &[GatePart],
    heads: usize,
    hd: usize,
) -> Result<CudaStorage> {
    let dtype = gs.dtype();
    let k = Kernel::load(
        gs.device(),
        &format!("attn_gate_{}", tag(dtype, "attention-gate")?),
    )?;
    let row = heads * hd;
    let total: usize = parts.iter().map(|p| p.rows.0 * p.rows.1 * row).sum();
    by_dtype!(dtype, "attention-gate", |T| {
        let mut out = k.output::<T>(total)?;
        let mut at = 0;
        for part in parts {
            let (o0, o1) = contiguous(part.o, "attention-gate input")?;
            let (b_sz, t_len) = part.rows;
            let n = b_sz * t_len * row;
            if o1 - o0 != n {
                bail!(
                    "attention-gate: input {:?} does not hold {b_sz} × {t_len} rows",
                    part.o
                )
            }
            if n == 0 {
                continue;
            }
            let o = part.storage.as_cuda_slice::<T>()?.slice(o0..o1);
            let g = gs.as_cuda_slice::<T>()?.slice(part.gate_at..);
            let mut dst = out.slice_mut(at..at + n);
            let strides = part.strides.map(|s| s as i64);
            let ints = [b_sz, t_len, heads, hd].map(|v| v as i32);
            let mut b = k.stream.launch_builder(&k.func);
            b.arg(&o)
                .arg(&g)
                .arg(&strides[0])
                .arg(&strides[1])
                .arg(&strides[2])
                .arg(&mut dst);
            for v in &ints {
                b.arg(v);
            }
            // SAFETY: argument types and order match `attn_gate_*` in ops.cu; blocks stride
            // over the part's B·T rows, writing only its slice of `out`.
            unsafe { b.launch(grid_for(b_sz * t_len * 256, 256)) }.w()?;
            at += n;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}

/// Rows of 16-byte words (gather.rs checked the sizes, the alignment and the indices).
pub(crate) fn gather_rows(
    ts: &CudaStorage,
    tl: &Layout,
    is: &CudaStorage,
    il: &Layout,
) -> Result<CudaStorage> {
    let k = Kernel::load(ts.device(), "gather_rows16")?;
    let (t0, t1) = contiguous(tl, "gather-rows input")?;
    let (i0, i1) = contiguous(il, "gather-rows index")?;
    let (src_rows, n) = (tl.dims()[0], i1 - i0);
    let row_elems = (t1 - t0) / src_rows.max(1);
    let units = row_elems * ts.dtype().size_in_bytes() / 16;
    let idx = is.as_cuda_slice::<u32>()?.slice(i0..i1);
    let (units_, rows_) = (units as i64, src_rows as i32);
    let cfg = LaunchConfig {
        grid_dim: (units.div_ceil(256).clamp(1, 1024) as u32, n as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    by_dtype!(ts.dtype(), "gather-rows", |T| {
        let src = ts.as_cuda_slice::<T>()?.slice(t0..t1);
        let out = k.output::<T>(n * row_elems)?;
        let mut b = k.stream.launch_builder(&k.func);
        b.arg(&src).arg(&idx).arg(&out).arg(&units_).arg(&rows_);
        // SAFETY: argument types and order match `gather_rows16` in ops.cu; rows are whole
        // 16-byte words and n ≤ 65535 (the wrapper checked), the grid strides over a row.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}

/// `gather_cat16`: `src` `[R, H, S, d]` rows picked by `is`, each followed by its `tail`
/// `[B, H, T, d]` row along the steps: `[B, H, S + T, d]`.
pub(crate) fn gather_cat(
    ss: &CudaStorage,
    sl: &Layout,
    is: &CudaStorage,
    il: &Layout,
    ts: &CudaStorage,
    tl: &Layout,
) -> Result<CudaStorage> {
    let k = Kernel::load(ss.device(), "gather_cat16")?;
    let (s0, s1) = contiguous(sl, "gather-cat source")?;
    let (i0, i1) = contiguous(il, "gather-cat index")?;
    let (t0, t1) = contiguous(tl, "gather-cat tail")?;
    let (src_rows, heads, s_len, d) = sl.shape().dims4()?;
    let (n, _, t_len, _) = tl.shape().dims4()?;
    let size = ss.dtype().size_in_bytes();
    let (us, ut) = (s_len * d * size / 16, t_len * d * size / 16);
    let idx = is.as_cuda_slice::<u32>()?.slice(i0..i1);
    let (heads_, us_, ut_, rows_) = (heads as i32, us as i64, ut as i64, src_rows as i32);
    let cfg = LaunchConfig {
        grid_dim: (
            (us + ut).div_ceil(256).clamp(1, 1024) as u32,
            (n * heads) as u32,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    by_dtype!(ss.dtype(), "gather-cat", |T| {
        let src = ss.as_cuda_slice::<T>()?.slice(s0..s1);
        let tail = ts.as_cuda_slice::<T>()?.slice(t0..t1);
        let out = k.output::<T>(n * heads * (s_len + t_len) * d)?;
        let mut b = k.stream.launch_builder(&k.func);
        b.arg(&src).arg(&idx).arg(&tail).arg(&out);
        b.arg(&heads_).arg(&us_).arg(&ut_).arg(&rows_);
        // SAFETY: argument types and order match `gather_cat16` in ops.cu; both parts are whole
        // 16-byte words and n·heads ≤ 65535 (the wrapper checked), the grid strides over a row.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}

/// The conv kernels' grid: a thread per CONV_VEC channels, `(rows, runs)` as y and z.
fn conv_launch(channels: usize, rows: usize, runs: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            (channels as u32).div_ceil(CONV_VEC * CONV_CACHED_BLOCK),
            rows as u32,
            runs as u32,
        ),
        block_dim: (CONV_CACHED_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The one-pass forward's conv (`conv_split_*`): `xs` `[R, S, C]` rows from zeros, `xb`
/// `[B, T, C]` rows continuing their owners' last K−1 real inputs; out `[R·S + B·T, C]`.
pub(crate) fn causal_conv1d_split(
    split: &SplitRows,
    ss: &CudaStorage,
    sl: &Layout,
    bs: &CudaStorage,
    bl: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
) -> Result<CudaStorage> {
    let k = Kernel::load(
        ss.device(),
        &format!("conv_split_{}", tag(ss.dtype(), "causal-conv1d")?),
    )?;
    let (states, s_len, channels) = sl.shape().dims3()?;
    let (b_sz, t_len, _) = bl.shape().dims3()?;
    let kernel = wl.dims()[1];
    let sv = rows(sl, "causal-conv1d state")?;
    let bv = rows(bl, "causal-conv1d branches")?;
    let (w0, w1) = contiguous(wl, "causal-conv1d weight")?;
    let n = split.tokens() * channels;
    // The grid is (channel blocks, 1, runs): CUDA caps z at 65535.
    let runs = states * s_len.div_ceil(CONV_RUN) + b_sz * t_len.div_ceil(CONV_RUN);
    if runs > 65535 {
        bail!(
            "causal-conv1d: {states} states of {s_len} steps and {b_sz} rows of {t_len} exceed one launch"
        )
    }
    let state_lengths = device_lengths(&k.dev, split.padded_state_lengths().as_deref())?;
    let owners = device_lengths(&k.dev, split.kernel_owners().as_deref())?;
    by_dtype!(ss.dtype(), "causal-conv1d", |T| {
        let out = k.output::<T>(n)?;
        let xs = ss.as_cuda_slice::<T>()?.slice(sv.span());
        let xb = bs.as_cuda_slice::<T>()?.slice(bv.span());
        let w = ws.as_cuda_slice::<T>()?.slice(w0..w1);
        let mut b = k.stream.launch_builder(&k.func);
        let (s_stride, b_stride) = (sv.stride as i64, bv.stride as i64);
        let [r_, s_, b_, t_, c_, k_] =
            [states, s_len, b_sz, t_len, channels, kernel].map(|v| v as i32);
        b.arg(&xs)
            .arg(&s_stride)
            .arg(&r_)
            .arg(&s_)
            .arg(&state_lengths.ptr);
        b.arg(&xb).arg(&b_stride).arg(&b_).arg(&t_).arg(&owners.ptr);
        b.arg(&w).arg(&out).arg(&c_).arg(&k_);
        let cfg = conv_launch(channels, 1, runs);
        // SAFETY: argument types and order match `conv_split_*` in ops.cu; a thread per CONV_VEC
        // channels below C and run of steps below S or T; reads stay inside the views the
        // layouts describe (the wrapper checked that both parts and the weight have C channels
        // and the parts fit `split`, whose lengths are at most S and owners below R).
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}

pub(crate) fn causal_conv1d_cached(
    op: &crate::causal_conv1d::CausalConv1dCached,
    xs: &CudaStorage,
    xl: &Layout,
    cs: &CudaStorage,
    cl: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
) -> Result<CudaStorage> {
    let k = Kernel::load(
        xs.device(),
        &format!("conv_cached_{}", tag(xs.dtype(), "causal-conv1d")?),
    )?;
    let (b_sz, seq_len, channels) = xl.shape().dims3()?;
    let kernel = wl.dims()[1];
    let xv = rows(xl, "causal-conv1d input")?;
    let (c0, c1) = contiguous(cl, "causal-conv1d cache")?;
    let (w0, w1) = contiguous(wl, "causal-conv1d weight")?;
    let n = b_sz * (seq_len + kernel - 1) * channels;
    // The grid is (channel blocks, rows, runs + 1): CUDA caps y and z at 65535.
    let runs = seq_len.div_ceil(CONV_RUN) + 1;
    if b_sz > 65535 || runs > 65535 {
        bail!("causal-conv1d: {b_sz} rows of {seq_len} steps exceed one launch; split the call")
    }
    let lengths = device_lengths(&k.dev, op.lengths.as_deref())?;
    by_dtype!(xs.dtype(), "causal-conv1d", |T| {
        let out = k.output::<T>(n)?;
        if n == 0 {
            return Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()));
        }
        let x = xs.as_cuda_slice::<T>()?.slice(xv.span());
        let cache = cs.as_cuda_slice::<T>()?.slice(c0..c1);
        let w = ws.as_cuda_slice::<T>()?.slice(w0..w1);
        let mut b = k.stream.launch_builder(&k.func);
        let stride = xv.stride as i64;
        b.arg(&x).arg(&stride).arg(&cache).arg(&w);
        b.arg(&lengths.ptr);
        b.arg(&out);
        let ints = [b_sz, seq_len, channels, kernel].map(|v| v as i32);
        for v in &ints {
            b.arg(v);
        }
        let cfg = conv_launch(channels, b_sz, runs);
        // SAFETY: argument types and order match `conv_cached_*` in ops.cu; a thread per CONV_VEC channels
        // below C and batch row, steps below T; reads stay inside the views the layouts describe.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
    })
}

/// The CUDA storage of an input an op carries beside its operands.
fn cuda_of<'a>(s: &'a candle_core::Storage, what: &str) -> Result<&'a CudaStorage> {
    match s {
        candle_core::Storage::Cuda(c) => Ok(c),
        _ => bail!("{what} is not on the GPU"),
    }
}

/// A flash-attention key or value source: a bf16 view from its start, and its strides (in
/// elements) of rows, heads and steps.
fn flash_source<'a>(
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<(CudaView<'a, half::bf16>, [i64; 3])> {
    let st = l.stride();
    let view = s.as_cuda_slice::<half::bf16>()?.slice(l.start_offset()..);
    Ok((view, [st[0], st[1], st[2]].map(|x| x as i64)))
}

/// `flash_attn_bf16` (flash_attn.cu): q `[B, Hq, T, 256]` contiguous, this step's k and v
/// `[B, Hkv, L, 256]` and the past's (k, v, owners) at their own strides (the wrapper checked
/// dtypes, shapes and 16-byte alignment), key bias `[B, S + L]` f32.
pub(crate) fn flash_attention(
    (qs, ql): (&CudaStorage, &Layout),
    (ks, kl): (&CudaStorage, &Layout),
    (vs, vl): (&CudaStorage, &Layout),
    past: Option<[&Tensor; 3]>,
    bias: &Tensor,
    scale: f32,
) -> Result<CudaStorage> {
    let k = Kernel::load_from(&FLASH_ATTN, qs.device(), "flash_attn_bf16")?;
    k.allow_shared_memory(FLASH_SMEM)?;
    let (b_sz, hq, t_len, hd) = ql.shape().dims4()?;
    let (_, hkv, l_len, _) = kl.shape().dims4()?;
    let (q0, q1) = contiguous(ql, "flash-attention queries")?;
    let (kn, kn_st) = flash_source(ks, kl)?;
    let (vn, vn_st) = flash_source(vs, vl)?;
    let past_in = past.map(|[pk, pv, owners]| {
        (
            pk.storage_and_layout(),
            pv.storage_and_layout(),
            owners.storage_and_layout(),
        )
    });
    let (b_bias, l_bias) = bias.storage_and_layout();
    let (m0, m1) = contiguous(l_bias, "flash-attention key bias")?;
    let bias_s = cuda_of(&b_bias, "flash-attention key bias")?
        .as_cuda_slice::<f32>()?
        .slice(m0..m1);
    let q = qs.as_cuda_slice::<half::bf16>()?.slice(q0..q1);
    let out = k.output::<half::bf16>(b_sz * hq * t_len * hd)?;
    let rep = hq / hkv;
    let cfg = LaunchConfig {
        grid_dim: (
            (rep * t_len).div_ceil(FLASH_ROWS) as u32,
            hkv as u32,
            b_sz as u32,
        ),
        block_dim: (FLASH_THREADS, 1, 1),
        shared_mem_bytes: FLASH_SMEM,
    };
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let mut b = k.stream.launch_builder(&k.func);
    b.arg(&q);
    // Without a past the kernel never reads these (S = 0): this step's tensors stand in.
    let (past_k, past_v, owners, s_len) = match &past_in {
        Some(((pk, pkl), (pv, pvl), (ow, owl))) => {
            let (i0, i1) = contiguous(owl, "flash-attention owners")?;
            let owners = cuda_of(ow, "flash-attention owners")?
                .as_cuda_slice::<u32>()?
                .slice(i0..i1);
            (
                flash_source(cuda_of(pk, "flash-attention past keys")?, pkl)?,
                flash_source(cuda_of(pv, "flash-attention past values")?, pvl)?,
                Some(owners),
                pkl.dims()[2] as i32,
            )
        }
        None => (flash_source(ks, kl)?, flash_source(vs, vl)?, None, 0),
    };
    let null: u64 = 0;
    b.arg(&past_k.0)
        .arg(&past_k.1[0])
        .arg(&past_k.1[1])
        .arg(&past_k.1[2]);
    b.arg(&past_v.0)
        .arg(&past_v.1[0])
        .arg(&past_v.1[1])
        .arg(&past_v.1[2]);
    match &owners {
        Some(o) => b.arg(o),
        None => b.arg(&null),
    };
    b.arg(&kn).arg(&kn_st[0]).arg(&kn_st[1]).arg(&kn_st[2]);
    b.arg(&vn).arg(&vn_st[0]).arg(&vn_st[1]).arg(&vn_st[2]);
    let ints = [hq, hkv, t_len].map(|x| x as i32);
    let l_i = l_len as i32;
    b.arg(&bias_s)
        .arg(&out)
        .arg(&ints[0])
        .arg(&ints[1])
        .arg(&ints[2])
        .arg(&s_len)
        .arg(&l_i)
        .arg(&scale_log2);
    // SAFETY: argument types and order match `flash_attn_bf16` in flash_attn.cu; the wrapper
    // checked shapes, dtypes (bf16, f32 bias, u32 owners within the past's rows), head dim 256
    // and 16-byte alignment of every row; the grid covers rep·T rows per (b, kv head).
    unsafe { b.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, k.dev.clone()))
}
