//! The CPU ops against their tensor-op references, and "two chunks == whole".

use candle_core::{DType, Device, Result, Tensor};
use kev_kernels::testing::{self, assert_close, patterned};
use kev_kernels::{
    causal_conv1d, causal_conv1d_cached, causal_conv1d_ref, causal_conv1d_split, gated_delta_rule,
    gated_delta_rule_ref, GdrDims, SplitBatch,
};

/// f32 op vs f32 reference on unit-scale data: same math, different summation order.
const TOL_F32: f32 = 1e-5;

struct Case {
    b: usize,
    t: usize,
    dims: GdrDims,
}

fn gdr_inputs(c: &Case, salt: f32) -> Result<(Tensor, Tensor, Tensor)> {
    testing::gdr_inputs(c.b, c.t, c.dims, salt)
}

fn cases() -> Vec<Case> {
    let dims = |hk, hv, dk, dv| GdrDims {
        num_k_heads: hk,
        num_v_heads: hv,
        head_k_dim: dk,
        head_v_dim: dv,
    };
    vec![
        Case {
            b: 1,
            t: 1,
            dims: dims(1, 1, 8, 8),
        },
        Case {
            b: 2,
            t: 7,
            dims: dims(2, 4, 32, 16),
        },
        Case {
            b: 3,
            t: 65,
            dims: dims(2, 2, 16, 24),
        },
        // Dv 40: one strip of 32 columns and one of 8 on AVX2; odd Dk; two step blocks.
        Case {
            b: 1,
            t: 70,
            dims: dims(1, 2, 9, 40),
        },
        // The real heads' sizes (128 × 128: four strips of 32).
        Case {
            b: 1,
            t: 5,
            dims: dims(1, 1, 128, 128),
        },
        // Dv 20 (not a multiple of 8): the row-by-row form, also on AVX2 machines.
        Case {
            b: 2,
            t: 9,
            dims: dims(1, 2, 9, 20),
        },
    ]
}

#[test]
fn gated_delta_rule_matches_reference() -> Result<()> {
    for c in cases() {
        let (qkv, gates, state) = gdr_inputs(&c, 0.3)?;
        let (o_ref, s_ref) = gated_delta_rule_ref(&qkv, &gates, &state, c.dims)?;
        let s = state.copy()?;
        let o = gated_delta_rule(&qkv, &gates, &s, c.dims, None)?;
        let tag = format!("gdr b={} t={} {:?}", c.b, c.t, c.dims);
        assert_close(&format!("{tag} output"), &o, &o_ref, TOL_F32)?;
        assert_close(&format!("{tag} state"), &s, &s_ref, TOL_F32)?;
    }
    Ok(())
}

#[test]
fn gated_delta_rule_two_chunks_equal_whole() -> Result<()> {
    let c = &cases()[2];
    let (qkv, gates, state) = gdr_inputs(c, 1.1)?;
    let whole_state = state.copy()?;
    let whole = gated_delta_rule(&qkv, &gates, &whole_state, c.dims, None)?;
    let split_state = state.copy()?;
    let first = gated_delta_rule(
        &qkv.narrow(1, 0, 40)?,
        &gates.narrow(1, 0, 40)?,
        &split_state,
        c.dims,
        None,
    )?;
    let second = gated_delta_rule(
        &qkv.narrow(1, 40, 25)?,
        &gates.narrow(1, 40, 25)?,
        &split_state,
        c.dims,
        None,
    )?;
    let split = Tensor::cat(&[first, second], 1)?;
    // Identical arithmetic in the same order: exact.
    assert_close("gdr split output", &split, &whole, 0.0)?;
    assert_close("gdr split state", &split_state, &whole_state, 0.0)?;
    Ok(())
}

