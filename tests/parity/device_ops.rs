//! The kernels on the test device against the CPU implementation (itself tested against the
//! tensor-op reference in kev-kernels/tests/ops.rs): output and final state, f32 and bf16,
//! padded rows, and "two chunks == whole".

use candle_core::{DType, Result, Tensor};
use kev_kernels::testing::{self, dims, patterned};
use kev_kernels::{
    causal_conv1d, causal_conv1d_cached, conv_gated_delta_rule_split,
    conv_gated_delta_rule_split_keeping, gated_delta_rule, gated_delta_rule_as,
    gated_delta_rule_split, GdrDims, GdrForm, SplitBatch,
};

use crate::common::{check, device};

/// (qkv, gates, state) on the CPU.
fn inputs(b: usize, t: usize, dims: GdrDims) -> Result<(Tensor, Tensor, Tensor)> {
    testing::gdr_inputs(b, t, dims, 0.3)
}

#[test]
fn gated_delta_rule_on_device_matches_cpu() -> Result<()> {
    let dev = device();
    // The test model's shape, a real 4B-like head shape, and T not a multiple of anything.
    for (b, t, d, lengths) in [
        (1, 1, dims(2, 4, 32, 16), None),
        (2, 37, dims(2, 4, 32, 16), Some(vec![37usize, 30])),
        (1, 70, dims(2, 4, 128, 128), None),
        // 64 and 128 (row, head) pairs: the kernels that give each warp 2 and 4 state columns.
        (16, 9, dims(2, 4, 32, 16), Some(vec![9usize; 16])),
        (
            32,
            5,
            dims(2, 4, 32, 16),
            Some((0..32).map(|i| 1 + i % 5).collect()),
        ),
        // The chunked kernels: several chunks, a partial last one, rows ending in different
        // chunks (one empty), 4B head counts.
        (3, 100, dims(16, 32, 128, 128), Some(vec![100usize, 33, 0])),
        // Many rows of two chunks, rows ending in either chunk, in the first step or empty.
        (
            24,
            40,
            dims(16, 16, 128, 128),
            Some((0..24).map(|i| [40, 33, 1, 0, 32, 17][i % 6]).collect()),
        ),
        // 64 (row, head) pairs of Dv = 128: the bf16 scan's 32-column blocks (24 rows above
        // take 64 columns, the 4 heads of one row 16).
        (2, 70, dims(16, 32, 128, 128), Some(vec![70usize, 41])),
        // Dv rows not 16-byte aligned: the scan's U and O element by element.
        (2, 45, dims(2, 4, 32, 18), Some(vec![45usize, 20])),
    ] {
        for dtype in [DType::F32, DType::BF16] {
            let (qkv, gates, state) = inputs(b, t, d)?;
            let qkv = qkv.to_dtype(dtype)?;
            let s_cpu = state.copy()?;
            let o_cpu = gated_delta_rule(&qkv, &gates, &s_cpu, d, lengths.as_deref())?;
            for form in [GdrForm::Recurrent, GdrForm::Chunked] {
                // A copy first: on the CPU `to_device` shares storage, and the op updates in place.
                let s_dev = state.copy()?.to_device(&dev)?;
                let o_dev = gated_delta_rule_as(
                    &qkv.to_device(&dev)?,
                    &gates.to_device(&dev)?,
                    &s_dev,
                    d,
                    lengths.as_deref(),
                    form,
                )?;
                let tag = format!(
                    "gdr {form:?} {dtype:?} b={b} t={t} dk={} dv={}",
                    d.head_k_dim, d.head_v_dim
                );
                // Recurrent, f32: same math, other summation order. Chunked: another algorithm
                // in f32 (cumulative log-decays, a triangular solve), as kev-kernels' tests of
                // the tensor-op chunked form. bf16: o is rounded once to bf16 (2^-8 rel.).
                let tol: f32 = match (form, dtype) {
                    (_, DType::BF16) => 2e-2,
                    (GdrForm::Recurrent, _) => 1e-5,
                    _ => 1e-4,
                };
                // The state stays f32 in every form, but the bf16 chunked scan multiplies on
                // tensor cores with bf16 operands (2^-8 relative rounding of each, the state's
                // included; its preparation with TF32 ones).
                let state_tol: f32 = match (form, dtype) {
                    (GdrForm::Chunked, DType::BF16) => 2e-3,
                    _ => tol.min(1e-4),
                };
                check(&format!("{tag} output"), &o_dev, &o_cpu, tol)?;
                check(&format!("{tag} state"), &s_dev, &s_cpu, state_tol)?;
            }
        }
    }
    Ok(())
}

#[test]
fn gated_delta_rule_on_device_continues_exactly() -> Result<()> {
    let dev = device();
    let d = dims(2, 4, 32, 16);
    let (qkv, gates, state) = inputs(1, 65, d)?;
    let (qkv, gates, state) = (
        qkv.to_device(&dev)?,
        gates.to_device(&dev)?,
        state.to_device(&dev)?,
    );
    // Each form against itself: 65 steps at once, then 40 + 25 continuing from the state.
    for form in [GdrForm::Recurrent, GdrForm::Chunked] {
        let run = |from: usize, len: usize, s: &Tensor| {
            let (x, g) = (qkv.narrow(1, from, len)?, gates.narrow(1, from, len)?);
            gated_delta_rule_as(&x, &g, s, d, None, form)
        };
        let whole_state = state.copy()?;
        let whole = run(0, 65, &whole_state)?;
        let split_state = state.copy()?;
        let a = run(0, 40, &split_state)?;
        let b = run(40, 25, &split_state)?;
        // The step-by-step kernel does the same operations either way (exact up to summation
        // order); the chunked one cuts its chunks elsewhere (32 + 8, 25 vs 32 + 32 + 1): f32
        // rounding of another grouping, as in the cross-form checks above.
        let tol = if form == GdrForm::Recurrent {
            1e-5
        } else {
            1e-4
        };
        let split = Tensor::cat(&[a, b], 1)?;
        check(&format!("gdr {form:?} split output"), &split, &whole, tol)?;
        check(
            &format!("gdr {form:?} split state"),
            &split_state,
            &whole_state,
            tol,
        )?;
    }
    Ok(())
}

