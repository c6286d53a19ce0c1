//! Benchmarks a Kev checkpoint on JSONL workloads and prints one JSON line of figures per
//! (records file, form); `bench/peers.py` prints the same figures for transformers.
//!
//! ```sh
//! cargo run --release --example bench -- --checkpoint bench/.cache/kev-0.8b \
//!     --records bench/.cache/records/one.jsonl --form prefix,row --repeats 3
//! ```
//! Forms: `prefix` (`probs`: the state once, then the record's branches as one batch), `row`
//! (`kev::reference::row_logits`: `state ++ branch_j` alone per question, the reference form), `batch`
//! (`probs_batch` over all records of the file: states as one batch, then all branches) and
//! `state` (`prefix`: each record's state pass alone, a prefill figure; no probabilities).
//! Figures: latency median and min over `--repeats` after `--warmup`, records/s, tokens/s
//! (encoded tokens: state + branches), computed tokens/s (row form recomputes the state per
//! question), model FLOPs and TFLOP/s (the count of `bench/common.py`), peak RSS (VmHWM, reset per
//! workload where the kernel allows), on CUDA the GPU memory in use sampled with `nvidia-smi`
//! (peak over the workload minus the figure before loading) and the memory pool's high-water mark
//! (`peak_gpu_alloc_mib`: tensors only, as the peers' `max_memory_allocated`), the load time and
//! where it went (`load_breakdown`, [`DecisionModel::load_breakdown`]),
//! the first (untimed) pass's time of each form (`first_run_ms`: the cold start of the first),
//! and the first record's probabilities (a parity check against the peers). On CUDA the prefix
//! form of a one-record workload replays a CUDA graph from its second run on (so the default
//! two warm-ups cover the eager run and the capture); `cuda_graphs` counts what happened, and
//! `--no-cuda-graphs` measures the eager path in the same command.

use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use kev::{Backend, DType, DecisionModel, JsonlRecords, LoadOptions, Record};
use serde_json::{json, Value};

/// Benchmark a Kev checkpoint (latency, throughput, memory, FLOP/s).
#[derive(Parser, Debug)]
#[command(about)]
struct Args {
    /// Checkpoint folder (holding kev.json).
    #[arg(long)]
    checkpoint: PathBuf,
    /// JSONL workload; repeat the flag for several (the model is loaded once).
    #[arg(long, required = true)]
    records: Vec<PathBuf>,
    /// Timed repetitions per workload and form.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Untimed repetitions first.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// auto, cpu, cuda[:i] or metal[:i].
    #[arg(long, default_value = "auto")]
    backend: Backend,
    /// auto, f32, bf16, f16, int8 or fp8.
    #[arg(long, default_value = "auto")]
    dtype: DType,
    /// prefix, row, batch, state (comma-separated or repeated; `all` for the first three).
    #[arg(long, value_delimiter = ',', default_value = "prefix")]
    form: Vec<String>,
    /// Run every forward eagerly on CUDA (no graph replays), for an A/B in one command.
    #[arg(long)]
    no_cuda_graphs: bool,
    /// CUDA graphs kept at most (`LoadOptions::cuda_graphs_kept`).
    #[arg(long, default_value_t = kev::DEFAULT_CUDA_GRAPHS_KEPT)]
    cuda_graphs_kept: usize,
    /// Bracket the timed runs with the CUDA profiler's start and stop, for
    /// `ncu --profile-from-start off`: kernels of the load and warm-ups stay out of the profile.
    #[arg(long)]
    profile_timed: bool,
    /// Free text copied into every line.
    #[arg(long, default_value = "")]
    label: String,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Form {
    Prefix,
    Row,
    Batch,
    /// The state pass alone (`DecisionModel::prefix`): a prefill figure, comparable with
    /// llama.cpp's `llama-bench -p N`.
    State,
}

impl Form {
    fn name(self) -> &'static str {
        match self {
            Form::Prefix => "prefix",
            Form::Row => "row",
            Form::Batch => "batch",
            Form::State => "state",
        }
    }
}

fn forms(raw: &[String]) -> Result<Vec<Form>> {
    let mut out = Vec::new();
    for f in raw {
        match f.trim() {
            "prefix" => out.push(Form::Prefix),
            "row" => out.push(Form::Row),
            "batch" => out.push(Form::Batch),
            "state" => out.push(Form::State),
            "all" => out.extend([Form::Row, Form::Prefix, Form::Batch]),
            "both" => out.extend([Form::Row, Form::Prefix]),
            other => bail!("unknown form `{other}` (expected prefix, row, batch, state, all)"),
        }
    }
    Ok(out)
}

