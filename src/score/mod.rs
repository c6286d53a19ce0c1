//! Scoring a JSONL file of records into a JSONL file of probabilities, streamed: what the `score`
//! example runs, reusable by other front ends.
//!
//! [`score`] makes two passes over the input, each holding a chunk of records (validation) or a
//! few batches (scoring) at a time, so memory does not grow with the file:
//!
//! 1. **Validation**: every line is parsed and encoded with the model's encoder (the length
//!    check included), without running the model; the records of a chunk are encoded in
//!    parallel and taken in order. Without `skip_invalid` the first invalid
//!    record stops the run before anything is written; with it, each invalid line is reported
//!    through [`Progress::skipped`] and left out. The batches of the scoring pass are decided
//!    here, from each valid record's token count (a few bytes per batch are kept, no records).
//!    When resuming, the records already in the partial output are checked against it here, and
//!    the lines kept are rounded down to the end of a batch.
//! 2. **Scoring**: the valid records, in input order, in those batches through
//!    [`Scorer::score_batch`], each record written as one line once its batch is scored. A
//!    reader thread parses the next batch and encodes its records in parallel while the model
//!    runs the current one,
//!    and a writer thread formats and writes the batch before it; the channels between them hold
//!    one batch each.
//!
//! The output's guarantees are [`OutputPlan`]'s: a regular file is written beside the target
//! and renamed over it at the end, anything else is written through. The k-th output line is
//! the k-th valid record, which is what lets `resume` continue a partial output.

mod error;
mod input;
mod output;

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::time::{Duration, Instant};

use kev_candle::{DecisionModel, EncodedRecord};
use kev_core::{JsonlRecords, Record};
use rayon::prelude::*;
use serde::Serialize;

pub use error::ScoreError;
pub use output::{Output, OutputPlan};

/// What the pipeline needs of a model; [`DecisionModel`] is one. The validation pass encodes
/// each record to check it and count its tokens; the scoring pass encodes it again on a reader
/// thread, ahead of the model, and runs the encodings: a scorer is shared between threads. Both
/// passes encode a chunk's or a batch's records in parallel on rayon's global pool, so
/// [`Scorer::encode`] must not wait for work that needs that pool (a lazily loaded model, for
/// one: load it before scoring).
pub trait Scorer: Sync {
    /// A record made ready for the model ([`EncodedRecord`] for a [`DecisionModel`]).
    type Encoded: Send;
    /// Encodes `record` (from input line `line`, which its errors name), checking that it can be
    /// scored (its length included), without a forward pass.
    fn encode(&self, record: &Record, line: usize) -> kev_core::Result<Self::Encoded>;
    /// The tokens `record` runs: what [`ScoreOptions::batch_tokens`] counts.
    fn tokens(&self, record: &Self::Encoded) -> usize;
    /// One distribution per question for each record.
    fn score_batch(&self, records: &[Self::Encoded]) -> kev_core::Result<Vec<Vec<Vec<f32>>>>;
    /// The token budget of a batch when [`ScoreOptions::batch_tokens`] sets none.
    fn default_batch_tokens(&self) -> usize {
        CPU_BATCH_TOKENS
    }
    /// What its numbers depend on, as a JSON object kept beside a partial output
    /// ([`Output::claim`]): `resume` continues a partial output only with an equal one. By
    /// default, nothing (`{}`).
    fn run_identity(&self) -> serde_json::Value {
        serde_json::json!({})
    }
}

impl Scorer for DecisionModel {
    type Encoded = EncodedRecord;

    fn encode(&self, record: &Record, line: usize) -> kev_core::Result<EncodedRecord> {
        self.encode_record(record, Some(line))
    }

    /// The state plus every branch: the rows a cold batch runs.
    fn tokens(&self, record: &EncodedRecord) -> usize {
        record.tokens()
    }

    fn score_batch(&self, records: &[EncodedRecord]) -> kev_core::Result<Vec<Vec<Vec<f32>>>> {
        Ok(self
            .run(records, &[], false)?
            .into_iter()
            .map(|s| s.probs)
            .collect())
    }

    /// The model's id ([`DecisionModel::id`]) and, to name what differs, what it covers that a
    /// user sets: the checkpoint folder, `lora_scale`, the dtypes and the device.
    fn run_identity(&self) -> serde_json::Value {
        let dir = &self.checkpoint().dir;
        serde_json::json!({
            "model": self.id().to_string(),
            "checkpoint": std::fs::canonicalize(dir).unwrap_or_else(|_| dir.clone()),
            "lora_scale": self.options().lora_scale,
            "dtype": self.weights_dtype().as_str(),
            "activation_dtype": self.activation_dtype().as_str(),
            "device": format!("{:?}", self.device().location()),
            "prefill_chunk": self.options().prefill_chunk,
        })
    }

    fn default_batch_tokens(&self) -> usize {
        if self.device().is_cpu() {
            CPU_BATCH_TOKENS
        } else {
            gpu_batch_tokens(
                self.backbone().config().hidden_size,
                self.activation_dtype().size_in_bytes(),
                kev_candle::device::total_memory(self.device()),
            )
        }
    }
}