/// `t: [R, ..]` on the test device, row `owners[i]` as row i.
fn pick_rows(t: &Tensor, owners: &[usize]) -> Result<Tensor> {
    let idx: Vec<u32> = owners.iter().map(|&o| o as u32).collect();
    let idx = Tensor::new(idx.as_slice(), t.device())?;
    t.index_select(&idx, 0)?.contiguous()
}

/// A split case: (state lengths, branch width, branch lengths, owners, dims).
type SplitCase = (Vec<usize>, usize, Vec<usize>, Vec<usize>, GdrDims);

/// The case's rows, and its gates on the test device: the states' `[R, S, Hv, 2]`, the
/// branches' `[B, T, Hv, 2]`, and both packed as the rows, `[R·S + B·T, Hv, 2]`.
fn split_batch_and_gates(case: &SplitCase) -> Result<(SplitBatch, Tensor, Tensor, Tensor)> {
    let (state_lengths, width, lengths, owners, d) = case;
    let s_len = *state_lengths.iter().max().unwrap();
    let dev = device();
    let split = SplitBatch::new(
        s_len,
        state_lengths.clone(),
        *width,
        lengths.clone(),
        owners.clone(),
        &dev,
    )?;
    let (_, gates_s, _) = testing::gdr_inputs(state_lengths.len(), s_len, *d, 0.3)?;
    let (_, gates_b, _) = testing::gdr_inputs(lengths.len(), *width, *d, 1.3)?;
    let (gates_s, gates_b) = (gates_s.to_device(&dev)?, gates_b.to_device(&dev)?);
    let packed = |t: &Tensor| t.flatten(0, 1);
    let gates = Tensor::cat(&[packed(&gates_s)?, packed(&gates_b)?], 0)?;
    Ok((split, gates_s, gates_b, gates))
}

/// What the split ops replace: the delta rule on the states' conv outputs `y_s` from zero
/// states, then on the branch rows' `y_b` from copies of their states' final states, packed.
fn states_then_branches(
    case: &SplitCase,
    (y_s, gates_s): (&Tensor, &Tensor),
    (y_b, gates_b): (&Tensor, &Tensor),
) -> Result<Tensor> {
    let (state_lengths, _, lengths, owners, d) = case;
    let (dk, dv) = (d.head_k_dim, d.head_v_dim);
    let shape = (state_lengths.len(), d.num_v_heads, dk, dv);
    let state = Tensor::zeros(shape, DType::F32, y_s.device())?;
    let o_s = gated_delta_rule(y_s, gates_s, &state, *d, Some(state_lengths))?;
    let state_b = pick_rows(&state, owners)?;
    let o_b = gated_delta_rule(y_b, gates_b, &state_b, *d, Some(lengths))?;
    Tensor::cat(&[o_s.flatten(0, 1)?, o_b.flatten(0, 1)?], 0)
}

/// The one-pass form's fused delta rule (states, then branches continuing them, packed) against
/// the composition it replaces, on the test device: the same kernels and sums, so exactly equal
/// where the fused form runs (CUDA, bf16); elsewhere it does not run (`None`) and the op
/// composes, with the same numbers.
#[test]
fn gated_delta_rule_split_equals_its_composition() -> Result<()> {
    let dev = device();
    // One state of 3 chunks (the last partial), branch rows of 2 chunks ending in either chunk
    // or empty, with the test model's heads; three padded states (one ending in its first
    // chunk) and branch rows continuing them out of order, with the 0.8B model's heads.
    let cases: [SplitCase; 3] = [
        (
            vec![70],
            40,
            vec![40usize, 33, 0],
            vec![0, 0, 0],
            dims(2, 4, 32, 16),
        ),
        (
            vec![96, 70, 20],
            48,
            vec![48usize, 47, 36, 41],
            vec![2, 0, 0, 1],
            dims(16, 16, 128, 128),
        ),
        // Eight branch rows, out of order, of two records.
        (
            vec![64, 50],
            48,
            vec![48usize, 47, 36, 41, 48, 2, 33, 30],
            vec![1, 0, 0, 1, 0, 1, 1, 0],
            dims(16, 16, 128, 128),
        ),
    ];
    for case in &cases {
        let (state_lengths, width, lengths, _, d) = case;
        let (split, gates_s, gates_b, gates) = split_batch_and_gates(case)?;
        for dtype in [DType::F32, DType::BF16] {
            let on = |t: Tensor| t.to_dtype(dtype)?.to_device(&dev);
            let (state_qkv, _, _) =
                testing::gdr_inputs(state_lengths.len(), split.state_width(), *d, 0.3)?;
            let (branch_qkv, _, _) = testing::gdr_inputs(lengths.len(), *width, *d, 1.3)?;
            let (qa, qb) = (on(state_qkv)?, on(branch_qkv)?);
            let fused = testing::fused_gated_delta_rule_split(&qa, &qb, &gates, *d, &split)?;
            let composed = states_then_branches(case, (&qa, &gates_s), (&qb, &gates_b))?;
            let tag = format!(
                "gdr split {dtype:?} states {state_lengths:?} t={width} dk={}",
                d.head_k_dim
            );
            let o = gated_delta_rule_split(&qa, &qb, &gates, *d, &split)?;
            let diff = check(&tag, &o, &composed, 0.0)?;
            assert_eq!(diff.max_abs, 0.0, "{tag}: the op is not the composition");
            match fused {
                Some(o) => {
                    assert!(
                        dev.is_metal() || (dev.is_cuda() && dtype != DType::F32),
                        "{tag}: fused off Metal and CUDA bf16"
                    );
                    let diff = check(&tag, &o, &composed, 0.0)?;
                    assert_eq!(diff.max_abs, 0.0, "{tag}: not the composition's numbers");
                }
                None => assert!(
                    dev.is_cpu() || (dev.is_cuda() && dtype == DType::F32),
                    "{tag}: Metal or CUDA bf16 declined the fused form"
                ),
            }
        }
    }
    Ok(())
}

