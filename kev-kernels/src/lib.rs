//! Kev's own candle ops for the layers of Qwen3.5, each a candle custom op with a CPU
//! implementation, CUDA and Metal ones behind the `cuda` / `metal` features, and a plain
//! tensor-op reference (`*_ref`) for tests. Every op returns its tensor on every backend: where a
//! fused kernel does not run (another backend, a shape or dtype it does not take), the op
//! composes the same computation from other ops itself.
//!
//! The recurrent-layer ops:
//!
//! - [`gated_delta_rule`]: the gated delta rule recurrence over a persistent f32 state that is
//!   updated **in place**, with the q/k l2-normalisation and query scaling fused in. CUDA and
//!   Metal run long bf16/f16 sequences in chunked form (CUDA two kernels, Metal one on the
//!   simdgroup matrix units), short ones step by step ([`GdrForm`]);
//!   [`gated_delta_rule_chunked`] is the chunked form as plain tensor ops, for any backend.
//! - [`causal_conv1d`]: the depthwise causal convolution (kernel K, no bias) with SiLU fused, fed
//!   with its K−1 previous inputs so that a run can continue from a cache;
//!   [`causal_conv1d_cached`] takes that cache separately and returns the next one.
//! - The one-pass prefix forward's forms ([`SplitBatch`] says how its rows divide into records'
//!   states and the branches continuing them): [`causal_conv1d_split`] the conv,
//!   [`gated_delta_rule_split`] the delta rule, [`conv_gated_delta_rule_split`] both (on CUDA
//!   the conv inside the delta rule's preparation).
//!
//! And the attention and the fused elementwise ops:
//!
//! - [`causal_attention`]: `softmax(q·kᵀ·scale + bias)·v`, on CUDA one flash kernel where it
//!   fills the GPU ([`flash_attention_fills_gpu`]), else matmuls around [`causal_softmax`].
//! - Ops that replace chains of candle ops (a GPU forward is launch-bound):
//!   [`rms_norm`] / [`add_rms_norm`] / [`gated_rms_norm`], [`deltanet_gates`], [`swiglu`],
//!   and the attention steps [`qk_norm_rope`], [`causal_softmax`], [`attention_gate`]
//!   ([`attention_gate_join`] for a packed batch's two parts).
//!   CPU, CUDA and Metal each run them as one op (Metal: `<op>/<op>.metal`).
//! - [`causal_attention`]: on CUDA and Metal, the attention's scores, softmax and weighted sum in
//!   one flash kernel where it pays, else the matmuls around [`causal_softmax`].
//!
//! - [`linear`]: `x · Wᵀ` on a GPU; on CUDA, per shape class timed inside [`tuning`], the
//!   fastest cuBLASLt algorithm that computes cuBLAS's numbers.
//!
//! - [`gather_rows`]: whole rows by index, for copying a prefix cache per branch; [`gather_cat`]:
//!   picked rows each followed by rows of their own, for a branch's attention keys and values.
//!
//! No op knows anything about Qwen: shapes and head counts are explicit arguments.
//!
//! Each op is a folder: its API, checks and the fallback it composes in `mod.rs`, its plain
//! tensor reference, its backends side by side (`cpu.rs`, `cuda.rs`, `metal.rs`, where it has
//! them) and their kernel sources (`*.cu`, `*.metal`). Which form runs is the op's wrapper's
//! choice, made from the device: a kernel's custom op is only reached on a backend that has it
//! (the CPU side of a CUDA-only op is an error nothing reaches), and the wrapper asks the CUDA
//! GPU's capabilities through one function that answers `None` off CUDA. Below the ops,
//! `backend` holds what the backends share (the CUDA source registry and compiler, launch
//! helpers, GPU capabilities, the device memory pool, the Metal pipelines) and imports no op;
//! `layout` the row and split layouts several ops read. [`dispatch`] counts the GPU dispatches of
//! a forward on the CPU: the wrappers choose through its [`dispatch::backend`] and record what they
//! launch.

/// The `cpu_fwd` of a custom op that only CUDA runs (its wrapper composes other ops on the
/// other backends, so the CPU never reaches it): an error with `$msg`. One `storage layout` pair
/// of (unused) parameter names per input of the op.
macro_rules! cuda_only_cpu_fwd {
    ($msg:expr, $($storage:ident $layout:ident),+) => {
        fn cpu_fwd(
            &self,
            $($storage: &candle_core::CpuStorage, $layout: &candle_core::Layout),+
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            candle_core::bail!($msg)
        }
    };
}

/// Launches on `dtype` storages: `$body` runs with `$t` bound to the element type.
#[cfg(feature = "cuda")]
macro_rules! by_dtype {
    ($dtype:expr, $op:expr, |$t:ident| $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            candle_core::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $t = half::f16;
                $body
            }
            other => candle_core::bail!("{}: unsupported dtype {other:?} on CUDA", $op),
        }
    };
}

mod attention;
mod backend;
mod bf16_gemm;
mod causal_conv1d;
mod cpu_tiles;
pub mod dispatch;
mod flash_attention;
mod fp8;
mod gated_delta_rule;
mod gates;
mod gather;
mod head;
mod int8_gemm;
mod layout;
mod linear;
mod moe;
mod norm;
mod swiglu;
#[doc(hidden)]
pub mod testing;
pub mod uploads;

pub use attention::{
    attention_gate, attention_gate_join, attention_gate_ref, causal_attention, causal_softmax,
    causal_softmax_ref, qk_norm_rope, qk_norm_rope_ref,
};
#[cfg(feature = "cuda")]
pub use backend::cuda::{
    keep_device_memory, kernel_seconds, pool_peak_bytes, prepare_kernels, profiler_range,
    release_device_memory, release_device_memory_of,
};
pub use bf16_gemm::{bf16_gemm_available, PackedBf16};
pub use causal_conv1d::{
    causal_conv1d, causal_conv1d_cached, causal_conv1d_cached_ref, causal_conv1d_ref,
    causal_conv1d_split,
};
pub use flash_attention::{flash_attention_fills_gpu, AttentionPast, FLASH_HEAD_DIM};
pub use fp8::{
    e4m3_from_f32, e4m3_to_f32, fp8_available, fp8_check, fp8_linear, fp8_linear_ref,
    quantize_rows, Fp8Weight, FP8_BLOCK,
};
pub use gated_delta_rule::{
    conv_gated_delta_rule_split, conv_gated_delta_rule_split_keeping, gated_delta_rule,
    gated_delta_rule_as, gated_delta_rule_chunked, gated_delta_rule_ref, gated_delta_rule_split,
    split_reads_table, GdrDims, GdrForm, CHUNKED_MIN_LEN, METAL_CHUNKED_MIN_LEN,
};
pub use gates::{deltanet_gates, deltanet_gates_ref};
pub use gather::{copy_rows, embed, gather_cat, gather_rows, join_rows, pack, RowIndex};
pub use head::{pointer_logits, rows_f32};
pub use int8_gemm::{
    int8_gemm_available, quantize_block, Int8Isa, PackedInt8, BLOCK as INT8_BLOCK,
};
pub use layout::split::SplitBatch;
pub use linear::{linear, tuning, MAX_TUNED_ROWS};
pub use moe::{
    moe_mlp, moe_mlp_ref, routed_sum, RoutedExperts, SharedExpert, CHUNK_TOKENS as MOE_CHUNK_TOKENS,
};
pub use norm::{add_rms_norm, gated_rms_norm, gated_rms_norm_ref, rms_norm, rms_norm_ref};
pub use swiglu::{swiglu, swiglu_ref};
