//! Scores a JSONL file of Kev records and writes one JSON line per record, in input order.
//!
//! ```sh
//! cargo run --release --example score                       # the shipped small checkpoint and records
//! cargo run --release --example score -- --checkpoint my-kev --records in.jsonl --out out.jsonl
//! ```
//! Each output line: `{"id": "r17", "questions": [{"id": "q1", "probs": [..], "argmax": 2, "option": "c"}]}`.
//! A summary goes to stderr. Invalid records stop the run (non-zero exit, nothing written) unless
//! `--skip-invalid` is given; then they are reported with their line number and left out.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kev::{Backend, DType, DecisionModel, JsonlRecords, LoadOptions, Record};
use serde::Serialize;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Score Kev records with a Kev checkpoint.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Checkpoint folder (holding kev.json). By default, the small checkpoint shipped in the repository.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// JSONL records, or `-` for stdin. By default, the sample records shipped in the repository.
    #[arg(long)]
    records: Option<PathBuf>,
    /// Output JSONL file, or `-` for stdout (the default). Written only once every record is scored.
    #[arg(long, default_value = "-")]
    out: PathBuf,
    /// auto, cpu, cuda[:i] or metal[:i]. By default, auto: Metal on Apple Silicon, CUDA where built and present, else CPU.
    #[arg(long, default_value = "auto")]
    backend: Backend,
    /// auto, f32, bf16 or f16. By default, auto: f32 on the CPU, bf16 on GPUs.
    #[arg(long, default_value = "auto")]
    dtype: DType,
    /// Adapter interpolation: 0 = base model, 1 = fine-tuned (the default).
    #[arg(long, default_value_t = 1.0)]
    lora_scale: f64,
    /// Report invalid records (with their line number) and go on without them.
    #[arg(long)]
    skip_invalid: bool,
    /// Records scored together (their states as one batch, then all their branches as one batch).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    batch_size: u64,
}

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

