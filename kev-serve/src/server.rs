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
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;
use tower::ServiceBuilder;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::trace::TraceLayer;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::scheduler::{BatchPolicy, DeviceModel, Job, Scheduler, SubmitError};

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
    serving: Option<JoinHandle<std::io::Result<()>>>,
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
        let (stop, mut stopped) = watch::channel(false);
        let router = router(Arc::clone(&app));
        let listener = LimitedListener {
            inner: listener,
            permits: Arc::new(Semaphore::new(app.config.max_connections)),
        };
        let serving = tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
        });
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
    /// (queued ones run), closes idle connections, then stops the workers.
    pub async fn shutdown(mut self) -> std::io::Result<()> {
        self.app.draining.store(true, Ordering::SeqCst);
        let _ = self.stop.send(true);
        let served = match self.serving.take() {
            Some(h) => h.await.unwrap_or_else(|e| Err(std::io::Error::other(e))),
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

fn check(config: &Config) -> Result<(), StartError> {
    let positive = [
        ("max-batch-tokens", config.max_batch_tokens),
        ("queue-capacity", config.queue_capacity),
        ("max-connections", config.max_connections),
        ("max-body-bytes", config.max_body_bytes),
        ("devices", config.devices.len()),
    ];
    for (name, v) in positive {
        if v == 0 {
            return Err(StartError::Setting {
                name,
                message: "must be at least 1".into(),
            });
        }
    }
    if config.request_timeout_ms == 0 {
        return Err(StartError::Setting {
            name: "request-timeout-ms",
            message: "must be at least 1".into(),
        });
    }
    Ok(())
}

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
                let cache = (c.prefix_cache_mib > 0)
                    .then(|| Arc::new(PrefixCache::new(c.prefix_cache_mib << 20)));
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
        .layer(
            ServiceBuilder::new()
                .layer(TraceLayer::new_for_http())
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
    let arrived = Instant::now();
    let timeout = app.config.request_timeout();
    let response = match tokio::time::timeout(timeout, score_inner(&app, req)).await {
        Ok(r) => r,
        Err(_) => {
            // The body may be unread: the connection closes after this answer.
            let mut r = error(
                StatusCode::GATEWAY_TIMEOUT,
                format!("not answered within {} ms", timeout.as_millis()),
                None,
            );
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            r
        }
    };
    app.metrics
        .observe_request(response.status().as_u16(), arrived.elapsed().as_secs_f64());
    response
}

async fn score_inner(app: &App, req: Request) -> Response {
    let Some(engine) = app.engine.get() else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the model is loading",
            None,
        );
    };
    // A body announced over the limit is refused before it is read.
    let announced = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if announced.is_some_and(|n| n > app.config.max_body_bytes as u64) {
        return too_large(app.config.max_body_bytes);
    }
    let body = match Bytes::from_request(req, &()).await {
        Ok(b) => b,
        Err(rejection) => {
            let code = rejection.status();
            if code == StatusCode::PAYLOAD_TOO_LARGE {
                return too_large(app.config.max_body_bytes);
            }
            return error(code, rejection.body_text(), None);
        }
    };
    let (records, batched) = match parse(&body) {
        Ok(r) => r,
        Err(e) => return e,
    };
    let mut encoded = Vec::with_capacity(records.len());
    for (i, r) in records.iter().enumerate() {
        match engine.encoder.encode_record(r) {
            Ok(e) => encoded.push(e),
            Err(e) => return invalid(i, batched, &e),
        }
    }
    let probs = if encoded.is_empty() {
        Vec::new()
    } else {
        match submit(engine, encoded).await {
            Ok(p) => p,
            Err(r) => return r,
        }
    };
    let outs: Vec<RecordOut<'_>> = records
        .iter()
        .zip(&probs)
        .map(|(r, p)| RecordOut::new(r, p))
        .collect();
    if batched {
        Json(json!({ "records": outs })).into_response()
    } else {
        Json(&outs[0]).into_response()
    }
}

/// 413, closing the connection: the rest of the body is not read, so the connection cannot
/// carry another request (and the client must not reuse it).
fn too_large(limit: usize) -> Response {
    let mut r = error(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("the body is larger than {limit} bytes"),
        None,
    );
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
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

/// The records of a body: one record, or `{"records": [...]}` (then `true`).
#[allow(clippy::result_large_err)]
fn parse(body: &[u8]) -> Result<(Vec<Record>, bool), Response> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            format!("the body is not valid JSON: {e}"),
            None,
        )
    })?;
    match value.get("records") {
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

/// The listener under a connection limit: a connection holds a permit until it closes, and
/// accepting waits for one.
struct LimitedListener {
    inner: TcpListener,
    permits: Arc<Semaphore>,
}

/// A connection holding its permit.
struct LimitedIo {
    stream: tokio::net::TcpStream,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl axum::serve::Listener for LimitedListener {
    type Io = LimitedIo;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let permit = Arc::clone(&self.permits)
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        loop {
            match self.inner.accept().await {
                Ok((stream, addr)) => {
                    let _ = stream.set_nodelay(true);
                    return (
                        LimitedIo {
                            stream,
                            _permit: permit,
                        },
                        addr,
                    );
                }
                // Out of file descriptors and the like: wait, as axum's own listener does.
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

impl tokio::io::AsyncRead for LimitedIo {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for LimitedIo {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}
