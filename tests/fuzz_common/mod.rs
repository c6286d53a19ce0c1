//! Shared by the fuzz and error tests of every crate of the workspace (`#[path]`-included): the
//! case count, temp folders, fixtures and copies of them, a child process with a bounded address
//! space, and generators of JSON values and of edits (structural and textual) to valid inputs.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{json, Map, Value};

// ---------------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------------

/// `normal` cases, times `KEV_FUZZ_SCALE` (default 1). Failures are not persisted to files: a
/// failure found is turned into a plain regression test instead.
pub fn cases(normal: u32) -> ProptestConfig {
    let scale = std::env::var("KEV_FUZZ_SCALE")
        .ok()
        .and_then(|s| s.parse::<u32>().ok())
        .unwrap_or(1)
        .max(1);
    ProptestConfig {
        cases: normal.saturating_mul(scale),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// A file of `tests/fixtures` (found above the including crate's folder).
pub fn fixture(rel: &str) -> PathBuf {
    let mut dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    while !dir.join("tests/fixtures").is_dir() {
        dir = dir.parent().expect("tests/fixtures above the crate");
    }
    dir.join("tests/fixtures").join(rel)
}

/// Copies the folder `from` (recursively) to `to`.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let dest = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &dest);
        } else {
            std::fs::copy(entry.path(), dest).unwrap();
        }
    }
}

/// A unique folder under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "kev-fuzz-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------------------------------------
// Generators: JSON values, paths and edits
// ---------------------------------------------------------------------------------------------

/// Field names of every format fuzzed here, so that random objects often hit real fields.
pub const KEYS: &[&str] = &[
    "id",
    "state",
    "questions",
    "prompt",
    "options",
    "answer",
    "format",
    "base",
    "adapter",
    "head",
    "file",
    "dim",
    "temperature",
    "template",
    "question",
    "option",
    "option_marker",
    "decide_marker",
    "max_tokens",
    "r",
    "lora_alpha",
    "use_rslora",
    "target_modules",
    "rank_pattern",
    "alpha_pattern",
    "trainable_token_indices",
    "embed_tokens",
    "peft_type",
    "bias",
    "modules_to_save",
    "fan_in_fan_out",
    "use_dora",
    "lora_bias",
    "",
    "__proto__",
];

/// Strings that matter to the formats: markers, template fields, braces, odd characters.
pub const TEXTS: &[&str] = &[
    "",
    " ",
    "x",
    "{state}",
    "{prompt}",
    "{option}",
    "{",
    "}",
    "{{",
    "}}",
    "{}",
    "{0}",
    "{state:>4}",
    "{state!r}",
    "{{state}}",
    "{state",
    "state}",
    "<|kev_option|>",
    "<|kev_decide|>",
    "<|im_start|>",
    "<|endoftext|>",
    "kev/1",
    "kev/2",
    "LORA",
    "none",
    "all",
    "hf:",
    "hf:a/b",
    "hf:a/b@",
    "hf:/a",
    "../base-mm",
    "\u{feff}",
    "\0",
    "\n",
    "\r\n",
    "\t",
    "\u{2028}",
    "\u{a0}",
    "é",
    "数字",
    "🦀",
    "\u{10ffff}",
    "q_proj",
    "embed_tokens",
    "lm_head",
    "layers.0.self_attn.q_proj",
];

pub fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(TEXTS).prop_map(str::to_owned),
        2 => "\\PC{0,12}",
        1 => any::<String>(),
        1 => (prop::sample::select(TEXTS), prop::sample::select(TEXTS), "[a-z {}]{0,4}")
            .prop_map(|(a, b, c)| format!("{a}{c}{b}")),
    ]
}

pub fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(KEYS).prop_map(str::to_owned),
        1 => text(),
    ]
}

pub fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        prop::sample::select(vec![
            0u64,
            1,
            2,
            3,
            4,
            16,
            255,
            256,
            65_535,
            u32::MAX as u64,
            1 << 53,
            u64::MAX
        ])
        .prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        prop::sample::select(vec![
            0.0f64,
            -0.0,
            0.5,
            -1.0,
            -1.5,
            1e-320,
            1e-7,
            1e300,
            -1e300,
            f64::MAX,
            f64::MIN_POSITIVE
        ])
        .prop_map(Value::from),
        (-1e12f64..1e12).prop_map(Value::from),
    ]
}

pub fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number(),
        text().prop_map(Value::String),
    ]
}

