//! Load options (docs/CONTRACT.md §6): backend, dtype and LoRA scale.
//!
//! These are plain values with no device behind them: `kev-core` has no tensor backend. The
//! backend crate resolves `Auto` (Metal on Apple Silicon, CUDA where built and present, else CPU;
//! f32 on CPU and bf16 on GPUs) once, where the model is loaded.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Backend {
    /// Metal on Apple Silicon, CUDA where built and present, else CPU. The default.
    #[default]
    Auto,
    /// The CPU.
    Cpu,
    /// The CUDA device with this ordinal.
    Cuda(usize),
    /// The Metal device with this ordinal.
    Metal(usize),
}

impl FromStr for Backend {
    type Err = Error;

    /// Parses `auto`, `cpu`, `cuda`, `cuda:N`, `metal`, `metal:N` (case-insensitive; no ordinal
    /// means device 0).
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.trim().to_ascii_lowercase();
        let (kind, ordinal) = match lower.split_once(':') {
            Some((k, n)) => {
                let n = n.trim().parse::<usize>().map_err(|_| {
                    Error::invalid_argument(
                        "backend",
                        format!(
                            "`{s}`: the device ordinal after `:` must be a non-negative integer"
                        ),
                    )
                })?;
                (k.trim(), Some(n))
            }
            None => (lower.as_str(), None),
        };
        match (kind, ordinal) {
            ("auto", None) => Ok(Backend::Auto),
            ("cpu", None) => Ok(Backend::Cpu),
            ("cuda", n) => Ok(Backend::Cuda(n.unwrap_or(0))),
            ("metal", n) => Ok(Backend::Metal(n.unwrap_or(0))),
            ("auto" | "cpu", Some(_)) => Err(Error::invalid_argument(
                "backend",
                format!("`{s}`: `{kind}` takes no device ordinal"),
            )),
            _ => Err(Error::invalid_argument(
                "backend",
                format!("`{s}`: expected `auto`, `cpu`, `cuda`, `cuda:N`, `metal` or `metal:N`"),
            )),
        }
    }
}

impl fmt::Display for Backend {
    /// `auto`, `cpu`, `cuda:N`, `metal:N` (parses back with [`FromStr`]).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Backend::Auto => f.write_str("auto"),
            Backend::Cpu => f.write_str("cpu"),
            Backend::Cuda(n) => write!(f, "cuda:{n}"),
            Backend::Metal(n) => write!(f, "metal:{n}"),
        }
    }
}

/// The floating-point type of the backbone weights and activations (the pointer head and the
/// DeltaNet recurrent state are always f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DType {
    /// f32 on the CPU, bf16 on GPUs. The default.
    #[default]
    Auto,
    /// 32-bit float.
    F32,
    /// bfloat16.
    BF16,
    /// IEEE half precision.
    F16,
    /// CPU only, opt-in, not exact: the projections' weights quantized to int8 at load (a scale
    /// per output feature) and multiplied with int8 dot products against activations quantized
    /// at each product (a scale per block of 32 inputs); f32 otherwise; needs x86-64 with AVX2
    /// and FMA, or AVX-512 VNNI (the same numbers).
    /// Its drift from f32 is measured, not bounded (BENCHMARKS.md).
    Int8,
    /// CUDA on Hopper (compute capability 9.0) only, opt-in, not exact: bf16, but the
    /// projections' weights (LoRA folded in f32) quantized to e4m3 in 128 × 128 blocks at load
    /// and multiplied on FP8 tensor cores against activations quantized at each product (a
    /// scale per token and block of 128 inputs). Its drift from bf16 is measured, not bounded.
    Fp8,
}

impl FromStr for DType {
    type Err = Error;

    /// Parses `auto`, `f32`, `bf16`, `f16`, `int8`, `fp8` (case-insensitive).
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(DType::Auto),
            "f32" => Ok(DType::F32),
            "bf16" => Ok(DType::BF16),
            "f16" => Ok(DType::F16),
            "int8" => Ok(DType::Int8),
            "fp8" => Ok(DType::Fp8),
            _ => Err(Error::invalid_argument(
                "dtype",
                format!("`{s}`: expected `auto`, `f32`, `bf16`, `f16`, `int8` or `fp8`"),
            )),
        }
    }
}

impl DType {
    /// `auto`, `f32`, `bf16`, `f16`, `int8`, `fp8` (parses back with [`FromStr`]).
    pub fn as_str(&self) -> &'static str {
        match self {
            DType::Auto => "auto",
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::Int8 => "int8",
            DType::Fp8 => "fp8",
        }
    }
}

impl fmt::Display for DType {
    /// [`DType::as_str`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How to load a Kev checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadOptions {
    /// Where the model runs. By default, [`Backend::Auto`].
    pub backend: Backend,
    /// Backbone dtype. By default, [`DType::Auto`].
    pub dtype: DType,
    /// LoRA interpolation (WiSE-FT, docs/CONTRACT.md §5): `W' = W + ΔW · lora_scale`, and trained token rows
    /// `(1 − s)·row + s·new_row`. 0 is the base model, 1 the adapter; any finite value is
    /// accepted. Ignored without an adapter. By default, 1.0.
    pub lora_scale: f64,
    /// Longest piece, in tokens, that one forward pass runs: longer states run piece by piece
    /// through the cache. Bounds attention's `T × S` scores (O(T²) memory in one pass) at no cost
    /// in exactness: pieces continue the cache like the next request would. Must be > 0. By
    /// default, [`DEFAULT_PREFILL_CHUNK`].
    pub prefill_chunk: usize,
    /// On CUDA, replay the prefix-form forward (`DecisionModel::forward`, `probs` and
    /// `probs_batch`) as a CUDA graph once a record or batch of the same shape comes a second
    /// time: one launch instead of about a thousand, the same kernels. A record or batch whose
    /// states and branches each fit `prefill_chunk` is shaped by its row and option counts and
    /// its widths, which are then padded to a few buckets (so its numbers may differ from an
    /// eager forward's in the last bits); otherwise by its rows' lengths too. Up to
    /// [`LoadOptions::cuda_graphs_kept`] graphs are kept, those of the shapes that come most
    /// often; rows over 2048 token positions and batches over 8192 stay eager (a graph holds
    /// its own copy of the working memory). Ignored elsewhere. By default, true.
    pub cuda_graphs: bool,
    /// How many CUDA graphs are kept at most ([`LoadOptions::cuda_graphs`]): more serve more
    /// shapes of traffic at the cost of each one's memory. By default,
    /// [`DEFAULT_CUDA_GRAPHS_KEPT`].
    pub cuda_graphs_kept: usize,
}

