//! Property-based fuzzing of kev-candle's loaders: the safetensors headers and tensor tables of
//! the head ([`PointerHead::load`]), the adapter ([`Adapter::load`], then folded into the base)
//! and the base weights ([`Weights::open`] and [`Model::new`]); the base `config.json`
//! ([`Config::from_json`], then the model built from it); and whole checkpoints with one file
//! edited ([`DecisionModel::load`], fewer cases, as each loads a model).
//!
//! Files are edited two ways: as tensor tables that stay valid safetensors (a dtype, shape or
//! name changed, a tensor dropped, repeated or added, values replaced by NaN and other bit
//! patterns), and as bytes (the header's declared length, its JSON, truncation, stray bytes).
//! The property: no panic or abort; every failure is a typed `kev_core::Error` whose message
//! names the file or the tensor; what loads can run.
//!
//! `KEV_FUZZ_SCALE=N` runs N times as many cases (`scripts/fuzz-long.sh`).

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use kev_candle::lora::Adapter;
use kev_candle::qwen35::{Config, MlpShape, Model};
use kev_candle::weights::Weights;
use kev_candle::{DecisionModel, PointerHead};
use kev_core::{Error, LoadOptions, Record};
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{json, Map, Value};

#[path = "../../tests/fuzz_common/mod.rs"]
mod common;
use common::*;

// ---------------------------------------------------------------------------------------------
// safetensors files as tensor tables
// ---------------------------------------------------------------------------------------------

/// One tensor of a safetensors file, its dtype as written in the header.
#[derive(Clone, Debug)]
struct Entry {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    data: Vec<u8>,
}

/// A safetensors file's table, in data order.
#[derive(Clone, Debug)]
struct Table {
    entries: Vec<Entry>,
    metadata: Option<Value>,
}

impl Table {
    fn read(path: &Path) -> Table {
        let bytes = std::fs::read(path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let data = &bytes[8 + n..];
        let mut metadata = None;
        let mut entries = Vec::new();
        for (name, info) in header {
            if name == "__metadata__" {
                metadata = Some(info);
                continue;
            }
            let offsets: Vec<usize> = serde_json::from_value(info["data_offsets"].clone()).unwrap();
            let entry = Entry {
                name,
                dtype: info["dtype"].as_str().unwrap().to_owned(),
                shape: serde_json::from_value(info["shape"].clone()).unwrap(),
                data: data[offsets[0]..offsets[1]].to_vec(),
            };
            entries.push((offsets[0], entry));
        }
        entries.sort_by_key(|(at, _)| *at);
        Table {
            entries: entries.into_iter().map(|(_, e)| e).collect(),
            metadata,
        }
    }

    fn header(&self) -> Value {
        let mut h = Map::new();
        if let Some(m) = &self.metadata {
            h.insert("__metadata__".into(), m.clone());
        }
        let mut at = 0;
        for e in &self.entries {
            h.insert(
                e.name.clone(),
                json!({"dtype": e.dtype, "shape": e.shape, "data_offsets": [at, at + e.data.len()]}),
            );
            at += e.data.len();
        }
        Value::Object(h)
    }

    fn data(&self) -> Vec<u8> {
        self.entries.iter().flat_map(|e| e.data.clone()).collect()
    }

    fn to_bytes(&self) -> Vec<u8> {
        with_header(&self.header().to_string(), &self.data())
    }
}

/// A safetensors file: the header's length, the header, the data.
fn with_header(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header.as_bytes());
    out.extend(data);
    out
}

/// Every dtype of the format (and two it does not have), with its size in bits.
const DTYPES: &[(&str, u64)] = &[
    ("F32", 32),
    ("F16", 16),
    ("BF16", 16),
    ("F64", 64),
    ("I64", 64),
    ("U64", 64),
    ("I32", 32),
    ("U32", 32),
    ("I16", 16),
    ("U16", 16),
    ("U8", 8),
    ("I8", 8),
    ("BOOL", 8),
    ("F8_E4M3", 8),
    ("F8_E5M2", 8),
    ("F8_E8M0", 8),
    ("F8_E4M3FNUZ", 8),
    ("F4", 4),
    ("F6_E2M3", 6),
    ("C64", 64),
    ("Q4_K", 8),
    ("f32", 32),
];

