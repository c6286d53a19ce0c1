//! The real server on a loopback port, spoken to over HTTP: answers against the library, error
//! codes, disconnects, shutdown, two workers.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_equal_the_library_in_order() {
    let server = start(config(|_| {})).await;
    let addr = server.addr();
    let model = model();
    let values = record_values();
    let client = reqwest::Client::new();

    // All records in one request, and each alone.
    let answers = batch_answers(&client, addr, &values).await;
    let mut worst = 0f32;
    for (v, a) in values.iter().zip(&answers) {
        let rec = record(v);
        let want = model.probs(&rec).unwrap();
        assert_eq!(a["id"], v.get("id").cloned().unwrap_or(Value::Null));
        worst = worst.max(max_delta(&probs_of(a), &want));
        for (q, (qa, p)) in rec
            .questions
            .iter()
            .zip(a["questions"].as_array().unwrap().iter().zip(&want))
        {
            assert_eq!(qa["id"], q.id.clone().map_or(Value::Null, Value::String));
            let argmax = qa["argmax"].as_u64().unwrap() as usize;
            assert!(p.iter().all(|x| *x <= p[argmax]));
            assert_eq!(qa["option"], q.options[argmax].as_str());
        }
        let one: Value = client
            .post(url(addr, "/v1/score"))
            .json(v)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(one["id"], a["id"], "{one}");
        worst = worst.max(max_delta(&probs_of(&one), &want));
    }
    println!("server vs library: max|Δp| {worst:.2e}");
    assert!(worst <= TOL, "{worst:e}");

    // The other endpoints.
    let info: Value = client
        .get(url(addr, "/v1/model"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["max_tokens"], 1024);
    assert_eq!(info["head"]["dim"], 16);
    assert_eq!(info["dtype"], "f32");
    assert!(
        info["base"].is_string() && info["checkpoint"].is_string() && info["backend"].is_array()
    );
    for path in ["/health", "/ready"] {
        assert_eq!(
            client.get(url(addr, path)).send().await.unwrap().status(),
            200
        );
    }
    let m = metrics_text(&client, addr).await;
    assert!(
        metric(&m, "kev_requests_total") >= 1.0 + values.len() as f64,
        "{m}"
    );
    assert!(metric(&m, "kev_prefix_cache_hits_total") > 0.0, "{m}");
    assert!(m.contains("kev_prefix_cache_bytes"), "{m}");
    server.shutdown().await.unwrap();
}

