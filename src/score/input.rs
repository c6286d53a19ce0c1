//! The records input, read twice: once to validate, once to score.
//!
//! A regular file is simply opened twice. Anything that can be read only once (stdin as `-`, a
//! FIFO, `/dev/stdin`, a shell's `<(...)`) is copied during the validation pass into an
//! unlinked temporary file in the system's temporary folder (`$TMPDIR`), which the scoring pass
//! then reads; it takes disk, not memory, and disappears with the process. The copy keeps at
//! most one byte past the line limit of each line (enough for the scoring pass to see the line
//! as too long), so a line costs at most the limit in disk however long it runs.

use std::cell::Cell;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::ScoreError;

const BUF_BYTES: usize = 1 << 16;

/// An input opened for its two passes.
pub(crate) struct Source {
    name: PathBuf,
    kind: Kind,
}

enum Kind {
    /// A regular file of this size when the validation pass began.
    File { len: u64 },
    /// Read once; copied to `spool` as it is read.
    Once {
        reader: Box<dyn Read>,
        spool: Option<File>,
    },
}

/// The validation pass's reader: counts the bytes read (for progress) and copies them to the
/// spool file when the input is read only once. A failure to copy is kept apart so that it is
/// not reported as a failure to read the input.
pub(crate) struct FirstPass<'a> {
    inner: Box<dyn Read + 'a>,
    spool: Option<BufWriter<File>>,
    pub(crate) spool_error: Option<io::Error>,
    /// Bytes of the current line seen so far (the copy keeps at most `MAX_LINE_BYTES + 1`).
    line_bytes: usize,
    read: Rc<Cell<u64>>,
}

/// The reader's line limit, which the copy keeps to.
const MAX_LINE_BYTES: usize = kev_core::DEFAULT_MAX_LINE_BYTES;

impl Read for FirstPass<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(spool) = &mut self.spool {
            if let Err(e) = copy_bounded(spool, &buf[..n], &mut self.line_bytes, MAX_LINE_BYTES) {
                self.spool_error = Some(e);
                return Err(io::Error::other("the copy of the input failed"));
            }
        }
        self.read.set(self.read.get() + n as u64);
        Ok(n)
    }
}

impl Source {
    /// Opens `path` (`-` for stdin) for the validation pass. Errors are [`kev_core::Error::Io`]
    /// naming the input, or [`ScoreError::Spool`].
    pub(crate) fn open(path: &Path) -> Result<Source, ScoreError> {
        let name = path.to_path_buf();
        let io_err = |e| ScoreError::Kev(kev_core::Error::io(path, e));
        if path == Path::new("-") {
            return Ok(Source {
                kind: Kind::Once {
                    reader: Box::new(io::stdin()),
                    spool: Some(spool_file(path)?),
                },
                name,
            });
        }
        let meta = std::fs::metadata(path).map_err(io_err)?;
        if meta.is_dir() {
            return Err(io_err(io::Error::from(io::ErrorKind::IsADirectory)));
        }
        if meta.is_file() {
            return Ok(Source {
                name,
                kind: Kind::File { len: meta.len() },
            });
        }
        let file = File::open(path).map_err(io_err)?;
        Ok(Source {
            kind: Kind::Once {
                reader: Box::new(file),
                spool: Some(spool_file(path)?),
            },
            name,
        })
    }

    /// The input as given.
    pub(crate) fn name(&self) -> &Path {
        &self.name
    }

    /// The input's size, when known before reading it.
    pub(crate) fn len(&self) -> Option<u64> {
        match self.kind {
            Kind::File { len } => Some(len),
            Kind::Once { .. } => None,
        }
    }

    /// The validation pass's reader and its byte counter.
    pub(crate) fn first_pass(&mut self) -> Result<(FirstPass<'_>, Rc<Cell<u64>>), ScoreError> {
        let read = Rc::new(Cell::new(0));
        let (inner, spool): (Box<dyn Read + '_>, _) = match &mut self.kind {
            Kind::File { .. } => {
                let file = File::open(&self.name)
                    .map_err(|e| ScoreError::Kev(kev_core::Error::io(&self.name, e)))?;
                (Box::new(file), None)
            }
            Kind::Once { reader, spool } => {
                let copy = spool
                    .as_ref()
                    .map(File::try_clone)
                    .transpose()
                    .map_err(|e| self::spool_error(&self.name, e))?
                    .map(|f| BufWriter::with_capacity(BUF_BYTES, f));
                (Box::new(reader), copy)
            }
        };
        Ok((
            FirstPass {
                inner,
                spool,
                spool_error: None,
                line_bytes: 0,
                read: read.clone(),
            },
            read,
        ))
    }

