//! Two `kev-serve` replicas behind HAProxy with `deploy/haproxy-kev.cfg` (requests routed by
//! their state), on loopback: the shared-state workload keeps one server's hit rate, where the
//! same replicas taken in turn lose much of it; answers are the library's.
//!
//! Needs `haproxy` (>= 2.6) on PATH, so it is ignored by a plain `cargo test`; `scripts/test`
//! installs HAProxy and runs it: `cargo test --release -p kev-serve --test affinity -- --ignored`.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{config, metric, metrics_text, model, start};
use kev::Record;
use serde_json::{json, Value};

const CONFIG: &str = include_str!("../../deploy/haproxy-kev.cfg");

/// `requests` one-question records over `states` states of ~100 words, each state drawn at
/// random (seeded), as `examples/ray_serve.py`'s workload.
fn shared_workload(requests: usize, states: usize) -> Vec<Value> {
    let words = [
        "market", "price", "rain", "river", "north", "signal", "volume", "risk", "order", "city",
        "morning", "trade", "cloud", "bridge", "yield", "storm",
    ];
    let texts: Vec<String> = (0..states)
        .map(|s| {
            let body: Vec<&str> = (0..100)
                .map(|w| words[(s * 7 + w * 3 + w / 5) % words.len()])
                .collect();
            format!("{} (case {s})", body.join(" "))
        })
        .collect();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..requests)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            json!({
                "id": format!("req{i}"),
                "state": texts[(x % states as u64) as usize],
                "questions": [{"prompt": format!("Question {}: what next?", i % 7),
                               "options": ["buy", "sell", "hold", format!("wait {}", i % 5)]}]
            })
        })
        .collect()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The shipped config with this test's ports, and `balance roundrobin` when `in_turn`.
fn haproxy_config(front: u16, replicas: &[SocketAddr], in_turn: bool) -> String {
    let mut out = String::new();
    let mut servers = replicas.iter().enumerate();
    for line in CONFIG.lines() {
        let t = line.trim_start();
        if t.starts_with("bind ") {
            out += &format!("    bind 127.0.0.1:{front}\n");
        } else if t.starts_with("server ") {
            if let Some((i, addr)) = servers.next() {
                out += &format!("    server kev{} {addr}\n", i + 1);
            }
        } else if in_turn && t.starts_with("balance ") {
            out += "    balance roundrobin\n";
        } else {
            out += line;
            out += "\n";
        }
    }
    out
}

struct Proxy(Child);

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn haproxy(cfg: &str, front: u16) -> Proxy {
    let path = std::env::temp_dir().join(format!("kev-haproxy-{}-{front}.cfg", std::process::id()));
    std::fs::write(&path, cfg).unwrap();
    let child = Command::new("haproxy")
        .args(["-db", "-f"])
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("`haproxy` (>= 2.6) must be on PATH: scripts/test installs it");
    let proxy = Proxy(child);
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", front)).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "haproxy did not listen"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    proxy
}

/// Sends `records` through the proxy at `front`, 8 at a time; returns the answers in order.
async fn send(front: u16, records: &[Value]) -> Vec<Value> {
    let client = reqwest::Client::new();
    let target = format!("http://127.0.0.1:{front}/v1/score");
    let mut answers = vec![Value::Null; records.len()];
    for (c, chunk) in records.chunks(8).enumerate() {
        let calls = chunk.iter().map(|r| {
            let (client, target) = (client.clone(), target.clone());
            let r = r.clone();
            async move {
                let resp = client.post(target).json(&r).send().await.unwrap();
                assert_eq!(resp.status(), 200);
                resp.json::<Value>().await.unwrap()
            }
        });
        for (i, a) in futures_join(calls).await.into_iter().enumerate() {
            answers[c * 8 + i] = a;
        }
    }
    answers
}

async fn futures_join<F: std::future::Future<Output = Value> + Send + 'static>(
    calls: impl Iterator<Item = F>,
) -> Vec<Value> {
    let handles: Vec<_> = calls.map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

/// The hit rate over both replicas and the requests each took, after `records` through a proxy
/// with `in_turn` or state routing, on fresh replicas of 12 MiB of prefix cache each: room for 24 of the 40 states' prefixes
/// (~0.5 MiB each), half the workload's states with room to spare.
async fn run(records: &[Value], in_turn: bool) -> (f64, Vec<f64>, Vec<Value>) {
    let mut servers = Vec::new();
    for _ in 0..2 {
        servers.push(start(config(|c| c.prefix_cache_mib = 12)).await);
    }
    let addrs: Vec<SocketAddr> = servers.iter().map(|s| s.addr()).collect();
    let front = free_port();
    let proxy = haproxy(&haproxy_config(front, &addrs, in_turn), front);
    let answers = send(front, records).await;
    drop(proxy);
    let client = reqwest::Client::new();
    let (mut hits, mut misses, mut taken) = (0.0, 0.0, Vec::new());
    for a in &addrs {
        let m = metrics_text(&client, *a).await;
        hits += metric(&m, "kev_prefix_cache_hits_total");
        misses += metric(&m, "kev_prefix_cache_misses_total");
        taken.push(hits + misses - taken.iter().sum::<f64>());
    }
    for s in servers {
        s.shutdown().await.unwrap();
    }
    (hits / (hits + misses), taken, answers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs haproxy on PATH; scripts/test runs it"]
async fn routing_by_state_keeps_one_servers_hit_rate() {
    let (requests, states) = (600, 40);
    let records = shared_workload(requests, states);
    let (by_state, taken, answers) = run(&records, false).await;
    let (in_turn, taken_in_turn, _) = run(&records, true).await;
    // One server with room for every state misses each state once.
    let one_server = 1.0 - states as f64 / requests as f64;
    println!(
        "hit rate: by state {by_state:.4} (requests {taken:?}), in turn {in_turn:.4} ({taken_in_turn:?}), one server {one_server:.4}"
    );
    assert!(taken.iter().all(|&t| t > 0.0), "{taken:?}");
    assert!(
        by_state >= one_server - 0.03,
        "{by_state} against {one_server}"
    );
    assert!(by_state >= in_turn + 0.1, "{by_state} against {in_turn}");

    let model = model();
    for (r, a) in records.iter().zip(&answers).take(50) {
        let record = Record::from_json_str(&r.to_string(), None).unwrap();
        let want = model.probs(&record).unwrap();
        let got: Vec<f32> = serde_json::from_value(a["questions"][0]["probs"].clone()).unwrap();
        let diff = got
            .iter()
            .zip(&want[0])
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        assert!(diff <= common::TOL, "{}: {diff}", r["id"]);
    }
}

#[test]
fn the_shipped_config_parses_to_this_tests_ports() {
    let addrs: Vec<SocketAddr> = vec![
        "127.0.0.1:9001".parse().unwrap(),
        "127.0.0.1:9002".parse().unwrap(),
    ];
    let cfg = haproxy_config(9000, &addrs, false);
    assert!(cfg.contains("bind 127.0.0.1:9000"));
    assert!(cfg.contains("server kev2 127.0.0.1:9002"));
    assert!(cfg.contains("balance hash req.body,json_query('$.state')"));
    assert!(haproxy_config(9000, &addrs, true).contains("balance roundrobin"));
}
