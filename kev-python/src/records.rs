//! Records from Python: JSON text (`str`, or UTF-8 `bytes` as read from a file) or any object
//! `json.dumps` takes (a `dict` in the contract's schema). Everything goes through
//! [`kev::Record::from_json_str`], so the checks and their messages are the library's.

use kev::{Error, Record};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyString};

use crate::errors::OrRaise;

/// `json.dumps`, looked up once.
static DUMPS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// The JSON text of `obj`: itself for text, `json.dumps(obj)` otherwise. Bytes that are not
/// UTF-8, and objects that JSON cannot hold, are record errors worded as the library's reader
/// words them.
pub fn json_text(obj: &Bound<'_, PyAny>, line: Option<usize>) -> PyResult<String> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(s.to_cow()?.into_owned());
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return std::str::from_utf8(b.as_bytes())
            .map(str::to_owned)
            .map_err(|e| Error::record(line, None, "", format!("not valid UTF-8: {e}")))
            .or_raise();
    }
    let py = obj.py();
    let dumps = DUMPS.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        Ok(py.import("json")?.getattr("dumps")?.unbind())
    })?;
    match dumps.bind(py).call1((obj,)) {
        Ok(text) => Ok(text.cast_into::<PyString>()?.to_cow()?.into_owned()),
        Err(e) => {
            let why = e.value(py).str()?.to_cow()?.into_owned();
            Err(Error::record(
                line,
                None,
                "",
                format!("not valid JSON: {why}"),
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