/// Rows whose lengths end inside, exactly at and before the first 64-step block of the CPU's
/// strip form: each equals its real steps run alone.
#[test]
fn gated_delta_rule_lengths_across_step_blocks() -> Result<()> {
    let c = Case {
        b: 3,
        t: 70,
        dims: GdrDims {
            num_k_heads: 1,
            num_v_heads: 2,
            head_k_dim: 16,
            head_v_dim: 40,
        },
    };
    let lengths = [66, 64, 0];
    let (qkv, gates, state) = gdr_inputs(&c, 0.7)?;
    let padded = state.copy()?;
    let o = gated_delta_rule(&qkv, &gates, &padded, c.dims, Some(&lengths))?;
    for (row, &len) in lengths.iter().enumerate() {
        let alone = state.narrow(0, row, 1)?.copy()?;
        let o_alone = gated_delta_rule(
            &qkv.narrow(0, row, 1)?.narrow(1, 0, len)?,
            &gates.narrow(0, row, 1)?.narrow(1, 0, len)?,
            &alone,
            c.dims,
            None,
        )?;
        let tag = format!("gdr row {row} of length {len}");
        assert_close(
            &format!("{tag} state"),
            &padded.narrow(0, row, 1)?,
            &alone,
            0.0,
        )?;
        let o_row = o.narrow(0, row, 1)?;
        assert_close(
            &format!("{tag} output"),
            &o_row.narrow(1, 0, len)?,
            &o_alone,
            0.0,
        )?;
        let tail = o_row.narrow(1, len, c.t - len)?;
        assert_close(&format!("{tag} padding"), &tail, &tail.zeros_like()?, 0.0)?;
    }
    Ok(())
}

#[test]
fn gated_delta_rule_lengths_freeze_padded_rows() -> Result<()> {
    let c = &cases()[1];
    let (qkv, gates, state) = gdr_inputs(c, 2.0)?;
    let padded = state.copy()?;
    let o = gated_delta_rule(&qkv, &gates, &padded, c.dims, Some(&[7, 3]))?;
    // Row 1 with only its 3 real steps.
    let short = state.narrow(0, 1, 1)?.copy()?;
    let o_short = gated_delta_rule(
        &qkv.narrow(0, 1, 1)?.narrow(1, 0, 3)?,
        &gates.narrow(0, 1, 1)?.narrow(1, 0, 3)?,
        &short,
        c.dims,
        None,
    )?;
    assert_close(
        "gdr padded row state",
        &padded.narrow(0, 1, 1)?,
        &short,
        0.0,
    )?;
    assert_close(
        "gdr padded row output",
        &o.narrow(0, 1, 1)?.narrow(1, 0, 3)?,
        &o_short,
        0.0,
    )?;
    let tail = o
        .narrow(0, 1, 1)?
        .narrow(1, 3, 4)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    assert_eq!(tail, 0.0, "padded steps must output zero");
    Ok(())
}

#[test]
fn gated_delta_rule_bf16_input_reads_as_f32() -> Result<()> {
    let c = &cases()[1];
    let (qkv, gates, state) = gdr_inputs(c, 0.9)?;
    let qkv16 = qkv.to_dtype(DType::BF16)?;
    let s_a = state.copy()?;
    let o = gated_delta_rule(&qkv16, &gates, &s_a, c.dims, None)?;
    assert_eq!(o.dtype(), DType::BF16);
    let s_b = state.copy()?;
    let o32 = gated_delta_rule(&qkv16.to_dtype(DType::F32)?, &gates, &s_b, c.dims, None)?;
    assert_close("gdr bf16 in: state", &s_a, &s_b, 0.0)?;
    // Output rounded once to bf16: within half an ulp of bf16 (2^-8 relative) of unit-scale values.
    assert_close("gdr bf16 in: output", &o, &o32, 2e-2)?;
    Ok(())
}

#[test]
fn gated_delta_rule_rejects_bad_shapes() -> Result<()> {
    let c = &cases()[1];
    let (qkv, gates, state) = gdr_inputs(c, 0.1)?;
    let err = gated_delta_rule(
        &qkv.narrow(2, 1, c.dims.channels() - 1)?,
        &gates,
        &state,
        c.dims,
        None,
    )
    .unwrap_err();
    assert!(err.to_string().contains("gated-delta-rule"), "{err}");
    let err =
        gated_delta_rule(&qkv, &gates, &state.to_dtype(DType::F16)?, c.dims, None).unwrap_err();
    assert!(err.to_string().contains("state must be f32"), "{err}");
    // Value heads of size 0: an error, not a panic.
    let empty_v = GdrDims {
        head_v_dim: 0,
        ..c.dims
    };
    let qkv0 = qkv.narrow(2, 0, empty_v.channels())?;
    let state0 = Tensor::zeros(
        (c.b, empty_v.num_v_heads, empty_v.head_k_dim, 0),
        DType::F32,
        qkv.device(),
    )?;
    let err = gated_delta_rule(&qkv0, &gates, &state0, empty_v, None).unwrap_err();
    assert!(err.to_string().contains("empty heads"), "{err}");
    Ok(())
}

