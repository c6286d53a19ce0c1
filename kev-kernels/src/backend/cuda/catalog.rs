// Kev's CUDA sources and the constants they share with their launchers (see sources.rs), kept
// in a file of its own so that the build script includes the same definitions to compile the
// sources ahead of time (build.rs): plain items and `std` only.

use std::sync::OnceLock;

/// Prepended to every source: the dtypes, vector loads and warp reductions.
const COMMON: &str = include_str!("common.cuh");
/// Prepended after [`COMMON`] to the sources with tensor-core kernels.
const MMA: &str = include_str!("mma.cuh");

/// The l2norm epsilon of the gated delta rule, added to Σx² (HF `l2norm`, FLA).
pub(crate) const L2NORM_EPS: f32 = 1e-6;

/// The side of an FP8 weight's scale block and the length of an activation's
/// (`crate::fp8::FP8_BLOCK`).
pub(crate) const FP8_BLOCK: usize = 128;

/// Warps per block of the recurrent delta rule.
pub(crate) const RECURRENT_WARPS: usize = 8;

/// Steps per chunk of the chunked delta rule's CUDA kernels.
pub(crate) const CHUNK: usize = 32;
/// Threads per block of its FMA (CUDA-core) kernels.
pub(crate) const FMA_THREADS: u32 = 128;
/// Threads per block of its tensor-core (`mma.sync`) kernels.
pub(crate) const MMA_THREADS: u32 = 256;
/// The largest Dk and Dv it takes, the size its tiles are padded to.
pub(crate) const MAX_DIM: usize = 128;
/// Dynamic shared memory of its preparation, scan and tensor-core preparation kernels (the
/// kernels check them against their layouts).
pub(crate) const PREPARE_SMEM: u32 = 70016;
pub(crate) const SCAN_SMEM: u32 = 77824;
pub(crate) const PREPARE_MMA_SMEM: u32 = 48512;
/// The tensor-core scans' columns per block (`NCOL`), widest first, with their entry points and
/// shared memory (`ScanTc<NCOL>::BYTES`, checked against `SCAN_MMA64_SMEM`,
/// `SCAN_MMA32_SMEM`, `SCAN_MMA16_SMEM`).
pub(crate) const SCAN_MMA: [(usize, &str, u32); 3] = [
    (64, "gdrc_scan_tc64_", 101376),
    (32, "gdrc_scan_tc_", 82944),
    (16, "gdrc_scan_tc16_", 73728),
];
/// `mode` bits of the tensor-core scans (`SCAN_*`): read the state first (else start at zero),
/// write it at the end, read each row's state from its owner's (row 0's without an owner list).
pub(crate) const SCAN_READ: i32 = 1;
pub(crate) const SCAN_WRITE: i32 = 2;
pub(crate) const SCAN_SHARED: i32 = 4;

/// Steps per thread of the cached conv.
pub(crate) const CONV_RUN: usize = 4;
/// Channels per thread of the cached conv.
pub(crate) const CONV_VEC: u32 = 8;
/// Threads per block of the cached and split convs (their launch bounds).
pub(crate) const CONV_CACHED_BLOCK: u32 = 128;

/// Warps per block of `qknorm_rope_*`, one per row.
pub(crate) const ROPE_WARPS: usize = 4;
/// The largest head size `qknorm_rope_*` takes (its shared row buffer).
pub(crate) const ROPE_MAX_HEAD_DIM: usize = 512;

/// The head size flash attention's kernel is written for.
pub const FLASH_HEAD_DIM: usize = 256;
/// Query rows per block, threads and dynamic shared memory of `flash_attn_bf16` (the kernel
/// checks the last against its tiles).
pub(crate) const FLASH_ROWS: usize = 64;
pub(crate) const FLASH_THREADS: u32 = 128;
pub(crate) const FLASH_SMEM: u32 = 101632;

/// Rows of a MoE tile: each expert's slots run in whole tiles of this many rows, padded.
pub(crate) const MOE_BM: usize = 64;
/// Columns of W per block of the tensor-core products (`_gu`: half gate, half up), the depth of
/// a stage, the stages and the threads (4 warps, each 32 rows × 64 columns).
pub(crate) const MOE_BN: usize = 128;
pub(crate) const MOE_BK: usize = 32;
pub(crate) const MOE_STAGES: usize = 3;
pub(crate) const MOE_THREADS: u32 = 128;
/// Threads of `moe_align`'s one block.
pub(crate) const MOE_ALIGN_THREADS: u32 = 1024;
/// The most routed experts and experts per token the routing kernels take (Qwen3.5's largest:
/// 512 and 10).
pub(crate) const MOE_MAX_EXPERTS: usize = 1024;
pub(crate) const MOE_MAX_K: usize = 32;

