//! The Metal ops against the CPU ops, on a Mac: `cargo test --release --features metal -p kev-kernels`.
//! (On Linux the kernels' logic is covered by `metal_emulated.rs`; this file only type-checks
//! there, with `--target aarch64-apple-darwin`.)
#![cfg(feature = "metal")]

use candle_core::{DType, Device, Result, Tensor};
use kev_kernels::testing::{assert_close, dims, gdr_inputs, patterned};
use kev_kernels::{
    causal_conv1d, gated_delta_rule, gated_delta_rule_as, GdrDims, GdrForm, METAL_CHUNKED_MIN_LEN,
};

/// Metal f32 vs CPU f32 on unit-scale data: the same math in another summation order (simd_sum
/// trees) and Metal's fast-math exp/rsqrt, over up to 37 steps (docs/DESIGN.md §9's starting
/// point for a kernel vs a reference). The emulated kernel agrees with a double loop to ~5e-8.
const TOL_F32: f32 = 1e-4;
/// Outputs rounded once to bf16 on both sides: one bf16 ulp apart at most for |x| < 2 (2^-7),
/// plus the f32 tolerance; as `ops.rs`' bf16 test.
const TOL_BF16: f32 = 2e-2;
/// The same for f16 (2^-10 ulp at |x| < 2).
const TOL_F16: f32 = 2e-3;

fn metal() -> Result<Device> {
    Device::new_metal(0)
}

/// Runs the op on the CPU and on Metal from the same inputs; returns (o, state) of both.
fn gdr_both(
    qkv: &Tensor,
    gates: &Tensor,
    state: &Tensor,
    d: GdrDims,
    lengths: Option<&[usize]>,
) -> Result<[(Tensor, Tensor); 2]> {
    let dev = metal()?;
    let s_cpu = state.copy()?;
    let o_cpu = gated_delta_rule(qkv, gates, &s_cpu, d, lengths)?;
    let s_gpu = state.to_device(&dev)?;
    let o_gpu = gated_delta_rule(
        &qkv.to_device(&dev)?,
        &gates.to_device(&dev)?,
        &s_gpu,
        d,
        lengths,
    )?;
    assert!(o_gpu.device().is_metal());
    Ok([(o_cpu, s_cpu), (o_gpu, s_gpu)])
}

#[test]
fn metal_gated_delta_rule_matches_cpu() -> Result<()> {
    for (b, t, d, lengths) in [
        (1, 1, dims(1, 1, 8, 8), None), // T = 1, Dk below one simdgroup
        (2, 37, dims(1, 2, 32, 16), Some(vec![37, 32])), // the test model's heads, padded row
        (2, 7, dims(2, 4, 32, 16), None), // several key heads
        (1, 5, dims(1, 2, 128, 128), None), // real model heads
        (1, 3, dims(1, 1, 48, 6), None), // Dk no multiple of 32, Dv of 4
        (1, 2, dims(1, 1, 256, 8), None), // the largest Dk
    ] {
        let (qkv, gates, state) = gdr_inputs(b, t, d, 0.3)?;
        let [(o_cpu, s_cpu), (o_gpu, s_gpu)] =
            gdr_both(&qkv, &gates, &state, d, lengths.as_deref())?;
        let tag = format!("metal gdr b={b} t={t} {d:?}");
        assert_close(&format!("{tag} output"), &o_gpu, &o_cpu, TOL_F32)?;
        assert_close(&format!("{tag} state"), &s_gpu, &s_cpu, TOL_F32)?;
    }
    Ok(())
}

#[test]
fn metal_gated_delta_rule_half_inputs() -> Result<()> {
    let d = dims(1, 2, 32, 16);
    for (dtype, tol) in [(DType::BF16, TOL_BF16), (DType::F16, TOL_F16)] {
        let (qkv, gates, state) = gdr_inputs(2, 13, d, 0.9)?;
        let qkv = qkv.to_dtype(dtype)?;
        let [(o_cpu, s_cpu), (o_gpu, s_gpu)] = gdr_both(&qkv, &gates, &state, d, Some(&[13, 8]))?;
        assert_eq!(o_gpu.dtype(), dtype);
        assert_close(&format!("metal gdr {dtype:?} output"), &o_gpu, &o_cpu, tol)?;
        assert_close(
            &format!("metal gdr {dtype:?} state"),
            &s_gpu,
            &s_cpu,
            TOL_F32,
        )?;
    }
    Ok(())
}

