//! [`DecisionModel`]: a Kev checkpoint loaded for scoring (KEV.md §3, §6).
//!
//! Two forms compute the same numbers. The row form runs `state ++ branch_j` for each question
//! (the reference). The prefix form runs the state once into a [`Cache`], then all branches as
//! one right-padded batch on copies of that cache; a [`Prefix`] can be kept and reused by the
//! next record with the same state. [`DecisionModel::probs_batch`] does the same for many
//! records at once: their states as one padded batch, then all their branches as one batch.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use kev_core::{Checkpoint, Encoder, Encoding, Error, LoadOptions, Record, Result, Row};

use crate::device::{select_device, select_dtype, settle};
use crate::head::{softmax, PointerHead};
use crate::lora::Adapter;
use crate::qwen35::{Cache, Config, Model};
use crate::weights::Weights;

/// Token id used to right-pad branches and states (never read: both layer kinds are causal and
/// padded positions are masked out of later attention).
const PAD_ID: u32 = 0;

/// A Kev decision model: backbone (adapter folded in), pointer head and encoder.
///
/// Immutable after loading; every method takes `&self`, so one model can serve many threads.
pub struct DecisionModel {
    model: Model,
    head: PointerHead,
    encoder: Encoder,
    checkpoint: Checkpoint,
    /// Longest piece one forward pass runs ([`LoadOptions::prefill_chunk`]).
    prefill_chunk: usize,
}

/// A state run once through the backbone, reusable for any record with the same state.
pub struct Prefix {
    state: String,
    state_ids: Vec<u32>,
    cache: Cache,
}

impl Prefix {
    /// The state text this prefix was computed from.
    pub fn state(&self) -> &str {
        &self.state
    }

    /// Number of state tokens.
    pub fn len(&self) -> usize {
        self.state_ids.len()
    }

    /// Whether the state encoded to no tokens at all.
    pub fn is_empty(&self) -> bool {
        self.state_ids.is_empty()
    }
}

fn backend_err(context: &str) -> impl Fn(candle_core::Error) -> Error + '_ {
    move |e| Error::backend(context.to_string(), e)
}

impl DecisionModel {
    /// Loads the checkpoint in `dir` (a folder with `kev.json`).
    pub fn load(dir: impl AsRef<Path>, options: &LoadOptions) -> Result<Self> {
        options.validate()?;
        let checkpoint = Checkpoint::open(dir)?;
        let device = select_device(options.backend)?;
        let dtype = select_dtype(options.dtype, &device);
        let config_text = std::fs::read_to_string(&checkpoint.base.config)
            .map_err(|e| Error::io(&checkpoint.base.config, e))?;
        let cfg = Config::from_json(&config_text)
            .map_err(|m| Error::config(&checkpoint.base.config, "text_config", m))?;
        let adapter = match (
            checkpoint.adapter_config_path(),
            checkpoint.adapter_weights_path(),
        ) {
            (Some(c), Some(w)) => Some(Adapter::load(&c, &w)?),
            _ => None,
        };
        let weights = Weights::open(
            &checkpoint.base.weights,
            adapter,
            options.lora_scale,
            dtype,
            device.clone(),
        )?;
        let model = Model::new(&cfg, &weights)?;
        let head_cfg = &checkpoint.config.head;
        let head = PointerHead::load(
            &checkpoint.head_path,
            head_cfg.dim,
            cfg.hidden_size,
            head_cfg.temperature,
            &device,
        )?;
        let encoder = checkpoint.encoder()?;
        let vocab = encoder.tokenizer().get_vocab_size(true);
        if vocab > cfg.vocab_size {
            return Err(Error::config(
                &checkpoint.base.config,
                "vocab_size",
                format!(
                    "the tokenizer has {vocab} tokens but the model only {} embeddings",
                    cfg.vocab_size
                ),
            ));
        }
        settle(&device)?;
        Ok(Self {
            model,
            head,
            encoder,
            checkpoint,
            prefill_chunk: options.prefill_chunk,
        })
    }

    /// The checkpoint this model was loaded from.
    pub fn checkpoint(&self) -> &Checkpoint {
        &self.checkpoint
    }

    /// The pointer head.
    pub fn head(&self) -> &PointerHead {
        &self.head
    }

    /// The backbone (activation) dtype.
    pub fn dtype(&self) -> DType {
        self.model.dtype()
    }

    /// The device everything runs on.
    pub fn device(&self) -> &Device {
        self.model.device()
    }

    /// The backbone.
    pub fn backbone(&self) -> &Model {
        &self.model
    }

