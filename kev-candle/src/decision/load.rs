//! Loading a Kev checkpoint into the parts a [`super::DecisionModel`] is made of: the executor
//! (backbone with its adapter folded in, pointer head), the encoder, and the checkpoint.

use std::path::Path;

use candle_core::DType;
use kev_core::{Checkpoint, Encoder, Error, LoadOptions, Result};

use crate::device::{release_freed_memory, select_device, select_dtype, settle};
use crate::executor::Executor;
use crate::head::PointerHead;
use crate::lora::Adapter;
use crate::qwen35::{Config, Model};
use crate::weights::Weights;

/// What loading yields; the model around it is assembled by the caller.
pub(super) struct Loaded {
    pub(super) executor: Executor,
    pub(super) encoder: Encoder,
    pub(super) checkpoint: Checkpoint,
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
    let checkpoint = Checkpoint::open(dir)?;
    let device = select_device(options.backend)?;
    let kernels = prepare_kernels(&device);
    let dtype = select_dtype(options.dtype, &device);
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
    let weights = Weights::open(
        &checkpoint.base.weights,
        adapter,
        options.lora_scale,
        dtype,
        device.clone(),
    )?
    .with_projection_dtype(weights_dtype);
    let model = Model::new(&cfg, &weights)?;
    weights.check_all_used()?;
    let head_cfg = &checkpoint.config.head;
    let head = PointerHead::load(
        &checkpoint.head_path,
        head_cfg.dim,
        cfg.hidden_size,
        head_cfg.temperature,
        &device,
    )?;
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
    kernels.finish()?;
    settle(&device)?;
    release_freed_memory();
    Ok(Loaded {
        executor: Executor::new(model, head, options.prefill_chunk),
        encoder,
        checkpoint,
    })
}
