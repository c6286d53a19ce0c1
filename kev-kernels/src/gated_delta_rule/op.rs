//! The gated delta rule's parameters, the op structs every backend reads, and the input checks.

use std::sync::Mutex;

use candle_core::{bail, DType, Result, Storage, Tensor};

use crate::backend::cuda::sources::MAX_DIM;
use crate::dispatch::Backend;
use crate::layout::split::SplitBatch;

/// From this many steps on (one chunk), [`GdrForm::Auto`] runs the chunked kernels on CUDA (a
/// preparation kernel per chunk of 32 steps, then a scan over the chunks) instead of the
/// step-by-step one, for bf16 and f16 models (f32 always runs step by step). One chunk: measured
/// with `gdr_bench` on the H200, the chunked form is faster from a single chunk on for every
/// Qwen3.5 shape, and within a CUDA graph its extra launch costs nothing (BENCHMARKS.md).
pub const CHUNKED_MIN_LEN: usize = 32;

/// From this many steps on, [`GdrForm::Auto`] runs the chunked kernel on Metal (chunks of 16 steps
/// on the simdgroup matrix units, `gated_delta_rule.metal`) instead of the step-by-step one, for
/// bf16 and f16 inputs with Dk ≤ 128 (f32 always runs step by step, as on CUDA). Four chunks: an
/// estimate, not a measurement (no Apple GPU has run the kernel yet). Each chunk costs nine
/// threadgroup barriers and the chunk's state-free products, repeated by every threadgroup of a
/// head, where the step-by-step kernel pays four simdgroup reductions a step; decoding and
/// short continuations stay step by step, where the chunks' fixed cost cannot pay off. To be set
/// from `gdr_bench` timings on a Mac, as [`CHUNKED_MIN_LEN`] was on the H200.
pub const METAL_CHUNKED_MIN_LEN: usize = 64;

/// Whether [`GdrForm::Auto`] takes the chunked kernels for `seq_len` steps.
pub(crate) fn auto_prefers_chunked(seq_len: usize) -> bool {
    seq_len >= CHUNKED_MIN_LEN
}

/// Which algorithm runs the recurrence, for backends that have both (CUDA and Metal, Dk ≤ 128);
/// the CPU always runs step by step. Both give the same results up to f32 rounding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GdrForm {
    /// Chunked from [`CHUNKED_MIN_LEN`] steps on (Metal: [`METAL_CHUNKED_MIN_LEN`]), step by step
    /// below and for f32.
    #[default]
    Auto,
    /// Step by step: T dependent steps, each one small.
    Recurrent,
    /// Chunked: T/32 (Metal: T/16) dependent rounds of small dense products.
    Chunked,
}

/// Head counts and sizes of one Gated DeltaNet layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrDims {
    /// Number of query/key heads (Hk).
    pub num_k_heads: usize,
    /// Number of value heads (Hv), a multiple of Hk: one recurrent state per value head.
    pub num_v_heads: usize,
    /// Query/key head size (Dk).
    pub head_k_dim: usize,
    /// Value head size (Dv).
    pub head_v_dim: usize,
}

impl GdrDims {
    /// Channels of the packed `[q | k | v]` input: 2·Hk·Dk + Hv·Dv.
    pub fn channels(&self) -> usize {
        2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim
    }
}

/// The op of [`gated_delta_rule_split`] and [`conv_gated_delta_rule_split`]: inputs the states'
/// `[q | k | v]` rows, the branches' and the packed gates; output the packed `o`. CUDA and Metal
/// only: on the CPU the wrappers compose the per-part calls.
#[cfg_attr(not(any(feature = "cuda", feature = "metal")), allow(dead_code))]
pub(crate) struct GatedDeltaRuleSplit {
    pub(crate) dims: GdrDims,
    pub(crate) split: SplitBatch,
    /// The conv weight `[C, 4]` (contiguous) when the inputs are the raw `in_proj` rows, run
    /// through the causal conv + SiLU inside the preparation.
    pub(crate) conv: Option<Tensor>,
    /// Where the states' final recurrent matrices are handed back, when they are kept (CUDA).
    pub(crate) kept: Option<Mutex<Option<Storage>>>,
}

impl GatedDeltaRuleSplit {
    /// Hands the states' final recurrent matrices back to the wrapper, if it keeps them.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn keep(&self, storage: impl FnOnce() -> Storage) {
        if let Some(slot) = &self.kept {
            *slot
                .lock()
                .expect("gated-delta-rule-split kept slot poisoned") = Some(storage());
        }
    }

    /// The kept matrices as `[R, Hv, Dk, Dv]` f32 (`None` unless kept).
    pub(crate) fn take_kept(&self) -> Result<Option<Tensor>> {
        let Some(slot) = &self.kept else {
            return Ok(None);
        };
        let storage = slot
            .lock()
            .expect("gated-delta-rule-split kept slot poisoned")
            .take();
        let Some(storage) = storage else {
            bail!("gated-delta-rule-split: the op kept no states")
        };
        let d = self.dims;
        let shape = (
            self.split.states(),
            d.num_v_heads,
            d.head_k_dim,
            d.head_v_dim,
        );
        Ok(Some(Tensor::from((
            storage,
            candle_core::Shape::from(shape),
        ))))
    }
}

/// The op: one in-place destination (the state), `o` handed back through `out`.
/// Fields are what every backend's kernel needs.
pub(crate) struct GatedDeltaRule {
    pub(crate) dims: GdrDims,
    pub(crate) b_sz: usize,
    pub(crate) seq_len: usize,
    /// Real steps per row (`seq_len` where the row is not padded).
    pub(crate) lengths: Vec<u32>,
    /// dtype of `o` (the dtype of `qkv`).
    pub(crate) out_dtype: DType,
    pub(crate) form: GdrForm,
    pub(crate) out: Mutex<Option<Storage>>,
}