/// Records whose states the server has cached and records it has not seen, in one request (so in
/// one batch), against one by one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_mixing_cold_and_cached_states_equals_one_by_one() {
    let server = start(config(|_| {})).await;
    let addr = server.addr();
    let model = model();
    let values = record_values();
    let client = reqwest::Client::new();
    let (warm, cold) = values.split_at(values.len() / 2);
    let r = client
        .post(url(addr, "/v1/score"))
        .json(&json!({ "records": warm }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let m0 = metrics_text(&client, addr).await;
    let hits0 = metric(&m0, "kev_prefix_cache_hits_total");

    // Interleaved: cached, new, cached, new ...; new records repeat states among themselves.
    let mut mixed = Vec::new();
    for i in 0..warm.len().max(cold.len()) {
        mixed.extend(warm.get(i).cloned());
        mixed.extend(cold.get(i).cloned());
    }
    mixed.extend(cold.iter().rev().cloned());
    let answer: Value = client
        .post(url(addr, "/v1/score"))
        .json(&json!({ "records": mixed }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let answers = answer["records"].as_array().unwrap();
    assert_eq!(answers.len(), mixed.len());
    let mut worst = 0f32;
    for (v, a) in mixed.iter().zip(answers) {
        assert_eq!(a["id"], v.get("id").cloned().unwrap_or(Value::Null));
        worst = worst.max(max_delta(&probs_of(a), &model.probs(&record(v)).unwrap()));
    }
    let m1 = metrics_text(&client, addr).await;
    assert!(
        metric(&m1, "kev_prefix_cache_hits_total") >= hits0 + warm.len() as f64,
        "{m1}"
    );
    println!("mixed cold/cached batch vs one by one: max|Δp| {worst:.2e}");
    assert!(worst <= TOL, "{worst:e}");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bodies_get_their_codes_and_the_server_keeps_serving() {
    let limit = 64 << 10;
    let server = start(config(|c| {
        c.max_body_bytes = limit;
        c.request_timeout_ms = 500;
        c.max_request_records = 4;
    }))
    .await;
    let addr = server.addr();
    let client = reqwest::Client::new();
    let good = record_values()[0].clone();
    let q =
        |options: Value| json!({"state": "s", "questions": [{"prompt": "p", "options": options}]});
    let long_state = "word ".repeat(3000);
    let corpus: Vec<(Vec<u8>, u16, &str)> = vec![
        (b"".to_vec(), 400, "empty body"),
        (b"{".to_vec(), 400, "truncated JSON"),
        (b"{\"state\": \"a\",}".to_vec(), 400, "trailing comma"),
        (vec![0xff, 0xfe, 0x00], 400, "not UTF-8"),
        (b"null".to_vec(), 422, "null"),
        (b"[1, 2]".to_vec(), 422, "a list"),
        (b"\"text\"".to_vec(), 422, "a string"),
        (
            json!({"state": 1, "questions": []}).to_string().into(),
            422,
            "state a number",
        ),
        (
            json!({"state": "s"}).to_string().into(),
            422,
            "no questions",
        ),
        (
            json!({"state": "s", "questions": []}).to_string().into(),
            422,
            "empty questions",
        ),
        (q(json!([])).to_string().into(), 422, "empty options"),
        (
            q(json!(["a", 2])).to_string().into(),
            422,
            "option a number",
        ),
        (
            json!({"state": "s", "questions": [{"prompt": "p", "options": ["a"], "answer": 3}]})
                .to_string()
                .into(),
            422,
            "answer out of range",
        ),
        (
            json!({"state": "s", "questions": [{"prompt": "p", "options": ["a"]}], "extra": 1})
                .to_string()
                .into(),
            422,
            "unknown field",
        ),
        (
            q(json!(["a <|kev_option|> b"])).to_string().into(),
            422,
            "marker in an option",
        ),
        (
            json!({"state": long_state, "questions": [{"prompt": "p", "options": ["a"]}]})
                .to_string()
                .into(),
            422,
            "over max_tokens",
        ),
        (
            json!({"records": 3}).to_string().into(),
            422,
            "records a number",
        ),
        (
            json!({"records": [good, {"state": "x"}]})
                .to_string()
                .into(),
            422,
            "second record invalid",
        ),
        (vec![b' '; limit + 1], 413, "over the body limit"),
        (
            json!({"records": vec![good.clone(); 5]}).to_string().into(),
            413,
            "more records than --max-request-records",
        ),
        (
            br#"{"state": "a", "state": "b", "questions": [{"prompt": "p", "options": ["x"]}]}"#
                .to_vec(),
            400,
            "duplicate key",
        ),
        (
            br#"{"records": [], "records": []}"#.to_vec(),
            400,
            "duplicate records key",
        ),
        (
            json!({"state": "s", "questions": [{"prompt": "p", "options": ["a"]}], "records": [good]})
                .to_string()
                .into(),
            422,
            "a record with a records field",
        ),
    ];
    for (body, code, what) in &corpus {
        let r = client
            .post(url(addr, "/v1/score"))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), *code, "{what}");
        let e: Value = r.json().await.unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(e["error"]["code"], *code, "{what}");
        assert!(
            e["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{what}"
        );
        if *what == "duplicate key" {
            let m = e["error"]["message"].as_str().unwrap();
            assert!(m.contains("duplicate key `state`"), "{m}");
        }
        if *what == "a record with a records field" {
            assert_eq!(e["error"]["field"], "records", "{e}");
        }
        if *what == "second record invalid" {
            assert_eq!(e["error"]["record"], 1);
            assert_eq!(e["error"]["field"], "questions");
            assert!(e["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with("records[1]"));
        }
    }
    // A body announced over the limit is refused before it is sent.
    assert_eq!(
        raw(addr, &post_head(limit * 4), b"", Duration::from_secs(5)).await,
        413
    );
    // A body that never arrives in full, by its length or unterminated chunks: the client's
    // fault, 408 at the request timeout.
    assert_eq!(
        raw(addr, &post_head(100), b"{\"state\"", Duration::from_secs(5)).await,
        408
    );
    let chunked = "POST /v1/score HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n";
    assert_eq!(
        raw(addr, chunked, b"5\r\n{\"sta\r\n", Duration::from_secs(5)).await,
        408
    );
    // A compressed body: 415, not "not valid JSON".
    let r = client
        .post(url(addr, "/v1/score"))
        .header("content-encoding", "gzip")
        .body(vec![0x1f, 0x8b, 8, 0])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 415);
    let e: Value = r.json().await.unwrap();
    assert!(
        e["error"]["message"].as_str().unwrap().contains("gzip"),
        "{e}"
    );
    // Wrong method: 405 with the documented error body.
    let r = client.get(url(addr, "/v1/score")).send().await.unwrap();
    assert_eq!(r.status(), 405);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], 405, "{e}");
    // A head too large: 414 and 431 with the same error body.
    let long_target = format!("/v1/score?{}", "a".repeat(9 << 10));
    let r = client.get(url(addr, &long_target)).send().await.unwrap();
    assert_eq!(r.status(), 414);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], 414, "{e}");
    let mut many = client.post(url(addr, "/v1/score"));
    for i in 0..150 {
        many = many.header(format!("x-h{i}"), "1");
    }
    let r = many.json(&record_values()[1]).send().await.unwrap();
    assert_eq!(r.status(), 431);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], 431, "{e}");
    // Unknown path.
    assert_eq!(
        client
            .get(url(addr, "/nope"))
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    // Still serving.
    let r = client
        .post(url(addr, "/v1/score"))
        .json(&record_values()[1])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let m = metrics_text(&client, addr).await;
    assert_eq!(metric(&m, "kev_requests_total{code=\"500\"}"), 0.0, "{m}");
    assert_eq!(metric(&m, "kev_requests_total{code=\"504\"}"), 0.0, "{m}");
    server.shutdown().await.unwrap();
}

