//! `kev.DecisionModel`, `kev.Prefix` and `kev.Encoding`: thin wrappers over the library's types.
//!
//! [`kev::DecisionModel`] is `Send + Sync` (immutable after loading, every method takes `&self`),
//! so the class is `frozen`: Python threads share one model without a lock, and each call runs
//! with the GIL released.

use std::path::PathBuf;

use candle_core::DeviceLocation;
use kev::score::{batch_ranges, Scorer};
use kev::{Backend, DType, LoadOptions};
use numpy::ndarray::{ArrayD, IxDyn};
use numpy::{PyArray1, PyArrayDyn};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::OrRaise;
use crate::records;

/// Per question, its values as a float32 array.
fn arrays(py: Python<'_>, per_question: Vec<Vec<f32>>) -> Vec<Bound<'_, PyArray1<f32>>> {
    per_question
        .into_iter()
        .map(|v| PyArray1::from_vec(py, v))
        .collect()
}

/// `e` from a batch starting at record `start` of the call, naming the record by its index in
/// the call.
fn in_call(e: kev::Error, start: usize) -> kev::Error {
    match e {
        kev::Error::NonFinite {
            id,
            index,
            question,
        } => kev::Error::NonFinite {
            id,
            index: start + index,
            question,
        },
        e => e,
    }
}

/// A Kev checkpoint loaded for scoring: backbone (LoRA folded in), pointer head and encoder.
///
/// Load with `DecisionModel.load(path)`. Records are dicts in the Kev record schema
/// (`{"id"?, "state", "questions": [{"id"?, "prompt", "options", "answer"?}]}`) or their JSON
/// text. Every method releases the GIL while the model computes, and one model can be used by
/// several threads at once.
#[pyclass(frozen, module = "kev", name = "DecisionModel")]
pub struct PyDecisionModel {
    inner: kev::DecisionModel,
}

#[pymethods]
impl PyDecisionModel {
    /// Loads the checkpoint folder `path` (holding `kev.json`).
    ///
    /// `backend`: "auto" (Metal on Apple Silicon, CUDA where built and present, else the CPU),
    /// "cpu", "cuda[:i]" or "metal[:i]". `dtype`: "auto" (f32 on the CPU, bf16 on GPUs), "f32",
    /// "bf16", "f16", "int8" (x86-64 CPU with AVX2 and FMA; approximate) or "fp8" (H100/H200;
    /// approximate). `lora_scale` interpolates the base (0) and the fine-tune (1).
    /// `prefill_chunk`: the longest piece, in tokens, one forward pass runs (default 2048).
    /// `cuda_graphs`: replay repeated shapes as CUDA graphs (CUDA only; default True).
    #[staticmethod]
    #[pyo3(signature = (path, backend = "auto", dtype = "auto", lora_scale = 1.0, *, prefill_chunk = None, cuda_graphs = true))]
    fn load(
        py: Python<'_>,
        path: PathBuf,
        backend: &str,
        dtype: &str,
        lora_scale: f64,
        prefill_chunk: Option<usize>,
        cuda_graphs: bool,
    ) -> PyResult<Self> {
        let mut options = LoadOptions::default()
            .with_backend(backend.parse::<Backend>().or_raise()?)
            .with_dtype(dtype.parse::<DType>().or_raise()?)
            .with_lora_scale(lora_scale)
            .with_cuda_graphs(cuda_graphs);
        if let Some(tokens) = prefill_chunk {
            options = options.with_prefill_chunk(tokens);
        }
        let inner = py
            .detach(|| kev::DecisionModel::load(&path, &options))
            .or_raise()?;
        Ok(Self { inner })
    }

    /// Token ids, segments and head positions of `record` (KEV.md §2). `line`, when given, is
    /// the record's line in its input file, named by any error.
    #[pyo3(signature = (record, *, line = None))]
    fn encode(
        &self,
        py: Python<'_>,
        record: &Bound<'_, PyAny>,
        line: Option<usize>,
    ) -> PyResult<PyEncoding> {
        let record = records::record(record, line)?;
        let encoding = py
            .detach(|| self.inner.encoder().encode(&record, line))
            .or_raise()?;
        Ok(PyEncoding { inner: encoding })
    }

    /// Logits per question (float32 arrays, one per question, one value per option).
    fn forward<'py>(
        &self,
        py: Python<'py>,
        record: &Bound<'py, PyAny>,
    ) -> PyResult<Vec<Bound<'py, PyArray1<f32>>>> {
        let record = records::record(record, None)?;
        let model = &self.inner;
        let scored = py
            .detach(|| {
                let encoded = model.encode_record(&record, None)?;
                model.run(&[encoded], &[], false)
            })
            .or_raise()?;
        Ok(arrays(
            py,
            scored
                .into_iter()
                .next()
                .map(|s| s.logits)
                .unwrap_or_default(),
        ))
    }

    /// Logits per question in row form (`state ++ branch_j` run alone for each question): the
    /// reference the fast prefix form is checked against; slower.
    fn forward_rows<'py>(
        &self,
        py: Python<'py>,
        record: &Bound<'py, PyAny>,
    ) -> PyResult<Vec<Bound<'py, PyArray1<f32>>>> {
        let record = records::record(record, None)?;
        let logits = py
            .detach(|| kev::reference::row_logits(&self.inner, &record))
            .or_raise()?;
        Ok(arrays(py, logits))
    }

    /// Probabilities per question (float32 arrays summing to 1, one value per option).
    fn probs<'py>(
        &self,
        py: Python<'py>,
        record: &Bound<'py, PyAny>,
    ) -> PyResult<Vec<Bound<'py, PyArray1<f32>>>> {
        let record = records::record(record, None)?;
        let probs = py.detach(|| self.inner.probs(&record)).or_raise()?;
        Ok(arrays(py, probs))
    }

    /// Probabilities per question, and the record's state as a `Prefix` for
    /// `probs_with_prefix` on the next record with the same state.
    fn probs_and_prefix<'py>(
        &self,
        py: Python<'py>,
        record: &Bound<'py, PyAny>,
    ) -> PyResult<(Vec<Bound<'py, PyArray1<f32>>>, PyPrefix)> {
        let record = records::record(record, None)?;
        let (probs, prefix) = py
            .detach(|| self.inner.probs_and_prefix(&record))
            .or_raise()?;
        Ok((arrays(py, probs), PyPrefix { inner: prefix }))
    }

    /// Probabilities per question, reusing `prefix` (computed from the same state by this model;
    /// a prefix of another state or from another model raises `PrefixError`). The prefix is not changed and can be reused again.
    fn probs_with_prefix<'py>(
        &self,
        py: Python<'py>,
        record: &Bound<'py, PyAny>,
        prefix: &Bound<'py, PyPrefix>,
    ) -> PyResult<Vec<Bound<'py, PyArray1<f32>>>> {
        let record = records::record(record, None)?;
        let prefix = &prefix.get().inner;
        let probs = py
            .detach(|| self.inner.probs_with_prefix(&record, prefix))
            .or_raise()?;
        Ok(arrays(py, probs))
    }

    /// Runs the state text `state` once into a `Prefix`.
    fn prefix(&self, py: Python<'_>, state: &str) -> PyResult<PyPrefix> {
        let prefix = py.detach(|| self.inner.prefix(state)).or_raise()?;
        Ok(PyPrefix { inner: prefix })
    }

    /// Probabilities for many records at once (a list of per-question arrays per record, in
    /// order): the records are encoded in parallel and run in batches of the device's token
    /// budget (as `score` runs them), each batch's states as one pass and its branches as
    /// another. Equal to scoring them one by one within float rounding; the first invalid record
    /// raises before any runs. Ctrl-C (any Python signal handler that raises) interrupts
    /// between batches.
    fn probs_batch<'py>(
        &self,
        py: Python<'py>,
        records: &Bound<'py, PyAny>,
    ) -> PyResult<Vec<Vec<Bound<'py, PyArray1<f32>>>>> {
        let records = records::records(records)?;
        let model = &self.inner;
        let encoded = py
            .detach(|| model.encode_records(&records))
            .map_err(|(_, e)| e)
            .or_raise()?;
        let batches = batch_ranges(
            encoded.iter().map(kev::EncodedRecord::tokens),
            Scorer::default_batch_tokens(model),
            usize::MAX,
        );
        let mut probs = Vec::with_capacity(encoded.len());
        for batch in batches {
            py.check_signals()?;
            let start = batch.start;
            let done = py
                .detach(|| model.run(&encoded[batch], &[], false))
                .map_err(|e| in_call(e, start))
                .or_raise()?;
            probs.extend(done.into_iter().map(|s| s.probs));
        }
        Ok(probs.into_iter().map(|p| arrays(py, p)).collect())
    }

    /// Probabilities for records whose states may be in `cache`, as one batch (a server's batch:
    /// no token-budget split, no Ctrl-C check): cached states do not run again, and the prefixes
    /// of the others are kept there for the next call (as `kev-serve` keeps them). Equal to
    /// `probs_batch` within float rounding.
    fn probs_cached<'py>(
        &self,
        py: Python<'py>,
        records: &Bound<'py, PyAny>,
        cache: &PyPrefixCache,
    ) -> PyResult<Vec<Vec<Bound<'py, PyArray1<f32>>>>> {
        let records = records::records(records)?;
        let model = &self.inner;
        let probs = py
            .detach(|| {
                let encoded = model.encode_records(&records).map_err(|(_, e)| e)?;
                cache.inner.probs(model, &encoded)
            })
            .or_raise()?;
        Ok(probs.into_iter().map(|p| arrays(py, p)).collect())
    }

    /// The pointer head's weights, float32 arrays by their names in `head.safetensors`:
    /// `q.weight` [dim, hidden], `q.bias` [dim], `k.weight` [dim, hidden], `k.bias` [dim].
    #[getter]
    fn head<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let dict = PyDict::new(py);
        for (name, tensor) in self.inner.head().tensors() {
            let read = |t: &candle_core::Tensor| -> candle_core::Result<Vec<f32>> {
                t.flatten_all()?.to_vec1::<f32>()
            };
            let data = read(tensor)
                .map_err(|e| kev::Error::backend(format!("reading head tensor `{name}`"), e))
                .or_raise()?;
            let array = ArrayD::from_shape_vec(IxDyn(tensor.dims()), data)
                .expect("a tensor's data fills its shape");
            dict.set_item(name, PyArrayDyn::from_owned_array(py, array))?;
        }
        Ok(dict)
    }

    /// The pointer head's projection size.
    #[getter]
    fn head_dim(&self) -> usize {
        self.inner.head().dim()
    }

    /// The pointer head's softmax temperature.
    #[getter]
    fn temperature(&self) -> f64 {
        self.inner.head().temperature()
    }

    /// This model's fingerprint (32 hex digits): equal for two loads of the same files with the
    /// same settings; a `Prefix` made by a model with another id is refused.
    #[getter]
    fn model_id(&self) -> String {
        self.inner.id().to_string()
    }

    /// The weights' dtype: "f32", "bf16", "f16", "int8" or "fp8".
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.weights_dtype().as_str()
    }

    /// The activations' dtype: `dtype`, but "f32" for the CPU's bf16 mode (bf16 weights, f32
    /// activations, on CPUs with AVX512-BF16).
    #[getter]
    fn activation_dtype(&self) -> &'static str {
        self.inner.activation_dtype().as_str()
    }

    /// The device the model runs on: "cpu", "cuda:i" or "metal:i".
    #[getter]
    fn device(&self) -> String {
        match self.inner.device().location() {
            DeviceLocation::Cpu => "cpu".into(),
            DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
            DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
        }
    }

    /// The checkpoint folder the model was loaded from.
    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.checkpoint().dir.clone()
    }

    /// The longest record (state plus its longest branch, in tokens) the model accepts.
    #[getter]
    fn max_tokens(&self) -> usize {
        self.inner.encoder().max_tokens()
    }

    fn __repr__(&self) -> String {
        format!(
            "DecisionModel(path={:?}, device={:?}, dtype={:?})",
            self.inner.checkpoint().dir.display().to_string(),
            self.device(),
            self.dtype()
        )
    }
}

