//! Depthwise causal conv1d with fused SiLU (the short convolution of a Gated DeltaNet layer).
//!
//! Written as an op because candle's `conv1d(groups = C)` loops over the groups and is hundreds
//! of times slower (docs/DESIGN.md §4.3). The caller prepends the K−1 cached inputs (zeros at the start
//! of a sequence), so the op itself is stateless and continuation is exact.

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "metal")]
mod metal;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use crate::backend::cpu::{as_f32, from_f32, silu_in_place};
use crate::dispatch::{self, backend, counted_zeros, record, Backend, CountedTensor};
use crate::layout::rows::{as_row_view, row_view};
use crate::layout::split::SplitBatch;

/// The op; `kernel` is K (the weight's second dim).
pub(crate) struct CausalConv1d {
    pub(crate) kernel: usize,
}

impl CustomOp2 for CausalConv1d {
    fn name(&self) -> &'static str {
        "causal-conv1d"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b_sz, padded_len, channels) = xl.shape().dims3()?;
        let k = self.kernel;
        let seq_len = padded_len + 1 - k;
        let x = as_f32(xs, xl, "causal-conv1d x")?;
        let w = as_f32(ws, wl, "causal-conv1d weight")?;
        let mut out = vec![0f32; b_sz * seq_len * channels];
        out.par_chunks_mut(channels)
            .enumerate()
            .for_each(|(row, out_row)| {
                let (b, t) = (row / seq_len, row % seq_len);
                let base = (b * padded_len + t) * channels;
                for (c, o) in out_row.iter_mut().enumerate() {
                    let mut acc = 0f32;
                    for j in 0..k {
                        acc += w[c * k + j] * x[base + j * channels + c];
                    }
                    *o = acc;
                }
                silu_in_place(out_row);
            });
        let storage = from_f32(out, xs.dtype())?;
        Ok((storage, Shape::from((b_sz, seq_len, channels))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::causal_conv1d(self.kernel, xs, xl, ws, wl)
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        xs: &candle_core::MetalStorage,
        xl: &Layout,
        ws: &candle_core::MetalStorage,
        wl: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        metal::causal_conv1d(self.kernel, xs, xl, ws, wl)
    }
}

fn check(xs: &Tensor, weight: &Tensor) -> Result<usize> {
    let (_, padded_len, channels) = xs.dims3()?;
    let (w_channels, k) = weight.dims2()?;
    if w_channels != channels || k == 0 || padded_len < k {
        bail!(
            "causal-conv1d: input {:?} (with K-1 cached steps prepended) does not fit weight {:?}",
            xs.dims(),
            weight.dims()
        )
    }
    Ok(k)
}

/// Causal depthwise convolution followed by SiLU.
///
/// `xs`: `[B, K−1+T, C]`, the K−1 previous inputs followed by the T new ones (channels last);
/// `weight`: `[C, K]` (the checkpoint's `[C, 1, K]` squeezed; the last tap multiplies the current
/// step). Returns `[B, T, C]` in the dtype of `xs`, accumulated in f32.
pub fn causal_conv1d(xs: &Tensor, weight: &Tensor) -> Result<Tensor> {
    let kernel = check(xs, weight)?;
    let (xs, weight) = (xs.counted_contiguous()?, weight.counted_contiguous()?);
    record("causal-conv1d", 1);
    xs.apply_op2_no_bwd(&weight, &CausalConv1d { kernel })
}

/// The same computation with plain tensor ops (the reference the op is tested against).
pub fn causal_conv1d_ref(xs: &Tensor, weight: &Tensor) -> Result<Tensor> {
    let k = check(xs, weight)?;
    let seq_len = xs.dim(1)? + 1 - k;
    let xs32 = xs.to_dtype(candle_core::DType::F32)?;
    let w32 = weight.to_dtype(candle_core::DType::F32)?;
    let mut acc = xs32
        .narrow(1, 0, seq_len)?
        .broadcast_mul(&w32.narrow(D::Minus1, 0, 1)?.t()?)?;
    for j in 1..k {
        let tap = w32.narrow(D::Minus1, j, 1)?.t()?;
        acc = (acc + xs32.narrow(1, j, seq_len)?.broadcast_mul(&tap)?)?;
    }
    candle_nn_silu(&acc)?.to_dtype(xs.dtype())
}

fn candle_nn_silu(xs: &Tensor) -> Result<Tensor> {
    xs / (xs.neg()?.exp()? + 1.0)?
}

