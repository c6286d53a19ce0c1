//! A bounded load-and-fault run on loopback: 64 clients for a fixed time mixing valid, invalid,
//! oversized, huge (many records) and repeated-state requests, clients cut off mid-body and
//! clients that half-close after sending. Every accepted request is answered (correctly), bad
//! input never gets a 5xx, the prefix cache and the RSS stay within their budgets. Then slow
//! clients: connections dribbling their headers are closed at the header timeout and lock no one
//! out, and SIGTERM stops the binary with such a connection open.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CLIENTS: usize = 64;
const RUN: Duration = Duration::from_secs(4);
const CACHE_MIB: usize = 1;
/// Records in a huge request (the per-request cap): far more tokens than one batch takes.
const HUGE: usize = 120;
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
    huge: AtomicUsize,
    half_closed: AtomicUsize,
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
        c.max_request_records = HUGE;
        c.max_batch_tokens = 1024;
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
                        // Huge: the record cap, answered in full; one more, 413.
                        3 if pick % 7 == 0 => {
                            let n_rec = HUGE + usize::from(pick % 2 == 0);
                            let chosen: Vec<usize> = (0..n_rec).map(|i| (pick + i) % pool.len()).collect();
                            let body = json!({"records": chosen.iter().map(|&i| pool[i].0.clone()).collect::<Vec<_>>()});
                            let r = client.post(url(addr, "/v1/score")).json(&body).send().await.unwrap();
                            let code = r.status().as_u16();
                            if n_rec > HUGE {
                                assert_eq!(code, 413, "{n_rec} records");
                                tally.rejected.fetch_add(1, Ordering::Relaxed);
                                continue;
                            }
                            if code == 503 {
                                tally.busy.fetch_add(1, Ordering::Relaxed);
                                continue;
                            }
                            let a: Value = r.json().await.unwrap();
                            assert_eq!(code, 200, "huge request got {code}");
                            let answers = a["records"].as_array().unwrap();
                            assert_eq!(answers.len(), n_rec);
                            for (got, &i) in answers.iter().zip(&chosen) {
                                let d = max_delta(&probs_of(got), &pool[i].1);
                                assert!(d <= TOL, "record {i}: {d:e}");
                            }
                            tally.huge.fetch_add(1, Ordering::Relaxed);
                        }
                        // Sent whole, then the sending side closed: still answered.
                        3 if pick % 7 == 1 => {
                            let (v, want) = &pool[pick % pool.len()];
                            let body = v.to_string();
                            let mut s = TcpStream::connect(addr).await.unwrap();
                            s.write_all(post_head(body.len()).as_bytes()).await.unwrap();
                            s.write_all(body.as_bytes()).await.unwrap();
                            s.shutdown().await.unwrap();
                            let mut answer = Vec::new();
                            s.read_to_end(&mut answer).await.unwrap();
                            let answer = String::from_utf8_lossy(&answer);
                            if answer.starts_with("HTTP/1.1 503") {
                                tally.busy.fetch_add(1, Ordering::Relaxed);
                                continue;
                            }
                            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
                            let json = answer.split("\r\n\r\n").nth(1).unwrap();
                            let d = max_delta(&probs_of(&serde_json::from_str(json).unwrap()), want);
                            assert!(d <= TOL, "{d:e}");
                            tally.half_closed.fetch_add(1, Ordering::Relaxed);
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
    let (ok, busy, rejected, cut, huge, half_closed) = (
        tally.ok.load(Ordering::Relaxed),
        tally.busy.load(Ordering::Relaxed),
        tally.rejected.load(Ordering::Relaxed),
        tally.cut.load(Ordering::Relaxed),
        tally.huge.load(Ordering::Relaxed),
        tally.half_closed.load(Ordering::Relaxed),
    );
    println!(
        "{CLIENTS} clients, {:?}: {ok} answered ({huge} huge, {half_closed} half-closed), {busy} 503, {rejected} rejected as bad input, {cut} cut off; \
         cache hits {} misses {} evictions {} bytes {} (budget {}); RSS {rss0:.0} -> {rss1:.0} MiB",
        RUN,
        metric(&m, "kev_prefix_cache_hits_total"),
        metric(&m, "kev_prefix_cache_misses_total"),
        metric(&m, "kev_prefix_cache_evictions_total"),
        metric(&m, "kev_prefix_cache_bytes"),
        metric(&m, "kev_prefix_cache_budget_bytes"),
    );
    assert!(ok > 100, "{ok}");
    assert!(
        huge > 0 && half_closed > 0,
        "{huge} huge, {half_closed} half-closed"
    );
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

/// A connection that sends a request head one byte every 100 ms and never finishes; returns how
/// long the server kept it open (none: still open after `give_up`).
async fn slowloris(addr: SocketAddr, give_up: Duration) -> Option<Duration> {
    let head = b"POST /v1/score HTTP/1.1\r\nHost: x\r\nX-a: ";
    let started = Instant::now();
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut sent = 0;
    while started.elapsed() < give_up {
        let byte = head.get(sent).copied().unwrap_or(b'a');
        if s.write_all(&[byte]).await.is_err() {
            return Some(started.elapsed());
        }
        sent += 1;
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_millis(100), s.read(&mut buf)).await;
        if let Ok(Ok(0) | Err(_)) = read {
            return Some(started.elapsed());
        }
    }
    None
}

