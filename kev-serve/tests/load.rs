//! A bounded load-and-fault run on loopback: 64 clients for a fixed time mixing valid, invalid,
//! oversized and repeated-state requests and clients cut off mid-body. Every accepted request is
//! answered (correctly), bad input never gets a 5xx, the prefix cache and the RSS stay within
//! their budgets.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const CLIENTS: usize = 64;
const RUN: Duration = Duration::from_secs(4);
const CACHE_MIB: usize = 1;
/// Growth of the process's resident memory allowed over the run.
const RSS_GROWTH_MIB: f64 = 512.0;

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

#[derive(Default)]
struct Tally {
    ok: AtomicUsize,
    busy: AtomicUsize,
    rejected: AtomicUsize,
    cut: AtomicUsize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_and_faults() {
    let limit = 32 << 10;
    let server = start(config(|c| {
        c.devices = vec![kev::Backend::Cpu, kev::Backend::Cpu];
        c.max_body_bytes = limit;
        c.prefix_cache_mib = CACHE_MIB;
        c.max_wait_ms = 2;
        c.queue_capacity = 128;
    }))
    .await;
    let addr = server.addr();
    let model = model();

    // Repeated states: 40 states (more than the cache holds), three question sets each.
    let prompts = [
        ("Which move?", vec!["buy", "sell", "hold"]),
        ("Is it risky?", vec!["yes", "no"]),
        ("Pick one.", vec!["north", "south", "east", "west"]),
    ];
    let mut pool: Vec<(Value, Vec<Vec<f32>>)> = Vec::new();
    for s in 0..40 {
        for (p, opts) in &prompts {
            let v = json!({"id": format!("s{s}"), "state": format!("State number {s}: the price moved {} points.", s * 7),
                           "questions": [{"prompt": p, "options": opts}]});
            let want = model.probs(&record(&v)).unwrap();
            pool.push((v, want));
        }
    }
    for v in record_values() {
        let want = model.probs(&record(&v)).unwrap();
        pool.push((v, want));
    }
    let pool = Arc::new(pool);
    let invalid: Arc<Vec<Vec<u8>>> = Arc::new(vec![
        b"{".to_vec(),
        b"[]".to_vec(),
        json!({"state": "s", "questions": []}).to_string().into(),
        json!({"state": "s", "questions": [{"prompt": "p", "options": ["a"], "answer": 9}]})
            .to_string()
            .into(),
        json!({"records": [{"state": "s"}]}).to_string().into(),
    ]);

    let rss0 = rss_mib();
    let tally = Arc::new(Tally::default());
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(CLIENTS)
        .build()
        .unwrap();
    let end = Instant::now() + RUN;
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (client, pool, invalid, tally) =
                (client.clone(), Arc::clone(&pool), Arc::clone(&invalid), Arc::clone(&tally));
            tokio::spawn(async move {
                let mut n = c;
                while Instant::now() < end {
                    n = n.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let pick = n >> 33;
                    match pick % 10 {
                        // Invalid: 4xx, never 5xx.
                        0 => {
                            let body = invalid[pick % invalid.len()].clone();
                            let r = client.post(url(addr, "/v1/score")).body(body).send().await.unwrap();
                            let code = r.status().as_u16();
                            assert!(code == 400 || code == 422, "invalid body got {code}");
                            tally.rejected.fetch_add(1, Ordering::Relaxed);
                        }
                        // Oversized: 413, or a reset when the server closes before the
                        // client has written its whole body (it reads none of it).
                        1 => {
                            let body = vec![b' '; limit + 1 + pick % 100_000];
                            let code = raw(addr, &post_head(body.len()), &body, Duration::from_secs(10)).await;
                            assert!(code == 413 || code == 0, "oversized body got {code}");
                            tally.rejected.fetch_add(1, Ordering::Relaxed);
                        }
                        // Cut off mid-body.
                        2 => {
                            let body = pool[pick % pool.len()].0.to_string();
                            cut_off(addr, body.as_bytes()).await;
                            tally.cut.fetch_add(1, Ordering::Relaxed);
                        }
                        // Valid: one record or several, states repeating.
                        k => {
                            let n_rec = if k < 7 { 1 } else { 1 + pick % 4 };
                            let chosen: Vec<usize> =
                                (0..n_rec).map(|i| (pick / 7 + i * 13) % pool.len()).collect();
                            let body = if n_rec == 1 {
                                pool[chosen[0]].0.clone()
                            } else {
                                json!({"records": chosen.iter().map(|&i| pool[i].0.clone()).collect::<Vec<_>>()})
                            };
                            let r = client.post(url(addr, "/v1/score")).json(&body).send().await.unwrap();
                            let code = r.status().as_u16();
                            if code == 503 {
                                tally.busy.fetch_add(1, Ordering::Relaxed);
                                continue;
                            }
                            let a: Value = r.json().await.unwrap();
                            assert_eq!(code, 200, "valid request got {code}: {a}");
                            let answers: Vec<Value> = if n_rec == 1 {
                                vec![a]
                            } else {
                                a["records"].as_array().unwrap().clone()
                            };
                            assert_eq!(answers.len(), n_rec);
                            for (got, &i) in answers.iter().zip(&chosen) {
                                let d = max_delta(&probs_of(got), &pool[i].1);
                                assert!(d <= TOL, "record {i}: {d:e}");
                            }
                            tally.ok.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let rss1 = rss_mib();
    let m = metrics_text(&client, addr).await;
    let (ok, busy, rejected, cut) = (
        tally.ok.load(Ordering::Relaxed),
        tally.busy.load(Ordering::Relaxed),
        tally.rejected.load(Ordering::Relaxed),
        tally.cut.load(Ordering::Relaxed),
    );
    println!(
        "{CLIENTS} clients, {:?}: {ok} answered, {busy} 503, {rejected} rejected as bad input, {cut} cut off; \
         cache hits {} misses {} evictions {} bytes {} (budget {}); RSS {rss0:.0} -> {rss1:.0} MiB",
        RUN,
        metric(&m, "kev_prefix_cache_hits_total"),
        metric(&m, "kev_prefix_cache_misses_total"),
        metric(&m, "kev_prefix_cache_evictions_total"),
        metric(&m, "kev_prefix_cache_bytes"),
        metric(&m, "kev_prefix_cache_budget_bytes"),
    );
    assert!(ok > 100, "{ok}");
    assert!(metric(&m, "kev_prefix_cache_hits_total") > 0.0);
    assert!(metric(&m, "kev_prefix_cache_evictions_total") > 0.0);
    assert!(metric(&m, "kev_prefix_cache_bytes") <= (CACHE_MIB << 20) as f64 * 2.0);
    assert!(metric(&m, "kev_prefix_cache_bytes") <= metric(&m, "kev_prefix_cache_budget_bytes"));
    for code in [500, 502, 504] {
        assert_eq!(
            metric(&m, &format!("kev_requests_total{{code=\"{code}\"}}")),
            0.0,
            "{code}: {m}"
        );
    }
    assert!(rss1 - rss0 < RSS_GROWTH_MIB, "RSS {rss0} -> {rss1} MiB");
    // Still serving after the storm.
    let r = client
        .post(url(addr, "/v1/score"))
        .json(&pool[0].0)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    server.shutdown().await.unwrap();
}
