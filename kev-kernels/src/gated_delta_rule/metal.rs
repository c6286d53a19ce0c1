//! The gated delta rule on Metal (`gated_delta_rule.metal`): one 32-lane simdgroup per (row,
//! value head, state column), the state in registers.

use candle_core::backend::BackendStorage;
use candle_core::{bail, DType, Layout, MetalStorage, Result};
use objc2_metal::{MTLComputePipelineState, MTLSize};

use super::op::{GatedDeltaRule, GdrDims};
use crate::backend::cuda::sources::L2NORM_EPS;
use crate::backend::metal::{as_u32, byte_offset, dtype_suffix, pipeline, Source, SET_BYTES_LIMIT};

const SOURCE: Source = Source {
    name: "gated_delta_rule",
    text: include_str!("gated_delta_rule.metal"),
};

/// The simdgroup width the gated-delta-rule kernel is written for (every Apple GPU); checked
/// against the pipeline's `threadExecutionWidth`.
const SIMD_WIDTH: usize = 32;
/// Value columns (one simdgroup each) per gated-delta-rule threadgroup: 128 threads, the same
/// (batch, head) for all, so they share the q/k rows in cache. Not tuned on hardware yet.
const COLUMNS_PER_GROUP: usize = 4;
/// The largest Dk the kernel variants cover (8 state rows per lane).
const MAX_HEAD_K_DIM: usize = 256;

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

// The MSL struct has the same fields; the emulation harness asserts the same size.
const _: () = assert!(std::mem::size_of::<GdrParams>() == 32);

/// State rows per lane of the compiled variant for `dk`: the smallest of 1, 2, 4, 8 with
/// `32·nk ≥ dk` (rows past dk are held as zeros).
fn gdr_rows_per_lane(dk: usize) -> Result<usize> {
    match [1, 2, 4, 8].into_iter().find(|nk| SIMD_WIDTH * nk >= dk) {
        Some(nk) if dk > 0 => Ok(nk),
        _ => bail!("gated-delta-rule: Dk = {dk} outside 1..={MAX_HEAD_K_DIM} on Metal"),
    }
}

pub(crate) fn gated_delta_rule(
    op: &GatedDeltaRule,
    state: &mut MetalStorage,
    sl: &Layout,
    qkv: &MetalStorage,
    ql: &Layout,
    gates: &MetalStorage,
    gl: &Layout,
) -> Result<()> {
    let GdrDims {
        num_k_heads: hk,
        num_v_heads: hv,
        head_k_dim: dk,
        head_v_dim: dv,
    } = op.dims;
    let (b_sz, seq_len) = (op.b_sz, op.seq_len);
    if state.dtype() != DType::F32 || gates.dtype() != DType::F32 {
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
    let pipeline = pipeline(&dev, &SOURCE, &format!("gated_delta_rule_{suffix}_nk{nk}"))?;
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
        enc.set_input_buffer(1, Some(gates.buffer()), g_off);
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
                width: dv.div_ceil(COLUMNS_PER_GROUP),
                height: hv,
                depth: b_sz,
            },
            MTLSize {
                width: SIMD_WIDTH * COLUMNS_PER_GROUP,
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