/// What does not fit is an error naming it; an empty part declines the fused form.
#[test]
fn gated_delta_rule_split_refuses_what_does_not_fit() -> Result<()> {
    let dev = device();
    let d = dims(2, 4, 32, 16);
    let (s_len, rows, width) = (40, 2, 33);
    let on = |t: Tensor| t.to_device(&dev);
    let qa = on(patterned(&[1, s_len, d.channels()], 0.1, 1.0)?.to_dtype(DType::BF16)?)?;
    let qb = on(patterned(&[rows, width, d.channels()], 0.2, 1.0)?.to_dtype(DType::BF16)?)?;
    let gates = on(patterned(&[s_len + rows * width, 4, 2], 0.3, 0.5)?)?;
    let split = |lengths: Vec<usize>, owners: Vec<usize>| {
        SplitBatch::new(s_len, vec![s_len], width, lengths, owners, &dev)
    };
    let fits = split(vec![33, 20], vec![0, 0])?;
    let refused = |what: &str, r: Result<()>, needle: &str| {
        let e = r.expect_err(what).to_string();
        assert!(e.contains(needle), "{what}: `{e}` does not say `{needle}`");
    };
    let zero_k = GdrDims {
        num_k_heads: 0,
        ..d
    };
    // Its [q | k | v] rows would be v alone: shapes that fit, head counts that do not.
    let (qa0, qb0) = (
        qa.narrow(2, 0, zero_k.channels())?,
        qb.narrow(2, 0, zero_k.channels())?,
    );
    refused(
        "no key heads",
        gated_delta_rule_split(&qa0, &qb0, &gates, zero_k, &fits).map(|_| ()),
        "key heads",
    );
    refused(
        "3 value heads over 2 key heads",
        gated_delta_rule_split(&qa, &qb, &gates, dims(2, 3, 32, 16), &fits).map(|_| ()),
        "do not fit",
    );
    refused(
        "a length past the width",
        split(vec![33, 34], vec![0, 0]).map(|_| ()),
        "longer than the width",
    );
    refused(
        "an owner past the state rows",
        split(vec![33, 20], vec![0, 1]).map(|_| ()),
        "continues state row 1 of 1",
    );
    refused(
        "rows the split does not describe",
        gated_delta_rule_split(
            &qa,
            &qb,
            &gates,
            d,
            &SplitBatch::new(s_len, vec![s_len], width, vec![33], vec![0], &dev)?,
        )
        .map(|_| ()),
        "do not fit 1 state rows",
    );
    refused(
        "gates of another shape",
        gated_delta_rule_split(
            &qa,
            &qb,
            &gates.narrow(0, 1, s_len + rows * width - 1)?,
            d,
            &fits,
        )
        .map(|_| ()),
        "do not fit",
    );
    refused(
        "branches in another dtype",
        gated_delta_rule_split(&qa, &qb.to_dtype(DType::F32)?, &gates, d, &fits).map(|_| ()),
        "share a dtype",
    );
    refused(
        "bf16 gates",
        gated_delta_rule_split(&qa, &qb, &gates.to_dtype(DType::BF16)?, d, &fits).map(|_| ()),
        "gates must be f32",
    );
    let empty = on(Tensor::zeros(
        (rows, 0, d.channels()),
        DType::BF16,
        &candle_core::Device::Cpu,
    )?)?;
    let no_steps = SplitBatch::new(s_len, vec![s_len], 0, vec![0, 0], vec![0, 0], &dev)?;
    let states_gates = gates.narrow(0, 0, s_len)?;
    let declined = testing::fused_gated_delta_rule_split(&qa, &empty, &states_gates, d, &no_steps)?;
    assert!(declined.is_none(), "empty branch rows take the composition");
    let o = gated_delta_rule_split(&qa, &empty, &states_gates, d, &no_steps)?;
    assert_eq!(o.dims(), [s_len, d.num_v_heads, d.head_v_dim]);
    Ok(())
}

#[test]
fn causal_conv1d_on_device_matches_cpu() -> Result<()> {
    let dev = device();
    for dtype in [DType::F32, DType::BF16] {
        let x = patterned(&[2, 3 + 45, 96], 0.4, 2.0)?.to_dtype(dtype)?;
        let w = patterned(&[96, 4], 1.7, 0.5)?.to_dtype(dtype)?;
        let y_cpu = causal_conv1d(&x, &w)?;
        let y_dev = causal_conv1d(&x.to_device(&dev)?, &w.to_device(&dev)?)?;
        let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
        check(&format!("conv {dtype:?}"), &y_dev, &y_cpu, tol)?;
    }
    Ok(())
}

