//! Counts the GPU dispatches of one forward per backend, on the CPU (`kev_kernels::dispatch`):
//! the model runs on the CPU while every op makes the choices it would make on CUDA (the H200)
//! or on Metal and counts what it would launch there. Prints a table per records file: per
//! layer kind, the dispatches of one layer (the range over the layers of that kind), and those
//! outside the layers (embedding, final norm, pointer head); then the dispatches that launch a
//! kernel of candle's own ([`Tally::candle_kernels`]).
//!
//! ```sh
//! python bench/make_checkpoint.py --size 0.8b --out bench/.cache/kev-0.8b
//! python bench/records.py --out bench/.cache/records
//! cargo run --release --example dispatch_count -- --checkpoint bench/.cache/kev-0.8b \
//!     --records bench/.cache/records/one.jsonl --records bench/.cache/records/batch8.jsonl
//! ```
//!
//! A file of one record runs the prefix form (`probs`), a file of several the batch form
//! (`probs_batch`); with `--keep`, both keep every state as a prefix (`run` with `keep`, what a
//! server with a prefix cache runs). `--ops` adds each op's share of one layer of each kind.

use std::collections::BTreeMap;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Parser;
use kev::{Backend, DType, DecisionModel, JsonlRecords, LoadOptions, Record};
use kev_candle::qwen35::LayerType;
use kev_kernels::dispatch::{self, Tally};

/// Count a forward's GPU dispatches per backend, on the CPU.
#[derive(Parser, Debug)]
#[command(about)]
struct Args {
    /// Checkpoint folder (holding kev.json).
    #[arg(long)]
    checkpoint: PathBuf,
    /// JSONL workload; repeat the flag for several.
    #[arg(long, required = true)]
    records: Vec<PathBuf>,
    /// Also list each op's dispatches in the first layer of each kind.
    #[arg(long)]
    ops: bool,
    /// Keep every state as a prefix (`DecisionModel::run` with `keep`).
    #[arg(long)]
    keep: bool,
}

const BACKENDS: [(dispatch::Backend, &str); 2] = [
    (dispatch::Backend::Cuda, "CUDA (eager)"),
    (dispatch::Backend::Metal, "Metal"),
];

fn main() -> Result<()> {
    let args = Args::parse();
    let options = LoadOptions {
        backend: Backend::Cpu,
        dtype: DType::BF16,
        ..LoadOptions::default()
    };
    // Loaded as a GPU would load it (projections in the checkpoint's layout, bf16 activations):
    // the same for both GPU backends, so one load serves both counts.
    let (model, load_tally) = dispatch::count(dispatch::Backend::Cuda, || {
        DecisionModel::load(&args.checkpoint, &options)
    });
    let model = model.with_context(|| format!("loading `{}`", args.checkpoint.display()))?;
    let kinds: Vec<&str> = model
        .backbone()
        .config()
        .layer_types
        .iter()
        .map(|t| match t {
            LayerType::LinearAttention => "DeltaNet layer",
            LayerType::FullAttention => "attention layer",
        })
        .collect();
    if args.ops {
        println!("load, CUDA: {}", op_list(&load_tally, None));
    }
    for path in &args.records {
        let records = read_records(path)?;
        let form = match (records.len(), args.keep) {
            (1, false) => "prefix form, one record",
            (_, false) => "batch form",
            (_, true) => "keeping the states",
        };
        let mut tallies = Vec::new();
        for (backend, _) in BACKENDS {
            let (probs, tally) = dispatch::count(backend, || match &records[..] {
                _ if args.keep => {
                    let encoded = model.encode_records(&records).map_err(|(_, e)| e)?;
                    Ok(model
                        .run(&encoded, &[], true)?
                        .into_iter()
                        .map(|s| s.probs)
                        .collect())
                }
                [record] => model.probs(record).map(|p| vec![p]),
                _ => model.probs_batch(&records),
            });
            probs.with_context(|| format!("scoring `{}`", path.display()))?;
            if !tally.is_complete() {
                bail!("{backend:?}: a composed path without counting ran: {tally:?}")
            }
            tallies.push(tally);
        }
        println!("\n{} ({form}, {} records)\n", path.display(), records.len());
        print_table(&kinds, &tallies);
        for (tally, (_, name)) in tallies.iter().zip(BACKENDS) {
            let mut per_op: BTreeMap<&str, usize> = BTreeMap::new();
            for (_, op, n) in tally.candle_kernels() {
                *per_op.entry(op).or_default() += n;
            }
            let candle: Vec<String> = per_op.iter().map(|(op, n)| format!("{op} {n}")).collect();
            let listed = if candle.is_empty() {
                "none".to_string()
            } else {
                candle.join(", ")
            };
            println!("\ncandle's own kernels, {name}: {listed}");
        }
        if args.ops {
            print_ops(&kinds, &tallies);
        }
    }
    Ok(())
}

