//! The gated delta rule on Metal (`gated_delta_rule.metal`): step by step, one 32-lane simdgroup
//! per (row, value head, state column) with the state in registers; or chunked (the UT/WY form,
//! chunks of 16 steps) on the simdgroup matrix units, one simdgroup per 8 state columns, for long
//! bf16/f16 calls ([`METAL_CHUNKED_MIN_LEN`]); and the split form, the records' state rows from
//! zero states then their branch rows from the states' final states, in two dispatches.

use candle_core::backend::BackendStorage;
use candle_core::{bail, DType, Layout, MetalDevice, MetalStorage, Result, Shape};
use candle_metal_kernels::metal::Buffer;
use objc2_metal::{MTLComputePipelineState, MTLSize};

use super::op::{GatedDeltaRule, GatedDeltaRuleSplit, GdrDims, METAL_CHUNKED_MIN_LEN};
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
    if op.lengths.len() != op.b_sz {
        bail!(
            "gated-delta-rule: {} lengths for a batch of {}",
            op.lengths.len(),
            op.b_sz
        )
    }
    let dev = state.device().clone();
    let o_elems = op.b_sz * op.seq_len * op.dims.num_v_heads * op.dims.head_v_dim;
    let o = dev.new_buffer(o_elems.max(1), op.out_dtype, "gated-delta-rule o")?;
    let pass = Pass {
        b_sz: op.b_sz,
        seq_len: op.seq_len,
        lengths: &op.lengths,
        chunked: op.chunked_from(METAL_CHUNKED_MIN_LEN),
        qkv: (
            qkv.buffer(),
            byte_offset(ql, qkv.dtype(), "gated-delta-rule: qkv")?,
        ),
        gates: (
            gates.buffer(),
            byte_offset(gl, DType::F32, "gated-delta-rule: gates")?,
        ),
        state: (
            state.buffer(),
            byte_offset(sl, DType::F32, "gated-delta-rule: state")?,
        ),
        o: (&o, 0),
        role: StateRole::InPlace,
    };
    encode(&dev, op.dims, qkv.dtype(), &pass)?;
    op.set_output(candle_core::Storage::Metal(MetalStorage::new(
        o,
        dev,
        o_elems,
        op.out_dtype,
    )));
    Ok(())
}

/// What a dispatch does with the state buffer (the kernel's `GDR_*` modes).
enum StateRole<'a> {
    /// Each row starts from its state row and writes the final state back.
    InPlace,
    /// Each row starts from zeros and writes its final state (the split form's state rows).
    FromZero,
    /// Row b starts from state row `owners[b]` and stores nothing (the split form's branches).
    FromOwner(&'a Buffer),
}

