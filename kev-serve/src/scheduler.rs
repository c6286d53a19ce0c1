//! One bounded queue in front of one model worker per device; batches formed by a token budget
//! and a short wait.
//!
//! A worker takes the oldest request, then every request already queued (and, for up to
//! `max_wait`, those that arrive) while the batch stays within `max_batch_tokens`. A batch's
//! tokens are what the model will run, padding included: its distinct uncached states and their
//! branch rows in passes grouped by length, the rows continuing cached states joining the last
//! (`DecisionModel::batch_tokens`).
//! Records are taken one by one, so a request larger than the budget is split: the batch takes
//! the records that fit and the rest start the worker's next batch (a single record larger than
//! the budget runs alone). A batch's working memory is therefore bounded by the budget however
//! large the request. The batch runs as one call of [`DecisionModel::run`] (cold states once,
//! every branch continuing its prefix, cached or computed) and the new prefixes go to the
//! device's [`PrefixCache`]. Requests whose client has gone are dropped before they run (and
//! between their parts).
use std::collections::HashMap;
use std::ops::Range;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TrySendError};
use kev::{DecisionModel, EncodedRecord, Prefix, PrefixCache, StateLoad};
use tokio::sync::oneshot;

use crate::metrics::Metrics;
use crate::throttle::Throttle;

/// Probabilities per record and question, or the library's message.
pub type Reply = std::result::Result<Vec<Vec<Vec<f32>>>, String>;

/// One request's records, waiting for a worker.
pub struct Job {
    records: Vec<EncodedRecord>,
    /// The probabilities of the records run so far (the first `answered.len()`).
    answered: Vec<Vec<Vec<f32>>>,
    reply: oneshot::Sender<Reply>,
    queued: Instant,
}

impl Job {
    /// A job and the receiver of its reply.
    pub fn new(records: Vec<EncodedRecord>) -> (Self, oneshot::Receiver<Reply>) {
        let (reply, rx) = oneshot::channel();
        let job = Self {
            answered: Vec::with_capacity(records.len()),
            records,
            reply,
            queued: Instant::now(),
        };
        (job, rx)
    }
}

/// Why a job was not queued.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SubmitError {
    /// The queue is full.
    #[error("the queue is full ({0} requests waiting)")]
    Full(usize),
    /// The workers have stopped.
    #[error("the server is shutting down")]
    Closed,
}

/// How workers form batches.
#[derive(Debug, Clone, Copy)]
pub struct BatchPolicy {
    /// A batch takes no request that would bring it over this many tokens (a first request
    /// larger than it runs alone).
    pub max_batch_tokens: usize,
    /// How long to wait for more requests when the queue is empty and the batch is not full.
    pub max_wait: Duration,
}

/// A model and the prefix cache of its device, shared by that device's workers.
#[derive(Clone)]
pub struct DeviceModel {
    /// The model.
    pub model: Arc<DecisionModel>,
    /// Its device's prefix cache (none: states always run).
    pub cache: Option<Arc<PrefixCache>>,
}

/// The queue and its workers.
pub struct Scheduler {
    tx: Option<Sender<Job>>,
    capacity: usize,
    workers: Vec<JoinHandle<()>>,
}

impl Scheduler {
    /// Starts one worker thread per entry of `devices` (entries may share a model) behind a
    /// queue of `capacity` requests.
    pub fn start(
        devices: Vec<DeviceModel>,
        capacity: usize,
        policy: BatchPolicy,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<Self> {
        let (tx, rx) = crossbeam_channel::bounded(capacity.max(1));
        let mut workers = Vec::with_capacity(devices.len());
        for (i, device) in devices.into_iter().enumerate() {
            let worker = Worker {
                device,
                rx: rx.clone(),
                policy,
                metrics: Arc::clone(&metrics),
                carry: None,
            };
            workers.push(
                std::thread::Builder::new()
                    .name(format!("kev-worker-{i}"))
                    .spawn(move || worker.run())?,
            );
        }
        Ok(Self {
            tx: Some(tx),
            capacity: capacity.max(1),
            workers,
        })
    }

    /// Queues `job`, or says why not (never waits).
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        let tx = self.tx.as_ref().ok_or(SubmitError::Closed)?;
        tx.try_send(job).map_err(|e| match e {
            TrySendError::Full(_) => SubmitError::Full(self.capacity),
            TrySendError::Disconnected(_) => SubmitError::Closed,
        })
    }

    /// Requests waiting now.
    pub fn queued(&self) -> usize {
        self.tx.as_ref().map_or(0, Sender::len)
    }