/// The one-pass form's conv (states from zeros, branches continuing their state rows' last
/// inputs, one launch) against the composition it replaces, on the test device: the same
/// products per output, so exactly equal where it runs (CUDA); elsewhere it does not run
/// (`None`) and the op composes, with the same numbers. Inputs are column slices of a wider projection (as in the model):
/// 16-byte aligned rows with 96 channels (the vector path), and rows shifted by one element with
/// 37 (element by element); a 2-step state is shorter than the conv's window (the rest is
/// zeros); padded states whose branch rows continue them out of order.
#[test]
fn causal_conv1d_split_equals_its_composition() -> Result<()> {
    let dev = device();
    for (state_lengths, owners, width, channels, shift) in [
        (vec![45usize], vec![0usize, 0, 0], 13usize, 96usize, 0usize),
        (vec![2], vec![0, 0], 6, 96, 0),
        (vec![19], vec![0, 0, 0], 9, 37, 1),
        (vec![30, 2, 17], vec![2, 0, 1, 1], 11, 96, 0),
        (vec![19, 25], vec![1, 0, 1], 9, 37, 1),
    ] {
        for dtype in [DType::F32, DType::BF16] {
            let (states, rows) = (state_lengths.len(), owners.len());
            let s_len = *state_lengths.iter().max().unwrap();
            let split = SplitBatch::new(
                s_len,
                state_lengths.clone(),
                width,
                vec![width; rows],
                owners.clone(),
                &dev,
            )?;
            let on = |t: Tensor| t.to_dtype(dtype)?.to_device(&dev);
            let wide = channels + 24;
            let proj = on(patterned(&[split.tokens(), wide], 0.4, 2.0)?)?;
            let w = on(patterned(&[channels, 4], 1.7, 0.5)?)?;
            let cols = proj.narrow(1, shift, channels)?;
            let x_s = cols
                .narrow(0, 0, states * s_len)?
                .reshape((states, s_len, channels))?;
            let x_b = cols
                .narrow(0, states * s_len, rows * width)?
                .reshape((rows, width, channels))?;
            let fused = testing::fused_causal_conv1d_split(&x_s, &x_b, &w, &split)?;
            let zeros = Tensor::zeros((states, 3, channels), dtype, &dev)?;
            let (y_s, window) = causal_conv1d_cached(&x_s, &zeros, &w, Some(&state_lengths))?;
            let window = pick_rows(&window, &owners)?;
            let (y_b, _) = causal_conv1d_cached(&x_b, &window, &w, None)?;
            let composed = Tensor::cat(&[y_s.flatten(0, 1)?, y_b.flatten(0, 1)?], 0)?;
            let tag =
                format!("conv split {dtype:?} states {state_lengths:?} t={width} c={channels}");
            let (op_s, op_b) = kev_kernels::causal_conv1d_split(&x_s, &x_b, &w, &split)?;
            let op = Tensor::cat(&[op_s.flatten(0, 1)?, op_b.flatten(0, 1)?], 0)?;
            let diff = check(&tag, &op, &composed, 0.0)?;
            assert_eq!(diff.max_abs, 0.0, "{tag}: the op is not the composition");
            match fused {
                Some(y) => {
                    assert!(!dev.is_cpu(), "{tag}: ran on the CPU");
                    let diff = check(&tag, &y, &composed, 0.0)?;
                    assert_eq!(diff.max_abs, 0.0, "{tag}: not the composition's numbers");
                }
                None => assert!(dev.is_cpu(), "{tag}: the GPU declined the one-launch form"),
            }
        }
    }
    Ok(())
}

/// The conv fused into the split delta rule's preparation against the two ops it replaces
/// (the conv, then the delta rule from zero states and on the branch rows from their states'
/// final ones), on the test device: the same arithmetic per output and the same sums, so
/// exactly equal where it runs (CUDA, bf16, rows at multiples of 4 elements); elsewhere it
/// declines. Inputs are row views of a wider projection's columns: at offsets 0 and 8 with a
/// pitch of C + 24 (the reference conv's 16-byte path), at offset 4 with a pitch of C + 20 (its
/// element-by-element path), and at an odd offset, which the fused form declines, as it
/// declines repeated key heads. A 2-step state is shorter than the conv's window (its branch
/// row's window starts in zeros); branch rows continue their states out of order.
#[test]
fn conv_gated_delta_rule_split_equals_conv_then_split() -> Result<()> {
    let dev = device();
    // (case, column offset, extra columns of the projection)
    let cases: [(SplitCase, usize, usize); 5] = [
        (
            (
                vec![70],
                40,
                vec![40, 33, 0],
                vec![0, 0, 0],
                dims(2, 2, 32, 16),
            ),
            1,
            24,
        ),
        (
            (
                vec![96, 70, 20],
                48,
                vec![48, 47, 36, 41],
                vec![2, 0, 0, 1],
                dims(16, 16, 128, 128),
            ),
            8,
            24,
        ),
        (
            (
                vec![2, 64],
                40,
                vec![40, 2, 33],
                vec![0, 1, 0],
                dims(2, 2, 32, 16),
            ),
            0,
            24,
        ),
        (
            (
                vec![50, 33],
                36,
                vec![36, 20],
                vec![1, 0],
                dims(2, 2, 32, 16),
            ),
            4,
            20,
        ),
        // Two value heads per key head: declined.
        ((vec![40], 33, vec![33], vec![0], dims(2, 4, 32, 16)), 0, 24),
    ];
    for (case, shift, extra) in &cases {
        let (state_lengths, width, lengths, owners, d) = case;
        let (states, rows, shift) = (state_lengths.len(), lengths.len(), *shift);
        let pitch = d.channels() + extra;
        let (split, gates_s, gates_b, gates) = split_batch_and_gates(case)?;
        let (s_len, c) = (split.state_width(), d.channels());
        for dtype in [DType::F32, DType::BF16] {
            let on = |t: Tensor| t.to_dtype(dtype)?.to_device(&dev);
            let proj = on(patterned(&[split.tokens(), pitch], 0.7, 2.0)?)?;
            let w = on(patterned(&[c, 4], 1.3, 0.6)?)?;
            // Row views of the projection's columns shift.., as the model passes them.
            let x_s = proj
                .narrow(0, 0, states * s_len)?
                .reshape((states, s_len, pitch))?
                .narrow(2, shift, c)?;
            let x_b = proj
                .narrow(0, states * s_len, rows * width)?
                .reshape((rows, *width, pitch))?
                .narrow(2, shift, c)?;
            let fused =
                testing::fused_conv_gated_delta_rule_split(&x_s, &x_b, &w, &gates, *d, &split)?;

            let zeros = Tensor::zeros((states, 3, c), dtype, &dev)?;
            let (y_s, window) = causal_conv1d_cached(&x_s, &zeros, &w, Some(state_lengths))?;
            let (y_b, _) = causal_conv1d_cached(&x_b, &pick_rows(&window, owners)?, &w, None)?;
            let composed = states_then_branches(case, (&y_s, &gates_s), (&y_b, &gates_b))?;
            let tag = format!(
                "conv+gdr split {dtype:?} states {state_lengths:?} t={width} dk={} shift {shift}",
                d.head_k_dim
            );
            let o = conv_gated_delta_rule_split(&x_s, &x_b, &w, &gates, *d, &split)?;
            let diff = check(&tag, &o, &composed, 0.0)?;
            assert_eq!(diff.max_abs, 0.0, "{tag}: the op is not the composition");
            // Keeping the states' final matrices: the same output, and the matrices the states'
            // delta rule from zero leaves.
            let (o, kept) =
                conv_gated_delta_rule_split_keeping(&x_s, &x_b, &w, &gates, *d, &split)?;
            let diff = check(&tag, &o, &composed, 0.0)?;
            assert_eq!(diff.max_abs, 0.0, "{tag}: keeping changed the output");
            let shape = (states, d.num_v_heads, d.head_k_dim, d.head_v_dim);
            let want = Tensor::zeros(shape, DType::F32, &dev)?;
            gated_delta_rule(&y_s, &gates_s, &want, *d, Some(state_lengths))?;
            let diff = check(&format!("{tag}, kept states"), &kept, &want, 0.0)?;
            assert_eq!(diff.max_abs, 0.0, "{tag}: kept states differ");
            let runs = dev.is_cuda()
                && dtype != DType::F32
                && shift % 4 == 0
                && d.num_k_heads == d.num_v_heads;
            match fused {
                Some(o) => {
                    assert!(runs, "{tag}: fused where it should decline");
                    let diff = check(&tag, &o, &composed, 0.0)?;
                    assert_eq!(diff.max_abs, 0.0, "{tag}: not the composition's numbers");
                }
                None => assert!(!runs, "{tag}: CUDA bf16 declined the fused form"),
            }
        }
    }
    Ok(())
}

