//! Folding a PEFT LoRA adapter into the base weights (docs/CONTRACT.md §5).
//!
//! The merge happens once, at load, on the CPU in f32: `W' = W + (B·A)·s·lora_scale`, with `s`
//! from `adapter_config.json` (`alpha/r`, or `alpha/√r` with rsLoRA), and the result is rounded
//! once to the backbone dtype, in one pass over the weight. Trained token embeddings
//! (`trainable_token_indices`) replace rows: `row' = (1 − s)·row + s·new_row`. A LoRA on a MoE
//! layer's fused routed experts (PEFT's `target_parameters`) is one pair per parameter whose
//! factors hold every expert's (`A: [r·E, in]`, expert e's rows `e·r..`; `B: [out, r·E]`,
//! expert e's columns `j·E + e`), folded expert by expert into the fused tensor or into each
//! expert's own projections.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use kev_core::{AdapterConfig, Error, Result};

/// Key prefixes PEFT writes, longest first: the text model wrapped directly, a causal-LM wrapper,
/// and the multimodal wrapper.
const PREFIXES: [&str; 3] = [
    "base_model.model.model.language_model.",
    "base_model.model.model.",
    "base_model.model.",
];

/// Where PEFT 0.21 stores the new rows of `trainable_token_indices` (relative to the text model).
const TOKENS_KEY: &str = "embed_tokens.token_adapter.trainable_tokens_delta";

/// One LoRA pair, f32 on the CPU: a module's, or a fused experts parameter's (`experts` > 1).
struct LoraPair {
    a: Tensor,
    b: Tensor,
    scaling: f64,
    /// Experts whose factors the pair holds (1 for a module).
    experts: usize,
}

impl LoraPair {
    /// Expert `e`'s factors `(B_e, A_e)`, `B_e`'s rows `rows` only (a part of the fused output).
    fn expert(
        &self,
        e: usize,
        rows: std::ops::Range<usize>,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (out, re) = self.b.dims2()?;
        let r = re / self.experts;
        let b = self.b.reshape((out, r, self.experts))?.narrow(2, e, 1)?;
        let b = b.reshape((out, r))?.narrow(0, rows.start, rows.len())?;
        Ok((b.contiguous()?, self.a.narrow(0, e * r, r)?.contiguous()?))
    }
}

/// What part of a pair a base weight takes: the whole product, or one expert's rows `rows` of
/// it (a routed expert's own projection in the per-expert layout).
enum Part {
    Whole,
    Expert(usize, std::ops::Range<usize>),
}

/// The fused experts module of a PEFT parameter wrapper (`layers.N.mlp.experts`, each further
/// wrapper one `.base_layer` deeper) and its depth.
fn expert_wrapper(module: &str) -> Option<(&str, usize)> {
    let mut m = module;
    let mut depth = 0;
    while let Some(inner) = m.strip_suffix(".base_layer") {
        m = inner;
        depth += 1;
    }
    m.ends_with(".mlp.experts").then_some((m, depth))
}

/// A loaded adapter: LoRA pairs by base weight name (text-model relative, e.g.
/// `layers.0.mlp.up_proj.weight`) and the trained token rows.
pub struct Adapter {
    path: PathBuf,
    pairs: HashMap<String, LoraPair>,
    tokens: Option<(Vec<u32>, Tensor)>,
}

fn tensor_err(name: &str, message: impl Into<String>) -> Error {
    Error::Tensor {
        name: name.to_string(),
        message: message.into(),
    }
}

