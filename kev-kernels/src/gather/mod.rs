//! Whole rows picked by index ([`gather_rows`]): the prefix cache copied once per branch; token
//! embeddings ([`embed`]); picked rows each followed by rows of their own ([`gather_cat`]): a
//! branch's attention keys; a strided view's rows made contiguous ([`copy_rows`]); and views
//! packed into buffers of their own ([`pack`]): a pass's kept states, one allocation a state.
//! candle's CUDA `index_select` finds every element's source with 64-bit divisions; whole rows
//! can move as 16-byte words, a few times faster on the 4B model's f32 recurrent states. And a
//! forward that launches no candle kernel never loads candle's PTX modules, which the driver
//! takes seconds each to translate in a fresh process.

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "metal")]
mod metal;

use candle_core::Layout;
#[cfg(any(feature = "cuda", feature = "metal"))]
use candle_core::Shape;
use candle_core::{bail, CustomOp1, CustomOp2, CustomOp3, DType, Device, Result, Tensor};

use crate::dispatch::{self, backend, counted_cat, Backend, CountedTensor};

/// Row indices, checked and uploaded once for any number of [`gather_rows`] calls.
#[derive(Clone)]
pub struct RowIndex {
    /// `[N]` u32 on the device.
    idx: Tensor,
    /// The largest index, checked against each source's row count.
    max: Option<usize>,
}

impl RowIndex {
    /// Uploads `rows` to `device`.
    pub fn new(rows: &[usize], device: &Device) -> Result<Self> {
        let idx = rows
            .iter()
            .map(|&r| u32::try_from(r))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| {
                candle_core::Error::Msg(format!("gather-rows: row index over u32 in {rows:?}"))
            })?;
        Ok(Self {
            idx: crate::uploads::upload(idx, rows.len(), device)?,
            max: rows.iter().copied().max(),
        })
    }

    /// `idx`, `[N]` u32 already on the device and holding `rows`, as an index. For indices that
    /// are a CUDA graph's input, rewritten between replays: those must be copies of their own, not
    /// the upload memo's tensors ([`crate::uploads`]), which [`RowIndex::new`] returns while a
    /// graph is recorded.
    pub fn on_device(idx: Tensor, rows: &[usize]) -> Result<Self> {
        if idx.dtype() != DType::U32 || idx.dims() != [rows.len()] {
            bail!(
                "row index: {:?} {:?} on the device for {} rows",
                idx.dtype(),
                idx.dims(),
                rows.len()
            )
        }
        Ok(Self {
            idx,
            max: rows.iter().copied().max(),
        })
    }

    /// The largest row picked (none: nothing is picked).
    pub fn max(&self) -> Option<usize> {
        self.max
    }

    /// Number of rows picked.
    pub fn len(&self) -> usize {
        self.idx.elem_count()
    }

    /// The indices, `[N]` u32 on the device.
    pub(crate) fn tensor(&self) -> &Tensor {
        &self.idx
    }

    /// Whether no row is picked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fails when a row picked is not one of `t`'s `src_rows` (its first dim).
    pub(crate) fn check_within(&self, op: &str, t: &Tensor, src_rows: usize) -> Result<()> {
        if let Some(max) = self.max.filter(|&m| m >= src_rows) {
            bail!(
                "{op}: row {max} of a tensor with {src_rows} rows ({:?})",
                t.dims()
            )
        }
        Ok(())
    }
}