    /// The encoder (tokenizer, template, markers).
    pub fn encoder(&self) -> &Encoder {
        &self.encoder
    }

    /// Token ids, segments and positions of `record` (KEV.md §2).
    pub fn encode(&self, record: &Record) -> Result<Encoding> {
        self.encoder.encode(record, None)
    }

    /// Logits per question (prefix form).
    pub fn forward(&self, record: &Record) -> Result<Vec<Vec<f32>>> {
        let (logits, _) = self.logits_and_prefix(record, None)?;
        Ok(logits)
    }

    /// Logits per question in row form: `state ++ branch_j` run on its own for each question.
    /// Slower; this is the reference the prefix form is checked against.
    pub fn forward_rows(&self, record: &Record) -> Result<Vec<Vec<f32>>> {
        let (state, rows) = self.encode(record)?.rows();
        rows.iter()
            .map(|row| {
                let ids: Vec<u32> = state.iter().chain(&row.ids).copied().collect();
                let mut cache = self.model.new_cache(1).map_err(backend_err("row form"))?;
                let hidden = self.run(&[ids], &mut cache)?;
                let shifted = Row {
                    ids: row.ids.clone(),
                    decide: row.decide + state.len(),
                    opts: row.opts.iter().map(|o| o + state.len()).collect(),
                };
                Ok(self.read_head(&hidden, &[shifted])?.remove(0))
            })
            .collect()
    }

    /// Probabilities per question (prefix form).
    pub fn probs(&self, record: &Record) -> Result<Vec<Vec<f32>>> {
        Ok(self.forward(record)?.iter().map(|l| softmax(l)).collect())
    }

    /// Probabilities per question, and the state's prefix for reuse.
    pub fn probs_and_prefix(&self, record: &Record) -> Result<(Vec<Vec<f32>>, Prefix)> {
        let (logits, prefix) = self.logits_and_prefix(record, None)?;
        let prefix = prefix.expect("a prefix is computed when none is given");
        Ok((logits.iter().map(|l| softmax(l)).collect(), prefix))
    }

    /// Probabilities per question, reusing `prefix` (which must come from the same state).
    pub fn probs_with_prefix(&self, record: &Record, prefix: &Prefix) -> Result<Vec<Vec<f32>>> {
        let (logits, _) = self.logits_and_prefix(record, Some(prefix))?;
        Ok(logits.iter().map(|l| softmax(l)).collect())
    }

    /// Runs `record.state` once into a prefix.
    pub fn prefix(&self, state: &str) -> Result<Prefix> {
        self.prefix_of(state, self.encoder.encode_state(state)?)
    }

    /// Runs already-encoded state ids into a prefix.
    fn prefix_of(&self, state: &str, state_ids: Vec<u32>) -> Result<Prefix> {
        let mut cache = self
            .model
            .new_cache(1)
            .map_err(backend_err("prefix cache"))?;
        if !state_ids.is_empty() {
            self.run(std::slice::from_ref(&state_ids), &mut cache)?;
        }
        Ok(Prefix {
            state: state.to_string(),
            state_ids,
            cache,
        })
    }

    /// Probabilities for many records at once: all states as one padded batch, then all branches
    /// as one padded batch. Equal to scoring them one by one.
    pub fn probs_batch(&self, records: &[Record]) -> Result<Vec<Vec<Vec<f32>>>> {
        if records.is_empty() {
            return Ok(Vec::new());
        }
        let encoded: Vec<(Vec<u32>, Vec<Row>)> = records
            .iter()
            .map(|r| self.encode(r).map(|e| e.rows()))
            .collect::<Result<_>>()?;
        let states: Vec<Vec<u32>> = encoded.iter().map(|(s, _)| s.clone()).collect();
        let mut cache = self
            .model
            .new_cache(states.len())
            .map_err(backend_err("batch cache"))?;
        if states.iter().any(|s| !s.is_empty()) {
            self.run(&states, &mut cache)?;
        }
        let owners: Vec<usize> = encoded
            .iter()
            .enumerate()
            .flat_map(|(i, (_, rows))| vec![i; rows.len()])
            .collect();
        let rows: Vec<Row> = encoded.into_iter().flat_map(|(_, rows)| rows).collect();
        let logits = self.branches(&cache, &owners, &rows)?;
        let mut out: Vec<Vec<Vec<f32>>> = vec![Vec::new(); records.len()];
        for (owner, l) in owners.into_iter().zip(logits) {
            out[owner].push(softmax(&l));
        }
        Ok(out)
    }