/// The token budget of a batch on the CPU ([`Scorer::default_batch_tokens`]): budgets from
/// 4,096 to 16,384 tokens score the shipped records within the noise of each other, all faster
/// than one record a batch (BENCHMARKS.md, "CPU: `score` at scale"). It also bounds the memory of
/// the few batches in flight.
pub const CPU_BATCH_TOKENS: usize = 8192;

/// The token budget of a batch on a GPU ([`Scorer::default_batch_tokens`]) for a backbone of
/// `hidden_size` whose activations take `dtype_bytes` a value, on a card of `card_bytes` (`None`:
/// not known): [`GPU_BATCH_VALUES`] hidden values, so that the batch's working memory is about
/// the same at every size (~13.5 GiB), but no more than a quarter of the card holds, and from
/// 8,192 to 262,144 tokens. It depends on the card's size, not on its free memory, so that a
/// run's batches (and `resume`) do not change with what else runs there. A batch's states are
/// grouped into passes of like lengths, and a GPU pass has a cost of its own, so the more
/// states a batch holds, the fewer and fuller its passes: on the H100, 10,000 varied records (`bench/varied_records.py`) at 0.8B scored 277,
/// 313 and 324 records/s with 32,768, 131,072 and 262,144 tokens a batch (BENCHMARKS.md).
pub fn gpu_batch_tokens(hidden_size: usize, dtype_bytes: usize, card_bytes: Option<u64>) -> usize {
    let hidden = hidden_size.max(1);
    let per_token = (WORKING_VALUES * dtype_bytes.max(1) * hidden) as u64;
    let fits = card_bytes.map_or(usize::MAX, |card| {
        usize::try_from(card / 4 / per_token).unwrap_or(usize::MAX)
    });
    (GPU_BATCH_VALUES / hidden)
        .min(fits)
        .clamp(CPU_BATCH_TOKENS, 262_144)
}

/// Hidden values (tokens × hidden size) a GPU batch holds by default: 262,144 tokens at 0.8B.
pub const GPU_BATCH_VALUES: usize = 1 << 28;

/// Working memory of a batch on a GPU, in activation values per token and hidden unit: the
/// batch form's pool high-water mark less the weights, per token, on the H200 (27 at 0.8B over
/// 256 records, 25 at 4B over 64).
const WORKING_VALUES: usize = 27;

/// How [`score`] runs.
#[derive(Debug, Clone)]
pub struct ScoreOptions {
    /// Tokens per [`Scorer::score_batch`] call (at least 1), counted by [`Scorer::tokens`]:
    /// a batch closes before the record that would take it over this budget, and a record over
    /// the budget by itself is a batch of its own. `None`, the default, takes the scorer's
    /// [`Scorer::default_batch_tokens`] (for a [`DecisionModel`], by its device; on a GPU also by
    /// its model and the card's memory). The batches follow from the records' token
    /// counts alone, so a run with the same input and options makes the same ones (which is
    /// what keeps `resume` byte-identical).
    pub batch_tokens: Option<usize>,
    /// Records per batch at most (at least 1); `usize::MAX`, the default, lets the token budget
    /// alone decide.
    pub batch_size: usize,
    /// Leave invalid records out (reported through [`Progress::skipped`]) instead of stopping.
    pub skip_invalid: bool,
    /// Continue from the partial output of an interrupted run (regular-file outputs only), with
    /// the same `batch_tokens` and `batch_size` as that run.
    pub resume: bool,
}

impl Default for ScoreOptions {
    fn default() -> Self {
        ScoreOptions {
            batch_tokens: None,
            batch_size: usize::MAX,
            skip_invalid: false,
            resume: false,
        }
    }
}

/// Hears how a run goes (a progress bar, a log). Every method does nothing by default.
pub trait Progress {
    /// Validation pass: `read` bytes read of `total` (`None` when the size is not known).
    fn validating(&mut self, _read: u64, _total: Option<u64>) {}
    /// An invalid record left out (`skip_invalid`); the error names its line.
    fn skipped(&mut self, _error: &kev_core::Error) {}
    /// Scoring pass: `done` of the `total` records this run scores, counted as the model
    /// finishes each batch (the writer thread writes it next).
    fn scoring(&mut self, _done: u64, _total: u64) {}
}

/// A [`Progress`] that ignores everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct Quiet;

impl Progress for Quiet {}

/// What a run did.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Output lines (one per valid record), resumed ones included.
    pub records: u64,
    /// Of those, lines kept from the partial output of an earlier run.
    pub resumed: u64,
    /// Invalid records left out.
    pub skipped: u64,
    /// Accuracy and log-loss over every output line (resumed ones read back from the output).
    pub metrics: Metrics,
    /// Time of the validation pass.
    pub validation: Duration,
    /// Time of the scoring pass.
    pub scoring: Duration,
    /// Batches scored by this run.
    pub batches: u64,
    /// Tokens of those batches ([`Scorer::tokens`] summed over their records).
    pub batch_tokens: u64,
}

