//! Bad input gives a clear, typed error naming what is wrong — never a panic. Each case breaks a
//! copy of the shipped checkpoint in one way.

use std::path::{Path, PathBuf};

use kev::{DecisionModel, Error, LoadOptions, Record};

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// A fresh copy of `kev-small` with its base copied alongside, in a unique temp folder.
fn broken_copy(tag: &str) -> PathBuf {
    let root = std::env::temp_dir().join(format!("kev-errors-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    copy_dir(&fixture("kev-small"), &root.join("kev-small"));
    copy_dir(&fixture("base-mm"), &root.join("base-mm"));
    root.join("kev-small")
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let dest = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &dest);
        } else {
            std::fs::copy(entry.path(), dest).unwrap();
        }
    }
}

fn load_err(dir: &Path) -> Error {
    match DecisionModel::load(dir, &LoadOptions::default()) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e,
    }
}

/// Rewrites a safetensors file through `edit` (name → tensor map, f32 on the CPU).
fn edit_safetensors(
    path: &Path,
    edit: impl FnOnce(&mut std::collections::HashMap<String, candle_core::Tensor>),
) {
    let mut tensors = candle_core::safetensors::load(path, &candle_core::Device::Cpu).unwrap();
    edit(&mut tensors);
    candle_core::safetensors::save(&tensors, path).unwrap();
}

#[test]
fn unknown_adapter_tensor_is_named() {
    let dir = broken_copy("unknown-adapter");
    edit_safetensors(&dir.join("adapter/adapter_model.safetensors"), |t| {
        let a = t["base_model.model.layers.0.mlp.up_proj.lora_A.weight"].clone();
        t.insert(
            "base_model.model.layers.0.mlp.nonexistent.lora_A.weight".into(),
            a.clone(),
        );
        t.insert(
            "base_model.model.layers.0.mlp.nonexistent.lora_B.weight".into(),
            a.t().unwrap(),
        );
    });
    let err = load_err(&dir);
    assert!(matches!(err, Error::Tensor { .. }), "{err}");
    assert!(
        err.to_string().contains("layers.0.mlp.nonexistent"),
        "{err}"
    );
}

#[test]
fn misshaped_adapter_tensor_is_named() {
    let dir = broken_copy("misshaped-adapter");
    edit_safetensors(&dir.join("adapter/adapter_model.safetensors"), |t| {
        let key = "base_model.model.layers.2.mlp.down_proj.lora_B.weight";
        let b = t[key].narrow(0, 0, 10).unwrap();
        t.insert(key.into(), b);
    });
    let err = load_err(&dir);
    assert!(err.to_string().contains("layers.2.mlp.down_proj"), "{err}");
}

#[test]
fn missing_base_tensor_is_named() {
    let dir = broken_copy("missing-base");
    let base = dir.parent().unwrap().join("base-mm/model.safetensors");
    edit_safetensors(&base, |t| {
        t.remove("model.language_model.layers.3.self_attn.k_norm.weight");
    });
    let err = load_err(&dir);
    assert!(matches!(err, Error::Tensor { .. }), "{err}");
    assert!(
        err.to_string().contains("layers.3.self_attn.k_norm.weight"),
        "{err}"
    );
}

#[test]
fn mlx_layout_is_refused() {
    let dir = broken_copy("mlx");
    let base = dir.parent().unwrap().join("base-mm/model.safetensors");
    edit_safetensors(&base, |t| {
        let renamed: Vec<(String, candle_core::Tensor)> = t
            .drain()
            .map(|(k, v)| {
                (
                    k.replacen("model.language_model.", "language_model.model.", 1),
                    v,
                )
            })
            .collect();
        t.extend(renamed);
    });
    let err = load_err(&dir);
    assert!(err.to_string().contains("mlx-community"), "{err}");
}

#[test]
fn head_errors_are_named() {
    let dir = broken_copy("head");
    edit_safetensors(&dir.join("head.safetensors"), |t| {
        t.remove("k.bias");
    });
    let err = load_err(&dir);
    assert!(err.to_string().contains("k.bias"), "{err}");
}

#[test]
fn missing_adapter_file_is_reported() {
    let dir = broken_copy("no-adapter-file");
    std::fs::remove_file(dir.join("adapter/adapter_model.safetensors")).unwrap();
    let err = load_err(&dir);
    assert!(
        err.to_string().contains("adapter_model.safetensors"),
        "{err}"
    );
}

#[test]
fn unavailable_backend_is_an_error() {
    let opts = LoadOptions::default().with_backend(kev::Backend::Metal(0));
    if cfg!(feature = "metal") {
        return; // a Metal build may well have the device
    }
    let err = DecisionModel::load(fixture("kev-small"), &opts)
        .err()
        .expect("no Metal in this build");
    assert!(matches!(err, Error::Device { .. }), "{err}");
}

#[test]
fn bad_records_are_errors_not_panics() {
    let model = DecisionModel::load(fixture("kev-small"), &LoadOptions::default()).unwrap();
    let long = Record::from_json_str(
        &format!(
            r#"{{"state": "{}", "questions": [{{"prompt": "q", "options": ["a"]}}]}}"#,
            "word ".repeat(3000)
        ),
        None,
    )
    .unwrap();
    assert!(matches!(
        model.probs(&long).unwrap_err(),
        Error::TooLong { .. }
    ));
    let marker = Record::from_json_str(
        r#"{"state": "s", "questions": [{"prompt": "q", "options": ["a <|kev_option|>"]}]}"#,
        None,
    )
    .unwrap();
    let err = model.probs(&marker).unwrap_err();
    assert!(err.to_string().contains("questions[0].options[0]"), "{err}");
    let built = Record {
        id: None,
        state: "s".into(),
        questions: vec![],
    };
    assert!(matches!(
        model.probs(&built).unwrap_err(),
        Error::Record { .. }
    ));
    assert!(model.probs_batch(&[]).unwrap().is_empty());
}