    fn logits_and_prefix(
        &self,
        record: &Record,
        given: Option<&Prefix>,
    ) -> Result<(Vec<Vec<f32>>, Option<Prefix>)> {
        let (state, rows) = self.encode(record)?.rows();
        let computed = match given {
            Some(prefix) => {
                if prefix.state != record.state || prefix.state_ids != state {
                    return Err(Error::Prefix {
                        message: format!(
                            "the prefix was computed for another state ({} tokens) than record `{}`'s ({} tokens)",
                            prefix.state_ids.len(),
                            record.id.as_deref().unwrap_or("<no id>"),
                            state.len()
                        ),
                    });
                }
                None
            }
            None => Some(self.prefix_of(&record.state, state.clone())?),
        };
        let prefix = given.or(computed.as_ref()).expect("one of the two is set");
        let logits = self.branches(&prefix.cache, &vec![0; rows.len()], &rows)?;
        Ok((logits, computed))
    }

    /// Runs `rows` as one right-padded batch, row i continuing row `owners[i]` of `cache`, and
    /// returns each row's logits.
    fn branches(&self, cache: &Cache, owners: &[usize], rows: &[Row]) -> Result<Vec<Vec<f32>>> {
        let mut branch_cache = cache
            .select_rows(owners)
            .map_err(backend_err("copying the prefix cache"))?;
        let ids: Vec<Vec<u32>> = rows.iter().map(|r| r.ids.clone()).collect();
        let hidden = self.run(&ids, &mut branch_cache)?;
        self.read_head(&hidden, rows)
    }

    /// Right-pads `seqs` into `[B, T]` and runs them after `cache`, in pieces of at most
    /// `prefill_chunk` tokens; returns the hidden states `[B, T, H]`.
    fn run(&self, seqs: &[Vec<u32>], cache: &mut Cache) -> Result<Tensor> {
        let width = seqs.iter().map(Vec::len).max().unwrap_or(0);
        let mut hidden = Vec::with_capacity(width.div_ceil(self.prefill_chunk));
        for start in (0..width).step_by(self.prefill_chunk) {
            let end = (start + self.prefill_chunk).min(width);
            let pieces: Vec<&[u32]> = seqs
                .iter()
                .map(|s| &s[start.min(s.len())..end.min(s.len())])
                .collect();
            hidden.push(self.run_piece(&pieces, end - start, cache)?);
        }
        if hidden.len() == 1 {
            return Ok(hidden.remove(0));
        }
        Tensor::cat(&hidden, 1).map_err(backend_err("joining prefill pieces"))
    }

    fn run_piece(&self, pieces: &[&[u32]], width: usize, cache: &mut Cache) -> Result<Tensor> {
        let lengths: Vec<usize> = pieces.iter().map(|p| p.len()).collect();
        let flat: Vec<u32> = pieces
            .iter()
            .flat_map(|p| {
                p.iter()
                    .copied()
                    .chain(std::iter::repeat_n(PAD_ID, width - p.len()))
            })
            .collect();
        let ids = Tensor::from_vec(flat, (pieces.len(), width), self.device())
            .map_err(backend_err("token ids"))?;
        let padded = lengths.iter().any(|&l| l != width);
        self.model
            .forward(&ids, cache, padded.then_some(lengths.as_slice()))
            .map_err(backend_err("backbone forward"))
    }

    /// Reads the head at each row's `decide` and `opts` positions of `hidden: [B, T, H]`.
    fn read_head(&self, hidden: &Tensor, rows: &[Row]) -> Result<Vec<Vec<f32>>> {
        let err = backend_err("pointer head");
        let (_, width, h) = hidden.dims3().map_err(&err)?;
        let flat = hidden.reshape(((), h)).map_err(&err)?;
        let decide: Vec<u32> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| (i * width + r.decide) as u32)
            .collect();
        let mut opts = Vec::new();
        let mut owner = Vec::new();
        for (i, r) in rows.iter().enumerate() {
            opts.extend(r.opts.iter().map(|&o| (i * width + o) as u32));
            owner.extend(std::iter::repeat_n(i as u32, r.opts.len()));
        }
        let pick = |idx: Vec<u32>| -> candle_core::Result<Tensor> {
            let n = idx.len();
            flat.index_select(&Tensor::from_vec(idx, n, self.device())?, 0)
        };
        let logits = self
            .head
            .logits(
                &pick(decide).map_err(&err)?,
                &pick(opts).map_err(&err)?,
                &owner,
            )
            .map_err(&err)?;
        let mut out = Vec::with_capacity(rows.len());
        let mut at = 0;
        for r in rows {
            out.push(logits[at..at + r.opts.len()].to_vec());
            at += r.opts.len();
        }
        Ok(out)
    }
}