/// A conv weight that does not fit is an error naming it, before anything runs.
#[test]
fn conv_gated_delta_rule_split_refuses_a_weight_that_does_not_fit() -> Result<()> {
    let dev = device();
    let d = dims(2, 4, 32, 16);
    let split = SplitBatch::new(40, vec![40], 33, vec![33], vec![0], &dev)?;
    let c = d.channels();
    let x_s = Tensor::zeros((1, 40, c), DType::BF16, &dev)?;
    let x_b = Tensor::zeros((1, 33, c), DType::BF16, &dev)?;
    let gates = Tensor::zeros((73, d.num_v_heads, 2), DType::F32, &dev)?;
    for w in [
        Tensor::zeros((c - 1, 4), DType::BF16, &dev)?,
        Tensor::zeros((c, 4), DType::F32, &dev)?,
    ] {
        let err = conv_gated_delta_rule_split(&x_s, &x_b, &w, &gates, d, &split)
            .expect_err("a weight that does not fit ran")
            .to_string();
        assert!(err.contains("conv weight"), "unclear error: {err}");
    }
    Ok(())
}

#[test]
fn fused_ops_on_device_match_references() -> Result<()> {
    testing::check_fused_ops(&device(), |what, got, want, tol| {
        check(what, got, want, tol).map(|_| ())
    })
}

/// One flash-attention case: batch rows, query and kv heads, queries, own keys, and a past of
/// (rows, steps, each batch row's past row).
struct FlashCase {
    b: usize,
    hq: usize,
    hkv: usize,
    t: usize,
    l: usize,
    past: Option<(usize, usize, Vec<usize>)>,
    /// Each row's own padding: its last keys masked (rows are right-padded).
    pads: Vec<usize>,
}

/// `[rows, heads, steps, 256]` values as a strided view (a head-major transpose of a wider
/// `[rows, steps, heads + 1, 256]` tensor, as the values' view of the projection is).
fn strided_heads(rows: usize, heads: usize, steps: usize, salt: f32) -> Result<Tensor> {
    patterned(&[rows, steps, heads + 1, 256], salt, 1.0)?
        .to_dtype(DType::BF16)?
        .narrow(2, 1, heads)?
        .transpose(1, 2)
}

