//! Loading a Kev checkpoint into the parts a [`super::DecisionModel`] is made of: the executor
//! (backbone with its adapter folded in, pointer head), the encoder, and the checkpoint.

use std::path::Path;
use std::time::Instant;

use candle_core::DType;
use kev_core::{Checkpoint, Encoder, Error, LoadOptions, Result};

use crate::device::{release_freed_memory, select_device, select_dtype, settle};
use crate::executor::Executor;
use crate::head::PointerHead;
use crate::identity::{Fingerprint, ModelId};
use crate::lora::Adapter;
use crate::qwen35::{Config, Model};
use crate::weights::{Quantization, StepSeconds, Weights};

/// What loading yields; the model around it is assembled by the caller.
pub(super) struct Loaded {
    pub(super) executor: Executor,
    pub(super) encoder: Encoder,
    pub(super) checkpoint: Checkpoint,
    pub(super) breakdown: LoadBreakdown,
    pub(super) id: ModelId,
}

/// Where a load's time went ([`super::DecisionModel::load_breakdown`]), in seconds of wall-clock
/// time for the parts done one after the other, and summed over threads for the steps of
/// reading the weights, which the decoder layers run in parallel.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct LoadBreakdown {
    /// The whole load.
    pub total_s: f64,
    /// Resolving `kev.json` and the files it names.
    pub checkpoint_s: f64,
    /// Opening the device (on CUDA, creating its context).
    pub device_s: f64,
    /// Reading the base config, and reading and checking the adapter.
    pub adapter_s: f64,
    /// Checking the safetensors headers and mapping the base files.
    pub open_weights_s: f64,
    /// Building the backbone: reading, folding, converting and uploading every weight, and
    /// laying the weights out for the backend (concatenations, packing).
    pub backbone_s: f64,
    /// The steps of reading the weights within `backbone_s`, summed over threads.
    pub weight_steps_cpu_s: StepSeconds,
    /// Checking that every tensor and adapter module was used.
    pub check_s: f64,
    /// Loading the pointer head.
    pub head_s: f64,
    /// Loading the tokenizer and checking its ids against the embeddings.
    pub tokenizer_s: f64,
    /// Waiting for the GPU's kernels, compiled and loaded beside the weights (CUDA).
    pub kernels_wait_s: f64,
    /// Compiling Kev's CUDA sources with NVRTC for this load, summed over the sources compiled
    /// in parallel: 0 on a GPU the build carried machine code for (`kev-kernels/build.rs`), and
    /// for a later load in the same process.
    pub kernels_compile_cpu_s: f64,
    /// Loading their machine code into the driver for this load, summed over the sources.
    pub kernels_load_cpu_s: f64,
    /// Waiting for the device's queued work and handing freed memory back.
    pub settle_s: f64,
}

/// Wall-clock seconds since `started`, restarting it.
fn lap(started: &mut Instant) -> f64 {
    let now = Instant::now();
    let seconds = now.duration_since(*started).as_secs_f64();
    *started = now;
    seconds
}

