//! Property-based fuzzing of kev-core's input formats: record lines ([`Record::from_json_str`],
//! [`JsonlRecords`]), `kev.json` ([`KevConfig`], [`Checkpoint::open`]), templates,
//! `adapter_config.json` ([`AdapterConfig`]) and the settings of `tokenizer.json` (through
//! [`Encoder`]).
//!
//! The property everywhere: no input panics or aborts; every failure is a typed
//! [`kev_core::Error`] whose message names the file, line, field or tensor at fault (and, for a
//! single edit of a valid input, a field related to the edit); whatever is accepted obeys the
//! format's rules. Inputs are arbitrary text and bytes, and valid inputs (the shipped fixtures or
//! generated ones) with one structural edit (a value replaced, removed or added anywhere) and
//! optionally one textual edit (truncation, a stray character, a duplicated key, deep nesting).
//!
//! The normal suite runs a few hundred cases per property (well under a second each); set
//! `KEV_FUZZ_SCALE=N` to run N times as many (`scripts/fuzz-long.sh`).

use std::io::BufReader;
use std::path::{Path, PathBuf};

use kev_core::{
    AdapterConfig, Checkpoint, Encoder, Error, JsonlRecords, KevConfig, Record, Template,
};
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{json, Value};

#[path = "../../tests/fuzz_common/mod.rs"]
mod common;
use common::*;

// ---------------------------------------------------------------------------------------------
// Records
// ---------------------------------------------------------------------------------------------

/// A valid record as JSON.
fn record_value() -> impl Strategy<Value = Value> {
    let question = (
        prop::option::of(text()),
        text(),
        prop::collection::vec(text(), 1..5),
        prop::option::of(any::<Index>()),
        any::<bool>(),
    )
        .prop_map(|(id, prompt, options, answer, null_id)| {
            let mut q = json!({"prompt": prompt, "options": options});
            match id {
                Some(id) => q["id"] = Value::String(id),
                None if null_id => q["id"] = Value::Null,
                None => {}
            }
            if let Some(a) = answer {
                q["answer"] = json!(a.index(options.len()));
            }
            q
        });
    (
        prop::option::of(text()),
        text(),
        prop::collection::vec(question, 1..4),
    )
        .prop_map(|(id, state, questions)| {
            let mut r = json!({"state": state, "questions": questions});
            if let Some(id) = id {
                r["id"] = Value::String(id);
            }
            r
        })
}

/// The rules of [`check_record_result`] for an accepted record.
fn check_accepted(r: &Record, line: usize) -> Result<(), TestCaseError> {
    prop_assert!(
        r.validate().is_ok(),
        "accepted record breaks the rules: {r:?}"
    );
    prop_assert!(!r.questions.is_empty());
    for q in &r.questions {
        prop_assert!(!q.options.is_empty());
        prop_assert!(q.answer.is_none_or(|a| a < q.options.len()));
    }
    // What was accepted reads back the same (nothing dropped or coerced).
    let again = Record::from_json_str(&serde_json::to_string(r).unwrap(), Some(line));
    prop_assert_eq!(again.as_ref().ok(), Some(r));
    Ok(())
}

/// A record result is a valid record, or an [`Error::Record`] naming `line` and its field.
fn check_record_result(res: &kev_core::Result<Record>, line: usize) -> Result<(), TestCaseError> {
    match res {
        Ok(r) => check_accepted(r, line),
        Err(e) => {
            let msg = e.to_string();
            let Error::Record {
                line: got, field, ..
            } = e
            else {
                return Err(TestCaseError::fail(format!("not a record error: {e:?}")));
            };
            prop_assert_eq!(*got, Some(line), "{}", msg);
            let prefix = format!("record at line {line}");
            prop_assert!(msg.starts_with(&prefix), "{msg}");
            if !field.is_empty() {
                prop_assert!(msg.contains(&format!("field `{field}`")), "{msg}");
            }
            Ok(())
        }
    }
}

