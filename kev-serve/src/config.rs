//! The server's settings: command-line flags, each with a `KEV_*` environment equivalent.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use kev::{Backend, DType};

/// The small checkpoint shipped in the repository, served when no `--checkpoint` is given.
pub fn shipped_checkpoint() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/kev-small"
    ))
}

/// Serve a Kev checkpoint over HTTP (POST /v1/score).
#[derive(clap::Parser, Debug, Clone)]
#[command(version, about)]
pub struct Config {
    /// Checkpoint folder (holding kev.json). By default, the small checkpoint shipped in the repository.
    #[arg(long, env = "KEV_CHECKPOINT")]
    pub checkpoint: Option<PathBuf>,
    /// Address to listen on (port 0: any free port).
    #[arg(long, env = "KEV_ADDR", default_value = "127.0.0.1:8080")]
    pub addr: SocketAddr,
    /// One model worker per entry, all over the one queue: `auto`, `cpu`, `cuda[:i]`, `metal[:i]`,
    /// comma-separated (`cuda:0,cuda:1`; `cpu,cpu` runs two CPU workers on one model).
    #[arg(
        long,
        env = "KEV_DEVICES",
        value_delimiter = ',',
        default_value = "auto"
    )]
    pub devices: Vec<Backend>,
    /// auto, f32, bf16, f16, int8 (x86-64 CPU with AVX2 and FMA; approximate) or fp8 (H100/H200; approximate); auto: f32 on the CPU, bf16 on GPUs.
    #[arg(long, env = "KEV_DTYPE", default_value = "auto")]
    pub dtype: DType,
    /// Adapter interpolation: 0 = base model, 1 = fine-tuned.
    #[arg(long, env = "KEV_LORA_SCALE", default_value_t = 1.0)]
    pub lora_scale: f64,
    /// A batch stops taking requests at this many tokens (a record's state, unless its prefix is
    /// cached or already in the batch, plus its branches). A larger request runs alone.
    #[arg(long, env = "KEV_MAX_BATCH_TOKENS", default_value_t = 4096)]
    pub max_batch_tokens: usize,
    /// How long a worker waits for more requests once a batch has one and the queue is empty.
    #[arg(long, env = "KEV_MAX_WAIT_MS", default_value_t = 0)]
    pub max_wait_ms: u64,
    /// Requests waiting for a worker; beyond it requests get 503 with Retry-After.
    #[arg(long, env = "KEV_QUEUE_CAPACITY", default_value_t = 256)]
    pub queue_capacity: usize,
    /// Device memory for cached state prefixes, per device (0: no cache).
    #[arg(long, env = "KEV_PREFIX_CACHE_MIB", default_value_t = 1024)]
    pub prefix_cache_mib: usize,
    /// Most records in one request; more get 413. A request's records run in batches of at most
    /// `--max-batch-tokens`, so this bounds its time and the memory of its answers, not of a batch.
    #[arg(long, env = "KEV_MAX_REQUEST_RECORDS", default_value_t = 1024)]
    pub max_request_records: usize,
    /// Largest request body; larger ones get 413.
    #[arg(long, env = "KEV_MAX_BODY_BYTES", default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// A request not answered within this time (body included) gets 504.
    #[arg(long, env = "KEV_REQUEST_TIMEOUT_MS", default_value_t = 30_000)]
    pub request_timeout_ms: u64,
    /// A connection must send each request's line and headers within this time from its start
    /// or its previous answer; a slower one (or one idle that long) is closed.
    #[arg(long, env = "KEV_HEADER_TIMEOUT_MS", default_value_t = 10_000)]
    pub header_timeout_ms: u64,
    /// Open connections at most; further ones wait to be accepted.
    #[arg(long, env = "KEV_MAX_CONNECTIONS", default_value_t = 1024)]
    pub max_connections: usize,
    /// Run every forward eagerly on CUDA (no graph replays).
    #[arg(long, env = "KEV_NO_CUDA_GRAPHS")]
    pub no_cuda_graphs: bool,
}

impl Config {
    /// The defaults, as with no flags and no environment.
    pub fn new() -> Self {
        <Self as clap::Parser>::parse_from(["kev-serve"])
    }

    /// The checkpoint folder to load.
    pub fn checkpoint_dir(&self) -> PathBuf {
        self.checkpoint.clone().unwrap_or_else(shipped_checkpoint)
    }

    /// The prefix cache's budget in bytes (none: more than a `usize` holds).
    pub fn prefix_cache_bytes(&self) -> Option<usize> {
        self.prefix_cache_mib.checked_mul(1 << 20)
    }

    /// The request timeout.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }
}

impl Default for Config {
    fn default() -> Self {
        Self::new()
    }
}
