//! Counting the GPU dispatches a forward issues, on the CPU: a GPU forward is launch-bound, and
//! how many kernels each backend launches per layer is a figure worth knowing without the GPU.
//!
//! [`count`] runs a closure on this thread with counting on for a [`Backend`]. While it runs on
//! a CPU device, every op makes the choices it would make on that backend ([`backend`]: fused
//! kernel or composed fallback, from the same functions that choose at runtime), and each
//! candle op or kernel launch at the ops' boundary adds what it costs there to the [`Tally`]:
//!
//! - a kernel of Kev's own: its launches on that backend (CUDA `launch`, Metal
//!   `dispatch_thread_groups`), recorded where the op applies it ([`record`]); where that
//!   kernel has no CPU form, the op computes the same values with its composed form, uncounted;
//! - a candle op: the kernels candle's `cuda_backend` / `metal_backend` issue for it
//!   ([`CountedTensor`], [`counted_cat`], [`counted_zeros`], [`counted`]).
//!
//! A composed fallback is counted by running it through these wrappers, not by a number typed
//! for it; a fallback not routed through them records itself as [`UNCOUNTED`] instead, so a
//! count that reached one says so. Views (narrow, squeeze, transpose, a reshape of a contiguous
//! tensor) launch nothing. Host-to-device uploads (token ids, RoPE positions, key biases, lengths,
//! the dims and strides CUDA's strided candle kernels upload) are not counted.
//!
//! Off counting, each hook costs one thread-local read (none for the choices on a GPU device).

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

use candle_core::{DType, Device, Result, Shape, Tensor};

/// The backend whose choices the ops make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    /// Counted as Kev's H200: tensor cores, 132 multiprocessors, 227 KB of shared memory per
    /// block (the flash kernel's and the chunked delta rule's choices read them).
    Cuda,
    Metal,
}

/// The op name recorded by a composed path that is not routed through the counting wrappers:
/// a tally holding it undercounts.
pub const UNCOUNTED: &str = "uncounted composed path";

/// Dispatches counted per (layer, op name); `None`: outside any layer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    counts: BTreeMap<(Option<usize>, &'static str), usize>,
    /// The ops among them that launch a kernel of candle's own ([`Tally::candle_kernels`]).
    candle: BTreeSet<&'static str>,
}

impl Tally {
    /// All dispatches.
    pub fn total(&self) -> usize {
        self.counts.values().sum()
    }

    /// The dispatches of layer `layer` (`None`: outside the layers).
    pub fn of_layer(&self, layer: Option<usize>) -> usize {
        self.counts
            .iter()
            .filter(|((l, _), _)| *l == layer)
            .map(|(_, n)| n)
            .sum()
    }