/// A state run once through the backbone (its cache), reusable by `probs_with_prefix` for any
/// record with the same state. Immutable: threads may share it.
#[pyclass(frozen, module = "kev", name = "Prefix")]
pub struct PyPrefix {
    inner: std::sync::Arc<kev::Prefix>,
}

#[pymethods]
impl PyPrefix {
    /// The state text this prefix was computed from.
    #[getter]
    fn state(&self) -> &str {
        self.inner.state()
    }

    /// The `model_id` of the model that computed it: only that model accepts it.
    #[getter]
    fn model_id(&self) -> String {
        self.inner.model().to_string()
    }

    /// Number of state tokens.
    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        format!("Prefix(tokens={})", self.inner.len())
    }
}

/// A record encoded (KEV.md §2): the state's ids, then each question's branch, with segments
/// (0 for the state, j + 1 for question j) and where the head reads each branch.
#[pyclass(frozen, module = "kev", name = "Encoding")]
pub struct PyEncoding {
    inner: kev::Encoding,
}

#[pymethods]
impl PyEncoding {
    /// State ids, then each branch's ids in question order.
    #[getter]
    fn ids(&self) -> Vec<u32> {
        self.inner.ids.clone()
    }

    /// Segment of each id: 0 for the state, j + 1 for question j's branch.
    #[getter]
    fn segments(&self) -> Vec<u32> {
        self.inner.segments.clone()
    }