fn softmax(l: &[f32]) -> Vec<f32> {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = l.iter().map(|x| (x - m).exp()).collect();
    let s: f32 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

/// One scoring pass over the workload in `form`; returns the probabilities per record.
fn score(model: &DecisionModel, records: &[Record], form: Form) -> Result<Vec<Vec<Vec<f32>>>> {
    Ok(match form {
        Form::Prefix => records
            .iter()
            .map(|r| model.probs(r))
            .collect::<kev::Result<_>>()?,
        Form::Row => records
            .iter()
            .map(|r| {
                kev::reference::row_logits(model, r)
                    .map(|ls| ls.iter().map(|l| softmax(l)).collect())
            })
            .collect::<kev::Result<_>>()?,
        Form::Batch => model.probs_batch(records)?,
        Form::State => {
            for r in records {
                model.prefix(&r.state)?;
            }
            Vec::new()
        }
    })
}

/// The model-FLOP count of `bench/common.py` (`flop_model`, `flops`): keep the two in step.
struct FlopModel {
    per_token: u128,
    attn: u128,
}

impl FlopModel {
    fn from_config(path: &Path) -> Result<Self> {
        let root: Value = serde_json::from_str(
            &std::fs::read_to_string(path)
                .with_context(|| format!("reading `{}`", path.display()))?,
        )?;
        let tc = root.get("text_config").unwrap_or(&root);
        let get = |k: &str| -> Result<u128> {
            tc.get(k)
                .and_then(Value::as_u64)
                .map(u128::from)
                .with_context(|| format!("`{k}` missing from `{}`", path.display()))
        };
        let h = get("hidden_size")?;
        // A layer's MLP per token: dense SwiGLU, or a MoE's router, k routed experts and the
        // gated shared expert (as `mlp_flops` in bench/common.py).
        let mlp = if tc.get("num_experts").is_some() {
            let routed = get("num_experts_per_tok")? * 2 * 3 * h * get("moe_intermediate_size")?;
            let shared = 2 * 3 * h * get("shared_expert_intermediate_size")? + 2 * h;
            2 * h * get("num_experts")? + routed + shared
        } else {
            2 * 3 * h * get("intermediate_size")?
        };
        let (hq, hkv, hd) = (
            get("num_attention_heads")?,
            get("num_key_value_heads")?,
            get("head_dim")?,
        );
        let (hk, hv) = (get("linear_num_key_heads")?, get("linear_num_value_heads")?);
        let (dk, dv, kconv) = (
            get("linear_key_head_dim")?,
            get("linear_value_head_dim")?,
            get("linear_conv_kernel_dim")?,
        );
        let n = get("num_hidden_layers")? as usize;
        let types: Vec<bool> = match tc.get("layer_types").and_then(Value::as_array) {
            Some(t) => t.iter().map(|x| x == "full_attention").collect(),
            None => {
                let every = tc
                    .get("full_attention_interval")
                    .and_then(Value::as_u64)
                    .unwrap_or(4) as usize;
                (0..n).map(|i| (i + 1) % every == 0).collect()
            }
        };
        let (mut per_token, mut n_full) = (0u128, 0u128);
        for full in types {
            per_token += mlp;
            if full {
                n_full += 1;
                per_token += 2 * h * (2 * hq * hd + 2 * hkv * hd) + 2 * hq * hd * h;
            } else {
                let conv_dim = 2 * hk * dk + hv * dv;
                per_token += 2 * h * (conv_dim + hv * dv + 2 * hv) + 2 * hv * dv * h;
                per_token += 8 * dk * dv * hv + 2 * kconv * conv_dim;
            }
        }
        Ok(FlopModel {
            per_token,
            attn: n_full * 4 * hq * hd,
        })
    }

    /// FLOPs of `(past, new)` segments: `new` tokens run after `past` cached ones.
    fn flops(&self, segments: &[(usize, usize)]) -> u128 {
        segments
            .iter()
            .map(|&(past, new)| {
                let (p, n) = (past as u128, new as u128);
                self.per_token * n + self.attn * (n * p + n * (n + 1) / 2)
            })
            .sum()
    }
}

/// The `(past, new)` pieces a form runs (as `segments` in `bench/common.py`).
fn segments(encoded: &[(usize, Vec<usize>)], form: Form) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for (state, branches) in encoded {
        match form {
            Form::Row => out.extend(branches.iter().map(|b| (0, state + b))),
            Form::State => out.push((0, *state)),
            Form::Prefix | Form::Batch => {
                out.push((0, *state));
                out.extend(branches.iter().map(|b| (*state, *b)));
            }
        }
    }
    out
}

