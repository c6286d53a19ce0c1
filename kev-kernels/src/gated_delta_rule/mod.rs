//! The gated delta rule (Gated DeltaNet recurrence), docs/BACKBONE.md §3 step 7 / §8.1.
//!
//! Per batch row b and value head h, with the state `S: [Dk, Dv]` (f32) and for each step t:
//! ```text
//! q ← l2norm(q)/√Dk,  k ← l2norm(k)                 (eps 1e-6 on Σx², as HF and FLA)
//! S ← exp(g_t)·S                                     (g_t ≤ 0 is the log decay)
//! δ ← β_t·(v_t − Sᵀk)
//! S ← S + k ⊗ δ
//! o_t = Sᵀq
//! ```
//! Value head h reads key head `h / (Hv/Hk)` (repeat-interleave, the HF checkpoint order).
//! The state is updated **in place** so a layer cache can continue from it; steps at or past a
//! row's length (right padding of a batch) are skipped: the state is left untouched and the
//! output is zero.

mod chunked;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "metal")]
mod metal;
mod op;
mod reference;

use std::sync::Mutex;

use candle_core::{bail, CpuStorage, DType, Device, InplaceOp3, Layout, Result, Shape, Tensor};

use crate::backend::cuda::cuda_gpu;
use crate::causal_conv1d::causal_conv1d_split;
use crate::dispatch::{self, backend, counted_zeros, record, Backend, CountedTensor};
use crate::layout::rows::{as_row_view, RowView};
use crate::layout::split::SplitBatch;
use op::{check, GatedDeltaRule, GatedDeltaRuleSplit};

pub use chunked::gated_delta_rule_chunked;
pub use op::{GdrDims, GdrForm, CHUNKED_MIN_LEN, METAL_CHUNKED_MIN_LEN};
pub use reference::gated_delta_rule_ref;

impl candle_core::CustomOp3 for GatedDeltaRuleSplit {
    fn name(&self) -> &'static str {
        "gated-delta-rule-split"
    }

    cuda_only_cpu_fwd!(
        "gated-delta-rule-split runs on CUDA and Metal only",
        _a _la, _b _lb, _c _lc
    );

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qa: &candle_core::CudaStorage,
        la: &Layout,
        qb: &candle_core::CudaStorage,
        lb: &Layout,
        gates: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::gated_delta_rule_split(self, qa, la, qb, lb, gates, lg)
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        qa: &candle_core::MetalStorage,
        la: &Layout,
        qb: &candle_core::MetalStorage,
        lb: &Layout,
        gates: &candle_core::MetalStorage,
        lg: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        metal::gated_delta_rule_split(self, qa, la, qb, lb, gates, lg)
    }
}

/// Records' state rows and the branch rows that continue them (the one-pass prefix form): the
/// delta rule on the states from zero states, then on the branch rows from copies of their
/// states' final states, packed.
///
/// `state_qkv: [R, S, C]` and `branch_qkv: [B, T, C]` are the conv outputs, `gates: [R·S + B·T, Hv,
/// 2]` the gates packed as the rows, `split` their real lengths and owners. Returns
/// `o: [R·S + B·T, Hv, Dv]`: the numbers of [`gated_delta_rule`] run on the states from zero
/// states, then on the branch rows from copies of their states' final states.
///
/// On CUDA with tensor cores (bf16 or f16, Dk and Dv at most 128, both parts of at least
/// [`CHUNKED_MIN_LEN`] steps) three launches on the chunked kernels where the composition takes
/// eight (a zero state, two preparations, two scans, the states copied to the branch rows, two
/// copies joining the outputs): one preparation grid for both parts, the states' scan from zero,
/// then the branches' scan reading its state row's final state in place; both write one packed
/// output, with the same kernels, blocks and sums as the composition. On Metal two dispatches
/// where the composition takes six (a zero state, two delta rules, the gather, two copies
/// joining the outputs): the states' from zero states, then the branches' from their state
/// rows' final states, read in place, both into one packed output, each with the kernel the
/// composition would choose for it. On the CPU the two [`gated_delta_rule`] calls.
///
/// Errors name what does not fit: shapes against `split`, head counts (Hv a multiple of Hk > 0),
/// the two parts' dtypes, gates other than f32.
pub fn gated_delta_rule_split(
    state_qkv: &Tensor,
    branch_qkv: &Tensor,
    gates: &Tensor,
    dims: GdrDims,
    split: &SplitBatch,
) -> Result<Tensor> {
    let call = SplitCall::new(state_qkv, branch_qkv, gates, dims, split);
    Ok(call.run(false)?.0)
}