/// The GPU's kernels being compiled and loaded beside the weights (CUDA), so that the first
/// forward finds them ready.
struct Kernels(#[cfg(feature = "cuda")] Option<std::thread::JoinHandle<candle_core::Result<()>>>);

fn prepare_kernels(device: &candle_core::Device) -> Kernels {
    #[cfg(feature = "cuda")]
    {
        Kernels(device.as_cuda_device().ok().map(|dev| {
            let dev = dev.clone();
            std::thread::spawn(move || kev_kernels::prepare_kernels(&dev))
        }))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        Kernels()
    }
}

impl Kernels {
    /// Waits for the kernels; their failure is the load's.
    fn finish(self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(handle) = self.0 {
            let done = handle
                .join()
                .unwrap_or_else(|_| Err(candle_core::Error::Msg("panicked".into())));
            done.map_err(|e| Error::backend("compiling and loading the GPU kernels", e))?;
        }
        Ok(())
    }
}

/// Loads the checkpoint in `dir` (a folder with `kev.json`) as `options` say.
pub(super) fn load(dir: &Path, options: &LoadOptions) -> Result<Loaded> {
    options.validate()?;
    let load_started = Instant::now();
    let mut clock = load_started;
    let mut breakdown = LoadBreakdown::default();
    let checkpoint = Checkpoint::open(dir)?;
    breakdown.checkpoint_s = lap(&mut clock);
    let device = select_device(options.backend)?;
    breakdown.device_s = lap(&mut clock);
    #[cfg(feature = "cuda")]
    let kernel_seconds_before = kev_kernels::kernel_seconds();
    let kernels = prepare_kernels(&device);
    let dtype = select_dtype(options.dtype, &device);
    // The `int8` dtype: f32 weights (the LoRA folded) quantized once, f32 activations.
    let int8 = options.dtype == kev_core::DType::Int8;
    if int8 && kev_kernels::dispatch::backend(&device) != kev_kernels::dispatch::Backend::Cpu {
        return Err(Error::invalid_argument(
            "dtype",
            format!("`int8` runs on the CPU only, not on {device:?}"),
        ));
    }
    if int8 && !kev_kernels::int8_gemm_available() {
        return Err(Error::invalid_argument(
            "dtype",
            "`int8` needs an x86-64 CPU with AVX2 and FMA (or AVX-512 VNNI), which this one lacks"
                .to_string(),
        ));
    }
    // The `fp8` dtype: bf16, the projections' f32 weights (the LoRA folded) quantized once to
    // e4m3 for FP8 products.
    let fp8 = options.dtype == kev_core::DType::Fp8;
    if fp8 && !kev_kernels::fp8_available(&device) {
        return Err(Error::invalid_argument(
            "dtype",
            format!(
                "`fp8` runs on a CUDA GPU of compute capability 9.0 (H100, H200) only, not on {device:?}"
            ),
        ));
    }
    let quantization = if int8 {
        Quantization::Int8
    } else if fp8 {
        kev_kernels::fp8_check(&device).map_err(|e| {
            Error::invalid_argument(
                "dtype",
                format!("`fp8`: this GPU's cuBLASLt cannot run FP8 products ({e})"),
            )
        })?;
        Quantization::Fp8
    } else {
        Quantization::None
    };
    // The CPU's bf16 mode where it has AVX512-BF16: the projections and the embedding table
    // in bf16, the activations in f32 between the matmuls (as llama.cpp's bf16 models),
    // since its bf16 matmul takes f32 rows and the rest of the forward is faster in f32.
    let (dtype, weights_dtype) = if kev_kernels::dispatch::backend(&device)
        == kev_kernels::dispatch::Backend::Cpu
        && dtype == DType::BF16
        && kev_kernels::bf16_gemm_available()
    {
        (DType::F32, DType::BF16)
    } else {
        (dtype, dtype)
    };
    let cfg = Config::from_file(&checkpoint.base.config)?;
    let adapter = match (
        checkpoint.adapter_config_path(),
        checkpoint.adapter_weights_path(),
    ) {
        (Some(c), Some(w)) => Some(Adapter::load(&c, &w)?),
        _ => None,
    };
    breakdown.adapter_s = lap(&mut clock);
    let weights = Weights::open(
        &checkpoint.base.weights,
        adapter,
        options.lora_scale,
        dtype,
        device.clone(),
    )?
    .with_projection_dtype(weights_dtype)
    .with_quantization(quantization)
    .with_fp8_block(cfg.fp8_block);
    breakdown.open_weights_s = lap(&mut clock);
    let model = Model::new(&cfg, &weights)?;
    breakdown.backbone_s = lap(&mut clock);
    breakdown.weight_steps_cpu_s = weights.step_seconds();
    weights.check_all_used()?;
    drop(weights);
    breakdown.check_s = lap(&mut clock);
    let head_cfg = &checkpoint.config.head;
    let head = PointerHead::load(
        &checkpoint.head_path,
        head_cfg.dim,
        cfg.hidden_size,
        head_cfg.temperature,
        &device,
    )?;
    breakdown.head_s = lap(&mut clock);
    let encoder = checkpoint.encoder()?;
    // Every id the tokenizer can produce needs an embedding row; checked here, not when a
    // record first meets the token.
    let max_id = encoder.max_token_id() as usize;
    if max_id >= cfg.vocab_size {
        return Err(Error::Tokenizer {
            path: Some(encoder.tokenizer_path().to_path_buf()),
            message: format!(
                "token id {max_id} has no embedding: the model's `vocab_size` is {} (`{}`)",
                cfg.vocab_size,
                checkpoint.base.config.display()
            ),
        });
    }
    breakdown.tokenizer_s = lap(&mut clock);
    kernels.finish()?;
    breakdown.kernels_wait_s = lap(&mut clock);
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        // The process's totals grow only by what this load compiled and loaded: a module is
        // compiled and loaded once per process and device.
        let (compile, load) = kev_kernels::kernel_seconds();
        breakdown.kernels_compile_cpu_s = compile - kernel_seconds_before.0;
        breakdown.kernels_load_cpu_s = load - kernel_seconds_before.1;
    }
    settle(&device)?;
    release_freed_memory();
    breakdown.settle_s = lap(&mut clock);
    let id = Fingerprint {
        checkpoint: &checkpoint,
        options,
        weights_dtype,
        activation_dtype: dtype,
        device: &device,
    }
    .id();
    breakdown.total_s = load_started.elapsed().as_secs_f64();
    Ok(Loaded {
        id,
        executor: Executor::new(
            model,
            head,
            options.prefill_chunk,
            if options.cuda_graphs {
                options.cuda_graphs_kept
            } else {
                0
            },
        ),
        encoder,
        checkpoint,
        breakdown,
    })
}