proptest! {
    #![proptest_config(cases(512))]

    /// Any text at all.
    #[test]
    fn record_from_any_text(s in prop_oneof![any::<String>(), "\\PC{0,64}", "[{}\\[\\]\":,0-9a-z ]{0,64}"]) {
        check_record_result(&Record::from_json_str(&s, Some(3)), 3)?;
    }

    /// A valid record with one structural and one textual edit. Unedited records are accepted
    /// as they are; an edited one that fails names a field related to the edit.
    #[test]
    fn record_near_valid(mut v in record_value(), e in edit(), t in text_edit()) {
        let original = v.clone();
        let edited = apply(&mut v, &e);
        let text = apply_text(&v.to_string(), &t);
        let res = Record::from_json_str(&text, Some(12));
        check_record_result(&res, 12)?;
        match (&res, &edited, &t) {
            (Ok(r), None, TextEdit::None | TextEdit::Wrap("\u{feff}" | " \t" | "\r\n", _)) => {
                // Unedited: exactly what was generated.
                let back: Value = serde_json::to_value(r).unwrap();
                let mut want = original.clone();
                strip_nulls(&mut want);
                prop_assert_eq!(back, want);
            }
            (Err(e), None, TextEdit::None) => {
                return Err(TestCaseError::fail(format!("valid record refused: {e}\n{text}")));
            }
            (Err(Error::Record { field, .. }), Some(p), TextEdit::None) => {
                prop_assert!(related(field, p), "edit at `{}` blamed on `{field}`: {text}", render(p));
            }
            _ => {}
        }
    }

    /// JSONL from lines of every kind (records, blanks, garbage, invalid UTF-8, CRLF), read
    /// through buffers of 1 to 64 bytes: every line that is not blank yields one item with its
    /// line number, errors name that line, and records equal the line parsed on its own.
    #[test]
    fn jsonl_lines(
        lines in prop::collection::vec(prop_oneof![
            3 => record_value().prop_map(|v| v.to_string().into_bytes()),
            1 => prop::sample::select(vec!["", " ", "\t", "\r", "\u{feff}", "\u{a0}", "{}", "[]", "null"]).prop_map(|s| s.as_bytes().to_vec()),
            1 => prop::collection::vec(any::<u8>().prop_filter("no newline", |b| *b != b'\n'), 0..24),
            1 => Just(vec![0xff, 0xfe, b'{']),
        ], 0..10),
        crlf in any::<bool>(),
        trailing in any::<bool>(),
        bom in any::<bool>(),
        cap in 1usize..64,
    ) {
        let sep: &[u8] = if crlf { b"\r\n" } else { b"\n" };
        let mut bytes = if bom { b"\xEF\xBB\xBF".to_vec() } else { Vec::new() };
        bytes.extend(lines.join(sep));
        if trailing && !lines.is_empty() {
            bytes.extend(sep);
        }
        check_jsonl(&bytes, cap)?;
    }

    /// JSONL from arbitrary bytes.
    #[test]
    fn jsonl_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256), cap in 1usize..64) {
        check_jsonl(&bytes, cap)?;
    }
}

/// Removes `null` ids (a record reads them as absent).
fn strip_nulls(v: &mut Value) {
    if let Value::Object(m) = v {
        m.retain(|_, x| !x.is_null());
        m.values_mut().for_each(strip_nulls);
    } else if let Value::Array(a) = v {
        a.iter_mut().for_each(strip_nulls);
    }
}