/// Whether the CUDA word kernels can copy `t`'s rows of `row_bytes` bytes: a CUDA float tensor,
/// contiguous, starting and breaking rows on 16-byte boundaries (CUDA: [`backend`]'s).
fn in_words(t: &Tensor, row_bytes: usize) -> bool {
    backend(t.device()) == Backend::Cuda
        && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && t.is_contiguous()
        && (t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(16)
        && row_bytes.is_multiple_of(16)
}

/// Whether the Metal kernels copy `t`'s rows of `row_bytes` bytes: a Metal float tensor,
/// contiguous, rows of whole 2-byte units (Metal: [`backend`]'s).
fn on_metal(t: &Tensor, row_bytes: usize) -> bool {
    backend(t.device()) == Backend::Metal
        && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && t.is_contiguous()
        && row_bytes.is_multiple_of(2)
}

/// The CUDA and Metal op; the CPU takes `index_select`.
struct GatherRows;

impl CustomOp2 for GatherRows {
    fn name(&self) -> &'static str {
        "gather-rows"
    }

    cuda_only_cpu_fwd!("gather-rows: the CPU takes index_select", _a _la, _b _lb);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ts: &candle_core::CudaStorage,
        tl: &Layout,
        is: &candle_core::CudaStorage,
        il: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let mut dims = tl.dims().to_vec();
        dims[0] = il.dims()[0];
        Ok((cuda::gather_parts(ts, tl, &[(is, il)])?, Shape::from(dims)))
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        ts: &candle_core::MetalStorage,
        tl: &Layout,
        is: &candle_core::MetalStorage,
        il: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        let mut dims = tl.dims().to_vec();
        dims[0] = il.dims()[0];
        Ok((metal::gather_rows(ts, tl, is, il)?, Shape::from(dims)))
    }
}

/// Rows `rows` of `t: [R, ..]` (repeats allowed) as a new `[N, ..]` tensor with storage of its
/// own, like `t.index_select(idx, 0)`. On CUDA a row moves as 16-byte words when its size and
/// start allow it (the cache tensors' always do); on Metal as 4- or 2-byte units (a float
/// tensor, contiguous); otherwise, and on the CPU, this is `index_select`.
pub fn gather_rows(t: &Tensor, rows: &RowIndex) -> Result<Tensor> {
    let src_rows = t.dims().first().copied().unwrap_or(0);
    rows.check_within("gather-rows", t, src_rows)?;
    let row_bytes = t
        .elem_count()
        .checked_div(src_rows)
        .map_or(0, |elems| elems * t.dtype().size_in_bytes());
    let fused = (in_words(t, row_bytes) || on_metal(t, row_bytes)) && !rows.is_empty();
    if row_bytes > 0 && fused {
        dispatch::launch(
            "gather-rows",
            1,
            t.device(),
            || t.apply_op2_no_bwd(&rows.idx, &GatherRows),
            || t.index_select(&rows.idx, 0),
        )
    } else {
        t.counted_index_select(&rows.idx, 0)
    }
}

/// The CUDA and Metal op of [`gather_cat`]; the CPU composes it.
struct GatherCat;

impl CustomOp3 for GatherCat {
    fn name(&self) -> &'static str {
        "gather-cat"
    }

    cuda_only_cpu_fwd!("gather-cat: the CPU composes index_select and cat", _a _la, _b _lb, _c _lc);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
        is: &candle_core::CudaStorage,
        il: &Layout,
        ts: &candle_core::CudaStorage,
        tl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (_, heads, s_len, d) = sl.shape().dims4()?;
        let (n, _, t_len, _) = tl.shape().dims4()?;
        let out = cuda::gather_cat(ss, sl, is, il, ts, tl)?;
        Ok((out, Shape::from((n, heads, s_len + t_len, d))))
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        ss: &candle_core::MetalStorage,
        sl: &Layout,
        is: &candle_core::MetalStorage,
        il: &Layout,
        ts: &candle_core::MetalStorage,
        tl: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        let (_, heads, s_len, d) = sl.shape().dims4()?;
        let (n, _, t_len, _) = tl.shape().dims4()?;
        let out = metal::gather_cat(ss, sl, is, il, ts, tl)?;
        Ok((out, Shape::from((n, heads, s_len + t_len, d))))
    }
}