/// 300 records in one request under a 256-token budget: they run in many batches, each within
/// the budget, so a request's working memory does not grow with its size; the answers are the
/// library's, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_request_runs_in_batches_within_the_token_budget() {
    let budget = 256;
    let server = start(config(|c| {
        c.max_batch_tokens = budget;
        c.prefix_cache_mib = 0;
    }))
    .await;
    let addr = server.addr();
    let model = model();
    let values: Vec<Value> = (0..300)
        .map(|i| {
            json!({"id": format!("r{i}"), "state": format!("Day {i}: it rains."),
                        "questions": [{"prompt": "Umbrella?", "options": ["yes", "no"]}]})
        })
        .collect();
    let client = reqwest::Client::new();
    let answers = batch_answers(&client, addr, &values).await;
    for (i, (got, v)) in answers.iter().zip(&values).enumerate() {
        assert_eq!(got["id"], v["id"]);
        let d = max_delta(&probs_of(got), &model.probs(&record(v)).unwrap());
        assert!(d <= TOL, "record {i}: {d:e}");
    }
    let m = metrics_text(&client, addr).await;
    let batches = metric(&m, "kev_batches_total");
    let tokens = metric(&m, "kev_batch_tokens_sum");
    // Every batch runs at most `budget` tokens (padding included), so at least this many.
    assert!(
        batches * budget as f64 >= tokens && batches > 1.0,
        "{batches} batches for {tokens} tokens"
    );
    server.shutdown().await.unwrap();
}

