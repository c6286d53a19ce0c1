//! How fast a weight is quantized to FP8 on the CPU (the `fp8` dtype's load step): one
//! `[rows, cols]` f32 weight, the 27B's MLP shape by default, timed over `--repeats` runs.
//!
//!     cargo run --release -p kev-kernels --example fp8_quantize -- [rows cols repeats]

use std::time::Instant;

use candle_core::{Device, Tensor};
use kev_kernels::Fp8Weight;

fn main() -> candle_core::Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("rows cols repeats: numbers"))
        .collect();
    let (rows, cols, repeats) = match args[..] {
        [r, c, n] => (r, c, n),
        _ => (17408, 5120, 3),
    };
    let w = Tensor::randn(0f32, 0.02, (rows, cols), &Device::Cpu)?;
    let mut best = f64::MAX;
    for _ in 0..repeats {
        let started = Instant::now();
        let q = Fp8Weight::quantize(&w, &Device::Cpu)?;
        best = best.min(started.elapsed().as_secs_f64());
        assert_eq!(q.dims(), (rows, cols));
    }
    let elements = (rows * cols) as f64;
    println!(
        "{{\"rows\": {rows}, \"cols\": {cols}, \"threads\": {}, \"best_s\": {best:.4}, \"m_elements_per_s\": {:.1}}}",
        rayon::current_num_threads(),
        elements / best / 1e6
    );
    Ok(())
}