impl Summary {
    /// Records scored by this run per second of the scoring pass.
    pub fn records_per_second(&self) -> f64 {
        (self.records - self.resumed) as f64 / self.scoring.as_secs_f64().max(1e-9)
    }

    /// Mean tokens per batch scored by this run (0 when none was).
    pub fn mean_batch_tokens(&self) -> f64 {
        self.batch_tokens as f64 / self.batches.max(1) as f64
    }
}

/// Question count, and accuracy and log-loss over questions that carry an `answer`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metrics {
    /// Questions in the output.
    pub questions: u64,
    /// Of those, questions with an `answer`.
    pub answered: u64,
    /// Answered questions whose argmax is the answer.
    pub correct: u64,
    /// Sum over answered questions of `-ln p[answer]` (p floored at 1e-12).
    pub log_loss: f64,
}

impl Metrics {
    /// `correct / answered`, if any question is answered.
    pub fn accuracy(&self) -> Option<f64> {
        (self.answered > 0).then(|| self.correct as f64 / self.answered as f64)
    }

    /// Mean log-loss over answered questions, if any.
    pub fn mean_log_loss(&self) -> Option<f64> {
        (self.answered > 0).then(|| self.log_loss / self.answered as f64)
    }

    fn add(&mut self, answer: Option<usize>, probs: &[f32], argmax: usize) {
        self.questions += 1;
        if let Some(answer) = answer {
            self.answered += 1;
            self.correct += u64::from(argmax == answer);
            self.log_loss -= f64::from(probs[answer].max(1e-12)).ln();
        }
    }
}

/// One question of an output line.
#[derive(Debug, Serialize)]
pub struct QuestionOut<'a> {
    /// The question's id.
    pub id: Option<&'a str>,
    /// Its probabilities, in option order.
    pub probs: &'a [f32],
    /// The first index of the largest probability.
    pub argmax: usize,
    /// The option at `argmax`.
    pub option: &'a str,
}

/// One output line, as `score` writes it and `kev-serve` answers it:
/// `{"id":…,"questions":[{"id":…,"probs":[…],"argmax":…,"option":…}]}`.
#[derive(Debug, Serialize)]
pub struct RecordOut<'a> {
    /// The record's id.
    pub id: Option<&'a str>,
    /// Its questions, in order.
    pub questions: Vec<QuestionOut<'a>>,
}

impl<'a> RecordOut<'a> {
    /// The output of `record` scored as `probs` (one distribution per question, each as long as
    /// its options; [`format_record`] checks that first).
    pub fn new(record: &'a Record, probs: &'a [Vec<f32>]) -> Self {
        RecordOut {
            id: record.id.as_deref(),
            questions: record
                .questions
                .iter()
                .zip(probs)
                .map(|(q, p)| {
                    let argmax = argmax(p);
                    QuestionOut {
                        id: q.id.as_deref(),
                        probs: p,
                        argmax,
                        option: &q.options[argmax],
                    }
                })
                .collect(),
        }
    }
}

/// The output line of `record` (from input line `line`) scored as `probs`:
/// `{"id":…,"questions":[{"id":…,"probs":[…],"argmax":…,"option":…}]}`, adding to `metrics`.
/// A non-finite probability is [`ScoreError::NonFinite`], a distribution of the wrong length
/// [`ScoreError::Shape`]: neither is ever written or counted.
pub fn format_record(
    record: &Record,
    probs: &[Vec<f32>],
    line: usize,
    metrics: &mut Metrics,
) -> Result<String, ScoreError> {
    if probs.len() != record.questions.len() {
        return Err(ScoreError::Shape {
            line,
            message: format!(
                "{} distributions for {} questions",
                probs.len(),
                record.questions.len()
            ),
        });
    }
    for (j, (q, p)) in record.questions.iter().zip(probs).enumerate() {
        if p.len() != q.options.len() {
            return Err(ScoreError::Shape {
                line,
                message: format!(
                    "{} probabilities for the {} options of question {j}",
                    p.len(),
                    q.options.len()
                ),
            });
        }
        if let Some(&value) = p.iter().find(|x| !x.is_finite()) {
            return Err(ScoreError::NonFinite {
                line,
                id: record.id.clone(),
                question: j,
                value,
            });
        }
    }
    let out = RecordOut::new(record, probs);
    for (q, o) in record.questions.iter().zip(&out.questions) {
        metrics.add(q.answer, o.probs, o.argmax);
    }
    Ok(serde_json::to_string(&out).expect("strings and finite numbers always serialize"))
}

/// The first index of the largest value.
fn argmax(p: &[f32]) -> usize {
    p.iter()
        .enumerate()
        .fold(0, |best, (i, x)| if *x > p[best] { i } else { best })
}