/// Accuracy and log-loss over questions that carry an `answer`.
#[derive(Default)]
struct Metrics {
    questions: usize,
    answered: usize,
    correct: usize,
    log_loss: f64,
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

fn run(args: Args) -> Result<()> {
    let checkpoint = args
        .checkpoint
        .clone()
        .unwrap_or_else(|| Path::new(ROOT).join("tests/fixtures/kev-small"));
    let records_path = args
        .records
        .clone()
        .unwrap_or_else(|| Path::new(ROOT).join("tests/fixtures/records.jsonl"));

    let started = Instant::now();
    let options = LoadOptions::default()
        .with_backend(args.backend)
        .with_dtype(args.dtype)
        .with_lora_scale(args.lora_scale);
    let model = DecisionModel::load(&checkpoint, &options)
        .with_context(|| format!("loading checkpoint `{}`", checkpoint.display()))?;
    eprintln!(
        "loaded `{}` on {:?} ({:?}) in {:.2} s",
        checkpoint.display(),
        model.device().location(),
        model.dtype(),
        started.elapsed().as_secs_f64()
    );

    let records = read_records(&records_path, &model, args.skip_invalid)?;
    let progress = progress_bar(
        records.len(),
        args.records.as_deref() != Some(Path::new("-")),
    );
    let started = Instant::now();
    let mut lines = Vec::with_capacity(records.len());
    let mut metrics = Metrics::default();
    for chunk in records.chunks(args.batch_size as usize) {
        let batch: Vec<Record> = chunk.iter().map(|(_, r)| r.clone()).collect();
        let probs = model.probs_batch(&batch).with_context(|| {
            format!(
                "scoring records at lines {}..={}",
                chunk[0].0,
                chunk[chunk.len() - 1].0
            )
        })?;
        for (record, probs) in batch.iter().zip(&probs) {
            lines.push(format_record(record, probs, &mut metrics)?);
        }
        progress.inc(chunk.len() as u64);
    }
    progress.finish_and_clear();
    let elapsed = started.elapsed().as_secs_f64();
    write_output(&args.out, &lines)?;

    eprintln!(
        "records: {}, questions: {}",
        records.len(),
        metrics.questions
    );
    if metrics.answered > 0 {
        eprintln!(
            "accuracy: {:.4} ({} / {} answered questions), mean log-loss: {:.4}",
            metrics.correct as f64 / metrics.answered as f64,
            metrics.correct,
            metrics.answered,
            metrics.log_loss / metrics.answered as f64
        );
    }
    eprintln!(
        "{:.2} records/s ({:.2} s scoring)",
        records.len() as f64 / elapsed.max(1e-9),
        elapsed
    );
    Ok(())
}

/// Reads and encodes every record first, so an invalid one stops the run before any output.
fn read_records(
    path: &Path,
    model: &DecisionModel,
    skip_invalid: bool,
) -> Result<Vec<(usize, Record)>> {
    let reader: Box<dyn BufRead> = if path == Path::new("-") {
        Box::new(BufReader::new(std::io::stdin()))
    } else {
        let file = std::fs::File::open(path)
            .with_context(|| format!("opening records `{}`", path.display()))?;
        Box::new(BufReader::new(file))
    };
    let mut records = Vec::new();
    let mut skipped = 0;
    for (line, record) in JsonlRecords::new(reader, path) {
        let checked = record.and_then(|r| model.encoder().encode(&r, Some(line)).map(|_| r));
        match checked {
            Ok(r) => records.push((line, r)),
            Err(e) if skip_invalid && !matches!(e, kev::Error::Io { .. }) => {
                eprintln!("skipping: {e}");
                skipped += 1;
            }
            Err(e) => return Err(e).with_context(|| format!("in `{}`", path.display())),
        }
    }
    if skipped > 0 {
        eprintln!("skipped {skipped} invalid record(s)");
    }
    Ok(records)
}

fn format_record(record: &Record, probs: &[Vec<f32>], metrics: &mut Metrics) -> Result<String> {
    let mut questions = Vec::with_capacity(record.questions.len());
    for (q, p) in record.questions.iter().zip(probs) {
        let argmax = p
            .iter()
            .enumerate()
            .fold(0, |best, (i, x)| if *x > p[best] { i } else { best });
        metrics.questions += 1;
        if let Some(answer) = q.answer {
            metrics.answered += 1;
            metrics.correct += usize::from(argmax == answer);
            metrics.log_loss -= f64::from(p[answer].max(1e-12)).ln();
        }
        questions.push(QuestionOut {
            id: q.id.as_deref(),
            probs: p,
            argmax,
            option: &q.options[argmax],
        });
    }
    let out = RecordOut {
        id: record.id.as_deref(),
        questions,
    };
    Ok(serde_json::to_string(&out)?)
}

/// Writes all lines at once: to stdout, or to a temporary file renamed over `out` at the end.
fn write_output(out: &Path, lines: &[String]) -> Result<()> {
    if out == Path::new("-") {
        let mut stdout = std::io::stdout().lock();
        for l in lines {
            writeln!(stdout, "{l}")?;
        }
        return Ok(stdout.flush()?);
    }
    let Some(name) = out.file_name() else {
        bail!("`--out {}` is not a file path", out.display())
    };
    let tmp = out.with_file_name(format!(".{}.partial", name.to_string_lossy()));
    let write = || -> std::io::Result<()> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        for l in lines {
            writeln!(f, "{l}")?;
        }
        f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, out)
    };
    write()
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
        .with_context(|| format!("writing `{}`", out.display()))
}

fn progress_bar(len: usize, from_file: bool) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(len as u64), ProgressDrawTarget::stderr());
    if !from_file || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    if let Ok(style) =
        ProgressStyle::with_template("{bar:40} {pos}/{len} records {per_sec} eta {eta}")
    {
        bar.set_style(style);
    }
    bar
}