/// softmax(q·kᵀ·scale + bias + causal mask)·v in f32 on the CPU, one batch row at a time: the
/// past's row `owners[b]`, then the row's own keys.
fn attention_reference(
    q: &Tensor,
    past: Option<(&Tensor, &Tensor, &[usize])>,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let f32_ = |t: &Tensor| t.to_dtype(DType::F32);
    let (b_sz, hq, t_len, _) = q.dims4()?;
    let hkv = k.dim(1)?;
    let rep = hq / hkv;
    let mut outs = Vec::new();
    for b in 0..b_sz {
        let (mut ks, mut vs) = (vec![f32_(&k.get(b)?)?], vec![f32_(&v.get(b)?)?]);
        if let Some((pk, pv, owners)) = past {
            ks.insert(0, f32_(&pk.get(owners[b])?)?);
            vs.insert(0, f32_(&pv.get(owners[b])?)?);
        }
        let (kb, vb) = (Tensor::cat(&ks, 1)?, Tensor::cat(&vs, 1)?); // [Hkv, S + L, hd]
        let keys = kb.dim(1)?;
        let mask: Vec<f32> = (0..t_len)
            .flat_map(|t| {
                (0..keys).map(move |j| {
                    if j > keys - t_len + t {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t_len, keys), &candle_core::Device::Cpu)?
            .broadcast_add(&bias.get(b)?.unsqueeze(0)?)?;
        let mut heads = Vec::new();
        for h in 0..hq {
            let qh = f32_(&q.get(b)?.get(h)?)?; // [T, hd]
            let (kh, vh) = (kb.get(h / rep)?, vb.get(h / rep)?);
            let scores = ((qh.matmul(&kh.t()?)? * scale)? + &mask)?;
            let probs = candle_nn::ops::softmax_last_dim(&scores)?;
            heads.push(probs.matmul(&vh)?);
        }
        outs.push(Tensor::stack(&heads, 0)?);
    }
    Tensor::stack(&outs, 0)
}

#[test]
fn flash_attention_matches_f32_reference() -> Result<()> {
    use kev_kernels::testing::flash_attention;
    use kev_kernels::{AttentionPast, RowIndex};
    let dev = device();
    let scale = 1.0 / 16.0;
    for case in [
        // A state pass: 4 query heads a kv head, steps not a multiple of the 64-row tiles; the
        // second row mostly padding (whole blocks of padded queries).
        FlashCase {
            b: 2,
            hq: 8,
            hkv: 2,
            t: 100,
            l: 100,
            past: None,
            pads: vec![1, 90],
        },
        // Branch rows on their state rows' keys (out of order, one state row twice).
        FlashCase {
            b: 3,
            hq: 8,
            hkv: 2,
            t: 37,
            l: 37,
            past: Some((2, 70, vec![1, 0, 1])),
            pads: vec![0, 17, 36],
        },
        // A cached continuation: more own keys than queries (the last T of L).
        FlashCase {
            b: 1,
            hq: 16,
            hkv: 4,
            t: 20,
            l: 90,
            past: None,
            pads: vec![5],
        },
    ] {
        let FlashCase {
            b, hq, hkv, t, l, ..
        } = case;
        let q = (patterned(&[b, hq, t, 256], 0.1, 3.0)?).to_dtype(DType::BF16)?;
        let k = patterned(&[b, hkv, l, 256], 0.7, 1.0)?.to_dtype(DType::BF16)?;
        let v = strided_heads(b, hkv, l, 1.3)?;
        let past = match &case.past {
            Some((r, s, owners)) => Some((
                patterned(&[*r, hkv, *s, 256], 2.1, 1.0)?.to_dtype(DType::BF16)?,
                strided_heads(*r, hkv, *s, 2.9)?,
                owners.clone(),
            )),
            None => None,
        };
        let s_len = past.as_ref().map_or(0, |p| p.0.dim(2).unwrap_or(0));
        // Padding: row 0's last past key and each row's last own keys (a query whose own key
        // is masked is padding: its output is zero on the kernel).
        let pads = &case.pads;
        let bias: Vec<f32> = (0..b)
            .flat_map(|row| {
                (0..s_len + l).map(move |j| {
                    let pad =
                        (row == 0 && s_len > 0 && j == s_len - 1) || j >= s_len + l - pads[row];
                    if pad {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                })
            })
            .collect();
        let bias = Tensor::from_vec(bias, (b, s_len + l), &candle_core::Device::Cpu)?;
        let want = attention_reference(
            &q,
            past.as_ref().map(|(pk, pv, o)| (pk, pv, o.as_slice())),
            &k,
            &v,
            &bias,
            scale,
        )?;
        // The padded queries (their own keys masked) read no key on the kernel: zeros.
        let real: Vec<f32> = (0..b)
            .flat_map(|row| (0..t).map(move |q| f32::from(u8::from(l - t + q < l - pads[row]))))
            .collect();
        let want = want.broadcast_mul(&Tensor::from_vec(real, (b, 1, t, 1), want.device())?)?;
        let on = |t: &Tensor| t.to_device(&dev);
        let (q_d, k_d, v_d, bias_d) = (on(&q)?, on(&k)?, on(&v)?, on(&bias)?);
        let past_d = match &past {
            Some((pk, pv, owners)) => Some((on(pk)?, on(pv)?, RowIndex::new(owners, &dev)?)),
            None => None,
        };
        let got = flash_attention(
            &q_d,
            past_d
                .as_ref()
                .map(|(k, v, owners)| AttentionPast { k, v, owners }),
            &k_d,
            &v_d,
            &bias_d,
            scale,
        )?;
        let what = format!(
            "flash attention b={b} hq={hq} t={t} l={l} past={:?}",
            case.past
        );
        match got {
            Some(got) => {
                assert_eq!(got.dims(), &[b, hq, t, 256]);
                check(&what, &got, &want, 2e-2)?;
            }
            None if dev.is_cuda() => panic!("{what}: declined on CUDA"),
            None => println!(
                "{what}: declined on {:?} (CUDA only), as expected",
                dev.location()
            ),
        }
        // f32 inputs and other head dims take the matmul form.
        let f32_q = q_d.to_dtype(DType::F32)?;
        let (f32_k, f32_v) = (k_d.to_dtype(DType::F32)?, v_d.to_dtype(DType::F32)?);
        assert!(flash_attention(
            &f32_q,
            None,
            &f32_k,
            &f32_v,
            &bias_d.narrow(1, s_len, l)?,
            scale
        )?
        .is_none());
    }
    // The model's choice: the kernel for grids that fill the GPU only.
    let q_of = |b: usize, t: usize| Tensor::zeros((b, 8, t, 256), DType::BF16, &dev);
    assert!(!kev_kernels::flash_attention_fills_gpu(&q_of(1, 1)?, 2)?);
    let many = kev_kernels::flash_attention_fills_gpu(&q_of(64, 512)?, 2)?;
    assert_eq!(
        many,
        dev.is_cuda(),
        "4096 blocks fill a GPU, and only CUDA runs the kernel"
    );
    Ok(())
}

/// The projections' matmul: on CUDA each shape class times cuBLASLt's algorithms against
/// cuBLAS's choice, and gives cuBLAS's numbers bit for bit whichever it keeps; on every device
/// it is a matmul (an f32 reference within the output dtype's rounding).
#[test]
fn linear_on_device_gives_cublas_numbers() -> Result<()> {
    let dev = device();
    // Inputs' leading dims, the weight's outputs and inputs, and the row it starts at: one row;
    // the one-request down projection (3-D, then another row count of the same weight, timed
    // and checked anew); a view of rows of a weight, on a 256-byte boundary and off one (cuBLAS
    // then); 3000 rows; a batch above `MAX_TUNED_ROWS` (candle's matmul). Off CUDA (the
    // composed matmul, slow in bf16 under the aarch64 emulation) the first and last.
    let cases = [
        (vec![1usize], 64usize, 32usize, 0usize),
        (vec![1, 704], 1024, 3584, 0),
        (vec![700], 1024, 3584, 0),
        (vec![192], 5120, 1024, 16),
        (vec![37], 96, 100, 1),
        (vec![3000], 2048, 1024, 0),
        (vec![kev_kernels::MAX_TUNED_ROWS + 64], 256, 128, 0),
    ];
    let cases = if dev.is_cuda() {
        cases.to_vec()
    } else {
        vec![cases[0].clone(), cases[6].clone()]
    };
    for (lead, n, k, offset) in cases {
        // The f32 bound: the output's rounding, f32 sums on CUDA. Off CUDA f16 is candle's CPU
        // matmul, which on aarch64 sums in f16 (measured under the emulation: 4.7e-3 of the
        // largest output).
        let f16_rel = if dev.is_cuda() {
            2f32.powi(-9)
        } else {
            2f32.powi(-5)
        };
        for (dtype, rel) in [(DType::BF16, 2f32.powi(-7)), (DType::F16, f16_rel)] {
            let rows: usize = lead.iter().product();
            let x = patterned(&[&lead[..], &[k]].concat(), 0.3, 0.5)?.to_dtype(dtype)?;
            let w = patterned(&[n + offset, k], 1.7, 0.5)?.to_dtype(dtype)?;
            let want = x
                .to_dtype(DType::F32)?
                .broadcast_matmul(&w.narrow(0, offset, n)?.to_dtype(DType::F32)?.t()?)?;
            let (x, w) = (x.to_device(&dev)?, w.to_device(&dev)?.narrow(0, offset, n)?);
            let what = format!("linear {dtype:?} {rows}x{n}x{k}+{offset}");
            let out_dims = [&lead[..], &[n]].concat();
            let cublas = x.reshape((rows, k))?.matmul(&w.t()?)?.reshape(out_dims)?;
            // The first call of a shape times it, the second runs the choice.
            for call in ["timing", "timed"] {
                let ours = kev_kernels::tuning(|| kev_kernels::linear(&x, &w))?;
                check(&format!("{what} ({call}) vs cuBLAS"), &ours, &cublas, 0.0)?;
            }
            let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
            check(
                &format!("{what} vs f32"),
                &kev_kernels::linear(&x, &w)?.to_dtype(DType::F32)?,
                &want,
                scale * rel,
            )?;
        }
    }
    Ok(())
}

/// A MoE layer's MLP past its router and shared expert, token by token in plain f32 loops:
/// softmax, the k most probable (lower index among equals), renormalised,
/// Σ w · down(silu(gate) · up), plus sigmoid(shared gate) · shared.
fn moe_mlp_by_token(
    x: &Tensor,
    logits: &Tensor,
    (gate_up, down): (&Tensor, &Tensor),
    k: usize,
    (shared, shared_gate): (&Tensor, &Tensor),
) -> Result<Tensor> {
    let f32s = |t: &Tensor| t.to_dtype(DType::F32)?.to_vec2::<f32>();
    let (x, logits, shared, shared_gate) =
        (f32s(x)?, f32s(logits)?, f32s(shared)?, f32s(shared_gate)?);
    let gate_up = gate_up.to_dtype(DType::F32)?.to_vec3::<f32>()?;
    let down = down.to_dtype(DType::F32)?.to_vec3::<f32>()?;
    let (h, i) = (x[0].len(), down[0][0].len());
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(a, b)| a * b).sum::<f32>();
    let mut out = Vec::with_capacity(x.len() * h);
    for (t, (row, l)) in x.iter().zip(&logits).enumerate() {
        let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let p: Vec<f32> = l.iter().map(|v| (v - max).exp()).collect();
        let mut order: Vec<usize> = (0..p.len()).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let total: f32 = order[..k].iter().map(|&e| p[e]).sum();
        let g = 1.0 / (1.0 + (-shared_gate[t][0]).exp());
        let mut acc: Vec<f32> = shared[t].iter().map(|s| g * s).collect();
        for &e in &order[..k] {
            let z: Vec<f32> = (0..i)
                .map(|c| {
                    let g = dot(row, &gate_up[e][c]);
                    g / (1.0 + (-g).exp()) * dot(row, &gate_up[e][i + c])
                })
                .collect();
            for (o, d) in acc.iter_mut().zip(&down[e]) {
                *o += p[e] / total * dot(&z, d);
            }
        }
        out.extend(acc);
    }
    Tensor::from_vec(out, (x.len(), h), &candle_core::Device::Cpu)
}

/// The MoE MLP on the device against the composed form on the CPU (itself checked against a
/// token-by-token loop): f32 on CUDA cores, bf16 on tensor cores and, with an expert width that
/// is no multiple of 8, on CUDA cores; experts with no token, experts with several tiles of
/// tokens, one token, and a NaN logit making its token's row NaN.
#[test]
fn moe_mlp_on_device_matches_the_composed_form() -> Result<()> {
    use kev_kernels::{moe_mlp, moe_mlp_ref, RoutedExperts, SharedExpert};
    let dev = device();
    let cpu = candle_core::Device::Cpu;
    // (tokens, hidden, experts, expert width, per token)
    for (t, h, e, i, k) in [
        (1, 64, 4, 32, 2),
        (37, 64, 8, 48, 3),
        (300, 256, 16, 128, 4),
        (9, 40, 6, 20, 2),
    ] {
        let x = patterned(&[t, h], 0.1, 1.0)?;
        // Skewed logits: some experts get many tokens, expert e - 1 none.
        let skew = Tensor::arange(0f32, e as f32, &cpu)?.affine(-0.4, 0.0)?;
        let logits = patterned(&[t, e], 0.7, 3.0)?.broadcast_add(&skew)?;
        let logits =
            logits.slice_assign(&[0..t, e - 1..e], &Tensor::full(-30f32, (t, 1), &cpu)?)?;
        let gate_up = patterned(&[e, 2 * i, h], 0.3, 1.0 / (h as f32).sqrt())?;
        let down = patterned(&[e, h, i], 0.9, 1.0 / (i as f32).sqrt())?;
        let shared = patterned(&[t, h], 0.5, 0.5)?;
        let shared_gate = patterned(&[t, 1], 0.2, 2.0)?;
        let plain = moe_mlp_by_token(&x, &logits, (&gate_up, &down), k, (&shared, &shared_gate))?;
        let weights = [&x, &logits, &gate_up, &down, &shared, &shared_gate];
        for (dtype, tol) in [(DType::F32, 1e-5f32), (DType::BF16, 0.05)] {
            let [x, logits, gate_up, down, shared, shared_gate] =
                weights.map(|t| t.to_dtype(dtype));
            let (x, logits, gate_up, down) = (x?, logits?, gate_up?, down?);
            let (shared, shared_gate) = (shared?, shared_gate?);
            let s = SharedExpert {
                output: &shared,
                gate: &shared_gate,
            };
            let experts = RoutedExperts {
                gate_up: &gate_up,
                down: &down,
                per_token: k,
            };
            let composed = moe_mlp_ref(&x, &logits, experts, s)?;
            if dtype == DType::F32 {
                check(
                    &format!("moe composed t{t} e{e} i{i}"),
                    &composed,
                    &plain,
                    1e-5,
                )?;
            }
            let on = |t: &Tensor| t.to_device(&dev);
            let (shared, shared_gate) = (on(&shared)?, on(&shared_gate)?);
            let s = SharedExpert {
                output: &shared,
                gate: &shared_gate,
            };
            let (gate_up, down) = (on(&gate_up)?, on(&down)?);
            let experts = RoutedExperts {
                gate_up: &gate_up,
                down: &down,
                per_token: k,
            };
            let ours = moe_mlp(&on(&x)?, &on(&logits)?, experts, s)?;
            let scale = composed
                .to_dtype(DType::F32)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert!(
                scale > 0.1,
                "outputs of scale {scale}: the check would mean little"
            );
            check(
                &format!("moe {dtype:?} t{t} h{h} e{e} i{i} k{k}"),
                &ours,
                &composed,
                tol * scale,
            )?;
        }
    }
    // A NaN logit: that token's row is NaN, the others are not.
    let (t, h, e, i, k) = (3, 64, 4, 32, 2);
    let nan = Tensor::full(f32::NAN, (1, 1), &cpu)?;
    let logits = patterned(&[t, e], 0.7, 3.0)?.slice_assign(&[1..2, 2..3], &nan)?;
    let on = |t: Tensor| t.to_device(&dev);
    let (shared, shared_gate) = (
        on(patterned(&[t, h], 0.5, 0.5)?)?,
        on(patterned(&[t, 1], 0.2, 1.0)?)?,
    );
    let (gate_up, down) = (
        on(patterned(&[e, 2 * i, h], 0.3, 0.1)?)?,
        on(patterned(&[e, h, i], 0.9, 0.1)?)?,
    );
    let experts = RoutedExperts {
        gate_up: &gate_up,
        down: &down,
        per_token: k,
    };
    let ours = moe_mlp(
        &on(patterned(&[t, h], 0.1, 1.0)?)?,
        &on(logits)?,
        experts,
        SharedExpert {
            output: &shared,
            gate: &shared_gate,
        },
    )?
    .to_vec2::<f32>()?;
    for (row, values) in ours.iter().enumerate() {
        assert_eq!(
            values.iter().all(|v| v.is_nan()),
            row == 1,
            "row {row}: {:?}",
            &values[..4]
        );
        assert!(row == 1 || values.iter().all(|v| v.is_finite()));
    }
    Ok(())
}

/// FP8 products ([`kev_kernels::fp8_linear`]) against their f32 reference: the same quantized
/// operands, summed in another order and rounded to bf16. On a GPU of compute capability 9.0:
/// token counts not a multiple of the padding, inputs of a partial last block and a weight
/// whose block columns do not fill a row of four (the scales' padding), a row view of the
/// weight (scales read past its first row), and a NaN input reaching its row only. Elsewhere
/// the product is refused, naming why.
#[test]
fn fp8_linear_on_device_matches_its_reference() -> Result<()> {
    use kev_kernels::{fp8_available, fp8_linear, fp8_linear_ref, Fp8Weight};
    let dev = device();
    let (n, k) = (328, 400);
    let w = Fp8Weight::quantize(&patterned(&[n, k], 0.4, 0.05)?, &dev)?;
    if !fp8_available(&dev) {
        let x = patterned(&[3, k], 0.1, 1.0)?
            .to_dtype(DType::BF16)?
            .to_device(&dev)?;
        let err = fp8_linear(&x, &w)
            .expect_err("no FP8 products here")
            .to_string();
        assert!(err.contains("FP8 products"), "{err}");
        println!("fp8 linear: refused on {dev:?} ({err})");
        return Ok(());
    }
    for (m, weight) in [
        (1, w.clone()),
        (5, w.clone()),
        (64, w.clone()),
        (300, w.rows(128, 200)?),
    ] {
        let x = patterned(&[m, k], 0.1 * m as f32, 2.0)?.to_dtype(DType::BF16)?;
        let ours = fp8_linear(&x.to_device(&dev)?, &weight)?.to_dtype(DType::F32)?;
        let reference = fp8_linear_ref(&x, &weight)?;
        let scale = reference.abs()?.max_all()?.to_scalar::<f32>()?;
        // bf16 output: half a unit in its last place of the largest value, and the sum's order.
        check(
            &format!("fp8 linear m{m}"),
            &ours,
            &reference,
            scale / 128.0,
        )?;
    }
    let mut x = patterned(&[4, k], 0.3, 1.0)?;
    x = x.slice_assign(
        &[2..3, 7..8],
        &Tensor::full(f32::NAN, (1, 1), &candle_core::Device::Cpu)?,
    )?;
    let ours = fp8_linear(&x.to_dtype(DType::BF16)?.to_device(&dev)?, &w)?;
    let rows = ours.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    for (r, row) in rows.iter().enumerate() {
        assert_eq!(
            row.iter().any(|v| v.is_nan()),
            r == 2,
            "row {r}: a NaN input reaches its row only"
        );
    }
    Ok(())
}