/// The conv of states and their branches: what does not fit is an error naming it; off CUDA
/// the one-launch form does not run (`None`) and the op composes.
#[test]
fn causal_conv1d_split_refuses_what_does_not_fit() -> Result<()> {
    let state = patterned(&[1, 10, 24], 0.4, 2.0)?;
    let branches = patterned(&[3, 5, 24], 0.4, 1.0)?;
    let w = patterned(&[24, 4], 1.7, 0.5)?;
    let rows = SplitBatch::new(10, vec![10], 5, vec![5, 4, 0], vec![0, 0, 0], &Device::Cpu)?;
    let refused = |s: &Tensor, b: &Tensor, w: &Tensor, needle: &str| {
        let e = causal_conv1d_split(s, b, w, &rows).unwrap_err().to_string();
        assert!(e.contains(needle), "`{e}` does not say `{needle}`");
    };
    refused(&state.narrow(2, 0, 20)?, &branches, &w, "do not fit weight");
    // Two state rows where the split has one.
    refused(
        &state.repeat((2, 1, 1))?,
        &branches,
        &w,
        "1 state rows of 10 steps",
    );
    refused(&state, &branches, &w.narrow(1, 0, 1)?, "do not fit weight");
    refused(&state, &branches.to_dtype(DType::BF16)?, &w, "mixed dtypes");
    assert!(
        testing::fused_causal_conv1d_split(&state, &branches, &w, &rows)?.is_none(),
        "the CPU composes"
    );
    Ok(())
}

/// Split batches that do not describe a pass are refused by name.
#[test]
fn split_batch_refuses_what_does_not_fit() {
    let new = |state_lengths: Vec<usize>, lengths: Vec<usize>, owners: Vec<usize>| {
        SplitBatch::new(4, state_lengths, 3, lengths, owners, &Device::Cpu)
    };
    let refused = |r: Result<SplitBatch>, needle: &str| {
        let e = r.unwrap_err().to_string();
        assert!(e.contains(needle), "`{e}` does not say `{needle}`");
    };
    refused(new(vec![4, 5], vec![3], vec![0]), "a state row of 5 steps");
    refused(
        new(vec![4], vec![3, 4], vec![0, 0]),
        "a branch row of 4 steps",
    );
    refused(
        new(vec![4], vec![3, 3], vec![0]),
        "1 owners for 2 branch rows",
    );
    refused(
        new(vec![4, 2], vec![3], vec![2]),
        "continues state row 2 of 2",
    );
    let rows = new(vec![4, 2], vec![3, 1, 0], vec![1, 0, 1]).unwrap();
    assert_eq!((rows.states(), rows.branches(), rows.tokens()), (2, 3, 17));
}

#[test]
fn causal_conv1d_matches_reference_and_continues() -> Result<()> {
    for &(b, t, ch, k) in &[
        (1usize, 1usize, 8usize, 4usize),
        (2, 9, 24, 4),
        (3, 70, 40, 3),
    ] {
        let x = patterned(&[b, k - 1 + t, ch], 0.4, 2.0)?;
        let w = patterned(&[ch, k], 1.7, 0.5)?;
        let y = causal_conv1d(&x, &w)?;
        let y_ref = causal_conv1d_ref(&x, &w)?;
        assert_close(
            &format!("conv b={b} t={t} c={ch} k={k}"),
            &y,
            &y_ref,
            TOL_F32,
        )?;
        if t > 2 {
            // Continuation: the second half fed with the K−1 inputs before it.
            let cut = t / 2;
            let second = causal_conv1d(&x.narrow(1, cut, k - 1 + t - cut)?, &w)?;
            assert_close(
                "conv continuation",
                &second,
                &y.narrow(1, cut, t - cut)?,
                0.0,
            )?;
        }
    }
    let x = patterned(&[1, 6, 8], 0.4, 2.0)?.to_dtype(DType::BF16)?;
    let w = patterned(&[8, 4], 1.7, 0.5)?.to_dtype(DType::BF16)?;
    assert_eq!(causal_conv1d(&x, &w)?.dtype(), DType::BF16);
    assert!(causal_conv1d(&x, &patterned(&[9, 4], 0.0, 1.0)?).is_err());
    Ok(())
}

