//! [`kev::Error`] as the package's exception classes (defined in `python/kev/_errors.py`, so
//! that they can subclass both `kev.KevError` and the built-in class that fits).

use pyo3::exceptions::PyBaseException;
use pyo3::prelude::*;
use pyo3::{import_exception, IntoPyObject};

import_exception!(kev, KevError);
import_exception!(kev, RecordError);
import_exception!(kev, TooLongError);
import_exception!(kev, PrefixError);
import_exception!(kev, ConfigError);
import_exception!(kev, ArgumentError);
import_exception!(kev, CheckpointError);
import_exception!(kev, DeviceError);
import_exception!(kev, BackendError);

/// The error's message followed by its sources', joined by `": "` (what anyhow's `{:#}`, and so
/// the `score` example, prints): the library's `Display` leaves the sources out.
pub fn message(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// The Python exception for `e`, with what locates the fault as attributes (`line`,
/// `record_id`, `field`, `path`, `name`, ...; the classes default them to `None`).
pub fn to_py(e: kev::Error) -> PyErr {
    use kev::Error as E;
    let msg = message(&e);
    Python::attach(|py| {
        let err = match &e {
            E::Record { .. } => RecordError::new_err(msg),
            E::TooLong { .. } => TooLongError::new_err(msg),
            E::Prefix { .. } => PrefixError::new_err(msg),
            E::Config { .. } | E::Json { .. } | E::MissingMarker { .. } => {
                ConfigError::new_err(msg)
            }
            E::InvalidArgument { .. } => ArgumentError::new_err(msg),
            E::Io { .. }
            | E::MissingFile { .. }
            | E::Tensor { .. }
            | E::Adapter { .. }
            | E::Tokenizer { .. } => CheckpointError::new_err(msg),
            E::Device { .. } => DeviceError::new_err(msg),
            E::Backend { .. } => BackendError::new_err(msg),
            _ => KevError::new_err(msg),
        };
        let value = err.value(py);
        let result = match &e {
            E::Record {
                line, id, field, ..
            } => set(value, "line", line)
                .and_then(|_| set(value, "record_id", id))
                .and_then(|_| set(value, "field", (!field.is_empty()).then_some(field))),
            E::TooLong {
                line,
                id,
                tokens,
                max_tokens,
                ..
            } => set(value, "line", line)
                .and_then(|_| set(value, "record_id", id))
                .and_then(|_| set(value, "tokens", tokens))
                .and_then(|_| set(value, "max_tokens", max_tokens)),
            E::Config { path, field, .. } => {
                set(value, "path", shown(path)).and_then(|_| set(value, "field", field))
            }
            E::Io { path, .. }
            | E::Json { path, .. }
            | E::MissingFile { path, .. }
            | E::Adapter { path, .. } => set(value, "path", shown(path)),
            E::MissingMarker { path, marker } => {
                set(value, "path", shown(path)).and_then(|_| set(value, "marker", marker))
            }
            E::Tokenizer { path, .. } => set(value, "path", path.as_deref().map(shown)),
            E::Tensor { name, .. } | E::InvalidArgument { name, .. } => set(value, "name", name),
            _ => Ok(()),
        };
        match result {
            Ok(()) => err,
            Err(failed) => failed,
        }
    })
}

/// A path as the message shows it.
fn shown(path: &std::path::Path) -> String {
    path.display().to_string()
}

fn set<'py, T>(value: &Bound<'py, PyBaseException>, name: &str, v: T) -> PyResult<()>
where
    T: IntoPyObject<'py>,
{
    value.setattr(name, v)
}

/// `?` on a library result inside a method: the package's exception.
pub trait OrRaise<T> {
    /// The value, or `e` as its Python exception.
    fn or_raise(self) -> PyResult<T>;
}

impl<T> OrRaise<T> for kev::Result<T> {
    fn or_raise(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