    /// Per (layer, op name), in order.
    pub fn entries(&self) -> impl Iterator<Item = (Option<usize>, &'static str, usize)> + '_ {
        self.counts.iter().map(|(&(l, op), &n)| (l, op, n))
    }

    /// The dispatches that launch a kernel of candle's own, per (layer, op name): on CUDA one
    /// from candle's PTX modules, which the driver translates when a process first uses one
    /// (seconds each on a fresh machine); on Metal one from candle's Metal libraries, compiled
    /// at first use. cuBLAS GEMMs, memsets and device-to-device copies are not among them.
    pub fn candle_kernels(&self) -> Vec<(Option<usize>, &'static str, usize)> {
        self.entries()
            .filter(|(_, op, _)| self.candle.contains(op))
            .collect()
    }

    /// Whether every composed path that ran was counted (none recorded [`UNCOUNTED`]).
    pub fn is_complete(&self) -> bool {
        self.counts.keys().all(|(_, op)| *op != UNCOUNTED)
    }
}

struct Counter {
    backend: Backend,
    layer: Option<usize>,
    paused: bool,
    tally: Tally,
}

thread_local! {
    static COUNTER: RefCell<Option<Counter>> = const { RefCell::new(None) };
}

/// Runs `run` with counting on for `backend` on this thread; returns its result and what it
/// dispatched. Counting is meant for CPU tensors: on a GPU device, the ops choose for that
/// device as always and only the counts follow `backend`.
pub fn count<T>(backend: Backend, run: impl FnOnce() -> T) -> (T, Tally) {
    let outer = COUNTER.with(|c| {
        c.borrow_mut().replace(Counter {
            backend,
            layer: None,
            paused: false,
            tally: Tally::default(),
        })
    });
    let out = run();
    let counter = COUNTER.with(|c| std::mem::replace(&mut *c.borrow_mut(), outer));
    (out, counter.map(|c| c.tally).unwrap_or_default())
}

/// Runs `run` with its dispatches counted as layer `layer`'s.
pub fn in_layer<T>(layer: usize, run: impl FnOnce() -> T) -> T {
    let outer = COUNTER.with(|c| c.borrow_mut().as_mut().map(|c| c.layer.replace(layer)));
    let out = run();
    if let Some(outer) = outer {
        COUNTER.with(|c| {
            if let Some(c) = c.borrow_mut().as_mut() {
                c.layer = outer;
            }
        });
    }
    out
}

/// The backend being counted for on this thread, for work handed to other threads
/// ([`choose_as`]).
pub fn counting_for() -> Option<Backend> {
    counted_backend()
}

/// Runs `run` with the ops choosing for `backend` (what [`counting_for`] gave on the thread
/// that handed the work over), its dispatches not counted; `None`: as it is.
pub fn choose_as<T>(backend: Option<Backend>, run: impl FnOnce() -> T) -> T {
    match backend {
        Some(backend) => count(backend, run).0,
        None => run(),
    }
}

/// Adds `dispatches` of `op` to the running count (none running: nothing).
pub fn record(op: &'static str, dispatches: usize) {
    record_as(op, dispatches, false);
}

/// [`record`] for an op that launches candle kernels ([`Tally::candle_kernels`]).
fn record_candle(op: &'static str, dispatches: usize) {
    record_as(op, dispatches, true);
}

fn record_as(op: &'static str, dispatches: usize, candle: bool) {
    COUNTER.with(|c| {
        if let Some(c) = c.borrow_mut().as_mut().filter(|c| !c.paused) {
            *c.tally.counts.entry((c.layer, op)).or_default() += dispatches;
            if candle {
                c.tally.candle.insert(op);
            }
        }
    });
}

/// The backend whose choices the ops make for `device`: its own, or on the CPU while a count
/// runs, the counted one.
pub fn backend(device: &Device) -> Backend {
    match device {
        Device::Cuda(_) => Backend::Cuda,
        Device::Metal(_) => Backend::Metal,
        Device::Cpu => counted_backend().unwrap_or(Backend::Cpu),
    }
}

/// The backend being counted for, if a count runs (and is not paused).
fn counted_backend() -> Option<Backend> {
    COUNTER.with(|c| c.borrow().as_ref().filter(|c| !c.paused).map(|c| c.backend))
}

/// Whether a kernel chosen for `device` runs as a stand-in: on the CPU while counting for a
/// GPU, whose kernel the CPU does not have.
pub(crate) fn stands_in(device: &Device) -> bool {
    device.is_cpu() && backend(device) != Backend::Cpu
}

/// Runs `run` with counting paused (a stand-in computing what a counted kernel would), and
/// the ops choosing for the CPU.
pub(crate) fn uncounted<T>(run: impl FnOnce() -> T) -> T {
    let outer = COUNTER.with(|c| {
        c.borrow_mut()
            .as_mut()
            .map(|c| std::mem::replace(&mut c.paused, true))
    });
    let out = run();
    if let Some(outer) = outer {
        COUNTER.with(|c| {
            if let Some(c) = c.borrow_mut().as_mut() {
                c.paused = outer;
            }
        });
    }
    out
}

/// A kernel of Kev's own: records its `launches` and runs `kernel`, or on the CPU while
/// counting for a GPU, computes the same values with `stand_in` (uncounted).
pub(crate) fn launch<T>(
    op: &'static str,
    launches: usize,
    device: &Device,
    kernel: impl FnOnce() -> Result<T>,
    stand_in: impl FnOnce() -> Result<T>,
) -> Result<T> {
    record(op, launches);
    if stands_in(device) {
        uncounted(stand_in)
    } else {
        kernel()
    }
}

/// `run`, a candle op that launches one kernel on either GPU backend (binary, unary, affine
/// and reduce ops: `binary_impl`, `unary_impl`, `affine`, `reduce_op` of candle-core 0.11.1's
/// `cuda_backend` and `metal_backend`; `candle_nn::Embedding::forward`, one `index_select`
/// between views), recorded as `op`.
pub fn counted<T>(op: &'static str, run: impl FnOnce() -> Result<T>) -> Result<T> {
    record_candle(op, 1);
    run()
}

/// Records one GEMM on `device`'s backend: cuBLAS on CUDA, candle's own kernel on Metal.
pub fn record_matmul(device: &Device) {
    if backend(device) == Backend::Metal {
        record_candle("matmul", 1);
    } else {
        record("matmul", 1);
    }
}

/// Candle's tensor ops that may launch work, each recording what it launches on a GPU.
///
/// Per candle-core 0.11.1: a copy (`Tensor::contiguous`, `force_contiguous`, `reshape` of a
/// non-contiguous tensor) is one `copy_strided_src` (CUDA: `memcpy_dtod` for a contiguous
/// source, else a `ucopy_*` kernel; Metal: a blit or a strided copy kernel); `to_dtype` to
/// another dtype one cast kernel; `matmul` one GEMM call (cuBLAS `gemm_strided_batched`, Metal
/// `call_mlx_gemm`, a candle kernel); `index_select` one kernel.
pub trait CountedTensor: Sized {
    /// `contiguous`: a copy unless it already is.
    fn counted_contiguous(&self) -> Result<Tensor>;
    /// `force_contiguous`: always a copy.
    fn counted_force_contiguous(&self) -> Result<Tensor>;
    /// `reshape`: a view of a contiguous tensor, else a copy.
    fn counted_reshape<S: candle_core::shape::ShapeWithOneHole>(&self, shape: S) -> Result<Tensor>;
    /// `flatten(start, end)`: a `reshape`.
    fn counted_flatten(&self, start: usize, end: usize) -> Result<Tensor>;
    /// `to_dtype`: nothing to the same dtype, else a cast.
    fn counted_to_dtype(&self, dtype: DType) -> Result<Tensor>;
    /// `matmul`: one GEMM.
    fn counted_matmul(&self, rhs: &Tensor) -> Result<Tensor>;
    /// `index_select`: one kernel.
    fn counted_index_select(&self, ids: &Tensor, dim: usize) -> Result<Tensor>;
}

impl CountedTensor for Tensor {
    fn counted_contiguous(&self) -> Result<Tensor> {
        if !self.is_contiguous() {
            record_candle("copy", 1);
        }
        self.contiguous()
    }

