//! cuBLASLt under [`super::linear`]: one handle per GPU; per shape class the algorithm that ran
//! fastest among those that gave cuBLAS's numbers, timed on the class's first product inside
//! [`super::tuning`]; per exact shape whether that algorithm gives cuBLAS's numbers there.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda_backend::cudarc::driver::sys::{CUevent_flags, CUstreamCaptureStatus};
use candle_core::cuda_backend::cudarc::driver::{
    result as driver, CudaStream, DevicePtr, PushKernelArg,
};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DevicePtrMut, DeviceRepr};
use candle_core::cuda_backend::CudaDType;
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaStorage, CustomOp2, DType, Device, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

use super::MAX_TUNED_ROWS;
use crate::backend::cuda::kernel::{contiguous, grid_for, Kernel};
use crate::backend::cuda::sources::LINEAR;

/// The heuristic's candidates timed per shape class (it offers at most 8 on the H200).
const CANDIDATES: usize = 8;
/// Each candidate's timed launches run back to back for about this long (3 to 10 launches).
const TIMED_GPU_US: f64 = 100.0;
/// How long the stream is held while the timed launches are queued, so that the GPU runs them
/// back to back rather than at the host's pace: longer than queueing the at most 90 takes.
const HOLD: Duration = Duration::from_millis(2);
/// cuBLASLt's candidates assume operands aligned to this many bytes (the heuristic's default);
/// a product with another alignment runs cuBLAS's choice.
const ALIGN: u64 = 256;

thread_local! {
    /// Whether this thread's products time the shapes they are the first of.
    static TUNING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with the thread's new product shapes timed (see [`super::tuning`]).
pub(super) fn tuning<R>(f: impl FnOnce() -> R) -> R {
    /// Puts the flag back even if `f` unwinds (a server catches a request's panic and goes on).
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            TUNING.with(|t| t.set(self.0));
        }
    }
    let _restore = Restore(TUNING.with(|t| t.replace(true)));
    f()
}

/// `x: [m, k]` times `w: [n, k]` transposed, on CUDA in bf16 or f16.
pub(super) struct TunedLinear;

/// Whether [`TunedLinear`] runs this product (else candle's matmul does; so does the op where
/// cuBLASLt cannot start).
pub(super) fn takes(x: &Tensor, w: &Tensor, rows: usize) -> bool {
    matches!(x.device(), Device::Cuda(_))
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && w.dtype() == x.dtype()
        && w.is_contiguous()
        && (1..=MAX_TUNED_ROWS).contains(&rows)
}

impl CustomOp2 for TunedLinear {
    fn name(&self) -> &'static str {
        "tuned-linear"
    }

    cuda_only_cpu_fwd!("tuned-linear runs on CUDA only", _x _xl, _w _wl);

    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        ws: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (m, k) = xl.shape().dims2()?;
        let (n, _) = wl.shape().dims2()?;
        let call = Call {
            xs,
            xl,
            ws,
            wl,
            mnk: (m, n, k),
        };
        let out = match xs.dtype() {
            DType::BF16 => product::<bf16>(call)?,
            DType::F16 => product::<f16>(call)?,
            other => bail!("tuned-linear: unsupported dtype {other:?}"),
        };
        Ok((out, Shape::from((m, n))))
    }
}

/// How a product shape runs.
#[derive(Clone, Copy)]
enum Choice {
    /// candle's matmul (cuBLAS's own choice).
    Cublas,
    Lt(sys::cublasLtMatmulAlgo_t),
}

/// A product's shape.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Product {
    ordinal: usize,
    dtype: DType,
    m: usize,
    n: usize,
    k: usize,
}

impl Product {
    /// The shape class it shares its timed choice with: rows rounded up, by coarser steps as
    /// products grow (a tile row more or less matters less).
    fn class(self) -> Product {
        let step = if self.m <= 2048 { 64 } else { 512 };
        Product {
            m: self.m.div_ceil(step) * step,
            ..self
        }
    }
}