/// Scores the records of `input` (`-` for stdin) with `model` into `output`; see the module
/// documentation for the passes and guarantees.
///
/// Errors: [`ScoreError::Kev`] for an unreadable input or (without `skip_invalid`) the first
/// invalid record, naming its line, before anything is written; [`ScoreError::Output`] for any
/// failure to write; [`ScoreError::Batch`], [`ScoreError::NonFinite`] and
/// [`ScoreError::Shape`] when the model fails; [`ScoreError::Resume`] when the partial output
/// does not belong to this input; [`ScoreError::InputChanged`] when the input changes between
/// the passes; [`ScoreError::Worker`] when a thread of the scoring pass panics. When several
/// go wrong at once, the error of the earliest batch is the one returned. After an error in
/// the scoring pass, the lines written so far (whole batches, in order) stay in the partial
/// file ([`OutputPlan::partial_path`]) for `resume`.
pub fn score<S: Scorer>(
    model: &S,
    input: impl AsRef<Path>,
    output: &OutputPlan,
    options: &ScoreOptions,
    progress: &mut dyn Progress,
) -> Result<Summary, ScoreError> {
    if options.batch_size == 0 {
        return Err(kev_core::Error::invalid_argument("batch_size", "must be at least 1").into());
    }
    let batch_tokens = options
        .batch_tokens
        .unwrap_or_else(|| model.default_batch_tokens());
    if batch_tokens == 0 {
        return Err(kev_core::Error::invalid_argument("batch_tokens", "must be at least 1").into());
    }
    let started = Instant::now();
    let mut source = input::Source::open(input.as_ref())?;
    let name = source.name().to_path_buf();

    // A replaced target's partial file is opened first, so that an unwritable folder fails
    // before a long validation pass; if validation fails, an empty partial file is removed.
    // A resumed one keeps its complete lines until validation knows where the batches end.
    let (mut out, complete) = match (options.resume, output.is_replace()) {
        (true, _) => {
            let (out, complete) = output.open_resume(1)?;
            (Some(out), complete)
        }
        (false, true) => (Some(output.open()?), 0),
        (false, false) => (None, 0),
    };
    // The partial file records what wrote it; a resumed one must have been written by this
    // model with these settings.
    if let Some(out) = &mut out {
        out.claim(&model.run_identity())?;
    }
    let mut resume = match (complete, output.partial_path()) {
        (0, _) | (_, None) => None,
        (_, Some(partial)) => Some(Resuming::new(partial, complete, output.target())?),
    };

    // Pass 1: validate every record, holding one at a time, and close the batches.
    let mut batcher = Batcher::new(batch_tokens, options.batch_size);
    let mut invalid_lines = Vec::new();
    let mut valid = 0u64;
    {
        let total = source.len();
        let (mut reader, read) = source.first_pass()?;
        let mut records = JsonlRecords::new(BufReader::new(&mut reader), &name);
        let mut failed = None;
        'pass: loop {
            let chunk = next_chunk(&mut records, options.skip_invalid);
            if chunk.is_empty() {
                break;
            }
            let checked: Vec<_> = chunk
                .into_par_iter()
                .map(|(line, record)| {
                    let checked = record.and_then(|r| {
                        let tokens = model.tokens(&model.encode(&r, line)?);
                        Ok((r, tokens))
                    });
                    (line, checked)
                })
                .collect();
            for (line, checked) in checked {
                progress.validating(read.get(), total);
                match checked {
                    Ok((r, tokens)) => {
                        if let Some(end) = batcher.push(tokens) {
                            if let Some(resume) = &mut resume {
                                resume.batch_end(end)?;
                            }
                        }
                        if let Some(resume) = &mut resume {
                            resume.check(&r, line, valid);
                        }
                        valid += 1;
                    }
                    Err(e) if options.skip_invalid && !matches!(e, kev_core::Error::Io { .. }) => {
                        progress.skipped(&e);
                        invalid_lines.push(line);
                    }
                    Err(e) => {
                        failed = Some(e);
                        break 'pass;
                    }
                }
            }
        }
        drop(records);
        if let Some(e) = failed {
            return Err(match reader.spool_error.take() {
                Some(spool) => input::spool_error(&name, spool),
                None => e.into(),
            });
        }
        progress.validating(read.get(), total);
        reader.finish(&name)?;
    }
    if let (Some(end), Some(resume)) = (batcher.finish(), &mut resume) {
        resume.batch_end(end)?;
    }
    if valid < complete {
        return Err(ScoreError::Resume {
            partial: output
                .partial_path()
                .unwrap_or(output.target())
                .to_path_buf(),
            message: format!(
                "it holds {complete} lines, but `{}` has only {valid} valid records",
                name.display()
            ),
        });
    }
    let (resumed, metrics) = match resume {
        Some(resume) => (resume.kept, resume.kept_metrics),
        None => (0, Metrics::default()),
    };
    let validation = started.elapsed();

    // Pass 2: score the batches, reading ahead and writing behind the model.
    let started = Instant::now();
    let mut out = match out.take() {
        Some(out) => out,
        None => output.open()?,
    };
    out.keep_lines(resumed)?;
    let spans = batcher.after(resumed);
    let total = valid - resumed;
    progress.scoring(0, total);
    let second = source.second_pass()?;
    let pass = ReadPass {
        name: &name,
        invalid_lines: &invalid_lines,
        resumed,
        valid,
        spans: &spans,
    };
    let (out, batches, batch_tokens, metrics) = std::thread::scope(|scope| {
        let (batch_tx, batch_rx) = sync_channel::<Result<Batch<S::Encoded>, ScoreError>>(1);
        let (scored_tx, scored_rx) = sync_channel::<Scored>(1);
        let reader = spawn(scope, "reader", move || pass.run(model, second, &batch_tx))?;
        let writer = match spawn(scope, "writer", move || {
            write_batches(scored_rx, out, metrics)
        }) {
            Ok(writer) => writer,
            Err(e) => {
                drop(batch_rx);
                let _ = reader.join();
                return Err(e);
            }
        };
        let (mut done, mut batches, mut batch_tokens) = (0u64, 0u64, 0u64);
        let mut failure = None;
        for item in &batch_rx {
            let batch = match item {
                Ok(batch) => batch,
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            };
            let tokens = batch.tokens;
            let scored = match batch.score(model) {
                Ok(scored) => scored,
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            };
            let records = scored.records.len() as u64;
            if scored_tx.send(scored).is_err() {
                // The writer stopped: its error comes out of `join` below.
                break;
            }
            done += records;
            batches += 1;
            batch_tokens += tokens;
            progress.scoring(done, total);
        }
        // Unblock both threads before waiting for them: the reader's next send fails, the
        // writer sees the end of its batches.
        drop(batch_rx);
        drop(scored_tx);
        let written = join(writer, "writer");
        let read = join(reader, "reader");
        // The writer's batches come before the model's, which come before the reader's.
        let (out, written_metrics) = written??;
        if let Some(e) = failure {
            return Err(e);
        }
        read?;
        Ok((out, batches, batch_tokens, written_metrics))
    })?;
    let records = out.lines();
    out.finish()?;
    Ok(Summary {
        records,
        resumed,
        skipped: invalid_lines.len() as u64,
        metrics,
        validation,
        scoring: started.elapsed(),
        batches,
        batch_tokens,
    })
}

