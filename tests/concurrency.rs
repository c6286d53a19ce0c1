//! One shared `DecisionModel`, many threads: 8 threads score a mix of the fixture records with
//! every scoring call (`probs`, `probs_batch`, `probs_and_prefix` then `probs_with_prefix`) and
//! every result must be bit-identical to the same call made serially before the threads start.
//!
//! The normal suite runs it for 3 seconds. The long form also samples the process's resident
//! memory (`VmRSS` of /proc/self/status) and checks that it stays flat after a warm-up: the
//! largest sample of the last quarter of the run within 3% or 8 MiB (whichever is more) of the
//! largest of the first quarter:
//!
//! ```sh
//! KEV_CONCURRENCY_SECS=180 cargo test --release --test concurrency -- --nocapture
//! ```

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kev::{DecisionModel, JsonlRecords, LoadOptions, Record};

const THREADS: usize = 8;

fn fixture(rel: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

fn records() -> Vec<Record> {
    let text = std::fs::read_to_string(fixture("records.jsonl")).unwrap();
    JsonlRecords::new(text.as_bytes(), "records.jsonl")
        .map(|(_, r)| r.unwrap())
        .collect()
}

/// Probabilities as bits, so that equality is bit-identity (and NaN would differ from itself).
type Bits = Vec<Vec<u32>>;

fn bits(probs: &[Vec<f32>]) -> Bits {
    probs
        .iter()
        .map(|q| q.iter().map(|p| p.to_bits()).collect())
        .collect()
}

/// One scoring call of the mix.
#[derive(Clone, Copy, Debug)]
enum Call {
    /// `probs` of record i.
    Probs(usize),
    /// `probs_batch` of records i..i+n (wrapping around).
    Batch(usize, usize),
    /// `probs_and_prefix` of record i, then `probs_with_prefix` with that prefix.
    Prefix(usize),
}

/// What a call returns, as bits: one entry per record scored (the prefix call gives two).
fn run(model: &DecisionModel, records: &[Record], call: Call) -> Vec<Bits> {
    match call {
        Call::Probs(i) => vec![bits(&model.probs(&records[i]).unwrap())],
        Call::Batch(i, n) => {
            let batch: Vec<Record> = (i..i + n)
                .map(|j| records[j % records.len()].clone())
                .collect();
            model
                .probs_batch(&batch)
                .unwrap()
                .iter()
                .map(|p| bits(p))
                .collect()
        }
        Call::Prefix(i) => {
            let (probs, prefix) = model.probs_and_prefix(&records[i]).unwrap();
            let again = model.probs_with_prefix(&records[i], &prefix).unwrap();
            vec![bits(&probs), bits(&again)]
        }
    }
}

/// Every call of the mix: each record alone and with its prefix, and batches of 2, 3 and 5.
fn calls(n: usize) -> Vec<Call> {
    let mut calls = Vec::new();
    for i in 0..n {
        calls.push(Call::Probs(i));
        calls.push(Call::Prefix(i));
        for size in [2, 3, 5] {
            calls.push(Call::Batch(i, size));
        }
    }
    calls
}

/// Resident memory of this process, in KiB.
fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn threads_share_one_model_bit_identically() {
    let secs: u64 = std::env::var("KEV_CONCURRENCY_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let long = secs >= 60;
    let model = DecisionModel::load(fixture("kev-small"), &LoadOptions::default()).unwrap();
    let records = records();
    let calls = calls(records.len());
    // The reference: every call once, serially, before any thread starts.
    let serial: Vec<Vec<Bits>> = calls.iter().map(|&c| run(&model, &records, c)).collect();

    let stop = AtomicBool::new(false);
    let done = AtomicUsize::new(0);
    let samples: Mutex<Vec<(f64, u64)>> = Mutex::new(Vec::new());
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (model, records, calls, serial, stop, done) =
                (&model, &records, &calls, &serial, &stop, &done);
            s.spawn(move || {
                // Each thread walks the calls in its own order (a stride coprime to their
                // number), so different calls overlap.
                let stride = [1, 7, 11, 13, 17, 19, 23, 29][t];
                let mut k = t;
                while !stop.load(Ordering::Relaxed) {
                    let i = k % calls.len();
                    let got = run(model, records, calls[i]);
                    assert!(
                        got == serial[i],
                        "thread {t}: {:?} differs from its serial result",
                        calls[i]
                    );
                    done.fetch_add(1, Ordering::Relaxed);
                    k += stride;
                }
            });
        }
        s.spawn(|| {
            while start.elapsed() < Duration::from_secs(secs) {
                samples
                    .lock()
                    .unwrap()
                    .push((start.elapsed().as_secs_f64(), rss_kib()));
                std::thread::sleep(Duration::from_millis(100));
            }
            stop.store(true, Ordering::Relaxed);
        });
    });

    let samples = samples.into_inner().unwrap();
    let calls_done = done.load(Ordering::Relaxed);
    let q = samples.len() / 4;
    let max_of = |s: &[(f64, u64)]| s.iter().map(|x| x.1).max().unwrap_or(0);
    let (first, last) = (max_of(&samples[..q]), max_of(&samples[samples.len() - q..]));
    eprintln!(
        "{THREADS} threads, {:.1} s, {calls_done} calls ({} kinds), all bit-identical to serial; RSS max first quarter {} KiB, last quarter {} KiB, overall {} KiB",
        start.elapsed().as_secs_f64(),
        calls.len(),
        first,
        last,
        max_of(&samples)
    );
    assert!(calls_done >= THREADS, "too few calls ran: {calls_done}");
    if long {
        let slack = (first * 3 / 100).max(8 << 10);
        assert!(
            last <= first + slack,
            "RSS grew: max {first} KiB in the first quarter, {last} KiB in the last"
        );
    }
}
