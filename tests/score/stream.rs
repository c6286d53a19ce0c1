//! `kev::score::score` with the shipped checkpoint and records: streamed output equals the
//! all-in-memory scoring byte for byte, resume continues to the same bytes from any cut, an
//! invalid record writes nothing and is named by its line, `skip_invalid` reports every bad
//! line, and a non-finite probability is never written.

use std::path::{Path, PathBuf};

use kev::score::{score, OutputPlan, Progress, Quiet, ScoreError, ScoreOptions, Scorer, Summary};
use kev::{DecisionModel, EncodedRecord, Record};
use serde::Serialize;

use crate::common::{fixture, model, record_lines, write_run_file};

#[derive(Serialize)]
struct QuestionOut<'a> {
    id: Option<&'a str>,
    probs: &'a [f32],
    argmax: usize,
    option: &'a str,
}

#[derive(Serialize)]
struct RecordOut<'a> {
    id: Option<&'a str>,
    questions: Vec<QuestionOut<'a>>,
}

/// What the all-in-memory `score` wrote: every record read first, then scored in chunks of
/// `batch_size` with `probs_batch`, one JSON line each.
fn in_memory(lines: &[String], batch_size: usize) -> String {
    let records: Vec<Record> = lines
        .iter()
        .enumerate()
        .map(|(i, l)| Record::from_json_str(l, Some(i + 1)).unwrap())
        .collect();
    let mut out = String::new();
    for chunk in records.chunks(batch_size) {
        for (r, probs) in chunk.iter().zip(model().probs_batch(chunk).unwrap()) {
            let questions = r
                .questions
                .iter()
                .zip(&probs)
                .map(|(q, p)| {
                    let argmax = p
                        .iter()
                        .enumerate()
                        .fold(0, |best, (i, x)| if *x > p[best] { i } else { best });
                    QuestionOut {
                        id: q.id.as_deref(),
                        probs: p,
                        argmax,
                        option: &q.options[argmax],
                    }
                })
                .collect();
            let line = RecordOut {
                id: r.id.as_deref(),
                questions,
            };
            out.push_str(&serde_json::to_string(&line).unwrap());
            out.push('\n');
        }
    }
    out
}

fn options(batch_size: usize) -> ScoreOptions {
    ScoreOptions {
        batch_size,
        ..ScoreOptions::default()
    }
}

fn run(input: &Path, target: &Path, options: &ScoreOptions) -> Result<Summary, ScoreError> {
    score(
        model(),
        input,
        &OutputPlan::new(target)?,
        options,
        &mut Quiet,
    )
}