/// One batch of the scoring pass as the validation pass closed it: its records and their
/// tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Span {
    records: u64,
    tokens: u64,
}

/// The batches [`score`] cuts records of these token counts into ([`ScoreOptions::batch_tokens`]
/// and [`ScoreOptions::batch_size`]'s rule), as ranges of their indices, in order.
pub fn batch_ranges(
    tokens: impl IntoIterator<Item = usize>,
    batch_tokens: usize,
    batch_size: usize,
) -> Vec<std::ops::Range<usize>> {
    let mut batcher = Batcher::new(batch_tokens, batch_size);
    let mut ends: Vec<u64> = tokens.into_iter().filter_map(|t| batcher.push(t)).collect();
    ends.extend(batcher.finish());
    let mut start = 0;
    ends.into_iter()
        .map(|end| {
            let range = start..end as usize;
            start = range.end;
            range
        })
        .collect()
}

/// Closes batches by the token budget and the record cap from the records' token counts alone,
/// so that the same input and options always give the same batches: what lets `resume` keep
/// whole batches of an earlier run. Keeps a [`Span`] per batch, never a record.
#[derive(Debug)]
struct Batcher {
    budget: u64,
    cap: u64,
    open: Span,
    closed: Vec<Span>,
    /// Records in the closed batches.
    end: u64,
}

impl Batcher {
    fn new(batch_tokens: usize, batch_size: usize) -> Self {
        Batcher {
            budget: batch_tokens as u64,
            cap: u64::try_from(batch_size).unwrap_or(u64::MAX),
            open: Span::default(),
            closed: Vec::new(),
            end: 0,
        }
    }

    /// Adds a record of `tokens`. When it closes the open batch (it would take it over the
    /// budget or the cap), returns the records before it, where that batch ends.
    fn push(&mut self, tokens: usize) -> Option<u64> {
        let tokens = tokens as u64;
        let full = self.open.records > 0
            && (self.open.tokens.saturating_add(tokens) > self.budget
                || self.open.records >= self.cap);
        let closed = full.then(|| self.close());
        self.open.records += 1;
        self.open.tokens = self.open.tokens.saturating_add(tokens);
        closed
    }

    /// Closes the last batch, if it holds records; returns where it ends.
    fn finish(&mut self) -> Option<u64> {
        (self.open.records > 0).then(|| self.close())
    }

    fn close(&mut self) -> u64 {
        let span = std::mem::take(&mut self.open);
        self.end += span.records;
        self.closed.push(span);
        self.end
    }

    /// The batches after the first `records` records, which end a batch.
    fn after(&self, records: u64) -> Vec<Span> {
        let mut end = 0;
        self.closed
            .iter()
            .skip_while(|span| {
                let skip = end < records;
                end += span.records;
                skip
            })
            .copied()
            .collect()
    }
}