/// A batch's answer is the single answers joined: one formatter (fields in order,
/// probabilities as f32, as `score` prints them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_answer_reads_as_the_single_answers() {
    let server = start(config(|_| {})).await;
    let addr = server.addr();
    let values = record_values();
    let client = reqwest::Client::new();
    let post = |body: Value| {
        let client = client.clone();
        async move {
            let r = client
                .post(url(addr, "/v1/score"))
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            r.text().await.unwrap()
        }
    };
    let batch = post(json!({ "records": values[..3] })).await;
    let mut singles = Vec::new();
    for v in &values[..3] {
        singles.push(post(v.clone()).await);
    }
    assert_eq!(batch, format!("{{\"records\":[{}]}}", singles.join(",")));
    assert!(singles[0].starts_with("{\"id\":"), "{}", singles[0]);
    server.shutdown().await.unwrap();
}

/// Flags out of range are refused at start with their name, never wrapped, panicking or
/// aborting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flags_out_of_range_are_refused_by_name() {
    type Set = fn(&mut kev_serve::Config);
    let cases: Vec<(&str, Set)> = vec![
        ("prefix-cache-mib", |c| {
            c.prefix_cache_mib = 17_592_186_044_416
        }),
        ("max-connections", |c| c.max_connections = 1 << 61),
        ("queue-capacity", |c| c.queue_capacity = 10_000_000_000),
        ("max-wait-ms", |c| c.max_wait_ms = c.request_timeout_ms),
        ("header-timeout-ms", |c| c.header_timeout_ms = 0),
        ("header-timeout-ms", |c| c.header_timeout_ms = u64::MAX),
        ("request-timeout-ms", |c| c.request_timeout_ms = u64::MAX),
        ("max-request-records", |c| c.max_request_records = 0),
    ];
    for (name, set) in cases {
        let mut c = config(|_| {});
        set(&mut c);
        match kev_serve::Server::start(c).await {
            Err(kev_serve::StartError::Setting { name: n, message }) => {
                assert_eq!(n, name, "{message}")
            }
            Err(e) => panic!("{name}: {e}"),
            Ok(_) => panic!("{name}: accepted"),
        }
    }
}

