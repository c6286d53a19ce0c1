//! Hand validation of JSON values, shared by records and configuration files.
//!
//! Parsing into [`serde_json::Value`] first and checking each field by hand gives errors that name the
//! exact field path (`questions[1].options[2]`, `head.dim`), which serde's derived `Deserialize`
//! does not. Each check returns a [`FieldError`]; the caller turns it into [`crate::Error::Record`]
//! or [`crate::Error::Config`].

use serde_json::{Map, Value};

/// A fault in one field: its path and what is wrong.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct FieldError {
    pub field: String,
    pub message: String,
}

pub(crate) type FieldResult<T> = std::result::Result<T, FieldError>;

pub(crate) fn fault(field: impl Into<String>, message: impl Into<String>) -> FieldError {
    FieldError {
        field: field.into(),
        message: message.into(),
    }
}

/// JSON type name for messages ("found a number").
pub(crate) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// `prefix.key`, or `key` at the top level.
pub(crate) fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_owned()
    } else {
        format!("{prefix}.{key}")
    }
}

/// Errors on the first key of `obj` not in `allowed`.
pub(crate) fn deny_unknown(
    obj: &Map<String, Value>,
    allowed: &[&str],
    prefix: &str,
) -> FieldResult<()> {
    match obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(fault(
            join(prefix, k),
            format!(
                "unknown field (expected one of {})",
                allowed
                    .iter()
                    .map(|a| format!("`{a}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
        None => Ok(()),
    }
}

/// The value as an object.
pub(crate) fn as_object<'a>(v: &'a Value, field: &str) -> FieldResult<&'a Map<String, Value>> {
    v.as_object()
        .ok_or_else(|| fault(field, format!("must be an object, found {}", type_name(v))))
}

/// A required string.
pub(crate) fn req_str<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    prefix: &str,
) -> FieldResult<&'a str> {
    match obj.get(key) {
        None => Err(fault(join(prefix, key), "missing (a string is required)")),
        Some(v) => v.as_str().ok_or_else(|| {
            fault(
                join(prefix, key),
                format!("must be a string, found {}", type_name(v)),
            )
        }),
    }
}

/// An optional string; absent and `null` are `None`.
pub(crate) fn opt_str<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    prefix: &str,
) -> FieldResult<Option<&'a str>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(fault(
            join(prefix, key),
            format!("must be a string or null, found {}", type_name(v)),
        )),
    }
}

/// An optional non-negative integer; absent and `null` are `None`.
pub(crate) fn opt_usize(
    obj: &Map<String, Value>,
    key: &str,
    prefix: &str,
) -> FieldResult<Option<usize>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => as_usize(v, &join(prefix, key)).map(Some),
    }
}

/// A non-negative integer that fits `usize`.
pub(crate) fn as_usize(v: &Value, field: &str) -> FieldResult<usize> {
    v.as_u64()
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| {
            fault(
                field,
                format!("must be a non-negative integer, found {}", show(v)),
            )
        })
}

/// An optional number; absent and `null` are `None`.
pub(crate) fn opt_f64(
    obj: &Map<String, Value>,
    key: &str,
    prefix: &str,
) -> FieldResult<Option<f64>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| {
            fault(
                join(prefix, key),
                format!("must be a number, found {}", type_name(v)),
            )
        }),
    }
}

/// An optional boolean; absent and `null` are `None`.
pub(crate) fn opt_bool(
    obj: &Map<String, Value>,
    key: &str,
    prefix: &str,
) -> FieldResult<Option<bool>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(fault(
            join(prefix, key),
            format!("must be a boolean, found {}", type_name(v)),
        )),
    }
}

/// A short rendering of a value for messages: numbers and short strings verbatim, else the type.
pub(crate) fn show(v: &Value) -> String {
    match v {
        Value::Number(n) => n.to_string(),
        Value::String(s) if s.chars().count() <= 40 => format!("{s:?}"),
        _ => type_name(v).to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn helpers_name_the_field() {
        let v = json!({"a": 1, "b": "x", "c": -1, "d": 1.5});
        let o = v.as_object().unwrap();
        assert_eq!(req_str(o, "b", "p").unwrap(), "x");
        assert_eq!(req_str(o, "a", "p").unwrap_err().field, "p.a");
        assert_eq!(req_str(o, "z", "").unwrap_err().field, "z");
        assert_eq!(opt_usize(o, "a", "").unwrap(), Some(1));
        assert!(opt_usize(o, "c", "").unwrap_err().message.contains("-1"));
        assert!(opt_usize(o, "d", "").is_err());
        assert_eq!(opt_f64(o, "d", "").unwrap(), Some(1.5));
        let e = deny_unknown(o, &["a", "b", "c"], "top").unwrap_err();
        assert_eq!(e.field, "top.d");
    }
}
