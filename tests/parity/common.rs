//! Shared helpers for the parity tests: fixture paths, the tolerance table, and one comparison
//! that reports max |Δ| with its index.
#![allow(dead_code)]

use std::path::PathBuf;

use candle_core::{DType, Result, Tensor};

/// f32 backbone vs transformers f32, unit-scale hidden states (|h| up to ~10 here): different
/// summation orders and the chunked (HF) vs recurrent (ours) delta rule give ~1e-6 relative;
/// 1e-4 absolute is the ceiling the issue names, and what we measure is far below it.
pub const TOL_HIDDEN_F32: f32 = 1e-4;
/// f32 probabilities vs the reference: docs/CONTRACT.md §7 parity target.
pub const TOL_PROBS_F32: f32 = 1e-5;
/// f32 prefix form vs row form, batched vs one by one: the same math with other batch shapes,
/// so other GEMM blockings and attention sums. Logits reach ~12 here, so f32 rounding of ~1e-6
/// relative gives ~1e-5 on a logit and a few 1e-6 on a probability (measured up to 4e-6).
pub const TOL_FORMS_F32: f32 = 1e-5;

/// `tests/fixtures/<rel>`: from the source tree, or relative to the working directory when the
/// test binary runs elsewhere (a GPU machine with a copy of the repository).
pub fn fixture(rel: &str) -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let root = if built.is_dir() {
        built
    } else {
        PathBuf::from("tests/fixtures")
    };
    root.join(rel)
}

/// The backend under test: `KEV_TEST_BACKEND` = `cpu` (default), `cuda[:i]` or `metal[:i]`.
pub fn backend() -> kev::Backend {
    match std::env::var("KEV_TEST_BACKEND") {
        Ok(b) => b
            .parse()
            .expect("KEV_TEST_BACKEND: cpu, cuda[:i] or metal[:i]"),
        Err(_) => kev::Backend::Cpu,
    }
}

/// The candle device of [`backend`].
pub fn device() -> candle_core::Device {
    kev_candle::device::select_device(backend()).expect("the test backend is available")
}

/// Max |a − b| and max |a − b| / (|b| + 1e-3), with the flat index of the worst absolute error.
pub struct Diff {
    pub max_abs: f32,
    pub max_rel: f32,
    pub index: usize,
    pub ours: f32,
    pub reference: f32,
}

pub fn diff(ours: &Tensor, reference: &Tensor) -> Result<Diff> {
    assert_eq!(ours.dims(), reference.dims(), "shapes differ");
    let a = ours.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let b = reference
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let mut d = Diff {
        max_abs: 0.0,
        max_rel: 0.0,
        index: 0,
        ours: 0.0,
        reference: 0.0,
    };
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let abs = if x.is_nan() || y.is_nan() {
            f32::INFINITY
        } else {
            (x - y).abs()
        };
        if abs > d.max_abs || (i == 0 && abs.is_infinite()) {
            d = Diff {
                max_abs: abs,
                index: i,
                ours: *x,
                reference: *y,
                ..d
            };
        }
        d.max_rel = d.max_rel.max(abs / (y.abs() + 1e-3));
    }
    Ok(d)
}

/// Prints the figures and fails beyond `tol`.
pub fn check(what: &str, ours: &Tensor, reference: &Tensor, tol: f32) -> Result<Diff> {
    let (ours, reference) = (
        &ours.to_device(&candle_core::Device::Cpu)?,
        &reference.to_device(&candle_core::Device::Cpu)?,
    );
    let d = diff(ours, reference)?;
    println!(
        "{what:<40} max|Δ| {:.2e}  max rel {:.2e}",
        d.max_abs, d.max_rel
    );
    assert!(
        d.max_abs <= tol,
        "{what}: max |Δ| = {:e} at flat index {} (ours {}, reference {}) exceeds {tol:e}",
        d.max_abs,
        d.index,
        d.ours,
        d.reference
    );
    Ok(d)
}
