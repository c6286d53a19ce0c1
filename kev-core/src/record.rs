//! Records (docs/CONTRACT.md §1): one shared state and one or more multiple-choice questions.
//!
//! Records arrive as JSON, one per line of a JSONL file. Parsing goes through
//! [`serde_json::Value`] and checks every field by hand, so each error names the line, the record
//! id (when it could be read) and the exact field path (`questions[1].options[2]`). Nothing is
//! dropped or coerced silently: unknown fields, wrong types, empty lists and out-of-range answers
//! are all [`Error::Record`].

use std::io::BufRead;
use std::path::PathBuf;

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::json::{self, fault, FieldResult};

/// One record: a state shared by all its questions.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    /// Optional record id, echoed in outputs and errors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Free text shared by all questions; may be empty.
    pub state: String,
    /// The questions; at least one.
    pub questions: Vec<Question>,
}

/// One multiple-choice question of a [`Record`].
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Question {
    /// Optional question id, echoed in outputs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The question text.
    pub prompt: String,
    /// The options; at least one (a single option gets probability 1).
    pub options: Vec<String>,
    /// Index of the correct option, if known (used for metrics only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<usize>,
}

const RECORD_FIELDS: &[&str] = &["id", "state", "questions"];
const QUESTION_FIELDS: &[&str] = &["id", "prompt", "options", "answer"];

impl Record {
    /// Bytes of text the record holds (state, prompts, options): what holding it costs, for
    /// callers that bound the records they keep at once.
    pub fn text_bytes(&self) -> usize {
        self.state.len()
            + self
                .questions
                .iter()
                .map(|q| q.prompt.len() + q.options.iter().map(String::len).sum::<usize>())
                .sum::<usize>()
    }

    /// Parses and validates one record from JSON text.
    ///
    /// `line` is the 1-based line in the input file, used in errors (`None` when the text did not
    /// come from a file). Every fault is an [`Error::Record`] naming the line, the record id when
    /// it could be read, and the field.
    pub fn from_json_str(s: &str, line: Option<usize>) -> Result<Record> {
        let value = json::parse_strict(s).map_err(|e| {
            Error::record(
                line,
                None,
                "",
                format!(
                    "not valid JSON at column {}: {}",
                    e.column(),
                    json::message_without_position(&e)
                ),
            )
        })?;
        Record::from_json_value(&value, line)
    }

    /// Validates and converts an already parsed JSON value; see [`Record::from_json_str`].
    pub fn from_json_value(value: &Value, line: Option<usize>) -> Result<Record> {
        let obj = value.as_object().ok_or_else(|| {
            Error::record(
                line,
                None,
                "",
                format!("must be a JSON object, found {}", json::type_name(value)),
            )
        })?;
        // Read the id first so that every later error can name the record.
        let id = json::opt_str(obj, "id", "")
            .map_err(|f| Error::record(line, None, f.field, f.message))?
            .map(str::to_owned);
        let record = parse_record(obj, id.clone())
            .map_err(|f| Error::record(line, id.as_deref(), f.field, f.message))?;
        Ok(record)
    }

    /// Checks a record built in code against the same rules as parsing: at least one question,
    /// at least one option per question, `answer` within the options. Errors are
    /// [`Error::Record`] with no line.
    pub fn validate(&self) -> Result<()> {
        self.validate_at(None)
    }

    /// [`Record::validate`] with the record's input line for the error.
    pub fn validate_at(&self, line: Option<usize>) -> Result<()> {
        check_record(self).map_err(|f| Error::record(line, self.id.as_deref(), f.field, f.message))
    }
}

fn parse_record(obj: &Map<String, Value>, id: Option<String>) -> FieldResult<Record> {
    json::deny_unknown(obj, RECORD_FIELDS, "")?;
    let state = json::req_str(obj, "state", "")?.to_owned();
    let questions = match obj.get("questions") {
        None => {
            return Err(fault(
                "questions",
                "missing (a list of questions is required)",
            ))
        }
        Some(Value::Array(qs)) => qs
            .iter()
            .enumerate()
            .map(|(j, q)| parse_question(q, &format!("questions[{j}]")))
            .collect::<FieldResult<Vec<_>>>()?,
        Some(v) => {
            return Err(fault(
                "questions",
                format!("must be a list, found {}", json::type_name(v)),
            ))
        }
    };
    let record = Record {
        id,
        state,
        questions,
    };
    check_record(&record)?;
    Ok(record)
}