/// What the process knows of its products: each class's timed choice, and for each exact shape
/// whether its class's cuBLASLt choice gives cuBLAS's numbers there (cuBLAS picks its kernel by
/// the whole shape, split-K for few rows say, so a candidate that matched it at one row count
/// may not at another).
#[derive(Default)]
struct Choices {
    classes: HashMap<Product, Choice>,
    exact: HashMap<Product, bool>,
}

fn choices() -> std::sync::MutexGuard<'static, Choices> {
    static CHOICES: OnceLock<Mutex<Choices>> = OnceLock::new();
    CHOICES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// A cuBLASLt handle. It holds no stream (each call names its own), so threads share it.
#[derive(Clone, Copy)]
pub(crate) struct Handle(pub(crate) sys::cublasLtHandle_t);
// SAFETY: cuBLASLt's calls may use one handle from several threads; it is never destroyed.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

/// The handle for `dev`'s GPU, made on first use; `None` where cuBLASLt cannot start (then
/// candle's matmul runs every product).
pub(crate) fn handle(dev: &candle_core::CudaDevice) -> Option<Handle> {
    static HANDLES: OnceLock<Mutex<HashMap<usize, Option<Handle>>>> = OnceLock::new();
    let stream = dev.cuda_stream();
    let ordinal = stream.context().ordinal();
    let mut handles = HANDLES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    *handles.entry(ordinal).or_insert_with(|| {
        stream.context().bind_to_thread().ok()?;
        lt::create_handle().ok().map(Handle)
    })
}

fn data_type(dtype: DType) -> Result<sys::cudaDataType> {
    Ok(match dtype {
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
        other => bail!("tuned-linear: unsupported dtype {other:?}"),
    })
}

pub(crate) fn lt_err(e: lt::CublasError) -> candle_core::Error {
    candle_core::Error::Msg(format!("cuBLASLt: {e}"))
}

/// The descriptors of one product `y[m, n] = x[m, k] · w[n, k]ᵀ`, row-major: in cuBLASLt's
/// column-major terms `yᵀ[n, m] = op(w)·xᵀ` with `w` transposed; f32 accumulation and scale.
struct Descriptors {
    desc: sys::cublasLtMatmulDesc_t,
    w: sys::cublasLtMatrixLayout_t,
    x: sys::cublasLtMatrixLayout_t,
    y: sys::cublasLtMatrixLayout_t,
}

