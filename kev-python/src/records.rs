//! Records from Python: JSON text (`str`, or UTF-8 `bytes` as read from a file) or any object
//! `json.dumps` takes (a `dict` in the contract's schema). Everything goes through
//! [`kev::Record::from_json_str`], so the checks and their messages are the library's.

use kev::{Error, Record};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyString};

use crate::errors::OrRaise;

/// `json.dumps` with its options for records (no NaN or infinity, numpy scalars as Python
/// numbers), looked up once.
static DUMPS: PyOnceLock<(Py<PyAny>, Py<PyDict>)> = PyOnceLock::new();

/// `json.dumps`'s `default`: a numpy scalar (an id or an answer taken from an array) is its
/// Python number; anything else JSON cannot hold is refused, naming its type.
#[pyfunction]
fn json_default(obj: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
    let py = obj.py();
    if obj.is_instance(&py.import("numpy")?.getattr("generic")?)? {
        return Ok(obj.call_method0("item")?.unbind());
    }
    Err(PyTypeError::new_err(format!(
        "a value of type `{}` is not a JSON value",
        obj.get_type().name()?
    )))
}

/// The JSON text of `obj`: itself for text, `json.dumps(obj)` otherwise. Text that is not
/// UTF-8 (bytes, or a str holding a lone surrogate), and objects that JSON cannot hold (NaN,
/// infinity, other types), are record errors worded as the library's reader words them.
pub fn json_text(obj: &Bound<'_, PyAny>, line: Option<usize>) -> PyResult<String> {
    let not_utf8 = |e: String| Error::record(line, None, "", format!("not valid UTF-8: {e}"));
    if let Ok(s) = obj.cast::<PyString>() {
        return match s.to_cow() {
            Ok(s) => Ok(s.into_owned()),
            Err(e) => Err(not_utf8(e.value(obj.py()).str()?.to_cow()?.into_owned())).or_raise(),
        };
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return std::str::from_utf8(b.as_bytes())
            .map(str::to_owned)
            .map_err(|e| not_utf8(e.to_string()))
            .or_raise();
    }
    let py = obj.py();
    let (dumps, options) = DUMPS.get_or_try_init(py, || -> PyResult<_> {
        let options = PyDict::new(py);
        options.set_item("allow_nan", false)?;
        options.set_item("default", wrap_pyfunction!(json_default, py)?)?;
        Ok((
            py.import("json")?.getattr("dumps")?.unbind(),
            options.unbind(),
        ))
    })?;
    match dumps.bind(py).call((obj,), Some(options.bind(py))) {
        Ok(text) => Ok(text.cast_into::<PyString>()?.to_cow()?.into_owned()),
        Err(e) => {
            let why = e.value(py).str()?.to_cow()?.into_owned();
            Err(Error::record(
                line,
                None,
                "",
                format!("not representable as JSON: {why}"),
            ))
            .or_raise()
        }
    }
}

/// One record, validated.
pub fn record(obj: &Bound<'_, PyAny>, line: Option<usize>) -> PyResult<Record> {
    Record::from_json_str(&json_text(obj, line)?, line).or_raise()
}

/// Every record of an iterable, validated (the first invalid one is the error). One record
/// given alone (text or a mapping) is refused, not iterated over.
pub fn records(objs: &Bound<'_, PyAny>) -> PyResult<Vec<Record>> {
    if objs.is_instance_of::<PyString>()
        || objs.is_instance_of::<PyBytes>()
        || objs.is_instance_of::<PyDict>()
    {
        return Err(PyTypeError::new_err(
            "expected a sequence of records, got a single record",
        ));
    }
    objs.try_iter()?.map(|obj| record(&obj?, None)).collect()
}