/// Rows `rows` of `src: [R, H, S, d]`, row i followed by row i of `tail: [B, H, T, d]` along the
/// steps: `[B, H, S + T, d]`, equal to `cat([gather_rows(src, rows), tail], 2)`. Attention's
/// keys and values of a branch row: its state row's, then its own. On CUDA (16-byte words, where
/// both parts' rows allow them) and Metal (contiguous float tensors) one copy instead of two.
pub fn gather_cat(src: &Tensor, rows: &RowIndex, tail: &Tensor) -> Result<Tensor> {
    let (src_rows, heads, s_len, d) = src.dims4()?;
    let (n, t_heads, t_len, t_d) = tail.dims4()?;
    if (t_heads, t_d) != (heads, d) || n != rows.len() || src.dtype() != tail.dtype() {
        bail!(
            "gather-cat: {} rows of {:?} ({:?}) cannot head a tail of {:?} ({:?})",
            rows.len(),
            src.dims(),
            src.dtype(),
            tail.dims(),
            tail.dtype()
        )
    }
    rows.check_within("gather-cat", src, src_rows)?;
    let row_bytes = |steps: usize| steps * d * src.dtype().size_in_bytes();
    let cuda = in_words(src, row_bytes(s_len))
        && in_words(tail, row_bytes(t_len))
        && (1..=65535).contains(&(n * heads));
    let metal = on_metal(src, row_bytes(s_len)) && on_metal(tail, row_bytes(t_len)) && n > 0;
    if (s_len + t_len) * d > 0 && (cuda || metal) {
        dispatch::launch(
            "gather-cat",
            1,
            src.device(),
            || src.apply_op3_no_bwd(&rows.idx, tail, &GatherCat),
            || Tensor::cat(&[&gather_rows(src, rows)?, tail], 2),
        )
    } else {
        counted_cat(&[&gather_rows(src, rows)?, tail], 2)
    }
}

/// The CUDA op of [`embed`]: the table is its operand, the id parts ride along.
// Read by the CUDA launch only.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Embed {
    ids: Vec<Tensor>,
}

impl CustomOp1 for Embed {
    fn name(&self) -> &'static str {
        "embed"
    }

    cuda_only_cpu_fwd!("embed: the CPU takes index_select", _a _la);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ts: &candle_core::CudaStorage,
        tl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let guards: Vec<_> = self.ids.iter().map(|t| t.storage_and_layout()).collect();
        let parts = guards
            .iter()
            .map(|(s, l)| Ok((crate::backend::cuda::kernel::cuda_of(s, "embed: ids")?, *l)))
            .collect::<Result<Vec<_>>>()?;
        let n: usize = self.ids.iter().map(Tensor::elem_count).sum();
        let out = cuda::gather_parts(ts, tl, &parts)?;
        Ok((out, Shape::from((n, tl.dims()[1]))))
    }
}

/// The rows of `table: [V, H]` for every id of `ids` (u32 tensors of any shape, one part after
/// another): `[N, H]`, as `index_select` of the joined ids. On CUDA (rows of whole 16-byte words)
/// one kernel per part writes them straight into place; elsewhere the ids are joined and
/// `index_select` picks. Ids come checked against the vocabulary (the tokenizer's largest id
/// at load); on CUDA one past the table would read as a row of zeros.
pub fn embed(table: &Tensor, ids: &[&Tensor]) -> Result<Tensor> {
    let (_, hidden) = table.dims2()?;
    let flat = ids
        .iter()
        .map(|t| t.flatten_all())
        .collect::<Result<Vec<_>>>()?;
    if let Some(bad) = flat.iter().find(|t| t.dtype() != DType::U32) {
        bail!("embed: ids of {:?}, not u32", bad.dtype())
    }
    let n: usize = flat.iter().map(Tensor::elem_count).sum();
    let composed = || index_select_joined(table, &flat);
    if n > 0 && in_words(table, hidden * table.dtype().size_in_bytes()) {
        dispatch::launch(
            "embed",
            flat.iter().filter(|t| t.elem_count() > 0).count(),
            table.device(),
            || {
                let flat = flat
                    .iter()
                    .map(Tensor::contiguous)
                    .collect::<Result<Vec<_>>>()?;
                table.apply_op1_no_bwd(&Embed { ids: flat })
            },
            composed,
        )
    } else {
        composed()
    }
}

