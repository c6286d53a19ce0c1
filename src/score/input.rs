//! The records input, read twice: once to validate, once to score.
//!
//! A regular file is simply opened twice. Anything that can be read only once (stdin as `-`, a
//! FIFO, `/dev/stdin`, a shell's `<(...)`) is copied during the validation pass into an
//! unlinked temporary file in the system's temporary folder (`$TMPDIR`), which the scoring pass
//! then reads; it takes disk, not memory, and disappears with the process.

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
    read: Rc<Cell<u64>>,
}

impl Read for FirstPass<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(spool) = &mut self.spool {
            if let Err(e) = spool.write_all(&buf[..n]) {
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
