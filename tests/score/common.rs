//! Fixtures and helpers shared by the `score` tests.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kev::{DecisionModel, LoadOptions};

pub fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// The shipped small checkpoint, loaded once for the whole binary.
pub fn model() -> &'static DecisionModel {
    static MODEL: OnceLock<DecisionModel> = OnceLock::new();
    MODEL.get_or_init(|| {
        DecisionModel::load(
            fixture("kev-small"),
            &LoadOptions::default().with_backend(kev::Backend::Cpu),
        )
        .expect("the shipped checkpoint loads")
    })
}

/// The shipped records' lines (non-blank).
pub fn record_lines() -> Vec<String> {
    std::fs::read_to_string(fixture("records.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect()
}

/// True when file permissions do not bind this process (root): checked by trying.
pub fn permissions_bypassed(dir: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let probe = dir.join("probe");
    std::fs::create_dir_all(&probe).unwrap();
    std::fs::set_permissions(&probe, std::fs::Permissions::from_mode(0o555)).unwrap();
    let bypassed = std::fs::write(probe.join("x"), b"x").is_ok();
    std::fs::set_permissions(&probe, std::fs::Permissions::from_mode(0o755)).unwrap();
    bypassed
}

/// Writes what a run of [`model`] records beside its partial file `partial`
/// (`.NAME.partial.run`), as a run killed after writing `partial` would have left it.
pub fn write_run_file(partial: &Path) {
    use kev::score::Scorer;
    let mut run = partial.as_os_str().to_owned();
    run.push(".run");
    std::fs::write(run, model().run_identity().to_string()).unwrap();
}
