//! Load generator for `kev-serve`, run beside the library in one command.
//!
//! ```sh
//! cargo run --release -p kev-serve --example loadgen -- \
//!     --records tests/fixtures/records.jsonl --concurrency 1,4,16,64 --rates 100,400 --duration-s 5
//! ```
//! In order, in one process: the library alone (`probs` per record: single-record latency;
//! `probs_batch` over the file: records/s), then a server started in-process on a loopback port
//! (or `--url` of one running elsewhere) under a closed loop at each `--concurrency` (clients
//! sending one record after another; the prefix cache off, as the records repeat) and an open loop at each `--rates` (requests/s on a fixed
//! schedule, latency from the scheduled time), then the shared-state workload
//! (`--shared-requests` requests over `--shared-states` states, the questions differing) on a
//! server with the prefix cache and one without. Prints one JSON line per measurement and a
//! markdown table.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use kev::{Backend, DType, DecisionModel, LoadOptions, Record};
use kev_serve::{Config, Server};
use serde_json::{json, Value};

#[derive(Parser, Debug)]
struct Args {
    /// Checkpoint (default: the shipped small one).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// JSONL records sent one per request (default: the shipped sample records).
    #[arg(long)]
    records: Option<PathBuf>,
    /// Instead of `--records`: this many records of distinct states of `--shared-words` words,
    /// 4 questions of 4 options each (one token shape, as `bench/records.py`'s workloads).
    #[arg(long, default_value_t = 0)]
    synthetic: usize,
    /// Records per `probs_batch` call of the library figure.
    #[arg(long, default_value_t = 8)]
    lib_batch: usize,
    /// A running server to load instead of an in-process one (the library figures then come from
    /// this process's own copy of the model).
    #[arg(long)]
    url: Option<String>,
    /// Closed-loop client counts.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    concurrency: Vec<usize>,
    /// The in-process server's prefix cache for the closed and open loops, one server each (the
    /// records' states are distinct: a cache too small to hold a prefix never hits, and measures
    /// what keeping the prefixes costs).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    closed_cache_mib: Vec<usize>,
    /// Open-loop request rates (per second).
    #[arg(long, value_delimiter = ',', default_value = "")]
    rates: Vec<String>,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 5.0)]
    duration_s: f64,
    /// Device(s) of the in-process server and of the library.
    #[arg(long, value_delimiter = ',', default_value = "auto")]
    devices: Vec<Backend>,
    /// Backbone dtype.
    #[arg(long, default_value = "auto")]
    dtype: DType,
    /// The in-process server's batch budget.
    #[arg(long, default_value_t = 4096)]
    max_batch_tokens: usize,
    /// The in-process server's batching wait.
    #[arg(long, default_value_t = 0)]
    max_wait_ms: u64,
    /// The in-process server's prefix cache (the shared-state workload runs with it and with 0).
    #[arg(long, default_value_t = 1024)]
    prefix_cache_mib: usize,
    /// Shared-state workload: requests (0: skip it).
    #[arg(long, default_value_t = 2000)]
    shared_requests: usize,
    /// Shared-state workload: distinct states.
    #[arg(long, default_value_t = 50)]
    shared_states: usize,
    /// Shared-state workload: words per state.
    #[arg(long, default_value_t = 200)]
    shared_words: usize,
    /// Shared-state workload: clients.
    #[arg(long, default_value_t = 16)]
    shared_concurrency: usize,
    /// Leave out the library figures (for sweeps of the server's settings).
    #[arg(long)]
    skip_library: bool,
    /// Free text copied into every JSON line.
    #[arg(long, default_value = "")]
    label: String,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

struct Run {
    done: usize,
    records: usize,
    errors: usize,
    elapsed: f64,
    lat_ms: Vec<f64>,
}

impl Run {
    fn json(&self, kind: &str, param: Value, label: &str) -> Value {
        let mut l = self.lat_ms.clone();
        l.sort_by(f64::total_cmp);
        json!({
            "kind": kind, "param": param, "label": label,
            "requests": self.done, "errors": self.errors,
            "records_per_s": self.records as f64 / self.elapsed,
            "requests_per_s": self.done as f64 / self.elapsed,
            "p50_ms": percentile(&l, 0.5), "p90_ms": percentile(&l, 0.9), "p99_ms": percentile(&l, 0.99),
        })
    }
}

