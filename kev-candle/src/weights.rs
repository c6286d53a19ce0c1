//! Reading the base weights: mmap'd safetensors (one file or shards), either checkpoint layout,
//! LoRA folded in at load, converted once to the backbone dtype and moved to the device.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use kev_core::{Error, Result};
use safetensors::tensor::TensorView;

use crate::lora::{Adapter, StoredValues};
use crate::safetensors_header::check_header;

/// Prefixes of the text model in the published multimodal layout and the text-only layout.
const LAYOUTS: [&str; 2] = ["model.language_model.", "model."];

/// How the projections' weights are held once loaded, their LoRA folded in f32 first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantization {
    /// In the projection dtype ([`Weights::projection_dtype`]).
    None,
    /// int8, a scale per output feature, on the CPU (the `int8` dtype,
    /// [`kev_kernels::PackedInt8`]).
    Int8,
    /// e4m3 in 128 × 128 blocks, on a Hopper GPU (the `fp8` dtype, [`kev_kernels::Fp8Weight`]).
    Fp8,
}

/// The base checkpoint's tensors with an optional adapter to fold in.
pub struct Weights {
    files: Vec<PathBuf>,
    st: MmapedSafetensors,
    prefix: &'static str,
    adapter: Option<Adapter>,
    lora_scale: f64,
    dtype: DType,
    /// The dtype of the projections' weights and the embedding table (`dtype` unless set).
    projections: DType,
    /// How the projections are quantized at load.
    quantization: Quantization,
    /// FP8 weights' block (rows, columns), where the config gives one.
    fp8_block: Option<(usize, usize)>,
    device: Device,
    /// Text-model tensors read so far (full names), for [`Weights::check_all_used`].
    used: Mutex<BTreeSet<String>>,
    /// Time spent in each step of [`Weights::get_as`], summed over the threads that call it.
    times: StepTimes,
}

/// Nanoseconds spent in each step of [`Weights::get_as`], summed over threads: the steps run on
/// several threads at once, so the sums may exceed the load's wall-clock time.
#[derive(Default)]
struct StepTimes {
    read: AtomicU64,
    fold: AtomicU64,
    convert: AtomicU64,
    upload: AtomicU64,
}

/// Seconds spent in each step of reading the base weights ([`Weights::step_seconds`]), summed
/// over the threads that read them.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct StepSeconds {
    /// Copying stored tensors out of the mapped files (those not read where they lie).
    pub read: f64,
    /// Folding the adapter in (`B·A` and the pass over the weight, rounding included).
    pub fold: f64,
    /// Converting the tensors that were copied out to their dtype.
    pub convert: f64,
    /// Moving the tensors to the device (those uploaded straight from the map included).
    pub upload: f64,
}

impl StepTimes {
    /// Runs `step`, adding its time to `counter`.
    fn time<T>(counter: &AtomicU64, step: impl FnOnce() -> T) -> T {
        let started = Instant::now();
        let out = step();
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        counter.fetch_add(nanos, Ordering::Relaxed);
        out
    }
}