/// [`gated_delta_rule_split`]'s fused form alone (its checks first): `None` where it does not
/// run. Public through [`crate::testing`], for the tests that it runs where it should.
pub fn fused_gated_delta_rule_split(
    state_qkv: &Tensor,
    branch_qkv: &Tensor,
    gates: &Tensor,
    dims: GdrDims,
    split: &SplitBatch,
) -> Result<Option<Tensor>> {
    let call = SplitCall::new(state_qkv, branch_qkv, gates, dims, split);
    Ok(call.fused(false)?.map(|(o, _)| o))
}

/// [`causal_conv1d_split`] followed by [`gated_delta_rule_split`]: the layer's conv and delta
/// rule on records' state rows and the branch rows that continue them.
///
/// `state_raw: [R, S, C]` and `branch_raw: [B, T, C]` are the raw `in_proj` `[q | k | v]` rows
/// (row views of the wider projection are read in place), `weight: [C, K]` the conv's; `gates`,
/// `dims`, `split` as in [`gated_delta_rule_split`]. Returns `o: [R·S + B·T, Hv, Dv]`.
///
/// On CUDA, where [`gated_delta_rule_split`] runs fused, the conv has 4 steps, there are as many
/// value heads as key heads and the kernel's 8- and 16-byte moves fit (Dk and Dv multiples of 4,
/// rows starting at multiples of 4 elements, the weight at a multiple of 8), the conv runs inside
/// the delta rule's preparation: it reads the raw rows, and the conv's output (the layer's
/// largest activation after `in_proj`'s) never goes to memory. The same arithmetic per output
/// and the same sums as the two calls, so the same numbers. The 0.8B model takes it (16 key and
/// value heads), the 4B one does not (16 and 32: each value head's block would run its key
/// head's conv again, slower than the two calls, A/B on the H200). Elsewhere the two calls.
///
/// Errors name what does not fit, as [`gated_delta_rule_split`]'s and
/// [`causal_conv1d_split`]'s, and a weight of another channel count or dtype.
pub fn conv_gated_delta_rule_split(
    state_raw: &Tensor,
    branch_raw: &Tensor,
    weight: &Tensor,
    gates: &Tensor,
    dims: GdrDims,
    split: &SplitBatch,
) -> Result<Tensor> {
    let call = SplitCall::new(state_raw, branch_raw, gates, dims, split);
    Ok(call.run_conv(weight, false)?.0)
}

/// [`conv_gated_delta_rule_split`] that also returns the states' final recurrent matrices
/// `[R, Hv, Dk, Dv]` f32: their rows of a cache, as [`gated_delta_rule`] on the states' conv
/// output from zero leaves them. On CUDA the fused kernels hand back the matrices their states'
/// scan wrote (no extra work); elsewhere the composed calls keep theirs.
pub fn conv_gated_delta_rule_split_keeping(
    state_raw: &Tensor,
    branch_raw: &Tensor,
    weight: &Tensor,
    gates: &Tensor,
    dims: GdrDims,
    split: &SplitBatch,
) -> Result<(Tensor, Tensor)> {
    let call = SplitCall::new(state_raw, branch_raw, gates, dims, split);
    match call.run_conv(weight, true)? {
        (o, Some(kept)) => Ok((o, kept)),
        (_, None) => bail!("conv-gated-delta-rule-split: no states kept"),
    }
}

/// [`conv_gated_delta_rule_split`]'s fused form alone (its checks first): `None` where it does
/// not run. Public through [`crate::testing`], for the tests that it runs where it should.
pub fn fused_conv_gated_delta_rule_split(
    state_raw: &Tensor,
    branch_raw: &Tensor,
    weight: &Tensor,
    gates: &Tensor,
    dims: GdrDims,
    split: &SplitBatch,
) -> Result<Option<Tensor>> {
    let call = SplitCall::new(state_raw, branch_raw, gates, dims, split);
    Ok(call.fused_conv(weight, false)?.map(|(o, _)| o))
}

/// One split call's inputs: the states' and the branches' rows (conv outputs, or for the conv
/// forms the raw `in_proj` rows), the packed gates, the heads and the split. Its forms return the
/// packed output and, when asked to keep them, the states' final recurrent matrices.
#[derive(Clone, Copy)]
struct SplitCall<'a> {
    state: &'a Tensor,
    branch: &'a Tensor,
    gates: &'a Tensor,
    dims: GdrDims,
    split: &'a SplitBatch,
}

