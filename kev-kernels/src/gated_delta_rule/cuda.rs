//! The gated delta rule on CUDA: the recurrent kernels (`recurrent.cu`, one warp per state
//! column group), the chunked ones (`chunked.cu`, a preparation and a scan per chunk) and the
//! split form's three launches over both. See the sources for grids, ownership and layouts.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Shape};

use super::op::{GatedDeltaRule, GatedDeltaRuleSplit};
use crate::backend::cuda::gpu::gpu;
use crate::backend::cuda::kernel::{
    contiguous, device_lengths, device_table, tag, DeviceLengths, Kernel,
};
use crate::backend::cuda::sources::{
    CHUNK, FMA_THREADS, GDR_CHUNKED, GDR_RECURRENT, MAX_DIM, MMA_THREADS, PREPARE_MMA_SMEM,
    PREPARE_SMEM, RECURRENT_WARPS, SCAN_MMA, SCAN_READ, SCAN_SHARED, SCAN_SMEM, SCAN_WRITE,
};

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

/// The delta rule's lengths (rows of `steps` steps), or none when no row is padded (most calls:
/// one upload fewer).
fn gdr_lengths(dev: &CudaDevice, lengths: &[u32], steps: usize) -> Result<DeviceLengths> {
    let padded = lengths.iter().any(|&l| l as usize != steps);
    device_lengths(dev, padded.then_some(lengths))
}

/// The op's CUDA forward: the chunked kernels where the op asks for them and Dk, Dv ≤ 128, the
/// recurrent kernel otherwise.
pub(crate) fn gated_delta_rule(
    op: &GatedDeltaRule,
    state: &mut CudaStorage,
    sl: &Layout,
    qkv: &CudaStorage,
    ql: &Layout,
    gates: &CudaStorage,
    gl: &Layout,
) -> Result<()> {
    let dims = op.dims;
    if op.cuda_chunked() {
        return gated_delta_rule_chunked(op, state, sl, qkv, ql, gates, gl);
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
        &GDR_RECURRENT,
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
    let gates = gates.as_cuda_slice::<f32>()?.slice(g0..g1);
    let mut st = state.as_cuda_slice_mut::<f32>()?.slice_mut(s0..s1);
    let n_out = op.b_sz * op.seq_len * dims.num_v_heads * dims.head_v_dim;
    let cfg = LaunchConfig {
        grid_dim: (
            dims.head_v_dim.div_ceil(RECURRENT_WARPS * cols) as u32,
            (op.b_sz * dims.num_v_heads) as u32,
            1,
        ),
        block_dim: ((32 * RECURRENT_WARPS) as u32, 1, 1),
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
        b.arg(&x).arg(&gates).arg(&mut st).arg(&out);
        b.arg(&lengths.ptr);
        for v in &ints {
            b.arg(v);
        }
        // SAFETY: argument types and order match `gdr_*` in recurrent.cu; the wrapper checked
        // every shape, so all indices stay inside the buffers.
        unsafe { b.launch(cfg) }.w()?;
        op.set_output(candle_core::Storage::Cuda(CudaStorage::wrap_cuda_slice(
            out,
            k.dev.clone(),
        )));
        Ok(())
    })
}