    /// Takes no more jobs, lets the workers finish the queued ones, and waits for them.
    pub fn shutdown(&mut self) {
        self.tx = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// What a batch runs, as the model pads it ([`DecisionModel::batch_tokens`]): its distinct cold
/// states, each with its branch rows, and the rows continuing cached states (how many, the
/// longest). Padding is counted, so a long branch joining short ones costs its length times theirs.
#[derive(Default)]
struct Shape {
    /// Each distinct cold state's place in `loads`.
    cold: HashMap<Vec<u32>, usize>,
    loads: Vec<StateLoad>,
    given: (usize, usize),
}

impl Shape {
    fn tokens(&self, model: &DecisionModel) -> usize {
        model.batch_tokens(&self.loads, self.given)
    }

    /// The padded tokens with `record` added, its state computed in this batch unless `cached`
    /// (and not already cold here).
    fn tokens_with(&self, model: &DecisionModel, record: &EncodedRecord, cached: bool) -> usize {
        let (mut loads, mut given) = (self.loads.clone(), self.given);
        let at = self.cold.get(record.state_ids()).copied();
        add(&mut loads, &mut given, at, record, !cached);
        model.batch_tokens(&loads, given)
    }

    /// Adds `record`, whose state is computed in this batch (`cold`) or continues a cached one.
    fn add(&mut self, record: &EncodedRecord, cold: bool) {
        let ids = record.state_ids();
        let at = self.cold.get(ids).copied();
        add(&mut self.loads, &mut self.given, at, record, cold);
        if cold && at.is_none() {
            self.cold.insert(ids.to_vec(), self.loads.len() - 1);
        }
    }
}

/// Adds `record`'s branch rows: to its state's load at `at` (already cold in the batch), to a
/// new load after the others (`cold`), or to the rows continuing cached states.
fn add(
    loads: &mut Vec<StateLoad>,
    given: &mut (usize, usize),
    at: Option<usize>,
    record: &EncodedRecord,
    cold: bool,
) {
    let (rows, longest) = (record.questions(), record.longest_branch());
    let branch_tokens = record.branch_tokens();
    match at {
        Some(at) => loads[at] = loads[at].with_rows(rows, longest, branch_tokens),
        None if cold => loads.push(StateLoad {
            tokens: record.state_ids().len(),
            rows,
            longest_row: longest,
            branch_tokens,
        }),
        None => *given = (given.0 + rows, given.1.max(longest)),
    }
}

/// A job taken from the queue: its records `range` run in this batch, with the prefixes found
/// for them.
struct Taken {
    job: Job,
    range: Range<usize>,
    prefixes: Vec<Option<Arc<Prefix>>>,
}

/// What [`Worker::take`] did with a job.
enum Took {
    /// Its client has gone: dropped.
    Gone,
    /// None of its records fit: it starts the next batch.
    Nothing(Job),
    /// Its remaining records, or (`whole` false) the first of them, the batch then being full.
    Records { taken: Taken, whole: bool },
}

struct Worker {
    device: DeviceModel,
    rx: Receiver<Job>,
    policy: BatchPolicy,
    metrics: Arc<Metrics>,
    /// A job taken that did not fit the last batch: the first of the next.
    carry: Option<Job>,
}

impl Worker {
    fn run(mut self) {
        while let Some(batch) = self.next_batch() {
            self.execute(batch);
        }
    }

    /// The next batch, or none once the queue is closed and empty.
    fn next_batch(&mut self) -> Option<Vec<Taken>> {
        loop {
            let batch = self.gather()?;
            // Empty when every job taken had lost its client: wait for the next.
            if !batch.is_empty() {
                return Some(batch);
            }
        }
    }

    /// Jobs for one batch (none once the queue is closed and empty).
    fn gather(&mut self) -> Option<Vec<Taken>> {
        let mut next = match self.carry.take() {
            Some(job) => Some(job),
            None => Some(self.rx.recv().ok()?),
        };
        let mut shape = Shape::default();
        let mut batch = Vec::new();
        let deadline = Instant::now() + self.policy.max_wait;
        loop {
            let job = match next.take() {
                Some(job) => job,
                None if shape.tokens(&self.device.model) >= self.policy.max_batch_tokens => break,
                None => match self.rx.try_recv() {
                    Ok(job) => job,
                    Err(_) if self.policy.max_wait.is_zero() => break,
                    Err(_) => match self.rx.recv_deadline(deadline) {
                        Ok(job) => job,
                        Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => break,
                    },
                },
            };
            match self.take(job, &mut shape, batch.is_empty()) {
                Took::Gone => {}
                Took::Nothing(job) => {
                    self.carry = Some(job);
                    break;
                }
                Took::Records { taken, whole } => {
                    batch.push(taken);
                    if !whole {
                        break;
                    }
                }
            }
        }
        Some(batch)
    }

    /// The padded tokens of `shape` with `record` added (no lookups counted).
    fn tokens_with(&self, shape: &Shape, record: &EncodedRecord) -> usize {
        let ids = record.state_ids();
        let cached = !shape.cold.contains_key(ids)
            && self
                .device
                .cache
                .as_ref()
                .is_some_and(|c| c.contains(self.device.model.id(), ids));
        shape.tokens_with(&self.device.model, record, cached)
    }

    /// Takes the records of `job` not run yet, in order, while they fit `shape`'s budget (the
    /// first record of a batch always does), looking their states up; drops `job` if its
    /// client has gone.
    fn take(&self, job: Job, shape: &mut Shape, batch_empty: bool) -> Took {
        if job.reply.is_closed() {
            self.metrics.abandoned.inc();
            return Took::Gone;
        }
        let start = job.answered.len();
        let mut prefixes = Vec::new();
        for (k, r) in job.records[start..].iter().enumerate() {
            let first = batch_empty && k == 0;
            if !first && self.tokens_with(shape, r) > self.policy.max_batch_tokens {
                break;
            }
            let ids = r.state_ids();
            let found = if shape.cold.contains_key(ids) {
                None
            } else {
                self.device
                    .cache
                    .as_ref()
                    .and_then(|c| c.get(self.device.model.id(), ids))
            };
            shape.add(r, found.is_none());
            prefixes.push(found);
        }
        if prefixes.is_empty() {
            return Took::Nothing(job);
        }
        if start == 0 {
            self.metrics
                .queue_wait
                .observe(job.queued.elapsed().as_secs_f64());
        }
        let end = start + prefixes.len();
        let whole = end == job.records.len();
        Took::Records {
            taken: Taken {
                job,
                range: start..end,
                prefixes,
            },
            whole,
        }
    }

    /// Runs `batch` and answers the jobs it completes; a job with records left starts the next
    /// batch.
    fn execute(&mut self, batch: Vec<Taken>) {
        if batch.is_empty() {
            return;
        }
        let started = Instant::now();
        let model = &self.device.model;
        let records: Vec<EncodedRecord> = batch
            .iter()
            .flat_map(|t| t.job.records[t.range.clone()].iter().cloned())
            .collect();
        let prefixes: Vec<Option<Arc<Prefix>>> =
            batch.iter().flat_map(|t| t.prefixes.clone()).collect();
        let tokens: usize = records
            .iter()
            .zip(&prefixes)
            .map(|(r, p)| {
                if p.is_some() {
                    r.branch_tokens()
                } else {
                    r.tokens()
                }
            })
            .sum();
        let run = || -> kev::Result<Vec<Vec<Vec<f32>>>> {
            // With a cache, the computed states come back as prefixes to keep there.
            let cache = self.device.cache.as_ref();
            let scored = model.run(&records, &prefixes, cache.is_some())?;
            Ok(match cache {
                Some(cache) => cache.keep(scored),
                None => scored.into_iter().map(|s| s.probs).collect(),
            })
        };
        let result = match std::panic::catch_unwind(AssertUnwindSafe(run)) {
            Ok(Ok(probs)) => Ok(probs),
            Ok(Err(e)) => {
                let mut message = e.to_string();
                let mut source = std::error::Error::source(&e);
                while let Some(s) = source {
                    message = format!("{message}: {s}");
                    source = s.source();
                }
                Err(message)
            }
            Err(_) => Err("the model worker panicked on this batch".to_string()),
        };
        self.metrics.observe_batch(
            batch.len(),
            records.len(),
            tokens,
            started.elapsed().as_secs_f64(),
        );
        match result {
            Ok(probs) => {
                let mut probs = probs.into_iter();
                for mut t in batch {
                    t.job.answered.extend(probs.by_ref().take(t.range.len()));
                    if t.job.answered.len() == t.job.records.len() {
                        let _ = t.job.reply.send(Ok(t.job.answered));
                    } else {
                        self.carry = Some(t.job);
                    }
                }
            }
            Err(message) => {
                static FAILED: Throttle = Throttle::new();
                if let Some(left_out) = FAILED.check(Instant::now()) {
                    tracing::error!(%message, records = records.len(), left_out, "batch failed");
                }
                for t in batch {
                    let _ = t.job.reply.send(Err(message.clone()));
                }
            }
        }
    }
}
