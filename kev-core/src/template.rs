//! The prompt template of `kev.json` (docs/CONTRACT.md §4) and its Python `str.format` semantics.
//!
//! Each template string has exactly one named field (`{state}`, `{prompt}`, `{option}`) and the
//! escapes `{{` and `}}`, as the Python runtime used them with `str.format`. Anything else
//! (another field, a positional `{}`, a format spec `{state:>4}` or conversion `{state!r}`, a lone
//! brace) is refused when the template is validated, so formatting itself cannot fail.

use std::path::Path;

use crate::error::{Error, Result};

/// The text around each piece of a record, and the two marker tokens.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Template {
    /// Wraps the state; one field, `{state}`. Example: `"<|im_start|>user\n{state}\n"`.
    pub state: String,
    /// Wraps each question's prompt; one field, `{prompt}`.
    pub question: String,
    /// Wraps each option; one field, `{option}`. The option marker follows it.
    pub option: String,
    /// The option marker, a single added token (`<|kev_option|>`), placed after each option.
    pub option_marker: String,
    /// The decide marker, a single added token (`<|kev_decide|>`), closing each branch.
    pub decide_marker: String,
}

/// One parsed piece of a template string.
#[derive(Debug, PartialEq)]
enum Part<'a> {
    Literal(&'a str),
    /// An escaped brace, `{{` or `}}`, giving this character.
    Brace(char),
    Field(&'a str),
}

/// Splits a `str.format` string into parts; `Err` describes the first syntax error.
fn parse(s: &str) -> std::result::Result<Vec<Part<'_>>, String> {
    let mut parts = Vec::new();
    let bytes = s.as_bytes();
    let (mut i, mut lit_start) = (0, 0);
    while i < bytes.len() {
        match bytes[i] {
            b'{' | b'}' if bytes.get(i + 1) == Some(&bytes[i]) => {
                if lit_start < i {
                    parts.push(Part::Literal(&s[lit_start..i]));
                }
                parts.push(Part::Brace(bytes[i] as char));
                i += 2;
                lit_start = i;
            }
            b'{' => {
                if lit_start < i {
                    parts.push(Part::Literal(&s[lit_start..i]));
                }
                let rest = &s[i + 1..];
                let Some(end) = rest.find(['}', '{']) else {
                    return Err(format!("unmatched `{{` at byte {i}"));
                };
                if rest.as_bytes()[end] == b'{' {
                    return Err(format!(
                        "unmatched `{{` at byte {i} (nested braces are not supported)"
                    ));
                }
                parts.push(Part::Field(&rest[..end]));
                i += end + 2;
                lit_start = i;
            }
            b'}' => {
                return Err(format!(
                    "single `}}` at byte {i} (write `}}}}` for a literal brace)"
                ))
            }
            _ => i += 1,
        }
    }
    if lit_start < bytes.len() {
        parts.push(Part::Literal(&s[lit_start..]));
    }
    Ok(parts)
}

/// Checks that `s` parses and has no field but `name`.
fn check_one(s: &str, name: &str) -> std::result::Result<(), String> {
    for part in parse(s)? {
        if let Part::Field(f) = part {
            if f != name {
                return Err(format!(
                    "unsupported replacement field `{{{f}}}`: only `{{{name}}}` is allowed (with `{{{{` and `}}}}` for literal braces)"
                ));
            }
        }
    }
    Ok(())
}

/// Formats `s` with `{name}` replaced by `value`, like Python's `s.format(name=value)`.
///
/// On a template that [`Template::validate`] would refuse, unknown fields and lone braces are
/// copied literally instead of failing.
fn format_one(s: &str, name: &str, value: &str) -> String {
    let Ok(parts) = parse(s) else {
        return s
            .replace("{{", "{")
            .replace("}}", "}")
            .replace(&format!("{{{name}}}"), value);
    };
    let mut out = String::with_capacity(s.len() + value.len());
    for part in parts {
        match part {
            Part::Literal(l) => out.push_str(l),
            Part::Brace(c) => out.push(c),
            Part::Field(f) if f == name => out.push_str(value),
            Part::Field(f) => {
                out.push('{');
                out.push_str(f);
                out.push('}');
            }
        }
    }
    out
}

impl Template {
    /// `state.format(state=state)`.
    pub fn format_state(&self, state: &str) -> String {
        format_one(&self.state, "state", state)
    }

    /// `question.format(prompt=prompt)`.
    pub fn format_question(&self, prompt: &str) -> String {
        format_one(&self.question, "prompt", prompt)
    }

    /// `option.format(option=option)`.
    pub fn format_option(&self, option: &str) -> String {
        format_one(&self.option, "option", option)
    }

    /// Checks the template; `path` (the `kev.json`) is named in the error.
    ///
    /// Refuses, as [`Error::Config`] with field `template.<name>`: a replacement field other than
    /// the one allowed, unbalanced braces, an empty marker, equal markers, and a marker string
    /// inside a text template (it would put a marker token at a wrong position). A template may
    /// leave out its field, as Python allows; the piece is then constant.
    pub fn validate(&self, path: &Path) -> Result<()> {
        self.check()
            .map_err(|(field, message)| Error::config(path, field, message))
    }

