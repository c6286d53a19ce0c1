//! CUDA implementations of the ops. The kernels (`kernels/ops.cu`) are compiled once per
//! process with NVRTC, so building needs no nvcc for our own code and head sizes stay runtime
//! values; see the source for grids, ownership and layouts.

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Shape};

use crate::causal_conv1d::CausalConv1d;
use crate::gated_delta_rule::GatedDeltaRule;

const SOURCE: &str = include_str!("kernels/ops.cu");
const MODULE: &str = "kev_ops";
/// Warps per block of the recurrence kernel (`WARPS` in ops.cu): 4 state columns per block.
const GDR_WARPS: usize = 4;
const CONV_BLOCK: u32 = 256;

/// The PTX of `ops.cu`, compiled on first use.
fn ptx() -> Result<&'static str> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    let compiled = PTX.get_or_init(|| {
        let opts = CompileOptions {
            name: Some("ops.cu".into()),
            ..Default::default()
        };
        compile_ptx_with_opts(SOURCE, opts)
            .map(|p| p.to_src())
            .map_err(|e| e.to_string())
    });
    match compiled {
        Ok(p) => Ok(p.as_str()),
        Err(e) => bail!("compiling kev-kernels ops.cu with NVRTC: {e}"),
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
        let func = dev
            .get_or_load_custom_func(name, MODULE, ptx()?)?
            .into_cuda_function();
        Ok(Self {
            dev: dev.clone(),
            func,
            stream: dev.cuda_stream(),
        })
    }

    /// An output buffer of `n` elements every launch fully overwrites.
    fn output<T: DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: both kernels write every element of their output (padding included).
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
    let nk = dims.head_k_dim.div_ceil(32).next_power_of_two();
    if nk > 8 {
        bail!(
            "gated-delta-rule: head_k_dim {} > 256 is not supported on CUDA",
            dims.head_k_dim
        )
    }
    let k = Kernel::load(
        qkv.device(),
        &format!("gdr_{}_nk{nk}", tag(qkv.dtype(), "gated-delta-rule")?),
    )?;
    let (q0, q1) = contiguous(ql, "gated-delta-rule qkv")?;
    let (g0, g1) = contiguous(gl, "gated-delta-rule gates")?;
    let (s0, s1) = contiguous(sl, "gated-delta-rule state")?;
    let lengths = k.dev.clone_htod(&op.lengths)?;
    let gb = gb.as_cuda_slice::<f32>()?.slice(g0..g1);
    let mut st = state.as_cuda_slice_mut::<f32>()?.slice_mut(s0..s1);
    let n_out = op.b_sz * op.seq_len * dims.num_v_heads * dims.head_v_dim;
    let cfg = LaunchConfig {
        grid_dim: (
            dims.head_v_dim.div_ceil(GDR_WARPS) as u32,
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
    macro_rules! launch {
        ($t:ty) => {{
            let x = qkv.as_cuda_slice::<$t>()?.slice(q0..q1);
            let out = k.output::<$t>(n_out)?;
            let mut b = k.stream.launch_builder(&k.func);
            b.arg(&x).arg(&gb).arg(&mut st).arg(&out).arg(&lengths);
            for v in &ints {
                b.arg(v);
            }
            // SAFETY: argument types and order match `gdr_*` in ops.cu; the wrapper checked
            // every shape, so all indices stay inside the buffers.
            unsafe { b.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, k.dev.clone())
        }};
    }
    let out = match qkv.dtype() {
        DType::F32 => launch!(f32),
        DType::BF16 => launch!(half::bf16),
        _ => launch!(half::f16),
    };
    op.set_output(candle_core::Storage::Cuda(out));
    Ok(())
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
    let cfg = LaunchConfig {
        grid_dim: ((n as u32).div_ceil(CONV_BLOCK).clamp(1, 1 << 18), 1, 1),
        block_dim: (CONV_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
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