/// Twice as many slow connections as connection slots: each is closed at the header timeout, and
/// a normal client still gets its answer; shutdown does not wait for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_closed_and_lock_no_one_out() {
    let server = start(config(|c| {
        c.max_connections = 4;
        c.header_timeout_ms = 300;
    }))
    .await;
    let addr = server.addr();
    let slow: Vec<_> = (0..8)
        .map(|_| tokio::spawn(slowloris(addr, Duration::from_secs(20))))
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let client = reqwest::Client::new();
    let r = tokio::time::timeout(
        Duration::from_secs(15),
        client
            .post(url(addr, "/v1/score"))
            .json(&record_values()[0])
            .send(),
    )
    .await
    .expect("a normal client was locked out by slow ones")
    .unwrap();
    assert_eq!(r.status(), 200);
    for s in slow {
        let open = s.await.unwrap();
        assert!(open.is_some(), "a slow connection was never closed");
    }
    // An idle keep-alive connection is closed at the same timeout.
    let mut idle = TcpStream::connect(addr).await.unwrap();
    let mut buf = [0u8; 16];
    let closed = tokio::time::timeout(Duration::from_secs(10), idle.read(&mut buf)).await;
    assert!(matches!(closed, Ok(Ok(0) | Err(_))), "{closed:?}");
    // Shutdown with a slow connection open returns at once.
    let one_more = tokio::spawn(slowloris(addr, Duration::from_secs(20)));
    tokio::time::sleep(Duration::from_millis(150)).await;
    tokio::time::timeout(Duration::from_secs(5), server.shutdown())
        .await
        .expect("shutdown waited for a slow connection")
        .unwrap();
    assert!(one_more.await.unwrap().is_some());
}

/// The binary under SIGTERM with a connection still sending its headers (default timeouts):
/// it stops promptly with exit status 0.
#[cfg(unix)]
#[test]
fn sigterm_with_a_slow_connection_open_exits_0() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_kev-serve"))
        .args(["--addr", "127.0.0.1:0", "--devices", "cpu", "--checkpoint"])
        .arg(fixtures().join("kev-small"))
        .env("KEV_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr: SocketAddr = loop {
        let line = lines
            .next()
            .expect("the server exited before it was ready")
            .unwrap();
        if let Some(at) = line.split("ready on http://").nth(1) {
            break at.split_whitespace().next().unwrap().parse().unwrap();
        }
    };
    let mut slow = std::net::TcpStream::connect(addr).unwrap();
    slow.write_all(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nX-a: ")
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("still running 10 s after SIGTERM with a slow connection open");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    drop(slow);
}