/// The partial output of a resumed run, checked during the validation pass: its lines are
/// kept up to the last batch end within them, and a line that does not belong to its record
/// refuses the resume only when it is among those kept.
struct Resuming {
    previous: PreviousLines,
    /// Complete lines in the partial file.
    complete: u64,
    /// Lines kept so far (a batch end) and their metrics.
    kept: u64,
    kept_metrics: Metrics,
    /// Metrics of every line checked.
    metrics: Metrics,
    /// The first line that does not fit its record (its index), and why.
    mismatch: Option<(u64, ScoreError)>,
}

impl Resuming {
    fn new(partial: &Path, complete: u64, target: &Path) -> Result<Self, ScoreError> {
        let file = File::open(partial).map_err(|e| {
            ScoreError::output(target, format!("reading `{}`", partial.display()), e)
        })?;
        Ok(Resuming {
            previous: PreviousLines {
                reader: BufReader::new(file),
                partial: partial.to_path_buf(),
                buf: String::new(),
            },
            complete,
            kept: 0,
            kept_metrics: Metrics::default(),
            metrics: Metrics::default(),
            mismatch: None,
        })
    }

    /// Checks the line of valid record `index` (input line `line`), if the file has one.
    fn check(&mut self, record: &Record, line: usize, index: u64) {
        if index < self.complete && self.mismatch.is_none() {
            if let Err(e) = self.previous.check(record, line, &mut self.metrics) {
                self.mismatch = Some((index, e));
            }
        }
    }

    /// A batch ends after `end` valid records: its lines are kept if the file holds them all,
    /// which needs every one of them to fit its record.
    fn batch_end(&mut self, end: u64) -> Result<(), ScoreError> {
        if end > self.complete {
            return Ok(());
        }
        if let Some((index, _)) = &self.mismatch {
            if *index < end {
                let (_, e) = self.mismatch.take().expect("just matched");
                return Err(e);
            }
        }
        self.kept = end;
        self.kept_metrics = self.metrics.clone();
        Ok(())
    }
}

/// Records the validation pass parses before encoding them in parallel, at most: the chunk
/// closes at this many records or [`CHUNK_BYTES`] of text, whichever comes first, so its memory
/// stays a few megabytes however the file runs.
const CHUNK_RECORDS: usize = 256;
/// Text bytes of a validation chunk at most (see [`CHUNK_RECORDS`]).
const CHUNK_BYTES: usize = 8 << 20;

/// The next records of the validation pass, each with its line, to be encoded in parallel. An
/// I/O error ends the chunk, and so does a line that is not a record unless such lines are
/// skipped: a pass that stops at it reads no further (past an overlong line may lie the rest of
/// an endless one).
fn next_chunk<R: BufRead>(
    records: &mut JsonlRecords<R>,
    skip_invalid: bool,
) -> Vec<(usize, kev_core::Result<Record>)> {
    let mut chunk = Vec::new();
    let mut bytes = 0;
    while chunk.len() < CHUNK_RECORDS && bytes < CHUNK_BYTES {
        let Some((line, record)) = records.next() else {
            break;
        };
        bytes += record.as_ref().map_or(0, Record::text_bytes);
        let failed = match &record {
            Err(kev_core::Error::Io { .. }) => true,
            Err(_) => !skip_invalid,
            Ok(_) => false,
        };
        chunk.push((line, record));
        if failed {
            break;
        }
    }
    chunk
}

/// A batch read and encoded by the reader thread.
struct Batch<E> {
    lines: Vec<usize>,
    records: Vec<Record>,
    encoded: Vec<E>,
    tokens: u64,
}

/// A batch scored: what the writer thread formats and writes.
struct Scored {
    lines: Vec<usize>,
    records: Vec<Record>,
    probs: Vec<Vec<Vec<f32>>>,
}

impl<E> Batch<E> {
    /// Runs the model on the batch, checking that it returns one result per record.
    fn score<S: Scorer<Encoded = E>>(self, model: &S) -> Result<Scored, ScoreError> {
        let lines = &self.lines;
        let (first_line, last_line) = (lines[0], lines[lines.len() - 1]);
        let probs = model
            .score_batch(&self.encoded)
            .map_err(|source| ScoreError::Batch {
                first_line,
                last_line,
                source,
            })?;
        if probs.len() != self.records.len() {
            return Err(ScoreError::Shape {
                line: first_line,
                message: format!(
                    "{} results for the batch of {} records at lines {first_line}..={last_line}",
                    probs.len(),
                    self.records.len()
                ),
            });
        }
        Ok(Scored {
            lines: self.lines,
            records: self.records,
            probs,
        })
    }
}

/// What the reader thread of the scoring pass needs.
#[derive(Clone, Copy)]
struct ReadPass<'a> {
    name: &'a Path,
    invalid_lines: &'a [usize],
    resumed: u64,
    valid: u64,
    spans: &'a [Span],
}