fn parse_question(v: &Value, prefix: &str) -> FieldResult<Question> {
    let obj = json::as_object(v, prefix)?;
    json::deny_unknown(obj, QUESTION_FIELDS, prefix)?;
    let id = json::opt_str(obj, "id", prefix)?.map(str::to_owned);
    let prompt = json::req_str(obj, "prompt", prefix)?.to_owned();
    let options_field = json::join(prefix, "options");
    let options = match obj.get("options") {
        None => {
            return Err(fault(
                options_field,
                "missing (a list of strings is required)",
            ))
        }
        Some(Value::Array(opts)) => opts
            .iter()
            .enumerate()
            .map(|(i, o)| {
                o.as_str().map(str::to_owned).ok_or_else(|| {
                    fault(
                        format!("{options_field}[{i}]"),
                        format!("must be a string, found {}", json::type_name(o)),
                    )
                })
            })
            .collect::<FieldResult<Vec<_>>>()?,
        Some(v) => {
            return Err(fault(
                options_field,
                format!("must be a list of strings, found {}", json::type_name(v)),
            ))
        }
    };
    let answer = json::opt_usize(obj, "answer", prefix)?;
    Ok(Question {
        id,
        prompt,
        options,
        answer,
    })
}

/// The rules that typed values can still break.
fn check_record(r: &Record) -> FieldResult<()> {
    if r.questions.is_empty() {
        return Err(fault("questions", "must not be empty"));
    }
    for (j, q) in r.questions.iter().enumerate() {
        if q.options.is_empty() {
            return Err(fault(
                format!("questions[{j}].options"),
                "must not be empty",
            ));
        }
        if let Some(a) = q.answer {
            if a >= q.options.len() {
                return Err(fault(
                    format!("questions[{j}].answer"),
                    format!(
                        "{a} is out of range for {} option{}",
                        q.options.len(),
                        if q.options.len() == 1 { "" } else { "s" }
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// The longest line [`JsonlRecords`] reads by default: 64 MiB. A longer line is a record error
/// without being held in memory, so a file with no newlines (`/dev/zero`) cannot exhaust it.
pub const DEFAULT_MAX_LINE_BYTES: usize = 64 << 20;

/// Reads records from JSONL, one per line.
///
/// Yields `(line, result)` with the 1-based line number, for every line: each is a record or an
/// [`Error::Record`] naming its line, and reading goes on with the next line, so a caller can
/// skip bad records and report each one. A blank or whitespace-only line is such an error (it is
/// not a record, and dropping it silently would hide a broken export), as are a line that is not
/// UTF-8 and a line longer than the limit ([`DEFAULT_MAX_LINE_BYTES`]): its error comes as soon
/// as the limit is passed, before the rest of the line is read (an endless line, `/dev/zero`, is
/// refused after the limit), and the rest is skipped, not kept, when reading goes on. The only
/// thing that is not a line is what follows the last newline when it is empty.
/// A read error yields [`Error::Io`] naming `source` and ends the iteration. A UTF-8 byte order
/// mark at the start of the input is ignored.
#[derive(Debug)]
pub struct JsonlRecords<R: BufRead> {
    reader: R,
    source: PathBuf,
    line: usize,
    buf: Vec<u8>,
    max_line_bytes: usize,
    /// The rest of an overlong line, already reported, is still to be skipped.
    skipping: bool,
    done: bool,
}

impl<R: BufRead> JsonlRecords<R> {
    /// Reads from `reader`; `source` names it in I/O errors (a file path, or e.g. `-` for stdin).
    pub fn new(reader: R, source: impl Into<PathBuf>) -> Self {
        JsonlRecords {
            reader,
            source: source.into(),
            line: 0,
            buf: Vec::new(),
            max_line_bytes: DEFAULT_MAX_LINE_BYTES,
            skipping: false,
            done: false,
        }
    }

    /// Sets the longest line accepted, in bytes (without its newline).
    pub fn with_max_line_bytes(mut self, max: usize) -> Self {
        self.max_line_bytes = max;
        self
    }

    /// The name given to the input.
    pub fn source(&self) -> &std::path::Path {
        &self.source
    }

    /// The number of lines read so far.
    pub fn lines_read(&self) -> usize {
        self.line
    }

    /// Reads one line into `buf` (without its newline). Returns `None` at the end of the input,
    /// else whether the line is longer than `max_line_bytes`: then it returns as soon as the
    /// limit is passed, and the next call first skips the rest of that line.
    fn read_line(&mut self) -> std::io::Result<Option<bool>> {
        self.buf.clear();
        let mut any = false;
        loop {
            let chunk = match self.reader.fill_buf() {
                Ok(c) => c,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if chunk.is_empty() {
                self.skipping = false;
                return Ok(any.then_some(false));
            }
            let (part, used, ended) = match chunk.iter().position(|&b| b == b'\n') {
                Some(i) => (&chunk[..i], i + 1, true),
                None => (chunk, chunk.len(), false),
            };
            if self.skipping {
                self.reader.consume(used);
                self.skipping = !ended;
                continue;
            }
            any = true;
            let room = self.max_line_bytes - self.buf.len();
            if part.len() > room {
                self.reader.consume(used);
                self.skipping = !ended;
                return Ok(Some(true));
            }
            self.buf.extend_from_slice(part);
            self.reader.consume(used);
            if ended {
                return Ok(Some(false));
            }
        }
    }
}

impl<R: BufRead> Iterator for JsonlRecords<R> {
    type Item = (usize, Result<Record>);

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let overlong = match self.read_line() {
            Ok(None) => {
                self.done = true;
                return None;
            }
            Ok(Some(overlong)) => overlong,
            Err(e) => {
                self.done = true;
                return Some((self.line + 1, Err(Error::io(&self.source, e))));
            }
        };
        self.line += 1;
        let line = self.line;
        let fail =
            |message: String| Some((line, Err(Error::record(Some(line), None, "", message))));
        if overlong {
            return fail(format!(
                "line is longer than {} bytes (the reader's limit)",
                self.max_line_bytes
            ));
        }
        let mut bytes = self.buf.as_slice();
        if line == 1 {
            bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
        }
        let bytes = bytes.strip_suffix(b"\r").unwrap_or(bytes);
        let text = match std::str::from_utf8(bytes) {
            Ok(t) => t,
            Err(e) => return fail(format!("not valid UTF-8: {e}")),
        };
        if text.trim().is_empty() {
            return fail("blank line: every line must be a record".to_owned());
        }
        Some((line, Record::from_json_str(text, Some(line))))
    }
}

impl<R: BufRead> std::iter::FusedIterator for JsonlRecords<R> {}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(s: &str) -> Error {
        Record::from_json_str(s, Some(7)).unwrap_err()
    }

    /// Asserts a record error with this id and field, and that the message names both and the line.
    fn assert_record_err(e: Error, want_id: Option<&str>, want_field: &str) {
        let msg = e.to_string();
        match e {
            Error::Record {
                line, id, field, ..
            } => {
                assert_eq!(line, Some(7), "{msg}");
                assert_eq!(id.as_deref(), want_id, "{msg}");
                assert_eq!(field, want_field, "{msg}");
            }
            other => panic!("expected Error::Record, got {other:?}"),
        }
        assert!(msg.starts_with("record at line 7"), "{msg}");
        if !want_field.is_empty() {
            assert!(msg.contains(&format!("field `{want_field}`")), "{msg}");
        }
        if let Some(id) = want_id {
            assert!(msg.contains(&format!("(`{id}`)")), "{msg}");
        }
    }

    #[test]
    fn parses_the_kev_md_example() {
        let r = Record::from_json_str(
            r#"{"id": "r17", "state": "s",
                "questions": [{"id": "q1", "prompt": "Which?", "options": ["a", "b", "c"], "answer": 2},
                              {"prompt": "Second", "options": ["yes", "no"]}]}"#,
            None,
        )
        .unwrap();
        assert_eq!(r.id.as_deref(), Some("r17"));
        assert_eq!(r.questions.len(), 2);
        assert_eq!(r.questions[0].answer, Some(2));
        assert_eq!(r.questions[1].id, None);
        assert_eq!(r.questions[1].options, vec!["yes", "no"]);
    }

    #[test]
    fn empty_state_and_null_ids_are_fine() {
        let r = Record::from_json_str(
            r#"{"id": null, "state": "", "questions": [{"id": null, "prompt": "", "options": ["x"], "answer": null}]}"#,
            None,
        )
        .unwrap();
        assert_eq!(r.state, "");
        assert_eq!(r.id, None);
        assert_eq!(r.questions[0].answer, None);
    }

    #[test]
    fn not_json() {
        let e = err("{not json");
        assert_record_err(e, None, "");
    }

    #[test]
    fn not_an_object() {
        let e = err("[1, 2]");
        assert!(e.to_string().contains("must be a JSON object"));
        assert_record_err(e, None, "");
    }

    #[test]
    fn missing_state() {
        assert_record_err(err(r#"{"id": "r1", "questions": []}"#), Some("r1"), "state");
    }

    #[test]
    fn ill_typed_state() {
        let e = err(r#"{"id": "r1", "state": 3, "questions": []}"#);
        assert!(e.to_string().contains("must be a string, found a number"));
        assert_record_err(e, Some("r1"), "state");
    }

    #[test]
    fn missing_questions() {
        assert_record_err(err(r#"{"id": "r1", "state": ""}"#), Some("r1"), "questions");
    }

    #[test]
    fn ill_typed_questions() {
        assert_record_err(
            err(r#"{"id": "r1", "state": "", "questions": {}}"#),
            Some("r1"),
            "questions",
        );
    }

    #[test]
    fn empty_questions() {
        let e = err(r#"{"id": "r1", "state": "", "questions": []}"#);
        assert!(e.to_string().ends_with("must not be empty"));
        assert_record_err(e, Some("r1"), "questions");
    }

    #[test]
    fn question_not_an_object() {
        assert_record_err(
            err(r#"{"id": "r1", "state": "", "questions": ["q"]}"#),
            Some("r1"),
            "questions[0]",
        );
    }

    #[test]
    fn missing_prompt() {
        assert_record_err(
            err(r#"{"id": "r1", "state": "", "questions": [{"options": ["a"]}]}"#),
            Some("r1"),
            "questions[0].prompt",
        );
    }

    #[test]
    fn ill_typed_prompt() {
        assert_record_err(
            err(r#"{"state": "", "questions": [{"prompt": ["p"], "options": ["a"]}]}"#),
            None,
            "questions[0].prompt",
        );
    }

    #[test]
    fn missing_options() {
        assert_record_err(
            err(
                r#"{"id": "r1", "state": "", "questions": [{"prompt": "p", "options": ["a"]}, {"prompt": "p"}]}"#,
            ),
            Some("r1"),
            "questions[1].options",
        );
    }

    #[test]
    fn empty_options() {
        let e = err(
            r#"{"id": "r17", "state": "", "questions": [{"prompt": "p", "options": ["a"]}, {"prompt": "p", "options": []}]}"#,
        );
        assert_eq!(
            e.to_string(),
            "record at line 7 (`r17`): field `questions[1].options`: must not be empty"
        );
        assert_record_err(e, Some("r17"), "questions[1].options");
    }

    #[test]
    fn ill_typed_option() {
        assert_record_err(
            err(
                r#"{"id": "r1", "state": "", "questions": [{"prompt": "p", "options": ["a", "b", 3]}]}"#,
            ),
            Some("r1"),
            "questions[0].options[2]",
        );
    }

    #[test]
    fn options_not_a_list() {
        assert_record_err(
            err(r#"{"id": "r1", "state": "", "questions": [{"prompt": "p", "options": "a"}]}"#),
            Some("r1"),
            "questions[0].options",
        );
    }

    #[test]
    fn ill_typed_record_id() {
        assert_record_err(
            err(r#"{"id": 17, "state": "", "questions": []}"#),
            None,
            "id",
        );
    }

    #[test]
    fn ill_typed_question_id() {
        assert_record_err(
            err(
                r#"{"id": "r1", "state": "", "questions": [{"id": 1, "prompt": "p", "options": ["a"]}]}"#,
            ),
            Some("r1"),
            "questions[0].id",
        );
    }

    #[test]
    fn unknown_record_field() {
        let e = err(r#"{"id": "r1", "state": "", "questions": [], "extra": 1}"#);
        assert!(e.to_string().contains("unknown field"));
        assert_record_err(e, Some("r1"), "extra");
    }

    #[test]
    fn unknown_question_field() {
        assert_record_err(
            err(
                r#"{"id": "r1", "state": "", "questions": [{"prompt": "p", "options": ["a"], "label": 0}]}"#,
            ),
            Some("r1"),
            "questions[0].label",
        );
    }

    #[test]
    fn answer_not_an_integer() {
        for bad in ["1.5", "-1", "\"1\"", "true"] {
            let s = format!(
                r#"{{"id": "r1", "state": "", "questions": [{{"prompt": "p", "options": ["a", "b"], "answer": {bad}}}]}}"#
            );
            assert_record_err(err(&s), Some("r1"), "questions[0].answer");
        }
    }

    #[test]
    fn answer_out_of_range() {
        let e = err(
            r#"{"id": "r1", "state": "", "questions": [{"prompt": "p", "options": ["a", "b"], "answer": 2}]}"#,
        );
        assert!(e.to_string().contains("2 is out of range for 2 options"));
        assert_record_err(e, Some("r1"), "questions[0].answer");
    }

    #[test]
    fn validate_records_built_in_code() {
        let mut r = Record {
            id: Some("c".into()),
            state: String::new(),
            questions: vec![Question {
                id: None,
                prompt: "p".into(),
                options: vec!["a".into()],
                answer: Some(0),
            }],
        };
        r.validate().unwrap();
        r.questions[0].answer = Some(1);
        match r.validate().unwrap_err() {
            Error::Record {
                line, id, field, ..
            } => {
                assert_eq!(line, None);
                assert_eq!(id.as_deref(), Some("c"));
                assert_eq!(field, "questions[0].answer");
            }
            e => panic!("{e:?}"),
        }
        r.questions.clear();
        assert!(r
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("record (`c`): field `questions`"));
    }

    #[test]
    fn serde_round_trip() {
        let r = Record::from_json_str(
            r#"{"id": "r", "state": "s", "questions": [{"prompt": "p", "options": ["a", "b"], "answer": 1}]}"#,
            None,
        )
        .unwrap();
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(Record::from_json_str(&s, None).unwrap(), r);
    }

    #[test]
    fn jsonl_reports_blank_lines_and_counts_lines() {
        let input = "\u{feff}{\"state\": \"a\", \"questions\": [{\"prompt\": \"p\", \"options\": [\"x\"]}]}\n\
                     \n   \t\n\
                     {\"id\": \"bad\", \"state\": 1}\r\n\
                     {\"state\": \"b\", \"questions\": [{\"prompt\": \"p\", \"options\": [\"x\"]}]}\n";
        let items: Vec<_> = JsonlRecords::new(input.as_bytes(), "in.jsonl").collect();
        let lines: Vec<usize> = items.iter().map(|(l, _)| *l).collect();
        assert_eq!(lines, [1, 2, 3, 4, 5]);
        assert_eq!(items[0].1.as_ref().unwrap().state, "a");
        for blank in &items[1..3] {
            let msg = blank.1.as_ref().unwrap_err().to_string();
            assert!(
                msg.starts_with(&format!("record at line {}: blank line", blank.0)),
                "{msg}"
            );
        }
        match &items[3].1 {
            Err(Error::Record {
                line, id, field, ..
            }) => {
                assert_eq!(*line, Some(4));
                assert_eq!(id.as_deref(), Some("bad"));
                assert_eq!(field, "state");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(items[4].1.as_ref().unwrap().state, "b");
    }

    #[test]
    fn jsonl_overlong_line_is_reported_without_being_kept() {
        let good = r#"{"state": "b", "questions": [{"prompt": "p", "options": ["x"]}]}"#;
        let input = format!("{}\n{good}\n{}", "x".repeat(10_000), "y".repeat(500));
        let reader = std::io::BufReader::with_capacity(64, input.as_bytes());
        let mut records = JsonlRecords::new(reader, "in.jsonl").with_max_line_bytes(100);
        let (line, first) = records.next().unwrap();
        assert_eq!(line, 1);
        let msg = first.unwrap_err().to_string();
        assert_eq!(
            msg,
            "record at line 1: line is longer than 100 bytes (the reader's limit)"
        );
        assert!(records.buf.capacity() <= 200, "{}", records.buf.capacity());
        assert!(records.next().unwrap().1.is_ok());
        assert!(records.next().unwrap().1.is_err());
        assert!(records.next().is_none());
        // An endless line (as from `/dev/zero`) is one error as soon as the limit is passed, in
        // bounded memory, with the rest of the input unread.
        let zeros = std::io::BufReader::new(std::io::Read::take(std::io::repeat(0), 1 << 24));
        let mut records = JsonlRecords::new(zeros, "/dev/zero").with_max_line_bytes(1 << 10);
        assert!(records.next().unwrap().1.is_err());
        assert!(records.buf.capacity() <= 1 << 12);
        let unread = records.reader.get_ref().limit();
        assert!(
            unread >= (1 << 24) - (1 << 14),
            "{unread} bytes left unread"
        );
        // Reading on skips the rest of that line: the input ends with no more lines.
        assert!(records.next().is_none());
    }

    #[test]
    fn json_syntax_error_names_one_line_and_the_column() {
        let msg = Record::from_json_str(r#"{"state": }"#, Some(9))
            .unwrap_err()
            .to_string();
        assert!(
            msg.starts_with("record at line 9: not valid JSON at column 11: "),
            "{msg}"
        );
        assert!(!msg.contains("line 1"), "{msg}");
    }

    #[test]
    fn duplicate_keys_are_refused() {
        for text in [
            r#"{"state": "a", "state": "b", "questions": [{"prompt": "p", "options": ["x"]}]}"#,
            r#"{"state": "a", "questions": [{"prompt": "p", "answer": 0, "options": ["x"], "answer": 0}]}"#,
        ] {
            let msg = Record::from_json_str(text, Some(2))
                .unwrap_err()
                .to_string();
            assert!(msg.starts_with("record at line 2: not valid JSON"), "{msg}");
            assert!(msg.contains("duplicate key"), "{msg}");
        }
    }

    #[test]
    fn jsonl_invalid_utf8_is_a_record_error() {
        let input: &[u8] = b"\xff\xfe\n{\"state\": \"b\", \"questions\": [{\"prompt\": \"p\", \"options\": [\"x\"]}]}\n";
        let items: Vec<_> = JsonlRecords::new(input, "in.jsonl").collect();
        assert_eq!(items.len(), 2);
        assert!(matches!(
            items[0].1,
            Err(Error::Record { line: Some(1), .. })
        ));
        assert!(items[1].1.is_ok());
    }

    struct FailingReader;
    impl std::io::Read for FailingReader {
        fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
            Err(std::io::Error::other("disk on fire"))
        }
    }

    #[test]
    fn jsonl_io_error_names_the_source_and_stops() {
        let reader = std::io::BufReader::new(FailingReader);
        let items: Vec<_> = JsonlRecords::new(reader, "data/in.jsonl").collect();
        assert_eq!(items.len(), 1);
        match &items[0].1 {
            Err(Error::Io { path, .. }) => assert_eq!(path, &PathBuf::from("data/in.jsonl")),
            other => panic!("{other:?}"),
        }
    }
}
