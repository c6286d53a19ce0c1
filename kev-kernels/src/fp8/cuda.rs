//! The FP8 product on CUDA: the input quantized by `fp8_quantize_rows_*` (`fp8.cu`), then
//! cuBLASLt's block-scaled matmul: in its column-major terms `yᵀ[n, m] = Wᵀ·xᵀ`, `W` the
//! transposed operand A with one scale per 128 × 128 block, `x` the operand B with one per
//! token and 128 inputs (the only transposes FP8 takes on Hopper), f32 accumulation without
//! the fast (FP8-precision) one.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::sync::{Mutex, OnceLock, PoisonError};

use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda_backend::cudarc::driver::{
    DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Result, Shape, Tensor};

use super::{fp8_available, Fp8Weight, FP8_BLOCK};
use crate::backend::cuda::kernel::{contiguous, cuda_of, Kernel};
use crate::backend::cuda::sources::FP8;
use crate::linear::cuda::{handle, lt_err, Handle};

/// Tokens are padded to a multiple of this (zero rows of scale 1): cuBLASLt reads the input's
/// scales token by token, in columns of the padded count.
const TOKEN_MULTIPLE: usize = 8;
/// Warps per block of the quantization.
const QUANTIZE_WARPS: u32 = 8;
/// The most workspace a product's algorithm may ask for (allocated per call, so that
/// concurrent streams and CUDA graphs each have their own).
const MAX_WORKSPACE: u64 = 32 << 20;