impl Descriptors {
    fn new(dtype: DType, (m, n, k): (usize, usize, usize)) -> Result<Self> {
        let t = data_type(dtype)?;
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(lt_err)?;
        // Fields filled one by one so that a failure drops (and destroys) what exists.
        let mut d = Self {
            desc,
            w: std::ptr::null_mut(),
            x: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
        };
        let transposed: i32 = 1;
        // SAFETY: `desc` is live; the attribute is an i32 operation (1 = transposed).
        unsafe {
            lt::set_matmul_desc_attribute(
                d.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&transposed as *const i32).cast(),
                std::mem::size_of::<i32>(),
            )
        }
        .map_err(lt_err)?;
        let (m, n, k) = (m as u64, n as u64, k as u64);
        d.w = lt::create_matrix_layout(t, k, n, k as i64).map_err(lt_err)?;
        d.x = lt::create_matrix_layout(t, k, m, k as i64).map_err(lt_err)?;
        d.y = lt::create_matrix_layout(t, n, m, n as i64).map_err(lt_err)?;
        Ok(d)
    }

    /// Up to [`CANDIDATES`] algorithms, in the heuristic's order, that need no workspace (so
    /// concurrent streams and graph captures need none either) and do not split the sum over
    /// k (so every one computes cuBLAS's numbers).
    fn candidates(&self, h: Handle) -> Vec<sys::cublasLtMatmulAlgo_t> {
        let Ok(pref) = lt::create_matmul_pref() else {
            return Vec::new();
        };
        let no_workspace: u64 = 0;
        let mut found = [MaybeUninit::<sys::cublasLtMatmulHeuristicResult_t>::uninit(); CANDIDATES];
        let mut count = 0i32;
        // SAFETY: every descriptor is live; `found` holds CANDIDATES results.
        let ok = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&no_workspace as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
            .is_ok()
                && sys::cublasLtMatmulAlgoGetHeuristic(
                    h.0,
                    self.desc,
                    self.w,
                    self.x,
                    self.y,
                    self.y,
                    pref,
                    CANDIDATES as i32,
                    found.as_mut_ptr().cast(),
                    &mut count,
                )
                .result()
                .is_ok()
        };
        // SAFETY: `pref` is live and not used again.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        if !ok {
            return Vec::new();
        }
        found[..count.clamp(0, CANDIDATES as i32) as usize]
            .iter()
            // SAFETY: the heuristic wrote the first `count` results.
            .map(|r| unsafe { r.assume_init() })
            .filter(|r| {
                r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && r.workspaceSize == 0
            })
            .map(|r| r.algo)
            .filter(|a| split_k(a) == 1)
            .collect()
    }
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each is destroyed once; null ones were never made.
        unsafe {
            for l in [self.w, self.x, self.y] {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// One configuration attribute of an algorithm, read in its own width (cuBLASLt refuses
/// another); 0 where it cannot be read.
fn config(
    algo: &sys::cublasLtMatmulAlgo_t,
    attr: sys::cublasLtMatmulAlgoConfigAttributes_t,
) -> u32 {
    use sys::cublasLtMatmulAlgoConfigAttributes_t as A;
    let mut value = [0u8; 4];
    let width = match attr {
        A::CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID | A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID => 2,
        _ => 4,
    };
    let mut written = 0usize;
    // SAFETY: reads one attribute of `width` bytes of a valid algorithm into `value`.
    let status = unsafe {
        sys::cublasLtMatmulAlgoConfigGetAttribute(
            algo,
            attr,
            value.as_mut_ptr().cast(),
            width,
            &mut written,
        )
    };
    match status {
        sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS if width == 2 => {
            u16::from_ne_bytes([value[0], value[1]]) as u32
        }
        sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS => u32::from_ne_bytes(value),
        _ => 0,
    }
}

/// How many parts an algorithm splits the sum over k into.
fn split_k(algo: &sys::cublasLtMatmulAlgo_t) -> u32 {
    config(
        algo,
        sys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
    )
}

/// What names an algorithm's kernel: the dtype and its configuration without the problem's
/// size.
type KernelKey = (DType, [u32; 7]);

fn kernel_key(dtype: DType, algo: &sys::cublasLtMatmulAlgo_t) -> KernelKey {
    use sys::cublasLtMatmulAlgoConfigAttributes_t as A;
    let config = [
        A::CUBLASLT_ALGO_CONFIG_ID,
        A::CUBLASLT_ALGO_CONFIG_TILE_ID,
        A::CUBLASLT_ALGO_CONFIG_STAGES_ID,
        A::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING,
        A::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION,
        A::CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID,
        A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID,
    ]
    .map(|attr| config(algo, attr));
    (dtype, config)
}

/// The kernels this process has run, and the weight shapes `(ordinal, dtype, n, k)` it has
/// timed a class of.
#[derive(Default)]
struct Seen {
    kernels: HashSet<KernelKey>,
    weights: HashSet<(usize, DType, usize, usize)>,
}

fn seen() -> std::sync::MutexGuard<'static, Seen> {
    static SEEN: OnceLock<Mutex<Seen>> = OnceLock::new();
    SEEN.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// A call's operands as device addresses on the calling thread's stream.
struct Addresses {
    x: u64,
    w: u64,
    y: u64,
}

/// `y = x · wᵀ` with `algo` (a cuBLASLt call on `stream`).
fn run_lt(
    h: Handle,
    d: &Descriptors,
    algo: &sys::cublasLtMatmulAlgo_t,
    p: &Addresses,
    stream: &CudaStream,
) -> Result<()> {
    let (one, zero) = (1f32, 0f32);
    // SAFETY: the descriptors match the operands' shapes and dtype, which stay alive until
    // the call is queued; the algorithm came from the heuristic for these descriptors and
    // needs no workspace.
    unsafe {
        lt::matmul(
            h.0,
            d.desc,
            (&one as *const f32).cast(),
            (&zero as *const f32).cast(),
            p.w as *const _,
            d.w,
            p.x as *const _,
            d.x,
            p.y as *const _,
            d.y,
            p.y as *mut _,
            d.y,
            algo,
            std::ptr::null_mut(),
            0,
            stream.cu_stream() as sys::cudaStream_t,
        )
    }
    .map_err(lt_err)
}

/// One product `y = x · wᵀ` as the op received it: `x: [m, k]`, `w: [n, k]`, contiguous.
#[derive(Clone, Copy)]
struct Call<'a> {
    xs: &'a CudaStorage,
    xl: &'a Layout,
    ws: &'a CudaStorage,
    wl: &'a Layout,
    mnk: (usize, usize, usize),
}

impl Call<'_> {
    /// candle's matmul of the product (what `candle_nn::Linear` runs).
    fn cublas(&self) -> Result<CudaStorage> {
        let (m, n, k) = self.mnk;
        self.xs
            .matmul(self.ws, (1, m, n, k), self.xl, &self.wl.transpose(0, 1)?)
    }

    /// The views of `x` and `w` the product reads.
    fn inputs<T: CudaDType + DeviceRepr>(&self) -> Result<(CudaView<'_, T>, CudaView<'_, T>)> {
        let (xa, xe) = contiguous(self.xl, "tuned-linear input")?;
        let (wa, we) = contiguous(self.wl, "tuned-linear weight")?;
        Ok((
            self.xs.as_cuda_slice::<T>()?.slice(xa..xe),
            self.ws.as_cuda_slice::<T>()?.slice(wa..we),
        ))
    }

    /// Whether `x` and `w` start on [`ALIGN`]-byte boundaries (a view of a weight's rows may
    /// not).
    fn inputs_aligned<T: CudaDType + DeviceRepr>(&self, stream: &Arc<CudaStream>) -> Result<bool> {
        let (x, w) = self.inputs::<T>()?;
        let (x, _gx) = x.device_ptr(stream);
        let (w, _gw) = w.device_ptr(stream);
        Ok(x % ALIGN == 0 && w % ALIGN == 0)
    }

    /// Runs `f` with the device addresses of `x`, `w` and `y`, valid on `stream` meanwhile.
    fn with_addresses<T: CudaDType + DeviceRepr, R>(
        &self,
        y: &mut CudaSlice<T>,
        stream: &Arc<CudaStream>,
        f: impl FnOnce(&Addresses) -> Result<R>,
    ) -> Result<R> {
        let (x, w) = self.inputs::<T>()?;
        let (x, _gx) = x.device_ptr(stream);
        let (w, _gw) = w.device_ptr(stream);
        let (y, _gy) = y.device_ptr_mut(stream);
        f(&Addresses { x, w, y })
    }
}