fn bits(dtype: &str) -> u64 {
    DTYPES.iter().find(|d| d.0 == dtype).map_or(8, |d| d.1)
}

/// `data` repeated or cut to `len` bytes (zeros when there is none).
fn cycled(data: &[u8], len: u64) -> Vec<u8> {
    if data.is_empty() {
        return vec![0; len as usize];
    }
    data.iter().copied().cycle().take(len as usize).collect()
}

/// Bytes of `shape` in `dtype`, when small enough to write (1 MiB).
fn size_of(shape: &[u64], dtype: &str) -> Option<u64> {
    let n = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
    let b = n.checked_mul(bits(dtype))? / 8;
    (b <= 1 << 20).then_some(b)
}

/// One edit of a tensor table that keeps it valid safetensors (when the new size is writable).
#[derive(Clone, Debug)]
enum TensorEdit {
    None,
    Dtype(Index, &'static str),
    Shape(Index, Vec<u64>),
    Drop(Index),
    Rename(Index, String),
    Duplicate(Index, String),
    Extra(String, &'static str, Vec<u64>),
    /// The tensor's bytes become this pattern, repeated (NaN, infinities, huge values…).
    Fill(Index, Vec<u8>),
}

fn dim() -> impl Strategy<Value = u64> {
    prop_oneof![
        8 => prop::sample::select(vec![0u64, 1, 2, 3, 4, 8, 16, 32, 48, 64, 112, 128, 400]),
        1 => prop::sample::select(vec![u32::MAX as u64, 1 << 40, 1 << 62, u64::MAX]),
    ]
}

fn tensor_name() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "q.weight",
            "k.weight",
            "q.bias",
            "k.bias",
            "",
            "__metadata__",
            "model.language_model.embed_tokens.weight",
            "model.language_model.norm.weight",
            "model.language_model.layers.0.mlp.up_proj.weight",
            "model.language_model.layers.8.mlp.up_proj.weight",
            "model.embed_tokens.weight",
            "language_model.model.embed_tokens.weight",
            "base_model.model.layers.0.mlp.up_proj.lora_A.weight",
            "base_model.model.layers.0.mlp.up_proj.lora_B.weight",
            "base_model.model.layers.0.mlp.nonexistent.lora_A.weight",
            "base_model.model.layers.99.self_attn.q_proj.lora_A.weight",
            "base_model.model.embed_tokens.token_adapter.trainable_tokens_delta",
        ])
        .prop_map(str::to_owned),
        "[a-z._0-9]{0,24}",
    ]
}

fn fill() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::sample::select(vec![
            f32::NAN.to_le_bytes().to_vec(),
            f32::INFINITY.to_le_bytes().to_vec(),
            f32::NEG_INFINITY.to_le_bytes().to_vec(),
            f32::MAX.to_le_bytes().to_vec(),
            1e30f32.to_le_bytes().to_vec(),
            f32::MIN_POSITIVE.to_le_bytes().to_vec(),
            vec![0xff, 0x7f], // bf16/f16 NaN-ish
            vec![0x80, 0x7f], // bf16 +inf
            vec![0],
        ]),
        prop::collection::vec(any::<u8>(), 1..9),
    ]
}

fn tensor_edit() -> impl Strategy<Value = TensorEdit> {
    let dtype = prop::sample::select(DTYPES.iter().map(|d| d.0).collect::<Vec<_>>());
    prop_oneof![
        1 => Just(TensorEdit::None),
        2 => (any::<Index>(), dtype.clone()).prop_map(|(i, d)| TensorEdit::Dtype(i, d)),
        3 => (any::<Index>(), prop::collection::vec(dim(), 0..5)).prop_map(|(i, s)| TensorEdit::Shape(i, s)),
        1 => any::<Index>().prop_map(TensorEdit::Drop),
        1 => (any::<Index>(), tensor_name()).prop_map(|(i, n)| TensorEdit::Rename(i, n)),
        1 => (any::<Index>(), tensor_name()).prop_map(|(i, n)| TensorEdit::Duplicate(i, n)),
        1 => (tensor_name(), dtype, prop::collection::vec(dim(), 0..4)).prop_map(|(n, d, s)| TensorEdit::Extra(n, d, s)),
        2 => (any::<Index>(), fill()).prop_map(|(i, f)| TensorEdit::Fill(i, f)),
    ]
}