/// The chunked form (chunked.cu): a preparation kernel per chunk writes the state-free
/// products to f32 scratch, then a scan kernel per 32 state columns walks the chunks.
fn gated_delta_rule_chunked(
    op: &GatedDeltaRule,
    state: &mut CudaStorage,
    sl: &Layout,
    qkv: &CudaStorage,
    ql: &Layout,
    gates: &CudaStorage,
    gl: &Layout,
) -> Result<()> {
    let dims = op.dims;
    let dtag = tag(qkv.dtype(), "gated-delta-rule")?;
    // bf16/f16 on tensor cores (TF32 products in the preparation, bf16 in the scan) where the GPU
    // has them; f32 models keep full f32 products. The two pairs lay out W, Q', K' and Aqk
    // differently, so they never mix.
    let tc = qkv.dtype() != DType::F32 && gpu(qkv.device())?.tensor_cores;
    let heads = op.b_sz * dims.num_v_heads;
    let load = |name: &str| Kernel::load(&GDR_CHUNKED, qkv.device(), &format!("{name}{dtag}"));
    let prep_smem = if tc { PREPARE_MMA_SMEM } else { PREPARE_SMEM };
    let prep = load(if tc { "gdrc_prep_tc_" } else { "gdrc_prep_" })?;
    prep.allow_shared_memory(prep_smem)?;
    let (scan, scan_cols, scan_smem) = if tc {
        tc_scan(qkv.device(), dtag, heads, dims.head_v_dim)?
    } else {
        let scan = load("gdrc_scan_")?;
        scan.allow_shared_memory(SCAN_SMEM)?;
        (scan, 32, SCAN_SMEM)
    };
    let (q0, q1) = contiguous(ql, "gated-delta-rule qkv")?;
    let (g0, g1) = contiguous(gl, "gated-delta-rule gates")?;
    let (s0, s1) = contiguous(sl, "gated-delta-rule state")?;
    let lengths = gdr_lengths(&prep.dev, &op.lengths, op.seq_len)?;
    let gates = gates.as_cuda_slice::<f32>()?.slice(g0..g1);
    let mut st = state.as_cuda_slice_mut::<f32>()?.slice_mut(s0..s1);
    let chunks = op.seq_len.div_ceil(CHUNK);
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
    let block = (if tc { MMA_THREADS } else { FMA_THREADS }, 1, 1);
    by_dtype!(qkv.dtype(), "gated-delta-rule", |T| {
        let x = qkv.as_cuda_slice::<T>()?.slice(q0..q1);
        let mut b = prep.stream.launch_builder(&prep.func);
        b.arg(&x).arg(&gates);
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
            b.arg(&no_owners).arg(&lengths.ptr);
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
    let [.., narrowest] = SCAN_MMA;
    // 64 columns ask for more shared memory than sm_86/89 give a block.
    let (cols, name, smem) = SCAN_MMA
        .into_iter()
        .find(|&(cols, _, smem)| {
            smem as usize <= gpu.shared_memory_per_block
                && heads * dv.div_ceil(cols) >= gpu.multiprocessors
        })
        .unwrap_or(narrowest);
    let scan = Kernel::load(&GDR_CHUNKED, dev, &format!("{name}{dtag}"))?;
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
        let (c, d) = (CHUNK, MAX_DIM);
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
    op: &GatedDeltaRuleSplit,
    qa: &CudaStorage,
    la: &Layout,
    qb: &CudaStorage,
    lb: &Layout,
    gates: &CudaStorage,
    lg: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dims = op.dims;
    let dev = qa.device();
    let dtag = tag(qa.dtype(), "gated-delta-rule")?;
    if !gpu(dev)?.tensor_cores || qa.dtype() == DType::F32 || qb.dtype() != qa.dtype() {
        bail!("gated-delta-rule-split: needs bf16/f16 inputs and tensor cores")
    }
    let (hv, dv) = (dims.num_v_heads, dims.head_v_dim);
    let split = &op.split;
    let (states, s_len) = (split.states(), split.state_width());
    let (rows, width) = (split.branches(), split.branch_width());
    let (nc_a, nc_b) = (s_len.div_ceil(CHUNK), width.div_ceil(CHUNK));
    let (blocks_a, blocks_b) = (nc_a * states * hv, nc_b * rows * hv);
    let prep_name = if op.conv.is_some() {
        "gdrc_prep2c_tc_"
    } else {
        "gdrc_prep2_tc_"
    };
    let prep = Kernel::load(&GDR_CHUNKED, dev, &format!("{prep_name}{dtag}"))?;
    prep.allow_shared_memory(PREPARE_MMA_SMEM)?;
    let (scan_a, cols_a, smem_a) = tc_scan(dev, dtag, states * hv, dv)?;
    let (scan_b, cols_b, smem_b) = tc_scan(dev, dtag, rows * hv, dv)?;
    // Conv outputs, contiguous; or (conv) raw rows at their own pitch.
    let sa = crate::layout::rows::row_view(la, "gated-delta-rule-split state rows")?;
    let sb = crate::layout::rows::row_view(lb, "gated-delta-rule-split branch rows")?;
    if op.conv.is_none() && (sa.stride != sa.cols || sb.stride != sb.cols) {
        bail!("gated-delta-rule-split: expected contiguous rows, got {la:?} and {lb:?}")
    }
    let conv_w = op.conv.as_ref().map(|w| w.storage_and_layout());
    let (g0, g1) = contiguous(lg, "gated-delta-rule-split gates")?;
    let gates = gates.as_cuda_slice::<f32>()?;
    let s_tokens = states * s_len;
    let g_split = g0 + s_tokens * hv * 2;
    let (gates_a, gates_b) = (gates.slice(g0..g_split), gates.slice(g_split..g1));
    let lengths = device_table(&prep.dev, split.branch_lengths_on_device()?)?;
    let state_lengths = device_table(&prep.dev, split.state_lengths_on_device()?)?;
    let owners = device_table(&prep.dev, split.owners_on_device()?)?;
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
            .arg(&gates_a)
            .arg(&state_lengths.ptr)
            .arg(&s_i)
            .arg(&nc_a_i)
            .arg(&bh_a_i);
        b.arg(&xb)
            .arg(&gates_b)
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
            block_dim: (MMA_THREADS, 1, 1),
            shared_mem_bytes: PREPARE_MMA_SMEM,
        };
        // SAFETY: argument types and order match `gdrc_prep2_tc_*` (with the conv's owners,
        // weight and pitches, `gdrc_prep2c_tc_*`); the scratch holds one block per launched
        // block, the inputs have the shapes the wrapper checked (Dk, Dv ≤ 128; rows of C
        // channels at their pitch; owners below R, lengths at most S and T, as `SplitBatch`
        // checks; a contiguous [C, 4] weight).
        unsafe { b.launch(cfg) }.w()?;

        let out = scan_a.output::<T>(split.tokens() * hv * dv)?;
        let out_a = out.slice(0..s_tokens * hv * dv);
        let out_b = out.slice(s_tokens * hv * dv..);
        let [wt_b, qt_b, kd_b, at_b, u_b, gtot_b] = layout.parts(&scratch, blocks_a);
        let no_owners = 0u64;
        for (scan, cols, smem, parts, owners, lens, o, t, nc, heads, mode) in [
            (
                &scan_a,
                cols_a,
                smem_a,
                [&wt, &u, &qt, &kd, &at, &gtot],
                &no_owners,
                &state_lengths.ptr,
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
                &lengths.ptr,
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
            b.arg(&mut state).arg(owners).arg(lens).arg(o);
            b.arg(&t_i)
                .arg(&hv_i)
                .arg(&dk_i)
                .arg(&dv_i)
                .arg(&nc_i)
                .arg(&mode);
            let cfg = LaunchConfig {
                grid_dim: (dv.div_ceil(cols) as u32, heads as u32, 1),
                block_dim: (MMA_THREADS, 1, 1),
                shared_mem_bytes: smem,
            };
            // SAFETY: argument types and order match `gdrc_scan_tc*`; each scan reads the scratch
            // blocks of its own part, writes its own rows of `out`; the branches' scan only
            // reads the states (SCAN_SHARED without SCAN_WRITE, owners below R as `SplitBatch`
            // checks), after the states' scan on the same stream wrote them.
            unsafe { b.launch(cfg) }.w()?;
        }
        let shape = Shape::from((split.tokens(), hv, dv));
        op.keep(|| {
            candle_core::Storage::Cuda(CudaStorage::wrap_cuda_slice(state, prep.dev.clone()))
        });
        Ok((CudaStorage::wrap_cuda_slice(out, prep.dev.clone()), shape))
    })
}