/// A split form's output, and the states' final matrices when kept.
type Kept = (Tensor, Option<Tensor>);

impl<'a> SplitCall<'a> {
    fn new(
        state: &'a Tensor,
        branch: &'a Tensor,
        gates: &'a Tensor,
        dims: GdrDims,
        split: &'a SplitBatch,
    ) -> Self {
        Self {
            state,
            branch,
            gates,
            dims,
            split,
        }
    }

    /// [`gated_delta_rule_split`]: fused where it runs, else composed.
    fn run(self, keep: bool) -> Result<Kept> {
        if let Some(out) = self.fused(keep)? {
            return Ok(out);
        }
        let (o, state) = self.composed()?;
        Ok((o, keep.then_some(state)))
    }

    /// [`gated_delta_rule_split`] off its fused kernels: the states' [`gated_delta_rule`] from a
    /// zero state, the state rows gathered per branch, the branches' from them, the outputs
    /// joined; and the states' final matrices.
    fn composed(self) -> Result<(Tensor, Tensor)> {
        let (dims, split) = (self.dims, self.split);
        let (gates_s, gates_b) = split.parts(self.gates)?;
        let shape = (
            split.states(),
            dims.num_v_heads,
            dims.head_k_dim,
            dims.head_v_dim,
        );
        let state = counted_zeros(shape, DType::F32, self.state.device())?;
        let lengths_s = Some(split.state_lengths());
        let o_s = gated_delta_rule(self.state, &gates_s, &state, dims, lengths_s)?;
        let state_b = split.to_branches(&state)?;
        let lengths_b = Some(split.branch_lengths());
        let o_b = gated_delta_rule(self.branch, &gates_b, &state_b, dims, lengths_b)?;
        Ok((split.join(&o_s, &o_b)?, state))
    }

    /// The fused form (its checks first), `None` where it does not run; with `keep` handing back
    /// the states' final matrices too (CUDA: the ones its states' scan wrote; Metal keeps none,
    /// so does not run fused then).
    fn fused(self, keep: bool) -> Result<Option<Kept>> {
        let name = "gated-delta-rule-split";
        let metal = backend(self.state.device()) == Backend::Metal;
        if !self.applies(name)? || (keep && metal) {
            return Ok(None);
        }
        let op = GatedDeltaRuleSplit {
            dims: self.dims,
            split: self.split.clone(),
            conv: None,
            kept: keep.then(|| Mutex::new(None)),
        };
        let (packed_state, packed_branches, packed_gates) = (
            self.state.counted_contiguous()?,
            self.branch.counted_contiguous()?,
            self.gates.counted_contiguous()?,
        );
        // CUDA: a preparation over both parts, then a scan per part
        // (`cuda::gated_delta_rule_split`); Metal: a dispatch per part
        // (`metal::gated_delta_rule_split`).
        let launches = if metal { 2 } else { 3 };
        let out = dispatch::launch(
            name,
            launches,
            self.state.device(),
            || {
                let o = packed_state.apply_op3_no_bwd(&packed_branches, &packed_gates, &op)?;
                Ok((o, op.take_kept()?))
            },
            || {
                let (o, state) = self.composed()?;
                Ok((o, keep.then_some(state)))
            },
        )?;
        Ok(Some(out))
    }

    /// [`conv_gated_delta_rule_split`] (`self` holding raw rows): fused where it runs, else the
    /// conv's split form, then [`SplitCall::run`].
    fn run_conv(self, weight: &Tensor, keep: bool) -> Result<Kept> {
        if let Some(out) = self.fused_conv(weight, keep)? {
            return Ok(out);
        }
        self.conv_then_run(weight, keep)
    }

    /// The conv's split form, then the delta rule's on its output.
    fn conv_then_run(self, weight: &Tensor, keep: bool) -> Result<Kept> {
        let (state, branch) = causal_conv1d_split(self.state, self.branch, weight, self.split)?;
        SplitCall::new(&state, &branch, self.gates, self.dims, self.split).run(keep)
    }