impl GatedDeltaRule {
    /// Whether CUDA should run its chunked kernels ([`CHUNKED_MIN_LEN`]).
    pub(crate) fn chunked(&self) -> bool {
        self.chunked_from(CHUNKED_MIN_LEN)
    }

    /// Whether a backend whose chunked kernel pays off from `min_len` steps should run it.
    #[cfg_attr(not(any(feature = "cuda", feature = "metal", test)), allow(dead_code))]
    pub(crate) fn chunked_from(&self, min_len: usize) -> bool {
        match self.form {
            // f32 is the exact path: the chunked form rounds differently (cumulative decays, the
            // triangular inverse), measured 1.4e-5 on a probability of the test model at its
            // largest LoRA scale against transformers, over the 1e-5 parity bound.
            GdrForm::Auto => self.out_dtype != DType::F32 && self.seq_len >= min_len,
            GdrForm::Recurrent => false,
            GdrForm::Chunked => true,
        }
    }

    /// Whether CUDA runs the chunked kernels (a preparation and a scan) rather than the
    /// recurrent one: where the op asks for them and Dk, Dv ≤ 128 (an empty sequence has no
    /// chunk to launch a grid over).
    pub(crate) fn cuda_chunked(&self) -> bool {
        let widest = self.dims.head_k_dim.max(self.dims.head_v_dim);
        self.chunked() && self.seq_len > 0 && widest <= MAX_DIM
    }

    /// The kernels this op launches on `backend` (counted by [`crate::dispatch`]).
    pub(crate) fn launches(&self, backend: Backend) -> usize {
        let outputs = self.b_sz * self.seq_len * self.dims.num_v_heads * self.dims.head_v_dim;
        match backend {
            Backend::Cuda if self.cuda_chunked() => 2,
            Backend::Cuda => 1,
            // `metal::gated_delta_rule` encodes its one dispatch only for a non-empty output.
            Backend::Metal => usize::from(outputs > 0),
            Backend::Cpu => 0,
        }
    }

    /// Hands `o` back to the wrapper.
    pub(crate) fn set_output(&self, storage: Storage) {
        *self
            .out
            .lock()
            .expect("gated-delta-rule output slot poisoned") = Some(storage);
    }
}

/// The shapes and dtypes of [`super::gated_delta_rule`]'s inputs; returns `(B, T)`.
pub(crate) fn check(
    qkv: &Tensor,
    gates: &Tensor,
    state: &Tensor,
    dims: GdrDims,
    lengths: Option<&[usize]>,
) -> Result<(usize, usize)> {
    let (b_sz, seq_len, channels) = qkv.dims3()?;
    if let Some(l) = lengths.filter(|l| l.len() != b_sz) {
        bail!(
            "gated-delta-rule: {} lengths for a batch of {b_sz}",
            l.len()
        )
    }
    let GdrDims {
        num_k_heads: hk,
        num_v_heads: hv,
        head_k_dim: dk,
        head_v_dim: dv,
    } = dims;
    if hk == 0 || hv % hk != 0 || channels != dims.channels() {
        bail!(
            "gated-delta-rule: qkv {:?} does not match {dims:?}",
            qkv.dims()
        )
    }
    if dk == 0 || dv == 0 {
        bail!("gated-delta-rule: empty heads in {dims:?}")
    }
    if gates.dims() != [b_sz, seq_len, hv, 2] || gates.dtype() != DType::F32 {
        bail!(
            "gated-delta-rule: gates must be f32 [{b_sz}, {seq_len}, {hv}, 2], got {:?} {:?}",
            gates.dtype(),
            gates.dims()
        )
    }
    if state.dims() != [b_sz, hv, dk, dv] || state.dtype() != DType::F32 {
        bail!(
            "gated-delta-rule: state must be f32 [{b_sz}, {hv}, {dk}, {dv}], got {:?} {:?}",
            state.dtype(),
            state.dims()
        )
    }
    if !state.is_contiguous() {
        bail!("gated-delta-rule: state must be contiguous (it is updated in place)")
    }
    Ok((b_sz, seq_len))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(form: GdrForm, out_dtype: DType, seq_len: usize) -> GatedDeltaRule {
        GatedDeltaRule {
            dims: GdrDims {
                num_k_heads: 1,
                num_v_heads: 1,
                head_k_dim: 32,
                head_v_dim: 16,
            },
            b_sz: 1,
            seq_len,
            lengths: vec![seq_len as u32],
            out_dtype,
            form,
            out: Mutex::new(None),
        }
    }

    /// Auto: chunked from the threshold on for 16-bit inputs, never for f32; the forced forms
    /// regardless of length and dtype.
    #[test]
    fn chunked_from_follows_form_dtype_and_threshold() {
        let min = METAL_CHUNKED_MIN_LEN;
        for dtype in [DType::BF16, DType::F16] {
            assert!(!op(GdrForm::Auto, dtype, min - 1).chunked_from(min));
            assert!(op(GdrForm::Auto, dtype, min).chunked_from(min));
            assert!(op(GdrForm::Auto, dtype, min + 1).chunked_from(min));
        }
        assert!(!op(GdrForm::Auto, DType::F32, 4 * min).chunked_from(min));
        assert!(op(GdrForm::Chunked, DType::F32, 1).chunked_from(min));
        assert!(!op(GdrForm::Recurrent, DType::BF16, 4 * min).chunked_from(min));
        // CUDA's threshold through the same rule.
        assert!(op(GdrForm::Auto, DType::BF16, CHUNKED_MIN_LEN).chunked());
        assert!(!op(GdrForm::Auto, DType::BF16, CHUNKED_MIN_LEN - 1).chunked());
    }
}
