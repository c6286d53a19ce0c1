//! Rate-limited logging: a fault that repeats with every request (each refused while the queue
//! is full) is logged at most once per interval, with how many were left out since.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use tower_http::classify::ServerErrorsFailureClass;

/// How often one kind of fault is logged at most.
pub(crate) const INTERVAL: Duration = Duration::from_secs(1);

/// One kind of fault's log: when it last logged, and how many it has left out since.
pub(crate) struct Throttle {
    state: Mutex<(Option<Instant>, u64)>,
}

impl Throttle {
    pub(crate) const fn new() -> Self {
        Self {
            state: Mutex::new((None, 0)),
        }
    }

    /// Whether to log an occurrence at `now`: `Some(left out since the last one logged)`, or
    /// none (counted as left out).
    pub(crate) fn check(&self, now: Instant) -> Option<u64> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let due =
            s.0.is_none_or(|last| now.saturating_duration_since(last) >= INTERVAL);
        if due {
            let left_out = s.1;
            *s = (Some(now), 0);
            Some(left_out)
        } else {
            s.1 += 1;
            None
        }
    }
}

/// Logs a failed answer (5xx) for the HTTP trace layer: a refusal the client is told to retry
/// (503) or a timeout (504) at WARN, anything else at ERROR; each kind at most once per
/// [`INTERVAL`].
pub(crate) fn log_failure(class: ServerErrorsFailureClass) {
    static BUSY: Throttle = Throttle::new();
    static TIMEOUT: Throttle = Throttle::new();
    static OTHER: Throttle = Throttle::new();
    let status = match &class {
        ServerErrorsFailureClass::StatusCode(s) => Some(*s),
        ServerErrorsFailureClass::Error(_) => None,
    };
    let throttle = match status {
        Some(StatusCode::SERVICE_UNAVAILABLE) => &BUSY,
        Some(StatusCode::GATEWAY_TIMEOUT) => &TIMEOUT,
        _ => &OTHER,
    };
    let Some(left_out) = throttle.check(Instant::now()) else {
        return;
    };
    match status {
        Some(StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT) => {
            tracing::warn!(%class, left_out, "request refused or timed out")
        }
        _ => tracing::error!(%class, left_out, "request failed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_fault_logs_once_per_interval_and_counts_the_rest() {
        let t = Throttle::new();
        let t0 = Instant::now();
        assert_eq!(t.check(t0), Some(0));
        for k in 1..=1000 {
            assert_eq!(t.check(t0 + INTERVAL * k / 2000), None);
        }
        assert_eq!(t.check(t0 + INTERVAL), Some(1000));
        assert_eq!(t.check(t0 + INTERVAL + INTERVAL / 2), None);
        assert_eq!(t.check(t0 + INTERVAL * 3), Some(1));
    }
}