/// Applies `edit`; returns the name of the tensor edited, if any.
fn apply_tensor_edit(t: &mut Table, edit: &TensorEdit) -> Option<String> {
    let n = t.entries.len();
    if n == 0 {
        return None;
    }
    let at = |i: &Index| i.index(n);
    match edit {
        TensorEdit::None => None,
        TensorEdit::Dtype(i, d) => {
            let e = &mut t.entries[at(i)];
            e.dtype = (*d).to_owned();
            if let Some(len) = size_of(&e.shape, d) {
                e.data = cycled(&e.data, len);
            }
            Some(e.name.clone())
        }
        TensorEdit::Shape(i, s) => {
            let e = &mut t.entries[at(i)];
            e.shape = s.clone();
            if let Some(len) = size_of(s, &e.dtype) {
                e.data = cycled(&e.data, len);
            }
            Some(e.name.clone())
        }
        TensorEdit::Drop(i) => Some(t.entries.remove(at(i)).name),
        TensorEdit::Rename(i, name) => {
            let e = &mut t.entries[at(i)];
            let old = std::mem::replace(&mut e.name, name.clone());
            Some(old)
        }
        TensorEdit::Duplicate(i, name) => {
            let mut e = t.entries[at(i)].clone();
            e.name = name.clone();
            t.entries.push(e);
            Some(name.clone())
        }
        TensorEdit::Extra(name, d, s) => {
            let len = size_of(s, d).unwrap_or(16);
            t.entries.push(Entry {
                name: name.clone(),
                dtype: (*d).to_owned(),
                shape: s.clone(),
                data: cycled(&[0x3c, 0x00, 0x80, 0x3f], len),
            });
            Some(name.clone())
        }
        TensorEdit::Fill(i, pattern) => {
            let e = &mut t.entries[at(i)];
            e.data = cycled(pattern, e.data.len() as u64);
            Some(e.name.clone())
        }
    }
}

/// One edit of a safetensors file's bytes.
#[derive(Clone, Debug)]
enum ByteEdit {
    None,
    /// The header's declared length.
    HeaderLen(u64),
    /// The declared length moved by a few bytes.
    HeaderLenBy(i8),
    /// A structural edit of the header's JSON (offsets, shapes, dtypes as numbers or text).
    HeaderJson(Edit),
    /// A textual edit of the header (a repeated key, a stray character, a cut).
    HeaderText(TextEdit),
    /// The file cut at this byte.
    Truncate(Index),
    /// Bytes appended.
    Append(Vec<u8>),
    /// One byte replaced.
    Byte(Index, u8),
}

fn byte_edit() -> impl Strategy<Value = ByteEdit> {
    prop_oneof![
        6 => Just(ByteEdit::None),
        1 => prop_oneof![any::<u64>(), Just(0u64), Just(1 << 40), Just(u64::MAX), Just(100 << 20), Just((100 << 20) + 1)].prop_map(ByteEdit::HeaderLen),
        1 => any::<i8>().prop_map(ByteEdit::HeaderLenBy),
        2 => edit().prop_map(ByteEdit::HeaderJson),
        1 => text_edit().prop_map(ByteEdit::HeaderText),
        1 => any::<Index>().prop_map(ByteEdit::Truncate),
        1 => prop::collection::vec(any::<u8>(), 1..16).prop_map(ByteEdit::Append),
        1 => (any::<Index>(), any::<u8>()).prop_map(|(i, b)| ByteEdit::Byte(i, b)),
    ]
}

fn apply_byte_edit(t: &Table, edit: &ByteEdit) -> Vec<u8> {
    let mut bytes = t.to_bytes();
    match edit {
        ByteEdit::None => {}
        ByteEdit::HeaderLen(n) => bytes[..8].copy_from_slice(&n.to_le_bytes()),
        ByteEdit::HeaderLenBy(d) => {
            let n =
                u64::from_le_bytes(bytes[..8].try_into().unwrap()).wrapping_add(*d as i64 as u64);
            bytes[..8].copy_from_slice(&n.to_le_bytes());
        }
        ByteEdit::HeaderJson(e) => {
            let mut h = t.header();
            apply(&mut h, e);
            bytes = with_header(&h.to_string(), &t.data());
        }
        ByteEdit::HeaderText(e) => {
            bytes = with_header(&apply_text(&t.header().to_string(), e), &t.data());
        }
        ByteEdit::Truncate(i) => bytes.truncate(i.index(bytes.len() + 1)),
        ByteEdit::Append(extra) => bytes.extend(extra),
        ByteEdit::Byte(i, b) => {
            let at = i.index(bytes.len());
            bytes[at] = *b;
        }
    }
    bytes
}