fn product<T: CudaDType + DeviceRepr>(call: Call) -> Result<CudaStorage> {
    let (m, n, k) = call.mnk;
    let dev = call.xs.device().clone();
    let stream = dev.cuda_stream();
    let Some(h) = handle(&dev) else {
        return call.cublas();
    };
    if !call.inputs_aligned::<T>(&stream)? {
        return call.cublas();
    }
    let shape = Product {
        ordinal: stream.context().ordinal(),
        dtype: call.xs.dtype(),
        m,
        n,
        k,
    };
    // Outside `tuning`, and in a graph capture (which cannot time or check anything), what is
    // not known yet runs cuBLAS's choice.
    let may_time = TUNING.with(Cell::get) && !capturing(&stream)?;
    let (class_choice, exact) = {
        let c = choices();
        (
            c.classes.get(&shape.class()).copied(),
            c.exact.get(&shape).copied(),
        )
    };
    let choice = match class_choice {
        Some(c) => c,
        None if !may_time => Choice::Cublas,
        None => {
            // Timing only picks a speed: where it fails (no memory for its scratch, say), the
            // class keeps cuBLAS's choice.
            let c = tune::<T>(h, call, &stream).unwrap_or(Choice::Cublas);
            let mut known = choices();
            known.classes.insert(shape.class(), c);
            // The timed candidates were checked on this very shape.
            known.exact.insert(shape, true);
            c
        }
    };
    let Choice::Lt(algo) = choice else {
        return call.cublas();
    };
    let d = Descriptors::new(call.xs.dtype(), call.mnk)?;
    let exact = match (exact, class_choice) {
        (Some(e), _) => e,
        // Just timed on this shape.
        (None, None) => true,
        (None, Some(_)) if !may_time => false,
        (None, Some(_)) => {
            let e = reproduces::<T>(h, &d, &algo, call, &stream).unwrap_or(false);
            choices().exact.insert(shape, e);
            e
        }
    };
    if !exact {
        return call.cublas();
    }
    // SAFETY: the call below writes every element, or `y` is dropped unread.
    let mut y = unsafe { dev.alloc::<T>(m * n) }?;
    // A refused call is a status on the host, not an error left on the context.
    let ran = call.with_addresses(&mut y, &stream, |p| {
        Ok(p.y % ALIGN == 0 && run_lt(h, &d, &algo, p, &stream).is_ok())
    })?;
    if !ran {
        return call.cublas();
    }
    Ok(CudaStorage::wrap_cuda_slice(y, dev))
}

