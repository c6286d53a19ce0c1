//! The counters behind `GET /metrics` (OpenMetrics text, which Prometheus reads).

use std::sync::{Arc, OnceLock};

use kev::PrefixCache;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Label of a request counter: the HTTP status.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabel {
    /// The status code.
    pub code: u16,
}

/// Everything the server counts.
pub struct Metrics {
    registry: Registry,
    /// `/v1/score` answers by status.
    pub requests: Family<StatusLabel, Counter>,
    /// `/v1/score` time from the request's arrival to its answer.
    pub latency: Histogram,
    /// Time requests waited in the queue.
    pub queue_wait: Histogram,
    /// Records scored.
    pub records: Counter,
    /// Batches run.
    pub batches: Counter,
    /// Records per batch.
    pub batch_records: Histogram,
    /// Tokens a batch ran.
    pub batch_tokens: Histogram,
    /// Model time per batch.
    pub batch_seconds: Histogram,
    /// Queued requests whose client had gone before they ran (not run).
    pub abandoned: Counter,
    /// Requests waiting (set on each scrape).
    pub queue_depth: Gauge,
    caches: Arc<OnceLock<Vec<Arc<PrefixCache>>>>,
}

impl Metrics {
    /// Counters at zero.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kev");
        let requests = Family::<StatusLabel, Counter>::default();
        registry.register(
            "requests",
            "POST /v1/score answers by status",
            requests.clone(),
        );
        let latency = Histogram::new(exponential_buckets(0.0005, 2.0, 18));
        registry.register(
            "request_duration_seconds",
            "POST /v1/score time from arrival to answer",
            latency.clone(),
        );
        let queue_wait = Histogram::new(exponential_buckets(0.0001, 2.0, 18));
        registry.register(
            "queue_wait_seconds",
            "time requests waited for a worker",
            queue_wait.clone(),
        );
        let records = Counter::default();
        registry.register("records", "records scored", records.clone());
        let batches = Counter::default();
        registry.register("batches", "batches run", batches.clone());
        let batch_records = Histogram::new(exponential_buckets(1.0, 2.0, 12));
        registry.register("batch_records", "records per batch", batch_records.clone());
        let batch_tokens = Histogram::new(exponential_buckets(16.0, 2.0, 14));
        registry.register(
            "batch_tokens",
            "tokens run per batch (cached states not counted)",
            batch_tokens.clone(),
        );
        let batch_seconds = Histogram::new(exponential_buckets(0.0002, 2.0, 18));
        registry.register(
            "batch_duration_seconds",
            "model time per batch",
            batch_seconds.clone(),
        );
        let abandoned = Counter::default();
        registry.register(
            "abandoned_requests",
            "queued requests dropped because their client had gone",
            abandoned.clone(),
        );
        let queue_depth = Gauge::default();
        registry.register("queue_depth", "requests waiting", queue_depth.clone());
        let caches = Arc::new(OnceLock::new());
        registry.register_collector(Box::new(CacheCollector(Arc::clone(&caches))));
        Self {
            registry,
            requests,
            latency,
            queue_wait,
            records,
            batches,
            batch_records,
            batch_tokens,
            batch_seconds,
            abandoned,
            queue_depth,
            caches,
        }
    }

    /// The prefix caches to report (once, after loading).
    pub fn set_caches(&self, caches: Vec<Arc<PrefixCache>>) {
        let _ = self.caches.set(caches);
    }

    /// Counts one answer of `/v1/score`.
    pub fn observe_request(&self, code: u16, seconds: f64) {
        self.requests.get_or_create(&StatusLabel { code }).inc();
        self.latency.observe(seconds);
    }

    /// Counts one batch.
    pub fn observe_batch(&self, _jobs: usize, records: usize, tokens: usize, seconds: f64) {
        self.batches.inc();
        self.records.inc_by(records as u64);
        self.batch_records.observe(records as f64);
        self.batch_tokens.observe(tokens as f64);
        self.batch_seconds.observe(seconds);
    }

    /// The text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

/// The prefix caches' counters, read at each scrape (summed over devices).
#[derive(Debug)]
struct CacheCollector(Arc<OnceLock<Vec<Arc<PrefixCache>>>>);

impl Collector for CacheCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let stats: Vec<_> = self
            .0
            .get()
            .map(|cs| cs.iter().map(|c| c.stats()).collect())
            .unwrap_or_default();
        let sum = |f: fn(&kev::PrefixCacheStats) -> u64| stats.iter().map(f).sum::<u64>();
        let counters: [(&str, &str, u64); 4] = [
            (
                "prefix_cache_hits",
                "lookups that found their state's prefix",
                sum(|s| s.hits),
            ),
            (
                "prefix_cache_misses",
                "lookups that did not",
                sum(|s| s.misses),
            ),
            (
                "prefix_cache_evictions",
                "prefixes dropped to make room",
                sum(|s| s.evictions),
            ),
            (
                "prefix_cache_rejected",
                "prefixes larger than the whole budget, not kept",
                sum(|s| s.rejected),
            ),
        ];
        for (name, help, v) in counters {
            let c = ConstCounter::new(v);
            c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        let gauges: [(&str, &str, u64); 3] = [
            (
                "prefix_cache_bytes",
                "device bytes of the prefixes held",
                sum(|s| s.bytes as u64),
            ),
            (
                "prefix_cache_budget_bytes",
                "the caches' byte budget",
                sum(|s| s.budget as u64),
            ),
            (
                "prefix_cache_entries",
                "prefixes held",
                sum(|s| s.entries as u64),
            ),
        ];
        for (name, help, v) in gauges {
            let g = ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX));
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        Ok(())
    }
}