    /// Number of state tokens (the state is `ids[:state_len]`).
    #[getter]
    fn state_len(&self) -> usize {
        self.inner.state_len
    }

    /// The state's ids.
    #[getter]
    fn state_ids(&self) -> Vec<u32> {
        self.inner.state_ids().to_vec()
    }

    /// Per question: a dict with `start` (index in `ids`), `len`, `decide` (position of
    /// `[DECIDE]` in the branch) and `opts` (positions of the `[OPTION]` markers in the branch).
    #[getter]
    fn branches<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.inner
            .branches
            .iter()
            .map(|b| {
                let d = PyDict::new(py);
                d.set_item("start", b.start)?;
                d.set_item("len", b.len)?;
                d.set_item("decide", b.decide)?;
                d.set_item("opts", b.opts.clone())?;
                Ok(d)
            })
            .collect()
    }

    /// The state's ids and one row per question, a dict with `ids` (the branch), `decide` and
    /// `opts` (positions in the branch): what the model runs after the state.
    fn rows<'py>(&self, py: Python<'py>) -> PyResult<(Vec<u32>, Vec<Bound<'py, PyDict>>)> {
        let (state, rows) = self.inner.rows();
        let rows = rows
            .into_iter()
            .map(|r| {
                let d = PyDict::new(py);
                d.set_item("ids", r.ids)?;
                d.set_item("decide", r.decide)?;
                d.set_item("opts", r.opts)?;
                Ok(d)
            })
            .collect::<PyResult<_>>()?;
        Ok((state, rows))
    }

    /// Number of token ids.
    fn __len__(&self) -> usize {
        self.inner.ids.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "Encoding(tokens={}, state_len={}, questions={})",
            self.inner.ids.len(),
            self.inner.state_len,
            self.inner.branches.len()
        )
    }
}

/// Prefixes of states seen before, least recently used out first under a byte budget of their
/// tensors; keyed by model and state tokens, so models may share one. Safe to share between
/// threads.
#[pyclass(frozen, module = "kev", name = "PrefixCache")]
pub struct PyPrefixCache {
    inner: kev::PrefixCache,
}

#[pymethods]
impl PyPrefixCache {
    /// A cache holding at most `budget_bytes` of prefix tensors (0 keeps nothing).
    #[new]
    fn new(budget_bytes: usize) -> Self {
        PyPrefixCache {
            inner: kev::PrefixCache::new(budget_bytes),
        }
    }

    /// Counters and sizes: hits, misses, evictions, rejected (larger than the budget alone),
    /// entries, bytes, budget.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("hits", s.hits)?;
        d.set_item("misses", s.misses)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("rejected", s.rejected)?;
        d.set_item("entries", s.entries)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("budget", s.budget)?;
        Ok(d)
    }

    /// Drops every entry (the counters stay).
    fn clear(&self) {
        self.inner.clear();
    }

    fn __repr__(&self) -> String {
        let s = self.inner.stats();
        format!(
            "PrefixCache(entries={}, bytes={}, budget={})",
            s.entries, s.bytes, s.budget
        )
    }
}
