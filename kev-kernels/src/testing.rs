//! Deterministic inputs and one comparison, shared by the op tests of every backend
//! (kev-kernels/tests, the workspace parity suite). Not part of the API.

use candle_core::{DType, Device, Result, Tensor, D};

use crate::GdrDims;

pub use crate::attention::flash_attention;
/// The fused forms of the ops that compose a fallback where their kernel does not run, alone:
/// `None` where it does not run. For the tests that the kernel runs where it should and gives
/// the composition's numbers.
pub use crate::causal_conv1d::fused_causal_conv1d_split;
pub use crate::gated_delta_rule::{
    fused_conv_gated_delta_rule_split, fused_gated_delta_rule_split,
};

/// A patterned sine of `shape` on the CPU: deterministic, non-trivial, no RNG dependency.
pub fn patterned(shape: &[usize], salt: f32, scale: f32) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| (i as f32 * 0.7311 + salt).sin() * scale)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
}

/// `(qkv, gates, state)` for the gated delta rule on the CPU: unit-scale qkv, log decays in
/// [−2, 0], β in (0, 1), a non-zero initial state.
pub fn gdr_inputs(
    b: usize,
    t: usize,
    dims: GdrDims,
    salt: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    let hv = dims.num_v_heads;
    let qkv = patterned(&[b, t, dims.channels()], salt, 1.0)?;
    let g = (patterned(&[b, t, hv, 1], salt + 1.0, 1.0)?.abs()? * -2.0)?;
    let beta = ((patterned(&[b, t, hv, 1], salt + 2.0, 3.0)?.neg()?.exp()? + 1.0)?.recip())?;
    let gates = Tensor::cat(&[g, beta], D::Minus1)?;
    let state = patterned(&[b, hv, dims.head_k_dim, dims.head_v_dim], salt + 3.0, 0.5)?;
    Ok((qkv, gates, state))
}

/// Max |a − b| (any devices, any float dtypes) with its flat index; a NaN counts as infinite.
pub fn max_diff(a: &Tensor, b: &Tensor) -> Result<(f32, usize)> {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let flat = |t: &Tensor| -> Result<Vec<f32>> {
        t.to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()
    };
    let (a, b) = (flat(a)?, flat(b)?);
    let mut worst = (0f32, 0usize);
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let d = if x.is_nan() || y.is_nan() {
            f32::INFINITY
        } else {
            (x - y).abs()
        };
        if d > worst.0 {
            worst = (d, i);
        }
    }
    Ok(worst)
}

/// Prints max |a − b| and fails beyond `tol`, naming the case and the index.
pub fn assert_close(what: &str, a: &Tensor, b: &Tensor, tol: f32) -> Result<()> {
    let (d, i) = max_diff(a, b)?;
    println!("{what}: max |Δ| = {d:.2e} at {i}");
    assert!(
        d <= tol,
        "{what}: max |Δ| = {d:e} at flat index {i} exceeds {tol:e}"
    );
    Ok(())
}

/// `a + b` summed in f32 and rounded once to their dtype (to nearest, ties to even), as PyTorch
/// adds 16-bit tensors. Not candle's `+`: on aarch64 CPUs (every Apple Silicon Mac) its NEON bf16
/// add truncates the f32 sum instead of rounding it.
fn rounded_sum(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    (a.to_dtype(DType::F32)? + b.to_dtype(DType::F32)?)?.to_dtype(a.dtype())
}

/// Shorthand for a [`GdrDims`].
pub fn dims(hk: usize, hv: usize, dk: usize, dv: usize) -> GdrDims {
    GdrDims {
        num_k_heads: hk,
        num_v_heads: hv,
        head_k_dim: dk,
        head_v_dim: dv,
    }
}

