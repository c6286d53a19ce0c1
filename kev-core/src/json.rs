//! Strict JSON parsing and hand validation of JSON values, shared by records and configuration
//! files.
//!
//! Parsing into [`serde_json::Value`] first and checking each field by hand gives errors that name the
//! exact field path (`questions[1].options[2]`, `head.dim`), which serde's derived `Deserialize`
//! does not. Each check returns a [`FieldError`]; the caller turns it into [`crate::Error::Record`]
//! or [`crate::Error::Config`].

use crate::Error;
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Parses JSON text strictly: a leading UTF-8 byte order mark is skipped, and a key that appears
/// twice in one object is an error (serde_json keeps the last one silently, so a misspelt override
/// would change numbers without a word). serde_json's nesting limit (128) bounds the recursion.
pub fn parse_strict(text: &str) -> std::result::Result<Value, serde_json::Error> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut de = serde_json::Deserializer::from_str(text);
    let StrictValue(value) = StrictValue::deserialize(&mut de)?;
    de.end()?;
    Ok(value)
}

/// Reads a JSON file strictly ([`parse_strict`]): [`Error::Io`] when it cannot be read,
/// [`Error::Json`] when it does not parse or repeats a key.
pub fn read_json_file(path: &std::path::Path) -> crate::Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    parse_json_text(&text, path)
}

/// [`parse_strict`] with `path` named in the [`Error::Json`].
pub fn parse_json_text(text: &str, path: &std::path::Path) -> crate::Result<Value> {
    parse_strict(text).map_err(|source| Error::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// serde_json's message without its trailing `at line L column C` (for callers that give the
/// position themselves, such as a record line, which is always line 1 of its own text).
pub(crate) fn message_without_position(e: &serde_json::Error) -> String {
    let full = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    full.strip_suffix(&suffix).unwrap_or(&full).to_owned()
}

/// A [`Value`] built by a visitor that refuses duplicate keys.
struct StrictValue(Value);

impl<'de> Deserialize<'de> for StrictValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(StrictValue)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, b: bool) -> std::result::Result<Value, E> {
        Ok(Value::Bool(b))
    }
    fn visit_i64<E>(self, n: i64) -> std::result::Result<Value, E> {
        Ok(Value::Number(n.into()))
    }
    fn visit_u64<E>(self, n: u64) -> std::result::Result<Value, E> {
        Ok(Value::Number(n.into()))
    }
    fn visit_f64<E: de::Error>(self, x: f64) -> std::result::Result<Value, E> {
        Number::from_f64(x)
            .map(Value::Number)
            .ok_or_else(|| E::custom("number is not finite"))
    }
    fn visit_str<E>(self, s: &str) -> std::result::Result<Value, E> {
        Ok(Value::String(s.to_owned()))
    }
    fn visit_string<E>(self, s: String) -> std::result::Result<Value, E> {
        Ok(Value::String(s))
    }
    fn visit_unit<E>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(StrictValue(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Value, A::Error> {
        let mut obj = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if obj.contains_key(&key) {
                return Err(de::Error::custom(format!("duplicate key `{key}`")));
            }
            let StrictValue(v) = map.next_value()?;
            obj.insert(key, v);
        }
        Ok(Value::Object(obj))
    }
}

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
    fn strict_parse_refuses_duplicate_keys_at_any_depth() {
        let e = parse_strict(r#"{"a": 1, "a": 2}"#).unwrap_err();
        assert!(e.to_string().contains("duplicate key `a`"), "{e}");
        let e = parse_strict(r#"{"q": [{"x": {"b": 1, "b": 1}}]}"#).unwrap_err();
        assert!(e.to_string().contains("duplicate key `b`"), "{e}");
        assert_eq!(
            parse_strict(r#"{"a": {"a": 1}, "b": [1, 2.5, null, true, "s"]}"#).unwrap(),
            json!({"a": {"a": 1}, "b": [1, 2.5, null, true, "s"]})
        );
    }

    #[test]
    fn strict_parse_skips_a_bom_and_refuses_trailing_text() {
        assert_eq!(parse_strict("\u{feff}{\"a\": 1}").unwrap(), json!({"a": 1}));
        assert!(parse_strict(r#"{"a": 1} x"#).is_err());
        assert!(parse_strict(&"[".repeat(200)).is_err());
    }

    #[test]
    fn message_without_position_drops_only_the_position() {
        let e = parse_strict("{\"a\": }").unwrap_err();
        let m = message_without_position(&e);
        assert!(!m.contains("line"), "{m}");
        assert!(e.to_string().starts_with(&m));
    }

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