    /// [`conv_gated_delta_rule_split`]'s fused form, `None` where it does not run.
    fn fused_conv(self, weight: &Tensor, keep: bool) -> Result<Option<Kept>> {
        let (state_raw, branch_raw, gates, dims, split) =
            (self.state, self.branch, self.gates, self.dims, self.split);
        let name = "conv-gated-delta-rule-split";
        let (channels, k) = weight.dims2()?;
        if channels != dims.channels()
            || weight.dtype() != state_raw.dtype()
            || !weight.device().same_device(state_raw.device())
        {
            bail!(
                "{name}: conv weight {:?} ({:?} on {:?}) does not fit {} channels of {:?} on {:?}",
                weight.dims(),
                weight.dtype(),
                weight.device().location(),
                dims.channels(),
                state_raw.dtype(),
                state_raw.device().location()
            )
        }
        // Hv > Hk: 4B 8 records 83.7, 84.0 → 84.1, 84.4 ms, one request 12.7 → 12.8, 12.9 ms. The
        // kernel moves 4 channels of a row (8 bytes) at a time.
        let heads_fit = dims.num_v_heads == dims.num_k_heads
            && dims.head_k_dim.is_multiple_of(4)
            && dims.head_v_dim.is_multiple_of(4);
        // CUDA only: Metal runs the conv and the delta rule as their own split forms.
        let cuda = backend(state_raw.device()) == Backend::Cuda;
        if !self.applies(name)? || !cuda || !heads_fit || k != 4 {
            return Ok(None);
        }
        let (state_rows, branch_rows, packed_weight) = (
            as_row_view(state_raw)?,
            as_row_view(branch_raw)?,
            weight.counted_contiguous()?,
        );
        // Rows at multiples of 4 elements (8 bytes), the weight at a multiple of 8 (read two
        // channels' taps, 16 bytes, at a time).
        let in_fours = |t: &Tensor| {
            RowView::of(t.layout())
                .is_some_and(|r| r.offset.is_multiple_of(4) && r.stride.is_multiple_of(4))
        };
        let aligned = in_fours(&state_rows)
            && in_fours(&branch_rows)
            && packed_weight.layout().start_offset().is_multiple_of(8);
        if !aligned {
            return Ok(None);
        }
        let op = GatedDeltaRuleSplit {
            dims,
            split: split.clone(),
            conv: Some(packed_weight),
            kept: keep.then(|| Mutex::new(None)),
        };
        let packed_gates = gates.counted_contiguous()?;
        // The conv inside the preparation: the same three launches as the unfused split form.
        let out = dispatch::launch(
            name,
            3,
            state_raw.device(),
            || {
                let o = state_rows.apply_op3_no_bwd(&branch_rows, &packed_gates, &op)?;
                Ok((o, op.take_kept()?))
            },
            || self.conv_then_run(weight, keep),
        )?;
        Ok(Some(out))
    }

    /// The split wrappers' checks (errors naming what does not fit), then whether the fused form
    /// runs: both parts hold steps and [`fused_split_applies`].
    fn applies(self, name: &str) -> Result<bool> {
        let (state_qkv, branch_qkv, gates, dims, split) =
            (self.state, self.branch, self.gates, self.dims, self.split);
        let (states, s_len, c) = state_qkv.dims3()?;
        let (b_rows, width, cb) = branch_qkv.dims3()?;
        split.check_parts(name, state_qkv, branch_qkv)?;
        if c != dims.channels() || cb != c || gates.dims() != [split.tokens(), dims.num_v_heads, 2]
        {
            bail!(
                "{name}: state {:?}, branches {:?} and gates {:?} do not fit {dims:?}",
                state_qkv.dims(),
                branch_qkv.dims(),
                gates.dims()
            )
        }
        let (hk, hv) = (dims.num_k_heads, dims.num_v_heads);
        if hk == 0 || hv % hk != 0 {
            bail!("{name}: {hv} value heads are not a multiple of {hk} key heads")
        }
        if state_qkv.dtype() != branch_qkv.dtype() || gates.dtype() != DType::F32 {
            bail!(
                "{name}: state {:?} and branches {:?} must share a dtype, gates must be f32 (got {:?})",
                state_qkv.dtype(),
                branch_qkv.dtype(),
                gates.dtype()
            )
        }
        Ok(states > 0
            && s_len > 0
            && width > 0
            && b_rows > 0
            && fused_split_applies(state_qkv.dtype(), state_qkv.device(), dims, s_len, width))
    }
}

/// Whether a split of `s_len` and `width` steps in `dtype` on `device` runs the conv and the
/// delta rule ([`conv_gated_delta_rule_split`]) on CUDA kernels that read the split's lengths
/// and owners from its table ([`SplitBatch::host_table`]) alone, none from the host: then a
/// CUDA graph of it serves splits of other lengths once the table is rewritten. (The
/// composed forms upload the host's lengths.)
pub fn split_reads_table(
    dtype: DType,
    device: &Device,
    dims: GdrDims,
    s_len: usize,
    width: usize,
) -> bool {
    backend(device) == Backend::Cuda
        && s_len > 0
        && width > 0
        && fused_split_applies(dtype, device, dims, s_len, width)
}

