//! `OutputPlan` / `Output`: regular files are replaced by a rename and keep their permissions;
//! devices, FIFOs and symlinks' non-regular targets are written through and stay what they are;
//! every failure names the target.

use std::io::Read;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;

use kev::score::{OutputPlan, ScoreError};

fn write_all(plan: &OutputPlan, lines: &[&str]) -> Result<(), ScoreError> {
    let mut out = plan.open()?;
    for l in lines {
        out.write_line(l)?;
    }
    out.finish()
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().mode() & 0o7777
}

/// Files of `dir` other than `keep`: nothing is left behind.
fn leftovers(dir: &Path, keep: &[&str]) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !keep.contains(&n.as_str()))
        .collect()
}

fn assert_names_target(err: &ScoreError, target: &Path) {
    let msg = err.to_string();
    assert!(
        matches!(err, ScoreError::Output { .. }),
        "expected an output error, got {err:?}"
    );
    assert!(
        msg.contains(&format!("`{}`", target.display())),
        "the message names the target: {msg}"
    );
}

#[test]
fn regular_file_is_replaced_and_keeps_its_mode() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("out.jsonl");
    std::fs::write(&target, "old\n").unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o640)).unwrap();
    let ino_before = std::fs::metadata(&target).unwrap().ino();
    let plan = OutputPlan::new(&target).unwrap();
    assert!(plan.is_replace());
    assert_eq!(
        plan.partial_path().unwrap(),
        dir.path().join(".out.jsonl.partial")
    );
    write_all(&plan, &["a", "b"]).unwrap();
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "a\nb\n");
    assert_eq!(mode(&target), 0o640);
    // Replaced by a rename, not rewritten in place.
    assert_ne!(std::fs::metadata(&target).unwrap().ino(), ino_before);
    assert_eq!(leftovers(dir.path(), &["out.jsonl"]), Vec::<String>::new());
}

#[test]
fn replaced_file_keeps_its_owner_and_group() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("owned.jsonl");
    std::fs::write(&target, "old\n").unwrap();
    // Root can hand the file to another user first; anyone else checks that its own
    // ownership survives.
    let _ = std::os::unix::fs::chown(&target, Some(65534), Some(65534));
    let before = std::fs::metadata(&target).unwrap();
    write_all(&OutputPlan::new(&target).unwrap(), &["x"]).unwrap();
    let after = std::fs::metadata(&target).unwrap();
    assert_eq!(
        (after.uid(), after.gid()),
        (before.uid(), before.gid()),
        "owner and group"
    );
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "x\n");
}

#[test]
fn new_file_is_created_by_the_rename() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("new.jsonl");
    write_all(&OutputPlan::new(&target).unwrap(), &["only"]).unwrap();
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "only\n");
    assert_eq!(leftovers(dir.path(), &["new.jsonl"]), Vec::<String>::new());
}

#[test]
fn dev_null_is_written_through_and_stays_a_device() {
    let plan = OutputPlan::new("/dev/null").unwrap();
    assert!(!plan.is_replace(), "/dev/null must not be replaced");
    assert!(plan.partial_path().is_none());
    write_all(&plan, &["a", "b"]).unwrap();
    let meta = std::fs::symlink_metadata("/dev/null").unwrap();
    assert!(
        meta.file_type().is_char_device(),
        "/dev/null is still a character device"
    );
    assert!(!Path::new("/dev/.null.partial").exists());
}

#[test]
fn fifo_is_written_through() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("pipe");
    let status = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo runs");
    assert!(status.success());
    let plan = OutputPlan::new(&fifo).unwrap();
    assert!(!plan.is_replace());
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || {
            let mut s = String::new();
            std::fs::File::open(fifo)
                .unwrap()
                .read_to_string(&mut s)
                .unwrap();
            s
        })
    };
    write_all(&plan, &["one", "two"]).unwrap();
    assert_eq!(reader.join().unwrap(), "one\ntwo\n");
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
    assert_eq!(leftovers(dir.path(), &["pipe"]), Vec::<String>::new());
}

#[test]
fn symlink_to_regular_file_replaces_the_resolved_target_and_stays_a_link() {
    let dir = tempfile::tempdir().unwrap();
    let real = dir.path().join("real.jsonl");
    let link = dir.path().join("link.jsonl");
    std::fs::write(&real, "old\n").unwrap();
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o604)).unwrap();
    std::os::unix::fs::symlink("real.jsonl", &link).unwrap();
    let plan = OutputPlan::new(&link).unwrap();
    assert!(plan.is_replace());
    assert_eq!(plan.resolved().unwrap(), real);
    assert_eq!(
        plan.partial_path().unwrap(),
        dir.path().join(".real.jsonl.partial")
    );
    write_all(&plan, &["new"]).unwrap();
    let link_meta = std::fs::symlink_metadata(&link).unwrap();
    assert!(link_meta.file_type().is_symlink(), "the link stays a link");
    assert_eq!(std::fs::read_link(&link).unwrap(), Path::new("real.jsonl"));
    assert_eq!(std::fs::read_to_string(&real).unwrap(), "new\n");
    assert_eq!(mode(&real), 0o604);
    assert_eq!(
        leftovers(dir.path(), &["real.jsonl", "link.jsonl"]),
        Vec::<String>::new()
    );
}

#[test]
fn symlink_to_a_device_is_written_through() {
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("null-link");
    std::os::unix::fs::symlink("/dev/null", &link).unwrap();
    let plan = OutputPlan::new(&link).unwrap();
    assert!(!plan.is_replace());
    write_all(&plan, &["x"]).unwrap();
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert!(std::fs::metadata("/dev/null")
        .unwrap()
        .file_type()
        .is_char_device());
}