/// `index_select` of the ids joined, counted.
fn index_select_joined(table: &Tensor, ids: &[Tensor]) -> Result<Tensor> {
    table.counted_index_select(&counted_cat(ids, 0)?, 0)
}

/// `t` with storage of its own, contiguous (a copy unless it already is). On CUDA, where the
/// last dim is contiguous and its rows and the outer strides are whole 16-byte words, one Kev
/// kernel copies whole rows; otherwise candle's copy.
pub fn copy_rows(t: &Tensor) -> Result<Tensor> {
    if t.is_contiguous() {
        return Ok(t.clone());
    }
    let size = t.dtype().size_in_bytes();
    let l = t.layout();
    let rank = t.rank();
    let words = |elems: usize| (elems * size).is_multiple_of(16);
    let fits = backend(t.device()) == Backend::Cuda
        && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && (2..=4).contains(&rank)
        && l.stride()[rank - 1] == 1
        && words(t.dims()[rank - 1])
        && words(l.start_offset())
        && l.stride()[..rank - 1].iter().all(|&s| words(s))
        && t.elem_count() > 0;
    if fits {
        dispatch::launch(
            "copy-rows",
            1,
            t.device(),
            || t.apply_op1_no_bwd(&CopyRows),
            || t.contiguous(),
        )
    } else {
        t.counted_contiguous()
    }
}

/// The CUDA op of [`copy_rows`].
struct CopyRows;

impl CustomOp1 for CopyRows {
    fn name(&self) -> &'static str {
        "copy-rows"
    }

    cuda_only_cpu_fwd!("copy-rows: the CPU takes contiguous", _a _la);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((cuda::copy_rows(ss, sl)?, sl.shape().clone()))
    }
}

/// `parts` (each `[n_i, ..]`, the same trailing dims and dtype) joined along the first dim, as
/// `Tensor::cat(parts, 0)`. On CUDA device-to-device copies into one buffer (candle's `cat`
/// launches a kernel from one of its PTX modules); elsewhere `cat`.
pub fn join_rows(parts: &[&Tensor]) -> Result<Tensor> {
    let Some(first) = parts.first() else {
        bail!("join-rows: no part")
    };
    let (dtype, rest) = (first.dtype(), &first.dims()[1.min(first.rank())..]);
    if let Some(bad) = parts
        .iter()
        .find(|p| p.rank() == 0 || p.dtype() != dtype || &p.dims()[1..] != rest)
    {
        bail!(
            "join-rows: {:?} {:?} does not join {:?} {:?}",
            bad.dims(),
            bad.dtype(),
            first.dims(),
            dtype
        )
    }
    let on_cuda = backend(first.device()) == Backend::Cuda
        && matches!(dtype, DType::F32 | DType::BF16 | DType::F16 | DType::U32);
    if parts.len() > 1 && on_cuda {
        let parts = parts
            .iter()
            .map(|p| p.counted_contiguous())
            .collect::<Result<Vec<_>>>()?;
        let copies = parts.iter().filter(|p| p.elem_count() > 0).count();
        // Device-to-device copies: no kernel of candle's or Kev's.
        dispatch::record("memcpy", copies);
        if dispatch::stands_in(first.device()) {
            return dispatch::uncounted(|| Tensor::cat(&parts, 0));
        }
        let op = JoinRows {
            rest: parts[1..].to_vec(),
        };
        return parts[0].apply_op1_no_bwd(&op);
    }
    counted_cat(parts, 0)
}

