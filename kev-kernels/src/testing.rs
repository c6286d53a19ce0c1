//! Deterministic inputs and one comparison, shared by the op tests of every backend
//! (kev-kernels/tests, the workspace parity suite). Not part of the API.

use candle_core::{DType, Device, Result, Tensor, D};

use crate::GdrDims;

/// A patterned sine of `shape` on the CPU: deterministic, non-trivial, no RNG dependency.
pub fn patterned(shape: &[usize], salt: f32, scale: f32) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| (i as f32 * 0.7311 + salt).sin() * scale)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
}

/// `(qkv, gb, state)` for the gated delta rule on the CPU: unit-scale qkv, log decays in
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
    let gb = Tensor::cat(&[g, beta], D::Minus1)?;
    let state = patterned(&[b, hv, dims.head_k_dim, dims.head_v_dim], salt + 3.0, 0.5)?;
    Ok((qkv, gb, state))
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

/// Shorthand for a [`GdrDims`].
pub fn dims(hk: usize, hv: usize, dk: usize, dv: usize) -> GdrDims {
    GdrDims {
        num_k_heads: hk,
        num_v_heads: hv,
        head_k_dim: dk,
        head_v_dim: dv,
    }
}