/// A constant's value as a define.
#[derive(Clone, Copy)]
pub(crate) enum Value {
    Int(i64),
    /// A float, written as a C float literal (`1e-6f`).
    Float(f32),
}

/// A CUDA source file, compiled by nvcc with the crate (build.rs) or by NVRTC on first use,
/// and loaded as its own module.
pub(crate) struct Source {
    pub(crate) file: &'static str,
    pub(crate) module: &'static str,
    pub(crate) body: &'static str,
    /// Whether it holds tensor-core kernels: `mma.cuh` is prepended, and it compiles for
    /// compute_80 where the GPU has tensor cores.
    pub(crate) tensor_cores: bool,
    pub(crate) defines: &'static [(&'static str, Value)],
    /// The machine code for the process's GPU, once compiled (`Kernel::load`).
    pub(crate) image: OnceLock<std::result::Result<Vec<u8>, String>>,
}

impl Source {
    /// The text the compiler sees: the headers, then the file.
    pub(crate) fn text(&self) -> String {
        let headers: &[&str] = if self.tensor_cores {
            &[COMMON, MMA]
        } else {
            &[COMMON]
        };
        let mut text = headers.concat();
        text.push_str(self.body);
        text
    }

    /// The `-D` options it is compiled with (nvcc and NVRTC alike).
    pub(crate) fn define_options(&self) -> Vec<String> {
        self.defines
            .iter()
            .map(|(name, value)| match value {
                Value::Int(v) => format!("-D{name}={v}"),
                Value::Float(v) => format!("-D{name}={v:e}f"),
            })
            .collect()
    }
}

const fn source(
    file: &'static str,
    module: &'static str,
    body: &'static str,
    tensor_cores: bool,
    defines: &'static [(&'static str, Value)],
) -> Source {
    Source {
        file,
        module,
        body,
        tensor_cores,
        defines,
        image: OnceLock::new(),
    }
}

pub(crate) static NORM: Source = source(
    "norm.cu",
    "kev_norm",
    include_str!("../../norm/norm.cu"),
    false,
    &[],
);

pub(crate) static GATES: Source = source(
    "gates.cu",
    "kev_gates",
    include_str!("../../gates/gates.cu"),
    false,
    &[],
);

pub(crate) static SWIGLU: Source = source(
    "swiglu.cu",
    "kev_swiglu",
    include_str!("../../swiglu/swiglu.cu"),
    false,
    &[],
);

pub(crate) static ATTENTION: Source = source(
    "attention.cu",
    "kev_attention",
    include_str!("../../attention/attention.cu"),
    false,
    &[
        ("ROPE_WARPS", Value::Int(ROPE_WARPS as i64)),
        ("ROPE_MAX_HEAD_DIM", Value::Int(ROPE_MAX_HEAD_DIM as i64)),
    ],
);

pub(crate) static FLASH_ATTENTION: Source = source(
    "flash_attention.cu",
    "kev_flash_attention",
    include_str!("../../flash_attention/flash_attention.cu"),
    true,
    &[
        ("FLASH_HEAD_DIM", Value::Int(FLASH_HEAD_DIM as i64)),
        ("FLASH_ROWS", Value::Int(FLASH_ROWS as i64)),
        ("FLASH_THREADS", Value::Int(FLASH_THREADS as i64)),
        ("FLASH_SMEM", Value::Int(FLASH_SMEM as i64)),
    ],
);

pub(crate) static CAUSAL_CONV1D: Source = source(
    "causal_conv1d.cu",
    "kev_causal_conv1d",
    include_str!("../../causal_conv1d/causal_conv1d.cu"),
    false,
    &[
        ("CONV_RUN", Value::Int(CONV_RUN as i64)),
        ("CONV_VEC", Value::Int(CONV_VEC as i64)),
        ("CONV_CACHED_BLOCK", Value::Int(CONV_CACHED_BLOCK as i64)),
    ],
);