/// The conv reading `[cache; x]` in place, and the next cache, in one op: inputs `x` (`[B, T, C]`
/// rows, possibly strided), `cache` (`[B, K−1, C]`), `weight` (`[C, K]`); output, flat,
/// `[y: B·T·C | next cache: B·(K−1)·C]`.
pub(crate) struct CausalConv1dCached {
    /// Real steps per row; `None`: every row has T.
    pub(crate) lengths: Option<Vec<u32>>,
}

impl CausalConv1dCached {
    fn out_shape(xl: &Layout, kernel: usize) -> Result<Shape> {
        let (b_sz, seq_len, channels) = xl.shape().dims3()?;
        Ok(Shape::from(b_sz * (seq_len + kernel - 1) * channels))
    }
}

impl CustomOp3 for CausalConv1dCached {
    fn name(&self) -> &'static str {
        "causal-conv1d-cached"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        cs: &CpuStorage,
        cl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b_sz, seq_len, channels) = xl.shape().dims3()?;
        let k = wl.dims()[1];
        // x in place when it is f32 (a row view of the projection), else packed as f32.
        let view = row_view(xl, "causal-conv1d x")?;
        let packed;
        let (x, x0, x_stride) = match xs {
            CpuStorage::F32(v) => (&v[..], view.offset, view.stride),
            _ => {
                packed = view.read_f32(xs, "causal-conv1d x")?;
                (&packed[..], 0, channels)
            }
        };
        let cache = as_f32(cs, cl, "causal-conv1d cache")?;
        let w = as_f32(ws, wl, "causal-conv1d weight")?;
        // Window row p of batch row b: the K−1 cached rows, then x.
        let window = |b: usize, p: usize| -> &[f32] {
            if p < k - 1 {
                &cache[(b * (k - 1) + p) * channels..][..channels]
            } else {
                &x[x0 + (b * seq_len + p - (k - 1)) * x_stride..][..channels]
            }
        };
        // The taps by row (wt[j][c] = w[c][j]): each tap is one multiply-add along a window row,
        // over contiguous channels (the compiler vectorises it), in the same order as before.
        let w = &w[..];
        let wt: Vec<f32> = (0..k)
            .flat_map(|j| (0..channels).map(move |c| w[c * k + j]))
            .collect();
        let ny = b_sz * seq_len * channels;
        let mut out = vec![0f32; ny + b_sz * (k - 1) * channels];
        let (y, next) = out.split_at_mut(ny);
        y.par_chunks_mut(channels).enumerate().for_each(|(row, y)| {
            let (b, t) = (row / seq_len, row % seq_len);
            for (j, taps) in wt.chunks_exact(channels).enumerate() {
                for ((o, &xv), &wv) in y.iter_mut().zip(window(b, t + j)).zip(taps) {
                    *o += wv * xv;
                }
            }
            silu_in_place(y);
        });
        for (i, next) in next.chunks_exact_mut(channels).enumerate() {
            let (b, r) = (i / (k - 1), i % (k - 1));
            let len = self.lengths.as_ref().map_or(seq_len, |l| l[b] as usize);
            next.copy_from_slice(window(b, len + r));
        }
        Ok((from_f32(out, xs.dtype())?, Self::out_shape(xl, k)?))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        cs: &candle_core::CudaStorage,
        cl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::causal_conv1d_cached(self.lengths.as_deref(), xs, xl, cs, cl, ws, wl)?;
        Ok((out, Self::out_shape(xl, wl.dims()[1])?))
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        xs: &candle_core::MetalStorage,
        xl: &Layout,
        cs: &candle_core::MetalStorage,
        cl: &Layout,
        ws: &candle_core::MetalStorage,
        wl: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        let out = metal::causal_conv1d_cached(self.lengths.as_deref(), xs, xl, cs, cl, ws, wl)?;
        Ok((out, Self::out_shape(xl, wl.dims()[1])?))
    }
}

/// [`causal_conv1d`] continuing from a cache: `x: [B, T, C]` (may be a slice of a wider
/// projection), `cache: [B, K−1, C]` (the raw inputs before `x`; zeros at the start), `weight:
/// [C, K]`, `lengths`: the real steps per row (right padding after them), `None` for all T.
/// Returns `y: [B, T, C]` and the next cache, `[B, K−1, C]`: the K−1 raw inputs before each row's
/// end. One op on every backend.
pub fn causal_conv1d_cached(
    x: &Tensor,
    cache: &Tensor,
    weight: &Tensor,
    lengths: Option<&[usize]>,
) -> Result<(Tensor, Tensor)> {
    let (y, next) = causal_conv1d_cached_view(x, cache, weight, lengths)?;
    // The cache outlives this step (a prefix keeps it): give it storage of its own, or it would
    // keep the whole output, y included, alive. (`Tensor::copy` would not do: it clones the
    // whole storage under the same view.)
    Ok((y, next.counted_force_contiguous()?))
}

