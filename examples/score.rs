//! Scores a JSONL file of Kev records and writes one JSON line per record, in input order.
//!
//! ```sh
//! cargo run --release --example score                       # the shipped small checkpoint and records
//! cargo run --release --example score -- --checkpoint my-kev --records in.jsonl --out out.jsonl
//! ```
//! Each output line: `{"id": "r17", "questions": [{"id": "q1", "probs": [..], "argmax": 2, "option": "c"}]}`.
//! The work is [`kev::score::score`]'s (streamed in two passes; see the README's `score` section
//! for what is guaranteed about the output); this is its command line.
//!
//! Exit status: 0 when every valid record was scored and written; 1 on any error (an invalid
//! record without `--skip-invalid`, a load or model failure, any failure to write the output,
//! stdout's reader leaving early); 2 for a bad command line.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kev::score::{OutputPlan, Progress, ScoreError, ScoreOptions, Summary};
use kev::{Backend, DType, DecisionModel, LoadOptions};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Score Kev records with a Kev checkpoint.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Checkpoint folder (holding kev.json). By default, the small checkpoint shipped in the repository.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// JSONL records, or `-` for stdin (copied to a temporary file for the second pass). By default, the sample records shipped in the repository.
    #[arg(long)]
    records: Option<PathBuf>,
    /// Output JSONL file, or `-` for stdout (the default). A regular file is written beside it and renamed over it at the end; a device or FIFO is written through.
    #[arg(long, default_value = "-")]
    out: PathBuf,
    /// auto, cpu, cuda[:i] or metal[:i]. By default, auto: Metal on Apple Silicon, CUDA where built and present, else CPU.
    #[arg(long, default_value = "auto")]
    backend: Backend,
    /// auto, f32, bf16, f16, int8 (x86-64 CPU with AVX2 and FMA; approximate) or fp8 (H100/H200; approximate). By default, auto: f32 on the CPU, bf16 on GPUs.
    #[arg(long, default_value = "auto")]
    dtype: DType,
    /// Adapter interpolation: 0 = base model, 1 = fine-tuned (the default); checked by the loader.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    lora_scale: f64,
    /// Report invalid records (with their line number) and go on without them.
    #[arg(long)]
    skip_invalid: bool,
    /// Tokens scored together (a record's state plus its branches): a batch closes before the record that would take it over this budget; a longer record is a batch of its own. By default 8192 on the CPU; on a GPU 262,144 at 0.8B, fewer for wider models and within a quarter of the card's memory (`kev::score::gpu_batch_tokens`).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    batch_tokens: Option<u64>,
    /// Records scored together at most (by default, no cap: the token budget decides). A resumed run needs the same --batch-tokens and --batch-size.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    batch_size: Option<u64>,
    /// Continue an interrupted run into the same `--out` from its partial file (`.NAME.partial`).
    #[arg(long)]
    resume: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    kev::keep_freed_memory();
    let mut partial = None;
    match run(&args, &mut partial) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            // A partial file that does not match the input is not worth resuming.
            let resumable = !matches!(
                e.downcast_ref::<ScoreError>(),
                Some(ScoreError::Resume { .. })
            );
            let kept = |p: &PathBuf| resumable && p.metadata().is_ok_and(|m| m.len() > 0);
            if let Some(p) = partial.filter(kept) {
                eprintln!(
                    "the lines written so far are in `{}`: rerun with --resume to continue",
                    p.display()
                );
            }
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args, partial: &mut Option<PathBuf>) -> Result<()> {
    let checkpoint = args
        .checkpoint
        .clone()
        .unwrap_or_else(|| Path::new(ROOT).join("tests/fixtures/kev-small"));
    let records = args
        .records
        .clone()
        .unwrap_or_else(|| Path::new(ROOT).join("tests/fixtures/records.jsonl"));

    // The output is looked at before the model loads, so a bad `--out` fails at once.
    let plan = OutputPlan::new(&args.out)?;
    *partial = plan.partial_path().map(Path::to_path_buf);

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
        model.weights_dtype(),
        started.elapsed().as_secs_f64()
    );

    let options = ScoreOptions {
        batch_tokens: args
            .batch_tokens
            .map(usize::try_from)
            .transpose()
            .context("--batch-tokens")?,
        // A cap past the address space is no cap.
        batch_size: args
            .batch_size
            .map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX)),
        skip_invalid: args.skip_invalid,
        resume: args.resume,
    };
    let mut progress = Bars::new();
    let summary = kev::score::score(&model, &records, &plan, &options, &mut progress);
    progress.clear();
    print_summary(&summary?);
    Ok(())
}

fn print_summary(s: &Summary) {
    let resumed = if s.resumed > 0 {
        format!(" ({} resumed)", s.resumed)
    } else {
        String::new()
    };
    eprintln!(
        "records: {}{resumed}, questions: {}, skipped: {}, {:.2} records/s scored ({:.2} s validation, {:.2} s scoring; {} batch{}, {:.0} tokens per batch)",
        s.records,
        s.metrics.questions,
        s.skipped,
        s.records_per_second(),
        s.validation.as_secs_f64(),
        s.scoring.as_secs_f64(),
        s.batches,
        if s.batches == 1 { "" } else { "es" },
        s.mean_batch_tokens()
    );
    if let (Some(acc), Some(ll)) = (s.metrics.accuracy(), s.metrics.mean_log_loss()) {
        eprintln!(
            "accuracy: {acc:.4} ({} / {} answered questions), mean log-loss: {ll:.4}",
            s.metrics.correct, s.metrics.answered
        );
    }
}

/// Progress bars on a terminal (bytes while validating, records/s and ETA while scoring);
/// nothing but skip reports otherwise.
struct Bars {
    bar: Option<ProgressBar>,
    phase: Phase,
}

#[derive(PartialEq)]
enum Phase {
    Start,
    Validating,
    Scoring,
}

impl Bars {
    fn new() -> Self {
        let bar = std::io::stderr()
            .is_terminal()
            .then(|| ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr()));
        Bars {
            bar,
            phase: Phase::Start,
        }
    }

    fn clear(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

fn set_style(bar: &ProgressBar, template: &str) {
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
}

impl Progress for Bars {
    fn validating(&mut self, read: u64, total: Option<u64>) {
        let Some(bar) = &self.bar else { return };
        if self.phase == Phase::Start {
            self.phase = Phase::Validating;
            match total {
                Some(t) => {
                    bar.set_length(t);
                    set_style(
                        bar,
                        "validating {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
                    );
                }
                None => set_style(bar, "validating {bytes} {binary_bytes_per_sec}"),
            }
        }
        bar.set_position(read);
    }

    fn skipped(&mut self, error: &kev::Error) {
        let message = format!("skipping: {error}");
        match &self.bar {
            Some(bar) => bar.suspend(|| eprintln!("{message}")),
            None => eprintln!("{message}"),
        }
    }

    fn scoring(&mut self, done: u64, total: u64) {
        let Some(bar) = &self.bar else { return };
        if self.phase != Phase::Scoring {
            self.phase = Phase::Scoring;
            bar.reset();
            bar.set_length(total);
            set_style(
                bar,
                "{bar:40} {pos}/{len} records {per_sec} eta {eta} ({elapsed})",
            );
        }
        bar.set_position(done);
    }
}