/// The next conv window a prefix keeps holds its own K−1 steps, not the step's whole output
/// (a view, or candle's `copy` of one, would keep every step's output alive in a prefix cache).
#[test]
fn causal_conv1d_cached_window_owns_its_storage() -> Result<()> {
    let (b, t, ch, k) = (2usize, 40usize, 16usize, 4usize);
    let x = patterned(&[b, t, ch], 0.4, 2.0)?;
    let w = patterned(&[ch, k], 1.7, 0.5)?;
    let cache = patterned(&[b, k - 1, ch], 0.9, 1.0)?;
    let (y, next) = causal_conv1d_cached(&x, &cache, &w, None)?;
    let (storage, _) = next.storage_and_layout();
    let held = match &*storage {
        candle_core::Storage::Cpu(s) => s.as_slice::<f32>()?.len(),
        _ => unreachable!("a CPU test"),
    };
    assert_eq!(
        held,
        b * (k - 1) * ch,
        "elements the window's storage holds"
    );
    // And it is the window: the last K−1 inputs of each row.
    assert_close("window", &next, &x.narrow(1, t - (k - 1), k - 1)?, 0.0)?;
    assert_eq!(y.dims(), &[b, t, ch]);
    Ok(())
}

#[test]
fn chunked_form_equals_recurrent() -> Result<()> {
    use kev_kernels::gated_delta_rule_chunked;
    let dims = |hk, hv, dk, dv| GdrDims {
        num_k_heads: hk,
        num_v_heads: hv,
        head_k_dim: dk,
        head_v_dim: dv,
    };
    for (b, t, d, lengths) in [
        (1, 1, dims(1, 1, 8, 8), None),
        (2, 65, dims(2, 4, 32, 16), Some(vec![65usize, 20])),
        (1, 200, dims(2, 2, 32, 32), None),
    ] {
        let c = Case { b, t, dims: d };
        let (qkv, gates, state) = gdr_inputs(&c, 0.7)?;
        let s_rec = state.copy()?;
        let o_rec = gated_delta_rule(&qkv, &gates, &s_rec, d, lengths.as_deref())?;
        let s_chunk = state.copy()?;
        let o_chunk = gated_delta_rule_chunked(&qkv, &gates, &s_chunk, d, lengths.as_deref())?;
        let tag = format!("chunked vs recurrent b={b} t={t}");
        // Different algorithms in f32 (cumulative log-decays, the doubling inverse): ~1e-6
        // relative on unit data; 1e-4 absolute bounds it.
        assert_close(&format!("{tag} output"), &o_chunk, &o_rec, 1e-4)?;
        assert_close(&format!("{tag} state"), &s_chunk, &s_rec, 1e-4)?;
    }
    Ok(())
}

#[test]
fn fused_ops_match_references() -> Result<()> {
    testing::check_fused_ops(&candle_core::Device::Cpu, |what, got, want, tol| {
        assert_close(what, got, want, tol)
    })
}

/// The int8 matmul against its definition computed here in f64: `quantize_block` of each weight
/// row (an output column) whole and of each input row per block of `INT8_BLOCK` inputs, integer
/// products per block scaled by the input block's scale, their sum by the column's. The kernel
/// sums each block exactly in i32 and the blocks in f32, so only f32 rounding separates them.
/// Row counts across both kernels' micro-tiles (6 and 4) and every partial tile, none, k not a
/// multiple of 4 nor of the block, n not a multiple of the 32-column block (nor of its 16-column
/// half) and over several tasks' blocks; a row range of the packed weight; an outlier confined
/// to its block; a block of zeros and one too small to scale (zeros, as `quantize_block` gives);
/// a NaN or infinite input giving NaN outputs in its row only. Against the f32 matmul: within
/// the quantization's error. Each instruction set this CPU has runs it, and where it has both,
/// their outputs are equal bit for bit (the same exact sums); one it lacks is refused with an
/// error naming it (and the test says that kernel did not run).
#[test]
fn packed_int8_matmul_matches_its_blockwise_definition() -> Result<()> {
    use kev_kernels::{int8_gemm_available, Int8Isa, PackedInt8};
    let empty = Tensor::zeros((4, 0), DType::F32, &Device::Cpu)?;
    assert!(
        PackedInt8::pack(&empty).is_err(),
        "packed a weight without input features"
    );
    let bad = Tensor::new(&[[1f32, f32::NAN]], &Device::Cpu)?;
    assert!(PackedInt8::pack(&bad).is_err(), "packed a NaN weight");
    for (m, k, n) in [
        (13usize, 37usize, 70usize),
        (67, 1024, 96),
        (1, 2, 1),
        (6, 128, 32),
        (7, 300, 300),
        (5, 130, 2100),
        (0, 8, 40),
        (9, 64, 48),
        (8, 96, 40),
        (10, 64, 33),
    ] {
        let mut xv = patterned(&[m, k], 0.3, 1.0)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        if m > 2 && k > 1 {
            xv[2 * k + 1] = 300.0; // an outlier in row 2, block 0
        }
        if m > 3 && k >= 64 {
            // Row 3: a block of zeros and a block too small for its reciprocal scale (both
            // quantize to zeros).
            xv[3 * k..3 * k + 32].fill(0.0);
            for v in &mut xv[3 * k + 32..3 * k + 64] {
                *v *= 1e-38;
            }
        }
        let x = Tensor::from_vec(xv, (m, k), &Device::Cpu)?;
        let w = patterned(&[n, k], 1.7, 0.2)?;
        let packed = PackedInt8::pack(&w)?;
        let mut outputs = Vec::new();
        for isa in [Int8Isa::Avx512Vnni, Int8Isa::Avx2] {
            let on = packed.clone().on(isa);
            assert_eq!(
                on.is_ok(),
                isa.available(),
                "{isa:?} taken or refused wrongly"
            );
            match on {
                Ok(p) => outputs.push(int8_checked(&p, &x, &w, (m, k, n), isa)?),
                Err(e) => {
                    assert!(e.to_string().contains(&format!("{isa:?}")), "unclear: {e}");
                    println!("no {isa:?} here: its kernel was not run");
                }
            }
        }
        if outputs.is_empty() {
            let err = packed
                .forward(&x)
                .expect_err("ran without an instruction set");
            assert!(err.to_string().contains("AVX2"), "unclear error: {err}");
        }
        if let [vnni, avx2] = &outputs[..] {
            assert_close(&format!("int8 {m}x{k}x{n}: AVX2 = VNNI"), avx2, vnni, 0.0)?;
        }
    }
    assert_eq!(int8_gemm_available(), Int8Isa::best().is_some());
    Ok(())
}