/// Whether [`gated_delta_rule_split`] has its fused form here: on Metal always (each part takes
/// the kernel [`gated_delta_rule`] would), on CUDA under the conditions under which
/// [`gated_delta_rule`] would run both parts on the chunked tensor-core kernels.
fn fused_split_applies(
    dtype: DType,
    device: &Device,
    dims: GdrDims,
    s_len: usize,
    width: usize,
) -> bool {
    if backend(device) == Backend::Metal {
        return true;
    }
    dtype != DType::F32
        && cuda_gpu(device).is_some_and(|gpu| gpu.tensor_cores)
        && dims.head_k_dim.max(dims.head_v_dim) <= 128
        && op::auto_prefers_chunked(s_len)
        && op::auto_prefers_chunked(width)
}

impl InplaceOp3 for GatedDeltaRule {
    fn name(&self) -> &'static str {
        "gated-delta-rule"
    }

    fn cpu_fwd(
        &self,
        state: &mut CpuStorage,
        sl: &Layout,
        qkv: &CpuStorage,
        ql: &Layout,
        gates: &CpuStorage,
        gl: &Layout,
    ) -> Result<()> {
        cpu::gated_delta_rule(self, state, sl, qkv, ql, gates, gl)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        state: &mut candle_core::CudaStorage,
        sl: &Layout,
        qkv: &candle_core::CudaStorage,
        ql: &Layout,
        gates: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        cuda::gated_delta_rule(self, state, sl, qkv, ql, gates, gl)
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        state: &mut candle_core::MetalStorage,
        sl: &Layout,
        qkv: &candle_core::MetalStorage,
        ql: &Layout,
        gates: &candle_core::MetalStorage,
        gl: &Layout,
    ) -> Result<()> {
        metal::gated_delta_rule(self, state, sl, qkv, ql, gates, gl)
    }
}

/// Runs the gated delta rule over `T` steps and returns `o` ([`GdrForm::Auto`]).
///
/// - `qkv`: `[B, T, 2·Hk·Dk + Hv·Dv]`, the conv output packed as `[q | k | v]`, heads contiguous
///   inside each part (any float dtype; read as f32);
/// - `gates`: `[B, T, Hv, 2]` f32, `(g, β)` per step and value head, g the log decay;
/// - `state`: `[B, Hv, Dk, Dv]` f32, contiguous, **updated in place** (own its storage: a tensor
///   clone shares it);
/// - `lengths`: per-row number of real steps (right padding beyond it is ignored), or `None`.
///
/// Returns `o: [B, T, Hv, Dv]` in the dtype of `qkv`.
pub fn gated_delta_rule(
    qkv: &Tensor,
    gates: &Tensor,
    state: &Tensor,
    dims: GdrDims,
    lengths: Option<&[usize]>,
) -> Result<Tensor> {
    gated_delta_rule_as(qkv, gates, state, dims, lengths, GdrForm::Auto)
}

/// [`gated_delta_rule`] with the algorithm chosen by the caller (benchmarks and tests of each
/// form's kernels).
pub fn gated_delta_rule_as(
    qkv: &Tensor,
    gates: &Tensor,
    state: &Tensor,
    dims: GdrDims,
    lengths: Option<&[usize]>,
    form: GdrForm,
) -> Result<Tensor> {
    let (b_sz, seq_len) = check(qkv, gates, state, dims, lengths)?;
    let op = GatedDeltaRule {
        dims,
        b_sz,
        seq_len,
        lengths: match lengths {
            Some(l) => l.iter().map(|&x| x.min(seq_len) as u32).collect(),
            None => vec![seq_len as u32; b_sz],
        },
        out_dtype: qkv.dtype(),
        form,
        out: Mutex::new(None),
    };
    let (qkv, gates) = (qkv.counted_contiguous()?, gates.counted_contiguous()?);
    record("gated-delta-rule", op.launches(backend(state.device())));
    state.inplace_op3(&qkv, &gates, &op)?;
    let out = op
        .out
        .into_inner()
        .expect("gated-delta-rule output slot poisoned");
    let Some(out) = out else {
        bail!("gated-delta-rule: the op produced no output")
    };
    let shape = Shape::from((b_sz, seq_len, dims.num_v_heads, dims.head_v_dim));
    Ok(Tensor::from((out, shape)))
}