/// Any JSON value, nesting at most 3 deep.
pub fn value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((key(), inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// One step of a path inside a JSON value.
#[derive(Clone, Debug, PartialEq)]
pub enum Seg {
    Key(String),
    Index(usize),
}

/// Every node's path (the root is `[]`), in document order.
pub fn paths(v: &Value) -> Vec<Vec<Seg>> {
    fn walk(v: &Value, at: &mut Vec<Seg>, out: &mut Vec<Vec<Seg>>) {
        out.push(at.clone());
        match v {
            Value::Object(m) => {
                for (k, c) in m {
                    at.push(Seg::Key(k.clone()));
                    walk(c, at, out);
                    at.pop();
                }
            }
            Value::Array(a) => {
                for (i, c) in a.iter().enumerate() {
                    at.push(Seg::Index(i));
                    walk(c, at, out);
                    at.pop();
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(v, &mut Vec::new(), &mut out);
    out
}

/// The path as Kev's errors write fields: `questions[1].options[2]`, `head.dim`.
pub fn render(path: &[Seg]) -> String {
    let mut s = String::new();
    for seg in path {
        match seg {
            Seg::Key(k) => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(k);
            }
            Seg::Index(i) => s.push_str(&format!("[{i}]")),
        }
    }
    s
}

pub fn node_mut<'a>(v: &'a mut Value, path: &[Seg]) -> &'a mut Value {
    path.iter().fold(v, |v, seg| match seg {
        Seg::Key(k) => &mut v[k.as_str()],
        Seg::Index(i) => &mut v[*i],
    })
}

/// One structural edit of a JSON value, at a node chosen among all of them.
#[derive(Clone, Debug)]
pub enum Edit {
    None,
    /// The node becomes this value.
    Replace(Index, Value),
    /// The node is removed from its object or array (the root becomes `null`).
    Remove(Index),
    /// A key is added to the node (an object), or the node becomes an object with it.
    AddKey(Index, String, Value),
    /// A value is appended to the node (an array), or the node becomes an array with it.
    Push(Index, Value),
}

pub fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        1 => Just(Edit::None),
        4 => (any::<Index>(), value()).prop_map(|(i, v)| Edit::Replace(i, v)),
        2 => any::<Index>().prop_map(Edit::Remove),
        1 => (any::<Index>(), key(), value()).prop_map(|(i, k, v)| Edit::AddKey(i, k, v)),
        1 => (any::<Index>(), value()).prop_map(|(i, v)| Edit::Push(i, v)),
    ]
}

/// Applies `edit` to `v`; returns the rendered path of the node edited (`None`: no edit).
pub fn apply(v: &mut Value, edit: &Edit) -> Option<Vec<Seg>> {
    let all = paths(v);
    let pick = |i: &Index| all[i.index(all.len())].clone();
    match edit {
        Edit::None => None,
        Edit::Replace(i, new) => {
            let p = pick(i);
            *node_mut(v, &p) = new.clone();
            Some(p)
        }
        Edit::Remove(i) => {
            let p = pick(i);
            match p.split_last() {
                None => *v = Value::Null,
                Some((last, parent)) => match (node_mut(v, parent), last) {
                    (Value::Object(m), Seg::Key(k)) => {
                        m.remove(k);
                    }
                    (Value::Array(a), Seg::Index(i)) => {
                        a.remove(*i);
                    }
                    _ => unreachable!("paths() only gives existing nodes"),
                },
            }
            Some(p)
        }
        Edit::AddKey(i, k, new) => {
            let p = pick(i);
            let node = node_mut(v, &p);
            match node {
                Value::Object(m) => {
                    m.insert(k.clone(), new.clone());
                }
                other => *other = json!({ k.clone(): new.clone() }),
            }
            Some(p)
        }
        Edit::Push(i, new) => {
            let p = pick(i);
            let node = node_mut(v, &p);
            match node {
                Value::Array(a) => a.push(new.clone()),
                other => *other = json!([new.clone()]),
            }
            Some(p)
        }
    }
}

/// A textual edit of serialized JSON (it stays UTF-8).
#[derive(Clone, Debug)]
pub enum TextEdit {
    None,
    /// Cut at this character.
    Truncate(Index),
    /// Insert this text at this character.
    Insert(Index, String),
    /// Remove one character.
    Delete(Index),
    /// Repeat a key of the top-level object at its start: `{"k": v, ...original...}`.
    DuplicateKey(String, Value),
    /// Wrap the text in this many arrays.
    Nest(usize),
    /// A byte order mark, or whitespace, before and after.
    Wrap(&'static str, &'static str),
}

pub fn text_edit() -> impl Strategy<Value = TextEdit> {
    prop_oneof![
        6 => Just(TextEdit::None),
        1 => any::<Index>().prop_map(TextEdit::Truncate),
        1 => (any::<Index>(), prop_oneof![
                prop::sample::select(vec!["{", "}", "[", "]", ",", ":", "\"", "\\", "\0", "\u{feff}", "1e999", "-", "null"]).prop_map(str::to_owned),
                text(),
            ]).prop_map(|(i, s)| TextEdit::Insert(i, s)),
        1 => any::<Index>().prop_map(TextEdit::Delete),
        1 => (key(), value()).prop_map(|(k, v)| TextEdit::DuplicateKey(k, v)),
        1 => prop_oneof![1usize..8, 100usize..140, Just(5000usize)].prop_map(TextEdit::Nest),
        1 => prop::sample::select(vec![("\u{feff}", ""), (" \t", "\n"), ("\r\n", "\r\n"), ("", " x")])
            .prop_map(|(a, b)| TextEdit::Wrap(a, b)),
    ]
}

pub fn apply_text(s: &str, edit: &TextEdit) -> String {
    let at = |i: &Index| {
        let bounds: Vec<usize> = s.char_indices().map(|(b, _)| b).chain([s.len()]).collect();
        bounds[i.index(bounds.len())]
    };
    match edit {
        TextEdit::None => s.to_owned(),
        TextEdit::Truncate(i) => s[..at(i)].to_owned(),
        TextEdit::Insert(i, t) => {
            let b = at(i);
            format!("{}{t}{}", &s[..b], &s[b..])
        }
        TextEdit::Delete(i) => {
            let b = at(i);
            let next = s[b..].chars().next().map_or(0, char::len_utf8);
            format!("{}{}", &s[..b], &s[b + next..])
        }
        TextEdit::DuplicateKey(k, v) => match s.strip_prefix('{') {
            Some(rest) => format!("{{{}: {v},{rest}", Value::String(k.clone())),
            None => s.to_owned(),
        },
        TextEdit::Nest(n) => format!("{}{s}{}", "[".repeat(*n), "]".repeat(*n)),
        TextEdit::Wrap(a, b) => format!("{a}{s}{b}"),
    }
}

/// Splits a rendered field path into its steps: `questions[1].options` → `questions`, `[1]`,
/// `options`.
pub fn steps(field: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, c) in field.char_indices() {
        if c == '.' || c == '[' {
            if start < i {
                out.push(&field[start..i]);
            }
            start = if c == '.' { i + 1 } else { i };
        }
    }
    if start < field.len() {
        out.push(&field[start..]);
    }
    out
}