/// Per row of `t: [rows, k]`, its blocks' (of `block` values) scales and integers.
type Int8Blocks = Vec<(f32, Vec<i8>)>;

fn int8_quantized(t: &Tensor, block: usize) -> Result<Vec<Int8Blocks>> {
    Ok(t.to_vec2::<f32>()?
        .iter()
        .map(|row| {
            row.chunks(block)
                .map(|v| {
                    let mut q = vec![0i8; v.len()];
                    (kev_kernels::quantize_block(v, &mut q), q)
                })
                .collect()
        })
        .collect())
}

/// [`packed_int8_matmul_matches_its_blockwise_definition`]'s checks of `packed` (run on `isa`)
/// on `x: [m, k]` against `w: [n, k]`; its output.
fn int8_checked(
    packed: &kev_kernels::PackedInt8,
    x: &Tensor,
    w: &Tensor,
    (m, k, n): (usize, usize, usize),
    isa: kev_kernels::Int8Isa,
) -> Result<Tensor> {
    use kev_kernels::INT8_BLOCK;
    let (qx, qw) = (int8_quantized(x, INT8_BLOCK)?, int8_quantized(w, k)?);
    let want: Vec<f32> = qx
        .iter()
        .flat_map(|xr| {
            qw.iter().map(move |wr| {
                let (sw, b) = &wr[0];
                let blocks: f64 = xr
                    .iter()
                    .zip(b.chunks(INT8_BLOCK))
                    .map(|((sa, a), b)| {
                        let dot: i64 = a.iter().zip(b).map(|(&a, &b)| a as i64 * b as i64).sum();
                        *sa as f64 * dot as f64
                    })
                    .sum();
                (*sw as f64 * blocks) as f32
            })
        })
        .collect();
    let want = Tensor::from_vec(want, (m, n), &Device::Cpu)?;
    let got = packed.forward(x)?;
    assert_eq!(got.dtype(), DType::F32);
    assert_close(
        &format!("int8 matmul {m}x{k}x{n} ({isa:?})"),
        &got,
        &want,
        1e-5 + 1e-6 * k as f32,
    )?;
    // Within the quantization's error of the f32 product (half a step of each operand per
    // input, an outlier's block coarser), away from the outlier's row.
    let exact = x.matmul(&w.t()?)?;
    if m > 3 {
        let rows = |t: &Tensor| t.narrow(0, 3, m - 3);
        assert_close(
            &format!("int8 matmul {m}x{k}x{n} ({isa:?}) against f32"),
            &rows(&got)?,
            &rows(&exact)?,
            0.01 * k as f32 * 0.2,
        )?;
    }
    if m == 0 {
        return Ok(got); // (candle's `narrow` of an empty tensor panics)
    }
    let (start, len) = (3.min(n - 1), n - 3.min(n - 1));
    assert_close(
        &format!("int8 matmul {m}x{k}x{n} ({isa:?}), rows {start}.."),
        &packed.rows(start, len)?.forward(x)?,
        &got.narrow(1, start, len)?,
        0.0,
    )?;
    // A NaN or infinite input makes its row's outputs NaN, the others' unchanged.
    for bad in [f32::NAN, f32::INFINITY] {
        let mut xv = x.flatten_all()?.to_vec1::<f32>()?;
        xv[k - 1] = bad;
        let out = packed.forward(&Tensor::from_vec(xv, (m, k), &Device::Cpu)?)?;
        let rows = out.to_vec2::<f32>()?;
        assert!(
            rows[0].iter().all(|v| v.is_nan()),
            "an input {bad} did not give NaN ({isa:?})"
        );
        if m > 1 {
            assert_close(
                &format!("int8 matmul, rows after an input {bad} ({isa:?})"),
                &out.narrow(0, 1, m - 1)?,
                &got.narrow(0, 1, m - 1)?,
                0.0,
            )?;
        }
    }
    Ok(got)
}