impl Adapter {
    /// Reads `adapter_config.json` and `adapter_model.safetensors`.
    ///
    /// Every problem found is reported, in one error and in the order of the tensor names (so the
    /// same broken adapter is always blamed on the same tensors): a key that matches no base
    /// weight, a lone `lora_A` or `lora_B`, shapes that do not agree with the configured rank,
    /// a module outside `layers_to_transform` or `target_modules`, a target module with no
    /// tensors, and an adapter with no tensors at all.
    pub fn load(config_path: &Path, weights_path: &Path) -> Result<Self> {
        let config = AdapterConfig::load(config_path)?;
        crate::safetensors_header::check_header(weights_path)?;
        let tensors = candle_core::safetensors::load(weights_path, &Device::Cpu)
            .map_err(|e| Error::backend(format!("reading `{}`", weights_path.display()), e))?;
        let tensors: BTreeMap<String, Tensor> = tensors.into_iter().collect();
        let file = weights_path.display();
        let mut errors = Vec::new();
        let mut halves: BTreeMap<String, (Option<Tensor>, Option<Tensor>)> = BTreeMap::new();
        let mut tokens = None;
        for (key, tensor) in tensors {
            let Some(rest) = PREFIXES.iter().find_map(|p| {
                key.strip_prefix(p)
                    .filter(|r| r.starts_with("layers.") || r.starts_with("embed_tokens."))
            }) else {
                errors.push(tensor_err(
                    &key,
                    format!("adapter tensor in `{file}` matches no base weight (unknown prefix)"),
                ));
                continue;
            };
            let tensor = tensor
                .to_dtype(DType::F32)
                .map_err(|e| Error::backend(format!("adapter tensor `{key}`"), e))?;
            if rest == TOKENS_KEY {
                let ids = &config.trainable_token_indices;
                let dims = tensor.dims().to_vec();
                if ids.is_empty() || dims.len() != 2 || dims[0] != ids.len() {
                    errors.push(tensor_err(&key, format!("shape {dims:?} does not match the {} `trainable_token_indices` of the adapter config", ids.len())));
                } else {
                    tokens = Some((ids.clone(), tensor));
                }
            } else if let Some(module) = rest.strip_suffix(".lora_A.weight") {
                halves.entry(module.to_string()).or_default().0 = Some(tensor);
            } else if let Some(module) = rest.strip_suffix(".lora_B.weight") {
                halves.entry(module.to_string()).or_default().1 = Some(tensor);
            } else {
                errors.push(tensor_err(
                    &key,
                    "adapter tensor is neither `lora_A`, `lora_B` nor trained token rows",
                ));
            }
        }
        if tokens.is_none() && !config.trainable_token_indices.is_empty() {
            errors.push(Error::Adapter {
                path: weights_path.to_path_buf(),
                message: format!(
                    "the config lists `trainable_token_indices` but `{TOKENS_KEY}` is missing"
                ),
            });
        }
        let mut pairs = HashMap::new();
        let mut wrappers: BTreeMap<String, Vec<(usize, Tensor, Tensor)>> = BTreeMap::new();
        for (module, (a, b)) in halves {
            let (Some(a), Some(b)) = (a, b) else {
                errors.push(tensor_err(
                    &module,
                    "LoRA module has only one of `lora_A` / `lora_B`",
                ));
                continue;
            };
            if let Some((experts, depth)) = expert_wrapper(&module) {
                wrappers
                    .entry(experts.to_string())
                    .or_default()
                    .push((depth, a, b));
                continue;
            }
            if let Some(problem) = module_problem(&config, &module, &a, &b) {
                errors.push(tensor_err(&module, problem));
                continue;
            }
            pairs.insert(
                format!("{module}.weight"),
                LoraPair {
                    a,
                    b,
                    scaling: config.scaling(&module),
                    experts: 1,
                },
            );
        }
        errors.extend(expert_pairs(&config, wrappers, &mut pairs, weights_path));
        errors.extend(uncovered_targets(&config, &pairs, weights_path));
        if pairs.is_empty() && tokens.is_none() && errors.is_empty() {
            errors.push(Error::Adapter {
                path: weights_path.to_path_buf(),
                message: format!(
                    "holds no LoRA tensors, but its config targets {:?}",
                    config.target_modules
                ),
            });
        }
        Error::from_all(errors)?;
        Ok(Self {
            path: weights_path.to_path_buf(),
            pairs,
            tokens,
        })
    }

