//! Metal implementations of the ops.
//!
//! The MSL sources (`kernels/*.metal`, each opening with its grid and buffer contract) are compiled
//! at run time, once per device, and their pipelines cached. Every buffer a kernel writes is
//! declared with `set_output_buffer` (the in-place state included): since candle 0.11 the compute
//! encoder dispatches concurrently and inserts barriers only from those declarations
//! (docs/DESIGN.md §4). Outputs are allocated before taking the command encoder, which holds candle's
//! command mutex.
//!
//! The kernels' logic is tested on Linux by the emulation harness (`tests/metal_emu/`); on a Mac,
//! `tests/metal_ops.rs` runs them against the CPU ops.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock, PoisonError};

use candle_core::backend::BackendStorage;
use candle_core::metal_backend::DeviceId;
use candle_core::{bail, DType, Layout, MetalDevice, MetalError, MetalStorage, Result, Shape};
use candle_metal_kernels::metal::{ComputePipeline, Library};
use objc2_metal::{MTLComputePipelineState, MTLSize};

use crate::causal_conv1d::CausalConv1d;
use crate::gated_delta_rule::{GatedDeltaRule, GdrDims, L2NORM_EPS};

/// One MSL source file, compiled into one library per device.
struct Source {
    name: &'static str,
    text: &'static str,
}

const GDR_SOURCE: Source = Source {
    name: "gated_delta_rule",
    text: include_str!("kernels/gated_delta_rule.metal"),
};
const CONV_SOURCE: Source = Source {
    name: "causal_conv1d",
    text: include_str!("kernels/causal_conv1d.metal"),
};

/// The simdgroup width the gated-delta-rule kernel is written for (every Apple GPU); checked
/// against the pipeline's `threadExecutionWidth`.
const SIMD_WIDTH: usize = 32;
/// Value columns (one simdgroup each) per gated-delta-rule threadgroup: 128 threads, the same
/// (batch, head) for all, so they share the q/k rows in cache. Not tuned on hardware yet.
const GDR_COLUMNS_PER_GROUP: usize = 4;
/// The largest Dk the kernel variants cover (8 state rows per lane).
const GDR_MAX_DK: usize = 256;
/// Threads per causal-conv1d threadgroup (one output element each); a common Metal default.
const CONV_THREADS_PER_GROUP: usize = 256;
/// Metal's limit for `setBytes`; larger per-row lengths go through a buffer.
const SET_BYTES_LIMIT: usize = 4096;

/// `GdrParams` of gated_delta_rule.metal.
#[repr(C)]
struct GdrParams {
    b: u32,
    t: u32,
    hk: u32,
    hv: u32,
    dk: u32,
    dv: u32,
    scale: f32,
    eps: f32,
}

/// `ConvParams` of causal_conv1d.metal.
#[repr(C)]
struct ConvParams {
    b: u32,
    t: u32,
    c: u32,
    k: u32,
}

// The MSL structs have the same fields; the emulation harness asserts the same sizes.
const _: () = assert!(std::mem::size_of::<GdrParams>() == 32);
const _: () = assert!(std::mem::size_of::<ConvParams>() == 16);

type LibraryCache = HashMap<(DeviceId, &'static str), Library>;
type PipelineCache = HashMap<(DeviceId, String), ComputePipeline>;

/// The pipeline of entry point `function` of `source` on `dev`, compiled on first use.
fn pipeline(dev: &MetalDevice, source: &Source, function: &str) -> Result<ComputePipeline> {
    static LIBRARIES: OnceLock<Mutex<LibraryCache>> = OnceLock::new();
    static PIPELINES: OnceLock<Mutex<PipelineCache>> = OnceLock::new();
    let key = (dev.id(), function.to_string());
    // A panic while holding a cache lock cannot leave a half-inserted entry: keep using it.
    let mut pipelines = PIPELINES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(p) = pipelines.get(&key) {
        return Ok(p.clone());
    }
    let library = {
        let mut libraries = LIBRARIES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match libraries.get(&(dev.id(), source.name)) {
            Some(l) => l.clone(),
            None => {
                let l = dev
                    .metal_device()
                    .new_library_with_source(source.text, None)
                    .map_err(MetalError::from)?;
                libraries.insert((dev.id(), source.name), l.clone());
                l
            }
        }
    };
    let f = library
        .get_function(function, None)
        .map_err(MetalError::from)?;
    let p = dev
        .metal_device()
        .new_compute_pipeline_state_with_function(&f)
        .map_err(MetalError::from)?;
    pipelines.insert(key, p.clone());
    Ok(p)
}

/// The suffix of the entry points for an element type (bf16 is read as ushort in MSL).
fn dtype_suffix(dtype: DType, what: &str) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => bail!("{what}: unsupported dtype {other:?} on Metal"),
    })
}