/// VmHWM of this process in MiB.
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// Resets VmHWM (Linux: `5` into /proc/self/clear_refs); false where not allowed.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// GPU memory in use on `gpu` (MiB), from nvidia-smi; None where it cannot be read.
fn gpu_used_mib(gpu: usize) -> Option<u64> {
    let out = std::process::Command::new("nvidia-smi")
        .args([
            "--query-gpu=memory.used",
            "--format=csv,noheader,nounits",
            &format!("--id={gpu}"),
        ])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

/// The high-water mark of the CUDA memory pool (MiB; `reset` restarts it): the tensors alone,
/// as PyTorch's `max_memory_allocated`, where `nvidia-smi` also counts the context and cuBLAS.
fn pool_peak_mib(device: &candle_core::Device, reset: bool) -> Option<f64> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        let bytes = kev_kernels::pool_peak_bytes(d, reset).ok()?;
        return Some((bytes as f64 / 1048576.0 * 10.0).round() / 10.0);
    }
    let _ = (device, reset);
    None
}

/// Starts or stops the CUDA profiler's range when `--profile-timed` asked for it.
fn profiler(device: &candle_core::Device, wanted: bool, on: bool) -> Result<()> {
    if !wanted {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return Ok(kev_kernels::profiler_range(d, on)?);
    }
    let _ = (device, on);
    bail!("--profile-timed needs the CUDA backend")
}