    /// The scoring pass's reader: the file again, or the copy. Call after the first pass's
    /// reader was flushed with [`FirstPass::finish`].
    pub(crate) fn second_pass(&mut self) -> Result<BufReader<File>, ScoreError> {
        let name = self.name.clone();
        match &mut self.kind {
            Kind::File { len } => {
                let file = File::open(&name)
                    .map_err(|e| ScoreError::Kev(kev_core::Error::io(&name, e)))?;
                let now = file
                    .metadata()
                    .map_err(|e| ScoreError::Kev(kev_core::Error::io(&name, e)))?
                    .len();
                if now != *len {
                    return Err(ScoreError::InputChanged {
                        input: name,
                        message: format!("its size went from {len} to {now} bytes"),
                    });
                }
                Ok(BufReader::with_capacity(BUF_BYTES, file))
            }
            Kind::Once { spool, .. } => {
                let mut file = spool.take().expect("the second pass is taken once");
                file.seek(SeekFrom::Start(0))
                    .map_err(|e| self::spool_error(&name, e))?;
                Ok(BufReader::with_capacity(BUF_BYTES, file))
            }
        }
    }
}

impl FirstPass<'_> {
    /// Flushes the copy, if any.
    pub(crate) fn finish(&mut self, name: &Path) -> Result<(), ScoreError> {
        if let Some(e) = self.spool_error.take() {
            return Err(spool_error(name, e));
        }
        if let Some(spool) = &mut self.spool {
            spool.flush().map_err(|e| spool_error(name, e))?;
        }
        Ok(())
    }
}

/// Writes `bytes` to `spool`, keeping at most `max + 1` bytes of each line; `line_bytes`
/// carries the current line's length across calls.
fn copy_bounded(
    spool: &mut impl Write,
    bytes: &[u8],
    line_bytes: &mut usize,
    max: usize,
) -> io::Result<()> {
    let mut rest = bytes;
    while !rest.is_empty() {
        let (part, ended) = match rest.iter().position(|&b| b == b'\n') {
            Some(i) => (&rest[..=i], true),
            None => (rest, false),
        };
        let room = (max + 1).saturating_sub(*line_bytes);
        // The newline itself is always kept, so the copy has the input's line numbers.
        let text = if ended { &part[..part.len() - 1] } else { part };
        spool.write_all(&text[..text.len().min(room)])?;
        if ended {
            spool.write_all(b"\n")?;
            *line_bytes = 0;
        } else {
            *line_bytes = line_bytes.saturating_add(part.len());
        }
        rest = &rest[part.len()..];
    }
    Ok(())
}

pub(crate) fn spool_error(input: &Path, source: io::Error) -> ScoreError {
    ScoreError::Spool {
        input: input.to_path_buf(),
        dir: std::env::temp_dir(),
        source,
    }
}

/// A new file in the temporary folder, unlinked at once: only this process holds it.
fn spool_file(input: &Path) -> Result<File, ScoreError> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let path = dir.join(format!(
        ".kev-score-input-{}-{}-{nanos}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| spool_error(input, e))?;
    std::fs::remove_file(&path).map_err(|e| spool_error(input, e))?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::copy_bounded;

    #[test]
    fn the_copy_keeps_one_byte_past_the_limit_of_each_line() {
        let input = b"ab\nabcdefgh\nabc\nabcdefghij";
        for step in [1, 2, 3, 5, input.len()] {
            let (mut copy, mut line) = (Vec::new(), 0);
            for piece in input.chunks(step) {
                copy_bounded(&mut copy, piece, &mut line, 3).unwrap();
            }
            assert_eq!(copy, b"ab\nabcd\nabc\nabcd", "pieces of {step} bytes");
        }
    }
}