/// The CUDA op of [`join_rows`]: the first part is the operand, the others ride along.
// Read by the CUDA launch only.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct JoinRows {
    rest: Vec<Tensor>,
}

impl CustomOp1 for JoinRows {
    fn name(&self) -> &'static str {
        "join-rows"
    }

    cuda_only_cpu_fwd!("join-rows: the CPU takes cat", _a _la);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        fs: &candle_core::CudaStorage,
        fl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let guards: Vec<_> = self.rest.iter().map(|t| t.storage_and_layout()).collect();
        let mut parts = vec![(fs, fl)];
        for (s, l) in &guards {
            parts.push((
                crate::backend::cuda::kernel::cuda_of(s, "join-rows: a part")?,
                *l,
            ));
        }
        let out = cuda::join_rows(&parts)?;
        let mut dims = fl.dims().to_vec();
        dims[0] = parts.iter().map(|(_, l)| l.dims()[0]).sum();
        Ok((out, Shape::from(dims)))
    }
}

/// Each group's views (one dtype a group, any layout) copied one after another, each in row-major
/// order, into one new 1-D tensor of the group's own: `[Σ elements]`, equal to `cat` of the views
/// flattened. A pass's kept states, one group a state and dtype: one allocation a state instead
/// of one a tensor. On CUDA (float dtypes, every contiguous run of every view whole 16-byte words
/// at 16-byte offsets) one kernel copies every run of every group; elsewhere each group is that
/// `cat`.
pub fn pack(groups: &[Vec<Tensor>]) -> Result<Vec<Tensor>> {
    let Some(first) = groups.iter().flatten().next() else {
        return Ok(Vec::new());
    };
    let device = first.device().clone();
    for group in groups {
        let Some(head) = group.first() else {
            bail!("pack: an empty group")
        };
        if let Some(bad) = group
            .iter()
            .find(|t| t.dtype() != head.dtype() || !t.device().same_device(&device))
        {
            bail!(
                "pack: a {:?} view on {:?} in a group of {:?} on {:?}",
                bad.dtype(),
                bad.device().location(),
                head.dtype(),
                device.location()
            )
        }
    }
    let composed = || {
        groups
            .iter()
            .map(|g| {
                let flat = g
                    .iter()
                    .map(|t| t.counted_contiguous()?.flatten_all())
                    .collect::<Result<Vec<_>>>()?;
                counted_cat(&flat, 0)
            })
            .collect::<Result<Vec<_>>>()
    };
    let runs = (backend(&device) == Backend::Cuda)
        .then(|| fused_runs(groups))
        .flatten();
    let Some(runs) = runs else {
        return composed();
    };
    // The distinct dtypes in the order groups first hold them: one launch each.
    let mut dtypes: Vec<DType> = Vec::new();
    for g in groups {
        if !dtypes.contains(&g[0].dtype()) {
            dtypes.push(g[0].dtype());
        }
    }
    dispatch::launch(
        "pack",
        dtypes.len(),
        &device,
        || pack_on_gpu(groups, &runs, &dtypes),
        composed,
    )
}

/// Each view's `(start, elements)` runs, for one group of [`pack`].
type GroupRuns = Vec<Vec<(usize, usize)>>;

/// The most runs one [`pack`] launch copies (a table of 24 bytes a run); past it, or for views
/// of short runs, the composed copies.
const MAX_PACK_RUNS: usize = 1 << 20;

/// Every view's runs where CUDA's one copy takes them all: float views whose every run is whole
/// 16-byte words at a 16-byte offset, each group holding some elements, at most
/// [`MAX_PACK_RUNS`] runs in all. `None`: the composed copies.
fn fused_runs(groups: &[Vec<Tensor>]) -> Option<Vec<GroupRuns>> {
    let mut budget = MAX_PACK_RUNS;
    groups
        .iter()
        .map(|g| {
            let runs = g
                .iter()
                .map(|t| {
                    let size = t.dtype().size_in_bytes();
                    let words = |elems: usize| (elems * size).is_multiple_of(16);
                    if !matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16) {
                        return None;
                    }
                    let runs = runs(t.layout(), budget)?;
                    budget -= runs.len();
                    runs.iter()
                        .all(|&(at, n)| words(at) && words(n))
                        .then_some(runs)
                })
                .collect::<Option<Vec<_>>>()?;
            runs.iter().flatten().any(|&(_, n)| n > 0).then_some(runs)
        })
        .collect()
}