fn check_jsonl(bytes: &[u8], cap: usize) -> Result<(), TestCaseError> {
    let items: Vec<(usize, kev_core::Result<Record>)> =
        JsonlRecords::new(BufReader::with_capacity(cap, bytes), "in.jsonl").collect();
    // The input's lines (what follows the last newline counts only when not empty).
    let mut lines: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
    if lines.last().is_some_and(|l| l.is_empty()) {
        lines.pop();
    }
    let content = |n: usize| -> &[u8] {
        let mut l = lines[n - 1];
        if n == 1 {
            l = l.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(l);
        }
        l.strip_suffix(b"\r").unwrap_or(l)
    };
    let numbers: Vec<usize> = items.iter().map(|(n, _)| *n).collect();
    prop_assert!(
        numbers.windows(2).all(|w| w[0] < w[1]),
        "line numbers {numbers:?}"
    );
    prop_assert!(
        numbers.iter().all(|&n| n >= 1 && n <= lines.len()),
        "{numbers:?} of {} lines",
        lines.len()
    );
    for n in 1..=lines.len() {
        let blank = std::str::from_utf8(content(n)).is_ok_and(|t| t.trim().is_empty());
        if !blank {
            prop_assert!(
                numbers.contains(&n),
                "line {n} ({:?}) dropped",
                String::from_utf8_lossy(content(n))
            );
        }
    }
    for (n, res) in &items {
        check_record_result(res, *n)?;
        if let Ok(text) = std::str::from_utf8(content(*n)) {
            let alone = Record::from_json_str(text, Some(*n));
            prop_assert_eq!(
                res.as_ref().ok(),
                alone.as_ref().ok(),
                "line {} read differently",
                n
            );
        } else {
            prop_assert!(res.is_err(), "line {n} is not UTF-8 but was accepted");
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// kev.json and Checkpoint::open
// ---------------------------------------------------------------------------------------------

/// A valid kev.json naming the shipped base, adapter and head by absolute paths, so that a
/// checkpoint folder needs nothing but its kev.json.
fn kev_json_value() -> impl Strategy<Value = Value> {
    let base = fixture("base-mm").canonicalize().unwrap();
    let ck = fixture("kev-small").canonicalize().unwrap();
    (
        1usize..64,
        prop::option::of(prop::sample::select(vec![0.05f64, 0.7, 1.0, 3.0])),
        prop::option::of(1usize..100_000),
        any::<bool>(),
    )
        .prop_map(move |(dim, temperature, max_tokens, with_adapter)| {
            let mut v = json!({
                "format": "kev/1",
                "base": base.to_str().unwrap(),
                "head": {"file": ck.join("head.safetensors").to_str().unwrap(), "dim": dim},
                "template": {
                    "state": "<|im_start|>user\n{state}\n",
                    "question": "{prompt}\n",
                    "option": "- {option}",
                    "option_marker": "<|kev_option|>",
                    "decide_marker": "<|kev_decide|>"
                }
            });
            if with_adapter {
                v["adapter"] = json!(ck.join("adapter").to_str().unwrap());
            }
            if let Some(t) = temperature {
                v["head"]["temperature"] = json!(t);
            }
            if let Some(m) = max_tokens {
                v["max_tokens"] = json!(m);
            }
            v
        })
}

/// The rules an accepted kev.json obeys.
fn check_kev_config(c: &KevConfig, path: &Path) -> Result<(), TestCaseError> {
    prop_assert_eq!(c.format.as_str(), "kev/1");
    prop_assert!(!c.base.trim().is_empty());
    prop_assert!(c.adapter.as_deref().is_none_or(|a| !a.trim().is_empty()));
    prop_assert!(!c.head.file.is_empty());
    prop_assert!(c.head.dim > 0);
    prop_assert!(c.head.temperature.is_finite() && c.head.temperature > 0.0);
    prop_assert!(c.max_tokens > 0);
    prop_assert!(c.template.validate(path).is_ok());
    Ok(())
}

/// A kev.json failure is typed and names kev.json (or the file found missing), and a field
/// related to the edit.
fn check_kev_error(
    e: &Error,
    kev_json: &Path,
    edited: Option<&[Seg]>,
) -> Result<(), TestCaseError> {
    let msg = e.to_string();
    match e {
        Error::Config { path, field, .. } => {
            prop_assert_eq!(path.as_path(), kev_json, "{}", msg);
            prop_assert!(msg.contains(&kev_json.display().to_string()), "{msg}");
            prop_assert!(msg.contains(&format!("field `{field}`")), "{msg}");
            if let Some(p) = edited {
                prop_assert!(
                    related(field, p),
                    "edit at `{}` blamed on `{field}`",
                    render(p)
                );
            }
        }
        Error::Json { path, .. } => prop_assert_eq!(path.as_path(), kev_json, "{}", msg),
        Error::MissingFile { path, .. } => {
            prop_assert!(msg.contains(&path.display().to_string()), "{msg}");
        }
        Error::Io { path, .. } => prop_assert!(!path.as_os_str().is_empty()),
        other => {
            return Err(TestCaseError::fail(format!(
                "unexpected error kind: {other:?}"
            )))
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(cases(256))]

    /// kev.json text alone ([`KevConfig::from_json_str`]): any text, and valid files with edits.
    #[test]
    fn kev_json_text(
        v in kev_json_value(), e in edit(), t in text_edit(),
        junk in prop_oneof![any::<String>(), "[{}\\[\\]\":,0-9a-z ]{0,64}"], use_junk in prop::bool::weighted(0.2),
    ) {
        let path = Path::new("ck/kev.json");
        let mut v = v;
        let edited = apply(&mut v, &e);
        let text = if use_junk { junk } else { apply_text(&v.to_string(), &t) };
        match KevConfig::from_json_str(&text, path) {
            Ok(c) => check_kev_config(&c, path)?,
            Err(err) => {
                let plain = !use_junk && matches!(t, TextEdit::None);
                if plain && edited.is_none() {
                    return Err(TestCaseError::fail(format!("valid kev.json refused: {err}\n{text}")));
                }
                let edited = edited.as_deref().filter(|_| plain);
                check_kev_error(&err, path, edited)?;
            }
        }
    }

    /// [`Checkpoint::open`] on a folder holding only an edited kev.json; then its encoder.
    #[test]
    fn checkpoint_open(v in kev_json_value(), e in edit(), t in text_edit()) {
        let dir = TempDir::new("ckpt");
        let kev_json = dir.0.join("kev.json");
        let mut v = v;
        let edited = apply(&mut v, &e);
        let text = apply_text(&v.to_string(), &t);
        std::fs::write(&kev_json, &text).unwrap();
        match Checkpoint::open(&dir.0) {
            Ok(ck) => {
                check_kev_config(&ck.config, &kev_json)?;
                prop_assert!(ck.head_path.is_file());
                prop_assert!(ck.base.config.is_file() && ck.base.tokenizer.is_file());
                prop_assert!(!ck.base.weights.is_empty() && ck.base.weights.iter().all(|w| w.is_file()));
                for p in ck.adapter_config_path().iter().chain(&ck.adapter_weights_path()) {
                    prop_assert!(p.is_file());
                }
                prop_assert!(ck.tokenizer.is_file());
                match ck.encoder() {
                    Ok(enc) => prop_assert_eq!(enc.max_tokens(), ck.config.max_tokens),
                    Err(err) => {
                        let msg = err.to_string();
                        prop_assert!(matches!(err, Error::MissingMarker { .. } | Error::Tokenizer { .. }), "{msg}");
                        prop_assert!(msg.contains(&ck.tokenizer.display().to_string()), "{msg}");
                    }
                }
            }
            Err(err) => {
                let plain = matches!(t, TextEdit::None);
                if plain && edited.is_none() {
                    return Err(TestCaseError::fail(format!("valid checkpoint refused: {err}\n{text}")));
                }
                check_kev_error(&err, &kev_json, edited.as_deref().filter(|_| plain))?;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Templates
// ---------------------------------------------------------------------------------------------

fn template_text() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::collection::vec(
            prop::sample::select(vec![
                "{",
                "}",
                "{{",
                "}}",
                "{state}",
                "{prompt}",
                "{option}",
                "{x}",
                "{}",
                "a",
                " ",
                "\n",
                "é",
                "<|kev_option|>",
                "<|kev_decide|>",
                "<|im_start|>",
                ":",
                "!"
            ]),
            0..6
        )
        .prop_map(|parts| parts.concat()),
        text(),
    ]
}

proptest! {
    #![proptest_config(cases(512))]

    /// A template that validates formats by plain substitution: the value is inserted as it is
    /// (braces or fields inside it are not read again), and a template without braces is
    /// constant. One that does not validate is a config error on a `template.*` field.
    #[test]
    fn template_formatting(
        state in template_text(), question in template_text(), option in template_text(),
        option_marker in prop_oneof![Just("<|kev_option|>".to_owned()), text()],
        decide_marker in prop_oneof![Just("<|kev_decide|>".to_owned()), text()],
        value in text(),
    ) {
        let t = Template { state, question, option, option_marker, decide_marker };
        let path = Path::new("ck/kev.json");
        match t.validate(path) {
            Ok(()) => {
                const SENTINEL: &str = "\u{1}\u{2}\u{1}";
                for (tpl, f) in [
                    (&t.state, Template::format_state as fn(&Template, &str) -> String),
                    (&t.question, Template::format_question),
                    (&t.option, Template::format_option),
                ] {
                    let marked = f(&t, SENTINEL);
                    prop_assert_eq!(f(&t, &value), marked.replace(SENTINEL, &value));
                    if !tpl.contains(['{', '}']) {
                        prop_assert_eq!(&f(&t, &value), tpl);
                    }
                }
                prop_assert!(!t.option_marker.is_empty() && t.option_marker != t.decide_marker);
            }
            Err(Error::Config { path: p, field, .. }) => {
                prop_assert_eq!(p.as_path(), path);
                prop_assert!(field.starts_with("template."), "{field}");
            }
            Err(other) => return Err(TestCaseError::fail(format!("{other:?}"))),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// adapter_config.json
// ---------------------------------------------------------------------------------------------

fn adapter_value() -> impl Strategy<Value = Value> {
    let shipped: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("kev-small/adapter/adapter_config.json")).unwrap(),
    )
    .unwrap();
    let module = prop::sample::select(vec![
        "q_proj",
        "v_proj",
        "self_attn.q_proj",
        "layers.3.self_attn.q_proj",
        "mlp.up_proj",
        "in_proj_qkv",
    ]);
    (
        prop::collection::btree_map(module.clone(), 1usize..64, 0..3),
        prop::collection::btree_map(module, -16.0f64..64.0, 0..3),
        prop::option::of(prop::collection::vec(0u32..400, 0..4)),
        any::<bool>(),
        1usize..32,
    )
        .prop_map(move |(ranks, alphas, tokens, rslora, r)| {
            let mut v = shipped.clone();
            v["r"] = json!(r);
            v["rank_pattern"] = json!(ranks);
            v["alpha_pattern"] = json!(alphas);
            v["use_rslora"] = json!(rslora);
            if let Some(mut t) = tokens {
                // A valid config lists each trained token once (a repeat is refused).
                t.sort_unstable();
                t.dedup();
                v["trainable_token_indices"] = json!({"embed_tokens": t});
            }
            v
        })
}

proptest! {
    #![proptest_config(cases(512))]

    /// adapter_config.json: any text, and valid configs with edits. An accepted config gives a
    /// positive rank and a finite scaling for every module, and an exact pattern key's own rank.
    #[test]
    fn adapter_config(
        v in adapter_value(), e in edit(), t in text_edit(),
        junk in prop_oneof![any::<String>(), "[{}\\[\\]\":,0-9a-z ]{0,64}"], use_junk in prop::bool::weighted(0.2),
        modules in prop::collection::vec(prop_oneof![
            prop::sample::select(vec!["layers.0.self_attn.q_proj", "layers.3.self_attn.q_proj", "model.layers.3.self_attn.q_proj", "layers.1.mlp.up_proj", "xq_proj", "q_proj", ""]).prop_map(str::to_owned),
            text(),
        ], 1..4),
    ) {
        let path = Path::new("ad/adapter_config.json");
        let mut v = v;
        let edited = apply(&mut v, &e);
        let text = if use_junk { junk } else { apply_text(&v.to_string(), &t) };
        match AdapterConfig::from_json_str(&text, path) {
            Ok(c) => {
                prop_assert!(c.r > 0);
                prop_assert!(c.lora_alpha.is_finite());
                prop_assert!(c.rank_pattern.values().all(|&r| r > 0));
                let keys: Vec<&String> = c.rank_pattern.keys().chain(c.alpha_pattern.keys()).collect();
                for m in modules.iter().chain(keys) {
                    let (r, a, s) = (c.rank(m), c.alpha(m), c.scaling(m));
                    prop_assert!(r > 0);
                    prop_assert!(r == c.r || c.rank_pattern.values().any(|&x| x == r));
                    prop_assert!(s.is_finite(), "scaling {s} for `{m}`");
                    let want = if c.use_rslora { a / (r as f64).sqrt() } else { a / r as f64 };
                    prop_assert_eq!(s, want);
                    if let Some(&own) = c.rank_pattern.get(m) {
                        prop_assert_eq!(r, own);
                    }
                }
            }
            Err(err) => {
                let msg = err.to_string();
                let plain = !use_junk && matches!(t, TextEdit::None);
                if plain && edited.is_none() {
                    return Err(TestCaseError::fail(format!("valid adapter config refused: {msg}\n{text}")));
                }
                prop_assert!(msg.contains("ad/adapter_config.json"), "{msg}");
                match &err {
                    Error::Config { field, .. } => {
                        if let Some(p) = edited.as_deref().filter(|_| plain) {
                            prop_assert!(related(field, p), "edit at `{}` blamed on `{field}`", render(p));
                        }
                    }
                    Error::Json { .. } => {}
                    other => return Err(TestCaseError::fail(format!("{other:?}"))),
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// tokenizer.json settings, through the Encoder
// ---------------------------------------------------------------------------------------------

fn shipped_template() -> Template {
    Template {
        state: "<|im_start|>user\n{state}\n".into(),
        question: "{prompt}\n".into(),
        option: "- {option}".into(),
        option_marker: "<|kev_option|>".into(),
        decide_marker: "<|kev_decide|>".into(),
    }
}

fn fixture_records() -> Vec<Record> {
    let text = std::fs::read_to_string(fixture("records.jsonl")).unwrap();
    JsonlRecords::new(text.as_bytes(), "records.jsonl")
        .map(|(_, r)| r.unwrap())
        .collect()
}

/// Settings of a tokenizer.json: truncation, padding, the added tokens, the normalizer. Lengths
/// stay small here (large ones are the bounded-memory test's).
fn tokenizer_settings() -> impl Strategy<Value = (Value, Value, Vec<(usize, u8, Value)>, Value)> {
    let truncation = prop_oneof![
        2 => Just(Value::Null),
        1 => (0usize..80, 0usize..80, prop::sample::select(vec!["LongestFirst", "OnlyFirst", "OnlySecond"]), prop::sample::select(vec!["Left", "Right"]))
            .prop_map(|(m, s, st, d)| json!({"max_length": m, "stride": s, "strategy": st, "direction": d})),
        1 => value(),
    ];
    let padding = prop_oneof![
        2 => Just(Value::Null),
        1 => (prop_oneof![Just(json!("BatchLongest")), (0usize..300).prop_map(|n| json!({"Fixed": n}))],
              prop::sample::select(vec!["Left", "Right"]), prop::option::of(0usize..17), 0u32..500)
            .prop_map(|(st, d, mult, id)| json!({"strategy": st, "direction": d, "pad_to_multiple_of": mult, "pad_id": id, "pad_type_id": 0, "pad_token": "<|endoftext|>"})),
        1 => value(),
    ];
    // (which added token, which field, new value)
    let token_edit = (
        0usize..5,
        0u8..8,
        prop_oneof![
            any::<bool>().prop_map(Value::Bool),
            prop_oneof![0u32..10, 390u32..410, Just(u32::MAX)].prop_map(Value::from),
            text().prop_map(Value::String),
        ],
    );
    let normalizer = prop_oneof![
        3 => Just(Value::Null),
        1 => prop::sample::select(vec![
            json!({"type": "Lowercase"}),
            json!({"type": "NFKC"}),
            json!({"type": "Strip", "strip_left": true, "strip_right": true}),
            json!({"type": "Replace", "pattern": {"String": "a"}, "content": "<|kev_option|>"}),
            json!({"type": "Prepend", "prepend": "<|kev_decide|>"}),
        ]),
        1 => value(),
    ];
    (
        truncation,
        padding,
        prop::collection::vec(token_edit, 0..3),
        normalizer,
    )
}

/// The positions an encoding gives the head are where the markers are.
fn check_encoding(
    enc: &kev_core::Encoding,
    r: &Record,
    encoder: &Encoder,
) -> Result<(), TestCaseError> {
    let (o, d) = (encoder.option_id(), encoder.decide_id());
    prop_assert_eq!(enc.ids.len(), enc.segments.len());
    prop_assert!(enc.state_len + enc.longest_branch() <= encoder.max_tokens());
    let state = enc.state_ids();
    prop_assert!(!state.contains(&o) && !state.contains(&d));
    prop_assert!(enc.segments[..enc.state_len].iter().all(|&s| s == 0));
    prop_assert_eq!(enc.branches.len(), r.questions.len());
    let mut at = enc.state_len;
    for (j, (b, q)) in enc.branches.iter().zip(&r.questions).enumerate() {
        prop_assert_eq!(b.start, at);
        at += b.len;
        let ids = enc.branch_ids(j);
        prop_assert_eq!(b.decide, b.len - 1);
        prop_assert_eq!(ids[b.decide], d);
        prop_assert_eq!(b.opts.len(), q.options.len());
        prop_assert!(b.opts.iter().all(|&p| ids[p] == o));
        prop_assert_eq!(ids.iter().filter(|&&x| x == o).count(), q.options.len());
        prop_assert_eq!(ids.iter().filter(|&&x| x == d).count(), 1);
        prop_assert!(enc.segments[b.start..b.start + b.len]
            .iter()
            .all(|&s| s as usize == j + 1));
    }
    prop_assert_eq!(at, enc.ids.len());
    Ok(())
}

proptest! {
    #![proptest_config(cases(64))]

    /// tokenizer.json with edited settings: loading it is a typed error naming the file, or an
    /// encoder whose every encoding of the fixture records puts the head's positions on the
    /// markers (or is a typed record error).
    #[test]
    fn tokenizer_settings_and_encoding(
        (truncation, padding, token_edits, normalizer) in tokenizer_settings(),
        max_tokens in prop_oneof![1usize..64, Just(1024usize)],
    ) {
        let mut tok: Value = serde_json::from_str(&std::fs::read_to_string(fixture("tokenizer.json")).unwrap()).unwrap();
        tok["truncation"] = truncation;
        tok["padding"] = padding;
        tok["normalizer"] = normalizer;
        for (which, field, v) in &token_edits {
            let name = ["id", "content", "single_word", "lstrip", "rstrip", "normalized", "special", "id"][*field as usize];
            tok["added_tokens"][*which][name] = v.clone();
        }
        let dir = TempDir::new("tok");
        let path = dir.0.join("tokenizer.json");
        std::fs::write(&path, tok.to_string()).unwrap();
        match Encoder::from_file(&path, shipped_template(), max_tokens) {
            Ok(encoder) => {
                for (i, r) in fixture_records().iter().enumerate() {
                    match encoder.encode(r, Some(i + 1)) {
                        Ok(enc) => check_encoding(&enc, r, &encoder)?,
                        Err(Error::TooLong { line, .. }) => prop_assert_eq!(line, Some(i + 1)),
                        Err(Error::Record { line, field, .. }) => {
                            prop_assert_eq!(line, Some(i + 1));
                            prop_assert!(!field.is_empty());
                        }
                        Err(e @ Error::Tokenizer { .. }) => {
                            prop_assert!(e.to_string().contains(&path.display().to_string()), "{e}");
                        }
                        Err(e) => return Err(TestCaseError::fail(format!("{e:?}"))),
                    }
                }
            }
            Err(e) => {
                let msg = e.to_string();
                prop_assert!(matches!(e, Error::Tokenizer { .. } | Error::MissingMarker { .. }), "{msg}");
                prop_assert!(msg.contains(&path.display().to_string()), "{msg}");
                if token_edits.is_empty() && tok["truncation"].is_null() && tok["padding"].is_null() && tok["normalizer"].is_null() {
                    return Err(TestCaseError::fail(format!("the shipped tokenizer refused: {msg}")));
                }
            }
        }
    }

    /// Random records (any text, markers included) under random valid templates, with the
    /// shipped tokenizer: an encoding's positions are on the markers, or a typed record error.
    #[test]
    fn encode_any_record(
        v in record_value(),
        state in prop_oneof![Just("<|im_start|>user\n{state}\n".to_owned()), template_text()],
        option in prop_oneof![Just("- {option}".to_owned()), template_text()],
        max_tokens in prop_oneof![1usize..32, Just(8192usize)],
    ) {
        let r = Record::from_json_value(&v, Some(1)).unwrap();
        let template = Template { state, option, ..shipped_template() };
        let path = fixture("tokenizer.json");
        let encoder = match Encoder::from_file(&path, template, max_tokens) {
            Ok(e) => e,
            Err(Error::InvalidArgument { name, .. }) => {
                prop_assert!(name.starts_with("template."), "{name}");
                return Ok(());
            }
            Err(e) => return Err(TestCaseError::fail(format!("{e:?}"))),
        };
        match encoder.encode(&r, Some(1)) {
            Ok(enc) => check_encoding(&enc, &r, &encoder)?,
            Err(Error::TooLong { line: Some(1), tokens, max_tokens: m, .. }) => prop_assert!(tokens > m),
            Err(Error::Record { line: Some(1), field, message, .. }) => {
                prop_assert!(field == "state" || field.starts_with("questions["), "{field}: {message}");
            }
            Err(e) => return Err(TestCaseError::fail(format!("{e:?}"))),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Regressions: cases the fuzzing found
// ---------------------------------------------------------------------------------------------

/// The shipped tokenizer.json with `key` set to `value`, in a temp folder.
fn tokenizer_with(dir: &TempDir, key: &str, value: Value) -> PathBuf {
    let mut tok: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("tokenizer.json")).unwrap()).unwrap();
    tok[key] = value;
    let path = dir.0.join("tokenizer.json");
    std::fs::write(&path, tok.to_string()).unwrap();
    path
}

/// A truncation stride not below `max_length` made tokenizers panic inside `Encoder::encode`
/// ("`stride` must be strictly less than `max_len=1`"). The runtime's own encoding is used.
#[test]
fn tokenizer_truncation_stride_at_max_length_encodes_untruncated() {
    let dir = TempDir::new("stride");
    let path = tokenizer_with(
        &dir,
        "truncation",
        json!({"max_length": 1, "stride": 1, "strategy": "LongestFirst", "direction": "Left"}),
    );
    let encoder = Encoder::from_file(&path, shipped_template(), 1024).unwrap();
    let plain = Encoder::from_file(fixture("tokenizer.json"), shipped_template(), 1024).unwrap();
    for r in fixture_records() {
        assert_eq!(
            encoder.encode(&r, None).unwrap(),
            plain.encode(&r, None).unwrap()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Bounded memory: numbers read from a file never size an allocation before they are checked
// ---------------------------------------------------------------------------------------------

/// The address space the bounded tests' children get: room for the test binary and the fixture
/// tokenizer, far from what any of the numbers below would allocate.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const LIMIT: u64 = 1 << 30;

/// The harness itself: a child that allocates (and touches) more than its limit fails, so a
/// passing bounded test means the code under test stayed within it.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn bounded_child_catches_an_allocation_over_its_limit() {
    match bounded_child("bounded_child_catches_an_allocation_over_its_limit", LIMIT) {
        None => {
            let v = vec![1u8; std::hint::black_box(2 * LIMIT as usize)];
            assert_eq!(std::hint::black_box(&v)[v.len() - 1], 1);
        }
        Some((status, text)) => assert!(!status.success(), "{text}"),
    }
}

/// A line with no end (`/dev/zero`-like input) is refused while at most the reader's line limit
/// is held: 1.5 GiB of input under a 1 GiB address space.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn endless_line_is_refused_in_bounded_memory() {
    run_bounded("endless_line_is_refused_in_bounded_memory", LIMIT, || {
        use std::io::Read;
        let input = BufReader::new(std::io::repeat(b'x').take(3 << 29));
        let items: Vec<_> = JsonlRecords::new(input, "endless").collect();
        assert_eq!(items.len(), 1);
        assert!(
            matches!(items[0], (1, Err(Error::Record { line: Some(1), .. }))),
            "{:?}",
            items[0].1
        );
    });
}

/// tokenizer.json asking to pad every piece to 2^40 tokens: the runtime's own encoding, no
/// terabyte of padding.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn huge_tokenizer_padding_is_not_allocated() {
    run_bounded("huge_tokenizer_padding_is_not_allocated", LIMIT, || {
        let dir = TempDir::new("pad");
        let path = tokenizer_with(
            &dir,
            "padding",
            json!({"strategy": {"Fixed": 1u64 << 40}, "direction": "Right", "pad_to_multiple_of": null,
                   "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}),
        );
        let encoder = Encoder::from_file(&path, shipped_template(), 1024).unwrap();
        let plain =
            Encoder::from_file(fixture("tokenizer.json"), shipped_template(), 1024).unwrap();
        for r in fixture_records() {
            assert_eq!(
                encoder.encode(&r, None).unwrap(),
                plain.encode(&r, None).unwrap()
            );
        }
    });
}

/// A 64 MB state under `max_tokens` = 1024 is refused from its length, without tokenizing it
/// (which takes gigabytes).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn huge_state_is_refused_in_bounded_memory() {
    run_bounded("huge_state_is_refused_in_bounded_memory", LIMIT, || {
        let encoder =
            Encoder::from_file(fixture("tokenizer.json"), shipped_template(), 1024).unwrap();
        let r = Record {
            id: Some("big".into()),
            state: "word ".repeat((64 << 20) / 5),
            questions: vec![kev_core::Question {
                id: None,
                prompt: "p".into(),
                options: vec!["a".into()],
                answer: None,
            }],
        };
        match encoder.encode(&r, Some(1)) {
            Err(Error::Record {
                line: Some(1),
                field,
                ..
            }) if field == "state" => {}
            other => panic!("{:?}", other.map(|e| e.ids.len())),
        }
    });
}

/// kev.json numbers at their largest (`max_tokens`, `head.dim`) size nothing when the
/// checkpoint is opened and its encoder built.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn huge_kev_json_numbers_allocate_nothing() {
    run_bounded("huge_kev_json_numbers_allocate_nothing", LIMIT, || {
        let dir = TempDir::new("bigkev");
        let base = fixture("base-mm").canonicalize().unwrap();
        let ck = fixture("kev-small").canonicalize().unwrap();
        let kev = json!({
            "format": "kev/1", "base": base, "adapter": ck.join("adapter"),
            "head": {"file": ck.join("head.safetensors"), "dim": u64::MAX, "temperature": 1.0},
            "template": {"state": "{state}", "question": "{prompt}", "option": "{option}",
                         "option_marker": "<|kev_option|>", "decide_marker": "<|kev_decide|>"},
            "max_tokens": u64::MAX
        });
        std::fs::write(dir.0.join("kev.json"), kev.to_string()).unwrap();
        let ck = Checkpoint::open(&dir.0).unwrap();
        let encoder = ck.encoder().unwrap();
        for r in fixture_records() {
            encoder.encode(&r, None).unwrap();
        }
    });
}