pub(super) fn fp8_linear(dev: &CudaDevice, x: &Tensor, w: &Fp8Weight) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let (n, _) = w.dims();
    let dtype = x.dtype();
    let out_type = data_type(dtype)?;
    if !fp8_available(x.device()) {
        bail!("fp8 linear: FP8 products need a GPU of compute capability 9.0 (H100, H200)")
    }
    if !k.is_multiple_of(16) || !n.is_multiple_of(8) {
        bail!("fp8 linear: {n} × {k} weight (FP8 products need k a multiple of 16, n of 8)")
    }
    let Some(h) = handle(dev) else {
        bail!("fp8 linear: cuBLASLt could not start")
    };
    let mp = m.next_multiple_of(TOKEN_MULTIPLE);
    let kb = k.div_ceil(FP8_BLOCK);
    let (xs, xl) = x.storage_and_layout();
    let xs = cuda_of(&xs, "fp8 input")?;
    let (ws, wl) = w.weight.storage_and_layout();
    let ws = cuda_of(&ws, "fp8 weight")?;
    let (ss, sl) = w.scales.storage_and_layout();
    let ss = cuda_of(&ss, "fp8 weight scales")?;
    let (wa, we) = contiguous(wl, "fp8 weight")?;
    let wv = ws.as_cuda_slice::<u8>()?.slice(wa..we);
    // The scales' rows keep their padded pitch in a view of some of them: narrowed, not
    // copied.
    let sa = sl.start_offset();
    let sv = ss.as_cuda_slice::<f32>()?.slice(sa..);

    let quantize = Kernel::for_dtype(&FP8, dev, "fp8_quantize_rows", dtype, "fp8 linear")?;
    let q = quantize.output::<u8>(mp * k)?;
    let qs = quantize.output::<f32>(kb * mp)?;
    let warps = mp * kb;
    let cfg = LaunchConfig {
        grid_dim: (
            warps.div_ceil(QUANTIZE_WARPS as usize).clamp(1, 8192) as u32,
            1,
            1,
        ),
        block_dim: (32 * QUANTIZE_WARPS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (m_, mp_, k_) = (m as i32, mp as i32, k as i32);
    let (xa, xe) = contiguous(xl, "fp8 input")?;
    let out = by_dtype!(dtype, "fp8 linear", |T| {
        let xv = xs.as_cuda_slice::<T>()?.slice(xa..xe);
        let mut b = quantize.stream.launch_builder(&quantize.func);
        b.arg(&xv).arg(&q).arg(&qs).arg(&m_).arg(&mp_).arg(&k_);
        // SAFETY: argument types and order match `fp8_quantize_rows_*` in fp8.cu; warps stride
        // over the mp × kb (row, block) pairs; q holds mp × k bytes, qs kb × mp scales.
        unsafe { b.launch(cfg) }.w()?;
        let mut y = quantize.output::<T>(mp * n)?;
        {
            let stream = &quantize.stream;
            let (wp, _g1) = wv.device_ptr(stream);
            let (sp, _g2) = sv.device_ptr(stream);
            let (qp, _g3) = q.device_ptr(stream);
            let (qsp, _g4) = qs.device_ptr(stream);
            let (yp, _g5) = y.device_ptr_mut(stream);
            let d = Descriptors::new(out_type, (mp, n, k), sp, qsp)?;
            let (algo, workspace) = algorithm(h, &d, dev, dtype, (mp, n, k))?;
            // SAFETY: cuBLASLt's scratch, which it writes before it reads.
            let mut space = unsafe { dev.alloc::<u8>(workspace.max(1)) }?;
            let (space_p, _g6) = space.device_ptr_mut(stream);
            let (one, zero) = (1f32, 0f32);
            // SAFETY: the descriptors match the operands (A: W, n × k e4m3; B: the quantized input,
            // mp × k; C = D: y, mp × n) and the scales' layouts (checked at quantization and in
            // `quantize`), all alive until the call is queued on `stream`; the algorithm came from
            // the heuristic for these descriptors with at most `workspace` bytes, which `space`
            // holds; beta is 0, so C is not read.
            unsafe {
                lt::matmul(
                    h.0,
                    d.desc,
                    (&one as *const f32).cast(),
                    (&zero as *const f32).cast(),
                    wp as *const _,
                    d.w,
                    qp as *const _,
                    d.x,
                    yp as *const _,
                    d.y,
                    yp as *mut _,
                    d.y,
                    &algo,
                    space_p as *mut _,
                    workspace,
                    stream.cu_stream() as sys::cudaStream_t,
                )
            }
            .map_err(lt_err)?;
        }
        Ok::<_, candle_core::Error>(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    })?;
    let y = Tensor::from((candle_core::Storage::Cuda(out), Shape::from((mp, n))));
    if mp == m {
        Ok(y)
    } else {
        y.narrow(0, 0, m)
    }
}

fn data_type(dtype: DType) -> Result<sys::cudaDataType> {
    Ok(match dtype {
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
        other => bail!("fp8 linear: {other:?} activations (bf16 or f16 only)"),
    })
}

/// The descriptors of one product: `w` (A), `x` (B), `y` (C and D), and the matmul's, holding
/// the scales' addresses (so made per call).
struct Descriptors {
    desc: sys::cublasLtMatmulDesc_t,
    w: sys::cublasLtMatrixLayout_t,
    x: sys::cublasLtMatrixLayout_t,
    y: sys::cublasLtMatrixLayout_t,
}

impl Descriptors {
    fn new(
        out: sys::cudaDataType,
        (mp, n, k): (usize, usize, usize),
        weight_scales: u64,
        input_scales: u64,
    ) -> Result<Self> {
        use sys::cublasLtMatmulDescAttributes_t as A;
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
        let block = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
        let vector = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        // W transposed (1), its scales per block, the input's per token and 128 inputs, f32
        // accumulation throughout (fast accumulation off, 0).
        d.set(A::CUBLASLT_MATMUL_DESC_TRANSA, &1i32)?;
        d.set(A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &(block as i32))?;
        d.set(A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &(vector as i32))?;
        d.set(A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &weight_scales)?;
        d.set(A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &input_scales)?;
        d.set(A::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &0i8)?;
        let e4m3 = sys::cudaDataType::CUDA_R_8F_E4M3;
        let (mp, n, k) = (mp as u64, n as u64, k as u64);
        d.w = lt::create_matrix_layout(e4m3, k, n, k as i64).map_err(lt_err)?;
        d.x = lt::create_matrix_layout(e4m3, k, mp, k as i64).map_err(lt_err)?;
        d.y = lt::create_matrix_layout(out, n, mp, n as i64).map_err(lt_err)?;
        Ok(d)
    }
}

impl Descriptors {
    /// Sets the matmul's attribute `attr` to `value`, of the type cuBLASLt gives that attribute.
    fn set<T>(&self, attr: sys::cublasLtMatmulDescAttributes_t, value: &T) -> Result<()> {
        // SAFETY: `desc` is live; `value` is one `T`, the attribute's type (the callers').
        unsafe {
            lt::set_matmul_desc_attribute(
                self.desc,
                attr,
                (value as *const T).cast(),
                std::mem::size_of::<T>(),
            )
        }
        .map_err(lt_err)
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

/// A product's shape, for its algorithm.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Product {
    ordinal: usize,
    dtype: DType,
    mnk: (usize, usize, usize),
}

/// The heuristic's first algorithm for the product and the workspace it needs, asked once per
/// shape (the heuristic costs more than the product at small shapes).
fn algorithm(
    h: Handle,
    d: &Descriptors,
    dev: &CudaDevice,
    dtype: DType,
    mnk: (usize, usize, usize),
) -> Result<(sys::cublasLtMatmulAlgo_t, usize)> {
    static ALGOS: OnceLock<Mutex<HashMap<Product, (sys::cublasLtMatmulAlgo_t, usize)>>> =
        OnceLock::new();
    let key = Product {
        ordinal: dev.cuda_stream().context().ordinal(),
        dtype,
        mnk,
    };
    let algos = ALGOS.get_or_init(Default::default);
    if let Some(&known) = algos
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&key)
    {
        return Ok(known);
    }
    let pref = lt::create_matmul_pref().map_err(lt_err)?;
    let mut found = MaybeUninit::<sys::cublasLtMatmulHeuristicResult_t>::uninit();
    let mut count = 0i32;
    // SAFETY: every descriptor is live; `found` holds one result.
    let asked = unsafe {
        lt::set_matmul_pref_attribute(
            pref,
            sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            (&MAX_WORKSPACE as *const u64).cast(),
            std::mem::size_of::<u64>(),
        )
        .and_then(|()| {
            sys::cublasLtMatmulAlgoGetHeuristic(
                h.0,
                d.desc,
                d.w,
                d.x,
                d.y,
                d.y,
                pref,
                1,
                found.as_mut_ptr(),
                &mut count,
            )
            .result()
        })
    };
    // SAFETY: `pref` is live and not used again.
    let _ = unsafe { lt::destroy_matmul_pref(pref) };
    asked.map_err(lt_err)?;
    if count < 1 {
        let (m, n, k) = mnk;
        bail!("fp8 linear: cuBLASLt has no block-scaled FP8 algorithm for {m} × {n} × {k}")
    }
    // SAFETY: the heuristic wrote one result.
    let found = unsafe { found.assume_init() };
    let chosen = (found.algo, found.workspaceSize);
    algos
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(key, chosen);
    Ok(chosen)
}