/// `clients` clients, each sending the next body as soon as it has its answer, for `duration`
/// (or until `bodies` is used up once, with `once`).
async fn closed_loop(
    url: &str,
    bodies: Arc<Vec<(String, usize)>>,
    clients: usize,
    duration: Duration,
    once: bool,
) -> Run {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(clients)
        .build()
        .expect("client");
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let end = started + duration;
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (client, bodies, next, url) = (
                client.clone(),
                Arc::clone(&bodies),
                Arc::clone(&next),
                url.to_string(),
            );
            tokio::spawn(async move {
                let (mut lat, mut records, mut errors) = (Vec::new(), 0, 0);
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if (once && i >= bodies.len()) || (!once && Instant::now() >= end) {
                        break;
                    }
                    let (body, n) = &bodies[i % bodies.len()];
                    let t = Instant::now();
                    let ok = match client.post(&url).body(body.clone()).send().await {
                        Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                        Err(_) => false,
                    };
                    if ok {
                        lat.push(t.elapsed().as_secs_f64() * 1e3);
                        records += n;
                    } else {
                        errors += 1;
                    }
                }
                (lat, records, errors)
            })
        })
        .collect();
    let mut run = Run {
        done: 0,
        records: 0,
        errors: 0,
        elapsed: 0.0,
        lat_ms: Vec::new(),
    };
    for t in tasks {
        let (lat, records, errors) = t.await.expect("client task");
        run.done += lat.len();
        run.lat_ms.extend(lat);
        run.records += records;
        run.errors += errors;
    }
    run.elapsed = started.elapsed().as_secs_f64();
    run
}

/// Requests sent at `rate` per second on a fixed schedule for `duration`; latency counts from
/// each request's scheduled time, so a slow server cannot hide its queue.
async fn open_loop(
    url: &str,
    bodies: Arc<Vec<(String, usize)>>,
    rate: f64,
    duration: Duration,
) -> Run {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .build()
        .expect("client");
    let started = Instant::now();
    let n = (rate * duration.as_secs_f64()).round() as usize;
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let at = started + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(at.into()).await;
        let (client, bodies, url) = (client.clone(), Arc::clone(&bodies), url.to_string());
        tasks.push(tokio::spawn(async move {
            let (body, n) = &bodies[i % bodies.len()];
            let ok = match client.post(&url).body(body.clone()).send().await {
                Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                Err(_) => false,
            };
            (ok, *n, at.elapsed().as_secs_f64() * 1e3)
        }));
    }
    let mut run = Run {
        done: 0,
        records: 0,
        errors: 0,
        elapsed: 0.0,
        lat_ms: Vec::new(),
    };
    for t in tasks {
        let (ok, n, ms) = t.await.expect("request task");
        if ok {
            run.done += 1;
            run.records += n;
            run.lat_ms.push(ms);
        } else {
            run.errors += 1;
        }
    }
    run.elapsed = started.elapsed().as_secs_f64();
    run
}

fn read_records(path: &std::path::Path) -> Result<Vec<Value>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading `{}`", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| Ok(serde_json::from_str(l)?))
        .collect()
}

/// `requests` records over `states` states of `words` words, each with its own question.
fn shared_workload(requests: usize, states: usize, words: usize) -> Vec<Value> {
    let vocab = [
        "market", "price", "rain", "river", "north", "signal", "volume", "risk", "order", "city",
        "morning", "trade", "cloud", "bridge", "yield", "storm",
    ];
    let state = |s: usize| -> String {
        (0..words)
            .map(|w| vocab[(s * 7 + w * 3 + w / 5) % vocab.len()])
            .collect::<Vec<_>>()
            .join(" ")
            + &format!(" (case {s})")
    };
    let states: Vec<String> = (0..states).map(state).collect();
    (0..requests)
        .map(|i| {
            let q = i / states.len();
            json!({
                "id": format!("req{i}"),
                "state": states[i % states.len()],
                "questions": [{"prompt": format!("Question {q}: what next for {}?", vocab[q % vocab.len()]),
                               "options": ["buy", "sell", "hold", format!("wait {q}")]}]
            })
        })
        .collect()
}

