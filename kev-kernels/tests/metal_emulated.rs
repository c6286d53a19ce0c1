//! The Metal kernels' logic, run on the CPU: compiles `tests/metal_emu/run_kernels.cpp` (which
//! includes the unchanged `src/<op>/*.metal` against our stand-in `<metal_stdlib>`) with clang
//! and runs it. The driver compares each kernel with a double-precision loop and exits non-zero
//! beyond tolerance. See `tests/metal_emu/README.md` for what this does and does not check.
//!
//! Needs clang ≥ 15 (`_Float16`); a missing clang fails the test rather than skipping it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Compilers tried in order; the first that runs is used. Override with `KEV_EMU_CXX`.
const COMPILERS: &[&str] = &[
    "clang++-16",
    "clang++-17",
    "clang++-18",
    "clang++-19",
    "clang++-15",
    "clang++",
];

fn find_clang() -> String {
    let candidates: Vec<String> = match std::env::var("KEV_EMU_CXX") {
        Ok(cxx) => vec![cxx],
        Err(_) => COMPILERS.iter().map(|s| s.to_string()).collect(),
    };
    for cxx in &candidates {
        if Command::new(cxx)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            return cxx.clone();
        }
    }
    panic!(
        "the Metal emulation test needs clang >= 15 and found none of {candidates:?}: \
         run `scripts/test`, which brings one from PyPI (ziglang), install one (Debian/Ubuntu: `apt-get install clang-16`), or point KEV_EMU_CXX at one"
    )
}

fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: could not start {cmd:?}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    stdout
}

#[test]
fn metal_kernels_match_double_loops_in_emulation() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let emu = root.join("tests/metal_emu");
    let exe: PathBuf = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kev_metal_emu_run_kernels");
    let cxx = find_clang();
    run(
        Command::new(&cxx)
            .args([
                "-std=c++20",
                "-O1",
                "-Wall",
                "-Wno-unknown-attributes",
                // The header turns `threadgroup` into `register` (see metal_stdlib_emu.h).
                "-Wno-register",
                "-I",
            ])
            .arg(emu.join("include"))
            .arg(emu.join("run_kernels.cpp"))
            .arg("-o")
            .arg(&exe),
        &format!("compiling the Metal emulation driver with {cxx}"),
    );
    let stdout = run(&mut Command::new(&exe), "the emulated Metal kernels");
    assert!(stdout.contains("all comparisons passed"), "{stdout}");
}
