//! SwiGLU with plain tensor ops: the test reference.

use candle_core::{DType, Result, Tensor, D};

/// [`swiglu`](super::swiglu) with plain tensor ops (the test reference).
pub fn swiglu_ref(gate_up: &Tensor) -> Result<Tensor> {
    let inter = gate_up.dim(D::Minus1)? / 2;
    let gate = gate_up.narrow(D::Minus1, 0, inter)?;
    let up = gate_up.narrow(D::Minus1, inter, inter)?;
    let g = gate.to_dtype(DType::F32)?;
    let silu = (&g / (g.neg()?.exp()? + 1.0)?)?.to_dtype(gate.dtype())?;
    if gate.device().is_cpu() && gate.dtype() != DType::F32 {
        // The product in f32, rounded once to nearest (PyTorch's 16-bit multiply): candle's CPU
        // bf16 `*` truncates instead on aarch64 (its NEON kernel; every Apple Silicon Mac).
        return (silu.to_dtype(DType::F32)? * up.to_dtype(DType::F32)?)?.to_dtype(gate.dtype());
    }
    silu * up
}
