//! The HTTP side: routes, request parsing and error codes, the connection limit, start-up and
//! graceful shutdown.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kev::score::RecordOut;
use kev::{Backend, DecisionModel, EncodedRecord, LoadOptions, PrefixCache, Record};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tower::ServiceBuilder;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::trace::TraceLayer;

use crate::config::Config;
use crate::connections::{self, Limits};
use crate::metrics::Metrics;
use crate::scheduler::{BatchPolicy, DeviceModel, Job, Scheduler, SubmitError};
use crate::throttle::log_failure;

/// What can stop the server from starting.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The address could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// A flag is out of range.
    #[error("invalid setting `{name}`: {message}")]
    Setting {
        /// The flag.
        name: &'static str,
        /// Why.
        message: String,
    },
    /// The model did not load.
    #[error("loading the checkpoint")]
    Load(#[from] kev::Error),
    /// A worker thread could not start.
    #[error("starting a worker")]
    Worker(#[source] std::io::Error),
    /// Loading stopped without an answer (it panicked).
    #[error("loading stopped: {0}")]
    Aborted(String),
}

/// The loaded side: models, workers, what `/v1/model` says.
struct Engine {
    scheduler: Mutex<Scheduler>,
    /// A model to encode with (all models share the checkpoint and so the encoder).
    encoder: Arc<DecisionModel>,
    info: Value,
}

struct App {
    config: Config,
    metrics: Arc<Metrics>,
    engine: OnceLock<Engine>,
    /// Set on shutdown: new requests get 503.
    draining: AtomicBool,
}

/// A running server: its address, readiness and shutdown.
pub struct Server {
    addr: SocketAddr,
    app: Arc<App>,
    stop: watch::Sender<bool>,
    serving: Option<JoinHandle<()>>,
    loading: Option<JoinHandle<Result<Duration, StartError>>>,
}

impl Server {
    /// Binds `config.addr` and serves `/health` at once; loads the model(s) in the background
    /// (`/ready` and `/v1/score` answer 503 until then; [`Server::ready`] waits for it).
    pub async fn start(config: Config) -> Result<Self, StartError> {
        check(&config)?;
        let listener = TcpListener::bind(config.addr)
            .await
            .map_err(|source| StartError::Bind {
                addr: config.addr,
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| StartError::Bind {
            addr: config.addr,
            source,
        })?;
        let app = Arc::new(App {
            metrics: Arc::new(Metrics::new()),
            engine: OnceLock::new(),
            draining: AtomicBool::new(false),
            config,
        });
        let (stop, stopped) = watch::channel(false);
        let router = router(Arc::clone(&app));
        let limits = Limits {
            max_connections: app.config.max_connections,
            header_timeout: Duration::from_millis(app.config.header_timeout_ms),
            drain_timeout: app.config.request_timeout(),
            max_headers: 2 * MAX_HEADERS,
        };
        let serving = tokio::spawn(connections::serve(listener, router, limits, stopped));
        let loader = Arc::clone(&app);
        let loading = tokio::task::spawn_blocking(move || load(&loader));
        Ok(Self {
            addr,
            app,
            stop,
            serving: Some(serving),
            loading: Some(loading),
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits until the model(s) are loaded; returns the load time (the first call only; later
    /// calls return zero).
    pub async fn ready(&mut self) -> Result<Duration, StartError> {
        match self.loading.take() {
            None => Ok(Duration::ZERO),
            Some(h) => h.await.map_err(|e| StartError::Aborted(e.to_string()))?,
        }
    }

    /// What `/v1/model` answers (null before loading).
    pub fn model_info(&self) -> Value {
        self.app
            .engine
            .get()
            .map_or(Value::Null, |e| e.info.clone())
    }

    /// Graceful shutdown: stops accepting connections, answers every request already accepted
    /// (queued ones run), closes idle connections and, a request timeout later, any still open
    /// (a client still sending its headers or body), then stops the workers.
    pub async fn shutdown(mut self) -> std::io::Result<()> {
        self.app.draining.store(true, Ordering::SeqCst);
        let _ = self.stop.send(true);
        let served = match self.serving.take() {
            Some(h) => h.await.map_err(std::io::Error::other),
            None => Ok(()),
        };
        if let Some(h) = self.loading.take() {
            let _ = h.await;
        }
        let app = Arc::clone(&self.app);
        tokio::task::spawn_blocking(move || {
            if let Some(engine) = app.engine.get() {
                engine
                    .scheduler
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .shutdown();
            }
        })
        .await
        .map_err(std::io::Error::other)?;
        served
    }
}

/// Flags out of range, each refused with its name and its limit.
fn check(config: &Config) -> Result<(), StartError> {
    let refuse = |name, message: String| Err(StartError::Setting { name, message });
    let at_least_one = [
        ("max-batch-tokens", config.max_batch_tokens as u64),
        ("queue-capacity", config.queue_capacity as u64),
        ("max-connections", config.max_connections as u64),
        ("max-body-bytes", config.max_body_bytes as u64),
        ("max-request-records", config.max_request_records as u64),
        ("devices", config.devices.len() as u64),
        ("request-timeout-ms", config.request_timeout_ms),
        ("header-timeout-ms", config.header_timeout_ms),
    ];
    for (name, v) in at_least_one {
        if v == 0 {
            return refuse(name, "must be at least 1".into());
        }
    }
    let at_most = [
        ("queue-capacity", config.queue_capacity as u64, MAX_SLOTS),
        ("max-connections", config.max_connections as u64, MAX_SLOTS),
        (
            "request-timeout-ms",
            config.request_timeout_ms,
            MAX_TIMEOUT_MS,
        ),
        (
            "header-timeout-ms",
            config.header_timeout_ms,
            MAX_TIMEOUT_MS,
        ),
    ];
    for (name, v, max) in at_most {
        if v > max {
            return refuse(name, format!("{v} is more than the most allowed, {max}"));
        }
    }
    if config.prefix_cache_bytes().is_none() {
        return refuse(
            "prefix-cache-mib",
            format!(
                "{} MiB is more bytes than this machine can address",
                config.prefix_cache_mib
            ),
        );
    }
    if config.max_wait_ms >= config.request_timeout_ms {
        return refuse(
            "max-wait-ms",
            format!(
                "{} must be less than --request-timeout-ms ({}): a lone request would wait past its timeout",
                config.max_wait_ms, config.request_timeout_ms
            ),
        );
    }
    Ok(())
}

/// The most queue slots or connections (the queue allocates its slots at start; far more
/// connections than file descriptors could ever be open).
const MAX_SLOTS: u64 = 1 << 20;
/// The longest timeout, a day (timer deadlines must stay representable).
const MAX_TIMEOUT_MS: u64 = 86_400_000;

/// Loads one model per distinct device (workers on one device share it and its prefix cache)
/// and starts the workers.
fn load(app: &App) -> Result<Duration, StartError> {
    let started = Instant::now();
    let c = &app.config;
    let dir = c.checkpoint_dir();
    let mut loaded: Vec<(Backend, DeviceModel)> = Vec::new();
    let mut workers = Vec::new();
    for &backend in &c.devices {
        let device = match loaded.iter().find(|(b, _)| *b == backend) {
            Some((_, d)) => d.clone(),
            None => {
                let options = LoadOptions::default()
                    .with_backend(backend)
                    .with_dtype(c.dtype)
                    .with_lora_scale(c.lora_scale)
                    .with_cuda_graphs(!c.no_cuda_graphs);
                let model = Arc::new(DecisionModel::load(&dir, &options)?);
                let cache = c
                    .prefix_cache_bytes()
                    .filter(|&b| b > 0)
                    .map(|b| Arc::new(PrefixCache::new(b)));
                let d = DeviceModel { model, cache };
                loaded.push((backend, d.clone()));
                d
            }
        };
        workers.push(device);
    }
    let first = Arc::clone(&loaded[0].1.model);
    let ck = first.checkpoint();
    let info = json!({
        "checkpoint": ck.dir.display().to_string(),
        "base": ck.config.base,
        "adapter": ck.config.adapter,
        "backend": loaded.iter().map(|(_, d)| format!("{:?}", d.model.device().location())).collect::<Vec<_>>(),
        "devices": c.devices.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "dtype": format!("{:?}", first.weights_dtype()).to_lowercase(),
        "max_tokens": ck.config.max_tokens,
        "head": {"dim": ck.config.head.dim, "temperature": ck.config.head.temperature},
        "lora_scale": c.lora_scale,
        "prefix_cache_mib": c.prefix_cache_mib,
        "max_batch_tokens": c.max_batch_tokens,
        "max_wait_ms": c.max_wait_ms,
    });
    app.metrics
        .set_caches(loaded.iter().filter_map(|(_, d)| d.cache.clone()).collect());
    let policy = BatchPolicy {
        max_batch_tokens: c.max_batch_tokens,
        max_wait: Duration::from_millis(c.max_wait_ms),
    };
    let scheduler = Scheduler::start(workers, c.queue_capacity, policy, Arc::clone(&app.metrics))
        .map_err(StartError::Worker)?;
    let _ = app.engine.set(Engine {
        scheduler: Mutex::new(scheduler),
        encoder: first,
        info,
    });
    Ok(started.elapsed())
}

fn router(app: Arc<App>) -> Router {
    let limit = app.config.max_body_bytes;
    Router::new()
        .route("/v1/score", post(score))
        .route("/v1/model", get(model_info))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such endpoint", None) })
        .method_not_allowed_fallback(|method: axum::http::Method| async move {
            error(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("method {method} is not allowed on this endpoint"),
                None,
            )
        })
        .layer(axum::middleware::from_fn(head_limits))
        .layer(
            ServiceBuilder::new()
                .layer(
                    TraceLayer::new_for_http()
                        .on_failure(|class, _latency, _span: &tracing::Span| log_failure(class)),
                )
                .layer(CatchPanicLayer::custom(|_| {
                    error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "the request handler panicked",
                        None,
                    )
                }))
                .layer(DefaultBodyLimit::max(limit)),
        )
        .with_state(app)
}

/// The longest request target answered: longer ones get 414.
const MAX_TARGET_BYTES: usize = 8 << 10;
/// The most header fields, and their bytes, answered: more get 431. Both are below hyper's own
/// limits (`Limits::max_headers`, twice this, and hyper's 64 KiB target and ~400 KB head), which
/// answer with an empty body, so a client over these limits reads why.
const MAX_HEADERS: usize = 100;
const MAX_HEADER_BYTES: usize = 64 << 10;

/// 414 and 431, with the error body every other answer has, for a request whose head is too
/// large; the connection closes after it.
async fn head_limits(req: Request, next: axum::middleware::Next) -> Response {
    let target = req.uri().path_and_query().map_or(0, |p| p.as_str().len());
    if target > MAX_TARGET_BYTES {
        return closing(error(
            StatusCode::URI_TOO_LONG,
            format!("the request target is {target} bytes, more than {MAX_TARGET_BYTES}"),
            None,
        ));
    }
    let headers = req.headers();
    let bytes: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    if headers.len() > MAX_HEADERS || bytes > MAX_HEADER_BYTES {
        return closing(error(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            format!(
                "{} header fields of {bytes} bytes: at most {MAX_HEADERS} fields and {MAX_HEADER_BYTES} bytes",
                headers.len()
            ),
            None,
        ));
    }
    next.run(req).await
}

/// An error answer: `{"error": {"code": 422, "message": ..., ...}}`.
fn error(code: StatusCode, message: impl Into<String>, extra: Option<Value>) -> Response {
    let mut body = json!({"code": code.as_u16(), "message": message.into()});
    if let (Some(Value::Object(extra)), Value::Object(b)) = (extra, &mut body) {
        b.extend(extra);
    }
    let mut r = (code, Json(json!({ "error": body }))).into_response();
    if code == StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

async fn ready(State(app): State<Arc<App>>) -> Response {
    if app.engine.get().is_some() && !app.draining.load(Ordering::SeqCst) {
        Json(json!({"status": "ready"})).into_response()
    } else {
        error(StatusCode::SERVICE_UNAVAILABLE, "not ready", None)
    }
}

async fn model_info(State(app): State<Arc<App>>) -> Response {
    match app.engine.get() {
        Some(e) => Json(e.info.clone()).into_response(),
        None => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the model is loading",
            None,
        ),
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    if let Some(e) = app.engine.get() {
        let queued = e.scheduler.lock().map_or(0, |s| s.queued());
        app.metrics.queue_depth.set(queued as i64);
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.metrics.encode(),
    )
        .into_response()
}

async fn score(State(app): State<Arc<App>>, req: Request) -> Response {
    let mut observed = Observed {
        metrics: &app.metrics,
        arrived: Instant::now(),
        code: None,
    };
    let deadline = tokio::time::Instant::now() + app.config.request_timeout();
    let response = score_inner(&app, req, deadline).await;
    observed.code = Some(response.status().as_u16());
    response
}

/// Counts a request in the metrics when its handler ends: with its answer's status, or as 499
/// when the client went away first (the handler was dropped), so every request is counted.
struct Observed<'a> {
    metrics: &'a Metrics,
    arrived: Instant,
    code: Option<u16>,
}

impl Drop for Observed<'_> {
    fn drop(&mut self) {
        self.metrics.observe_request(
            self.code.unwrap_or(CLIENT_CLOSED),
            self.arrived.elapsed().as_secs_f64(),
        );
    }
}

/// The status counted for a request whose client closed the connection before the answer
/// (nginx's 499; never sent).
const CLIENT_CLOSED: u16 = 499;

async fn score_inner(app: &App, req: Request, deadline: tokio::time::Instant) -> Response {
    let Some(engine) = app.engine.get() else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the model is loading",
            None,
        );
    };
    // Records are plain JSON: a compressed body would otherwise read as malformed JSON.
    if let Some(coding) = req.headers().get(header::CONTENT_ENCODING) {
        let coding = String::from_utf8_lossy(coding.as_bytes());
        if !coding.trim().eq_ignore_ascii_case("identity") {
            return closing(error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!("content-encoding `{coding}` is not supported: send the JSON uncompressed"),
                None,
            ));
        }
    }
    // A body announced over the limit is refused before it is read.
    let announced = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if announced.is_some_and(|n| n > app.config.max_body_bytes as u64) {
        return too_large(app.config.max_body_bytes);
    }
    let timeout_ms = app.config.request_timeout_ms;
    let body = match tokio::time::timeout_at(deadline, Bytes::from_request(req, &())).await {
        Ok(Ok(b)) => b,
        Ok(Err(rejection)) => {
            let code = rejection.status();
            if code == StatusCode::PAYLOAD_TOO_LARGE {
                return too_large(app.config.max_body_bytes);
            }
            return closing(error(code, rejection.body_text(), None));
        }
        // The client's fault: its body did not all arrive (the rest is unread: close).
        Err(_) => {
            return closing(error(
                StatusCode::REQUEST_TIMEOUT,
                format!("the request body did not arrive within {timeout_ms} ms"),
                None,
            ))
        }
    };
    let (records, batched) = match parse(&body, app.config.max_request_records) {
        Ok(r) => r,
        Err(e) => return e,
    };
    let (records, encoded) = match encode(&engine.encoder, records).await {
        Ok(done) => done,
        Err(response) => return response,
    };
    let encoded = match encoded {
        Ok(encoded) => encoded,
        Err((i, e)) => return invalid(i, batched, &e),
    };
    let probs = if encoded.is_empty() {
        Vec::new()
    } else {
        match tokio::time::timeout_at(deadline, submit(engine, encoded)).await {
            Ok(Ok(p)) => p,
            Ok(Err(r)) => return r,
            Err(_) => {
                return error(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!("not answered within {timeout_ms} ms"),
                    None,
                )
            }
        }
    };
    let outs: Vec<RecordOut<'_>> = records
        .iter()
        .zip(&probs)
        .map(|(r, p)| RecordOut::new(r, p))
        .collect();
    // Both forms serialize each record with `score`'s `RecordOut`, so an answer reads the same
    // (fields in order, probabilities as f32) alone, in a batch and in `score`'s output.
    if batched {
        Json(Answers { records: &outs }).into_response()
    } else {
        Json(&outs[0]).into_response()
    }
}

/// A batch's answer: `{"records": [...]}`.
#[derive(serde::Serialize)]
struct Answers<'a> {
    records: &'a [RecordOut<'a>],
}