    /// Per LoRA pair, the base tensors any of which shows its target is there and read (for
    /// the up-front coverage check): the weight it folds into; for fused routed experts, the
    /// fused parameter or, in the per-expert layout, expert 0's first projection of it.
    pub fn targets(&self) -> impl Iterator<Item = Vec<String>> + '_ {
        self.pairs.keys().map(|k| match k.rsplit_once(".experts.") {
            Some((stem, param)) if !k.ends_with(".weight") => {
                let first = if param == "gate_up_proj" {
                    "gate_proj"
                } else {
                    "down_proj"
                };
                vec![k.clone(), format!("{stem}.experts.0.{first}.weight")]
            }
            _ => vec![k.clone()],
        })
    }

    /// The adapter file, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the adapter changes base weight `name`.
    pub fn touches(&self, name: &str) -> bool {
        self.lora_of(name).is_some() || (name == "embed_tokens.weight" && self.tokens.is_some())
    }

    /// The pair that folds into base weight `name`, and which part of its product: a module's
    /// or a fused experts parameter's whole, or in the per-expert layout
    /// (`layers.N.mlp.experts.X.{gate,up,down}_proj.weight`) expert X's rows of its parameter
    /// (`gate_up_proj`'s first half for `gate_proj`, its second for `up_proj`).
    fn lora_of(&self, name: &str) -> Option<(&LoraPair, Part)> {
        if let Some(pair) = self.pairs.get(name) {
            return Some((pair, Part::Whole));
        }
        let (stem, rest) = name.rsplit_once(".experts.")?;
        let (x, proj) = rest.split_once('.')?;
        let x: usize = x.parse().ok()?;
        let (param, half) = match proj {
            "gate_proj.weight" => ("gate_up_proj", Some(0)),
            "up_proj.weight" => ("gate_up_proj", Some(1)),
            "down_proj.weight" => ("down_proj", None),
            _ => return None,
        };
        let pair = self.pairs.get(&format!("{stem}.experts.{param}"))?;
        let out = pair.b.dims()[0];
        let rows = match half {
            Some(h) => h * out / 2..(h + 1) * out / 2,
            None => 0..out,
        };
        Some((pair, Part::Expert(x, rows)))
    }

    /// The factors `(B, A)` that fold into base weight `name` of `shape`, one pair per matrix
    /// of it (a fused experts tensor `[E, out, in]` has E), checked to fit it.
    fn factors(
        &self,
        name: &str,
        pair: &LoraPair,
        part: &Part,
        shape: &[usize],
    ) -> Result<Vec<(Tensor, Tensor)>> {
        let ctx = |e| Error::backend(format!("merging the adapter into `{name}`"), e);
        let misfit = || {
            tensor_err(
                name,
                format!(
                    "LoRA A {:?} · B {:?}{} does not fit base weight {shape:?}",
                    pair.a.dims(),
                    pair.b.dims(),
                    if pair.experts > 1 {
                        format!(" ({} experts)", pair.experts)
                    } else {
                        String::new()
                    }
                ),
            )
        };
        let (b_out, a_in) = (pair.b.dims()[0], pair.a.dims()[1]);
        let mats = match (part, shape) {
            (Part::Whole, &[out, inp]) if name.ends_with(".weight") => {
                if b_out != out || a_in != inp {
                    return Err(misfit());
                }
                vec![(pair.b.clone(), pair.a.clone())]
            }
            (Part::Whole, &[e, out, inp]) if !name.ends_with(".weight") => {
                if e != pair.experts || b_out != out || a_in != inp {
                    return Err(misfit());
                }
                (0..e)
                    .map(|x| pair.expert(x, 0..out))
                    .collect::<candle_core::Result<_>>()
                    .map_err(ctx)?
            }
            (Part::Expert(x, rows), &[out, inp]) => {
                if *x >= pair.experts || rows.len() != out || a_in != inp {
                    return Err(misfit());
                }
                vec![pair.expert(*x, rows.clone()).map_err(ctx)?]
            }
            _ => return Err(misfit()),
        };
        Ok(mats)
    }

    /// Folds the adapter into base weight `name` (`stored`: as stored, on the CPU) with
    /// interpolation `lora_scale`, rounded once to `dtype` (still on the CPU). `Ok(Err(v))`
    /// when the folded weight holds `v`, a value that is not finite or that `dtype` cannot hold.
    pub fn fold(
        &self,
        name: &str,
        stored: &Tensor,
        lora_scale: f64,
        dtype: DType,
    ) -> Result<std::result::Result<Tensor, f32>> {
        let ctx = |e| Error::backend(format!("merging the adapter into `{name}`"), e);
        if let Some((pair, part)) = self.lora_of(name) {
            let mats = self.factors(name, pair, &part, stored.dims())?;
            let scale = pair.scaling * lora_scale;
            let fused = stored.rank() == 3;
            return fold_each(&mats, fused, |x, b, a| {
                let base = if fused {
                    stored.get(x)?
                } else {
                    stored.clone()
                };
                fold_update(&base, b, a, scale, dtype)
            })
            .map_err(ctx);
        }
        let mut weight = stored.to_dtype(DType::F32).map_err(ctx)?;
        if name == "embed_tokens.weight" {
            if let Some((ids, rows)) = &self.tokens {
                weight = replace_rows(name, weight, ids, rows, lora_scale)?;
            }
        }
        let values = weight
            .flatten_all()
            .and_then(|w| w.to_vec1::<f32>())
            .map_err(ctx)?;
        if let Some(&bad) = values.iter().find(|&&v| !fits(v, dtype)) {
            return Ok(Err(bad));
        }
        weight.to_dtype(dtype).map(Ok).map_err(ctx)
    }

    /// [`Adapter::fold`] of a LoRA pair into `values`, the stored weight of `shape` borrowed
    /// where it lies (the mapped file), without a copy of it first: the same bits. `None` when
    /// the adapter has no LoRA pair for `name` (trained token rows fold through
    /// [`Adapter::fold`]).
    pub fn fold_values(
        &self,
        name: &str,
        values: StoredValues<'_>,
        shape: &[usize],
        lora_scale: f64,
        dtype: DType,
    ) -> Result<Option<std::result::Result<Tensor, f32>>> {
        let Some((pair, part)) = self.lora_of(name) else {
            return Ok(None);
        };
        let ctx = |e| Error::backend(format!("merging the adapter into `{name}`"), e);
        let mats = self.factors(name, pair, &part, shape)?;
        // One matrix, or a fused experts tensor's E, each `per` values.
        let matrix = &shape[shape.len() - 2..];
        let per = matrix[0] * matrix[1];
        fold_each(&mats, shape.len() == 3, |x, b, a| {
            let fold = Fold {
                b,
                a,
                scale: (pair.scaling * lora_scale) as f32,
                dtype,
                shape: matrix,
            };
            fold.values(values.slice(x * per..(x + 1) * per))
        })
        .map(Some)
        .map_err(ctx)
    }
}

