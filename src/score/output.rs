//! Where the scores go, written so that nothing is lost and nothing but the target is touched.
//!
//! - `-` is stdout, written as records are scored.
//! - A regular file (or a path that does not exist yet) is written to `.NAME.partial` beside it
//!   and renamed over it once everything is written and synced: readers see the old file or the
//!   whole new one, never a part. The new file gets the old one's mode, and its owner and group
//!   where the process may set them. The partial file is what `--resume` continues from.
//! - Anything else (a character device such as `/dev/null`, a FIFO, a block device) is opened
//!   and written through, never replaced by a regular file.
//! - A symlink is followed to its final target, which is then handled as above: a regular file
//!   is replaced through a partial file beside the *resolved* target (the link stays a link,
//!   pointing at the new file), a device or FIFO is written through, a missing target is
//!   created (as a shell's `>` would).
//!
//! Every failure (opening, writing, syncing, renaming; ENOSPC, EIO, a closed pipe) is a
//! [`ScoreError::Output`] naming the target as given.

use std::fs::{File, Metadata, OpenOptions};
use std::io::{self, BufRead, BufReader, BufWriter, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::ScoreError;

/// Symlinks followed before giving up (Linux's own limit).
const MAX_LINKS: usize = 40;
const BUF_BYTES: usize = 1 << 16;

/// How a target will be written, decided from what it is when the run starts.
#[derive(Debug, Clone)]
pub struct OutputPlan {
    target: PathBuf,
    kind: PlanKind,
}

#[derive(Debug, Clone)]
enum PlanKind {
    Stdout,
    /// Not a regular file: opened for writing as it is.
    Through {
        resolved: PathBuf,
    },
    /// A regular file or a new one: written beside `dest` (symlinks resolved) and renamed.
    Replace {
        dest: PathBuf,
        partial: PathBuf,
        existing: Option<ExistingFile>,
    },
}

/// What the replaced file's successor inherits.
#[derive(Debug, Clone, Copy)]
struct ExistingFile {
    mode: u32,
    uid: u32,
    gid: u32,
}

impl OutputPlan {
    /// Looks at `target` (`-` for stdout) and decides how to write it. Fails when it is a
    /// folder, a symlink loop, or a regular file that is not writable (replacing a file that the
    /// user made read-only would override that choice).
    pub fn new(target: impl AsRef<Path>) -> Result<Self, ScoreError> {
        let target = target.as_ref().to_path_buf();
        if target == Path::new("-") {
            return Ok(OutputPlan {
                target,
                kind: PlanKind::Stdout,
            });
        }
        let err = |step: &str, e| ScoreError::output(&target, step, e);
        let (resolved, meta) = resolve(&target).map_err(|e| err("resolving the path", e))?;
        let kind = match meta {
            Some(m) if m.is_dir() => {
                return Err(err(
                    "it is a folder",
                    io::Error::from(io::ErrorKind::IsADirectory),
                ))
            }
            Some(m) if !m.file_type().is_file() => PlanKind::Through { resolved },
            meta => {
                if meta.is_some() {
                    // Opening for writing without truncating changes nothing, and fails as the
                    // shell's `>` would on a file the user cannot write.
                    OpenOptions::new()
                        .write(true)
                        .open(&resolved)
                        .map_err(|e| err("the file is not writable", e))?;
                }
                let partial = partial_path(&resolved).ok_or_else(|| {
                    err(
                        "it is not a file path",
                        io::Error::from(io::ErrorKind::InvalidInput),
                    )
                })?;
                PlanKind::Replace {
                    dest: resolved,
                    partial,
                    existing: meta.map(|m| ExistingFile {
                        mode: m.mode() & 0o7777,
                        uid: m.uid(),
                        gid: m.gid(),
                    }),
                }
            }
        };
        Ok(OutputPlan { target, kind })
    }

    /// The target as given.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// True when the target is replaced by a rename at the end (regular files and new paths).
    pub fn is_replace(&self) -> bool {
        matches!(self.kind, PlanKind::Replace { .. })
    }

    /// True for stdout.
    pub fn is_stdout(&self) -> bool {
        matches!(self.kind, PlanKind::Stdout)
    }

    /// The partial file beside the (resolved) target, for targets that are replaced.
    pub fn partial_path(&self) -> Option<&Path> {
        match &self.kind {
            PlanKind::Replace { partial, .. } => Some(partial),
            _ => None,
        }
    }

    /// The file finally written: the target with its symlinks resolved (`None` for stdout).
    pub fn resolved(&self) -> Option<&Path> {
        match &self.kind {
            PlanKind::Stdout => None,
            PlanKind::Through { resolved } => Some(resolved),
            PlanKind::Replace { dest, .. } => Some(dest),
        }
    }

    /// Opens the output afresh. For a replaced target this creates (or empties) the partial
    /// file; for a write-through target it opens the target itself, which for a FIFO waits for
    /// a reader.
    pub fn open(&self) -> Result<Output, ScoreError> {
        self.open_inner(None).map(|(out, _)| out)
    }

    /// Opens a replaced target's partial file to continue it: keeps its complete lines, rounded
    /// down to a multiple of `align` (the batch size, so that the records rescored form the same
    /// batches as in an uninterrupted run), drops the rest (a torn last line included), and
    /// returns the output positioned after them with the number of lines kept. A missing
    /// partial file is created (nothing to resume: 0 lines). Stdout and write-through targets
    /// cannot be resumed.
    pub fn open_resume(&self, align: usize) -> Result<(Output, u64), ScoreError> {
        self.open_inner(Some(align.max(1)))
    }

    fn open_inner(&self, resume: Option<usize>) -> Result<(Output, u64), ScoreError> {
        let target = &self.target;
        let err = |step: String, e| ScoreError::output(target, step, e);
        match &self.kind {
            PlanKind::Stdout | PlanKind::Through { .. } if resume.is_some() => {
                Err(ScoreError::Resume {
                    partial: target.clone(),
                    message: "only a regular file (or a new path) as the output can be resumed"
                        .into(),
                })
            }
            PlanKind::Stdout => Ok((
                Output {
                    target: target.clone(),
                    sink: Sink::Stdout(BufWriter::with_capacity(BUF_BYTES, io::stdout())),
                    lines: 0,
                },
                0,
            )),
            PlanKind::Through { resolved } => {
                let file = OpenOptions::new()
                    .write(true)
                    .open(resolved)
                    .map_err(|e| err("opening it for writing".into(), e))?;
                let meta = file
                    .metadata()
                    .map_err(|e| err("reading its type".into(), e))?;
                if meta.is_file() {
                    // It became a regular file since the plan: never write a regular file in
                    // place (a failure would leave it half written).
                    return Err(err(
                        "it became a regular file while the run started".into(),
                        io::Error::from(io::ErrorKind::InvalidInput),
                    ));
                }
                Ok((
                    Output {
                        target: target.clone(),
                        sink: Sink::Through(BufWriter::with_capacity(BUF_BYTES, file)),
                        lines: 0,
                    },
                    0,
                ))
            }
            PlanKind::Replace {
                dest,
                partial,
                existing,
            } => {
                let step = |what: &str| format!("{what} `{}`", partial.display());
                let existed = match std::fs::symlink_metadata(partial) {
                    Ok(m) if !m.is_file() => {
                        return Err(err(
                            step("the partial file is not a regular file:"),
                            io::Error::from(io::ErrorKind::AlreadyExists),
                        ))
                    }
                    Ok(_) => true,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => false,
                    Err(e) => return Err(err(step("looking at"), e)),
                };
                let mut file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(partial)
                    .map_err(|e| err(step("creating"), e))?;
                match file.try_lock() {
                    Ok(()) => {}
                    Err(std::fs::TryLockError::WouldBlock) => {
                        return Err(err(
                            step("another run is writing"),
                            io::Error::from(io::ErrorKind::WouldBlock),
                        ))
                    }
                    Err(std::fs::TryLockError::Error(e)) => return Err(err(step("locking"), e)),
                }
                if let Some(old) = existing {
                    inherit(&file, old).map_err(|e| err(step("setting the mode of"), e))?;
                }
                let kept = match resume {
                    Some(align) if existed => {
                        let (lines, bytes) = complete_lines(&file, align, u64::MAX)
                            .map_err(|e| err(step("reading"), e))?;
                        file.set_len(bytes)
                            .map_err(|e| err(step("truncating"), e))?;
                        file.seek(SeekFrom::End(0))
                            .map_err(|e| err(step("seeking in"), e))?;
                        lines
                    }
                    _ => {
                        file.set_len(0).map_err(|e| err(step("emptying"), e))?;
                        0
                    }
                };
                Ok((
                    Output {
                        target: target.clone(),
                        sink: Sink::Replace {
                            writer: BufWriter::with_capacity(BUF_BYTES, file),
                            dest: dest.clone(),
                            partial: partial.clone(),
                            // An old partial file emptied by a fresh run holds nothing either.
                            remove_unused: !existed || resume.is_none(),
                        },
                        lines: kept,
                    },
                    kept,
                ))
            }
        }
    }
}

/// An open output: lines go in with [`Output::write_line`]; [`Output::finish`] makes them
/// final. Dropped without `finish`, a partial file is kept for `--resume` when it holds lines,
/// and removed when it holds none and was created or emptied by this run.
#[derive(Debug)]
pub struct Output {
    target: PathBuf,
    sink: Sink,
    lines: u64,
}

#[derive(Debug)]
enum Sink {
    Stdout(BufWriter<io::Stdout>),
    Through(BufWriter<File>),
    Replace {
        writer: BufWriter<File>,
        dest: PathBuf,
        partial: PathBuf,
        remove_unused: bool,
    },
    Done,
}

/// `.NAME.partial.run` beside the partial file `.NAME.partial`: what wrote it
/// ([`Output::claim`]).
fn run_path(partial: &Path) -> PathBuf {
    let mut name = partial.as_os_str().to_owned();
    name.push(".run");
    PathBuf::from(name)
}

impl Output {
    /// Ties a replaced target's partial file to the run writing it: `run` (the model and the
    /// settings its numbers depend on, [`super::Scorer::run_identity`]) is kept in
    /// `.NAME.partial.run` beside it, written before any line. A resumed partial file with lines
    /// is continued only by a run whose `run` is equal; one with another, or with none
    /// recorded, is [`ScoreError::Resume`] naming what differs. Nothing for other targets.
    pub fn claim(&mut self, run: &serde_json::Value) -> Result<(), ScoreError> {
        let Sink::Replace { partial, .. } = &self.sink else {
            return Ok(());
        };
        let path = run_path(partial);
        let refuse = |message: String| ScoreError::Resume {
            partial: partial.clone(),
            message: format!("{message}; run without --resume to start afresh"),
        };
        if self.lines > 0 {
            let text = match std::fs::read_to_string(&path) {
                Ok(t) => t,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    return Err(refuse(format!(
                        "it does not record what wrote it (`{}` is missing), so it may be another model's output",
                        path.display()
                    )))
                }
                Err(e) => {
                    return Err(ScoreError::output(
                        &self.target,
                        format!("reading `{}`", path.display()),
                        e,
                    ))
                }
            };
            let theirs: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
            if &theirs != run {
                return Err(refuse(format!(
                    "it was written with another model or settings ({})",
                    differences(&theirs, run)
                )));
            }
            return Ok(());
        }
        std::fs::write(&path, format!("{run}\n")).map_err(|e| {
            ScoreError::output(&self.target, format!("writing `{}`", path.display()), e)
        })
    }

    /// The target as given.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Lines in the output so far (resumed lines included).
    pub fn lines(&self) -> u64 {
        self.lines
    }

    /// Writes one line (a newline is added).
    pub fn write_line(&mut self, line: &str) -> Result<(), ScoreError> {
        let result = match &mut self.sink {
            Sink::Stdout(w) => write_line(w, line),
            Sink::Through(w) => write_line(w, line),
            Sink::Replace { writer, .. } => write_line(writer, line),
            Sink::Done => Ok(()),
        };
        result.map_err(|e| self.write_error(e))?;
        self.lines += 1;
        Ok(())
    }

    /// Keeps only the first `lines` lines of a resumed partial file (none past those it holds),
    /// dropping the rest: [`score`](super::score) opens it with every complete line, then learns
    /// from the validation pass where its batches end and keeps whole batches. Before any
    /// [`Output::write_line`]; a target that is not replaced holds no lines and is left as is.
    pub fn keep_lines(&mut self, lines: u64) -> Result<(), ScoreError> {
        if lines >= self.lines {
            return Ok(());
        }
        let target = self.target.clone();
        if let Sink::Replace {
            writer, partial, ..
        } = &mut self.sink
        {
            let step = |what: &str| format!("{what} `{}`", partial.display());
            let err = |what: &str, e| ScoreError::output(&target, step(what), e);
            writer.flush().map_err(|e| err("writing", e))?;
            let file = writer.get_mut();
            let (_, bytes) = complete_lines(file, 1, lines).map_err(|e| err("reading", e))?;
            file.set_len(bytes).map_err(|e| err("truncating", e))?;
            file.seek(SeekFrom::End(0))
                .map_err(|e| err("seeking in", e))?;
        }
        self.lines = lines;
        Ok(())
    }

    fn write_error(&self, e: io::Error) -> ScoreError {
        let step = match &self.sink {
            Sink::Stdout(_) => return stdout_error(&self.target, self.lines, e),
            Sink::Replace { partial, .. } => format!("writing `{}`", partial.display()),
            _ => "writing".into(),
        };
        ScoreError::output(&self.target, step, e)
    }

    /// Flushes everything; a replaced target's partial file is synced to disk, renamed over the
    /// target, and the folder synced so that the rename itself is durable.
    pub fn finish(mut self) -> Result<(), ScoreError> {
        let sink = std::mem::replace(&mut self.sink, Sink::Done);
        let target = self.target.clone();
        let fail = |step: String, e| ScoreError::output(&target, step, e);
        match sink {
            Sink::Stdout(mut w) => w.flush().map_err(|e| stdout_error(&target, self.lines, e)),
            Sink::Through(mut w) => w.flush().map_err(|e| fail("writing".into(), e)),
            Sink::Replace {
                writer,
                dest,
                partial,
                ..
            } => {
                let p = partial.display();
                let file = writer
                    .into_inner()
                    .map_err(|e| fail(format!("writing `{p}`"), e.into_error()))?;
                file.sync_all()
                    .map_err(|e| fail(format!("syncing `{p}`"), e))?;
                // Never rename over something that became a device, FIFO or folder meanwhile.
                match std::fs::symlink_metadata(&dest) {
                    Ok(m) if !m.is_file() => {
                        return Err(fail(
                            format!(
                                "`{}` is no longer a regular file; the output is kept in `{p}`",
                                dest.display()
                            ),
                            io::Error::from(io::ErrorKind::AlreadyExists),
                        ))
                    }
                    _ => {}
                }
                std::fs::rename(&partial, &dest)
                    .map_err(|e| fail(format!("renaming `{p}` over it"), e))?;
                // The output is complete: nothing is left to resume.
                let _ = std::fs::remove_file(run_path(&partial));
                drop(file);
                let dir = match dest.parent() {
                    Some(d) if !d.as_os_str().is_empty() => d,
                    _ => Path::new("."),
                };
                File::open(dir)
                    .and_then(|d| d.sync_all())
                    .map_err(|e| fail(format!("syncing the folder `{}`", dir.display()), e))
            }
            Sink::Done => Ok(()),
        }
    }
}

