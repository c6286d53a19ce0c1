//! Scoring a JSONL file of records into a JSONL file of probabilities, streamed: what the `score`
//! example runs, reusable by other front ends.
//!
//! [`score`] makes two passes over the input, each holding one record (validation) or one batch
//! (scoring) at a time, so memory does not grow with the file:
//!
//! 1. **Validation**: every line is parsed and encoded with the model's encoder (the length
//!    check included), without running the model. Without `skip_invalid` the first invalid
//!    record stops the run before anything is written; with it, each invalid line is reported
//!    through [`Progress::skipped`] and left out. When resuming, the records already in the
//!    partial output are checked against it here.
//! 2. **Scoring**: the valid records, in input order, in batches of `batch_size` through
//!    [`Scorer::probs_batch`], each written as one line as soon as its batch is scored.
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
use std::time::{Duration, Instant};

use kev_candle::DecisionModel;
use kev_core::{JsonlRecords, Record};
use serde::Serialize;

pub use error::ScoreError;
pub use output::{Output, OutputPlan};

/// What the pipeline needs of a model; [`DecisionModel`] is one.
pub trait Scorer {
    /// Checks that `record` (from input line `line`) can be scored: encoding and length, no
    /// forward pass.
    fn check(&self, record: &Record, line: usize) -> kev_core::Result<()>;
    /// One distribution per question for each record.
    fn probs_batch(&self, records: &[Record]) -> kev_core::Result<Vec<Vec<Vec<f32>>>>;
}

impl Scorer for DecisionModel {
    fn check(&self, record: &Record, line: usize) -> kev_core::Result<()> {
        self.encoder().encode(record, Some(line)).map(drop)
    }

    fn probs_batch(&self, records: &[Record]) -> kev_core::Result<Vec<Vec<Vec<f32>>>> {
        DecisionModel::probs_batch(self, records)
    }
}

/// How [`score`] runs.
#[derive(Debug, Clone)]
pub struct ScoreOptions {
    /// Records per [`Scorer::probs_batch`] call (at least 1).
    pub batch_size: usize,
    /// Leave invalid records out (reported through [`Progress::skipped`]) instead of stopping.
    pub skip_invalid: bool,
    /// Continue from the partial output of an interrupted run (regular-file outputs only).
    pub resume: bool,
}