/// The packed bf16 matmul against an f32 matmul of the same bf16-rounded operands: the products
/// are exact in both, only the order of the f32 sums differs. Row counts across a micro-tile
/// (8), none, an odd k, n not a multiple of the 32-column block and over several tasks' blocks;
/// a row range of the packed weight; bf16 in, bf16 out. On a CPU without AVX512-BF16 the op
/// refuses with an error (and the test says the kernel did not run). An empty input dimension
/// is refused at packing.
#[test]
fn packed_bf16_matmul_matches_f32_of_rounded_operands() -> Result<()> {
    use kev_kernels::{bf16_gemm_available, PackedBf16};
    let round = |t: &Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F32);
    let empty = Tensor::zeros((4, 0), DType::F32, &candle_core::Device::Cpu)?;
    assert!(
        PackedBf16::pack(&empty).is_err(),
        "packed a weight without input features"
    );
    for (m, k, n) in [
        (19usize, 37usize, 70usize),
        (67, 1024, 96),
        (1, 2, 1),
        (8, 64, 32),
        (9, 37, 300),
        (5, 16, 2100),
        (0, 8, 40),
    ] {
        let x = round(&patterned(&[m, k], 0.3, 1.0)?)?;
        let w = round(&patterned(&[n, k], 1.7, 0.2)?)?;
        let packed = PackedBf16::pack(&w)?;
        if !bf16_gemm_available() {
            let err = packed.forward(&x).expect_err("ran without AVX512-BF16");
            assert!(
                err.to_string().contains("AVX512-BF16"),
                "unclear error: {err}"
            );
            println!("no AVX512-BF16 here: only the refusal was checked, not the kernel");
            continue;
        }
        let want = x.matmul(&w.t()?)?;
        let got = packed.forward(&x)?;
        // f32 rows are rounded to bf16 as `half` rounds them (the vector conversion included).
        let raw = patterned(&[m, k], 0.3, 1.0)?;
        assert_close(
            &format!("bf16 matmul {m}x{k}x{n}, unrounded f32 rows"),
            &packed.forward(&raw)?,
            &packed.forward(&round(&raw)?)?,
            0.0,
        )?;
        assert_eq!(got.dtype(), DType::F32);
        assert_close(
            &format!("bf16 matmul {m}x{k}x{n}"),
            &got,
            &want,
            1e-5 * k as f32,
        )?;
        // bf16 in, bf16 out: the same sums rounded once.
        let got16 = packed.forward(&x.to_dtype(DType::BF16)?)?;
        assert_eq!(got16.dtype(), DType::BF16);
        assert_close(
            &format!("bf16 matmul {m}x{k}x{n}, bf16"),
            &got16,
            &round(&got)?,
            0.0,
        )?;
        if m == 0 {
            continue; // (candle's `narrow` of an empty tensor panics)
        }
        // Output rows 3.. of the weight, packed on their own.
        let (start, len) = (3.min(n - 1), n - 3.min(n - 1));
        let part = packed.rows(start, len)?.forward(&x)?;
        assert_close(
            &format!("bf16 matmul {m}x{k}x{n}, rows {start}.."),
            &part,
            &got.narrow(1, start, len)?,
            0.0,
        )?;
    }
    Ok(())
}
