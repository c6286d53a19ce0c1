//! Shared by the server tests: a server on a loopback port, fixture records, the library's
//! answers, raw HTTP.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use kev::{Backend, DecisionModel, LoadOptions, Record};
use kev_serve::{Config, Server};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub const TOL: f32 = 1e-5;

pub fn fixtures() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures"))
}

/// The server's defaults on a free loopback port, one CPU worker, modified by `f`.
pub fn config(f: impl FnOnce(&mut Config)) -> Config {
    let mut c = Config::new();
    c.addr = "127.0.0.1:0".parse().unwrap();
    c.devices = vec![Backend::Cpu];
    c.checkpoint = Some(fixtures().join("kev-small"));
    f(&mut c);
    c
}

pub async fn start(config: Config) -> Server {
    let mut server = Server::start(config).await.unwrap();
    server.ready().await.unwrap();
    server
}

pub fn model() -> DecisionModel {
    DecisionModel::load(
        fixtures().join("kev-small"),
        &LoadOptions::default().with_backend(Backend::Cpu),
    )
    .unwrap()
}

/// The fixture records as JSON values, in file order.
pub fn record_values() -> Vec<Value> {
    std::fs::read_to_string(fixtures().join("records.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

pub fn record(v: &Value) -> Record {
    Record::from_json_value(v, None).unwrap()
}

/// The probabilities of one answered record object (`{"id", "questions": [{"probs"..}]}`).
pub fn probs_of(answer: &Value) -> Vec<Vec<f32>> {
    answer["questions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| {
            q["probs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p.as_f64().unwrap() as f32)
                .collect()
        })
        .collect()
}

pub fn max_delta(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

pub fn url(addr: SocketAddr, path: &str) -> String {
    format!("http://{addr}{path}")
}

/// Sends `head` then `body` on a fresh connection and returns the status of the answer (0 when
/// the connection closed without one) within `wait`.
pub async fn raw(addr: SocketAddr, head: &str, body: &[u8], wait: Duration) -> u16 {
    let mut s = TcpStream::connect(addr).await.unwrap();
    // A server that answers early may close while the body is still being written: the answer
    // can still be read.
    if s.write_all(head.as_bytes()).await.is_ok() {
        let _ = s.write_all(body).await;
    }
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(wait, s.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf);
    text.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// A POST /v1/score head announcing `len` body bytes.
pub fn post_head(len: usize) -> String {
    format!(
        "POST /v1/score HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {len}\r\nconnection: close\r\n\r\n"
    )
}

/// Opens a connection, sends a head and part of the body, and drops the connection.
pub async fn cut_off(addr: SocketAddr, body: &[u8]) {
    if let Ok(mut s) = TcpStream::connect(addr).await {
        let _ = s.write_all(post_head(body.len()).as_bytes()).await;
        let _ = s.write_all(&body[..body.len() / 2]).await;
    }
}

/// The server's `/metrics` text.
pub async fn metrics_text(client: &reqwest::Client, addr: SocketAddr) -> String {
    client
        .get(url(addr, "/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// A metric's value from the `/metrics` text (summed over its label sets).
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