/// The chunked kernel (forced for f32; chosen by `GdrForm::Auto` for bf16 from
/// `METAL_CHUNKED_MIN_LEN` steps) against the CPU's step-by-step op: lengths no multiple of the
/// 16-step chunk, a padded row, several heads, Dk = 128 with Dv no multiple of the 32 columns a
/// threadgroup takes, Dk no multiple of 8.
#[test]
fn metal_gated_delta_rule_chunked_matches_cpu() -> Result<()> {
    let dev = metal()?;
    let cases = [
        (
            2,
            37,
            dims(1, 2, 32, 16),
            vec![37, 30],
            DType::F32,
            GdrForm::Chunked,
        ),
        (
            1,
            40,
            dims(2, 4, 128, 40),
            vec![40],
            DType::F32,
            GdrForm::Chunked,
        ),
        (
            3,
            21,
            dims(1, 1, 44, 6),
            vec![21, 0, 1],
            DType::F32,
            GdrForm::Chunked,
        ),
        (
            2,
            METAL_CHUNKED_MIN_LEN,
            dims(1, 2, 128, 128),
            vec![METAL_CHUNKED_MIN_LEN, 50],
            DType::BF16,
            GdrForm::Auto,
        ),
    ];
    for (b, t, d, lengths, dtype, form) in cases {
        let (qkv, gates, state) = gdr_inputs(b, t, d, 0.7)?;
        let qkv = qkv.to_dtype(dtype)?;
        let s_cpu = state.copy()?;
        let o_cpu = gated_delta_rule(&qkv, &gates, &s_cpu, d, Some(&lengths))?;
        let s_gpu = state.to_device(&dev)?;
        let o_gpu = gated_delta_rule_as(
            &qkv.to_device(&dev)?,
            &gates.to_device(&dev)?,
            &s_gpu,
            d,
            Some(&lengths),
            form,
        )?;
        let tol = if dtype == DType::F32 {
            TOL_F32
        } else {
            TOL_BF16
        };
        let tag = format!("metal chunked gdr {dtype:?} b={b} t={t} {d:?}");
        assert_close(&format!("{tag} output"), &o_gpu, &o_cpu, tol)?;
        assert_close(&format!("{tag} state"), &s_gpu, &s_cpu, TOL_F32)?;
    }
    Ok(())
}

#[test]
fn metal_gated_delta_rule_two_chunks_equal_whole() -> Result<()> {
    let dev = metal()?;
    let d = dims(1, 2, 32, 16);
    let (qkv, gates, state) = gdr_inputs(2, 37, d, 1.1)?;
    let (qkv, gates) = (qkv.to_device(&dev)?, gates.to_device(&dev)?);
    let whole_state = state.to_device(&dev)?;
    let whole = gated_delta_rule(&qkv, &gates, &whole_state, d, None)?;
    let split_state = state.to_device(&dev)?;
    let first = gated_delta_rule(
        &qkv.narrow(1, 0, 20)?,
        &gates.narrow(1, 0, 20)?,
        &split_state,
        d,
        None,
    )?;
    let second = gated_delta_rule(
        &qkv.narrow(1, 20, 17)?,
        &gates.narrow(1, 20, 17)?,
        &split_state,
        d,
        None,
    )?;
    let split = Tensor::cat(&[first, second], 1)?;
    // The same kernel on the same data, in the same order: exact.
    assert_close("metal gdr split output", &split, &whole, 0.0)?;
    assert_close("metal gdr split state", &split_state, &whole_state, 0.0)?;
    Ok(())
}

#[test]
fn metal_gated_delta_rule_reads_start_offsets() -> Result<()> {
    // Row 1 of a batch: contiguous views that start past the beginning of their buffers.
    let dev = metal()?;
    let d = dims(1, 2, 32, 16);
    let (qkv, gates, state) = gdr_inputs(2, 5, d, 2.0)?;
    let (qkv_g, gb_g) = (qkv.to_device(&dev)?, gates.to_device(&dev)?);
    let s_gpu = state.to_device(&dev)?;
    let o_gpu = gated_delta_rule(
        &qkv_g.narrow(0, 1, 1)?,
        &gb_g.narrow(0, 1, 1)?,
        &s_gpu.narrow(0, 1, 1)?,
        d,
        None,
    )?;
    let s_cpu = state.narrow(0, 1, 1)?.copy()?;
    let o_cpu = gated_delta_rule(
        &qkv.narrow(0, 1, 1)?,
        &gates.narrow(0, 1, 1)?,
        &s_cpu,
        d,
        None,
    )?;
    assert_close("metal gdr offset output", &o_gpu, &o_cpu, TOL_F32)?;
    assert_close(
        "metal gdr offset state",
        &s_gpu.narrow(0, 1, 1)?,
        &s_cpu,
        TOL_F32,
    )?;
    // Row 0 of the state was not touched.
    assert_close(
        "metal gdr offset row 0",
        &s_gpu.narrow(0, 0, 1)?,
        &state.narrow(0, 0, 1)?,
        0.0,
    )?;
    Ok(())
}