/// Whether `algo`'s output on this product equals cuBLAS's bit for bit.
fn reproduces<T: CudaDType + DeviceRepr>(
    h: Handle,
    d: &Descriptors,
    algo: &sys::cublasLtMatmulAlgo_t,
    call: Call,
    stream: &Arc<CudaStream>,
) -> Result<bool> {
    let (m, n, _) = call.mnk;
    let reference = call.cublas()?;
    let reference = reference.as_cuda_slice::<T>()?;
    let differ = Differ::new::<T>(call.xs, reference, m * n, stream)?;
    // SAFETY: the call writes every element before the comparison reads them.
    let mut y = unsafe { call.xs.device().alloc::<T>(m * n) }?;
    call.with_addresses(&mut y, stream, |p| {
        Ok(p.y % ALIGN == 0 && run_lt(h, d, algo, p, stream).is_ok() && differ.same(p.y)?)
    })
}

/// Compares outputs with a reference of `words` 16-bit words on the GPU.
struct Differ<'a> {
    kernel: Kernel,
    reference: u64,
    words: u64,
    stream: &'a Arc<CudaStream>,
}

impl<'a> Differ<'a> {
    fn new<T: CudaDType + DeviceRepr>(
        xs: &CudaStorage,
        reference: &CudaSlice<T>,
        elements: usize,
        stream: &'a Arc<CudaStream>,
    ) -> Result<Self> {
        // Event tracking is off on Kev's devices (kev-candle's `single_stream`), so the guard
        // records nothing; the reference outlives every comparison.
        let (r, _guard) = reference.device_ptr(stream);
        Ok(Self {
            kernel: Kernel::load(&LINEAR, xs.device(), "count_differences_u16")?,
            reference: r,
            words: (elements * xs.dtype().size_in_bytes() / 2) as u64,
            stream,
        })
    }