/// A failure names the file (`path`) or a tensor: its message holds the path, or it is a
/// tensor error with a name (a key of the file, a module, or `(header)`) that the message shows.
fn check_names_file_or_tensor(e: &Error, paths: &[&Path]) -> Result<(), TestCaseError> {
    let msg = e.to_string();
    let names_file = paths.iter().any(|p| msg.contains(&p.display().to_string()));
    match e {
        Error::Several { errors } => {
            prop_assert!(errors.len() > 1);
            for e in errors {
                check_names_file_or_tensor(e, paths)?;
            }
        }
        Error::Tensor { name, .. } => {
            prop_assert!(
                !name.is_empty() || names_file,
                "unnamed tensor error: {msg}"
            );
            prop_assert!(msg.contains(name.as_str()));
        }
        Error::Backend { context, .. } => {
            prop_assert!(
                names_file || context.contains('`'),
                "backend error naming nothing: {msg}"
            );
        }
        Error::Io { .. } | Error::Adapter { .. } | Error::Config { .. } | Error::Json { .. } => {
            prop_assert!(names_file, "{msg} does not name {paths:?}");
        }
        other => {
            return Err(TestCaseError::fail(format!(
                "unexpected error kind: {other:?}"
            )))
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The head
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(cases(256))]

    /// The shipped head with one tensor-table edit and one byte edit. A head that loads reads
    /// any hidden states into one finite logit per option.
    #[test]
    fn head_safetensors(t_edit in tensor_edit(), b_edit in byte_edit(), dim_is_16 in prop::bool::weighted(0.9)) {
        let mut table = Table::read(&fixture("kev-small/head.safetensors"));
        apply_tensor_edit(&mut table, &t_edit);
        let dir = TempDir::new("head");
        let path = dir.0.join("head.safetensors");
        std::fs::write(&path, apply_byte_edit(&table, &b_edit)).unwrap();
        let dim = if dim_is_16 { 16 } else { 8 };
        match PointerHead::load(&path, dim, 64, 0.7, &Device::Cpu) {
            Ok(head) => {
                prop_assert_eq!(head.dim(), dim);
                let h = Tensor::ones((2, 64), DType::F32, &Device::Cpu).unwrap();
                let o = Tensor::ones((3, 64), DType::F32, &Device::Cpu).unwrap();
                // Finite weights can still overflow to non-finite logits (the model refuses
                // non-finite probabilities when scoring): only the shapes are checked here.
                let logits = head.logits(&h, &o, &[0, 0, 1]).unwrap();
                prop_assert_eq!(logits.len(), 3);
            }
            Err(e) => check_names_file_or_tensor(&e, &[path.as_path()])?,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The adapter, then folded into the base
// ---------------------------------------------------------------------------------------------

fn base_mm_files() -> Vec<PathBuf> {
    vec![fixture("base-mm/model.safetensors")]
}

fn base_mm_config() -> Config {
    Config::from_json(&std::fs::read_to_string(fixture("base-mm/config.json")).unwrap()).unwrap()
}

/// Builds the backbone from `weights` and runs three tokens through it: every output finite.
fn build_and_run(cfg: &Config, weights: &Weights, files: &[&Path]) -> Result<(), TestCaseError> {
    match Model::new(cfg, weights).and_then(|m| weights.check_all_used().map(|()| m)) {
        Ok(model) => {
            let mut cache = model.new_cache(1).unwrap();
            let ids = Tensor::new(&[[1u32, 5, 7]], &Device::Cpu).unwrap();
            let out = model.forward(&ids, &mut cache, None);
            prop_assert!(
                out.is_ok(),
                "a model that loaded cannot run: {:?}",
                out.err()
            );
            let dims = out.unwrap().dims().to_vec();
            prop_assert_eq!(dims, vec![1, 3, cfg.hidden_size]);
        }
        Err(e) => check_names_file_or_tensor(&e, files)?,
    }
    Ok(())
}

proptest! {
    #![proptest_config(cases(48))]

    /// The shipped adapter's tensors with one table edit and one byte edit, and sometimes its
    /// config's rank changed: it loads and folds into the base, or fails naming a file or tensor.
    #[test]
    fn adapter_safetensors(t_edit in tensor_edit(), b_edit in byte_edit(), r in prop::option::weighted(0.15, 1usize..9)) {
        let src = fixture("kev-small/adapter");
        let mut table = Table::read(&src.join("adapter_model.safetensors"));
        apply_tensor_edit(&mut table, &t_edit);
        let dir = TempDir::new("adapter");
        let weights_path = dir.0.join("adapter_model.safetensors");
        let config_path = dir.0.join("adapter_config.json");
        std::fs::write(&weights_path, apply_byte_edit(&table, &b_edit)).unwrap();
        let mut config: Value = serde_json::from_str(&std::fs::read_to_string(src.join("adapter_config.json")).unwrap()).unwrap();
        if let Some(r) = r {
            config["r"] = json!(r);
        }
        std::fs::write(&config_path, config.to_string()).unwrap();
        let files = [weights_path.as_path(), config_path.as_path()];
        match Adapter::load(&config_path, &weights_path) {
            Ok(adapter) => {
                match Weights::open(&base_mm_files(), Some(adapter), 1.0, DType::F32, Device::Cpu) {
                    Ok(w) => build_and_run(&base_mm_config(), &w, &files)?,
                    Err(e) => check_names_file_or_tensor(&e, &files)?,
                }
            }
            Err(e) => check_names_file_or_tensor(&e, &files)?,
        }
    }

    /// The base weights with one table edit and one byte edit (the single-file layout, or one
    /// shard of the two-shard text layout): the backbone builds and runs, or the failure names
    /// a file or tensor.
    #[test]
    fn base_safetensors(t_edit in tensor_edit(), b_edit in byte_edit(), sharded in any::<bool>(), shard in 0usize..2) {
        let dir = TempDir::new("base");
        let (cfg_file, files): (PathBuf, Vec<PathBuf>) = if sharded {
            (fixture("base-text/config.json"), vec![
                fixture("base-text/model-00001-of-00002.safetensors"),
                fixture("base-text/model-00002-of-00002.safetensors"),
            ])
        } else {
            (fixture("base-mm/config.json"), base_mm_files())
        };
        let edited = if sharded { shard } else { 0 };
        let mut table = Table::read(&files[edited]);
        apply_tensor_edit(&mut table, &t_edit);
        let out = dir.0.join(files[edited].file_name().unwrap());
        std::fs::write(&out, apply_byte_edit(&table, &b_edit)).unwrap();
        let mut files = files;
        files[edited] = out.clone();
        let cfg = Config::from_json(&std::fs::read_to_string(cfg_file).unwrap()).unwrap();
        let names: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
        match Weights::open(&files, None, 1.0, DType::F32, Device::Cpu) {
            Ok(w) => build_and_run(&cfg, &w, &names)?,
            Err(e) => check_names_file_or_tensor(&e, &names)?,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// config.json
// ---------------------------------------------------------------------------------------------

/// Sizes of the backbone, as a config states them (the fixtures', others, and extremes).
fn size_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => prop::sample::select(vec![0u64, 1, 2, 3, 4, 8, 16, 32, 64, 112, 400]).prop_map(Value::from),
        1 => prop::sample::select(vec![1u64 << 31, 1 << 32, 1 << 40, 1 << 62, u64::MAX]).prop_map(Value::from),
        1 => number(),
    ]
}

/// A config edit that concerns the sizes: one key of the text config set to a size.
fn size_edit() -> impl Strategy<Value = (&'static str, Value)> {
    (
        prop::sample::select(vec![
            "hidden_size",
            "num_hidden_layers",
            "intermediate_size",
            "vocab_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
            "full_attention_interval",
            "rms_norm_eps",
            "rope_theta",
            "partial_rotary_factor",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "decoder_sparse_step",
        ]),
        size_value(),
    )
}

proptest! {
    #![proptest_config(cases(256))]

    /// config.json: the four shipped bases (two dense layouts, one MoE, one FP8) with edits (any value
    /// anywhere, or extreme sizes, the MoE sizes among them),
    /// and arbitrary text. An accepted config obeys the rules the model relies on, and building
    /// the backbone from it over the matching shipped weights succeeds, or fails naming a
    /// tensor, and never allocates by an unchecked size (an abort here fails the whole run).
    #[test]
    fn config_json(
        layout in 0usize..4, e in edit(), sizes in prop::collection::vec(size_edit(), 0..3),
        drop_layer_types in any::<bool>(), t in text_edit(),
    ) {
        let (cfg_file, files) = match layout {
            0 => (fixture("base-text/config.json"), vec![
                fixture("base-text/model-00001-of-00002.safetensors"),
                fixture("base-text/model-00002-of-00002.safetensors"),
            ]),
            1 => (fixture("base-mm/config.json"), base_mm_files()),
            2 => (fixture("base-moe/config.json"), vec![fixture("base-moe/model.safetensors")]),
            _ => (fixture("base-fp8/config.json"), vec![fixture("base-fp8/model.safetensors")]),
        };
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&cfg_file).unwrap()).unwrap();
        {
            let text = if v.get("text_config").is_some() { &mut v["text_config"] } else { &mut v };
            if drop_layer_types {
                text.as_object_mut().unwrap().remove("layer_types");
            }
            for (k, x) in &sizes {
                text[*k] = x.clone();
            }
        }
        apply(&mut v, &e);
        let text = apply_text(&v.to_string(), &t);
        match Config::from_json(&text) {
            Ok(cfg) => {
                prop_assert_eq!(cfg.layer_types.len(), cfg.num_hidden_layers);
                prop_assert!(cfg.rotary_dim > 0 && cfg.rotary_dim % 2 == 0 && cfg.rotary_dim <= cfg.head_dim);
                prop_assert!(cfg.num_key_value_heads > 0 && cfg.num_attention_heads % cfg.num_key_value_heads == 0);
                prop_assert!(cfg.linear_num_key_heads > 0 && cfg.linear_num_value_heads % cfg.linear_num_key_heads == 0);
                prop_assert!(cfg.linear_conv_kernel_dim >= 2);
                prop_assert!(cfg.rms_norm_eps.is_finite() && cfg.rms_norm_eps > 0.0);
                prop_assert!(cfg.rope_theta.is_finite() && cfg.rope_theta > 0.0);
                if let MlpShape::Experts(x) = cfg.mlp {
                    prop_assert!(x.per_token > 0 && x.per_token <= x.experts);
                    prop_assert!(x.width > 0 && x.shared_width > 0);
                }
                let names: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
                let w = Weights::open(&files, None, 1.0, DType::F32, Device::Cpu).unwrap();
                build_and_run(&cfg, &w, &names)?;
            }
            Err(fault) => prop_assert!(!fault.to_string().is_empty()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Whole checkpoints: DecisionModel::load with one file edited
// ---------------------------------------------------------------------------------------------

/// Which file of the checkpoint is edited, and how.
#[derive(Clone, Debug)]
enum FileEdit {
    None,
    Json(&'static str, Edit, TextEdit),
    Safetensors(&'static str, TensorEdit, ByteEdit),
}

fn file_edit() -> impl Strategy<Value = FileEdit> {
    let json = prop::sample::select(vec![
        "kev-small/kev.json",
        "kev-small/adapter/adapter_config.json",
        "base-mm/config.json",
        "base-mm/tokenizer.json",
    ]);
    let st = prop::sample::select(vec![
        "kev-small/head.safetensors",
        "kev-small/adapter/adapter_model.safetensors",
        "base-mm/model.safetensors",
    ]);
    prop_oneof![
        1 => Just(FileEdit::None),
        3 => (json, edit(), text_edit()).prop_map(|(f, e, t)| FileEdit::Json(f, e, t)),
        3 => (st, tensor_edit(), byte_edit()).prop_map(|(f, e, b)| FileEdit::Safetensors(f, e, b)),
    ]
}

fn fixture_records() -> Vec<Record> {
    let text = std::fs::read_to_string(fixture("records.jsonl")).unwrap();
    text.lines()
        .map(|l| Record::from_json_str(l, None).unwrap())
        .collect()
}

proptest! {
    #![proptest_config(cases(16))]

    /// A copy of `kev-small` and its base with one file edited: the model loads and scores the
    /// fixture records into distributions (or a typed record error), or the load fails with an
    /// error naming a file of the checkpoint or a tensor.
    #[test]
    fn decision_model_load(fe in file_edit()) {
        let dir = TempDir::new("model");
        copy_dir(&fixture("kev-small"), &dir.0.join("kev-small"));
        copy_dir(&fixture("base-mm"), &dir.0.join("base-mm"));
        let edited = match &fe {
            FileEdit::None => None,
            FileEdit::Json(f, e, t) => {
                let path = dir.0.join(f);
                let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
                apply(&mut v, e);
                std::fs::write(&path, apply_text(&v.to_string(), t)).unwrap();
                Some(path)
            }
            FileEdit::Safetensors(f, e, b) => {
                let path = dir.0.join(f);
                let mut table = Table::read(&path);
                apply_tensor_edit(&mut table, e);
                std::fs::write(&path, apply_byte_edit(&table, b)).unwrap();
                Some(path)
            }
        };
        match DecisionModel::load(dir.0.join("kev-small"), &LoadOptions::default()) {
            Ok(model) => {
                for r in fixture_records() {
                    match model.probs(&r) {
                        Ok(probs) => {
                            prop_assert_eq!(probs.len(), r.questions.len());
                            for (p, q) in probs.iter().zip(&r.questions) {
                                prop_assert_eq!(p.len(), q.options.len());
                                prop_assert!(p.iter().all(|x| x.is_finite() && *x >= 0.0));
                                let sum: f32 = p.iter().sum();
                                prop_assert!((sum - 1.0).abs() < 1e-3, "{p:?}");
                            }
                        }
                        Err(e @ (Error::Record { .. } | Error::TooLong { .. })) => {
                            prop_assert!(edited.is_some(), "the shipped checkpoint refused a record: {e}");
                        }
                        Err(e @ Error::NonFinite { .. }) => {
                            prop_assert!(edited.is_some(), "the shipped checkpoint gave NaN: {e}");
                        }
                        Err(e) => return Err(TestCaseError::fail(format!("{e:?}"))),
                    }
                }
            }
            Err(e) => {
                prop_assert!(edited.is_some(), "the shipped checkpoint did not load: {e}");
                check_load_error(&e, &dir.0)?;
            }
        }
    }
}

/// A load failure names a file under `root` or a tensor (each of several faults does).
fn check_load_error(e: &Error, root: &Path) -> Result<(), TestCaseError> {
    let root = root.display().to_string();
    let msg = e.to_string();
    let names_file = msg.contains(&root);
    match e {
        Error::Several { errors } => {
            for e in errors {
                check_load_error(e, Path::new(&root))?;
            }
        }
        Error::Tensor { name, .. } => {
            // A tensor named "" (a valid safetensors key) is named by its file instead.
            prop_assert!(
                (!name.is_empty() || names_file) && msg.contains(name.as_str()),
                "{msg}"
            )
        }
        Error::Backend { context, .. } => {
            prop_assert!(names_file || context.contains('`'), "{msg}")
        }
        Error::Config { .. }
        | Error::Json { .. }
        | Error::Io { .. }
        | Error::MissingFile { .. }
        | Error::Adapter { .. }
        | Error::Tokenizer { .. }
        | Error::MissingMarker { .. } => {
            prop_assert!(names_file, "{msg} names no file of {root}");
        }
        other => {
            return Err(TestCaseError::fail(format!(
                "unexpected error kind: {other:?}"
            )))
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Bounded memory: numbers read from a file never size an allocation before they are checked
// ---------------------------------------------------------------------------------------------

/// The address space the bounded tests' children get: room for the test binary, its threads and
/// the small checkpoint, far from what the numbers below would allocate.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const LIMIT: u64 = 3 << 30;

/// Headers declaring a huge length, huge shapes or offsets fail without allocating by them, for
/// the head, the adapter and the base.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn huge_safetensors_numbers_fail_fast() {
    run_bounded("huge_safetensors_numbers_fail_fast", LIMIT, || {
        let dir = TempDir::new("huge-st");
        let head = Table::read(&fixture("kev-small/head.safetensors"));
        let mut bad: Vec<Vec<u8>> = Vec::new();
        for n in [1u64 << 40, u64::MAX, 100 << 20, (100 << 20) + 1] {
            bad.push(apply_byte_edit(&head, &ByteEdit::HeaderLen(n)));
        }
        for (shape, offsets) in [
            (json!([1u64 << 31, 1u64 << 31]), json!([0, 16])),
            (json!([u64::MAX, 2]), json!([0, 16])),
            (json!([16, 64]), json!([0, u64::MAX])),
            (json!([0, 1u64 << 62]), json!([0, 0])),
        ] {
            let mut h = head.header();
            h["q.weight"]["shape"] = shape;
            h["q.weight"]["data_offsets"] = offsets;
            bad.push(with_header(&h.to_string(), &head.data()));
        }
        for (i, bytes) in bad.iter().enumerate() {
            let path = dir.0.join(format!("{i}.safetensors"));
            std::fs::write(&path, bytes).unwrap();
            assert!(
                PointerHead::load(&path, 16, 64, 1.0, &Device::Cpu).is_err(),
                "case {i}"
            );
            assert!(
                Adapter::load(&fixture("kev-small/adapter/adapter_config.json"), &path).is_err()
            );
            assert!(Weights::open(
                std::slice::from_ref(&path),
                None,
                1.0,
                DType::F32,
                Device::Cpu
            )
            .is_err());
        }
    });
}

/// A copy of `kev-small` and its base in a temp folder (`root/kev-small`, `root/base-mm`), with
/// `edit` applied to the base's config.json text config.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn checkpoint_with_config(tag: &str, edit: impl FnOnce(&mut Value)) -> TempDir {
    let dir = TempDir::new(tag);
    copy_dir(&fixture("kev-small"), &dir.0.join("kev-small"));
    copy_dir(&fixture("base-mm"), &dir.0.join("base-mm"));
    let path = dir.0.join("base-mm/config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v["text_config"]);
    std::fs::write(&path, v.to_string()).unwrap();
    dir
}

/// `num_hidden_layers` = 2^40 (no `layer_types`, so the interval builds the list): refused
/// without a terabyte-long layer list.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn huge_layer_count_fails_fast() {
    run_bounded("huge_layer_count_fails_fast", LIMIT, || {
        let dir = checkpoint_with_config("layers", |t| {
            t.as_object_mut().unwrap().remove("layer_types");
            t["num_hidden_layers"] = json!(1u64 << 40);
        });
        let e = DecisionModel::load(dir.0.join("kev-small"), &LoadOptions::default())
            .err()
            .expect("2^40 layers cannot load");
        assert!(e.to_string().contains("num_hidden_layers"), "{e}");
    });
}

/// A base of DeltaNet layers only, its config stating `head_dim` = 2^40: no tensor checks
/// `head_dim` (only attention layers have it), so nothing may be sized by it.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn unchecked_head_dim_sizes_nothing() {
    run_bounded("unchecked_head_dim_sizes_nothing", LIMIT, || {
        let dir = checkpoint_with_config("headdim", |t| {
            t["num_hidden_layers"] = json!(3);
            t["layer_types"] = json!(vec!["linear_attention"; 3]);
            t["head_dim"] = json!(1u64 << 40);
        });
        // The first three layers (all DeltaNet) of the base, and no adapter (it has the others).
        let st = dir.0.join("base-mm/model.safetensors");
        let mut table = Table::read(&st);
        table.entries.retain(|e| {
            !(3..8).any(|l| {
                e.name
                    .starts_with(&format!("model.language_model.layers.{l}."))
            })
        });
        std::fs::write(&st, table.to_bytes()).unwrap();
        let kev = dir.0.join("kev-small/kev.json");
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&kev).unwrap()).unwrap();
        v.as_object_mut().unwrap().remove("adapter");
        std::fs::write(&kev, v.to_string()).unwrap();
        let model = DecisionModel::load(dir.0.join("kev-small"), &LoadOptions::default()).unwrap();
        for r in fixture_records() {
            model.probs(&r).unwrap();
        }
    });
}