impl Weights {
    /// Maps the safetensors `files`, detects the layout, and checks that every adapter target
    /// exists in the base.
    pub fn open(
        files: &[PathBuf],
        adapter: Option<Adapter>,
        lora_scale: f64,
        dtype: DType,
        device: Device,
    ) -> Result<Self> {
        // SAFETY: the files are mapped read-only; like every mmap-based loader, we rely on them not
        // being truncated while the model is loading (weights are copied out during `get`).
        refuse_repeated_tensors(files)?;
        let st = unsafe { MmapedSafetensors::multi(files) }
            .map_err(|e| Error::backend(format!("reading safetensors {}", list(files)), e))?;
        let names: Vec<String> = st.tensors().into_iter().map(|(n, _)| n).collect();
        let prefix = LAYOUTS
            .into_iter()
            .find(|p| names.iter().any(|n| n.starts_with(p) && n.ends_with("embed_tokens.weight")))
            .ok_or_else(|| {
                // mlx-lm conversions rename the tree and fold +1 into the zero-centred norms.
                let mlx = names.iter().any(|n| n.starts_with("language_model.model."));
                Error::Tensor {
                    name: "model.language_model.embed_tokens.weight".into(),
                    message: if mlx {
                        format!("{} is an mlx-community conversion (norm weights with +1 folded in), not the Hugging Face format: use the original checkpoint", list(files))
                    } else {
                        format!("not found in {} (nor `model.embed_tokens.weight`): not a Qwen3.5 checkpoint", list(files))
                    },
                }
            })?;
        let weights = Self {
            files: files.to_vec(),
            st,
            prefix,
            adapter,
            lora_scale,
            dtype,
            projections: dtype,
            quantization: Quantization::None,
            fp8_block: None,
            device,
            used: Mutex::default(),
            times: StepTimes::default(),
        };
        if let Some(adapter) = &weights.adapter {
            let missing = adapter
                .targets()
                .filter(|t| {
                    t.iter()
                        .all(|n| weights.st.get(&format!("{prefix}{n}")).is_err())
                })
                .map(|t| Error::Tensor {
                    name: t[0].clone(),
                    message: format!(
                        "adapter `{}` modifies a weight the base does not have",
                        adapter.path().display()
                    ),
                })
                .collect();
            Error::from_all(missing)?;
        }
        Ok(weights)
    }

    /// The backbone dtype weights are converted to.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Keeps the projections' weights and the embedding table in `dtype` instead of the
    /// backbone's (the CPU's bf16 mode: bf16 weights, f32 activations).
    pub fn with_projection_dtype(mut self, dtype: DType) -> Self {
        self.projections = dtype;
        self
    }

    /// Quantizes the projections once loaded (the `int8` and `fp8` dtypes).
    pub fn with_quantization(mut self, quantization: Quantization) -> Self {
        self.quantization = quantization;
        self
    }

    /// How the projections are quantized once loaded.
    pub fn quantization(&self) -> Quantization {
        self.quantization
    }

    /// Reads FP8 weights' block scales as one per `block` (rows, columns): the config's
    /// `weight_block_size` ([`crate::qwen35::Config::fp8_block`]).
    pub fn with_fp8_block(mut self, block: Option<(usize, usize)>) -> Self {
        self.fp8_block = block;
        self
    }

    /// The dtype of the projections' weights and the embedding table.
    pub fn projection_dtype(&self) -> DType {
        self.projections
    }

    /// The device weights are moved to.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether the checkpoint holds text-model tensor `name` (for weights stored in either of
    /// two layouts).
    pub fn contains(&self, name: &str) -> bool {
        self.st.get(&format!("{}{name}", self.prefix)).is_ok()
    }