impl ReadPass<'_> {
    /// Reads the input again and sends the batches of `spans`, encoded, in order; a failure is
    /// the last thing sent. Stops when the receiver is gone.
    fn run<S: Scorer>(
        self,
        model: &S,
        reader: BufReader<File>,
        tx: &SyncSender<Result<Batch<S::Encoded>, ScoreError>>,
    ) {
        if let Err(e) = self.read(model, reader, tx) {
            let _ = tx.send(Err(e));
        }
    }

    fn read<S: Scorer>(
        self,
        model: &S,
        reader: BufReader<File>,
        tx: &SyncSender<Result<Batch<S::Encoded>, ScoreError>>,
    ) -> Result<(), ScoreError> {
        let mut records = ValidRecords {
            records: JsonlRecords::new(reader, self.name),
            invalid_lines: self.invalid_lines,
            next_invalid: 0,
            seen: 0,
            pass: self,
        };
        for _ in 0..self.resumed {
            records.next_record()?;
        }
        for span in self.spans {
            let capacity = usize::try_from(span.records).unwrap_or(usize::MAX);
            let mut batch = Batch {
                lines: Vec::with_capacity(capacity),
                records: Vec::with_capacity(capacity),
                encoded: Vec::with_capacity(capacity),
                tokens: 0,
            };
            let mut read = Vec::with_capacity(capacity);
            for _ in 0..span.records {
                read.push(records.next_record()?);
            }
            let encoded: Vec<_> = read
                .par_iter()
                .map(|(line, record)| model.encode(record, *line))
                .collect();
            for ((line, record), encoded) in read.into_iter().zip(encoded) {
                let encoded = encoded.map_err(|e| {
                    self.changed(format!("{e} (it was valid in the validation pass)"))
                })?;
                batch.tokens += model.tokens(&encoded) as u64;
                batch.lines.push(line);
                batch.records.push(record);
                batch.encoded.push(encoded);
            }
            if batch.tokens != span.tokens {
                return Err(self.changed(format!(
                    "the records at lines {}..={} have {} tokens, {} in the validation pass",
                    batch.lines[0],
                    batch.lines[batch.lines.len() - 1],
                    batch.tokens,
                    span.tokens
                )));
            }
            if tx.send(Ok(batch)).is_err() {
                return Ok(());
            }
        }
        records.end()
    }

    fn changed(&self, message: String) -> ScoreError {
        ScoreError::InputChanged {
            input: self.name.to_path_buf(),
            message,
        }
    }
}

/// The valid records of the scoring pass, in order, checked against the validation pass.
struct ValidRecords<'a> {
    records: JsonlRecords<BufReader<File>>,
    invalid_lines: &'a [usize],
    next_invalid: usize,
    seen: u64,
    pass: ReadPass<'a>,
}

impl ValidRecords<'_> {
    /// The next valid record and its line; the end of the input is an error here.
    fn next_record(&mut self) -> Result<(usize, Record), ScoreError> {
        match self.next_valid()? {
            Some(next) => Ok(next),
            None => Err(self.pass.changed(format!(
                "{} records, {} in the validation pass",
                self.seen, self.pass.valid
            ))),
        }
    }

    /// Checks that no valid record is left.
    fn end(&mut self) -> Result<(), ScoreError> {
        match self.next_valid()? {
            None => Ok(()),
            Some((line, _)) => Err(self.pass.changed(format!(
                "line {line}: more records than the {} of the validation pass",
                self.pass.valid
            ))),
        }
    }

    fn next_valid(&mut self) -> Result<Option<(usize, Record)>, ScoreError> {
        for (line, record) in &mut self.records {
            if self.invalid_lines.get(self.next_invalid) == Some(&line) {
                self.next_invalid += 1;
                continue;
            }
            let record = match record {
                Ok(r) => r,
                Err(e @ kev_core::Error::Io { .. }) => return Err(e.into()),
                Err(e) => {
                    return Err(self
                        .pass
                        .changed(format!("{e} (it was valid in the validation pass)")))
                }
            };
            self.seen += 1;
            if self.seen > self.pass.valid {
                return Err(self.pass.changed(format!(
                    "line {line}: more records than the {} of the validation pass",
                    self.pass.valid
                )));
            }
            return Ok(Some((line, record)));
        }
        Ok(None)
    }
}

/// The writer thread: formats each scored batch whole (a bad result in it writes none of it),
/// then writes it. Returns the output, not yet finished, and the metrics of every line.
fn write_batches(
    batches: Receiver<Scored>,
    mut out: Output,
    mut metrics: Metrics,
) -> Result<(Output, Metrics), ScoreError> {
    for batch in batches {
        let mut batch_metrics = metrics.clone();
        let formatted = batch
            .records
            .iter()
            .zip(&batch.probs)
            .zip(&batch.lines)
            .map(|((r, p), &line)| format_record(r, p, line, &mut batch_metrics))
            .collect::<Result<Vec<_>, _>>()?;
        for text in &formatted {
            out.write_line(text)?;
        }
        metrics = batch_metrics;
    }
    Ok((out, metrics))
}

/// Starts a named thread of the scoring pass.
fn spawn<'scope, T: Send + 'scope>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    thread: &'static str,
    f: impl FnOnce() -> T + Send + 'scope,
) -> Result<std::thread::ScopedJoinHandle<'scope, T>, ScoreError> {
    std::thread::Builder::new()
        .name(format!("kev-score-{thread}"))
        .spawn_scoped(scope, f)
        .map_err(|e| ScoreError::Worker {
            thread,
            message: format!("it could not start: {e}"),
        })
}