/// Per layer kind: the range of one layer's dispatches and the sum; then outside the layers
/// and the whole forward.
fn print_table(kinds: &[&str], tallies: &[Tally]) {
    let names: Vec<&str> = BACKENDS.iter().map(|b| b.1).collect();
    println!("| | layers | {} |", names.join(" | "));
    println!("|---|---|{}", "---|".repeat(names.len()));
    let mut distinct: Vec<&str> = kinds.to_vec();
    distinct.dedup();
    distinct.sort();
    distinct.dedup();
    for kind in distinct {
        let layers: Vec<usize> = (0..kinds.len()).filter(|&i| kinds[i] == kind).collect();
        let cells: Vec<String> = tallies
            .iter()
            .map(|t| {
                let per_layer: Vec<usize> = layers.iter().map(|&i| t.of_layer(Some(i))).collect();
                let (low, high) = (per_layer.iter().min(), per_layer.iter().max());
                let sum: usize = per_layer.iter().sum();
                match (low, high) {
                    (Some(low), Some(high)) if low == high => format!("{low} per layer ({sum})"),
                    (Some(low), Some(high)) => format!("{low}–{high} per layer ({sum})"),
                    _ => "–".to_string(),
                }
            })
            .collect();
        println!("| {kind} | {} | {} |", layers.len(), cells.join(" | "));
    }
    let outside: Vec<String> = tallies
        .iter()
        .map(|t| t.of_layer(None).to_string())
        .collect();
    println!(
        "| embedding, final norm, head | – | {} |",
        outside.join(" | ")
    );
    let totals: Vec<String> = tallies
        .iter()
        .map(|t| format!("**{}**", t.total()))
        .collect();
    println!(
        "| whole forward | {} | {} |",
        kinds.len(),
        totals.join(" | ")
    );
}

/// Each op's dispatches in the first layer of each kind and outside the layers, per backend.
fn print_ops(kinds: &[&str], tallies: &[Tally]) {
    let mut firsts: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, kind) in kinds.iter().enumerate() {
        firsts.entry(kind).or_insert(i);
    }
    for (kind, layer) in firsts {
        for (tally, (_, name)) in tallies.iter().zip(BACKENDS) {
            println!("{kind} {layer}, {name}: {}", op_list(tally, Some(layer)));
        }
    }
    for (tally, (_, name)) in tallies.iter().zip(BACKENDS) {
        println!("outside the layers, {name}: {}", op_list(tally, None));
    }
}

/// `op n, …` for the dispatches of `layer` (`None`: outside the layers).
fn op_list(tally: &Tally, layer: Option<usize>) -> String {
    let ops: Vec<String> = tally
        .entries()
        .filter(|(l, _, n)| *l == layer && *n > 0)
        .map(|(_, op, n)| format!("{op} {n}"))
        .collect();
    ops.join(", ")
}

fn read_records(path: &Path) -> Result<Vec<Record>> {
    let file =
        std::fs::File::open(path).with_context(|| format!("opening `{}`", path.display()))?;
    let records: Vec<Record> = JsonlRecords::new(BufReader::new(file), path)
        .map(|(line, r)| r.with_context(|| format!("`{}` line {line}", path.display())))
        .collect::<Result<_>>()?;
    if records.is_empty() {
        bail!("`{}` holds no record", path.display())
    }
    Ok(records)
}