    /// The checks of [`Template::validate`], returning `(field, message)`.
    pub(crate) fn check(&self) -> std::result::Result<(), (String, String)> {
        let texts = [
            ("template.state", &self.state, "state"),
            ("template.question", &self.question, "prompt"),
            ("template.option", &self.option, "option"),
        ];
        for (field, text, name) in texts {
            check_one(text, name).map_err(|m| (field.to_owned(), m))?;
        }
        for (field, marker) in [
            ("template.option_marker", &self.option_marker),
            ("template.decide_marker", &self.decide_marker),
        ] {
            if marker.is_empty() {
                return Err((field.to_owned(), "must not be empty".to_owned()));
            }
            for (tfield, text, _) in texts {
                if text.contains(marker.as_str()) {
                    return Err((
                        tfield.to_owned(),
                        format!(
                            "contains the marker `{marker}`; markers are placed by the encoder"
                        ),
                    ));
                }
            }
        }
        if self.option_marker == self.decide_marker {
            return Err((
                "template.decide_marker".to_owned(),
                "must differ from `option_marker`".to_owned(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template() -> Template {
        Template {
            state: "<|im_start|>user\n{state}\n".into(),
            question: "{prompt}\n".into(),
            option: "- {option}".into(),
            option_marker: "<|kev_option|>".into(),
            decide_marker: "<|kev_decide|>".into(),
        }
    }

    #[test]
    fn formats_like_python() {
        let t = template();
        t.validate(Path::new("kev.json")).unwrap();
        assert_eq!(t.format_state("hi"), "<|im_start|>user\nhi\n");
        assert_eq!(t.format_state(""), "<|im_start|>user\n\n");
        assert_eq!(t.format_question("Which?"), "Which?\n");
        assert_eq!(t.format_option("a"), "- a");
        // The value is inserted verbatim: braces in it are not template syntax.
        assert_eq!(t.format_option("{x} }}"), "- {x} }}");
    }

    #[test]
    fn escapes() {
        let t = Template {
            state: "{{json}}: {state} {{{state}}}".into(),
            ..template()
        };
        t.validate(Path::new("kev.json")).unwrap();
        // Python: "{{json}}: {state} {{{state}}}".format(state="s") == "{json}: s {s}"
        assert_eq!(t.format_state("s"), "{json}: s {s}");
        let t = Template {
            option: "}}{{".into(),
            ..template()
        };
        t.validate(Path::new("kev.json")).unwrap();
        assert_eq!(t.format_option("x"), "}{");
    }

    #[test]
    fn field_may_be_absent_or_repeated() {
        let t = Template {
            question: "Q:".into(),
            option: "{option}/{option}".into(),
            ..template()
        };
        t.validate(Path::new("kev.json")).unwrap();
        assert_eq!(t.format_question("ignored"), "Q:");
        assert_eq!(t.format_option("a"), "a/a");
    }

    fn config_err(t: Template) -> (String, String) {
        match t.validate(Path::new("dir/kev.json")).unwrap_err() {
            e @ Error::Config { .. } => {
                let msg = e.to_string();
                assert!(msg.starts_with("`dir/kev.json`: field `template."), "{msg}");
                let Error::Config { field, message, .. } = e else {
                    unreachable!()
                };
                (field, message)
            }
            e => panic!("expected Error::Config, got {e:?}"),
        }
    }

    #[test]
    fn other_field_is_refused() {
        let (field, msg) = config_err(Template {
            question: "{state} {prompt}".into(),
            ..template()
        });
        assert_eq!(field, "template.question");
        assert!(msg.contains("`{state}`"), "{msg}");
        for bad in ["{}", "{0}", "{option:>3}", "{option!r}"] {
            let (field, _) = config_err(Template {
                option: bad.into(),
                ..template()
            });
            assert_eq!(field, "template.option", "{bad}");
        }
    }

    #[test]
    fn unbalanced_braces_are_refused() {
        for bad in ["{state", "state}", "{{state}", "{ {state}}", "a}b"] {
            let (field, _) = config_err(Template {
                state: bad.into(),
                ..template()
            });
            assert_eq!(field, "template.state", "{bad}");
        }
    }

    #[test]
    fn marker_checks() {
        let (field, _) = config_err(Template {
            option_marker: String::new(),
            ..template()
        });
        assert_eq!(field, "template.option_marker");
        let (field, _) = config_err(Template {
            decide_marker: "<|kev_option|>".into(),
            ..template()
        });
        assert_eq!(field, "template.decide_marker");
        let (field, _) = config_err(Template {
            option: "- {option}<|kev_option|>".into(),
            ..template()
        });
        assert_eq!(field, "template.option");
    }
}