    /// Text-model tensor `name` (e.g. `layers.0.mlp.up_proj.weight`) with `shape`, adapter folded
    /// in (f32, CPU), rounded once to the backbone dtype, on the device.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.get_as(name, shape, self.dtype)
    }

    /// Like [`Weights::get`] but in `dtype` (for the few tensors kept in f32).
    ///
    /// Where it can, a tensor goes from the mapped file to the device without a host copy first:
    /// a LoRA fold reads the stored values where they lie, and a tensor stored in `dtype` that
    /// the adapter leaves alone is uploaded straight from the map. Either gives the bits of the
    /// copy-then-convert path below, which every other tensor takes.
    pub fn get_as(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        self.get_on(name, shape, dtype, &self.device)
    }

    /// [`Weights::get_as`] on `device` rather than the model's (the CPU, for a weight quantized
    /// there before it moves).
    pub fn get_on(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let times = &self.times;
        let full = self.mark_used(name);
        let view = self.st.get(&full).map_err(|_| self.missing(&full))?;
        if view.shape() != shape {
            return Err(Error::Tensor {
                name: full,
                message: format!("expected shape {shape:?}, found {:?}", view.shape()),
            });
        }
        let touched = self.adapter.as_ref().filter(|a| a.touches(name));
        if view.dtype() == safetensors::Dtype::F8_E4M3 {
            let stored = StepTimes::time(&times.read, || self.dequantized(name, &full, shape))?;
            return self.finish(name, stored, touched, dtype, device);
        }
        if let (Some(adapter), Some(values)) = (touched, stored_values(&view)) {
            let folded = StepTimes::time(&times.fold, || {
                adapter.fold_values(name, values, shape, self.lora_scale, dtype)
            })?;
            if let Some(folded) = folded {
                let w = folded.map_err(|bad| self.unfit(name, bad, dtype))?;
                return StepTimes::time(&times.upload, || w.to_device(device))
                    .map_err(|e| self.err(name, e));
            }
        }
        if touched.is_none() && stored_dtype(&view) == Some(dtype) {
            return StepTimes::time(&times.upload, || {
                Tensor::from_raw_buffer(view.data(), dtype, shape, device)
            })
            .map_err(|e| self.err(name, e));
        }
        let stored = StepTimes::time(&times.read, || self.st.load(&full, &Device::Cpu))
            .map_err(|_| self.missing(&full))?;
        self.finish(name, stored, touched, dtype, device)
    }

    /// `stored` (on the CPU) with the adapter folded in where it touches `name`, in `dtype`, on
    /// `device`. Only tensors the adapter changes are folded (in f32, rounded once to
    /// `dtype`); the others go straight to their dtype (the same values: bf16 → f32 is exact,
    /// f32 → bf16 rounds once).
    fn finish(
        &self,
        name: &str,
        stored: Tensor,
        touched: Option<&Adapter>,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let times = &self.times;
        let w = match touched {
            Some(adapter) => {
                let folded = StepTimes::time(&times.fold, || {
                    adapter.fold(name, &stored, self.lora_scale, dtype)
                })?;
                folded.map_err(|bad| self.unfit(name, bad, dtype))?
            }
            None => stored,
        };
        let w =
            StepTimes::time(&times.convert, || w.to_dtype(dtype)).map_err(|e| self.err(name, e))?;
        StepTimes::time(&times.upload, || w.to_device(device)).map_err(|e| self.err(name, e))
    }

    /// An FP8 weight (e4m3, `full`) dequantized to f32 on the CPU with its block scales
    /// `{name}_scale_inv` (f32, bf16 or f16; one per block of each trailing matrix, a last block
    /// of a side that is not a whole number of blocks included), as Qwen's FP8 releases store
    /// them: element (r, c) times the scale of block (r / bm, c / bn). The block is the config's
    /// `weight_block_size`, which the grid must fit; without one it is read from the grid, whose
    /// blocks must then tile the matrix whole (as transformers reads it).
    fn dequantized(&self, name: &str, full: &str, shape: &[usize]) -> Result<Tensor> {
        let scale_name = format!("{name}_scale_inv");
        let scale_full = self.mark_used(&scale_name);
        if shape.len() < 2 {
            return Err(Error::Tensor {
                name: full.to_string(),
                message: format!("stored in FP8, which only a matrix may be (shape {shape:?})"),
            });
        }
        let scales = self
            .st
            .load(&scale_full, &Device::Cpu)
            .map_err(|_| Error::Tensor {
                name: full.to_string(),
                message: format!("stored in FP8 without its block scales `{scale_full}`"),
            })?;
        let scale_fault = |message: String| Error::Tensor {
            name: scale_full.clone(),
            message,
        };
        if !matches!(scales.dtype(), DType::F32 | DType::BF16 | DType::F16) {
            let dtype = scales.dtype();
            return Err(scale_fault(format!(
                "block scales in {dtype:?}: only f32, bf16 or f16 are read"
            )));
        }
        let (lead, [rows, cols]) = (
            &shape[..shape.len() - 2],
            [shape[shape.len() - 2], shape[shape.len() - 1]],
        );
        let grid = scales.dims();
        let (sr, sc) = match grid {
            [g_lead @ .., sr, sc] if g_lead == lead && *sr > 0 && *sc > 0 => (*sr, *sc),
            _ => {
                return Err(scale_fault(format!(
                    "block scales of shape {grid:?} for the FP8 weight {shape:?}"
                )))
            }
        };
        let (bm, bn) = match self.fp8_block {
            Some(block) => block,
            None if rows.is_multiple_of(sr) && cols.is_multiple_of(sc) => (rows / sr, cols / sc),
            None => {
                return Err(scale_fault(format!(
                    "block scales of shape {grid:?} do not tile the FP8 weight {shape:?} into whole blocks (and the config gives no `weight_block_size`)"
                )))
            }
        };
        if (sr, sc) != (rows.div_ceil(bm), cols.div_ceil(bn)) {
            return Err(scale_fault(format!(
                "block scales of shape {grid:?} are not one per {bm} x {bn} block of the FP8 weight {shape:?}"
            )));
        }
        let err = |e| self.err(name, e);
        // Each row's and column's block, as indices into the grid.
        let index = |n: usize, block: usize| {
            let idx: Vec<u32> = (0..n).map(|i| (i / block) as u32).collect();
            Tensor::from_vec(idx, n, &Device::Cpu)
        };
        let lead_n: usize = lead.iter().product();
        let per_element = scales
            .to_dtype(DType::F32)
            .and_then(|s| s.reshape((lead_n, sr, sc)))
            .and_then(|s| s.index_select(&index(rows, bm)?, 1))
            .and_then(|s| s.index_select(&index(cols, bn)?, 2))
            .map_err(err)?;
        self.st
            .load(full, &Device::Cpu)
            .and_then(|q| q.to_dtype(DType::F32)?.reshape((lead_n, rows, cols)))
            .and_then(|q| q.mul(&per_element)?.reshape(shape))
            .map_err(err)
    }

    /// The time spent so far in each step of [`Weights::get_as`], summed over threads.
    pub fn step_seconds(&self) -> StepSeconds {
        let seconds = |counter: &AtomicU64| {
            Duration::from_nanos(counter.load(Ordering::Relaxed)).as_secs_f64()
        };
        StepSeconds {
            read: seconds(&self.times.read),
            fold: seconds(&self.times.fold),
            convert: seconds(&self.times.convert),
            upload: seconds(&self.times.upload),
        }
    }

    /// The error for a folded weight that holds `bad`, a value that is not finite or that
    /// `dtype` cannot hold: an extreme `lora_scale` or alpha, or NaN in the base or the adapter,
    /// would otherwise give NaN probabilities. It is found in f32 on the CPU, where the fold
    /// already reads every value.
    fn unfit(&self, name: &str, bad: f32, dtype: DType) -> Error {
        Error::Tensor {
            name: format!("{}{name}", self.prefix),
            message: format!(
                "with the adapter folded in (lora_scale {:?}) it holds {bad}, which {dtype:?} cannot hold: check the base and adapter weights, `lora_alpha` and the LoRA scale",
                self.lora_scale
            ),
        }
    }

    /// Refuses every text-model tensor of the checkpoint that the model did not read: a layer past
    /// `num_hidden_layers`, a misspelt or unsupported weight would otherwise be ignored silently.
    /// Call once the model is built. Tensors outside the text model (a vision tower, `lm_head`,
    /// the multi-token-prediction layers) are not the runtime's and are left alone.
    pub fn check_all_used(&self) -> Result<()> {
        let used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        let mut unused: Vec<String> = self
            .st
            .tensors()
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| n.starts_with(self.prefix) && !used.contains(n))
            .collect();
        unused.sort();
        let mut errors: Vec<Error> = unused
            .into_iter()
            .map(|name| Error::Tensor {
                name,
                message: format!(
                    "in {} but not read by the model: the config (`num_hidden_layers`, `layer_types`) does not describe it",
                    list(&self.files)
                ),
            })
            .collect();
        if let Some(adapter) = &self.adapter {
            let mut unapplied: Vec<String> = adapter
                .targets()
                .filter(|t| {
                    !t.iter()
                        .any(|n| used.contains(&format!("{}{n}", self.prefix)))
                })
                .map(|t| t[0].clone())
                .collect();
            unapplied.sort();
            errors.extend(unapplied.into_iter().map(|t| Error::Tensor {
                name: t,
                message: format!(
                    "adapter `{}` modifies it, but the model does not read it",
                    adapter.path().display()
                ),
            }));
        }
        Error::from_all(errors)
    }

    /// Records text-model tensor `name` as read; its full name.
    fn mark_used(&self, name: &str) -> String {
        let full = format!("{}{name}", self.prefix);
        self.used
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(full.clone());
        full
    }

    fn missing(&self, full: &str) -> Error {
        Error::Tensor {
            name: full.to_string(),
            message: format!("missing from {}", list(&self.files)),
        }
    }

    fn err(&self, name: &str, e: candle_core::Error) -> Error {
        Error::backend(format!("loading tensor `{}{name}`", self.prefix), e)
    }
}

