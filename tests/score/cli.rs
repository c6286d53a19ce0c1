//! The built `score` example, end to end: exit codes and what reaches the output. `cargo test`
//! builds the examples; a targeted run needs `cargo build --release --example score` first.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use kev::score::Scorer;

use crate::common::{fixture, model, record_lines};

/// target/<profile>/deps/<this test> → target/<profile>/examples/score.
fn score_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .unwrap()
        .join("examples/score");
    assert!(
        bin.is_file(),
        "{} is missing: build it with `cargo build --release --example score` (cargo test builds it)",
        bin.display()
    );
    bin
}

fn score(args: &[&str]) -> Output {
    Command::new(score_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn default_run_scores_every_record_to_stdout() {
    let out = score(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout.clone()).unwrap();
    assert_eq!(text.lines().count(), record_lines().len());
    let err = stderr(&out);
    assert!(
        err.contains("records: 12, questions: 21, skipped: 0"),
        "{err}"
    );
}

#[test]
fn stdin_input_gives_the_file_input_bytes() {
    let from_file = score(&["--batch-size", "3"]);
    assert_eq!(from_file.status.code(), Some(0));
    let mut child = Command::new(score_bin())
        .args(["--records", "-", "--batch-size", "3"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let records = std::fs::read(fixture("records.jsonl")).unwrap();
    child.stdin.take().unwrap().write_all(&records).unwrap();
    let from_stdin = child.wait_with_output().unwrap();
    assert_eq!(from_stdin.status.code(), Some(0), "{}", stderr(&from_stdin));
    assert_eq!(from_stdin.stdout, from_file.stdout);
}

#[test]
fn negative_lora_scale_reaches_the_loader() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("out.jsonl");
    let target = target.to_str().unwrap();
    let out = score(&["--lora-scale", "-1", "--out", target]);
    let err = stderr(&out);
    // Parsed: whatever the loader decides of -1, it is not a command-line error.
    assert_ne!(out.status.code(), Some(2), "{err}");
    assert!(!err.contains("unexpected argument"), "{err}");
    let out = score(&["--lora-scale=-0.5", "--out", target]);
    assert_ne!(out.status.code(), Some(2), "{}", stderr(&out));
}

#[test]
fn dev_full_fails_naming_the_target() {
    let out = score(&["--out", "/dev/full"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot write `/dev/full`"), "{err}");
}

#[test]
fn endless_line_is_refused_at_the_line_limit() {
    // Read once, so copied for the scoring pass: the copy and the read stop at the line limit.
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(score_bin())
        .args(["--records", "/dev/zero"])
        .env("TMPDIR", tmp.path())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("line 1: line is longer than 67108864 bytes"),
        "{err}"
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn full_stdout_fails() {
    let out = Command::new(score_bin())
        .stdout(
            std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/full")
                .unwrap(),
        )
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot write `-`"), "{err}");
}

#[test]
fn closed_stdout_pipe_is_a_failure() {
    let mut child = Command::new(score_bin())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The reader goes away before the first line (the model loads first).
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("closed by its reader"), "{err}");
}

#[test]
fn invalid_record_exits_1_names_the_line_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut lines = record_lines();
    lines[4] = r#"{"id": "r5", "state": "s", "questions": [{"prompt": "p", "options": ["a"], "answer": 3}]}"#.into();
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, lines.join("\n")).unwrap();
    let target = dir.path().join("out.jsonl");
    let args = [
        "--records",
        input.to_str().unwrap(),
        "--out",
        target.to_str().unwrap(),
    ];
    let out = score(&args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("line 5"), "{err}");
    assert!(!target.exists());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "only the input is left"
    );

    let out = score(&[&args[..], &["--skip-invalid"]].concat());
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("skipping: record at line 5"), "{err}");
    assert!(
        err.contains("records: 11, questions: 20, skipped: 1"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(&target).unwrap().lines().count(),
        11
    );
}

#[test]
fn resume_to_stdout_is_refused() {
    let out = score(&["--resume"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot resume"), "{err}");
}

#[test]
fn interrupted_run_resumes_to_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("full.jsonl");
    let out = score(&["--batch-size", "2", "--out", full.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let full = std::fs::read(full).unwrap();
    let target = dir.path().join("out.jsonl");
    // As a killed run leaves it: five lines and a torn sixth.
    let cut = full
        .iter()
        .enumerate()
        .filter(|(_, &b)| b == b'\n')
        .nth(4)
        .unwrap()
        .0
        + 10;
    std::fs::write(dir.path().join(".out.jsonl.partial"), &full[..cut]).unwrap();
    // What the killed run recorded beside it: the shipped checkpoint, default settings.
    std::fs::write(
        dir.path().join(".out.jsonl.partial.run"),
        model().run_identity().to_string(),
    )
    .unwrap();
    let out = score(&[
        "--batch-size",
        "2",
        "--resume",
        "--out",
        target.to_str().unwrap(),
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("records: 12 (4 resumed)"), "{err}");
    assert_eq!(std::fs::read(&target).unwrap(), full);
    assert!(!dir.path().join(".out.jsonl.partial.run").exists());
}

/// A partial output continues only with the model and settings that wrote it: another
/// `--lora-scale` or `--checkpoint`, or a partial file that records no run, is refused (exit 1,
/// naming what differs) and the partial file keeps its complete lines.
#[test]
fn resume_with_another_model_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("full.jsonl");
    let out = score(&["--out", full.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let full = std::fs::read(full).unwrap();
    let half = full.len() / 2;
    let partial = dir.path().join(".out.jsonl.partial");
    let run = dir.path().join(".out.jsonl.partial.run");
    let target = dir.path().join("out.jsonl");
    std::fs::write(&partial, &full[..half]).unwrap();
    std::fs::write(&run, model().run_identity().to_string()).unwrap();
    let rslora = fixture("kev-rslora");
    let cases: [(&[&str], &str); 2] = [
        (&["--lora-scale", "0"], "`lora_scale`: 1.0 there, 0.0 here"),
        (&["--checkpoint", rslora.to_str().unwrap()], "`checkpoint`"),
    ];
    for (args, names) in cases {
        let mut all = args.to_vec();
        all.extend(["--resume", "--out", target.to_str().unwrap()]);
        let out = score(&all);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("cannot resume") && err.contains(names),
            "{args:?}: {err}"
        );
        let kept = std::fs::read(&partial).unwrap();
        assert!(!kept.is_empty() && full.starts_with(&kept) && kept.ends_with(b"\n"));
        assert!(!target.exists());
    }
    std::fs::remove_file(&run).unwrap();
    let out = score(&["--resume", "--out", target.to_str().unwrap()]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("does not record what wrote it"), "{err}");
}

#[test]
fn bad_batch_size_is_a_usage_error() {
    let out = score(&["--batch-size", "0"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}