/// Waits for a thread of the scoring pass; its panic becomes [`ScoreError::Worker`].
fn join<T>(
    handle: std::thread::ScopedJoinHandle<'_, T>,
    thread: &'static str,
) -> Result<T, ScoreError> {
    handle.join().map_err(|payload| ScoreError::Worker {
        thread,
        message: format!(
            "it panicked: {}",
            payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into())
        ),
    })
}

/// The partial output's lines, read back one per valid record while resuming.
struct PreviousLines {
    reader: BufReader<File>,
    partial: std::path::PathBuf,
    buf: String,
}

impl PreviousLines {
    /// Checks that the next line is `record`'s (same ids, one distribution of the right
    /// length per question, finite, its argmax naming the option) and counts it in `metrics`.
    fn check(
        &mut self,
        record: &Record,
        line: usize,
        metrics: &mut Metrics,
    ) -> Result<(), ScoreError> {
        let mismatch = |message: String| ScoreError::Resume {
            partial: self.partial.clone(),
            message: format!("{message}; remove it or run without resume"),
        };
        self.buf.clear();
        let n = self
            .reader
            .read_line(&mut self.buf)
            .map_err(|e| ScoreError::Resume {
                partial: self.partial.clone(),
                message: format!("reading it: {e}"),
            })?;
        if n == 0 {
            return Err(mismatch("it ended early".into()));
        }
        let parsed: Result<PreviousRecord, _> = serde_json::from_str(self.buf.trim_end());
        let Ok(prev) = parsed else {
            return Err(mismatch(format!(
                "its line for the record at input line {line} is not an output line"
            )));
        };
        let fits = prev.id == record.id
            && prev.questions.len() == record.questions.len()
            && prev.questions.iter().zip(&record.questions).all(|(p, q)| {
                p.id == q.id
                    && p.probs.len() == q.options.len()
                    && p.probs.iter().all(|x| x.is_finite())
                    && p.argmax < q.options.len()
                    && p.option == q.options[p.argmax]
            });
        if !fits {
            return Err(mismatch(format!(
                "its line for the record at input line {line}{} does not match that record",
                record
                    .id
                    .as_ref()
                    .map(|i| format!(" (`{i}`)"))
                    .unwrap_or_default()
            )));
        }
        for (p, q) in prev.questions.iter().zip(&record.questions) {
            metrics.add(q.answer, &p.probs, p.argmax);
        }
        Ok(())
    }
}

#[derive(serde::Deserialize)]
struct PreviousRecord {
    id: Option<String>,
    questions: Vec<PreviousQuestion>,
}

#[derive(serde::Deserialize)]
struct PreviousQuestion {
    id: Option<String>,
    probs: Vec<f32>,
    argmax: usize,
    option: String,
}

#[cfg(test)]
mod tests {
    use super::{batch_ranges, gpu_batch_tokens};

    #[test]
    fn batch_ranges_close_before_the_record_over_the_budget() {
        // 3 + 3 fit 6; a record over the budget is alone; the cap closes at 2 records.
        assert_eq!(
            batch_ranges([3, 3, 3, 10, 1], 6, usize::MAX),
            vec![0..2, 2..3, 3..4, 4..5]
        );
        assert_eq!(batch_ranges([1, 1, 1], 100, 2), vec![0..2, 2..3]);
        assert!(batch_ranges([], 6, 2).is_empty());
    }

    #[test]
    fn gpu_batch_tokens_hold_the_working_memory_and_fit_the_card() {
        const GB: u64 = 1_000_000_000;
        // 0.8B (hidden 1,024) in bf16: 2^28 hidden values, far within a quarter of 80 GB.
        assert_eq!(gpu_batch_tokens(1024, 2, Some(80 * GB)), 262_144);
        assert_eq!(gpu_batch_tokens(1024, 2, None), 262_144);
        // 27B (5,120) on 80 GB: the values' 52,428, within the card's quarter.
        assert_eq!(gpu_batch_tokens(5120, 2, Some(80 * GB)), (1 << 28) / 5120);
        // 4B (2,560) on a 16 GB card: a quarter of it at 27 values a token and hidden unit,
        // below the values' 104,857.
        assert_eq!(gpu_batch_tokens(2560, 2, Some(16 * GB)), 28_935);
        // f32 activations take twice the bytes.
        assert_eq!(
            gpu_batch_tokens(2560, 4, Some(16 * GB)),
            (4 * GB / (27 * 4 * 2560)) as usize
        );
        // Within 8,192 and 262,144 tokens whatever the model or card.
        assert_eq!(gpu_batch_tokens(4096, 2, Some(GB / 10)), 8192);
        assert_eq!(gpu_batch_tokens(64, 4, None), 262_144);
        assert_eq!(gpu_batch_tokens(0, 0, Some(0)), 8192);
    }
}