/// [`causal_conv1d_cached`] with the next cache left as a view into the op's output (which it
/// keeps alive): for a caller that reads it once, right away, and saves the copy (one launch per
/// layer of a one-pass forward).
fn causal_conv1d_cached_view(
    x: &Tensor,
    cache: &Tensor,
    weight: &Tensor,
    lengths: Option<&[usize]>,
) -> Result<(Tensor, Tensor)> {
    let (b_sz, seq_len, channels) = x.dims3()?;
    let (w_channels, k) = weight.dims2()?;
    if w_channels != channels || k < 2 || cache.dims() != [b_sz, k - 1, channels] {
        bail!(
            "causal-conv1d: input {:?} / cache {:?} do not fit weight {:?}",
            x.dims(),
            cache.dims(),
            weight.dims()
        )
    }
    if let Some(l) = lengths {
        if l.len() != b_sz || l.iter().any(|&n| n > seq_len) {
            bail!(
                "causal-conv1d: lengths {l:?} do not fit input {:?}",
                x.dims()
            )
        }
    }
    let op = CausalConv1dCached {
        lengths: lengths
            .filter(|l| l.iter().any(|&n| n != seq_len))
            .map(|l| l.iter().map(|&n| n as u32).collect()),
    };
    let (x, cache, weight) = (
        as_row_view(x)?,
        cache.counted_contiguous()?,
        weight.counted_contiguous()?,
    );
    record("causal-conv1d", 1);
    let out = x.apply_op3_no_bwd(&cache, &weight, &op)?;
    let ny = b_sz * seq_len * channels;
    let y = out
        .narrow(0, 0, ny)?
        .counted_reshape((b_sz, seq_len, channels))?;
    let next = out
        .narrow(0, ny, b_sz * (k - 1) * channels)?
        .counted_reshape((b_sz, k - 1, channels))?;
    Ok((y, next))
}

/// The one-pass forward's conv: `[x_state; x_branches]` run as [`causal_conv1d_cached`] would be
/// run twice (the states from zeros, each branch from its state row's last K−1 real inputs), in
/// one CUDA launch or Metal dispatch; inputs rows (possibly strided), `weight: [C, K]`. GPU only.
#[cfg_attr(not(any(feature = "cuda", feature = "metal")), allow(dead_code))]
struct CausalConv1dSplit(SplitBatch);

impl CustomOp3 for CausalConv1dSplit {
    fn name(&self) -> &'static str {
        "causal-conv1d-split"
    }

    cuda_only_cpu_fwd!(
        "causal-conv1d-split: CUDA and Metal only (`causal_conv1d_split` composes on the CPU)",
        _a _la, _b _lb, _c _lc
    );

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
        bs: &candle_core::CudaStorage,
        bl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::causal_conv1d_split(&self.0, ss, sl, bs, bl, ws, wl)?;
        Ok((out, Shape::from((self.0.tokens(), sl.dims()[2]))))
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        ss: &candle_core::MetalStorage,
        sl: &Layout,
        bs: &candle_core::MetalStorage,
        bl: &Layout,
        ws: &candle_core::MetalStorage,
        wl: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        let out = metal::causal_conv1d_split(&self.0, ss, sl, bs, bl, ws, wl)?;
        Ok((out, Shape::from((self.0.tokens(), sl.dims()[2]))))
    }
}

/// Records' convs: the states `x_state: [R, S, C]` from zeros, then the branches
/// `x_branches: [B, T, C]`, each continuing the last K−1 real inputs of its state row (`split`:
/// lengths and owners). Returns the states' `[R, S, C]` and the branches' `[B, T, C]` (padded
/// steps included, as [`causal_conv1d_cached`] computes them). On CUDA and Metal one launch
/// writing both into one packed output (the parts are views of it), the state rows' windows read
/// in place; on the CPU, and where a part is empty, [`causal_conv1d_cached`] on the states from zeros and
/// on the branches from their state rows' windows: the same products per output, so the same
/// numbers.
pub fn causal_conv1d_split(
    x_state: &Tensor,
    x_branches: &Tensor,
    weight: &Tensor,
    split: &SplitBatch,
) -> Result<(Tensor, Tensor)> {
    if let Some(y) = fused_causal_conv1d_split(x_state, x_branches, weight, split)? {
        return split.parts(&y);
    }
    composed_causal_conv1d_split(x_state, x_branches, weight, split)
}

