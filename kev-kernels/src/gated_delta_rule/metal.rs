//! The gated delta rule on Metal (`gated_delta_rule.metal`): step by step, one 32-lane simdgroup
//! per (row, value head, state column) with the state in registers; or chunked (the UT/WY form,
//! chunks of 16 steps) on the simdgroup matrix units, one simdgroup per 8 state columns, for long
//! bf16/f16 calls ([`METAL_CHUNKED_MIN_LEN`]).

use candle_core::backend::BackendStorage;
use candle_core::{bail, DType, Layout, MetalStorage, Result};
use objc2_metal::{MTLComputePipelineState, MTLSize};

use super::op::{GatedDeltaRule, GdrDims, METAL_CHUNKED_MIN_LEN};
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

/// Value columns per threadgroup of the chunked kernel: 4 simdgroups of 8 (each holds an 8-column
/// slab of the state). Every threadgroup of a head repeats the chunk's state-free products, so
/// wider groups repeat them less and narrower ones give a short batch more threadgroups; not
/// tuned on hardware yet.
const CHUNKED_COLUMNS_PER_GROUP: usize = 32;
/// State columns per simdgroup of the chunked kernel: one 8×8 simdgroup matrix wide.
const CHUNKED_COLUMNS_PER_SIMDGROUP: usize = 8;
/// Steps per chunk of the chunked kernel (`GDRC_CHUNK` of the source).
const CHUNKED_STEPS: usize = 16;
/// The chunked kernel's Dk variants: a chunk's q̂ and k̂ are padded with zeros to one of them.
/// Larger Dk runs step by step.
const CHUNKED_HEAD_K_DIMS: [usize; 3] = [32, 64, 128];
/// Threadgroup memory of every Apple GPU Metal runs on (`maxThreadgroupMemoryLength`).
const THREADGROUP_MEMORY_BYTES: usize = 32 * 1024;

/// Threadgroup memory of the chunked kernel (its layout in gated_delta_rule.metal): q̂ and k̂ tiles
/// `[C][dk_padded]`, five C×C matrices, eight rows of C per-step gate values, a `[C][8]` staging
/// tile per simdgroup; f32, C = [`CHUNKED_STEPS`]. Metal wants a multiple of 16 bytes.
const fn chunked_threadgroup_bytes(dk_padded: usize, simdgroups: usize) -> usize {
    let c = CHUNKED_STEPS;
    let floats = 2 * c * dk_padded + 5 * c * c + 8 * c + simdgroups * c * 8;
    (4 * floats).next_multiple_of(16)
}

const _: () = assert!(
    chunked_threadgroup_bytes(
        128,
        CHUNKED_COLUMNS_PER_GROUP / CHUNKED_COLUMNS_PER_SIMDGROUP
    ) <= THREADGROUP_MEMORY_BYTES
);

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
    // The chunked kernel where the op asks for it and Dk has a variant (an empty sequence has no
    // chunk to run), as CUDA chooses.
    let chunked_dk = CHUNKED_HEAD_K_DIMS
        .into_iter()
        .find(|&d| d >= dk)
        .filter(|_| op.chunked_from(METAL_CHUNKED_MIN_LEN) && seq_len > 0);
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

    // (entry point, threadgroups along x, threads per threadgroup, threadgroup memory)
    let (entry, groups_x, threads, threadgroup_bytes) = match chunked_dk {
        Some(dk_padded) => {
            let simdgroups = CHUNKED_COLUMNS_PER_GROUP / CHUNKED_COLUMNS_PER_SIMDGROUP;
            (
                format!("gated_delta_rule_chunked_{suffix}_dk{dk_padded}"),
                dv.div_ceil(CHUNKED_COLUMNS_PER_GROUP),
                SIMD_WIDTH * simdgroups,
                Some(chunked_threadgroup_bytes(dk_padded, simdgroups)),
            )
        }
        None => (
            format!("gated_delta_rule_{suffix}_nk{}", gdr_rows_per_lane(dk)?),
            dv.div_ceil(COLUMNS_PER_GROUP),
            SIMD_WIDTH * COLUMNS_PER_GROUP,
            None,
        ),
    };

    let dev = state.device().clone();
    let pipeline = pipeline(&dev, &SOURCE, &entry)?;
    let width = pipeline.as_ref().threadExecutionWidth();
    if width != SIMD_WIDTH {
        bail!("gated-delta-rule: the kernel needs {SIMD_WIDTH}-wide simdgroups, this GPU runs {width}")
    }
    let max_threads = pipeline.as_ref().maxTotalThreadsPerThreadgroup();
    if max_threads < threads {
        bail!("gated-delta-rule: {entry} takes at most {max_threads} threads a threadgroup, it needs {threads}")
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
        if let Some(bytes) = threadgroup_bytes {
            enc.set_threadgroup_memory_length(0, bytes);
        }
        enc.dispatch_thread_groups(
            MTLSize {
                width: groups_x,
                height: hv,
                depth: b_sz,
            },
            MTLSize {
                width: threads,
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
