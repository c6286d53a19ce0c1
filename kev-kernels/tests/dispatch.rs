//! The dispatch count (`kev_kernels::dispatch`) on single ops, on the CPU: a fused kernel counts
//! its launches, a composed fallback the candle ops it runs, and a kernel the CPU does not have
//! still gives the values its composed form gives.

use candle_core::{DType, Device, Result, Tensor};
use kev_kernels::dispatch::{count, Backend, Tally};
use kev_kernels::{
    causal_attention, causal_conv1d_split, conv_gated_delta_rule_split, gated_delta_rule_split,
    rms_norm, GdrDims, SplitBatch,
};

const GPUS: [Backend; 2] = [Backend::Cuda, Backend::Metal];

/// (op, dispatches) of everything counted outside the layers.
fn ops(tally: &Tally) -> Vec<(&'static str, usize)> {
    tally
        .entries()
        .filter(|&(_, _, n)| n > 0)
        .map(|(_, op, n)| (op, n))
        .collect()
}

fn max_difference(a: &Tensor, b: &Tensor) -> Result<f32> {
    let diff = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?;
    diff.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

#[test]
fn a_fused_norm_counts_its_launch_and_the_copies_its_wrapper_makes() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1.0, (4, 8), &dev)?;
    let w1 = Tensor::ones(8, DType::F32, &dev)?;
    for gpu in GPUS {
        let (out, tally) = count(gpu, || rms_norm(&x, &w1, 1e-6));
        assert_eq!(ops(&tally), [("rms-norm", 1)], "{gpu:?}");
        assert_eq!(out?.dims(), [4, 8]);
        // Columns of a transposed tensor are no row view: one copy first.
        let columns = Tensor::randn(0f32, 1.0, (8, 4), &dev)?.t()?;
        let (_, tally) = count(gpu, || rms_norm(&columns, &w1, 1e-6));
        assert_eq!(ops(&tally), [("copy", 1), ("rms-norm", 1)], "{gpu:?}");
        // A bf16 weight is widened to f32 first: one cast.
        let (_, tally) = count(gpu, || rms_norm(&x, &w1.to_dtype(DType::BF16)?, 1e-6));
        assert_eq!(ops(&tally), [("cast", 1), ("rms-norm", 1)], "{gpu:?}");
    }
    // Counting for the CPU: its own path, the same single op.
    let (_, tally) = count(Backend::Cpu, || rms_norm(&x, &w1, 1e-6));
    assert_eq!(ops(&tally), [("rms-norm", 1)]);
    Ok(())
}

#[test]
fn attention_counts_metals_flash_kernel_and_cudas_matmuls_around_the_softmax() -> Result<()> {
    let dev = Device::Cpu;
    // hd 64: Metal's flash kernel takes it, CUDA's (hd 256 only) does not.
    let q = Tensor::randn(0f32, 1.0, (1, 4, 6, 64), &dev)?;
    let k = Tensor::randn(0f32, 1.0, (1, 2, 6, 64), &dev)?;
    let v = Tensor::randn(0f32, 1.0, (1, 2, 6, 64), &dev)?;
    let bias = Tensor::zeros((1, 6), DType::F32, &dev)?;
    let plain = causal_attention(&q, None, &k, &v, &bias, 0.125)?;
    let (metal, tally) = count(Backend::Metal, || {
        causal_attention(&q, None, &k, &v, &bias, 0.125)
    });
    assert_eq!(ops(&tally), [("flash-attention", 1)]);
    // The CPU has no flash kernel: the values are the composed form's, exactly.
    assert_eq!(max_difference(&metal?, &plain)?, 0.0);
    let (cuda, tally) = count(Backend::Cuda, || {
        causal_attention(&q, None, &k, &v, &bias, 0.125)
    });
    assert_eq!(ops(&tally), [("causal-softmax", 1), ("matmul", 2)]);
    assert_eq!(max_difference(&cuda?, &plain)?, 0.0);
    Ok(())
}

/// A one-pass prefix split of 1 state row of 40 steps and 2 branch rows of 36, DeltaNet heads
/// that CUDA's fused conv + delta rule takes (bf16, equal head counts, lengths ≥ 32).
struct SplitCase {
    state: Tensor,
    branches: Tensor,
    weight: Tensor,
    gates: Tensor,
    dims: GdrDims,
    split: SplitBatch,
}

fn split_case() -> Result<SplitCase> {
    let dev = Device::Cpu;
    let dims = GdrDims {
        num_k_heads: 2,
        num_v_heads: 2,
        head_k_dim: 16,
        head_v_dim: 16,
    };
    let channels = dims.channels();
    let (s_len, width) = (40, 36);
    let split = SplitBatch::new(s_len, vec![s_len], width, vec![width, 30], vec![0, 0], &dev)?;
    let bf16 = |t: Tensor| t.to_dtype(DType::BF16);
    let tokens = split.tokens();
    let gates = Tensor::randn(0f32, 0.1, (tokens, dims.num_v_heads, 2), &dev)?;
    Ok(SplitCase {
        state: bf16(Tensor::randn(0f32, 1.0, (1, s_len, channels), &dev)?)?,
        branches: bf16(Tensor::randn(0f32, 1.0, (2, width, channels), &dev)?)?,
        weight: bf16(Tensor::randn(0f32, 0.2, (channels, 4), &dev)?)?,
        gates: (gates.abs()?.neg()?.exp()? * 0.5)?,
        dims,
        split,
    })
}

#[test]
fn the_split_deltanet_counts_cudas_three_launches_and_metals_three_dispatches() -> Result<()> {
    let c = split_case()?;
    let run = || {
        conv_gated_delta_rule_split(&c.state, &c.branches, &c.weight, &c.gates, c.dims, &c.split)
    };
    let plain = run()?;
    let (cuda, tally) = count(Backend::Cuda, run);
    assert_eq!(ops(&tally), [("conv-gated-delta-rule-split", 3)]);
    assert_eq!(max_difference(&cuda?, &plain)?, 0.0);
    let (metal, metal_tally) = count(Backend::Metal, run);
    assert_eq!(max_difference(&metal?, &plain)?, 0.0);
    // Metal runs the conv and the delta rule as their own split forms: the conv's one dispatch
    // over both parts, the delta rule's two (the states, then the branches from their final
    // states), each counted on its own adding up to the whole.
    let (qkv, conv_tally) = count(Backend::Metal, || {
        causal_conv1d_split(&c.state, &c.branches, &c.weight, &c.split)
    });
    let (state_qkv, branch_qkv) = qkv?;
    let (_, rule_tally) = count(Backend::Metal, || {
        gated_delta_rule_split(&state_qkv, &branch_qkv, &c.gates, c.dims, &c.split)
    });
    assert_eq!(ops(&conv_tally), [("causal-conv1d-split", 1)]);
    assert_eq!(ops(&rule_tally), [("gated-delta-rule-split", 2)]);
    assert_eq!(metal_tally.total(), conv_tally.total() + rule_tally.total());
    assert_eq!(metal_tally.total(), tally.total());
    Ok(())
}
