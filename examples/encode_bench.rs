//! Benchmarks a checkpoint's tokenizer as Kev uses it: the encoder's load against the
//! `tokenizers` crate's own `Tokenizer::from_file` of the same file (each the median of
//! `--repeats`, with the resident memory each leaves), then encoding every record of a JSONL
//! file on one thread and on rayon's pool (all cores), as `score` and `probs_batch` encode.
//! Prints one JSON line.
//!
//! ```sh
//! cargo run --release --example encode_bench -- --checkpoint bench/.cache/kev-0.8b \
//!     --records bench/.cache/records/varied.jsonl
//! ```

use std::io::BufReader;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use kev::{Checkpoint, Encoder, JsonlRecords, Record};
use rayon::prelude::*;
use serde_json::json;

/// Benchmark a checkpoint's tokenizer (load time, encoding throughput).
#[derive(Parser, Debug)]
#[command(about)]
struct Args {
    /// Checkpoint folder (holding kev.json).
    #[arg(long)]
    checkpoint: PathBuf,
    /// JSONL records to encode.
    #[arg(long)]
    records: PathBuf,
    /// Timed loads of each kind, and timed encoding passes.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Resident memory now (VmRSS), MiB.
fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kib| kib / 1024.0)
}

/// Seconds a pass of `f` takes, median of `repeats`.
fn timed<T>(repeats: usize, mut f: impl FnMut() -> Result<T>) -> Result<f64> {
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let started = Instant::now();
        std::hint::black_box(f()?);
        times.push(started.elapsed().as_secs_f64());
    }
    Ok(median(times))
}

/// Tokens of every record (state plus all branches), encoded one after another or in parallel.
fn encode_all(encoder: &Encoder, records: &[Record], parallel: bool) -> Result<usize> {
    let tokens = |r: &Record| encoder.encode(r, None).map(|e| e.ids.len());
    let counts: Vec<kev::Result<usize>> = if parallel {
        records.par_iter().map(tokens).collect()
    } else {
        records.iter().map(tokens).collect()
    };
    Ok(counts
        .into_iter()
        .collect::<kev::Result<Vec<_>>>()?
        .iter()
        .sum())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let repeats = args.repeats.max(1);
    let checkpoint = Checkpoint::open(&args.checkpoint)?;
    let path = checkpoint.tokenizer.clone();
    let file = std::fs::File::open(&args.records)
        .with_context(|| format!("opening {}", args.records.display()))?;
    let records = JsonlRecords::new(BufReader::new(file), &args.records)
        .map(|(_, r)| r)
        .collect::<kev::Result<Vec<Record>>>()?;

    let rss_before = rss_mib();
    let crate_load_s = timed(repeats, || {
        tokenizers::Tokenizer::from_file(&path).map_err(|e| anyhow::anyhow!("{e}"))
    })?;
    let kev_load_s = timed(repeats, || Ok(checkpoint.encoder()?))?;
    let encoder = checkpoint.encoder()?;
    let rss_with_encoder = rss_mib();

    let tokens = encode_all(&encoder, &records, false)?;
    let one_thread_s = timed(repeats, || encode_all(&encoder, &records, false))?;
    encode_all(&encoder, &records, true)?;
    let parallel_s = timed(repeats, || encode_all(&encoder, &records, true))?;
    println!(
        "{}",
        json!({
            "tokenizer": path,
            "vocab_size": encoder.max_token_id() + 1,
            "crate_from_file_s": crate_load_s,
            "kev_encoder_load_s": kev_load_s,
            "kev_over_crate": kev_load_s / crate_load_s,
            "rss_mib_before": rss_before,
            "rss_mib_with_encoder": rss_with_encoder,
            "records": records.len(),
            "tokens": tokens,
            "threads": rayon::current_num_threads(),
            "one_thread_tokens_per_s": tokens as f64 / one_thread_s,
            "parallel_tokens_per_s": tokens as f64 / parallel_s,
        })
    );
    Ok(())
}