fn write_records(dir: &Path, lines: &[String]) -> PathBuf {
    let path = dir.join("records.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

#[test]
fn streamed_output_equals_the_in_memory_output() {
    let dir = tempfile::tempdir().unwrap();
    let lines = record_lines();
    for batch_size in [8, 5, 1] {
        let target = dir.path().join(format!("out-{batch_size}.jsonl"));
        let summary = run(&fixture("records.jsonl"), &target, &options(batch_size)).unwrap();
        let got = std::fs::read_to_string(&target).unwrap();
        assert_eq!(
            got,
            in_memory(&lines, batch_size),
            "batch size {batch_size}"
        );
        assert_eq!(summary.records, lines.len() as u64);
        assert_eq!(summary.resumed, 0);
        assert_eq!(summary.skipped, 0);
        assert_eq!(summary.metrics.questions, 21);
        assert_eq!(summary.metrics.answered, 16);
        assert_eq!(summary.metrics.correct, 6);
    }
}

#[test]
fn resume_from_any_cut_gives_the_full_run_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let input = fixture("records.jsonl");
    let batch_size = 4;
    let full_target = dir.path().join("full.jsonl");
    let full_summary = run(&input, &full_target, &options(batch_size)).unwrap();
    let full = std::fs::read(&full_target).unwrap();
    let ends: Vec<usize> = full
        .iter()
        .enumerate()
        .filter(|(_, &b)| b == b'\n')
        .map(|(i, _)| i + 1)
        .collect();
    // Cuts: nothing, mid first line, each line end of batches 1 and 2, mid-line, all lines.
    let cuts = [
        0,
        ends[0] / 2,
        ends[0],
        ends[3],
        ends[4] + 3,
        ends[6],
        ends[8] - 1,
        ends[10],
        full.len(),
    ];
    let target = dir.path().join("out.jsonl");
    let plan = OutputPlan::new(&target).unwrap();
    let partial = plan.partial_path().unwrap().to_path_buf();
    for cut in cuts {
        let _ = std::fs::remove_file(&target);
        std::fs::write(&partial, &full[..cut]).unwrap();
        write_run_file(&partial);
        let complete = ends.iter().filter(|&&e| e <= cut).count() as u64;
        let opts = ScoreOptions {
            resume: true,
            ..options(batch_size)
        };
        let summary = score(model(), &input, &plan, &opts, &mut Quiet).unwrap();
        assert_eq!(
            std::fs::read(&target).unwrap(),
            full,
            "resumed from a partial file of {cut} bytes"
        );
        assert_eq!(summary.resumed, complete / 4 * 4, "cut {cut}");
        assert_eq!(summary.records, full_summary.records);
        assert_eq!(summary.metrics, full_summary.metrics, "cut {cut}");
        assert!(!partial.exists());
    }
}

#[test]
fn resume_refuses_a_partial_file_of_other_records() {
    let dir = tempfile::tempdir().unwrap();
    let input = fixture("records.jsonl");
    let full_target = dir.path().join("full.jsonl");
    run(&input, &full_target, &options(1)).unwrap();
    let full = std::fs::read_to_string(&full_target).unwrap();
    let target = dir.path().join("out.jsonl");
    let partial = dir.path().join(".out.jsonl.partial");
    let resume = ScoreOptions {
        resume: true,
        ..options(1)
    };
    // The second record's line names another id.
    let forged: String = full
        .lines()
        .take(3)
        .map(|l| l.replace("\"r2\"", "\"zz\"") + "\n")
        .collect();
    std::fs::write(&partial, &forged).unwrap();
    write_run_file(&partial);
    let err = run(&input, &target, &resume).unwrap_err();
    assert!(matches!(err, ScoreError::Resume { .. }), "{err}");
    assert!(err.to_string().contains("input line 2"), "{err}");
    assert!(!target.exists());
    assert_eq!(std::fs::read_to_string(&partial).unwrap(), forged);
    // More lines than the input has records.
    std::fs::write(
        &partial,
        format!("{full}{}", full.lines().next().unwrap()) + "\n",
    )
    .unwrap();
    let err = run(&input, &target, &resume).unwrap_err();
    assert!(err.to_string().contains("13 lines"), "{err}");
    assert!(!target.exists());
}

#[test]
fn invalid_record_writes_nothing_and_names_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let mut lines = record_lines();
    lines[2] =
        r#"{"id": "bad", "state": "s", "questions": [{"prompt": "p", "options": []}]}"#.into();
    let input = write_records(dir.path(), &lines);
    let target = dir.path().join("out.jsonl");
    std::fs::write(&target, "old\n").unwrap();
    let err = run(&input, &target, &options(2)).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            ScoreError::Kev(kev::Error::Record { line: Some(3), .. })
        ),
        "{msg}"
    );
    assert!(msg.contains("line 3"), "{msg}");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "old\n");
    assert!(!dir.path().join(".out.jsonl.partial").exists());

    // Too long for the checkpoint's max_tokens: found by the validation pass too (and the
    // write-through target is never opened).
    lines[2] = format!(
        r#"{{"id": "long", "state": "{}", "questions": [{{"prompt": "p", "options": ["a"]}}]}}"#,
        "word ".repeat(5000)
    );
    let input = write_records(dir.path(), &lines);
    let err = run(&input, Path::new("/dev/full"), &options(2)).unwrap_err();
    match &err {
        ScoreError::Kev(e) => assert_eq!(line_of(e), Some(3), "{err}"),
        _ => panic!("expected the record's error, got {err}"),
    }
}

#[derive(Default)]
struct Skips(Vec<Option<usize>>);

impl Progress for Skips {
    fn skipped(&mut self, error: &kev::Error) {
        self.0.push(line_of(error));
    }
}

/// The input line a record error names.
fn line_of(error: &kev::Error) -> Option<usize> {
    match error {
        kev::Error::Record { line, .. } | kev::Error::TooLong { line, .. } => *line,
        _ => None,
    }
}

