//! What the ops' implementations share per backend, below every op: the CPU's f32 helpers, the
//! CUDA sources, compiler and launch helpers, the Metal pipelines.

pub(crate) mod cpu;
pub(crate) mod cuda;
#[cfg(feature = "metal")]
pub(crate) mod metal;