/// Whether an error's `field` can be blamed on an edit at `edited`: one is a prefix of the
/// other, or both are inside the same question (`questions[j]`) or the same top-level section
/// (`template`, `head`). An error with no field concerns the whole document (root edits only).
/// Keys containing `.` or `[` are compared as rendered, so they cannot be split apart wrongly.
pub fn related(field: &str, edited: &[Seg]) -> bool {
    if edited.is_empty() {
        return true;
    }
    let p = render(edited);
    if field.is_empty() {
        return false;
    }
    let under = |a: &str, b: &str| {
        a == b || (a.starts_with(b) && matches!(a.as_bytes()[b.len()], b'.' | b'['))
    };
    if under(field, &p) || under(&p, field) {
        return true;
    }
    let (f, e) = (steps(field), steps(&p));
    let shared = f.iter().zip(&e).take_while(|(a, b)| a == b).count();
    match f.first() {
        Some(&"questions") => shared >= 2,
        Some(_) => shared >= 1,
        None => false,
    }
}

/// The environment variable naming the test a child process runs under a bounded address space.
const BOUNDED_CHILD: &str = "KEV_FUZZ_BOUNDED_CHILD";

/// Runs test `test` of this test binary again in a child process whose address space is limited
/// to `limit` bytes (`RLIMIT_AS`): an allocation sized by a number read from a file, rather than
/// checked against the file first, then aborts the child instead of passing unnoticed (Linux
/// overcommits) or exhausting the machine.
///
/// In the child, sets the limit and returns `None`: the caller runs the test's body. In the
/// parent, returns the child's exit status and output, for [`assert_child_passed`].
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn bounded_child(test: &str, limit: u64) -> Option<(std::process::ExitStatus, String)> {
    if std::env::var(BOUNDED_CHILD).as_deref() == Ok(test) {
        let lim = libc::rlimit {
            rlim_cur: limit,
            rlim_max: limit,
        };
        // SAFETY: setrlimit only reads `lim`; it lowers this process's own limit.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) }, 0);
        return None;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--test-threads=1", "--nocapture"])
        .env(BOUNDED_CHILD, test)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some((out.status, text))
}

/// The child of [`bounded_child`] ran its test and passed.
pub fn assert_child_passed(
    test: &str,
    limit: u64,
    (status, text): (std::process::ExitStatus, String),
) {
    assert!(
        status.success() && text.contains("1 passed"),
        "`{test}` under a {} MiB address space: {status}\n{text}",
        limit >> 20
    );
}

/// Runs `body` in a child process limited to `limit` bytes of address space (see
/// [`bounded_child`]) and asserts that it passed there.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn run_bounded(test: &str, limit: u64, body: impl FnOnce()) {
    match bounded_child(test, limit) {
        None => body(),
        Some(out) => assert_child_passed(test, limit, out),
    }
}
