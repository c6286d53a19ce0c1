//! CUDA graphs over the executor's plain passes ([`Pass::is_plain`](crate::plan::Pass): a
//! record's forward, or a batch of records, keeping no prefix).
//!
//! One request is about a thousand small launches, and on the GPU its time is the host's: each
//! candle op costs several microseconds to issue. A graph issues them all at once. The host
//! code of a forward is fixed by the pass's *shape* (`PassShape`), not by the contents of its
//! inputs (`Replays::Inputs`: token ids, where the head reads, each option's question and, for
//! a pass in one pass over the layers, its rows' lengths and owners and what the backbone
//! derives from them), so the second pass of a shape (where a graph of it will be kept) is run
//! eagerly once more to record its other uploads ([`kev_kernels::uploads`]), then captured;
//! later passes of that shape only write their inputs into the graph's and launch it. The
//! kernels and their inputs are the same as eagerly, so are the numbers. A pass in one pass
//! over the layers is shaped by its row counts and widths alone, which the plan pads to a few
//! buckets ([`crate::plan::bucket_width`]), so records of other lengths replay too; other
//! passes (states in several pieces) by their rows' lengths as well. A batch is one pass (its
//! states' rows, then all its branches), so a batch of the same shapes replays as well.
//!
//! A few graphs are kept (`LoadOptions::cuda_graphs_kept`), by how often their shape comes back
//! ([`HALVE_EVERY`]): capturing costs more than an eager forward, so a shape seen again replaces
//! a kept graph only if it has come more often; more shapes than are kept, coming round at the
//! same rate, then leave the first ones kept instead of each capture evicting the graph needed
//! next.
//! Long rows (over `MAX_ROW_POSITIONS`) and large batches (over `MAX_TOKENS` positions) stay
//! eager: their host time is small beside their GPU time, and a graph would hold a second copy
//! of their working memory.

/// Passes whose rows are longer than this (a long state) run eagerly. A graph reserves its own
/// copy of the forward's working memory (the driver keeps graph memory apart from the pool
/// eager forwards use), while a long row's host time is small beside its GPU time: with a
/// 4096-token state a graph saved 10 % at 0.8B and 2 % at 4B on the H200 but held 2.9 and
/// 5.6 GiB more; one request (704 positions) held the same or +0.7 GiB.
const MAX_ROW_POSITIONS: usize = 2048;
/// Passes computing more token positions than this (a large batch) run eagerly, for the same
/// reason. 8 records of a 512-token state and 4 questions compute 5632; eagerly, their host
/// time was 5 of 29 ms at 0.8B and 10 of 101 ms at 4B on the H200.
const MAX_TOKENS: usize = 8192;

/// Whether a pass of `tokens` token positions (padding included) whose longest row (a state
/// and a branch, padded) is `row_positions` long is worth a graph.
pub(crate) fn graph_sized(tokens: usize, row_positions: usize) -> bool {
    tokens <= MAX_TOKENS && row_positions <= MAX_ROW_POSITIONS
}

/// How the CUDA graphs of a model have fared: for benchmarks, tests and logs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Graphs captured (a shape seen again, where its graph is kept).
    pub captured: usize,
    /// Forwards served by replaying a graph.
    pub replayed: usize,
    /// Captures that failed; those shapes run eagerly from then on.
    pub failed: usize,
    /// Why the last capture failed.
    pub last_failure: Option<String>,
}

#[cfg(feature = "cuda")]
pub(crate) use cuda::{Graphs, Replays};

#[cfg(feature = "cuda")]
mod cuda {
    use std::collections::{HashMap, HashSet, VecDeque};
    use std::sync::{Arc, Mutex, PoisonError};