/// `fold(x, B, A)` of each matrix's factors in `mats`, stacked into `[E, out, in]` for a fused
/// experts weight (`fused`), else the one matrix; `Err(v)` for the first value that does not fit.
fn fold_each(
    mats: &[(Tensor, Tensor)],
    fused: bool,
    fold: impl Fn(usize, &Tensor, &Tensor) -> candle_core::Result<std::result::Result<Tensor, f32>>,
) -> candle_core::Result<std::result::Result<Tensor, f32>> {
    let mut folded = Vec::with_capacity(mats.len());
    for (x, (b, a)) in mats.iter().enumerate() {
        match fold(x, b, a)? {
            Ok(w) => folded.push(w),
            Err(bad) => return Ok(Err(bad)),
        }
    }
    if fused {
        Tensor::stack(&folded, 0).map(Ok)
    } else {
        Ok(Ok(folded.remove(0)))
    }
}

/// A stored weight's values in one of the dtypes the fold reads.
#[derive(Clone, Copy)]
pub enum StoredValues<'a> {
    /// Stored as bf16.
    Bf16(&'a [half::bf16]),
    /// Stored as f16.
    F16(&'a [half::f16]),
    /// Stored as f32.
    F32(&'a [f32]),
}

impl<'a> StoredValues<'a> {
    /// Values `range` (one expert's matrix of a fused tensor).
    fn slice(self, range: std::ops::Range<usize>) -> Self {
        match self {
            Self::Bf16(v) => Self::Bf16(&v[range]),
            Self::F16(v) => Self::F16(&v[range]),
            Self::F32(v) => Self::F32(&v[range]),
        }
    }
}

/// Whether the folded value `v` can be rounded to `dtype` without becoming infinite.
fn fits(v: f32, dtype: DType) -> bool {
    v.abs() <= largest(dtype)
}

/// The largest finite value of `dtype`, as f32 (f32's own for the others). Comparing `|v|` with
/// it also refuses infinities and NaN (every comparison with NaN is false).
fn largest(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => f32::from(half::f16::MAX),
        DType::BF16 => f32::from(half::bf16::MAX),
        _ => f32::MAX,
    }
}

/// `W + Δ·s` rounded to `dtype`, for `base` (`W`, as stored) and `Δ = B·A` (`b`, `a`: f32), in
/// one pass over the weight on every core. The arithmetic is candle's
/// `(W.to_dtype(f32) + B.matmul(A) * s).to_dtype(dtype)` element for element (`Δ * s` is
/// `Δ·(s as f32) + 0`), so the weights are the bits that chain gives; but it writes the weight
/// once instead of five times, and computes `Δ` a block of rows at a time, where the pass reads
/// it (a row of `B·A` is the same product whichever rows are multiplied with it), instead of
/// writing a whole f32 copy of the weight first. Folding is most of a large checkpoint's load.
/// `Err(v)`: the first value in order that does not fit ([`fits`]).
fn fold_update(
    base: &Tensor,
    b: &Tensor,
    a: &Tensor,
    scale: f64,
    dtype: DType,
) -> candle_core::Result<std::result::Result<Tensor, f32>> {
    use half::{bf16, f16};
    let base = match base.dtype() {
        DType::BF16 | DType::F16 | DType::F32 => base.contiguous()?,
        _ => base.to_dtype(DType::F32)?,
    };
    let (storage, layout) = base.storage_and_layout();
    let fold = Fold {
        b,
        a,
        scale: scale as f32,
        dtype,
        shape: base.dims(),
    };
    fold.values(match base.dtype() {
        DType::BF16 => StoredValues::Bf16(cpu_slice::<bf16>(&storage, layout)?),
        DType::F16 => StoredValues::F16(cpu_slice::<f16>(&storage, layout)?),
        _ => StoredValues::F32(cpu_slice::<f32>(&storage, layout)?),
    })
}

/// The contiguous elements of a CPU tensor's storage.
fn cpu_slice<'a, T: candle_core::WithDType>(
    storage: &'a candle_core::Storage,
    layout: &candle_core::Layout,
) -> candle_core::Result<&'a [T]> {
    let candle_core::Storage::Cpu(cpu) = storage else {
        candle_core::bail!("the adapter is folded on the CPU")
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("folding needs contiguous weights")
    };
    Ok(&cpu.as_slice::<T>()?[start..end])
}

/// One weight's fold: [`fold_update`]'s operands other than the base.
struct Fold<'a> {
    /// LoRA's `B` (`[out, r]`) and `A` (`[r, in]`), f32 on the CPU.
    b: &'a Tensor,
    a: &'a Tensor,
    scale: f32,
    dtype: DType,
    shape: &'a [usize],
}