/// One dispatch of the recurrence: a buffer and byte offset per operand.
struct Pass<'a> {
    b_sz: usize,
    seq_len: usize,
    /// Real steps per row.
    lengths: &'a [u32],
    /// Whether the op asks for the chunked kernel (it runs where Dk has a variant).
    chunked: bool,
    qkv: (&'a Buffer, usize),
    gates: (&'a Buffer, usize),
    state: (&'a Buffer, usize),
    o: (&'a Buffer, usize),
    role: StateRole<'a>,
}

/// Encodes `pass` (nothing for an empty output): the chunked kernel where it asks for it and Dk
/// has a variant (an empty sequence has no chunk to run), as CUDA chooses, else step by step.
fn encode(dev: &MetalDevice, dims: GdrDims, dtype: DType, pass: &Pass<'_>) -> Result<()> {
    let GdrDims {
        num_k_heads: hk,
        num_v_heads: hv,
        head_k_dim: dk,
        head_v_dim: dv,
    } = dims;
    let (b_sz, seq_len) = (pass.b_sz, pass.seq_len);
    let suffix = dtype_suffix(dtype, "gated-delta-rule qkv")?;
    let chunked_dk = CHUNKED_HEAD_K_DIMS
        .into_iter()
        .find(|&d| d >= dk)
        .filter(|_| pass.chunked && seq_len > 0);
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
    let role = match pass.role {
        StateRole::InPlace => "",
        StateRole::FromZero => "states_",
        StateRole::FromOwner(_) => "branches_",
    };

    // (entry point, threadgroups along x, threads per threadgroup, threadgroup memory)
    let (entry, groups_x, threads, threadgroup_bytes) = match chunked_dk {
        Some(dk_padded) => {
            let simdgroups = CHUNKED_COLUMNS_PER_GROUP / CHUNKED_COLUMNS_PER_SIMDGROUP;
            (
                format!("gated_delta_rule_chunked_{role}{suffix}_dk{dk_padded}"),
                dv.div_ceil(CHUNKED_COLUMNS_PER_GROUP),
                SIMD_WIDTH * simdgroups,
                Some(chunked_threadgroup_bytes(dk_padded, simdgroups)),
            )
        }
        None => (
            format!(
                "gated_delta_rule_{role}{suffix}_nk{}",
                gdr_rows_per_lane(dk)?
            ),
            dv.div_ceil(COLUMNS_PER_GROUP),
            SIMD_WIDTH * COLUMNS_PER_GROUP,
            None,
        ),
    };

    let pipeline = pipeline(dev, &SOURCE, &entry)?;
    let width = pipeline.as_ref().threadExecutionWidth();
    if width != SIMD_WIDTH {
        bail!("gated-delta-rule: the kernel needs {SIMD_WIDTH}-wide simdgroups, this GPU runs {width}")
    }
    let max_threads = pipeline.as_ref().maxTotalThreadsPerThreadgroup();
    if max_threads < threads {
        bail!("gated-delta-rule: {entry} takes at most {max_threads} threads a threadgroup, it needs {threads}")
    }
    // Everything that allocates comes before the encoder (it holds the command mutex).
    let lengths_bytes = std::mem::size_of_val(pass.lengths);
    let lengths_buf = if lengths_bytes > SET_BYTES_LIMIT {
        Some(dev.new_buffer_with_data(pass.lengths)?)
    } else {
        None
    };
    if o_elems == 0 {
        return Ok(());
    }
    let guard = dev.command_encoder()?;
    let enc: &candle_metal_kernels::metal::ComputeCommandEncoder = guard.as_ref();
    enc.set_compute_pipeline_state(&pipeline);
    enc.set_input_buffer(0, Some(pass.qkv.0), pass.qkv.1);
    enc.set_input_buffer(1, Some(pass.gates.0), pass.gates.1);
    match pass.role {
        // Read by the branches' dispatch: declared as an input, so candle orders it after the
        // states' dispatch that wrote it.
        StateRole::FromOwner(owners) => {
            enc.set_input_buffer(2, Some(pass.state.0), pass.state.1);
            enc.set_input_buffer(6, Some(owners), 0);
        }
        // Written (and, in place, read): declared as an output, so candle orders this dispatch
        // after earlier readers and writers of the state.
        StateRole::InPlace | StateRole::FromZero => {
            enc.set_output_buffer(2, Some(pass.state.0), pass.state.1)
        }
    }
    enc.set_output_buffer(3, Some(pass.o.0), pass.o.1);
    match &lengths_buf {
        Some(buf) => enc.set_input_buffer(4, Some(buf), 0),
        None => enc.set_bytes_directly(4, lengths_bytes, pass.lengths.as_ptr().cast()),
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
    Ok(())
}

/// The split form ([`super::gated_delta_rule_split`]) in two dispatches writing one packed `o`:
/// the state rows from zero states into a state buffer of their own, then the branch rows, each
/// starting from its owner's final state there. Inputs contiguous (`qa` the states' `[R, S, C]`,
/// `qb` the branches' `[B, T, C]`, `gates` packed `[R·S + B·T, Hv, 2]`); each part takes the
/// chunked or the step-by-step kernel as [`super::gated_delta_rule`] would for it alone.
pub(crate) fn gated_delta_rule_split(
    op: &GatedDeltaRuleSplit,
    qa: &MetalStorage,
    la: &Layout,
    qb: &MetalStorage,
    lb: &Layout,
    gates: &MetalStorage,
    lg: &Layout,
) -> Result<(MetalStorage, Shape)> {
    let dims = op.dims;
    let split = &op.split;
    let dtype = qa.dtype();
    if qb.dtype() != dtype || gates.dtype() != DType::F32 {
        bail!(
            "gated-delta-rule-split: states {dtype:?} and branches {:?} must share a dtype, gates must be f32 (got {:?})",
            qb.dtype(),
            gates.dtype()
        )
    }
    if dims.head_k_dim == 0 || dims.head_v_dim == 0 {
        bail!("gated-delta-rule-split: empty heads in {dims:?}")
    }
    if op.conv.is_some() {
        bail!("gated-delta-rule-split: the conv runs inside the delta rule on CUDA only")
    }
    let (hv, dk, dv) = (dims.num_v_heads, dims.head_k_dim, dims.head_v_dim);
    let (states, s_len) = (split.states(), split.state_width());
    let (branches, t_len) = (split.branches(), split.branch_width());
    let (o_s, o_all) = (states * s_len * hv * dv, split.tokens() * hv * dv);
    let to_u32 = |v: &[usize], width: usize| -> Vec<u32> {
        v.iter().map(|&l| l.min(width) as u32).collect()
    };
    let (lengths_s, lengths_b) = (
        to_u32(split.state_lengths(), s_len),
        to_u32(split.branch_lengths(), t_len),
    );
    // Auto's choice per part, as `gated_delta_rule` makes it for that part alone.
    let chunked = |seq_len: usize| dtype != DType::F32 && seq_len >= METAL_CHUNKED_MIN_LEN;
    let gates_off = byte_offset(lg, DType::F32, "gated-delta-rule-split: gates")?;
    let dev = qa.device().clone();
    // Metal has no empty buffers: the caller runs this with both parts non-empty.
    let owners: Vec<u32> = split.owners().iter().map(|&o| o as u32).collect();
    let owners_buf = dev.new_buffer_with_data(&owners)?;
    let state = dev.new_buffer(
        (states * hv * dk * dv).max(1),
        DType::F32,
        "gated-delta-rule-split states",
    )?;
    let o = dev.new_buffer(o_all.max(1), dtype, "gated-delta-rule-split o")?;
    let elem = dtype.size_in_bytes();
    encode(
        &dev,
        dims,
        dtype,
        &Pass {
            b_sz: states,
            seq_len: s_len,
            lengths: &lengths_s,
            chunked: chunked(s_len),
            qkv: (
                qa.buffer(),
                byte_offset(la, dtype, "gated-delta-rule-split: states")?,
            ),
            gates: (gates.buffer(), gates_off),
            state: (&state, 0),
            o: (&o, 0),
            role: StateRole::FromZero,
        },
    )?;
    encode(
        &dev,
        dims,
        dtype,
        &Pass {
            b_sz: branches,
            seq_len: t_len,
            lengths: &lengths_b,
            chunked: chunked(t_len),
            qkv: (
                qb.buffer(),
                byte_offset(lb, dtype, "gated-delta-rule-split: branches")?,
            ),
            gates: (
                gates.buffer(),
                gates_off + states * s_len * hv * 2 * DType::F32.size_in_bytes(),
            ),
            state: (&state, 0),
            o: (&o, o_s * elem),
            role: StateRole::FromOwner(&owners_buf),
        },
    )?;
    let shape = Shape::from((split.tokens(), hv, dv));
    Ok((MetalStorage::new(o, dev, o_all, dtype), shape))
}
