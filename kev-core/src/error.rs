//! The one error type of the Kev runtime.
//!
//! Every variant carries a payload that locates the fault (a path, a record line and field, a tensor
//! key) so a user can fix the input without a debugger. Messages are lowercase with names in
//! backticks. Variants that wrap another error (`Io`, `Json`, `Backend`) expose it through
//! [`std::error::Error::source`] and do not repeat it in their own message: print the whole chain
//! (`{:#}` with `anyhow`, or walk `source()`) to see it.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// `Result` with the crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong while reading Kev inputs, loading a checkpoint or running a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file or stream could not be read; `path` is the file (or the name given to a stream).
    #[error("cannot read `{}`", path.display())]
    Io {
        /// The file or stream that failed.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },

    /// A JSON file (`kev.json`, `adapter_config.json`, `config.json`, an index) is not valid JSON.
    #[error("`{}` is not valid JSON", path.display())]
    Json {
        /// The file that does not parse.
        path: PathBuf,
        /// The parser's error (it gives the line and column).
        source: serde_json::Error,
    },

    /// A configuration value is missing, ill-typed, out of range or unsupported.
    #[error("`{}`: field `{field}`: {message}", path.display())]
    Config {
        /// The configuration file.
        path: PathBuf,
        /// The dotted path of the field inside the file (`head.dim`, `template.option`).
        field: String,
        /// What is wrong with it.
        message: String,
    },

    /// A record is not valid (docs/CONTRACT.md §1).
    ///
    /// Displayed as ``record at line 7 (`r17`): field `questions[1].options`: must not be empty``;
    /// the line is left out for records built in code, the id when it could not be read, and the
    /// field when the fault concerns the record as a whole (`field` is then empty).
    #[error("{}", record_prefix(.line, .id, .field, .message))]
    Record {
        /// 1-based line in the JSONL input, `None` for a record that did not come from a file.
        line: Option<usize>,
        /// The record's `id`, when it could be read.
        id: Option<String>,
        /// The field path inside the record (`questions[1].options[2]`), empty for the whole record.
        field: String,
        /// What is wrong with it.
        message: String,
    },

    /// A record's state plus its longest branch is longer than `max_tokens` (records are never
    /// truncated).
    #[error(
        "{}",
        record_prefix(
            .line,
            .id,
            .counted_in.as_deref().unwrap_or(""),
            &match .counted_in {
                None => format!("state plus longest branch is {} tokens, more than `max_tokens` = {}", .tokens, .max_tokens),
                Some(_) => format!("has at least {} tokens alone, more than `max_tokens` = {}", .tokens, .max_tokens),
            }
        )
    )]
    TooLong {
        /// 1-based line in the JSONL input, `None` for a record built in code.
        line: Option<usize>,
        /// The record's `id`, if any.
        id: Option<String>,
        /// Tokens needed: state length plus the longest branch; with `counted_in`, a lower bound.
        tokens: usize,
        /// The checkpoint's `max_tokens`.
        max_tokens: usize,
        /// The field whose count stopped as soon as it passed `max_tokens` (a long text is not
        /// tokenized whole just to be refused): `tokens` is that field's count so far.
        counted_in: Option<String>,
    },

    /// A file the runtime needs is not there (a checkpoint file, a base file not in the Hugging Face
    /// cache); `hint` says how to get it.
    #[error("missing file `{}`: {hint}", path.display())]
    MissingFile {
        /// The file that was looked for.
        path: PathBuf,
        /// How to provide it (for the Hub: the `hf download ...` command).
        hint: String,
    },

    /// The tokenizer could not be loaded or failed to encode a text.
    #[error("tokenizer{}: {message}", opt_path(.path))]
    Tokenizer {
        /// The `tokenizer.json` involved, when known.
        path: Option<PathBuf>,
        /// The tokenizer's message.
        message: String,
    },

    /// A marker string of `kev.json` (`option_marker`, `decide_marker`) is not a single token of
    /// the tokenizer.
    #[error(
        "marker `{marker}` is not a single token of the tokenizer `{}` (it must be an added or special token)",
        path.display()
    )]
    MissingMarker {
        /// The marker string.
        marker: String,
        /// The tokenizer file.
        path: PathBuf,
    },

    /// A weight, adapter or head tensor is missing, mis-shaped or unknown.
    #[error("tensor `{name}`: {message}")]
    Tensor {
        /// The tensor's key in its safetensors file.
        name: String,
        /// What is wrong with it.
        message: String,
    },

    /// A LoRA adapter cannot be used (beyond a malformed `adapter_config.json`, which is a
    /// [`Error::Config`]).
    #[error("adapter `{}`: {message}", path.display())]
    Adapter {
        /// The adapter folder or file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },

    /// A prefix was used with a record whose state differs from the prefix's state.
    #[error("prefix: {message}")]
    Prefix {
        /// What does not match.
        message: String,
    },

    /// The requested device is not built into this binary or not available on this machine.
    #[error("device: {message}")]
    Device {
        /// Which device and why.
        message: String,
    },

    /// An error of the tensor backend (candle), with what the runtime was doing.
    #[error("{context}")]
    Backend {
        /// What was being done (the layer, the tensor key, the step).
        context: String,
        /// The backend's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// The model's probabilities for a record are not finite (NaN or infinity in the weights or
    /// the activations): an error, never output.
    #[error(
        "record{} at batch index {index}: question {question}: the model's probabilities are not finite (NaN or infinity in the weights or activations)",
        .id.as_ref().map(|i| format!(" `{i}`")).unwrap_or_default()
    )]
    NonFinite {
        /// The record's `id`, if any.
        id: Option<String>,
        /// The record's index in the call (0 for a one-record call).
        index: usize,
        /// The question whose probabilities are not finite.
        question: usize,
    },

    /// Several faults found together: a loader reports every problem it finds, in a fixed order,
    /// so that one run shows everything to fix.
    #[error("{} problems:{}", .errors.len(), list_errors(.errors))]
    Several {
        /// The faults, in the order found (sorted by what they name).
        errors: Vec<Error>,
    },

    /// An argument given in code or on a command line is invalid.
    #[error("invalid argument `{name}`: {message}")]
    InvalidArgument {
        /// The argument's name.
        name: String,
        /// Why it is invalid.
        message: String,
    },
}