    fn counted_force_contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            record("memcpy", 1);
        } else {
            record_candle("copy", 1);
        }
        self.force_contiguous()
    }

    fn counted_reshape<S: candle_core::shape::ShapeWithOneHole>(&self, shape: S) -> Result<Tensor> {
        if !self.is_contiguous() {
            record_candle("copy", 1);
        }
        self.reshape(shape)
    }

    fn counted_flatten(&self, start: usize, end: usize) -> Result<Tensor> {
        if start < end && !self.is_contiguous() {
            record_candle("copy", 1);
        }
        self.flatten(start, end)
    }

    fn counted_to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if self.dtype() != dtype {
            record_candle("cast", 1);
        }
        self.to_dtype(dtype)
    }

    fn counted_matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        record_matmul(self.device());
        self.matmul(rhs)
    }

    fn counted_index_select(&self, ids: &Tensor, dim: usize) -> Result<Tensor> {
        record_candle("index-select", 1);
        self.index_select(ids, dim)
    }
}

/// `Tensor::cat`: one copy per part (`cat_contiguous`'s `copy2d` or `cat0`'s
/// `copy_strided_src`), none for a single part.
pub fn counted_cat<A: AsRef<Tensor>>(parts: &[A], dim: usize) -> Result<Tensor> {
    if parts.len() > 1 {
        record_candle("cat", parts.len());
    }
    Tensor::cat(parts, dim)
}

/// `Tensor::zeros`: one fill (CUDA `alloc_zeros`, a memset; Metal `allocate_zeros`, a blit
/// fill).
pub fn counted_zeros<S: Into<Shape>>(shape: S, dtype: DType, device: &Device) -> Result<Tensor> {
    record("zeros", 1);
    Tensor::zeros(shape, dtype, device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_only_inside_count_and_per_layer() -> Result<()> {
        let t = Tensor::zeros((2, 3), DType::F32, &Device::Cpu)?;
        record("outside", 5);
        let (_, tally) = count(Backend::Metal, || -> Result<()> {
            assert_eq!(backend(&Device::Cpu), Backend::Metal);
            t.t()?.counted_contiguous()?; // a copy
            t.counted_contiguous()?; // already contiguous
            in_layer(3, || t.counted_matmul(&t.t()?))?;
            uncounted(|| t.counted_to_dtype(DType::BF16))?;
            Ok(())
        });
        assert_eq!(backend(&Device::Cpu), Backend::Cpu);
        assert_eq!(tally.of_layer(None), 1);
        assert_eq!(tally.of_layer(Some(3)), 1);
        assert_eq!(tally.total(), 2);
        assert!(tally.is_complete());
        Ok(())
    }
}
