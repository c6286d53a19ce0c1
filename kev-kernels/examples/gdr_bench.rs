//! Times the forms of the gated delta rule on the 0.8B / 4B DeltaNet shapes, to choose where the
//! dispatch switches between them: the step-by-step kernel, the chunked kernels (CUDA, Metal) and
//! the chunked tensor-op composition (`gated_delta_rule_chunked`).
//!
//! ```sh
//! cargo run --release -p kev-kernels --features cuda --example gdr_bench    # on a CUDA machine
//! cargo run --release -p kev-kernels --features metal --example gdr_bench   # on a Mac
//! ```
//! Prints one line per (batch, steps, shape): median milliseconds per call of each form, and the
//! largest difference of the chunked kernels' output and state from the step-by-step ones.

use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor};
use kev_kernels::testing::{dims, gdr_inputs};
use kev_kernels::{gated_delta_rule_as, gated_delta_rule_chunked, GdrDims, GdrForm};

fn median_ms(dev: &Device, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    dev.synchronize()?;
    let mut times = Vec::new();
    for _ in 0..9 {
        let start = Instant::now();
        f()?;
        dev.synchronize()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn main() -> Result<()> {
    let dev = if candle_core::utils::cuda_is_available() {
        Device::new_cuda(0)?
    } else if candle_core::utils::metal_is_available() {
        Device::new_metal(0)?
    } else {
        Device::Cpu
    };
    // As Kev's models do; `KEV_POOL_RELEASE=1` leaves the driver's default (memory handed back
    // at every synchronisation), to see what that costs.
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = &dev {
        if std::env::var("KEV_POOL_RELEASE").as_deref() != Ok("1") {
            kev_kernels::keep_device_memory(d)?;
        }
    }
    let shapes: [(&str, GdrDims); 2] = [
        ("0.8b", dims(16, 16, 128, 128)),
        ("4b", dims(16, 32, 128, 128)),
    ];
    println!("device {dev:?}");
    // The host cost of one small launch (a launch-bound forward pays it per op).
    let x = Tensor::ones((1, 1024), DType::BF16, &dev)?;
    let per_op = median_ms(&dev, || {
        let mut y = x.clone();
        for _ in 0..100 {
            y = (&y + &x)?;
        }
        Ok(())
    })? / 100.0;
    let w1 = Tensor::ones(1024, DType::F32, &dev)?;
    let per_norm = median_ms(&dev, || {
        for _ in 0..100 {
            kev_kernels::rms_norm(&x, &w1, 1e-6)?;
        }
        Ok(())
    })? / 100.0;
    let per_upload = median_ms(&dev, || {
        for i in 0..100u32 {
            Tensor::from_vec(vec![i; 16], 16, &dev)?;
        }
        Ok(())
    })? / 100.0;
    println!(
        "per call: candle add {:.1} us, rms_norm {:.1} us, 16-element upload {:.1} us",
        per_op * 1e3,
        per_norm * 1e3,
        per_upload * 1e3
    );
    let max_diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
        (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()
    };
    // Without a GPU only the step-by-step kernel runs (the CPU has no chunked kernels; the
    // tensor-op form is far slower there), on the one-request shapes.
    let cases: &[(usize, usize)] = if dev.is_cpu() {
        &[(4, 48), (1, 512)]
    } else if dev.is_metal() {
        // Around METAL_CHUNKED_MIN_LEN (an estimate until these times set it), then prefills.
        &[
            (1, 16),
            (1, 32),
            (1, 64),
            (1, 128),
            (4, 48),
            (8, 512),
            (1, 4096),
        ]
    } else {
        &[(4, 48), (32, 48), (1, 512), (8, 512), (1, 4096), (1, 8192)]
    };
    for (name, d) in shapes {
        for &(b, t) in cases {
            let (qkv, gates, state) = gdr_inputs(b, t, d, 0.3)?;
            // bf16 on a GPU; f32 on the CPU, as Kev's CPU models run.
            let dtype = if dev.is_cpu() {
                DType::F32
            } else {
                DType::BF16
            };
            let qkv = qkv.to_dtype(dtype)?.to_device(&dev)?;
            let (gates, state) = (gates.to_device(&dev)?, state.to_device(&dev)?);
            let rec = median_ms(&dev, || {
                gated_delta_rule_as(&qkv, &gates, &state, d, None, GdrForm::Recurrent).map(|_| ())
            })?;
            if dev.is_cpu() {
                println!("{name} b={b:<2} t={t:<4} recurrent {rec:8.3} ms");
                continue;
            }
            let fused = median_ms(&dev, || {
                gated_delta_rule_as(&qkv, &gates, &state, d, None, GdrForm::Chunked).map(|_| ())
            })?;
            let ops = median_ms(&dev, || {
                gated_delta_rule_chunked(&qkv, &gates, &state, d, None).map(|_| ())
            })?;
            let (s_rec, s_fused) = (state.copy()?, state.copy()?);
            let a = gated_delta_rule_as(&qkv, &gates, &s_rec, d, None, GdrForm::Recurrent)?;
            let c = gated_delta_rule_as(&qkv, &gates, &s_fused, d, None, GdrForm::Chunked)?;
            println!(
                "{name} b={b:<2} t={t:<4} recurrent {rec:8.3} ms  chunked kernels {fused:8.3} ms  \
                 chunked tensor ops {ops:8.3} ms  max|Δ| out {:.1e} state {:.1e}",
                max_diff(&a, &c)?,
                max_diff(&s_rec, &s_fused)?
            );
        }
    }
    Ok(())
}