/// The candle dtype of a tensor stored as bf16, f16 or f32 (the dtypes weights are kept in).
fn stored_dtype(view: &TensorView<'_>) -> Option<DType> {
    match view.dtype() {
        safetensors::Dtype::BF16 => Some(DType::BF16),
        safetensors::Dtype::F16 => Some(DType::F16),
        safetensors::Dtype::F32 => Some(DType::F32),
        _ => None,
    }
}

/// The stored values where they lie in the map, when they are bf16, f16 or f32 and aligned for
/// their type (safetensors does not promise alignment; the others are copied first).
fn stored_values<'a>(view: &TensorView<'a>) -> Option<StoredValues<'a>> {
    /// The bytes as `T`s, when they are aligned for `T` and a whole number of them.
    fn cast<T: Copy>(bytes: &[u8]) -> Option<&[T]> {
        // SAFETY: bf16, f16 and f32 are plain bits (every bit pattern is a value), and
        // `align_to` gives the aligned middle part only; the ends must be empty.
        let (head, values, tail) = unsafe { bytes.align_to::<T>() };
        (head.is_empty() && tail.is_empty()).then_some(values)
    }
    let bytes = view.data();
    match view.dtype() {
        safetensors::Dtype::BF16 => cast::<half::bf16>(bytes).map(StoredValues::Bf16),
        safetensors::Dtype::F16 => cast::<half::f16>(bytes).map(StoredValues::F16),
        safetensors::Dtype::F32 => cast::<f32>(bytes).map(StoredValues::F32),
        _ => None,
    }
}

