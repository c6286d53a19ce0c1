//! Batches chosen by a token budget: the batches `score` runs follow the stated rule (closed
//! before the record that would pass the budget or the record cap, a record over the budget
//! alone), a resumed run with token batches gives the uninterrupted run's bytes from every cut,
//! and a failure or panic on a thread of the scoring pass is an error, never a hang.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use kev::score::{score, OutputPlan, Quiet, ScoreError, ScoreOptions, Scorer, Summary};
use kev::{DecisionModel, EncodedRecord, Record};

use crate::common::{model, record_lines, write_run_file};

/// The real model, noting the input lines of every batch it runs.
struct Recording {
    /// Taken when the scorer is made: `encode` runs on rayon's pool, where waiting for another
    /// test's first load of the shared model (which itself runs on that pool) could deadlock.
    model: &'static DecisionModel,
    batches: Mutex<Vec<Vec<usize>>>,
    /// What [`Scorer::default_batch_tokens`] answers (`None`: the trait's default).
    default_budget: Option<usize>,
}

impl Default for Recording {
    fn default() -> Self {
        Recording {
            model: model(),
            batches: Mutex::default(),
            default_budget: None,
        }
    }
}

impl Scorer for Recording {
    type Encoded = (EncodedRecord, usize);

    fn encode(&self, record: &Record, line: usize) -> kev::Result<Self::Encoded> {
        Ok((Scorer::encode(self.model, record, line)?, line))
    }

    fn tokens(&self, (encoded, _): &Self::Encoded) -> usize {
        encoded.tokens()
    }

    fn score_batch(&self, records: &[Self::Encoded]) -> kev::Result<Vec<Vec<Vec<f32>>>> {
        self.batches
            .lock()
            .unwrap()
            .push(records.iter().map(|(_, line)| *line).collect());
        let encoded: Vec<EncodedRecord> = records.iter().map(|(e, _)| e.clone()).collect();
        self.model.score_batch(&encoded)
    }

    fn default_batch_tokens(&self) -> usize {
        self.default_budget
            .unwrap_or_else(|| self.model.default_batch_tokens())
    }
}