/// Default [`LoadOptions::cuda_graphs_kept`].
pub const DEFAULT_CUDA_GRAPHS_KEPT: usize = 8;

/// Default [`LoadOptions::prefill_chunk`]: 2048 tokens (f32 scores of one 0.8B attention layer:
/// 8 heads × 2048 × 4096 keys × 4 B = 256 MiB at a 4096-token state).
pub const DEFAULT_PREFILL_CHUNK: usize = 2048;

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            backend: Backend::Auto,
            dtype: DType::Auto,
            lora_scale: 1.0,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            cuda_graphs: true,
            cuda_graphs_kept: DEFAULT_CUDA_GRAPHS_KEPT,
        }
    }
}

impl LoadOptions {
    /// The defaults: auto backend, auto dtype, LoRA scale 1.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets [`LoadOptions::backend`].
    #[must_use]
    pub fn with_backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// Sets [`LoadOptions::dtype`].
    #[must_use]
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// Sets [`LoadOptions::lora_scale`].
    #[must_use]
    pub fn with_lora_scale(mut self, lora_scale: f64) -> Self {
        self.lora_scale = lora_scale;
        self
    }

    /// Sets [`LoadOptions::prefill_chunk`].
    #[must_use]
    pub fn with_prefill_chunk(mut self, tokens: usize) -> Self {
        self.prefill_chunk = tokens;
        self
    }

    /// Sets [`LoadOptions::cuda_graphs`].
    #[must_use]
    pub fn with_cuda_graphs(mut self, on: bool) -> Self {
        self.cuda_graphs = on;
        self
    }

    /// Sets [`LoadOptions::cuda_graphs_kept`].
    #[must_use]
    pub fn with_cuda_graphs_kept(mut self, graphs: usize) -> Self {
        self.cuda_graphs_kept = graphs;
        self
    }

    /// Checks the options: `lora_scale` must be finite and `prefill_chunk` positive
    /// ([`Error::InvalidArgument`] otherwise).
    pub fn validate(&self) -> Result<()> {
        if self.prefill_chunk == 0 {
            return Err(Error::invalid_argument(
                "prefill_chunk",
                "must be at least 1 token",
            ));
        }
        if !self.lora_scale.is_finite() {
            return Err(Error::invalid_argument(
                "lora_scale",
                format!("must be a finite number, got {}", self.lora_scale),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_parses_and_round_trips() {
        let cases = [
            ("auto", Backend::Auto),
            ("cpu", Backend::Cpu),
            ("CPU", Backend::Cpu),
            ("cuda", Backend::Cuda(0)),
            ("cuda:1", Backend::Cuda(1)),
            ("metal", Backend::Metal(0)),
            ("metal:0", Backend::Metal(0)),
        ];
        for (s, b) in cases {
            assert_eq!(s.parse::<Backend>().unwrap(), b, "{s}");
            assert_eq!(b.to_string().parse::<Backend>().unwrap(), b);
        }
        assert_eq!(Backend::Cuda(1).to_string(), "cuda:1");
    }

    #[test]
    fn backend_errors() {
        for bad in ["gpu", "cuda:x", "cuda:-1", "cpu:0", ""] {
            match bad.parse::<Backend>() {
                Err(Error::InvalidArgument { name, message }) => {
                    assert_eq!(name, "backend");
                    assert!(message.contains(&format!("`{bad}`")), "{message}");
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn dtype_parses_and_round_trips() {
        for (s, d) in [
            ("auto", DType::Auto),
            ("f32", DType::F32),
            ("bf16", DType::BF16),
            ("F16", DType::F16),
            ("int8", DType::Int8),
            ("FP8", DType::Fp8),
        ] {
            assert_eq!(s.parse::<DType>().unwrap(), d);
            assert_eq!(d.to_string().parse::<DType>().unwrap(), d);
        }
        assert!(
            matches!("f64".parse::<DType>(), Err(Error::InvalidArgument { name, .. }) if name == "dtype")
        );
    }

    #[test]
    fn load_options() {
        let o = LoadOptions::default();
        assert_eq!(o.lora_scale, 1.0);
        assert_eq!(o.backend, Backend::Auto);
        o.validate().unwrap();
        let o = o
            .with_backend(Backend::Cpu)
            .with_dtype(DType::F32)
            .with_lora_scale(0.5);
        assert_eq!(
            (o.backend, o.dtype, o.lora_scale),
            (Backend::Cpu, DType::F32, 0.5)
        );
        for bad in [f64::NAN, f64::INFINITY] {
            assert!(matches!(
                LoadOptions::new().with_lora_scale(bad).validate(),
                Err(Error::InvalidArgument { name, .. }) if name == "lora_scale"
            ));
        }
    }
}
