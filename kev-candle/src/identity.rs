//! [`ModelId`]: which loaded model computed something, as a fingerprint cheap to compare.
//!
//! Two loads get the same id when they read the same files with the same numeric settings, so
//! they compute the same numbers: a [`crate::Prefix`] carries the id of the model that made it
//! and is refused by any other, and `score --resume` keeps it beside its partial output. The id
//! is the SHA-256 (first 16 bytes) of: the checkpoint folder's canonical path; the contents of
//! `kev.json`, the adapter config and the head file (small); for every other file read (base
//! config and weights, adapter weights, tokenizer) its canonical path, size and modification
//! time, so that a rewritten file changes it without hashing gigabytes at load; `lora_scale`; the
//! weights' and activations' dtypes; the device (its kind and index); `prefill_chunk`.

use std::fmt;
use std::path::Path;

use candle_core::{DType, Device};
use kev_core::{Checkpoint, LoadOptions};
use sha2::{Digest, Sha256};

/// The fingerprint of a loaded model (see the module docs); printed as 32 hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelId([u8; 16]);

impl fmt::Display for ModelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for ModelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ModelId({self})")
    }
}

/// What a model's numbers depend on, hashed.
pub(super) struct Fingerprint<'a> {
    pub checkpoint: &'a Checkpoint,
    pub options: &'a LoadOptions,
    pub weights_dtype: DType,
    pub activation_dtype: DType,
    pub device: &'a Device,
}

impl Fingerprint<'_> {
    pub(super) fn id(&self) -> ModelId {
        let mut h = Sha256::new();
        let mut field = |name: &str, bytes: &[u8]| {
            // Length-prefixed, so that no two sequences of fields hash alike.
            for part in [name.as_bytes(), bytes] {
                h.update((part.len() as u64).to_le_bytes());
                h.update(part);
            }
        };
        let ck = self.checkpoint;
        field("format", b"kev-model-id/1");
        field("dir", canonical(&ck.dir).as_bytes());
        let adapter_config = ck.adapter_config_path();
        let small = [
            Some(ck.dir.join("kev.json")),
            adapter_config.clone(),
            Some(ck.head_path.clone()),
        ];
        for path in small.iter().flatten() {
            field("path", canonical(path).as_bytes());
            field("contents", &std::fs::read(path).unwrap_or_default());
        }
        let large = ck
            .base
            .weights
            .iter()
            .chain([&ck.base.config, &ck.tokenizer])
            .cloned()
            .chain(ck.adapter_weights_path());
        for path in large {
            field("path", canonical(&path).as_bytes());
            field("stamp", &stamp(&path));
        }
        field("lora_scale", &self.options.lora_scale.to_le_bytes());
        field(
            "weights_dtype",
            format!("{:?}", self.weights_dtype).as_bytes(),
        );
        field(
            "activation_dtype",
            format!("{:?}", self.activation_dtype).as_bytes(),
        );
        field("device", format!("{:?}", self.device.location()).as_bytes());
        field(
            "prefill_chunk",
            &(self.options.prefill_chunk as u64).to_le_bytes(),
        );
        let digest = h.finalize();
        let mut id = [0; 16];
        id.copy_from_slice(&digest[..16]);
        ModelId(id)
    }
}

/// The canonical path where it resolves (symlinks and `..` followed), else the path as given.
fn canonical(path: &Path) -> String {
    std::fs::canonicalize(path)
        .unwrap_or_else(|_| path.to_path_buf())
        .to_string_lossy()
        .into_owned()
}

/// A file's size and modification time in nanoseconds (zeros where unreadable: the load has
/// just read it).
fn stamp(path: &Path) -> [u8; 24] {
    let meta = std::fs::metadata(path).ok();
    let len = meta.as_ref().map_or(0, |m| m.len());
    let modified = meta
        .and_then(|m| m.modified().ok())
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let mut out = [0; 24];
    out[..8].copy_from_slice(&len.to_le_bytes());
    out[8..].copy_from_slice(&modified.to_le_bytes());
    out
}