/// The byte offset of a contiguous layout's first element.
fn byte_offset(l: &Layout, dtype: DType, what: &str) -> Result<usize> {
    if !l.is_contiguous() {
        bail!("{what} must be contiguous on Metal")
    }
    Ok(l.start_offset() * dtype.size_in_bytes())
}

fn as_u32(x: usize, what: &str) -> Result<u32> {
    match u32::try_from(x) {
        Ok(v) => Ok(v),
        Err(_) => bail!("{what} = {x} does not fit the kernel's 32-bit indices"),
    }
}

/// State rows per lane of the compiled variant for `dk`: the smallest of 1, 2, 4, 8 with
/// `32·nk ≥ dk` (rows past dk are held as zeros).
fn gdr_rows_per_lane(dk: usize) -> Result<usize> {
    match [1, 2, 4, 8].into_iter().find(|nk| SIMD_WIDTH * nk >= dk) {
        Some(nk) if dk > 0 => Ok(nk),
        _ => bail!("gated-delta-rule: Dk = {dk} outside 1..={GDR_MAX_DK} on Metal"),
    }
}

pub(crate) fn gated_delta_rule(
    op: &GatedDeltaRule,
    state: &mut MetalStorage,
    sl: &Layout,
    qkv: &MetalStorage,
    ql: &Layout,
    gb: &MetalStorage,
    gl: &Layout,
) -> Result<()> {
    let GdrDims {
        num_k_heads: hk,
        num_v_heads: hv,
        head_k_dim: dk,
        head_v_dim: dv,
    } = op.dims;
    let (b_sz, seq_len) = (op.b_sz, op.seq_len);
    if state.dtype() != DType::F32 || gb.dtype() != DType::F32 {
        bail!("gated-delta-rule: state and gates must be f32")
    }
    if qkv.dtype() != op.out_dtype {
        bail!(
            "gated-delta-rule: qkv dtype {:?} is not the output dtype {:?}",
            qkv.dtype(),
            op.out_dtype
        )
    }
    let suffix = dtype_suffix(qkv.dtype(), "gated-delta-rule qkv")?;
    let nk = gdr_rows_per_lane(dk)?;
    let q_off = byte_offset(ql, qkv.dtype(), "gated-delta-rule: qkv")?;
    let g_off = byte_offset(gl, DType::F32, "gated-delta-rule: gates")?;
    let s_off = byte_offset(sl, DType::F32, "gated-delta-rule: state")?;
    let o_elems = b_sz * seq_len * hv * dv;
    let params = GdrParams {
        b: as_u32(b_sz, "gated-delta-rule: batch")?,
        t: as_u32(seq_len, "gated-delta-rule: steps")?,
        hk: hk as u32,
        hv: hv as u32,
        dk: dk as u32,
        dv: as_u32(dv, "gated-delta-rule: Dv")?,
        scale: 1.0 / (dk as f32).sqrt(),
        eps: L2NORM_EPS,
    };
    if op.lengths.len() != b_sz {
        bail!(
            "gated-delta-rule: {} lengths for a batch of {b_sz}",
            op.lengths.len()
        )
    }

    let dev = state.device().clone();
    let pipeline = pipeline(
        &dev,
        &GDR_SOURCE,
        &format!("gated_delta_rule_{suffix}_nk{nk}"),
    )?;
    let width = pipeline.as_ref().threadExecutionWidth();
    if width != SIMD_WIDTH {
        bail!("gated-delta-rule: the kernel needs {SIMD_WIDTH}-wide simdgroups, this GPU runs {width}")
    }
    // Everything that allocates comes before the encoder (it holds the command mutex).
    let o = dev.new_buffer(o_elems.max(1), op.out_dtype, "gated-delta-rule o")?;
    let lengths_bytes = std::mem::size_of_val(op.lengths.as_slice());
    let lengths_buf = if lengths_bytes > SET_BYTES_LIMIT {
        Some(dev.new_buffer_with_data(&op.lengths)?)
    } else {
        None
    };
    if o_elems > 0 {
        let guard = dev.command_encoder()?;
        let enc: &candle_metal_kernels::metal::ComputeCommandEncoder = guard.as_ref();
        enc.set_compute_pipeline_state(&pipeline);
        enc.set_input_buffer(0, Some(qkv.buffer()), q_off);
        enc.set_input_buffer(1, Some(gb.buffer()), g_off);
        // Read and written: declared as an output, so candle orders this dispatch after earlier
        // readers and writers of the state.
        enc.set_output_buffer(2, Some(state.buffer()), s_off);
        enc.set_output_buffer(3, Some(&o), 0);
        match &lengths_buf {
            Some(buf) => enc.set_input_buffer(4, Some(buf), 0),
            None => enc.set_bytes_directly(4, lengths_bytes, op.lengths.as_ptr().cast()),
        }
        enc.set_bytes(5, &params);
        enc.dispatch_thread_groups(
            MTLSize {
                width: dv.div_ceil(GDR_COLUMNS_PER_GROUP),
                height: hv,
                depth: b_sz,
            },
            MTLSize {
                width: SIMD_WIDTH * GDR_COLUMNS_PER_GROUP,
                height: 1,
                depth: 1,
            },
        );
    }
    op.set_output(candle_core::Storage::Metal(MetalStorage::new(
        o,
        dev,
        o_elems,
        op.out_dtype,
    )));
    Ok(())
}