/// [`pack`]'s launches, one for each of `dtypes` (a launch's table holds one element size).
#[cfg(feature = "cuda")]
fn pack_on_gpu(
    groups: &[Vec<Tensor>],
    runs: &[GroupRuns],
    dtypes: &[DType],
) -> Result<Vec<Tensor>> {
    use candle_core::{op::BackpropOp, Storage};
    let Device::Cuda(dev) = groups[0][0].device() else {
        bail!("pack: not on a CUDA device")
    };
    let mut out: Vec<Option<Tensor>> = vec![None; groups.len()];
    for &dtype in dtypes {
        let picked: Vec<usize> = (0..groups.len())
            .filter(|&g| groups[g][0].dtype() == dtype)
            .collect();
        let guards: Vec<Vec<_>> = picked
            .iter()
            .map(|&g| groups[g].iter().map(Tensor::storage_and_layout).collect())
            .collect();
        let parts = picked
            .iter()
            .zip(&guards)
            .map(|(&g, guards)| {
                guards
                    .iter()
                    .zip(&runs[g])
                    .map(|((s, _), r)| {
                        let s = crate::backend::cuda::kernel::cuda_of(s, "pack: a view")?;
                        Ok((s, r.clone()))
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        let storages = cuda::pack(dev, dtype, &parts)?;
        for (&g, storage) in picked.iter().zip(storages) {
            let elems = groups[g].iter().map(Tensor::elem_count).sum::<usize>();
            out[g] = Some(Tensor::from_storage(
                Storage::Cuda(storage),
                elems,
                BackpropOp::none(),
                false,
            ));
        }
    }
    out.into_iter()
        .map(|t| t.ok_or_else(|| candle_core::Error::Msg("pack: a group left out".into())))
        .collect()
}

#[cfg(not(feature = "cuda"))]
fn pack_on_gpu(_: &[Vec<Tensor>], _: &[GroupRuns], _: &[DType]) -> Result<Vec<Tensor>> {
    bail!("pack: built without CUDA")
}

/// A view's contiguous runs in its storage, `(start, elements)` in row-major order: the trailing
/// dims laid out one after another make one run, the leading ones repeat it. `None` where there
/// would be more than `max` runs (the list is never built then).
fn runs(l: &Layout, max: usize) -> Option<Vec<(usize, usize)>> {
    let (dims, strides) = (l.dims(), l.stride());
    if l.shape().elem_count() == 0 {
        return Some(Vec::new());
    }
    let (mut inner, mut run) = (dims.len(), 1);
    while inner > 0 && (dims[inner - 1] == 1 || strides[inner - 1] == run) {
        run *= dims[inner - 1];
        inner -= 1;
    }
    let outer = &dims[..inner];
    let count = outer.iter().try_fold(1usize, |n, &d| n.checked_mul(d))?;
    if count > max {
        return None;
    }
    let mut index = vec![0usize; inner];
    let mut out = Vec::with_capacity(count);
    loop {
        let at = l.start_offset() + index.iter().zip(strides).map(|(i, s)| i * s).sum::<usize>();
        out.push((at, run));
        // The next outer index, last dim fastest; done when it wraps around.
        let Some(d) = (0..inner).rev().find(|&d| index[d] + 1 < outer[d]) else {
            return Some(out);
        };
        index[d] += 1;
        index[d + 1..].iter_mut().for_each(|i| *i = 0);
    }
}