/// [`causal_conv1d_split`] off its fused kernel: two [`causal_conv1d_cached`] ops and a gather.
fn composed_causal_conv1d_split(
    x_state: &Tensor,
    x_branches: &Tensor,
    weight: &Tensor,
    split: &SplitBatch,
) -> Result<(Tensor, Tensor)> {
    // The windows stay views into the conv's output: the states' are read once (copied to the
    // branch rows), the branches' never.
    let (channels, k) = weight.dims2()?;
    let zeros = counted_zeros(
        (split.states(), k - 1, channels),
        x_state.dtype(),
        x_state.device(),
    )?;
    let state_lengths = Some(split.state_lengths());
    let (y_s, window) = causal_conv1d_cached_view(x_state, &zeros, weight, state_lengths)?;
    let window_b = split.to_branches(&window)?;
    let (y_b, _) =
        causal_conv1d_cached_view(x_branches, &window_b, weight, Some(split.branch_lengths()))?;
    Ok((y_s, y_b))
}

/// [`causal_conv1d_split`]'s one-launch form alone (its checks first), packed `[R·S + B·T, C]`:
/// `None` where it does not run (on the CPU, an empty part). Public through [`crate::testing`],
/// for the tests that it runs where it should.
pub fn fused_causal_conv1d_split(
    x_state: &Tensor,
    x_branches: &Tensor,
    weight: &Tensor,
    split: &SplitBatch,
) -> Result<Option<Tensor>> {
    let (states, s_len, channels) = x_state.dims3()?;
    let (b_sz, t_len, b_channels) = x_branches.dims3()?;
    let (w_channels, k) = weight.dims2()?;
    split.check_parts("causal-conv1d-split", x_state, x_branches)?;
    if b_channels != channels || w_channels != channels || k < 2 {
        bail!(
            "causal-conv1d-split: state {:?} / branches {:?} do not fit weight {:?}",
            x_state.dims(),
            x_branches.dims(),
            weight.dims()
        )
    }
    let dtype = x_state.dtype();
    if x_branches.dtype() != dtype || weight.dtype() != dtype {
        bail!(
            "causal-conv1d-split: mixed dtypes (state {dtype:?}, branches {:?}, weight {:?})",
            x_branches.dtype(),
            weight.dtype()
        )
    }
    if backend(x_state.device()) == Backend::Cpu || states * s_len == 0 || b_sz * t_len == 0 {
        return Ok(None);
    }
    let (state_rows, branch_rows, packed_weight) = (
        as_row_view(x_state)?,
        as_row_view(x_branches)?,
        weight.counted_contiguous()?,
    );
    let out = dispatch::launch(
        "causal-conv1d-split",
        1,
        x_state.device(),
        || {
            state_rows.apply_op3_no_bwd(
                &branch_rows,
                &packed_weight,
                &CausalConv1dSplit(split.clone()),
            )
        },
        || {
            let (y_s, y_b) = composed_causal_conv1d_split(x_state, x_branches, weight, split)?;
            split.join(&y_s, &y_b)
        },
    )?;
    Ok(Some(out))
}

/// [`causal_conv1d_cached`] from the window op and tensor ops (the test reference).
pub fn causal_conv1d_cached_ref(
    x: &Tensor,
    cache: &Tensor,
    weight: &Tensor,
    lengths: Option<&[usize]>,
) -> Result<(Tensor, Tensor)> {
    let (b_sz, seq_len, channels) = x.dims3()?;
    let keep = cache.dim(1)?;
    let window = Tensor::cat(&[cache, x], 1)?; // [B, K−1+T, C]
    let y = causal_conv1d(&window, weight)?;
    let rows = (0..b_sz)
        .map(|b| {
            let len = lengths.map_or(seq_len, |l| l[b]);
            window.narrow(0, b, 1)?.narrow(1, len, keep)
        })
        .collect::<Result<Vec<_>>>()?;
    let next = Tensor::cat(&rows, 0)?.reshape((b_sz, keep, channels))?;
    Ok((y, next))
}