impl Error {
    /// An [`Error::Record`].
    pub fn record(
        line: Option<usize>,
        id: Option<&str>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Error::Record {
            line,
            id: id.map(str::to_owned),
            field: field.into(),
            message: message.into(),
        }
    }

    /// An [`Error::Config`].
    pub fn config(path: &Path, field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Config {
            path: path.to_path_buf(),
            field: field.into(),
            message: message.into(),
        }
    }

    /// An [`Error::Io`].
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        Error::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    /// An [`Error::Backend`] wrapping `source` with `context`.
    pub fn backend(
        context: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Error::Backend {
            context: context.into(),
            source: source.into(),
        }
    }

    /// An [`Error::InvalidArgument`].
    pub fn invalid_argument(name: impl Into<String>, message: impl Into<String>) -> Self {
        Error::InvalidArgument {
            name: name.into(),
            message: message.into(),
        }
    }
}

impl Error {
    /// `Ok` for no faults, the fault itself for one, [`Error::Several`] for more.
    pub fn from_all(mut errors: Vec<Error>) -> Result<()> {
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.remove(0)),
            _ => Err(Error::Several { errors }),
        }
    }
}

fn list_errors(errors: &[Error]) -> String {
    let mut s = String::new();
    for (i, e) in errors.iter().enumerate() {
        let _ = write!(s, "\n  {}. {e}", i + 1);
    }
    s
}

/// "record at line 7 (`r17`): field `f`: message", leaving out what is unknown.
fn record_prefix(line: &Option<usize>, id: &Option<String>, field: &str, message: &str) -> String {
    let mut s = String::from("record");
    if let Some(line) = line {
        let _ = write!(s, " at line {line}");
    }
    if let Some(id) = id {
        let _ = write!(s, " (`{id}`)");
    }
    if !field.is_empty() {
        let _ = write!(s, ": field `{field}`");
    }
    let _ = write!(s, ": {message}");
    s
}

fn opt_path(path: &Option<PathBuf>) -> String {
    match path {
        Some(p) => format!(" `{}`", p.display()),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn record_display_names_line_id_and_field() {
        let e = Error::record(
            Some(7),
            Some("r17"),
            "questions[1].options",
            "must not be empty",
        );
        assert_eq!(
            e.to_string(),
            "record at line 7 (`r17`): field `questions[1].options`: must not be empty"
        );
        let e = Error::record(None, Some("r17"), "state", "must be a string");
        assert_eq!(
            e.to_string(),
            "record (`r17`): field `state`: must be a string"
        );
        let e = Error::record(Some(3), None, "", "not valid JSON");
        assert_eq!(e.to_string(), "record at line 3: not valid JSON");
    }

    #[test]
    fn too_long_display() {
        let e = Error::TooLong {
            line: Some(2),
            id: Some("a".into()),
            tokens: 10,
            max_tokens: 8,
            counted_in: None,
        };
        assert_eq!(
            e.to_string(),
            "record at line 2 (`a`): state plus longest branch is 10 tokens, more than `max_tokens` = 8"
        );
        let e = Error::TooLong {
            line: None,
            id: Some("a".into()),
            tokens: 9,
            max_tokens: 8,
            counted_in: Some("state".into()),
        };
        assert_eq!(
            e.to_string(),
            "record (`a`): field `state`: has at least 9 tokens alone, more than `max_tokens` = 8"
        );
    }

    #[test]
    fn several_lists_every_fault_in_order() {
        assert!(Error::from_all(vec![]).is_ok());
        let one = Error::from_all(vec![Error::invalid_argument("a", "x")]).unwrap_err();
        assert_eq!(one.to_string(), "invalid argument `a`: x");
        let two = Error::from_all(vec![
            Error::invalid_argument("a", "x"),
            Error::invalid_argument("b", "y"),
        ])
        .unwrap_err();
        assert_eq!(
            two.to_string(),
            "2 problems:\n  1. invalid argument `a`: x\n  2. invalid argument `b`: y"
        );
    }

    #[test]
    fn sources_are_chained_not_repeated() {
        let e = Error::io(
            Path::new("x.jsonl"),
            std::io::Error::new(std::io::ErrorKind::NotFound, "gone"),
        );
        assert_eq!(e.to_string(), "cannot read `x.jsonl`");
        assert_eq!(e.source().map(|s| s.to_string()).as_deref(), Some("gone"));
        let e = Error::backend("layer 3", "bad shape");
        assert_eq!(e.to_string(), "layer 3");
        assert!(e.source().is_some());
    }

    #[test]
    fn tokenizer_display_with_and_without_path() {
        let e = Error::Tokenizer {
            path: Some("t.json".into()),
            message: "boom".into(),
        };
        assert_eq!(e.to_string(), "tokenizer `t.json`: boom");
        let e = Error::Tokenizer {
            path: None,
            message: "boom".into(),
        };
        assert_eq!(e.to_string(), "tokenizer: boom");
    }
}