/// Runs every fused elementwise op on `dev` against its tensor-op reference on the CPU, in f32
/// and bf16, with inputs that are slices of a wider tensor (as the model passes them) and
/// contiguous ones. `check(what, got, want, tol)` compares.
pub fn check_fused_ops(
    dev: &Device,
    check: impl Fn(&str, &Tensor, &Tensor, f32) -> Result<()>,
) -> Result<()> {
    use crate::{
        add_rms_norm, attention_gate, attention_gate_join, attention_gate_ref,
        causal_conv1d_cached, causal_conv1d_cached_ref, causal_softmax, causal_softmax_ref,
        deltanet_gates, deltanet_gates_ref, gated_rms_norm, gated_rms_norm_ref, gather_cat,
        gather_rows, qk_norm_rope, qk_norm_rope_ref, rms_norm, rms_norm_ref, swiglu, swiglu_ref,
        RowIndex,
    };
    let eps = 1e-6;
    for dtype in [DType::F32, DType::BF16] {
        // f32: same math, other summation order. bf16: one rounding of O(1) values may land
        // one ulp (2^-7 relative) apart.
        let tol = if dtype == DType::F32 { 1e-5 } else { 3e-2 };
        let on = |t: Tensor| -> Result<(Tensor, Tensor)> {
            let t = t.to_dtype(dtype)?;
            Ok((t.to_device(dev)?, t))
        };
        // A merged projection [B, T, 3·64 + 2·4]: x | h | z parts and a [b | a] tail.
        let (b, t, hv, dv) = (2, 5, 4, 16);
        let (proj_d, proj) = on(patterned(&[b, t, 3 * 64 + 2 * hv], 0.2, 2.0)?)?;
        let part = |p: &Tensor, i: usize| p.narrow(D::Minus1, 64 * i, 64);
        let w1 = (patterned(&[64], 1.3, 0.3)? + 1.0)?;
        let w1_d = w1.to_device(dev)?;
        let tag = |op: &str| format!("{op} {dtype:?}");

        let got = rms_norm(&part(&proj_d, 0)?, &w1_d, eps)?;
        let want = rms_norm_ref(&part(&proj, 0)?, &w1, eps)?;
        check(&tag("rms-norm (slice)"), &got, &want, tol)?;
        // Rows longer than one vector per thread of CUDA's 1024 (f32: 4 values a vector), and a
        // weight that does not start on 16 bytes (read value by value).
        let wide = 4160;
        let (xw_d, xw) = on(patterned(&[2, wide], 0.4, 2.0)?)?;
        let ww = (patterned(&[wide + 1], 0.9, 0.3)? + 1.0)?;
        let (ww_d, ww) = (
            ww.to_device(dev)?.narrow(0, 1, wide)?,
            ww.narrow(0, 1, wide)?,
        );
        let got = rms_norm(&xw_d, &ww_d, eps)?;
        let want = rms_norm_ref(&xw, &ww, eps)?;
        check(
            &tag("rms-norm (wide rows, offset weight)"),
            &got,
            &want,
            tol,
        )?;
        // A slice one element off (no 16-byte rows: CUDA's scalar path).
        let off = |p: &Tensor| p.narrow(D::Minus1, 1, 64);
        let got = rms_norm(&off(&proj_d)?, &w1_d, eps)?;
        let want = rms_norm_ref(&off(&proj)?, &w1, eps)?;
        check(&tag("rms-norm (unaligned slice)"), &got, &want, tol)?;
        let (sum, normed) = add_rms_norm(&off(&proj_d)?, &part(&proj_d, 1)?, &w1_d, eps)?;
        let want_sum = rounded_sum(&off(&proj)?, &part(&proj, 1)?)?;
        check(&tag("add-rms-norm sum (unaligned)"), &sum, &want_sum, 0.0)?;
        let want = rms_norm_ref(&want_sum, &w1, eps)?;
        check(&tag("add-rms-norm normed (unaligned)"), &normed, &want, tol)?;
        let x = part(&proj, 0)?.contiguous()?;
        let got = rms_norm(&x.to_device(dev)?, &w1_d, eps)?;
        check(&tag("rms-norm"), &got, &rms_norm_ref(&x, &w1, eps)?, tol)?;

        let (sum, normed) = add_rms_norm(&part(&proj_d, 0)?, &part(&proj_d, 1)?, &w1_d, eps)?;
        let want_sum = rounded_sum(&part(&proj, 0)?, &part(&proj, 1)?)?;
        check(&tag("add-rms-norm sum"), &sum, &want_sum, 0.0)?;
        let want = rms_norm_ref(&want_sum, &w1, eps)?;
        check(&tag("add-rms-norm normed"), &normed, &want, tol)?;

        let (x_d, x) = on(patterned(&[b, t, hv, dv], 0.7, 1.5)?)?;
        let (w_d, w) = on(patterned(&[dv], 2.1, 1.0)?)?;
        let got = gated_rms_norm(&x_d, &part(&proj_d, 2)?, &w_d, eps)?;
        let want = gated_rms_norm_ref(&x, &part(&proj, 2)?, &w, eps)?;
        check(&tag("gated-rms-norm"), &got, &want, tol)?;
        // z one element off (CUDA's scalar path).
        let z_off = |p: &Tensor| p.narrow(D::Minus1, 129, 64);
        let got = gated_rms_norm(&x_d, &z_off(&proj_d)?, &w_d, eps)?;
        let want = gated_rms_norm_ref(&x, &z_off(&proj)?, &w, eps)?;
        check(&tag("gated-rms-norm (unaligned gate)"), &got, &want, tol)?;

        let dt_bias = patterned(&[hv], 0.5, 1.0)?;
        let neg_a = (patterned(&[hv], 0.9, 1.0)?.exp()? * -1.0)?;
        let ba = proj.narrow(D::Minus1, 3 * 64, 2 * hv)?;
        let got = deltanet_gates(
            &proj_d.narrow(D::Minus1, 3 * 64, 2 * hv)?,
            &dt_bias.to_device(dev)?,
            &neg_a.to_device(dev)?,
        )?;
        let want = deltanet_gates_ref(&ba, &dt_bias, &neg_a)?;
        // Gates are f32 from the same inputs; β is rounded to the dtype on both sides.
        check(&tag("deltanet-gates"), &got, &want, 1e-5)?;

        let (gu_d, gu) = on(patterned(&[b, t, 2 * 48], 1.9, 3.0)?)?;
        check(&tag("swiglu"), &swiglu(&gu_d)?, &swiglu_ref(&gu)?, tol)?;
        // An intermediate size of no whole 16-byte vectors (CUDA's scalar path).
        let (gu_d, gu) = on(patterned(&[b, t, 2 * 45], 1.7, 3.0)?)?;
        check(
            &tag("swiglu (odd)"),
            &swiglu(&gu_d)?,
            &swiglu_ref(&gu)?,
            tol,
        )?;

        // Attention: a [q | gate] per head projection viewed as [B, T, H, 2, hd].
        let (heads, hd, rot) = (3, 16, 8);
        let (qg_d, qg) = on(patterned(&[b, t, heads, 2, hd], 0.6, 2.0)?)?;
        let (cs_d, cs) = on(patterned(&[2, b, t, rot], 1.4, 1.0)?)?;
        let w1 = (patterned(&[hd], 0.8, 0.3)? + 1.0)?;
        let view = |x: &Tensor, i: usize| x.narrow(3, i, 1).and_then(|x| x.squeeze(3));
        let got = qk_norm_rope(&view(&qg_d, 0)?, &w1.to_device(dev)?, &cs_d, eps)?;
        let want = qk_norm_rope_ref(&view(&qg, 0)?, &w1, &cs, eps)?;
        check(&tag("qk-norm-rope"), &got, &want, tol)?;

        let (o_d, o) = on(patterned(&[b, heads, t, hd], 0.1, 1.0)?)?;
        let got = attention_gate(&o_d, &view(&qg_d, 1)?)?;
        let want = attention_gate_ref(&o, &view(&qg, 1)?)?;
        check(&tag("attention-gate"), &got, &want, tol)?;

        // The same gate on a packed batch: one state row of 5 steps, two branches of 3.
        let (n, s_steps, t_steps) = (11, 5, 3);
        let (pk_d, pk) = on(patterned(&[n, heads, 2, hd], 0.9, 2.0)?)?;
        let gates = |x: &Tensor| x.narrow(2, 1, 1).and_then(|x| x.squeeze(2));
        let (os_d, os) = on(patterned(&[1, heads, s_steps, hd], 0.5, 1.0)?)?;
        let (ob_d, ob) = on(patterned(&[2, heads, t_steps, hd], 0.7, 1.0)?)?;
        let got = attention_gate_join(&os_d, &ob_d, &gates(&pk_d)?)?;
        let gated_part = |o: &Tensor, start: usize, rows: usize, len: usize| -> Result<Tensor> {
            let g = gates(&pk.narrow(0, start, rows * len)?)?
                .contiguous()?
                .reshape((rows, len, heads, hd))?;
            attention_gate_ref(o, &g)?.reshape((rows * len, heads * hd))
        };
        let want = Tensor::cat(
            &[
                gated_part(&os, 0, 1, s_steps)?,
                gated_part(&ob, s_steps, 2, t_steps)?,
            ],
            0,
        )?;
        check(&tag("attention-gate-join"), &got, &want, tol)?;

        // Three cached keys, of which row 1's second is padding, then the t new ones.
        let s_len = t + 3;
        let (sc_d, sc) = on(patterned(&[b, heads, t, s_len], 0.3, 4.0)?)?;
        let bias: Vec<f32> = (0..b * s_len)
            .map(|i| {
                if i == s_len + 1 {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let bias = Tensor::from_vec(bias, (b, s_len), &Device::Cpu)?;
        let got = causal_softmax(&sc_d, &bias.to_device(dev)?, 0.25)?;
        let want = causal_softmax_ref(&sc, &bias, 0.25)?;
        check(&tag("causal-softmax"), &got, &want, tol)?;
        let short = bias.narrow(1, 0, s_len - 1)?.to_device(dev)?;
        if causal_softmax(&sc_d, &short, 0.25).is_ok() {
            candle_core::bail!("causal-softmax accepted a key bias shorter than the keys")
        }

        // Whole rows by index (repeats, any order) against index_select, on rows of 16-byte
        // words (the word path) and on odd-sized ones (its fallback).
        for width in [16, 3] {
            let (src_d, src) = on(patterned(&[3, 2, width], 0.6, 1.0)?)?;
            let rows = [2, 0, 0, 1, 2];
            let got = gather_rows(&src_d, &RowIndex::new(&rows, dev)?)?;
            let idx = Tensor::from_vec(rows.map(|r| r as u32).to_vec(), 5, &Device::Cpu)?;
            check(
                &tag(&format!("gather-rows {width}")),
                &got,
                &src.index_select(&idx, 0)?,
                0.0,
            )?;
        }
        let three_rows = Tensor::zeros((3, 4), DType::F32, dev)?;
        if gather_rows(&three_rows, &RowIndex::new(&[3], dev)?).is_ok() {
            candle_core::bail!("gather-rows accepted row 3 of a 3-row tensor")
        }

        // Picked rows each followed by a tail row, against index_select then cat: steps × width
        // of whole 16-byte words (the word path), then not (its fallback).
        for (steps, width) in [(4, 8), (3, 3)] {
            let (src_d, src) = on(patterned(&[3, 2, steps, width], 0.6, 1.0)?)?;
            let (tail_d, tail) = on(patterned(&[4, 2, 2, width], 1.4, 1.0)?)?;
            let rows = [2, 0, 0, 1];
            let got = gather_cat(&src_d, &RowIndex::new(&rows, dev)?, &tail_d)?;
            let idx = Tensor::from_vec(rows.map(|r| r as u32).to_vec(), 4, &Device::Cpu)?;
            let want = Tensor::cat(&[&src.index_select(&idx, 0)?, &tail], 2)?;
            check(
                &tag(&format!("gather-cat {steps}×{width}")),
                &got,
                &want,
                0.0,
            )?;
        }
        // Views packed a group to a buffer against `cat` of the views flattened: a row's first
        // keys (runs strided by the steps), whole rows, a group of another dtype, all in one
        // call; rows of whole 16-byte words (CUDA's one launch), then not (its fallback).
        for width in [8, 3] {
            let (keys_d, keys) = on(patterned(&[3, 2, 5, width], 0.3, 1.0)?)?;
            let (rows_d, rows) = on(patterned(&[3, 4, width], 0.8, 1.0)?)?;
            let groups = |k: &Tensor, r: &Tensor| -> Result<Vec<Vec<Tensor>>> {
                let state = |row: usize| -> Result<Vec<Tensor>> {
                    Ok(vec![
                        k.narrow(0, row, 1)?.narrow(2, 0, 2 + row)?,
                        r.narrow(0, row, 1)?,
                    ])
                };
                let other = r.narrow(0, 1, 2)?.to_dtype(DType::F32)?;
                Ok(vec![state(2)?, state(0)?, vec![other.clone(), other]])
            };
            let got = crate::pack(&groups(&keys_d, &rows_d)?)?;
            for (i, (got, group)) in got.iter().zip(groups(&keys, &rows)?).enumerate() {
                let flat = group
                    .iter()
                    .map(Tensor::flatten_all)
                    .collect::<Result<Vec<_>>>()?;
                let want = Tensor::cat(&flat, 0)?;
                check(&tag(&format!("pack {width}, group {i}")), got, &want, 0.0)?;
            }
        }
        let (src_d, tail_d) = (
            Tensor::zeros((3, 2, 4, 8), DType::F32, dev)?,
            Tensor::zeros((2, 2, 1, 8), DType::F32, dev)?,
        );
        if gather_cat(&src_d, &RowIndex::new(&[0, 3], dev)?, &tail_d).is_ok() {
            candle_core::bail!("gather-cat accepted row 3 of a 3-row tensor")
        }
        if gather_cat(&src_d, &RowIndex::new(&[0], dev)?, &tail_d).is_ok() {
            candle_core::bail!("gather-cat accepted 1 row for a tail of 2")
        }

        // The conv from a cache, x a slice of the projection, with and without padded rows: 64
        // aligned channels (CUDA's vector path), then 61 channels one element off (its scalar
        // path, with a last group of 5), then a row of 19 steps (three runs of a thread).
        let (long_d, long) = on(patterned(&[b, 19, 64], 1.1, 2.0)?)?;
        let unaligned = |p: &Tensor| p.narrow(D::Minus1, 65, 61);
        let cases: [(&str, Tensor, Tensor, usize); 3] = [
            ("aligned", part(&proj_d, 1)?, part(&proj, 1)?, t),
            ("unaligned", unaligned(&proj_d)?, unaligned(&proj)?, t),
            ("19 steps", long_d, long, 19),
        ];
        for (case, x_d, x, steps) in cases {
            let c = x.dim(D::Minus1)?;
            let (cache_d, cache) = on(patterned(&[b, 3, c], 2.5, 1.0)?)?;
            let (w_d, w) = on(patterned(&[c, 4], 0.9, 0.5)?)?;
            for lengths in [None, Some(&[steps, 2][..])] {
                let (y, next) = causal_conv1d_cached(&x_d, &cache_d, &w_d, lengths)?;
                let (y_ref, next_ref) = causal_conv1d_cached_ref(&x, &cache, &w, lengths)?;
                let what = format!("conv-cached {case} {lengths:?}");
                check(&tag(&format!("{what} y")), &y, &y_ref, tol)?;
                check(&tag(&format!("{what} next cache")), &next, &next_ref, 0.0)?;
            }
        }
    }
    Ok(())
}