#[test]
fn skip_invalid_reports_every_bad_line() {
    let dir = tempfile::tempdir().unwrap();
    let good = record_lines();
    let mut lines = good.clone();
    lines.insert(1, "{not json".into());
    lines.insert(4, r#"{"id": "x", "questions": []}"#.into());
    lines.insert(
        7,
        format!(
            r#"{{"state": "{}", "questions": [{{"prompt": "p", "options": ["a"]}}]}}"#,
            "word ".repeat(5000)
        ),
    );
    lines.push("[1, 2]".into());
    let input = write_records(dir.path(), &lines);
    let target = dir.path().join("out.jsonl");
    let mut skips = Skips::default();
    let opts = ScoreOptions {
        skip_invalid: true,
        ..options(8)
    };
    let summary = score(
        model(),
        &input,
        &OutputPlan::new(&target).unwrap(),
        &opts,
        &mut skips,
    )
    .unwrap();
    assert_eq!(skips.0, vec![Some(2), Some(5), Some(8), Some(16)]);
    assert_eq!(summary.skipped, 4);
    assert_eq!(summary.records, good.len() as u64);
    assert_eq!(
        std::fs::read_to_string(&target).unwrap(),
        in_memory(&good, 8),
        "the valid records, in order, as if the bad lines were not there"
    );
}

/// The real model, except that one record's distribution is poisoned.
struct Poisoned {
    /// Taken when the scorer is made: `encode` runs on rayon's pool, where waiting for another
    /// test's first load of the shared model (which itself runs on that pool) could deadlock.
    model: &'static DecisionModel,
    state: &'static str,
    value: f32,
}

impl Scorer for Poisoned {
    /// The encoding and whether the record's state is the poisoned one.
    type Encoded = (EncodedRecord, bool);

    fn encode(&self, record: &Record, line: usize) -> kev::Result<Self::Encoded> {
        Ok((
            Scorer::encode(self.model, record, line)?,
            record.state == self.state,
        ))
    }

    fn tokens(&self, (encoded, _): &Self::Encoded) -> usize {
        encoded.tokens()
    }

    fn score_batch(&self, records: &[Self::Encoded]) -> kev::Result<Vec<Vec<Vec<f32>>>> {
        let encoded: Vec<EncodedRecord> = records.iter().map(|(e, _)| e.clone()).collect();
        let mut probs = self.model.score_batch(&encoded)?;
        for ((_, poisoned), p) in records.iter().zip(&mut probs) {
            if *poisoned {
                p[0][0] = self.value;
            }
        }
        Ok(probs)
    }
}

#[test]
fn non_finite_probability_is_an_error_naming_the_record_and_never_written() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("out.jsonl");
    for value in [f32::NAN, f32::INFINITY] {
        let scorer = Poisoned {
            model: model(),
            state: "The patient reports a mild headache.",
            value,
        };
        let err = score(
            &scorer,
            fixture("records.jsonl"),
            &OutputPlan::new(&target).unwrap(),
            &options(3),
            &mut Quiet,
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(
                err,
                ScoreError::NonFinite {
                    line: 8,
                    question: 0,
                    ..
                }
            ),
            "{msg}"
        );
        assert!(msg.contains("line 8") && msg.contains("`r8`"), "{msg}");
        assert!(!target.exists());
        // The batches before the poisoned one are kept for --resume, and nothing of its batch.
        let partial = std::fs::read_to_string(dir.path().join(".out.jsonl.partial")).unwrap();
        assert_eq!(partial.lines().count(), 6, "{partial}");
        for line in partial.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            for q in v["questions"].as_array().unwrap() {
                assert!(
                    q["probs"].as_array().unwrap().iter().all(|p| p.is_f64()),
                    "{line}"
                );
            }
        }
    }
}

/// A scorer that appends a record to the input while validating its last line.
struct Growing {
    /// Taken when the scorer is made (see [`Poisoned::model`]).
    model: &'static DecisionModel,
    input: PathBuf,
    last_line: usize,
}

impl Scorer for Growing {
    type Encoded = EncodedRecord;

    fn encode(&self, record: &Record, line: usize) -> kev::Result<EncodedRecord> {
        if line == self.last_line {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(&self.input)
                .unwrap();
            writeln!(f, "{}", record_lines()[0]).unwrap();
        }
        Scorer::encode(self.model, record, line)
    }

    fn tokens(&self, record: &EncodedRecord) -> usize {
        record.tokens()
    }

    fn score_batch(&self, records: &[EncodedRecord]) -> kev::Result<Vec<Vec<Vec<f32>>>> {
        self.model.score_batch(records)
    }
}

#[test]
fn input_changed_between_the_passes_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let lines = record_lines();
    let input = write_records(dir.path(), &lines);
    let target = dir.path().join("out.jsonl");
    let scorer = Growing {
        model: model(),
        input: input.clone(),
        last_line: lines.len(),
    };
    let err = score(
        &scorer,
        &input,
        &OutputPlan::new(&target).unwrap(),
        &options(4),
        &mut Quiet,
    )
    .unwrap_err();
    assert!(matches!(err, ScoreError::InputChanged { .. }), "{err}");
    assert!(!target.exists());
}

#[test]
fn zero_batch_size_is_an_invalid_argument() {
    let dir = tempfile::tempdir().unwrap();
    let err = run(
        &fixture("records.jsonl"),
        &dir.path().join("o"),
        &options(0),
    )
    .unwrap_err();
    assert!(
        matches!(err, ScoreError::Kev(kev::Error::InvalidArgument { .. })),
        "{err}"
    );
}