/// `r`, closing the connection after it (the rest of the request is unread).
fn closing(mut r: Response) -> Response {
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// 413, closing the connection: the rest of the body is not read, so the connection cannot
/// carry another request (and the client must not reuse it).
fn too_large(limit: usize) -> Response {
    closing(error(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("the body is larger than {limit} bytes"),
        None,
    ))
}

/// A request's records encoded off the async workers (a long state takes milliseconds to
/// tokenize, time a worker would not serve other connections), in parallel
/// ([`DecisionModel::encode_records`]). The records come back for the answer.
#[allow(clippy::type_complexity)]
async fn encode(
    model: &Arc<DecisionModel>,
    records: Vec<Record>,
) -> Result<(Vec<Record>, Result<Vec<EncodedRecord>, (usize, kev::Error)>), Response> {
    let model = Arc::clone(model);
    tokio::task::spawn_blocking(move || {
        let encoded = model.encode_records(&records);
        (records, encoded)
    })
    .await
    .map_err(|e| {
        error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding the records failed: {e}"),
            None,
        )
    })
}

async fn submit(
    engine: &Engine,
    encoded: Vec<EncodedRecord>,
) -> Result<Vec<Vec<Vec<f32>>>, Response> {
    let (job, rx) = Job::new(encoded);
    let queued = engine
        .scheduler
        .lock()
        .map_err(|_| {
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the scheduler is unavailable",
                None,
            )
        })?
        .submit(job);
    match queued {
        Ok(()) => {}
        Err(e @ (SubmitError::Full(_) | SubmitError::Closed)) => {
            return Err(error(StatusCode::SERVICE_UNAVAILABLE, e.to_string(), None))
        }
    }
    match rx.await {
        Ok(Ok(p)) => Ok(p),
        Ok(Err(message)) => Err(error(StatusCode::INTERNAL_SERVER_ERROR, message, None)),
        Err(_) => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the worker stopped before answering",
            None,
        )),
    }
}