/// A client that sends its whole request and then closes its sending side gets its answer; one
/// that closes the connection outright is still counted in the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_close_after_sending_are_answered_and_counted() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let server = start(config(|_| {})).await;
    let addr = server.addr();
    let body = record_values()[0].to_string();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(post_head(body.len()).as_bytes()).await.unwrap();
    s.write_all(body.as_bytes()).await.unwrap();
    s.shutdown().await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut answer))
        .await
        .expect("no answer after a half-close")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    let n = 20;
    for _ in 0..n {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(post_head(body.len()).as_bytes()).await.unwrap();
        s.write_all(body.as_bytes()).await.unwrap();
    }
    let client = reqwest::Client::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let m = metrics_text(&client, addr).await;
        let counted = metric(&m, "kev_requests_total");
        if counted >= (n + 1) as f64 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{counted} of {} requests counted: {m}",
            n + 1
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_does_not_disturb_others() {
    let server = start(config(|c| c.max_wait_ms = 20)).await;
    let addr = server.addr();
    let model = model();
    let values = record_values();
    let want: Vec<_> = values
        .iter()
        .map(|v| model.probs(&record(v)).unwrap())
        .collect();
    let body = json!({ "records": values }).to_string().into_bytes();
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for i in 0..24 {
        let body = body.clone();
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            match i % 3 {
                // Cut off mid-body.
                0 => {
                    cut_off(addr, &body).await;
                    None
                }
                // Sent whole, then gone before the answer.
                1 => {
                    let _ = raw(
                        addr,
                        &post_head(body.len()),
                        &body,
                        Duration::from_millis(1),
                    )
                    .await;
                    None
                }
                _ => {
                    let r = client
                        .post(url(addr, "/v1/score"))
                        .body(body)
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status(), 200);
                    Some(r.json::<Value>().await.unwrap())
                }
            }
        }));
    }
    let mut answered = 0;
    for t in tasks {
        if let Some(a) = t.await.unwrap() {
            answered += 1;
            for (got, w) in a["records"].as_array().unwrap().iter().zip(&want) {
                assert!(max_delta(&probs_of(got), w) <= TOL);
            }
        }
    }
    assert_eq!(answered, 8);
    let r = client.get(url(addr, "/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_answers_what_was_accepted() {
    // A long batching wait keeps the requests queued or waiting when shutdown begins.
    let server = start(config(|c| c.max_wait_ms = 300)).await;
    let addr = server.addr();
    let values = record_values();
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for v in values.iter().cycle().take(16) {
        let (client, v) = (client.clone(), v.clone());
        tasks.push(tokio::spawn(async move {
            client
                .post(url(addr, "/v1/score"))
                .json(&v)
                .send()
                .await
                .map(|r| r.status().as_u16())
        }));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let began = std::time::Instant::now();
    server.shutdown().await.unwrap();
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap(), 200);
    }
    assert!(began.elapsed() < Duration::from_secs(10));
    // Nothing listens any more.
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_answer_as_one() {
    let one = start(config(|_| {})).await;
    let two = start(config(|c| {
        c.devices = vec![kev::Backend::Cpu, kev::Backend::Cpu]
    }))
    .await;
    let info: Value = reqwest::get(url(two.addr(), "/v1/model"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["devices"].as_array().unwrap().len(), 2);
    let values = record_values();
    let client = reqwest::Client::new();
    let ask = |addr, v: Value| {
        let client = client.clone();
        tokio::spawn(async move {
            let r = client
                .post(url(addr, "/v1/score"))
                .json(&v)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            probs_of(&r.json::<Value>().await.unwrap())
        })
    };
    // Concurrent requests, each record three times, so both workers take some.
    let jobs: Vec<_> = values
        .iter()
        .cycle()
        .take(values.len() * 3)
        .cloned()
        .collect();
    let a: Vec<_> = jobs.iter().map(|v| ask(one.addr(), v.clone())).collect();
    let b: Vec<_> = jobs.iter().map(|v| ask(two.addr(), v.clone())).collect();
    let mut worst = 0f32;
    for (a, b) in a.into_iter().zip(b) {
        worst = worst.max(max_delta(&a.await.unwrap(), &b.await.unwrap()));
    }
    println!("two workers vs one: max|Δp| {worst:.2e}");
    assert!(worst <= TOL, "{worst:e}");
    one.shutdown().await.unwrap();
    two.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_503_with_retry_after() {
    let server = start(config(|c| {
        c.queue_capacity = 1;
        c.max_batch_tokens = 64;
    }))
    .await;
    let addr = server.addr();
    let values = record_values();
    let body = json!({ "records": values.iter().cycle().take(60).collect::<Vec<_>>() });
    let client = reqwest::Client::new();
    let tasks: Vec<_> = (0..48)
        .map(|_| {
            let (client, body) = (client.clone(), body.clone());
            tokio::spawn(async move {
                let r = client
                    .post(url(addr, "/v1/score"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                (r.status().as_u16(), r.headers().get("retry-after").cloned())
            })
        })
        .collect();
    let mut busy = 0;
    for t in tasks {
        let (code, retry) = t.await.unwrap();
        assert!(code == 200 || code == 503, "{code}");
        if code == 503 {
            busy += 1;
            assert_eq!(retry.unwrap(), "1");
        }
    }
    assert!(busy > 0);
    server.shutdown().await.unwrap();
}

/// The answers to `values` sent as one batch request (200 expected), one per record.
async fn batch_answers(client: &reqwest::Client, addr: SocketAddr, values: &[Value]) -> Vec<Value> {
    let r = client
        .post(url(addr, "/v1/score"))
        .json(&json!({ "records": values }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let answer: Value = r.json().await.unwrap();
    let answers = answer["records"].as_array().unwrap().clone();
    assert_eq!(answers.len(), values.len());
    answers
}
