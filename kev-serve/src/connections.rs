//! Connections: accepting under the connection limit, HTTP/1 with the timeouts that bound slow
//! clients, and a drain that ends every connection within a deadline.
//!
//! A connection holds one of `max_connections` permits until it closes, so a client that never
//! finishes would hold its slot for good: hyper's header read timeout closes a connection whose
//! request line and headers have not all arrived `header_timeout` after it started reading them.
//! Reading a head starts when the connection opens and again after each answer, so the same
//! timeout closes a keep-alive connection left idle. Bodies are read inside the request timeout
//! (`server`). On shutdown a connection with no request in flight (idle, or still sending a
//! request's head) closes at once; one with a request in flight closes after answering it, or
//! at `drain_timeout` at the latest.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tower::ServiceExt;

/// How connections are bounded.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Open connections at most; accepting waits for one to close.
    pub max_connections: usize,
    /// Time to send a request's line and headers, from the connection's start or its last answer.
    pub header_timeout: Duration,
    /// How long a connection may stay open once shutdown begins.
    pub drain_timeout: Duration,
    /// Header fields hyper parses at most: past them it answers 431 with an empty body, so the
    /// server sets this above the limit its router answers with a reason.
    pub max_headers: usize,
}

/// Serves `router` on `listener` until `stop` turns true, then drains: returns once every
/// connection has closed (at most `drain_timeout` later).
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let mut open = JoinSet::new();
    loop {
        let permit = tokio::select! {
            p = Arc::clone(&permits).acquire_owned() => p.expect("the semaphore is never closed"),
            _ = stop.wait_for(|s| *s) => break,
        };
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.wait_for(|s| *s) => break,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            // Out of file descriptors and the like: wait, as axum's own listener does.
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        while open.try_join_next().is_some() {}
        open.spawn(connection(
            stream,
            peer,
            permit,
            router.clone(),
            limits,
            stop.clone(),
        ));
    }
    drop(listener);
    while open.join_next().await.is_some() {}
}

/// One connection, until it closes or the drain deadline passes.
async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    _permit: OwnedSemaphorePermit,
    router: Router,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        // Above the router's own limit, which answers with a body (`server::head_limits`).
        .max_headers(limits.max_headers)
        // A client may close its sending side once its request is sent and still get the answer.
        .half_close(true);
    let in_flight = Arc::new(AtomicUsize::new(0));
    let service = {
        let in_flight = Arc::clone(&in_flight);
        service_fn(move |req: hyper::Request<Incoming>| {
            let busy = Busy::enter(&in_flight);
            let answer = router.clone().oneshot(req.map(Body::new));
            async move {
                let response = answer.await?;
                // Busy until hyper has written the body and drops it.
                Ok::<_, Infallible>(response.map(|body| {
                    Body::new(body.map_frame(move |frame| {
                        let _ = &busy;
                        frame
                    }))
                }))
            }
        })
    };
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let done = tokio::select! {
        r = conn.as_mut() => Some(r),
        _ = stop.wait_for(|s| *s) => None,
    };
    let result = match done {
        Some(r) => r,
        // Nothing accepted is pending here: close now.
        None if in_flight.load(Ordering::SeqCst) == 0 => return,
        None => {
            conn.as_mut().graceful_shutdown();
            match tokio::time::timeout(limits.drain_timeout, conn).await {
                Ok(r) => r,
                Err(_) => {
                    tracing::debug!(%peer, "connection still open at the drain deadline: closed");
                    return;
                }
            }
        }
    };
    if let Err(e) = result {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}

/// A request of this connection being answered: from its head's arrival until its answer's body
/// has been written (or the connection dropped).
struct Busy(Arc<AtomicUsize>);

impl Busy {
    fn enter(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(Arc::clone(count))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}