/// Samples `gpu_used_mib` every 100 ms and keeps the largest value until dropped.
struct GpuSampler {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl GpuSampler {
    fn start(gpu: usize) -> Self {
        let peak = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (peak.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Some(m) = gpu_used_mib(gpu) {
                    p.fetch_max(m, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        GpuSampler {
            peak,
            stop,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.peak.load(Ordering::Relaxed)
    }
}

fn read_records(path: &Path) -> Result<Vec<Record>> {
    let file =
        std::fs::File::open(path).with_context(|| format!("opening `{}`", path.display()))?;
    JsonlRecords::new(BufReader::new(file), path)
        .map(|(line, r)| r.with_context(|| format!("`{}` line {line}", path.display())))
        .collect()
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let forms = forms(&args.form)?;
    if args.repeats == 0 {
        bail!("--repeats must be at least 1");
    }
    let gpu = match args.backend {
        Backend::Cuda(i) => Some(i),
        _ => None,
    };
    let gpu_before = gpu.and_then(gpu_used_mib);

    let options = LoadOptions::default()
        .with_backend(args.backend)
        .with_dtype(args.dtype)
        .with_cuda_graphs(!args.no_cuda_graphs)
        .with_cuda_graphs_kept(args.cuda_graphs_kept);
    let started = Instant::now();
    let model = DecisionModel::load(&args.checkpoint, &options)
        .with_context(|| format!("loading `{}`", args.checkpoint.display()))?;
    let load_s = started.elapsed().as_secs_f64();
    let device = format!("{:?}", model.device().location());
    let dtype = format!("{:?}", model.weights_dtype()).to_lowercase();
    let activations = format!("{:?}", model.activation_dtype()).to_lowercase();
    eprintln!(
        "kev: loaded `{}` on {device} ({dtype}) in {load_s:.2} s",
        args.checkpoint.display()
    );
    let flop_model = FlopModel::from_config(&model.checkpoint().base.config)?;
    let threads = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let checkpoint_name = args
        .checkpoint
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();

    for path in &args.records {
        let records = read_records(path)?;
        let encoded: Vec<(usize, Vec<usize>)> = records
            .iter()
            .map(|r| {
                model
                    .encode(r)
                    .map(|e| (e.state_len, e.branches.iter().map(|b| b.len).collect()))
            })
            .collect::<kev::Result<_>>()?;
        let tokens: usize = encoded
            .iter()
            .map(|(s, b)| s + b.iter().sum::<usize>())
            .sum();
        let questions: usize = encoded.iter().map(|(_, b)| b.len()).sum();
        // Tokenizing is inside every timed run (the API takes records); the peers time from
        // token ids. This is its share: the records encoded one after another, as the prefix
        // form does (the batch form encodes them in parallel).
        let encode_runs = args.repeats.max(3);
        let mut encode_times = Vec::with_capacity(encode_runs);
        for _ in 0..encode_runs {
            let t = Instant::now();
            for r in &records {
                model.encode(r)?;
            }
            encode_times.push(t.elapsed().as_secs_f64());
        }
        let encode_ms = median(&encode_times) * 1e3;
        let workload = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        for &form in &forms {
            let segs = segments(&encoded, form);
            let computed: usize = segs.iter().map(|&(_, n)| n).sum();
            let flops = flop_model.flops(&segs) as f64;
            let rss_reset = reset_peak_rss();
            let sampler = gpu.map(GpuSampler::start);
            pool_peak_mib(model.device(), true);
            let graphs_before = model.graph_stats();
            let mut times = Vec::with_capacity(args.repeats);
            let mut first = Vec::new();
            let mut first_run_ms = None;
            for i in 0..args.warmup + args.repeats {
                if i == args.warmup {
                    profiler(model.device(), args.profile_timed, true)?;
                }
                let t = Instant::now();
                let probs = score(&model, &records, form)
                    .with_context(|| format!("{workload} {}", form.name()))?;
                let dt = t.elapsed().as_secs_f64();
                first_run_ms.get_or_insert(dt * 1e3);
                if i >= args.warmup {
                    times.push(dt);
                }
                first = probs.into_iter().next().unwrap_or_default();
            }
            profiler(model.device(), args.profile_timed, false)?;
            let gpu_peak = sampler.map(GpuSampler::finish);
            let pool_peak = pool_peak_mib(model.device(), false);
            let med = median(&times);
            let min = times.iter().copied().fold(f64::INFINITY, f64::min);
            let round6 = |x: f32| (f64::from(x) * 1e6).round() / 1e6;
            let mut line = json!({
                "impl": "kev",
                "checkpoint": checkpoint_name,
                "device": device,
                "dtype": dtype,
                "activations": activations,
                "threads": threads,
                "workload": workload,
                "form": form.name(),
                "records": records.len(),
                "questions": questions,
                "tokens": tokens,
                "computed_tokens": computed,
                "warmup": args.warmup,
                "repeats": args.repeats,
                "latency_ms_median": med * 1e3,
                "latency_ms_min": min * 1e3,
                "records_per_s": records.len() as f64 / med,
                "tok_per_s": tokens as f64 / med,
                "computed_tok_per_s": computed as f64 / med,
                "gflop": flops / 1e9,
                "tflop_per_s": flops / med / 1e12,
                "peak_rss_mib": (peak_rss_mib() * 10.0).round() / 10.0,
                "peak_rss_reset": rss_reset,
                "load_s": load_s,
                "load_breakdown": model.load_breakdown(),
                "first_run_ms": first_run_ms,
                "encode_ms": encode_ms,
                "first_probs": first
                    .iter()
                    .map(|p| p.iter().map(|&x| round6(x)).collect::<Vec<_>>())
                    .collect::<Vec<_>>(),
            });
            if let (Some(peak), Some(before)) = (gpu_peak, gpu_before) {
                line["peak_gpu_mib"] = json!(peak.saturating_sub(before));
                line["gpu_mib_sampled"] = json!(true);
            }
            if let Some(mib) = pool_peak {
                line["peak_gpu_alloc_mib"] = json!(mib);
            }
            if model.device().is_cuda() {
                let g = model.graph_stats();
                line["cuda_graphs"] = json!({
                    "enabled": !args.no_cuda_graphs,
                    "kept_at_most": args.cuda_graphs_kept,
                    "captured": g.captured - graphs_before.captured,
                    "replayed": g.replayed - graphs_before.replayed,
                    "failed": g.failed - graphs_before.failed,
                });
                if let Some(why) = g.last_failure {
                    line["cuda_graphs"]["last_failure"] = json!(why);
                }
            }
            if !args.label.is_empty() {
                line["label"] = json!(args.label);
            }
            println!("{line}");
            eprintln!(
                "{workload} {}: median {:.1} ms, min {:.1} ms",
                form.name(),
                med * 1e3,
                min * 1e3
            );
        }
    }
    Ok(())
}