/// The records of a body: one record, or `{"records": [...]}` (then `true`), at most
/// `max_records` of them. The JSON is read as strictly as `score` and Python read it (a
/// duplicate key is an error); an object with `records` beside other fields is a record, and
/// so refused for its unknown field.
#[allow(clippy::result_large_err)]
fn parse(body: &[u8], max_records: usize) -> Result<(Vec<Record>, bool), Response> {
    let malformed = |message: String| error(StatusCode::BAD_REQUEST, message, None);
    let text =
        std::str::from_utf8(body).map_err(|e| malformed(format!("the body is not UTF-8: {e}")))?;
    let value = kev::json::parse_strict(text)
        .map_err(|e| malformed(format!("the body is not valid JSON: {e}")))?;
    let batch = match &value {
        Value::Object(o) if o.len() == 1 => o.get("records"),
        _ => None,
    };
    match batch {
        Some(Value::Array(items)) if items.len() > max_records => Err(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the request has {} records; at most {max_records} are taken in one request (--max-request-records)",
                items.len()
            ),
            Some(json!({"field": "records"})),
        )),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| Record::from_json_value(v, None).map_err(|e| invalid(i, true, &e)))
            .collect::<Result<Vec<_>, _>>()
            .map(|r| (r, true)),
        Some(other) => Err(error(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "field `records`: must be a list of records, found {}",
                type_name(other)
            ),
            Some(json!({"field": "records"})),
        )),
        None => Record::from_json_value(&value, None)
            .map(|r| (vec![r], false))
            .map_err(|e| invalid(0, false, &e)),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// 422 for record `index`, naming its field where the library does.
fn invalid(index: usize, batched: bool, e: &kev::Error) -> Response {
    let field = match e {
        kev::Error::Record { field, .. } => field.clone(),
        _ => String::new(),
    };
    let code = match e {
        kev::Error::Record { .. } | kev::Error::TooLong { .. } | kev::Error::Tokenizer { .. } => {
            StatusCode::UNPROCESSABLE_ENTITY
        }
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    let message = if batched {
        format!("records[{index}]: {e}")
    } else {
        e.to_string()
    };
    error(
        code,
        message,
        Some(json!({"record": index, "field": field})),
    )
}