impl Fold<'_> {
    fn values(
        &self,
        base: StoredValues<'_>,
    ) -> candle_core::Result<std::result::Result<Tensor, f32>> {
        match base {
            StoredValues::Bf16(base) => self.from(base),
            StoredValues::F16(base) => self.from(base),
            StoredValues::F32(base) => self.from(base),
        }
    }

    /// The fold of `base` (bf16, f16 or f32) in `self.dtype`.
    fn from<I: Widen>(&self, base: &[I]) -> candle_core::Result<std::result::Result<Tensor, f32>> {
        use half::{bf16, f16};
        match self.dtype {
            DType::BF16 => self.into::<I, bf16>(base, round_to_bf16),
            DType::F16 => self.into::<I, f16>(base, f16::from_f32),
            DType::F32 => self.into::<I, f32>(base, |v| v),
            other => candle_core::bail!("folding into {other:?} weights"),
        }
    }

    /// `round` is generic, not a function pointer, so that it is inlined and the loop below
    /// vectorised: the pass is most of a folded load's time.
    fn into<I: Widen, O: candle_core::WithDType>(
        &self,
        base: &[I],
        round: impl Fn(f32) -> O + Sync,
    ) -> candle_core::Result<std::result::Result<Tensor, f32>> {
        use rayon::prelude::*;
        // About this many elements a task: large enough to amortise a task and a product, small
        // enough to share a layer's weight among cores and keep a block of `Δ` in the cache.
        const BLOCK: usize = 1 << 16;
        let (rows, cols) = candle_core::Shape::from(self.shape).dims2()?;
        if base.len() != rows * cols || self.b.dims()[0] != rows || self.a.dims()[1] != cols {
            candle_core::bail!(
                "{} weights of shape {:?} for an update of {:?} · {:?}",
                base.len(),
                self.shape,
                self.b.dims(),
                self.a.dims()
            )
        }
        let (s, dtype) = (self.scale, self.dtype);
        let limit = largest(dtype);
        let block_rows = (BLOCK / cols.max(1)).max(1);
        let block = block_rows * cols;
        // `Δ` for rows `first..first + count`.
        let delta_rows = |first: usize, count: usize| -> candle_core::Result<Vec<f32>> {
            self.b
                .narrow(0, first, count)?
                .matmul(self.a)?
                .flatten_all()?
                .to_vec1()
        };
        let mut out: Vec<O> = Vec::with_capacity(base.len());
        let fit: Vec<bool> = if block == 0 {
            Vec::new()
        } else {
            out.spare_capacity_mut()[..base.len()]
                .par_chunks_mut(block)
                .zip(base.par_chunks(block))
                .enumerate()
                .map(|(i, (out, base))| {
                    let delta = delta_rows(i * block_rows, base.len() / cols)?;
                    Ok(fold_block(out, base, &delta, s, limit, &round))
                })
                .collect::<candle_core::Result<_>>()?
        };
        // SAFETY: the blocks above cover `base.len()` elements and wrote every one.
        unsafe { out.set_len(base.len()) };
        // The first value that does not fit, in order, for the error.
        if let Some(i) = fit.iter().position(|&all| !all) {
            let first = i * block_rows;
            let count = block_rows.min(rows - first);
            let delta = delta_rows(first, count)?;
            let bad = base[first * cols..(first + count) * cols]
                .iter()
                .zip(&delta)
                .map(|(&w, &d)| w.widen() + (d * s + 0.0))
                .find(|&v| !fits(v, dtype))
                .unwrap_or(f32::NAN);
            return Ok(Err(bad));
        }
        Tensor::from_vec(out, self.shape, &Device::Cpu).map(Ok)
    }
}

