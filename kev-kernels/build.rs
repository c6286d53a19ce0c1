//! Compiles Kev's CUDA sources to machine code for the GPUs named at build time (feature `cuda`),
//! so that a process on such a GPU loads them as they are: compiling them at run time (NVRTC)
//! takes a fresh machine ~15 s, since the driver's cache that would keep the result is empty.
//! A GPU not named here compiles them at run time (NVRTC).
//!
//! `KEV_CUDA_ARCHS` (e.g. `80,86,89,90`) names the compute capabilities; without it
//! `CUDA_COMPUTE_CAP` (as candle's kernels read it), else 80, 86, 89 and 90. nvcc comes from
//! `CUDA_HOME` or the `PATH`; without it the build warns and ships no machine code.

use std::path::{Path, PathBuf};
use std::process::Command;

#[allow(dead_code)]
mod catalog {
    include!("src/backend/cuda/catalog.rs");
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for var in [
        "KEV_CUDA_ARCHS",
        "CUDA_COMPUTE_CAP",
        "CUDA_HOME",
        "CARGO_FEATURE_CUDA",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    watch_sources(Path::new("src"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let images = if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        compile_all(&out)
    } else {
        Vec::new()
    };
    let entries: String = images
        .iter()
        .map(|(module, arch, path)| {
            format!("    ({module:?}, {arch:?}, include_bytes!({path:?})),\n")
        })
        .collect();
    std::fs::write(out.join("cuda_images.rs"), format!("&[\n{entries}]\n"))
        .expect("writing cuda_images.rs");
}

/// Reruns the script when a CUDA source or the catalog changes.
fn watch_sources(dir: &Path) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            watch_sources(&path);
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("cu" | "cuh")
        ) || path.ends_with("catalog.rs")
        {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
}

/// The compute capabilities to build for, as `sm_XY` names.
fn archs() -> Vec<String> {
    let listed = std::env::var("KEV_CUDA_ARCHS")
        .or_else(|_| std::env::var("CUDA_COMPUTE_CAP"))
        .unwrap_or_else(|_| "80,86,89,90".to_string());
    listed
        .split([',', ';', ' '])
        .map(|a| a.trim().trim_start_matches("sm_").trim_end_matches('a'))
        .filter(|a| !a.is_empty())
        .map(|a| format!("sm_{a}"))
        .collect()
}

/// `sm_XY` as the number XY.
fn capability(arch: &str) -> u32 {
    arch.trim_start_matches("sm_").parse().unwrap_or(0)
}

/// Every (source, arch) compiled with nvcc into `out`: (module, arch, image path). Sources with
/// tensor-core kernels only for sm_80 and later, as at run time.
fn compile_all(out: &Path) -> Vec<(String, String, PathBuf)> {
    let nvcc = std::env::var_os("CUDA_HOME")
        .map(|home| PathBuf::from(home).join("bin/nvcc"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let jobs: Vec<(&catalog::Source, String)> = catalog::ALL
        .iter()
        .flat_map(|&source| archs().into_iter().map(move |arch| (source, arch)))
        .filter(|(source, arch)| !source.tensor_cores || capability(arch) >= 80)
        .collect();
    let threads = std::env::var("NUM_JOBS")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(2)
        .max(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((source, arch)) = jobs.get(i) else {
                    break;
                };
                let result = compile(&nvcc, out, source, arch);
                results.lock().unwrap().push((i, result));
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|(i, _)| *i);
    let mut images = Vec::new();
    for (i, result) in results {
        let (source, arch) = &jobs[i];
        match result {
            Ok(path) => images.push((source.module.to_string(), arch.clone(), path)),
            Err(e) => {
                println!(
                    "cargo:warning=kev-kernels: no prebuilt {} for {arch} (compiled at run time instead): {e}",
                    source.file
                );
            }
        }
    }
    images
}

/// `source` compiled for `arch` by nvcc, as NVRTC compiles it at run time (the same text and
/// defines): the path of its CUBIN.
fn compile(
    nvcc: &Path,
    out: &Path,
    source: &catalog::Source,
    arch: &str,
) -> Result<PathBuf, String> {
    let input = out.join(format!("{}.{arch}.cu", source.module));
    std::fs::write(&input, source.text()).map_err(|e| e.to_string())?;
    let image = out.join(format!("{}.{arch}.cubin", source.module));
    let output = Command::new(nvcc)
        .arg("--cubin")
        .arg(format!("--gpu-architecture={arch}"))
        .args(source.define_options())
        .arg("-o")
        .arg(&image)
        .arg(&input)
        .output()
        .map_err(|e| format!("running {}: {e}", nvcc.display()))?;
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).into_owned());
    }
    Ok(image)
}