impl Drop for Output {
    fn drop(&mut self) {
        if let Sink::Replace {
            partial,
            remove_unused,
            ..
        } = &self.sink
        {
            if *remove_unused && self.lines == 0 {
                let _ = std::fs::remove_file(partial);
                let _ = std::fs::remove_file(run_path(partial));
            }
        }
    }
}

/// The fields of two run identities that differ: "`lora_scale`: 1.0 there, 0.0 here".
fn differences(theirs: &serde_json::Value, ours: &serde_json::Value) -> String {
    let (Some(a), Some(b)) = (theirs.as_object(), ours.as_object()) else {
        return format!("{theirs} there, {ours} here");
    };
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| {
            let show = |v: Option<&serde_json::Value>| v.map_or("none".into(), |v| v.to_string());
            format!("`{k}`: {} there, {} here", show(a.get(k)), show(b.get(k)))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// A broken pipe means the reader left before the end: the output is incomplete, so it is an
/// error like any other, said plainly.
fn stdout_error(target: &Path, lines: u64, e: io::Error) -> ScoreError {
    let step = if e.kind() == io::ErrorKind::BrokenPipe {
        format!("stdout was closed by its reader after at most {lines} lines")
    } else {
        "writing to stdout".into()
    };
    ScoreError::output(target, step, e)
}

fn write_line(w: &mut impl Write, line: &str) -> io::Result<()> {
    w.write_all(line.as_bytes())?;
    w.write_all(b"\n")
}

/// Follows symlinks to the final path; returns it with its metadata (`None` if it does not
/// exist).
fn resolve(target: &Path) -> io::Result<(PathBuf, Option<Metadata>)> {
    let mut path = target.to_path_buf();
    for _ in 0..=MAX_LINKS {
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_symlink() => {
                let link = std::fs::read_link(&path)?;
                path = match path.parent() {
                    Some(dir) if link.is_relative() => dir.join(link),
                    _ => link,
                };
            }
            Ok(m) => return Ok((path, Some(m))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((path, None)),
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::other(format!(
        "more than {MAX_LINKS} levels of symbolic links"
    )))
}

/// `.NAME.partial` beside `path`.
fn partial_path(path: &Path) -> Option<PathBuf> {
    let name = path.file_name()?;
    let mut partial = std::ffi::OsString::from(".");
    partial.push(name);
    partial.push(".partial");
    Some(path.with_file_name(partial))
}

/// Gives `file` the replaced file's owner and group (where allowed: root may set both, a user
/// may set a group it belongs to), then its mode (after the owner, which may clear set-id bits).
fn inherit(file: &File, old: &ExistingFile) -> io::Result<()> {
    let meta = file.metadata()?;
    if (meta.uid(), meta.gid()) != (old.uid, old.gid)
        && std::os::unix::fs::fchown(file, Some(old.uid), Some(old.gid)).is_err()
    {
        let _ = std::os::unix::fs::fchown(file, None, Some(old.gid));
    }
    file.set_permissions(std::fs::Permissions::from_mode(old.mode))
}

/// Complete lines at the start of `file`, at most `limit`, rounded down to a multiple of
/// `align`, and the byte length they take.
fn complete_lines(file: &File, align: usize, limit: u64) -> io::Result<(u64, u64)> {
    let mut reader = BufReader::with_capacity(BUF_BYTES, file);
    reader.seek(SeekFrom::Start(0))?;
    let align = align as u64;
    let (mut lines, mut bytes) = (0u64, 0u64);
    let (mut kept_lines, mut kept_bytes) = (0u64, 0u64);
    loop {
        let buf = reader.fill_buf()?;
        if buf.is_empty() {
            break;
        }
        let n = buf.len();
        let mut start = 0;
        while let Some(i) = buf[start..].iter().position(|&b| b == b'\n') {
            if lines == limit {
                return Ok((kept_lines, kept_bytes));
            }
            start += i + 1;
            lines += 1;
            if lines % align == 0 {
                kept_lines = lines;
                kept_bytes = bytes + start as u64;
            }
        }
        bytes += n as u64;
        reader.consume(n);
    }
    Ok((kept_lines, kept_bytes))
}