/// One block of [`Fold::into`]'s pass: writes `out[i] = round(base[i] + (delta[i]·s + 0))`;
/// whether every value is within `±limit`. On x86-64 the loop runs in the widest vectors the CPU
/// has (AVX-512, else AVX2, else SSE2): the pass is most of a folded load's time, and the
/// instructions are the same elementwise operations, so the bits do not depend on the width.
fn fold_block<I: Widen, O>(
    out: &mut [std::mem::MaybeUninit<O>],
    base: &[I],
    delta: &[f32],
    s: f32,
    limit: f32,
    round: &impl Fn(f32) -> O,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
        {
            // SAFETY: the CPU has the features the function is compiled for.
            return unsafe { fold_block_avx512(out, base, delta, s, limit, round) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: as above.
            return unsafe { fold_block_avx2(out, base, delta, s, limit, round) };
        }
    }
    fold_block_plain(out, base, delta, s, limit, round)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn fold_block_avx512<I: Widen, O>(
    out: &mut [std::mem::MaybeUninit<O>],
    base: &[I],
    delta: &[f32],
    s: f32,
    limit: f32,
    round: &impl Fn(f32) -> O,
) -> bool {
    fold_block_plain(out, base, delta, s, limit, round)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn fold_block_avx2<I: Widen, O>(
    out: &mut [std::mem::MaybeUninit<O>],
    base: &[I],
    delta: &[f32],
    s: f32,
    limit: f32,
    round: &impl Fn(f32) -> O,
) -> bool {
    fold_block_plain(out, base, delta, s, limit, round)
}

/// [`fold_block`]'s loop, branch-free so that it vectorises (inlined into each variant).
#[inline(always)]
fn fold_block_plain<I: Widen, O>(
    out: &mut [std::mem::MaybeUninit<O>],
    base: &[I],
    delta: &[f32],
    s: f32,
    limit: f32,
    round: &impl Fn(f32) -> O,
) -> bool {
    let mut unfit = 0u32;
    for ((o, &w), &d) in out.iter_mut().zip(base).zip(delta) {
        let v = w.widen() + (d * s + 0.0);
        // Negated so that NaN counts as unfit (one comparison, which vectorises).
        #[allow(clippy::neg_cmp_op_on_partial_ord)]
        let bad = !(v.abs() <= limit);
        unfit |= u32::from(bad);
        o.write(round(v));
    }
    unfit == 0
}

/// `bf16::from_f32` without branches, so that the fold's loop vectorises: the same bits for
/// every input (round to nearest, ties to even; a NaN keeps its sign and upper payload bits,
/// with the quiet bit set).
#[inline(always)]
fn round_to_bf16(v: f32) -> half::bf16 {
    let bits = v.to_bits();
    let nan = bits & 0x7FFF_FFFF > 0x7F80_0000;
    // Up when the dropped half is over 0x8000, or exactly 0x8000 with an odd kept part.
    let up = u32::from(bits & 0x8000 != 0 && bits & 0x1_7FFF != 0);
    let rounded = if nan {
        (bits >> 16) | 0x40
    } else {
        (bits >> 16) + up
    };
    half::bf16::from_bits(rounded as u16)
}

/// A stored weight element, widened exactly to f32.
trait Widen: Copy + Send + Sync {
    fn widen(self) -> f32;
}

impl Widen for half::bf16 {
    /// `bf16::to_f32` without branches (a NaN gets its quiet bit, as there), so that the fold's
    /// loop vectorises.
    #[inline(always)]
    fn widen(self) -> f32 {
        let bits = u32::from(self.to_bits());
        let nan = bits & 0x7FFF > 0x7F80;
        f32::from_bits(if nan { (bits | 0x40) << 16 } else { bits << 16 })
    }
}

impl Widen for half::f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

impl Widen for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

/// What is wrong with one LoRA pair, if anything: its shapes against the configured rank, its
/// layer against `layers_to_transform`, its name against a list of `target_modules`.
fn module_problem(config: &AdapterConfig, module: &str, a: &Tensor, b: &Tensor) -> Option<String> {
    let r = config.rank(module);
    if a.rank() != 2 || b.rank() != 2 || a.dims()[0] != r || b.dims()[1] != r {
        return Some(format!(
            "LoRA shapes A {:?}, B {:?} do not agree with rank {r} (A must be [{r}, in], B [out, {r}])",
            a.dims(),
            b.dims()
        ));
    }
    if let Some(problem) = outside_layers(config, module) {
        return Some(problem);
    }
    if !targets_are_regex(config) && !config.target_modules.is_empty() {
        let name = module.rsplit('.').next().unwrap_or(module);
        if !config
            .target_modules
            .iter()
            .any(|t| t == name || suffix_of(module, t))
        {
            return Some(format!(
                "is not among `target_modules` {:?} of the adapter config",
                config.target_modules
            ));
        }
    }
    None
}

/// Why `module` may not carry a LoRA: a layer outside `layers_to_transform`.
fn outside_layers(config: &AdapterConfig, module: &str) -> Option<String> {
    let layers = config.layers_to_transform.as_ref()?;
    match layer_of(module) {
        Some(l) if layers.contains(&l) => None,
        _ => Some(format!(
            "is outside `layers_to_transform` {layers:?} of the adapter config"
        )),
    }
}

/// The fused experts' pairs from `wrappers` (per experts module, each parameter wrapper's depth
/// and factors) into `pairs`, keyed by parameter (`layers.N.mlp.experts.gate_up_proj`): PEFT
/// nests one wrapper per `target_parameters` entry, the first innermost (deepest). Errors:
/// wrappers that do not match `target_parameters` one to one, a layer outside
/// `layers_to_transform`, factors whose shapes do not agree with the rank, and
/// `target_parameters` with no wrapper at all.
fn expert_pairs(
    config: &AdapterConfig,
    wrappers: BTreeMap<String, Vec<(usize, Tensor, Tensor)>>,
    pairs: &mut HashMap<String, LoraPair>,
    path: &Path,
) -> Vec<Error> {
    let params = &config.target_parameters;
    let mut errors = Vec::new();
    if !params.is_empty() && wrappers.is_empty() {
        errors.push(Error::Adapter {
            path: path.to_path_buf(),
            message: format!(
                "`target_parameters` names {params:?} but the adapter holds no LoRA tensors for them"
            ),
        });
    }
    let r = config.r;
    for (module, mut found) in wrappers {
        found.sort_by_key(|w| w.0);
        let depths: Vec<usize> = found.iter().map(|w| w.0).collect();
        if depths != (0..params.len()).collect::<Vec<_>>() {
            errors.push(tensor_err(
                &module,
                format!("LoRA on parameters at wrapper depths {depths:?} does not match `target_parameters` {params:?} of the adapter config (one wrapper each)"),
            ));
            continue;
        }
        if let Some(problem) = outside_layers(config, &module) {
            errors.push(tensor_err(&module, problem));
            continue;
        }
        for (depth, a, b) in found {
            let key = format!("{module}.{}", params[params.len() - 1 - depth]);
            let re = a.dims().first().copied().unwrap_or(0);
            if a.rank() != 2 || b.rank() != 2 || re == 0 || re % r != 0 || b.dims()[1] != re {
                errors.push(tensor_err(
                    &key,
                    format!(
                        "LoRA shapes A {:?}, B {:?} do not agree with rank {r} per expert (A must be [{r} × experts, in], B [out, {r} × experts])",
                        a.dims(),
                        b.dims()
                    ),
                ));
                continue;
            }
            pairs.insert(
                key,
                LoraPair {
                    a,
                    b,
                    scaling: config.scaling(&module),
                    experts: re / r,
                },
            );
        }
    }
    errors
}

/// PEFT's `target_modules` is either a list of names or one string holding a regular expression,
/// which this runtime does not evaluate (the adapter's tensors then decide).
fn targets_are_regex(config: &AdapterConfig) -> bool {
    config.target_modules.len() == 1
        && config.target_modules[0].contains(|c: char| "\\^$*+?()[]{}|".contains(c))
}

fn suffix_of(module: &str, target: &str) -> bool {
    module.ends_with(target) && module[..module.len() - target.len()].ends_with('.')
}

/// `layers.<n>.…` → n.
fn layer_of(module: &str) -> Option<usize> {
    module
        .strip_prefix("layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// A listed target module with no LoRA pair at all: the adapter file lost tensors.
fn uncovered_targets(
    config: &AdapterConfig,
    pairs: &HashMap<String, LoraPair>,
    path: &Path,
) -> Vec<Error> {
    if targets_are_regex(config) {
        return Vec::new();
    }
    config
        .target_modules
        .iter()
        .filter(|t| {
            !pairs.keys().any(|k| {
                // (A fused experts parameter's pair covers no target module.)
                k.strip_suffix(".weight").is_some_and(|module| {
                    module.rsplit('.').next() == Some(t.as_str()) || suffix_of(module, t)
                })
            })
        })
        .map(|t| Error::Adapter {
            path: path.to_path_buf(),
            message: format!(
                "`target_modules` names `{t}` but the adapter holds no LoRA tensors for it"
            ),
        })
        .collect()
}

fn replace_rows(name: &str, weight: Tensor, ids: &[u32], rows: &Tensor, s: f64) -> Result<Tensor> {
    let ctx = |e| Error::backend(format!("trained token rows of `{name}`"), e);
    let (vocab, hidden) = weight.dims2().map_err(ctx)?;
    if rows.dims() != [ids.len(), hidden] {
        return Err(tensor_err(
            name,
            format!(
                "trained token rows {:?} do not fit embeddings [{vocab}, {hidden}]",
                rows.dims()
            ),
        ));
    }
    let mut table = weight.to_vec2::<f32>().map_err(ctx)?;
    let new_rows = rows.to_vec2::<f32>().map_err(ctx)?;
    for (&id, new_row) in ids.iter().zip(&new_rows) {
        let row = table.get_mut(id as usize).ok_or_else(|| {
            tensor_err(
                name,
                format!("trainable token id {id} is outside the vocabulary of {vocab}"),
            )
        })?;
        for (x, n) in row.iter_mut().zip(new_row) {
            *x = ((1.0 - s) * f64::from(*x) + s * f64::from(*n)) as f32;
        }
    }
    Tensor::new(table, &Device::Cpu).map_err(ctx)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values that exercise rounding: spread magnitudes, signed zeros, ties.
    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2_654_435_761).max(1);
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                match i % 97 {
                    0 => 0.0,
                    1 => -0.0,
                    _ => (x as f32 / u32::MAX as f32 - 0.5) * 2f32.powi((i % 23) as i32 - 12),
                }
            })
            .collect()
    }

    /// The one-pass fold gives the bits of candle's chain for every stored and target dtype, in
    /// blocks of more than one task.
    #[test]
    fn fold_update_is_candle_chain_bit_for_bit() {
        // Shapes whose rows split into several blocks of `Δ`, the last one short.
        for (out_f, in_f, rank) in [(37, 4099, 16), (300, 512, 5), (1030, 2560, 16)] {
            let tensor = |n: usize, seed: u32, shape: (usize, usize)| {
                Tensor::from_vec(values(n, seed), shape, &Device::Cpu).unwrap()
            };
            // Factors small enough that every fold fits f16.
            let b = (tensor(out_f * rank, 7, (out_f, rank)) * 0.03).unwrap();
            let a = (tensor(rank * in_f, 11, (rank, in_f)) * 0.03).unwrap();
            let base32 = tensor(out_f * in_f, 3, (out_f, in_f));
            check_fold_update(&base32, &b, &a);
        }
    }

    fn check_fold_update(base32: &Tensor, b: &Tensor, a: &Tensor) {
        let delta = b.matmul(a).unwrap();
        for stored in [DType::BF16, DType::F16, DType::F32] {
            let base = base32.to_dtype(stored).unwrap();
            for target in [DType::BF16, DType::F16, DType::F32] {
                for scale in [0.5, -1.75, 3e-3] {
                    let want = (base.to_dtype(DType::F32).unwrap() + (&delta * scale).unwrap())
                        .unwrap()
                        .to_dtype(target)
                        .unwrap();
                    let got = fold_update(&base, b, a, scale, target).unwrap().unwrap();
                    assert_eq!(got.dtype(), target);
                    assert_eq!(got.dims(), want.dims());
                    // Widening to f32 is exact, and a no-op for f32.
                    let bits = |t: &Tensor| {
                        let values = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
                        let values = values.to_vec1::<f32>().unwrap();
                        values.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    };
                    assert!(
                        bits(&got) == bits(&want),
                        "stored {stored:?} → {target:?}, scale {scale}"
                    );
                }
            }
        }
    }

    /// The branch-free rounding gives `half`'s bits for every sign and exponent, with low
    /// halves around every rounding boundary, NaN payloads and infinities included.
    #[test]
    fn round_to_bf16_is_half_bit_for_bit() {
        let lows = [
            0x0000, 0x0001, 0x3FFF, 0x7FFF, 0x8000, 0x8001, 0xBFFF, 0xC000, 0xFFFE, 0xFFFF,
        ];
        let mut checked = 0;
        for high in 0..=u32::from(u16::MAX) {
            for low in lows
                .iter()
                .copied()
                .chain(values(4, high).iter().map(|v| v.to_bits() & 0xFFFF))
            {
                let v = f32::from_bits(high << 16 | low);
                let (got, want) = (
                    round_to_bf16(v).to_bits(),
                    half::bf16::from_f32(v).to_bits(),
                );
                assert_eq!(got, want, "{:#010x}", v.to_bits());
                checked += 1;
            }
        }
        assert_eq!(checked, 65_536 * 14);
    }

    /// The branch-free widening gives `half`'s bits for every bf16.
    #[test]
    fn widen_bf16_is_half_bit_for_bit() {
        for bits in 0..=u16::MAX {
            let v = half::bf16::from_bits(bits);
            assert_eq!(v.widen().to_bits(), v.to_f32().to_bits(), "{bits:#06x}");
        }
    }

    /// A value the target dtype cannot hold is reported, the first in order.
    #[test]
    fn fold_update_reports_the_first_unfit_value() {
        // 7 rows of 20,000: blocks of `Δ` of 3, 3 and 1 rows.
        let (rows, cols) = (7, 20_000);
        // `B = I`, so `Δ = A`: the values below land where they are put.
        let b = Tensor::eye(rows, DType::F32, &Device::Cpu).unwrap();
        let mut d = vec![1.0f32; rows * cols];
        d[4 * cols + 9] = 1e30;
        let a = Tensor::from_vec(d, (rows, cols), &Device::Cpu).unwrap();
        // A NaN in the base, in the last block (in `Δ`, `0·NaN` would spread it down a column).
        let mut w = vec![0.0f32; rows * cols];
        w[6 * cols] = f32::NAN;
        let base = Tensor::from_vec(w, (rows, cols), &Device::Cpu).unwrap();
        // bf16 and f32 hold 1e30 (f32's exponent range); f16 does not.
        for dtype in [DType::BF16, DType::F32] {
            let got = fold_update(&base, &b, &a, 1.0, dtype).unwrap();
            assert!(got.unwrap_err().is_nan(), "{dtype:?}");
        }
        let got = fold_update(&base, &b, &a, 1.0, DType::F16).unwrap();
        assert_eq!(got.unwrap_err(), 1e30);
    }
}