/// `n` records of distinct states of `words` words, 4 questions of 4 options each.
fn synthetic(n: usize, words: usize) -> Vec<Value> {
    let opts = ["north", "south", "east", "west"];
    shared_workload(n, n, words)
        .into_iter()
        .enumerate()
        .map(|(i, mut v)| {
            v["questions"] = json!((0..4)
                .map(|q| json!({"prompt": format!("Question {q} of case {i}?"), "options": opts}))
                .collect::<Vec<_>>());
            v
        })
        .collect()
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn server_config(args: &Args, cache_mib: usize) -> Config {
    let mut c = Config::new();
    c.addr = "127.0.0.1:0".parse().expect("address");
    c.checkpoint = args.checkpoint.clone();
    c.devices = args.devices.clone();
    c.dtype = args.dtype;
    c.max_batch_tokens = args.max_batch_tokens;
    c.max_wait_ms = args.max_wait_ms;
    c.prefix_cache_mib = cache_mib;
    c.queue_capacity = 4096;
    c
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let duration = Duration::from_secs_f64(args.duration_s);
    let records_path = args
        .records
        .clone()
        .unwrap_or_else(|| kev_serve::config::shipped_checkpoint().join("../records.jsonl"));
    let values = if args.synthetic > 0 {
        synthetic(args.synthetic, args.shared_words)
    } else {
        read_records(&records_path)?
    };
    let records: Vec<Record> = values
        .iter()
        .map(|v| Record::from_json_value(v, None))
        .collect::<kev::Result<_>>()?;
    let mut rows: Vec<Value> = Vec::new();
    let mut emit = |v: Value| {
        println!("{v}");
        rows.push(v);
    };

    // The library alone.
    if !args.skip_library {
        let dir = args
            .checkpoint
            .clone()
            .unwrap_or_else(kev_serve::config::shipped_checkpoint);
        let options = LoadOptions::default()
            .with_backend(args.devices[0])
            .with_dtype(args.dtype);
        let model = Arc::new(DecisionModel::load(&dir, &options)?);
        let m = Arc::clone(&model);
        let recs = records.clone();
        let lib_batch = args.lib_batch.max(1);
        let (single, batch) = tokio::task::spawn_blocking(move || -> kev::Result<_> {
            for r in &recs {
                m.probs(r)?;
            }
            for chunk in recs.chunks(lib_batch) {
                m.probs_batch(chunk)?;
            }
            let mut single = Vec::new();
            let end = Instant::now() + duration;
            while Instant::now() < end {
                for r in &recs {
                    let t = Instant::now();
                    m.probs(r)?;
                    single.push(t.elapsed().as_secs_f64() * 1e3);
                }
            }
            let (mut n, t) = (0usize, Instant::now());
            while t.elapsed() < duration {
                for chunk in recs.chunks(lib_batch) {
                    m.probs_batch(chunk)?;
                    n += chunk.len();
                }
            }
            Ok((single, n as f64 / t.elapsed().as_secs_f64()))
        })
        .await??;
        let mut s = single.clone();
        s.sort_by(f64::total_cmp);
        emit(
            json!({"kind": "library", "param": "probs (1 record)", "label": args.label,
                    "records_per_s": s.len() as f64 / (s.iter().sum::<f64>() / 1e3),
                    "p50_ms": percentile(&s, 0.5), "p90_ms": percentile(&s, 0.9), "p99_ms": percentile(&s, 0.99)}),
        );
        emit(
            json!({"kind": "library", "param": format!("probs_batch ({} records a call)", args.lib_batch),
                    "label": args.label, "records_per_s": batch}),
        );
    }

    let bodies: Arc<Vec<(String, usize)>> =
        Arc::new(values.iter().map(|v| (v.to_string(), 1)).collect());
    let caches = match &args.url {
        Some(_) => vec![None],
        None => args.closed_cache_mib.iter().copied().map(Some).collect(),
    };
    for cache in caches {
        let (server, url) = match (&args.url, cache) {
            (Some(u), _) => (None, format!("{}/v1/score", u.trim_end_matches('/'))),
            (None, cache) => {
                let mut s = Server::start(server_config(&args, cache.unwrap_or(0))).await?;
                s.ready().await?;
                let url = format!("http://{}/v1/score", s.addr());
                (Some(s), url)
            }
        };
        // Warm-up: every record once.
        closed_loop(&url, Arc::clone(&bodies), 1, duration, true).await;
        for &c in &args.concurrency {
            let run = closed_loop(&url, Arc::clone(&bodies), c, duration, false).await;
            let mut row = run.json("closed", json!(c), &args.label);
            row["cache_mib"] = json!(cache);
            emit(row);
        }
        for rate in args.rates.iter().filter(|r| !r.is_empty()) {
            let rate: f64 = rate.parse().context("--rates")?;
            let run = open_loop(&url, Arc::clone(&bodies), rate, duration).await;
            let mut row = run.json("open", json!(rate), &args.label);
            row["cache_mib"] = json!(cache);
            emit(row);
        }
        if let Some(s) = server {
            s.shutdown().await?;
        }
    }

    if args.shared_requests > 0 && args.url.is_none() {
        let work = shared_workload(args.shared_requests, args.shared_states, args.shared_words);
        let bodies: Arc<Vec<(String, usize)>> =
            Arc::new(work.iter().map(|v| (v.to_string(), 1)).collect());
        for cache in [args.prefix_cache_mib, 0] {
            let mut s = Server::start(server_config(&args, cache)).await?;
            s.ready().await?;
            let url = format!("http://{}/v1/score", s.addr());
            let run = closed_loop(
                &url,
                Arc::clone(&bodies),
                args.shared_concurrency,
                duration,
                true,
            )
            .await;
            let m = reqwest::get(format!("http://{}/metrics", s.addr()))
                .await?
                .text()
                .await?;
            let (hits, misses) = (
                metric(&m, "kev_prefix_cache_hits_total"),
                metric(&m, "kev_prefix_cache_misses_total"),
            );
            let mut row = run.json(
                "shared",
                json!(format!(
                    "{} req / {} states, c={}, cache {}",
                    args.shared_requests,
                    args.shared_states,
                    args.shared_concurrency,
                    if cache > 0 { "on" } else { "off" }
                )),
                &args.label,
            );
            row["hit_rate"] = json!(if hits + misses > 0.0 {
                hits / (hits + misses)
            } else {
                0.0
            });
            emit(row);
            s.shutdown().await?;
        }
    }

    println!("\n| workload | records/s | p50 ms | p90 ms | p99 ms | notes |");
    println!("|---|---|---|---|---|---|");
    let f = |v: &Value| v.as_f64().map_or("–".to_string(), |x| format!("{x:.2}"));
    for r in &rows {
        let what = match r["kind"].as_str() {
            Some("closed") => format!(
                "server, closed loop, {} clients, cache {} MiB",
                r["param"], r["cache_mib"]
            ),
            Some("open") => format!(
                "server, open loop, {} req/s, cache {} MiB",
                r["param"], r["cache_mib"]
            ),
            Some("shared") => format!("server, {}", r["param"].as_str().unwrap_or("")),
            _ => format!("library, {}", r["param"].as_str().unwrap_or("")),
        };
        let mut notes = String::new();
        if let Some(e) = r["errors"].as_u64().filter(|&e| e > 0) {
            notes += &format!("{e} errors ");
        }
        if let Some(h) = r["hit_rate"].as_f64() {
            notes += &format!("hit rate {:.1} %", h * 100.0);
        }
        println!(
            "| {what} | {} | {} | {} | {} | {notes} |",
            f(&r["records_per_s"]),
            f(&r["p50_ms"]),
            f(&r["p90_ms"]),
            f(&r["p99_ms"])
        );
    }
    Ok(())
}