/// The fixture records repeated `copies` times, ids made distinct.
fn repeated(dir: &Path, copies: usize) -> (PathBuf, Vec<String>) {
    let mut lines = Vec::new();
    for copy in 0..copies {
        for line in record_lines() {
            let mut v: serde_json::Value = serde_json::from_str(&line).unwrap();
            let id = format!("{}-{copy}", v["id"].as_str().unwrap_or("r"));
            v["id"] = id.into();
            lines.push(v.to_string());
        }
    }
    let path = dir.join("records.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    (path, lines)
}

/// Each record's tokens (state plus every branch), from the model's encoding.
fn token_counts(lines: &[String]) -> Vec<usize> {
    lines
        .iter()
        .map(|l| {
            let record = Record::from_json_str(l, None).unwrap();
            model().encode_record(&record, None).unwrap().tokens()
        })
        .collect()
}

/// The batches (1-based input lines) that the rule of `ScoreOptions::batch_tokens` gives,
/// written out here as the reference.
fn expected_batches(tokens: &[usize], budget: usize, cap: usize) -> Vec<Vec<usize>> {
    let mut batches: Vec<Vec<usize>> = Vec::new();
    let mut open: Vec<usize> = Vec::new();
    let mut open_tokens = 0;
    for (i, &t) in tokens.iter().enumerate() {
        if !open.is_empty() && (open_tokens + t > budget || open.len() == cap) {
            batches.push(std::mem::take(&mut open));
            open_tokens = 0;
        }
        open.push(i + 1);
        open_tokens += t;
    }
    if !open.is_empty() {
        batches.push(open);
    }
    batches
}

fn options(batch_tokens: usize, batch_size: usize) -> ScoreOptions {
    ScoreOptions {
        batch_tokens: Some(batch_tokens),
        batch_size,
        ..ScoreOptions::default()
    }
}

fn run(scorer: &impl Scorer, input: &Path, target: &Path, options: &ScoreOptions) -> Summary {
    score(
        scorer,
        input,
        &OutputPlan::new(target).unwrap(),
        options,
        &mut Quiet,
    )
    .unwrap()
}

#[test]
fn batches_follow_the_token_budget_and_a_long_record_runs_alone() {
    let dir = tempfile::tempdir().unwrap();
    let (input, lines) = repeated(dir.path(), 2);
    let tokens = token_counts(&lines);
    let longest = *tokens.iter().max().unwrap();
    let shortest = *tokens.iter().min().unwrap();
    // Below the longest record (which then runs alone), above three short ones.
    let budget = longest - 1;
    assert!(3 * shortest <= budget, "{tokens:?}");
    for (budget, cap) in [(budget, usize::MAX), (budget, 2), (usize::MAX, 5), (1, 3)] {
        let want = expected_batches(&tokens, budget, cap);
        let mut runs = Vec::new();
        for _ in 0..2 {
            let scorer = Recording::default();
            let target = dir.path().join("out.jsonl");
            let summary = run(&scorer, &input, &target, &options(budget, cap));
            let got = scorer.batches.into_inner().unwrap();
            assert_eq!(got, want, "budget {budget}, cap {cap}");
            assert_eq!(summary.batches, want.len() as u64);
            assert_eq!(
                summary.batch_tokens,
                tokens.iter().map(|&t| t as u64).sum::<u64>()
            );
            runs.push(std::fs::read(&target).unwrap());
        }
        assert_eq!(runs[0], runs[1], "budget {budget}, cap {cap}");
        if budget < longest {
            let alone = want
                .iter()
                .filter(|b| b.iter().any(|&l| tokens[l - 1] == longest))
                .all(|b| b.len() == 1);
            assert!(alone, "{want:?}");
        }
        if budget == longest - 1 && cap == usize::MAX {
            assert!(want.iter().any(|b| b.len() >= 3), "{want:?}");
        }
    }
}

#[test]
fn without_a_budget_the_scorer_default_decides() {
    let dir = tempfile::tempdir().unwrap();
    let (input, lines) = repeated(dir.path(), 2);
    let tokens = token_counts(&lines);
    // The CPU model's default is past the whole file: one batch.
    assert_eq!(model().default_batch_tokens(), kev::score::CPU_BATCH_TOKENS);
    assert!(tokens.iter().sum::<usize>() <= kev::score::CPU_BATCH_TOKENS);
    let budget = *tokens.iter().max().unwrap();
    for (default_budget, want) in [
        (None, vec![(1..=lines.len()).collect()]),
        (Some(budget), expected_batches(&tokens, budget, usize::MAX)),
    ] {
        assert!(want.len() > 1 || default_budget.is_none(), "{want:?}");
        let scorer = Recording {
            default_budget,
            ..Recording::default()
        };
        let unset = ScoreOptions::default();
        assert_eq!(unset.batch_tokens, None);
        run(&scorer, &input, &dir.path().join("out.jsonl"), &unset);
        assert_eq!(scorer.batches.into_inner().unwrap(), want);
    }
}

#[test]
fn resume_with_token_batches_gives_the_full_run_bytes_from_every_cut() {
    let dir = tempfile::tempdir().unwrap();
    let (input, lines) = repeated(dir.path(), 2);
    let tokens = token_counts(&lines);
    let budget = tokens.iter().max().unwrap() + tokens.iter().min().unwrap();
    let opts = options(budget, usize::MAX);
    let batches = expected_batches(&tokens, budget, usize::MAX);
    assert!(batches.iter().any(|b| b.len() > 1), "{batches:?}");
    let ends: Vec<u64> = batches
        .iter()
        .scan(0u64, |end, b| {
            *end += b.len() as u64;
            Some(*end)
        })
        .collect();

    let full_target = dir.path().join("full.jsonl");
    let full_summary = run(model(), &input, &full_target, &opts);
    let full = std::fs::read(&full_target).unwrap();
    let line_ends: Vec<usize> = full
        .iter()
        .enumerate()
        .filter(|(_, &b)| b == b'\n')
        .map(|(i, _)| i + 1)
        .collect();
    // Every line end, and a cut inside every line.
    let mut cuts = vec![0];
    let mut start = 0;
    for &end in &line_ends {
        cuts.push(start + (end - start) / 2);
        cuts.push(end);
        start = end;
    }
    let target = dir.path().join("out.jsonl");
    let plan = OutputPlan::new(&target).unwrap();
    let partial = plan.partial_path().unwrap().to_path_buf();
    let resume = ScoreOptions {
        resume: true,
        ..opts
    };
    for cut in cuts {
        let _ = std::fs::remove_file(&target);
        std::fs::write(&partial, &full[..cut]).unwrap();
        write_run_file(&partial);
        let complete = line_ends.iter().filter(|&&e| e <= cut).count() as u64;
        let kept = ends.iter().copied().filter(|&e| e <= complete).max();
        let summary = score(model(), &input, &plan, &resume, &mut Quiet).unwrap();
        assert_eq!(
            std::fs::read(&target).unwrap(),
            full,
            "resumed from a partial file of {cut} bytes"
        );
        assert_eq!(summary.resumed, kept.unwrap_or(0), "cut {cut}");
        assert_eq!(summary.records, full_summary.records);
        assert_eq!(summary.metrics, full_summary.metrics, "cut {cut}");
        assert!(!partial.exists());
    }
}

/// How [`Failing`] fails, counting from 1.
#[derive(Clone, Copy)]
enum Fail {
    /// The reader thread panics encoding this record of the scoring pass.
    ReaderPanic(usize),
    /// The model returns an error on this batch.
    ModelError(usize),
    /// The model returns a NaN in this batch: the writer thread refuses it.
    NonFinite(usize),
}

/// The real model, except that one thread of the scoring pass fails as `fail` says.
struct Failing {
    /// Taken when the scorer is made (see [`Recording::model`]).
    model: &'static DecisionModel,
    /// Valid records in the input (the validation pass encodes them all first).
    records: usize,
    fail: Fail,
    encoded: AtomicUsize,
    batches: AtomicUsize,
}

impl Failing {
    fn new(records: usize, fail: Fail) -> Self {
        Failing {
            model: model(),
            records,
            fail,
            encoded: AtomicUsize::new(0),
            batches: AtomicUsize::new(0),
        }
    }
}

impl Scorer for Failing {
    type Encoded = EncodedRecord;

    fn encode(&self, record: &Record, line: usize) -> kev::Result<EncodedRecord> {
        let n = self.encoded.fetch_add(1, Ordering::SeqCst) + 1;
        if let Fail::ReaderPanic(at) = self.fail {
            if n == self.records + at {
                panic!("encoding the record at line {line} failed on purpose");
            }
        }
        Scorer::encode(self.model, record, line)
    }

    fn tokens(&self, record: &EncodedRecord) -> usize {
        record.tokens()
    }

    fn score_batch(&self, records: &[EncodedRecord]) -> kev::Result<Vec<Vec<Vec<f32>>>> {
        let n = self.batches.fetch_add(1, Ordering::SeqCst) + 1;
        let mut probs = self.model.score_batch(records)?;
        match self.fail {
            Fail::ModelError(at) if at == n => {
                return Err(kev::Error::invalid_argument("records", "failed on purpose"))
            }
            Fail::NonFinite(at) if at == n => probs[0][0][0] = f32::NAN,
            _ => {}
        }
        Ok(probs)
    }
}

/// Runs `score` on another thread and waits at most a minute: a hang fails the test.
fn score_within_a_minute(
    scorer: Failing,
    input: &Path,
    target: &Path,
    options: ScoreOptions,
) -> Result<Summary, ScoreError> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (input, target) = (input.to_path_buf(), target.to_path_buf());
    std::thread::spawn(move || {
        let plan = OutputPlan::new(&target).unwrap();
        let _ = tx.send(score(&scorer, &input, &plan, &options, &mut Quiet));
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("score returned within a minute")
}

#[test]
fn a_failing_thread_of_the_scoring_pass_is_an_error_not_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    let (input, lines) = repeated(dir.path(), 3);
    let n = lines.len();
    let target = dir.path().join("out.jsonl");
    let partial = dir.path().join(".out.jsonl.partial");
    let kept = || std::fs::read_to_string(&partial).unwrap().lines().count();

    // The reader panics on the 6th record: the 5 before it are scored and written.
    let fail = Failing::new(n, Fail::ReaderPanic(6));
    let err = score_within_a_minute(fail, &input, &target, options(usize::MAX, 1)).unwrap_err();
    assert!(
        matches!(
            err,
            ScoreError::Worker {
                thread: "reader",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("line 6"), "{err}");
    assert!(!target.exists());
    assert_eq!(kept(), 5);

    // The model fails on its 3rd batch: its lines are named, the 2 batches before are kept.
    let fail = Failing::new(n, Fail::ModelError(3));
    let err = score_within_a_minute(fail, &input, &target, options(usize::MAX, 2)).unwrap_err();
    assert!(
        matches!(
            err,
            ScoreError::Batch {
                first_line: 5,
                last_line: 6,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(kept(), 4);

    // The writer refuses the 2nd batch while the reader and the model run ahead of it.
    let fail = Failing::new(n, Fail::NonFinite(2));
    let err = score_within_a_minute(fail, &input, &target, options(usize::MAX, 1)).unwrap_err();
    assert!(
        matches!(err, ScoreError::NonFinite { line: 2, .. }),
        "{err}"
    );
    assert_eq!(kept(), 1);
}