pub(crate) static GDR_RECURRENT: Source = source(
    "recurrent.cu",
    "kev_gdr_recurrent",
    include_str!("../../gated_delta_rule/recurrent.cu"),
    false,
    &[
        ("RECURRENT_WARPS", Value::Int(RECURRENT_WARPS as i64)),
        ("L2NORM_EPS", Value::Float(L2NORM_EPS)),
    ],
);

pub(crate) static GDR_CHUNKED: Source = source(
    "chunked.cu",
    "kev_gdr_chunked",
    include_str!("../../gated_delta_rule/chunked.cu"),
    true,
    &[
        ("CHUNK", Value::Int(CHUNK as i64)),
        ("FMA_THREADS", Value::Int(FMA_THREADS as i64)),
        ("MMA_THREADS", Value::Int(MMA_THREADS as i64)),
        ("MAX_DIM", Value::Int(MAX_DIM as i64)),
        ("PREPARE_SMEM", Value::Int(PREPARE_SMEM as i64)),
        ("SCAN_SMEM", Value::Int(SCAN_SMEM as i64)),
        ("PREPARE_MMA_SMEM", Value::Int(PREPARE_MMA_SMEM as i64)),
        ("SCAN_MMA64_SMEM", Value::Int(SCAN_MMA[0].2 as i64)),
        ("SCAN_MMA32_SMEM", Value::Int(SCAN_MMA[1].2 as i64)),
        ("SCAN_MMA16_SMEM", Value::Int(SCAN_MMA[2].2 as i64)),
        ("SCAN_READ", Value::Int(SCAN_READ as i64)),
        ("SCAN_WRITE", Value::Int(SCAN_WRITE as i64)),
        ("SCAN_SHARED", Value::Int(SCAN_SHARED as i64)),
        ("L2NORM_EPS", Value::Float(L2NORM_EPS)),
    ],
);

pub(crate) static GATHER: Source = source(
    "gather.cu",
    "kev_gather",
    include_str!("../../gather/gather.cu"),
    false,
    &[],
);

pub(crate) static HEAD: Source = source(
    "head.cu",
    "kev_head",
    include_str!("../../head/head.cu"),
    false,
    &[],
);

pub(crate) static FP8: Source = source(
    "fp8.cu",
    "kev_fp8",
    include_str!("../../fp8/fp8.cu"),
    false,
    &[("FP8_BLOCK", Value::Int(FP8_BLOCK as i64))],
);

pub(crate) static LINEAR: Source = source(
    "linear.cu",
    "kev_linear",
    include_str!("../../linear/linear.cu"),
    false,
    &[],
);

pub(crate) static MOE: Source = source(
    "moe.cu",
    "kev_moe",
    concat!(
        include_str!("../../moe/moe_rows.cuh"),
        include_str!("../../moe/moe.cu")
    ),
    false,
    &[
        ("MOE_BM", Value::Int(MOE_BM as i64)),
        ("MOE_ALIGN_THREADS", Value::Int(MOE_ALIGN_THREADS as i64)),
        ("MOE_MAX_EXPERTS", Value::Int(MOE_MAX_EXPERTS as i64)),
        ("MOE_MAX_K", Value::Int(MOE_MAX_K as i64)),
    ],
);

pub(crate) static MOE_MM: Source = source(
    "moe_mm.cu",
    "kev_moe_mm",
    concat!(
        include_str!("../../moe/moe_rows.cuh"),
        include_str!("../../moe/moe_mm.cu")
    ),
    true,
    &[
        ("MOE_BM", Value::Int(MOE_BM as i64)),
        ("MOE_BN", Value::Int(MOE_BN as i64)),
        ("MOE_BK", Value::Int(MOE_BK as i64)),
        ("MOE_STAGES", Value::Int(MOE_STAGES as i64)),
        ("MOE_THREADS", Value::Int(MOE_THREADS as i64)),
    ],
);

/// Every source: the checks below, and compiling them all ahead of the first forward.
pub(crate) const ALL: [&Source; 14] = [
    &NORM,
    &GATES,
    &SWIGLU,
    &ATTENTION,
    &FLASH_ATTENTION,
    &CAUSAL_CONV1D,
    &GDR_RECURRENT,
    &GDR_CHUNKED,
    &GATHER,
    &HEAD,
    &FP8,
    &LINEAR,
    &MOE,
    &MOE_MM,
];