#[test]
fn metal_causal_conv1d_matches_cpu() -> Result<()> {
    let dev = metal()?;
    for &(b, t, ch, k) in &[
        (1usize, 1usize, 8usize, 4usize),
        (2, 9, 24, 4),
        (3, 70, 40, 3),
    ] {
        let x = patterned(&[b, k - 1 + t, ch], 0.4, 2.0)?;
        let w = patterned(&[ch, k], 1.7, 0.5)?;
        for (dtype, tol) in [
            (DType::F32, TOL_F32),
            (DType::BF16, TOL_BF16),
            (DType::F16, TOL_F16),
        ] {
            let (x, w) = (x.to_dtype(dtype)?, w.to_dtype(dtype)?);
            let y_cpu = causal_conv1d(&x, &w)?;
            let y_gpu = causal_conv1d(&x.to_device(&dev)?, &w.to_device(&dev)?)?;
            assert!(y_gpu.device().is_metal());
            assert_eq!(y_gpu.dtype(), dtype);
            let tag = format!("metal conv {dtype:?} b={b} t={t} c={ch} k={k}");
            assert_close(&tag, &y_gpu, &y_cpu, tol)?;
        }
        // bf16 input with an f32 weight: continuation from a narrowed view, and a batch row (a
        // contiguous view with a start offset), both exactly the whole run's.
        let x_g = x.to_dtype(DType::BF16)?.to_device(&dev)?;
        let w_g = w.to_device(&dev)?;
        let whole = causal_conv1d(&x_g, &w_g)?;
        if t > 2 {
            let cut = t / 2;
            let second = causal_conv1d(&x_g.narrow(1, cut, k - 1 + t - cut)?, &w_g)?;
            let expect = whole.narrow(1, cut, t - cut)?;
            assert_close("metal conv continuation", &second, &expect, 0.0)?;
        }
        let last = causal_conv1d(&x_g.narrow(0, b - 1, 1)?, &w_g)?;
        let expect = whole.narrow(0, b - 1, 1)?;
        assert_close("metal conv batch-row view", &last, &expect, 0.0)?;
    }
    Ok(())
}

#[test]
fn metal_fused_ops_match_references() -> Result<()> {
    // The norms, gates, SwiGLU and attention steps run their own Metal kernels; each against its
    // tensor-op reference on the CPU (slices of a wider projection and contiguous inputs, f32 and
    // bf16). Exact checks stay exact; f32 ones get Metal's fast-math allowance.
    kev_kernels::testing::check_fused_ops(&metal()?, |what, got, want, tol| {
        assert!(
            got.device().is_metal(),
            "{what}: the result left the Metal device"
        );
        let tol = if tol == 0.0 { 0.0 } else { tol.max(TOL_F32) };
        assert_close(what, &got.to_device(&Device::Cpu)?, want, tol)
    })
}

#[test]
fn metal_flash_attention_matches_matmuls() -> Result<()> {
    // The one-pass kernel against the composed form on the CPU (q·kᵀ, causal_softmax, ·v): three
    // of five keys seen by the first of three queries, row 1's first key padded by −∞, f32.
    use kev_kernels::causal_softmax;
    use kev_kernels::testing::flash_attention;
    let dev = metal()?;
    let (b, h, t, l, hd) = (2, 2, 3, 5, 64);
    let q = patterned(&[b, h, t, hd], 0.3, 1.0)?;
    let k = patterned(&[b, h, l, hd], 0.7, 1.0)?;
    let v = patterned(&[b, h, l, hd], 1.1, 1.0)?;
    let mut bias = vec![0f32; b * l];
    bias[l] = f32::NEG_INFINITY;
    let bias = Tensor::from_vec(bias, (b, l), &Device::Cpu)?;
    let scale = (hd as f64).powf(-0.5);
    let probs = causal_softmax(&q.matmul(&k.t()?.contiguous()?)?, &bias, scale)?;
    let want = probs.matmul(&v)?;
    let Some(got) = flash_attention(
        &q.to_device(&dev)?,
        None,
        &k.to_device(&dev)?,
        &v.to_device(&dev)?,
        &bias.to_device(&dev)?,
        scale,
    )?
    else {
        panic!("flash attention declined on Metal");
    };
    assert_close(
        "metal flash attention",
        &got.to_device(&Device::Cpu)?,
        &want,
        TOL_F32,
    )
}