pub(crate) fn causal_conv1d(
    op: &CausalConv1d,
    xs: &MetalStorage,
    xl: &Layout,
    ws: &MetalStorage,
    wl: &Layout,
) -> Result<(MetalStorage, Shape)> {
    let (b_sz, padded_len, channels) = xl.shape().dims3()?;
    let k = op.kernel;
    if k == 0 || padded_len < k || wl.shape().dims2()? != (channels, k) {
        bail!(
            "causal-conv1d: input {:?} does not fit weight {:?}",
            xl.shape().dims(),
            wl.shape().dims()
        )
    }
    let seq_len = padded_len + 1 - k;
    let x_suffix = dtype_suffix(xs.dtype(), "causal-conv1d x")?;
    let w_suffix = dtype_suffix(ws.dtype(), "causal-conv1d weight")?;
    let x_off = byte_offset(xl, xs.dtype(), "causal-conv1d: x")?;
    let w_off = byte_offset(wl, ws.dtype(), "causal-conv1d: weight")?;
    let n = b_sz * seq_len * channels;
    as_u32(b_sz * padded_len * channels, "causal-conv1d: x elements")?;
    let params = ConvParams {
        b: b_sz as u32,
        t: seq_len as u32,
        c: channels as u32,
        k: as_u32(k, "causal-conv1d: K")?,
    };

    let dev = xs.device().clone();
    let pipeline = pipeline(
        &dev,
        &CONV_SOURCE,
        &format!("causal_conv1d_{x_suffix}_{w_suffix}"),
    )?;
    let y = dev.new_buffer(n.max(1), xs.dtype(), "causal-conv1d y")?;
    if n > 0 {
        let guard = dev.command_encoder()?;
        let enc: &candle_metal_kernels::metal::ComputeCommandEncoder = guard.as_ref();
        enc.set_compute_pipeline_state(&pipeline);
        enc.set_input_buffer(0, Some(xs.buffer()), x_off);
        enc.set_input_buffer(1, Some(ws.buffer()), w_off);
        enc.set_output_buffer(2, Some(&y), 0);
        enc.set_bytes(3, &params);
        enc.dispatch_thread_groups(
            MTLSize {
                width: n.div_ceil(CONV_THREADS_PER_GROUP),
                height: 1,
                depth: 1,
            },
            MTLSize {
                width: CONV_THREADS_PER_GROUP,
                height: 1,
                depth: 1,
            },
        );
    }
    let storage = MetalStorage::new(y, dev, n, xs.dtype());
    Ok((storage, Shape::from((b_sz, seq_len, channels))))
}