#[test]
fn dangling_symlink_creates_its_target() {
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("link");
    std::os::unix::fs::symlink("made.jsonl", &link).unwrap();
    write_all(&OutputPlan::new(&link).unwrap(), &["x"]).unwrap();
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(
        std::fs::read_to_string(dir.path().join("made.jsonl")).unwrap(),
        "x\n"
    );
}

#[test]
fn symlink_loop_is_an_error_naming_the_target() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    std::os::unix::fs::symlink("b", &a).unwrap();
    std::os::unix::fs::symlink("a", dir.path().join("b")).unwrap();
    let err = OutputPlan::new(&a).unwrap_err();
    assert_names_target(&err, &a);
}

#[test]
fn dev_full_is_an_error_naming_the_target() {
    let target = Path::new("/dev/full");
    let plan = OutputPlan::new(target).unwrap();
    assert!(!plan.is_replace());
    // Few lines: the error comes at the final flush.
    let err = write_all(&plan, &["a"]).unwrap_err();
    assert_names_target(&err, target);
    let ScoreError::Output { source, .. } = &err else {
        unreachable!()
    };
    assert_eq!(source.kind(), std::io::ErrorKind::StorageFull, "{err}");
    // Many lines: the error comes from a write.
    let mut out = plan.open().unwrap();
    let line = "x".repeat(1000);
    let err = (0..1000)
        .try_for_each(|_| out.write_line(&line))
        .unwrap_err();
    assert_names_target(&err, target);
    drop(out);
    assert!(std::fs::metadata(target)
        .unwrap()
        .file_type()
        .is_char_device());
}

#[test]
fn unwritable_folder_is_an_error_naming_the_target() {
    let dir = tempfile::tempdir().unwrap();
    // A read-only folder binds every user but root; root is checked on procfs, where no one
    // can create a file.
    let target = if crate::common::permissions_bypassed(dir.path()) {
        Path::new("/proc/kev-score-test.jsonl").to_path_buf()
    } else {
        let ro = dir.path().join("ro");
        std::fs::create_dir(&ro).unwrap();
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
        ro.join("out.jsonl")
    };
    let err = OutputPlan::new(&target)
        .and_then(|plan| write_all(&plan, &["x"]))
        .unwrap_err();
    assert_names_target(&err, &target);
    assert!(!target.exists());
}

#[test]
fn missing_folder_is_an_error_naming_the_target() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("no/such/dir/out.jsonl");
    let err = OutputPlan::new(&target)
        .and_then(|plan| write_all(&plan, &["x"]))
        .unwrap_err();
    assert_names_target(&err, &target);
}

#[test]
fn folder_as_target_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let err = OutputPlan::new(dir.path()).unwrap_err();
    assert_names_target(&err, dir.path());
}

#[test]
fn a_second_writer_of_the_same_target_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("out.jsonl");
    let plan = OutputPlan::new(&target).unwrap();
    let mut first = plan.open().unwrap();
    first.write_line("a").unwrap();
    let err = plan.open().unwrap_err();
    assert_names_target(&err, &target);
    assert!(err.to_string().contains("another run"), "{err}");
    first.finish().unwrap();
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "a\n");
}

#[test]
fn unfinished_output_keeps_its_lines_for_resume_and_leaves_the_target() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("out.jsonl");
    std::fs::write(&target, "old\n").unwrap();
    let plan = OutputPlan::new(&target).unwrap();
    // Nothing written: the partial file goes away, a stale one from an earlier run too.
    drop(plan.open().unwrap());
    assert!(!plan.partial_path().unwrap().exists());
    std::fs::write(plan.partial_path().unwrap(), "stale\n").unwrap();
    drop(plan.open().unwrap());
    assert!(!plan.partial_path().unwrap().exists());
    // Lines written: they stay for --resume; the target is untouched.
    let mut out = plan.open().unwrap();
    out.write_line("a").unwrap();
    out.write_line("b").unwrap();
    drop(out);
    assert_eq!(
        std::fs::read_to_string(plan.partial_path().unwrap()).unwrap(),
        "a\nb\n"
    );
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "old\n");
}

#[test]
fn resume_keeps_complete_lines_by_whole_batches() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("out.jsonl");
    let plan = OutputPlan::new(&target).unwrap();
    let partial = plan.partial_path().unwrap().to_path_buf();
    for (content, align, kept, bytes) in [
        ("", 1, 0, 0),
        ("a\nb\nc\ntor", 1, 3, 6),
        ("a\nb\nc\ntor", 2, 2, 4),
        ("a\nb\nc\n", 3, 3, 6),
        ("a\nb\n", 3, 0, 0),
    ] {
        std::fs::write(&partial, content).unwrap();
        let (out, lines) = plan.open_resume(align).unwrap();
        assert_eq!(lines, kept, "{content:?} by {align}");
        assert_eq!(out.lines(), kept);
        drop(out);
        if kept > 0 {
            assert_eq!(std::fs::metadata(&partial).unwrap().len(), bytes);
        }
    }
    std::fs::write(&partial, "a\nb\ntorn").unwrap();
    let (mut out, kept) = plan.open_resume(1).unwrap();
    assert_eq!(kept, 2);
    out.write_line("c").unwrap();
    out.finish().unwrap();
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "a\nb\nc\n");
    assert!(!partial.exists());
}

#[test]
fn stdout_and_devices_cannot_be_resumed() {
    for target in ["-", "/dev/null"] {
        let err = OutputPlan::new(target).unwrap().open_resume(1).unwrap_err();
        assert!(matches!(err, ScoreError::Resume { .. }), "{target}: {err}");
    }
}
