//! Memory and time of `kev::score::score` on a large file (issue 23's streaming figures).
//!
//! ```sh
//! python3 bench/stream_records.py --n 1000000 --out bench/.cache/stream-1m.jsonl
//! cargo run --release --example stream_bench -- --records bench/.cache/stream-1m.jsonl --out /tmp/o.jsonl
//! cargo run --release --example stream_bench -- --records bench/.cache/stream-1m.jsonl --out /tmp/o.jsonl --stub
//! ```
//! Prints the run's summary and the process's peak resident memory (`VmHWM`). With `--stub`
//! the validation pass is the real one (the checkpoint's encoder) but the scoring pass returns
//! uniform distributions instead of running the model: it measures everything the pipeline
//! itself holds (reading, both passes, formatting, writing, the rename) at full speed, where
//! the model would take hours on a small CPU. With `--forward-only` it times the library alone
//! on the same batches: every record read and encoded first, then
//! [`DecisionModel::score_batch`] over the batches of the `--batch-tokens`/`--batch-size`
//! rule, which is the throughput `score` is held to (BENCHMARKS.md, "CPU: `score` at scale").

use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use kev::score::{OutputPlan, Quiet, ScoreOptions, Scorer};
use kev::{Backend, DecisionModel, EncodedRecord, JsonlRecords, LoadOptions, Record};

#[derive(Parser, Debug)]
struct Args {
    /// Checkpoint folder; by default the shipped small one.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    #[arg(long)]
    records: PathBuf,
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = kev::score::CPU_BATCH_TOKENS)]
    batch_tokens: usize,
    /// Records per batch at most; by default the token budget alone decides.
    #[arg(long)]
    batch_size: Option<usize>,
    /// Uniform distributions instead of the model in the scoring pass.
    #[arg(long)]
    stub: bool,
    /// Time `score_batch` over the batches alone (records read and encoded beforehand).
    #[arg(long)]
    forward_only: bool,
}

/// The library's batch throughput on the records of `path`: all read and encoded first, cut
/// into batches as `ScoreOptions::batch_tokens` says (a batch closes before the record that
/// would take it over the budget or the cap), then only the forwards timed.
fn forward_only(model: &DecisionModel, path: &Path, budget: usize, cap: usize) -> Result<()> {
    let reader = BufReader::new(std::fs::File::open(path)?);
    let mut encoded = Vec::new();
    for (_, record) in JsonlRecords::new(reader, path) {
        encoded.push(model.encode_record(&record?, None)?);
    }
    let mut batches: Vec<Vec<EncodedRecord>> = Vec::new();
    let mut open: Vec<EncodedRecord> = Vec::new();
    let mut open_tokens = 0;
    for record in encoded {
        if !open.is_empty() && (open_tokens + record.tokens() > budget || open.len() == cap) {
            batches.push(std::mem::take(&mut open));
            open_tokens = 0;
        }
        open_tokens += record.tokens();
        open.push(record);
    }
    if !open.is_empty() {
        batches.push(open);
    }
    let records: usize = batches.iter().map(Vec::len).sum();
    let started = Instant::now();
    for batch in &batches {
        model.score_batch(batch)?;
    }
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "forward_only records {records} batches {} forward_s {seconds:.2} records_per_s {:.2}",
        batches.len(),
        records as f64 / seconds.max(1e-9)
    );
    Ok(())
}

/// The real encoder; uniform distributions in place of the forward pass.
struct Stub<'a>(&'a DecisionModel);

impl Scorer for Stub<'_> {
    /// The encoding (for its tokens) and each question's option count.
    type Encoded = (EncodedRecord, Vec<usize>);

    fn encode(&self, record: &Record, line: usize) -> kev::Result<Self::Encoded> {
        let options = record.questions.iter().map(|q| q.options.len()).collect();
        Ok((self.0.encode_record(record, Some(line))?, options))
    }

    fn tokens(&self, (encoded, _): &Self::Encoded) -> usize {
        encoded.tokens()
    }

    fn score_batch(&self, records: &[Self::Encoded]) -> kev::Result<Vec<Vec<Vec<f32>>>> {
        Ok(records
            .iter()
            .map(|(_, options)| options.iter().map(|&n| vec![1.0 / n as f32; n]).collect())
            .collect())
    }
}

fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn main() -> Result<()> {
    let args = Args::parse();
    let checkpoint = args.checkpoint.clone().unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kev-small")
    });
    let model = DecisionModel::load(
        &checkpoint,
        &LoadOptions::default().with_backend(Backend::Cpu),
    )?;
    if args.forward_only {
        let cap = args.batch_size.unwrap_or(usize::MAX);
        return forward_only(&model, &args.records, args.batch_tokens, cap);
    }
    let plan = OutputPlan::new(&args.out)?;
    let options = ScoreOptions {
        batch_tokens: Some(args.batch_tokens),
        batch_size: args.batch_size.unwrap_or(usize::MAX),
        ..ScoreOptions::default()
    };
    let summary = if args.stub {
        kev::score::score(&Stub(&model), &args.records, &plan, &options, &mut Quiet)?
    } else {
        kev::score::score(&model, &args.records, &plan, &options, &mut Quiet)?
    };
    let validation = summary.validation.as_secs_f64();
    let scoring = summary.scoring.as_secs_f64();
    println!(
        "records {} questions {} stub {} validation_s {validation:.2} scoring_s {scoring:.2} \
         validation_per_record_us {:.2} records_per_s {:.2} validation_over_scoring {:.4} peak_rss_kib {}",
        summary.records,
        summary.metrics.questions,
        args.stub,
        validation * 1e6 / summary.records.max(1) as f64,
        summary.records_per_second(),
        validation / scoring.max(1e-9),
        peak_rss_kib().unwrap_or(0),
    );
    Ok(())
}