    use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
    use candle_core::cuda_backend::cudarc::driver::sys::{
        CUgraphInstantiate_flags, CUstreamCaptureMode,
    };
    use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaGraph, CudaStream};
    use candle_core::{CudaDevice, Tensor};
    use kev_core::{Error, Result};
    use kev_kernels::uploads::{self, UploadMemo};

    use super::GraphStats;
    use crate::plan::Pass;

    /// What the graphs capture and replay: the executor's runs of plain passes, through these
    /// alone (the graphs know nothing of the model they serve).
    pub(crate) trait Replays {
        /// A pass's inputs on the device, copies of their own.
        type Inputs;
        fn upload_inputs(&self, pass: &Pass) -> Result<Self::Inputs>;
        /// Rewrites `inputs` (of a pass of `pass`'s shape) with `pass`'s.
        fn write_inputs(&self, pass: &Pass, inputs: &Self::Inputs) -> Result<()>;
        /// Whether `pass`'s inputs hold everything it reads that its widths and row counts do
        /// not fix (else its shape holds its rows' lengths as well).
        fn lengths_are_inputs(&self, pass: &Pass) -> bool;
        fn pass_logits(&self, pass: &Pass, inputs: &Self::Inputs) -> Result<Tensor>;
        fn pass_logits_eager(&self, pass: &Pass) -> Result<Tensor>;
    }

    /// Every this many forwards of graph-sized passes a graph kept, every shape's count is
    /// halved (and shapes without a graph that reach zero forgotten), so the graphs follow a
    /// change of traffic.
    pub(super) const HALVE_EVERY: u64 = 32;
    /// Shapes without a graph remembered at most (forgotten all at once beyond it).
    const SEEN: usize = 4096;
    /// A [`Pass`] without its inputs: passes of equal shape run the same kernels on the same
    /// shapes with the same host-built tensors besides their inputs, so one CUDA graph serves
    /// them all.
    #[derive(Clone, PartialEq, Eq, Hash)]
    enum PassShape {
        /// One pass over the layers, lengths and owners among the inputs: the state and branch
        /// pieces' rows and widths, and the head's rows and options.
        Split {
            states: (usize, usize),
            branches: (usize, usize),
            rows: usize,
            options: usize,
        },
        /// Otherwise: every piece's width and rows' lengths too, and the branch rows' states.
        Rows {
            state_pieces: usize,
            computed: usize,
            pieces: Vec<(usize, Vec<usize>)>,
            owners: Vec<usize>,
            rows: usize,
            options: usize,
        },
    }

    impl PassShape {
        fn of(pass: &Pass, lengths_are_inputs: bool) -> Self {
            let rows = pass.rows.len();
            let options = pass.options();
            if lengths_are_inputs {
                let dims = |p: &crate::plan::Piece| (p.lengths.len(), p.width);
                return Self::Split {
                    states: dims(&pass.state[0]),
                    branches: dims(&pass.branches[0]),
                    rows,
                    options,
                };
            }
            Self::Rows {
                state_pieces: pass.state.len(),
                computed: pass.computed,
                owners: pass.owners.clone(),
                pieces: pass
                    .pieces()
                    .map(|p| (p.width, p.lengths.clone()))
                    .collect(),
                rows,
                options,
            }
        }
    }

    /// Token positions `pass` computes (padding included).
    fn tokens(pass: &Pass) -> usize {
        pass.pieces().map(|p| p.width * p.lengths.len()).sum()
    }

    /// Token positions of `pass`'s longest row: a state (padded) and a branch (padded).
    fn row_positions(pass: &Pass) -> usize {
        pass.pieces().map(|p| p.width).sum()
    }

    /// The graphs of one model, whose passes' inputs are `I`.
    pub(crate) struct Graphs<I> {
        book: Mutex<Book<I>>,
    }

    impl<I> Graphs<I> {
        /// Graphs keeping up to `keep` (the shapes that came most often, then most recently).
        /// Each holds its inputs and its output; the driver shares the rest of the graphs'
        /// memory between them.
        pub(crate) fn new(keep: usize) -> Self {
            Self {
                book: Mutex::new(Book {
                    keep,
                    seen: HashMap::new(),
                    failed: HashSet::new(),
                    capturing: HashSet::new(),
                    graphs: VecDeque::new(),
                    forwards: 0,
                    stats: GraphStats::default(),
                }),
            }
        }
    }

    /// What the graphs keep account of, behind one lock.
    struct Book<I> {
        /// Graphs kept at most.
        keep: usize,
        /// Shapes without a graph, and how often each came (halved every [`HALVE_EVERY`]).
        seen: HashMap<PassShape, u32>,
        failed: HashSet<PassShape>,
        /// Shapes being captured: other threads run them eagerly meanwhile rather than capture
        /// a second graph.
        capturing: HashSet<PassShape>,
        /// The kept graphs, least recently used first. A graph out for a replay keeps its
        /// place (its `graph` taken), so the room left, the halving and the choice of a victim
        /// count it while another thread runs it.
        graphs: VecDeque<Kept<I>>,
        /// Forwards of graph-sized passes, for the halving.
        forwards: u64,
        stats: GraphStats,
    }

    /// A kept graph (`None` while a thread replays it), and how often its shape came (the
    /// sightings before its capture included).
    struct Kept<I> {
        shape: PassShape,
        graph: Option<Captured<I>>,
        count: u32,
    }

    impl<I> Book<I> {
        /// Counts a forward of a graph-sized pass, halving every count every [`HALVE_EVERY`] a
        /// graph kept.
        fn tick(&mut self) {
            self.forwards += 1;
            if self.forwards.is_multiple_of(HALVE_EVERY * self.keep as u64) {
                for kept in &mut self.graphs {
                    kept.count /= 2;
                }
                self.seen.retain(|_, n| {
                    *n /= 2;
                    *n > 0
                });
            }
        }

        /// The kept graph a new one would replace once all are kept: the least counted of
        /// those not out for a replay, the least recent of those.
        fn victim(&self) -> Option<usize> {
            let idle = || self.graphs.iter().filter(|k| k.graph.is_some());
            let least = idle().map(|k| k.count).min()?;
            self.graphs
                .iter()
                .position(|k| k.graph.is_some() && k.count == least)
        }

        /// Whether a new graph of a shape that came `count` times is kept: there is room, or
        /// it came more often than the graph it would replace.
        fn room_for(&self, count: u32) -> bool {
            self.graphs.len() < self.keep
                || self.victim().is_some_and(|v| count > self.graphs[v].count)
        }
    }

    /// A captured forward. Field order is drop order: the output (a graph allocation) is freed
    /// before the graph goes.
    struct Captured<I> {
        logits: Tensor,
        graph: CudaGraph,
        inputs: I,
        _uploads: UploadMemo,
        /// Recorded once its last launch and the copy of its logits were issued: the next
        /// replay, perhaps on another thread's stream, waits for it on the device before
        /// rewriting the inputs that launch reads.
        done: CudaEvent,
    }

    impl<I> Drop for Captured<I> {
        /// Waits for the launch `done` marks first: another thread's stream may still be
        /// running it, and the memory it reads and writes is freed on this thread's. (A later
        /// launch whose logits copy failed was this thread's own, so the frees follow it.)
        fn drop(&mut self) {
            let _ = self.done.synchronize();
        }
    }

    // SAFETY: CUDA graph objects may be used from any thread as long as no two threads use one
    // at a time. A `Captured` has one owner at a time: the list (behind the mutex), or the one
    // thread that took it from its place in the list to replay it. Its inputs are device
    // tensors, used by that one owner alike.
    unsafe impl<I> Send for Captured<I> {}

    fn backend(context: &str, e: impl std::fmt::Display) -> Error {
        Error::Device {
            message: format!("CUDA graph, {context}: {e}"),
        }
    }

    impl<I> Graphs<I> {
        pub(crate) fn stats(&self) -> GraphStats {
            self.lock().stats.clone()
        }

        fn lock(&self) -> std::sync::MutexGuard<'_, Book<I>> {
            self.book.lock().unwrap_or_else(PoisonError::into_inner)
        }

        /// All options' logits of `pass` on the device, issued on this thread's stream and not
        /// waited for: replayed, captured, or eager (a shape not worth a graph yet, one whose
        /// graph another thread is running, or one that failed to capture).
        pub(crate) fn logits(
            &self,
            exec: &impl Replays<Inputs = I>,
            pass: &Pass,
            dev: &CudaDevice,
        ) -> Result<Tensor> {
            if !super::graph_sized(tokens(pass), row_positions(pass)) {
                return exec.pass_logits_eager(pass);
            }
            let shape = PassShape::of(pass, exec.lengths_are_inputs(pass));
            // The lock is not held while the GPU works: other threads' forwards (on their own
            // streams) go on; a graph in use is taken from its place until it is done.
            let action = self.lock().action(&shape);
            match action {
                Action::Eager => exec.pass_logits_eager(pass),
                Action::Replay(mut graph) => {
                    let out = graph.replay(exec, pass, &dev.cuda_stream());
                    // A graph that failed to run is not kept (its next launch would likely
                    // fail the same way); the error goes to the caller. It is dropped once
                    // the lock is released, since dropping waits for the device.
                    let mut book = self.lock();
                    let failed = match &out {
                        Ok(_) => {
                            book.stats.replayed += 1;
                            book.put_back(&shape, Some(graph));
                            None
                        }
                        Err(_) => {
                            book.put_back(&shape, None);
                            Some(graph)
                        }
                    };
                    drop(book);
                    drop(failed);
                    out
                }
                Action::Capture(count) => {
                    let captured = capture(exec, pass, dev);
                    let mut book = self.lock();
                    book.capturing.remove(&shape);
                    match captured {
                        Ok((graph, logits)) => {
                            book.stats.captured += 1;
                            let dropped = book.keep(shape, graph, count);
                            drop(book);
                            drop(dropped);
                            Ok(logits)
                        }
                        Err(why) => {
                            book.stats.failed += 1;
                            book.stats.last_failure = Some(why);
                            book.failed.insert(shape);
                            drop(book);
                            exec.pass_logits_eager(pass)
                        }
                    }
                }
            }
        }
    }

    impl<I> Book<I> {
        /// What a forward of a graph-sized pass of `shape` does, counting it.
        fn action(&mut self, shape: &PassShape) -> Action<I> {
            self.tick();
            if self.failed.contains(shape) || self.capturing.contains(shape) {
                return Action::Eager;
            }
            if let Some(i) = self.graphs.iter().position(|k| k.shape == *shape) {
                let mut kept = self.graphs.remove(i).expect("in range");
                kept.count += 1;
                let graph = kept.graph.take();
                self.graphs.push_back(kept);
                // Out for another thread's replay: run eagerly meanwhile.
                return graph.map_or(Action::Eager, Action::Replay);
            }
            if self.seen.len() >= SEEN && !self.seen.contains_key(shape) {
                self.seen.clear();
            }
            let count = {
                let n = self.seen.entry(shape.clone()).or_insert(0);
                *n += 1;
                *n
            };
            // Worth a capture (about two eager forwards' cost) once seen before, where the
            // graph will be kept.
            if count >= 2 && self.room_for(count) {
                self.seen.remove(shape);
                self.capturing.insert(shape.clone());
                Action::Capture(count)
            } else {
                Action::Eager
            }
        }

        /// Returns a replayed graph to its place (none: the replay failed, the place goes).
        fn put_back(&mut self, shape: &PassShape, graph: Option<Captured<I>>) {
            let Some(i) = self.graphs.iter().position(|k| k.shape == *shape) else {
                return;
            };
            match graph {
                Some(graph) => self.graphs[i].graph = Some(graph),
                None => drop(self.graphs.remove(i)),
            }
        }

        /// Keeps a new graph of a shape that came `count` times at the most recent end, in
        /// place of [`Book::victim`] once all are kept; or not, where the graphs kept
        /// meanwhile (by other threads) leave no room for it. Returns the graph that goes (the
        /// victim, or the new one), for the caller to drop once the lock is released.
        fn keep(
            &mut self,
            shape: PassShape,
            graph: Captured<I>,
            count: u32,
        ) -> Option<Captured<I>> {
            if !self.room_for(count) {
                return Some(graph);
            }
            let evicted = if self.graphs.len() >= self.keep {
                self.victim()
                    .and_then(|v| self.graphs.remove(v))
                    .and_then(|k| k.graph)
            } else {
                None
            };
            self.graphs.push_back(Kept {
                shape,
                graph: Some(graph),
                count,
            });
            evicted
        }
    }

    /// What a forward does; a capture with its shape's count.
    enum Action<I> {
        Eager,
        Capture(u32),
        Replay(Captured<I>),
    }

    impl<I> Captured<I> {
        /// Rewrites the inputs with `pass`'s and launches the graph on `stream` (this thread's),
        /// after its previous launch; returns a copy of the logits (the next launch frees the
        /// graph's own).
        fn replay(
            &mut self,
            exec: &impl Replays<Inputs = I>,
            pass: &Pass,
            stream: &Arc<CudaStream>,
        ) -> Result<Tensor> {
            stream
                .wait(&self.done)
                .map_err(|e| backend("waiting for the last launch", e))?;
            exec.write_inputs(pass, &self.inputs)?;
            self.graph.launch().map_err(|e| backend("launch", e))?;
            let (logits, done) =
                logits_copy(&self.logits, stream).map_err(|e| backend("after the launch", e))?;
            self.done = done;
            Ok(logits)
        }
    }

    /// A copy of a graph's `logits`, issued on `stream` after its launch, and the event that
    /// marks both issued.
    fn logits_copy(
        logits: &Tensor,
        stream: &Arc<CudaStream>,
    ) -> std::result::Result<(Tensor, CudaEvent), String> {
        let copy = logits
            .copy()
            .map_err(|e| format!("copying the logits: {e}"))?;
        let done = stream
            .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| format!("recording an event: {e}"))?;
        Ok((copy, done))
    }

    /// Records `pass`'s uploads in an eager run, captures a second run, launches it once and
    /// returns the graph and its logits (a copy, on the device); on failure, why, with the
    /// stream out of capture and the errors the abandoned capture left on the context taken.
    fn capture<I>(
        exec: &impl Replays<Inputs = I>,
        pass: &Pass,
        dev: &CudaDevice,
    ) -> std::result::Result<(Captured<I>, Tensor), String> {
        let inputs = exec.upload_inputs(pass).map_err(|e| e.to_string())?;
        let stream = dev.cuda_stream();
        let (captured, memo, ended) = {
            // candle's own small uploads (strides of non-contiguous operands) come from its
            // cache while this guard lives; the recording run fills it.
            let _candle_cache = dev.enable_cuda_graph_htod_cache();
            // The projections' new shape classes are timed here, so the capture takes the
            // fastest algorithms ([`kev_kernels::tuning`]).
            let (warm, memo) =
                kev_kernels::tuning(|| uploads::recording(|| exec.pass_logits(pass, &inputs)));
            drop(warm.map_err(|e| format!("recording run: {e}"))?);
            let capturing = Capturing::begin(&stream)?;
            let (captured, memo) = uploads::replaying(memo, || exec.pass_logits(pass, &inputs));
            let ended = capturing.end();
            (captured, memo, ended)
        };
        let (logits, graph) = match (captured, ended) {
            (Ok(logits), Ok(graph)) => (logits, graph),
            (captured, ended) => {
                let why = match (&captured, &ended) {
                    (Err(e), _) => format!("capture: {e}"),
                    (_, Err(e)) => e.clone(),
                    _ => unreachable!("the first arm takes two successes"),
                };
                // Frees of memory from the abandoned capture leave errors on the context.
                drop((captured, ended));
                let _ = stream.context().check_err();
                return Err(why);
            }
        };
        let first = graph.launch().map_err(|e| format!("first launch: {e}"));
        let out = first.and_then(|()| logits_copy(&logits, &stream));
        match out {
            Ok((out, done)) => Ok((
                Captured {
                    logits,
                    graph,
                    inputs,
                    _uploads: memo,
                    done,
                },
                out,
            )),
            Err(why) => {
                drop((logits, graph));
                let _ = stream.context().check_err();
                Err(why)
            }
        }
    }

    /// A capture in progress on `stream`; ended (and the graph dropped) if the thread unwinds
    /// before [`Capturing::end`], so the stream never stays capturing.
    struct Capturing<'a> {
        stream: &'a Arc<CudaStream>,
        open: bool,
    }

    impl<'a> Capturing<'a> {
        fn begin(stream: &'a Arc<CudaStream>) -> std::result::Result<Self, String> {
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .map_err(|e| format!("begin capture: {e}"))?;
            Ok(Self { stream, open: true })
        }

        /// Ends the capture and instantiates the graph. Graph allocations still held at a
        /// relaunch (the logits) are freed by it.
        fn end(mut self) -> std::result::Result<CudaGraph, String> {
            self.open = false;
            // cudarc's `end_capture` first reports any error recorded on the context (frees
            // inside an invalidated capture record some) and would then leave the stream
            // capturing: take them first, and count them as this capture's failure.
            let recorded = self.stream.context().check_err();
            let ended = self.stream.end_capture(
                CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            );
            match (recorded, ended) {
                (Ok(()), Ok(Some(graph))) => Ok(graph),
                (Err(e), _) => Err(format!("during capture: {e}")),
                (_, Err(e)) => Err(format!("end capture: {e}")),
                (_, Ok(None)) => Err("end capture: no graph".to_string()),
            }
        }
    }

    impl Drop for Capturing<'_> {
        fn drop(&mut self) {
            if self.open {
                let _ = self.stream.context().check_err();
                let _ = self.stream.end_capture(CUgraphInstantiate_flags(0));
            }
        }
    }
}