impl Default for ScoreOptions {
    fn default() -> Self {
        ScoreOptions {
            batch_size: 8,
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
    /// Scoring pass: `done` of the `total` records this run scores.
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
}

impl Summary {
    /// Records scored by this run per second of the scoring pass.
    pub fn records_per_second(&self) -> f64 {
        (self.records - self.resumed) as f64 / self.scoring.as_secs_f64().max(1e-9)
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
/// the passes. After an error in the scoring pass, the lines written so far stay in the partial
/// file ([`OutputPlan::partial_path`]) for `resume`.
pub fn score(
    model: &impl Scorer,
    input: impl AsRef<Path>,
    output: &OutputPlan,
    options: &ScoreOptions,
    progress: &mut dyn Progress,
) -> Result<Summary, ScoreError> {
    let batch_size = options.batch_size;
    if batch_size == 0 {
        return Err(kev_core::Error::invalid_argument("batch_size", "must be at least 1").into());
    }
    let started = Instant::now();
    let mut source = input::Source::open(input.as_ref())?;
    let name = source.name().to_path_buf();

    // A replaced target's partial file is opened first, so that an unwritable folder fails
    // before a long validation pass; if validation fails, an empty partial file is removed.
    let (mut out, resumed) = match (options.resume, output.is_replace()) {
        (true, _) => {
            let (out, kept) = output.open_resume(batch_size)?;
            (Some(out), kept)
        }
        (false, true) => (Some(output.open()?), 0),
        (false, false) => (None, 0),
    };
    let mut previous = match (resumed, output.partial_path()) {
        (0, _) | (_, None) => None,
        (_, Some(partial)) => Some(PreviousLines {
            reader: BufReader::new(File::open(partial).map_err(|e| {
                ScoreError::output(
                    output.target(),
                    format!("reading `{}`", partial.display()),
                    e,
                )
            })?),
            partial: partial.to_path_buf(),
            buf: String::new(),
        }),
    };

    // Pass 1: validate every record, holding one at a time.
    let mut metrics = Metrics::default();
    let mut invalid_lines = Vec::new();
    let mut valid = 0u64;
    {
        let total = source.len();
        let (mut reader, read) = source.first_pass()?;
        let mut records = JsonlRecords::new(BufReader::new(&mut reader), &name);
        for (line, record) in &mut records {
            progress.validating(read.get(), total);
            match record.and_then(|r| model.check(&r, line).map(|()| r)) {
                Ok(r) => {
                    if let Some(prev) = previous.as_mut().filter(|_| valid < resumed) {
                        prev.check(&r, line, &mut metrics)?;
                    }
                    valid += 1;
                }
                Err(e) if options.skip_invalid && !matches!(e, kev_core::Error::Io { .. }) => {
                    progress.skipped(&e);
                    invalid_lines.push(line);
                }
                Err(e) => {
                    drop(records);
                    return Err(match reader.spool_error.take() {
                        Some(spool) => input::spool_error(&name, spool),
                        None => e.into(),
                    });
                }
            }
        }
        drop(records);
        progress.validating(read.get(), total);
        reader.finish(&name)?;
    }
    if valid < resumed {
        return Err(ScoreError::Resume {
            partial: output
                .partial_path()
                .unwrap_or(output.target())
                .to_path_buf(),
            message: format!(
                "it holds {resumed} lines, but `{}` has only {valid} valid records",
                name.display()
            ),
        });
    }
    let validation = started.elapsed();

    // Pass 2: score in batches, writing each batch as soon as it is scored.
    let started = Instant::now();
    let mut out = match out.take() {
        Some(out) => out,
        None => output.open()?,
    };
    let total = valid - resumed;
    progress.scoring(0, total);
    let changed = |message: String| ScoreError::InputChanged {
        input: name.clone(),
        message,
    };
    let mut batch: Vec<(usize, Record)> = Vec::with_capacity(batch_size);
    let mut done = 0u64;
    let mut seen = 0u64;
    let mut skips = invalid_lines.iter().peekable();
    for (line, record) in JsonlRecords::new(source.second_pass()?, &name) {
        if skips.next_if(|&&l| l == line).is_some() {
            continue;
        }
        let record = match record {
            Ok(r) => r,
            Err(e @ kev_core::Error::Io { .. }) => return Err(e.into()),
            Err(e) => {
                return Err(changed(format!(
                    "{e} (it was valid in the validation pass)"
                )))
            }
        };
        seen += 1;
        if seen > valid {
            return Err(changed(format!(
                "line {line}: more records than the {valid} of the validation pass"
            )));
        }
        if seen <= resumed {
            continue;
        }
        batch.push((line, record));
        if batch.len() == batch_size {
            score_batch(model, &mut batch, &mut out, &mut metrics)?;
            done += batch_size as u64;
            progress.scoring(done, total);
        }
    }
    if !batch.is_empty() {
        done += batch.len() as u64;
        score_batch(model, &mut batch, &mut out, &mut metrics)?;
        progress.scoring(done, total);
    }
    if seen != valid {
        return Err(changed(format!(
            "{seen} records, {valid} in the validation pass"
        )));
    }
    let records = out.lines();
    out.finish()?;
    Ok(Summary {
        records,
        resumed,
        skipped: invalid_lines.len() as u64,
        metrics,
        validation,
        scoring: started.elapsed(),
    })
}

/// Scores and writes one batch, emptying it.
fn score_batch(
    model: &impl Scorer,
    batch: &mut Vec<(usize, Record)>,
    out: &mut Output,
    metrics: &mut Metrics,
) -> Result<(), ScoreError> {
    let (lines, records): (Vec<usize>, Vec<Record>) = batch.drain(..).unzip();
    let (first_line, last_line) = (lines[0], lines[lines.len() - 1]);
    let probs = model
        .probs_batch(&records)
        .map_err(|source| ScoreError::Batch {
            first_line,
            last_line,
            source,
        })?;
    if probs.len() != records.len() {
        return Err(ScoreError::Shape {
            line: first_line,
            message: format!(
                "{} results for the batch of {} records at lines {first_line}..={last_line}",
                probs.len(),
                records.len()
            ),
        });
    }
    // Format the whole batch first: a bad result in it writes none of it.
    let mut batch_metrics = metrics.clone();
    let formatted = records
        .iter()
        .zip(&probs)
        .zip(&lines)
        .map(|((r, p), &line)| format_record(r, p, line, &mut batch_metrics))
        .collect::<Result<Vec<_>, _>>()?;
    for text in &formatted {
        out.write_line(text)?;
    }
    *metrics = batch_metrics;
    Ok(())
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