/// A tensor stored in two shards would be read from one of them, chosen by the map's order.
fn refuse_repeated_tensors(files: &[PathBuf]) -> Result<()> {
    let mut first: BTreeMap<String, &PathBuf> = BTreeMap::new();
    let mut errors = Vec::new();
    for file in files {
        check_header(file)?;
        // SAFETY: as in `Weights::open`; only the header is read here.
        let st = unsafe { MmapedSafetensors::new(file) }
            .map_err(|e| Error::backend(format!("reading safetensors `{}`", file.display()), e))?;
        let mut names: Vec<String> = st.tensors().into_iter().map(|(n, _)| n).collect();
        names.sort();
        for name in names {
            if let Some(other) = first.get(&name) {
                errors.push(Error::Tensor {
                    message: format!(
                        "stored twice, in `{}` and `{}`",
                        other.display(),
                        file.display()
                    ),
                    name,
                });
            } else {
                first.insert(name, file);
            }
        }
    }
    Error::from_all(errors)
}

fn list(files: &[PathBuf]) -> String {
    let names: Vec<String> = files.iter().map(|f| format!("`{}`", f.display())).collect();
    names.join(", ")
}

/// `f` applied to `t` on the CPU, the result put back on `t`'s device: load-time arithmetic on
/// a few small tensors (norm weights, decay rates) stays off the GPU, so that a GPU process
/// launches no candle kernel, whose PTX modules take the driver seconds each to translate in a
/// fresh process.
pub(crate) fn on_host(
    t: &Tensor,
    f: impl FnOnce(Tensor) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    f(t.to_device(&Device::Cpu)?)?.to_device(t.device())
}
