//! The native module of the `kev` Python package (`kev._kev`): [`kev::DecisionModel`] from
//! Python, with the contract of the Python runtime's `DecisionModel` (KEV.md §6).
//!
//! Records come in as dicts or JSON text and are checked by [`kev::Record::from_json_str`], so
//! every rule and message is the library's; its errors come out as the package's exception
//! classes (`python/kev/_errors.py`). Computing releases the GIL, so one model shared by several
//! Python threads scores in parallel.

mod errors;
mod model;
mod records;

use pyo3::prelude::*;

#[pymodule]
fn _kev(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<model::PyDecisionModel>()?;
    m.add_class::<model::PyPrefix>()?;
    m.add_class::<model::PyEncoding>()?;
    m.add_class::<model::PyPrefixCache>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
