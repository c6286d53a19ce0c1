//! The error of the scoring pipeline: the runtime's [`kev::Error`](crate::Error) for inputs and
//! the model, plus what only a run that writes its output can hit.

use std::path::PathBuf;

/// What can stop [`score`](super::score) or an [`Output`](super::Output).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ScoreError {
    /// An input, record, checkpoint or model error of the runtime (a record error names its
    /// line).
    #[error(transparent)]
    Kev(#[from] kev_core::Error),

    /// The model failed on a batch of (already validated) records.
    #[error("scoring the records at lines {first_line}..={last_line}")]
    Batch {
        /// Input line of the batch's first record.
        first_line: usize,
        /// Input line of the batch's last record.
        last_line: usize,
        /// The model's error.
        #[source]
        source: kev_core::Error,
    },

    /// The output could not be opened, written, synced or renamed into place. `target` is the
    /// `--out` as given (`-` for stdout); `step` says what was being done.
    #[error("cannot write `{}`: {step}", target.display())]
    Output {
        /// The output as given.
        target: PathBuf,
        /// What was being done (`creating `.out.jsonl.partial``, `renaming ...`, `writing`).
        step: String,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },

    /// An input that can be read only once (stdin, a FIFO) could not be copied for the second
    /// pass.
    #[error("cannot copy `{}` for the scoring pass into `{}`", input.display(), dir.display())]
    Spool {
        /// The input as given.
        input: PathBuf,
        /// The folder of the copy (the system's temporary folder).
        dir: PathBuf,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },

    /// The model returned a probability that is NaN or infinite; it is never written.
    #[error(
        "record at line {line}{}: question {question}: the model returned a non-finite probability ({value})",
        id.as_ref().map(|i| format!(" (`{i}`)")).unwrap_or_default()
    )]
    NonFinite {
        /// Input line of the record.
        line: usize,
        /// The record's id, if any.
        id: Option<String>,
        /// 0-based question index.
        question: usize,
        /// The offending value.
        value: f32,
    },

    /// The model returned a result of the wrong shape (a record or question missing, or a
    /// distribution whose length is not the question's option count).
    #[error("record at line {line}: the model returned {message}")]
    Shape {
        /// Input line of the record.
        line: usize,
        /// What does not match.
        message: String,
    },

    /// `--resume` cannot continue from the partial output: it does not hold this input's first
    /// records, or the target cannot be resumed.
    #[error("cannot resume `{}`: {message}", partial.display())]
    Resume {
        /// The partial output (or the target when it cannot be resumed at all).
        partial: PathBuf,
        /// Why.
        message: String,
    },

    /// A thread of the scoring pass (the reader that parses and encodes batches ahead of the
    /// model, or the writer that formats and writes them) panicked or could not start: reported
    /// as an error rather than a hang or an abort. The lines written before it stay in the
    /// partial file.
    #[error("the {thread} thread of the scoring pass failed: {message}")]
    Worker {
        /// `reader` or `writer`.
        thread: &'static str,
        /// What happened (`it panicked: ...`, `it could not start: ...`).
        message: String,
    },

    /// The input changed between the validation pass and the scoring pass.
    #[error("`{}` changed while it was being scored: {message}", input.display())]
    InputChanged {
        /// The input as given.
        input: PathBuf,
        /// What differed.
        message: String,
    },
}

impl ScoreError {
    pub(crate) fn output(
        target: impl Into<PathBuf>,
        step: impl Into<String>,
        source: std::io::Error,
    ) -> Self {
        ScoreError::Output {
            target: target.into(),
            step: step.into(),
            source,
        }
    }

    /// True for a write to stdout that failed because the reader closed the pipe.
    pub fn is_broken_pipe(&self) -> bool {
        matches!(self, ScoreError::Output { source, .. } if source.kind() == std::io::ErrorKind::BrokenPipe)
    }
}