    /// Whether the `words` at `y` equal the reference's.
    fn same(&self, y: u64) -> Result<bool> {
        let mut count = self.stream.alloc_zeros::<u32>(1).w()?;
        {
            let mut b = self.stream.launch_builder(&self.kernel.func);
            b.arg(&self.reference)
                .arg(&y)
                .arg(&self.words)
                .arg(&mut count);
            // SAFETY: both buffers hold `words` 16-bit words; `count` one u32.
            unsafe { b.launch(grid_for(self.words as usize, 256)) }.w()?;
        }
        Ok(self.stream.clone_dtoh(&count).w()?[0] == 0)
    }
}

fn capturing(stream: &Arc<CudaStream>) -> Result<bool> {
    Ok(stream.capture_status().w()? != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Times cuBLAS's choice and each candidate that reproduces its output on this product, and
/// returns the fastest.
fn tune<T: CudaDType + DeviceRepr>(
    h: Handle,
    call: Call,
    stream: &Arc<CudaStream>,
) -> Result<Choice> {
    let (m, n, k) = call.mnk;
    let dtype = call.xs.dtype();
    let d = Descriptors::new(dtype, call.mnk)?;
    let mut algos = d.candidates(h);
    {
        // A kernel's first launch in the process loads it (~2 ms on the H200, most of a class's
        // timing). The first class of a weight tries every candidate; later ones only those
        // whose kernels have run, so a file of many batch sizes does not load dozens.
        let mut seen = seen();
        let weight = (stream.context().ordinal(), dtype, n, k);
        if !seen.weights.insert(weight) {
            algos.retain(|a| seen.kernels.contains(&kernel_key(dtype, a)));
        }
    }
    if algos.is_empty() {
        return Ok(Choice::Cublas);
    }
    // At ~500 TFLOP/s: enough launches for TIMED_GPU_US of work.
    let flop = 2.0 * (m * n * k) as f64;
    let reps = (TIMED_GPU_US * 5e8 / flop).clamp(3.0, 10.0) as usize;
    // SAFETY: every call writes every element; nothing reads them.
    let mut y = unsafe { call.xs.device().alloc::<T>(m * n) }?;
    let ctx = stream.context();
    let event = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).w();
    // cuBLAS's output, which a candidate must reproduce bit for bit to be timed.
    let reference = call.cublas()?;
    let reference = reference.as_cuda_slice::<T>()?;
    let differ = Differ::new::<T>(call.xs, reference, m * n, stream)?;
    let timings = call.with_addresses(&mut y, stream, |p| {
        let mut same = Vec::new();
        for a in &algos {
            // A candidate that fails to launch is dropped with the others.
            if p.y % ALIGN != 0 || run_lt(h, &d, a, p, stream).is_err() {
                continue;
            }
            seen().kernels.insert(kernel_key(dtype, a));
            if differ.same(p.y)? {
                same.push(*a);
            }
        }
        hold(stream)?;
        let order = std::iter::once(Choice::Cublas).chain(same.into_iter().map(Choice::Lt));
        let mut marks = Vec::new();
        for choice in order {
            let (start, end) = (event()?, event()?);
            start.record(stream).w()?;
            for _ in 0..reps {
                match &choice {
                    Choice::Cublas => drop(call.cublas()?),
                    Choice::Lt(a) => run_lt(h, &d, a, p, stream)?,
                }
            }
            end.record(stream).w()?;
            marks.push((start, end, choice));
        }
        Ok(marks)
    })?;
    let mut best = (f32::INFINITY, Choice::Cublas);
    for (start, end, choice) in timings {
        let ms = start.elapsed_ms(&end).w()?;
        if ms < best.0 {
            best = (ms, choice);
        }
    }
    Ok(best.1)
}

/// Holds `stream` on the host for [`HOLD`], so that the launches queued meanwhile run back to
/// back once it goes on.
fn hold(stream: &CudaStream) -> Result<()> {
    unsafe extern "C" fn sleep(_: *mut std::ffi::c_void) {
        std::thread::sleep(HOLD);
    }
    // SAFETY: the function takes no data and makes no CUDA call.
    unsafe { driver::stream::launch_host_function(stream.cu_stream(), sleep, std::ptr::null_mut()) }
        .w()
}
