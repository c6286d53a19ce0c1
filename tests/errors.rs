//! Bad input gives a clear, typed error naming what is wrong — never a panic. Each case breaks a
//! copy of the shipped checkpoint in one way.

use std::path::{Path, PathBuf};

use kev::{DecisionModel, Error, LoadOptions, Record};

#[path = "fuzz_common/mod.rs"]
mod common;
use common::{copy_dir, fixture};

/// A fresh copy of `kev-small` with its base copied alongside, in a unique temp folder.
fn broken_copy(tag: &str) -> PathBuf {
    let root = std::env::temp_dir().join(format!("kev-errors-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    copy_dir(&fixture("kev-small"), &root.join("kev-small"));
    copy_dir(&fixture("base-mm"), &root.join("base-mm"));
    root.join("kev-small")
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

// ---- Checkpoints whose files contradict each other, and values that would give NaN ----

/// Rewrites a JSON file through `edit`.
fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

fn base_of(dir: &Path) -> PathBuf {
    dir.parent().unwrap().join("base-mm")
}

fn adapter_file(dir: &Path) -> PathBuf {
    dir.join("adapter/adapter_model.safetensors")
}

fn load_with(dir: &Path, options: &LoadOptions) -> kev::Result<DecisionModel> {
    DecisionModel::load(dir, options)
}

fn first_record() -> Record {
    let text = std::fs::read_to_string(fixture("records.jsonl")).unwrap();
    Record::from_json_str(text.lines().next().unwrap(), Some(1)).unwrap()
}

#[test]
fn layers_the_config_does_not_describe_are_refused() {
    let dir = broken_copy("fewer-layers");
    edit_json(&base_of(&dir).join("config.json"), |c| {
        let t = &mut c["text_config"];
        t["num_hidden_layers"] = 4.into();
        t["layer_types"] = serde_json::json!([
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention"
        ]);
    });
    let msg = load_err(&dir).to_string();
    // The adapter's layers 4.. have no base module any more, and the base's layers 4.. are unread.
    assert!(msg.contains("model.language_model.layers.4."), "{msg}");
    assert!(msg.contains("not read by the model"), "{msg}");
    assert!(
        msg.contains("tensor `layers.4.mlp.down_proj.weight`: adapter"),
        "{msg}"
    );
}

#[test]
fn a_tensor_stored_in_two_shards_is_refused() {
    let root = std::env::temp_dir().join(format!("kev-errors-{}-two-shards", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    copy_dir(&fixture("base-text"), &root.join("base-text"));
    copy_dir(&fixture("kev-small"), &root.join("kev-small"));
    let dir = root.join("kev-small");
    edit_json(&dir.join("kev.json"), |k| k["base"] = "../base-text".into());
    assert!(DecisionModel::load(&dir, &LoadOptions::default()).is_ok());
    let shards = root.join("base-text");
    let first = candle_core::safetensors::load(
        shards.join("model-00001-of-00002.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let (name, tensor) = first.iter().min_by_key(|(n, _)| n.as_str()).unwrap();
    let (name, tensor) = (name.clone(), tensor.clone());
    edit_safetensors(&shards.join("model-00002-of-00002.safetensors"), |t| {
        t.insert(name.clone(), tensor);
    });
    let msg = load_err(&dir).to_string();
    assert!(
        msg.contains(&format!("tensor `{name}`: stored twice")),
        "{msg}"
    );
}

#[test]
fn an_adapter_without_tensors_is_refused() {
    let dir = broken_copy("empty-adapter");
    candle_core::safetensors::save(
        &std::collections::HashMap::<String, candle_core::Tensor>::new(),
        adapter_file(&dir),
    )
    .unwrap();
    let msg = load_err(&dir).to_string();
    assert!(msg.contains("holds no LoRA tensors for it"), "{msg}");
}

#[test]
fn adapter_tensors_outside_layers_to_transform_are_refused() {
    let dir = broken_copy("layers-to-transform");
    edit_json(&dir.join("adapter/adapter_config.json"), |c| {
        c["layers_to_transform"] = serde_json::json!([0]);
    });
    let msg = load_err(&dir).to_string();
    assert!(msg.contains("layers.1."), "{msg}");
    assert!(msg.contains("outside `layers_to_transform` [0]"), "{msg}");
}

#[test]
fn every_adapter_problem_is_reported_in_the_same_order() {
    let dir = broken_copy("two-problems");
    edit_safetensors(&adapter_file(&dir), |t| {
        t.remove("base_model.model.layers.3.self_attn.q_proj.lora_B.weight");
        let a = t["base_model.model.layers.0.mlp.up_proj.lora_A.weight"].clone();
        t.insert(
            "base_model.model.layers.0.mlp.up_proj.lora_C.weight".into(),
            a,
        );
    });
    let first = load_err(&dir).to_string();
    assert!(first.starts_with("2 problems:"), "{first}");
    assert!(
        first.contains("layers.0.mlp.up_proj.lora_C.weight"),
        "{first}"
    );
    assert!(
        first.contains("layers.3.self_attn.q_proj`: LoRA module has only one"),
        "{first}"
    );
    for _ in 0..3 {
        assert_eq!(load_err(&dir).to_string(), first);
    }
}

#[test]
fn a_rank_0_adapter_tensor_is_an_error() {
    let dir = broken_copy("rank0");
    edit_safetensors(&adapter_file(&dir), |t| {
        let key = "base_model.model.layers.0.mlp.up_proj.lora_A.weight";
        t.insert(
            key.into(),
            candle_core::Tensor::new(1f32, &candle_core::Device::Cpu).unwrap(),
        );
    });
    let msg = load_err(&dir).to_string();
    assert!(
        msg.contains("layers.0.mlp.up_proj`: LoRA shapes A []"),
        "{msg}"
    );
}

/// Sets one element of `name` to `value`.
fn poison(path: &Path, name: &str, value: f32) {
    edit_safetensors(path, |t| {
        let w = &t[name];
        let dtype = w.dtype();
        let mut v = w
            .flatten_all()
            .unwrap()
            .to_dtype(candle_core::DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        v[0] = value;
        let p = candle_core::Tensor::new(v, &candle_core::Device::Cpu)
            .unwrap()
            .reshape(w.dims())
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        t.insert(name.into(), p);
    });
}

#[test]
fn non_finite_head_or_adapter_values_are_refused_at_load() {
    let dir = broken_copy("nan-head");
    poison(&dir.join("head.safetensors"), "k.bias", f32::NAN);
    let msg = load_err(&dir).to_string();
    assert!(msg.contains("tensor `k.bias`: holds NaN"), "{msg}");

    let dir = broken_copy("inf-adapter");
    poison(
        &adapter_file(&dir),
        "base_model.model.layers.2.mlp.down_proj.lora_B.weight",
        f32::INFINITY,
    );
    let msg = load_err(&dir).to_string();
    assert!(
        msg.contains("layers.2.mlp.down_proj.weight`: with the adapter folded in"),
        "{msg}"
    );
}

#[test]
fn a_non_finite_base_weight_is_an_error_naming_the_record_never_output() {
    let dir = broken_copy("nan-base");
    poison(
        &base_of(&dir).join("model.safetensors"),
        "model.language_model.norm.weight",
        f32::NAN,
    );
    let model = DecisionModel::load(&dir, &LoadOptions::default()).unwrap();
    let record = first_record();
    for err in [
        model.probs(&record).unwrap_err(),
        model
            .run(&[model.encode_record(&record, None).unwrap()], &[], true)
            .err()
            .unwrap(),
        model
            .probs_batch(&[record.clone(), record.clone()])
            .unwrap_err(),
        model.probs_and_prefix(&record).err().unwrap(),
    ] {
        assert!(matches!(err, Error::NonFinite { .. }), "{err}");
        assert!(
            err.to_string()
                .starts_with("record `r1` at batch index 0: question 0"),
            "{err}"
        );
    }
}

#[test]
fn extreme_scales_are_refused_at_load_and_negative_ones_work() {
    let dir = fixture("kev-small");
    // Past f32: the folded weights overflow, refused at load.
    let msg = load_with(&dir, &LoadOptions::default().with_lora_scale(1e300))
        .err()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("with the adapter folded in (lora_scale 1e300)"),
        "{msg}"
    );
    // Within f32 but overflowing the activations: an error naming the record, never output.
    let model = load_with(&dir, &LoadOptions::default().with_lora_scale(1e37)).unwrap();
    let err = model.probs(&first_record()).unwrap_err();
    assert!(matches!(err, Error::NonFinite { .. }), "{err}");
    let msg = load_with(&dir, &LoadOptions::default().with_lora_scale(f64::NAN))
        .err()
        .unwrap()
        .to_string();
    assert!(msg.contains("lora_scale"), "{msg}");
    let model = load_with(&dir, &LoadOptions::default().with_lora_scale(-1.0)).unwrap();
    assert!(model.probs(&first_record()).is_ok());

    let copy = broken_copy("alpha");
    edit_json(&copy.join("adapter/adapter_config.json"), |c| {
        c["lora_alpha"] = 1e300.into()
    });
    let msg = load_err(&copy).to_string();
    assert!(msg.contains("cannot hold"), "{msg}");
}

#[test]
fn config_values_that_give_nan_are_refused_naming_their_field() {
    for (field, value, want) in [
        (
            "rms_norm_eps",
            serde_json::json!(-1e-6),
            "text_config.rms_norm_eps",
        ),
        (
            "rope_parameters",
            serde_json::json!({"rope_theta": 0.0, "partial_rotary_factor": 0.25}),
            "text_config.rope_parameters.rope_theta",
        ),
        (
            "hidden_size",
            serde_json::json!(0),
            "text_config.hidden_size",
        ),
    ] {
        let dir = broken_copy(&format!("cfg-{field}"));
        edit_json(&base_of(&dir).join("config.json"), |c| {
            c["text_config"][field] = value
        });
        match load_err(&dir) {
            Error::Config { field, .. } => assert_eq!(field, want),
            other => panic!("{other}"),
        }
    }
    let dir = broken_copy("temperature");
    edit_json(&dir.join("kev.json"), |k| {
        k["head"]["temperature"] = 1e-300.into()
    });
    match load_err(&dir) {
        Error::Config { field, .. } => assert_eq!(field, "head.temperature"),
        other => panic!("{other}"),
    }
}

#[test]
fn duplicate_keys_are_refused_and_a_bom_is_accepted_in_every_json_file() {
    let dir = broken_copy("dup-config");
    let path = base_of(&dir).join("config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replacen("\"vocab_size\"", "\"vocab_size\": 400, \"vocab_size\"", 1),
    )
    .unwrap();
    let err = load_err(&dir);
    let chain = format!(
        "{err}: {}",
        std::error::Error::source(&err)
            .map(|s| s.to_string())
            .unwrap_or_default()
    );
    assert!(
        matches!(err, Error::Json { .. }) && chain.contains("duplicate key `vocab_size`"),
        "{chain}"
    );

    let dir = broken_copy("bom");
    for file in [
        dir.join("kev.json"),
        dir.join("adapter/adapter_config.json"),
        base_of(&dir).join("config.json"),
    ] {
        let text = std::fs::read_to_string(&file).unwrap();
        std::fs::write(&file, format!("\u{feff}{text}")).unwrap();
    }
    let model = DecisionModel::load(&dir, &LoadOptions::default()).unwrap();
    let reference = DecisionModel::load(fixture("kev-small"), &LoadOptions::default()).unwrap();
    assert_eq!(
        model.probs(&first_record()).unwrap(),
        reference.probs(&first_record()).unwrap()
    );
}

#[test]
fn the_tokenizers_truncation_cannot_cut_a_record() {
    let dir = broken_copy("truncation");
    edit_json(&base_of(&dir).join("tokenizer.json"), |t| {
        t["truncation"] = serde_json::json!({"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0});
    });
    let model = DecisionModel::load(&dir, &LoadOptions::default()).unwrap();
    let reference = DecisionModel::load(fixture("kev-small"), &LoadOptions::default()).unwrap();
    let record = first_record();
    assert_eq!(
        model.encode(&record).unwrap(),
        reference.encode(&record).unwrap()
    );
    assert_eq!(
        model.probs(&record).unwrap(),
        reference.probs(&record).unwrap()
    );
}

#[test]
fn a_token_id_without_an_embedding_is_refused_at_load() {
    let dir = broken_copy("token-id");
    edit_json(&base_of(&dir).join("tokenizer.json"), |t| {
        t["added_tokens"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({
                "id": 400, "content": "<|extra|>", "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true
            }));
    });
    let err = load_err(&dir);
    assert!(matches!(err, Error::Tokenizer { .. }), "{err}");
    assert!(
        err.to_string().contains("token id 400 has no embedding"),
        "{err}"
    );
}

/// A fresh copy of fixture checkpoint `ckpt` with its base `base`, in a unique temp folder.
fn broken_copy_of(ckpt: &str, base: &str, tag: &str) -> PathBuf {
    let root = std::env::temp_dir().join(format!("kev-errors-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    copy_dir(&fixture(ckpt), &root.join(ckpt));
    copy_dir(&fixture(base), &root.join(base));
    root.join(ckpt)
}

fn broken_moe_copy(tag: &str) -> PathBuf {
    broken_copy_of("kev-moe", "base-moe", tag)
}

/// A MoE config that contradicts the tensors is refused naming the tensor: an expert the config
/// counts but the file lacks, experts the config does not count, a missing shared-expert gate.
#[test]
fn moe_configs_that_contradict_their_tensors_are_refused() {
    let config = |dir: &Path| dir.parent().unwrap().join("base-moe/config.json");
    let weights = |dir: &Path| dir.parent().unwrap().join("base-moe/model.safetensors");

    // Layers load in parallel, so whichever layer's tensor is met first is named: the router
    // stored for four experts, or the fifth expert missing, or the fourth unread.
    for (experts, named) in [(5, "mlp.experts.4.gate_proj.weight"), (3, "mlp.experts.3.")] {
        let dir = broken_moe_copy(&format!("moe-{experts}-experts"));
        edit_json(&config(&dir), |c| {
            c["text_config"]["num_experts"] = experts.into()
        });
        let msg = load_err(&dir).to_string();
        assert!(
            msg.contains(named) || msg.contains("mlp.gate.weight"),
            "{msg}"
        );
    }

    let dir = broken_moe_copy("moe-no-shared-gate");
    edit_safetensors(&weights(&dir), |t| {
        t.remove("model.language_model.layers.2.mlp.shared_expert_gate.weight");
    });
    let msg = load_err(&dir).to_string();
    assert!(
        msg.contains("layers.2.mlp.shared_expert_gate.weight"),
        "{msg}"
    );

    let dir = broken_moe_copy("moe-top-k");
    edit_json(&config(&dir), |c| {
        c["text_config"]["num_experts_per_tok"] = 9.into()
    });
    let msg = load_err(&dir).to_string();
    assert!(msg.contains("text_config.num_experts_per_tok"), "{msg}");
}

/// An FP8 base whose block scales are missing or do not tile the weight, or whose config names
/// another quantization, is refused naming the tensor or the field.
#[test]
fn fp8_bases_that_cannot_be_dequantized_are_refused() {
    let weight = "model.layers.0.linear_attn.out_proj.weight";
    let config = |dir: &Path| dir.parent().unwrap().join("base-fp8/config.json");
    let weights = |dir: &Path| dir.parent().unwrap().join("base-fp8/model.safetensors");

    let dir = broken_copy_of("kev-fp8", "base-fp8", "fp8-no-scales");
    edit_safetensors(&weights(&dir), |t| {
        t.remove(&format!("{weight}_scale_inv"));
    });
    let msg = load_err(&dir).to_string();
    assert!(
        msg.contains(weight) && msg.contains("without its block scales"),
        "{msg}"
    );

    let dir = broken_copy_of("kev-fp8", "base-fp8", "fp8-bad-grid");
    edit_safetensors(&weights(&dir), |t| {
        let grid =
            candle_core::Tensor::ones((3, 4), candle_core::DType::F32, &candle_core::Device::Cpu);
        t.insert(format!("{weight}_scale_inv"), grid.unwrap());
    });
    let msg = load_err(&dir).to_string();
    assert!(
        msg.contains(&format!("{weight}_scale_inv")) && msg.contains("16 x 16 block"),
        "{msg}"
    );

    let dir = broken_copy_of("kev-fp8", "base-fp8", "fp8-awq");
    edit_json(&config(&dir), |c| {
        c["quantization_config"]["quant_method"] = "awq".into()
    });
    let msg = load_err(&dir).to_string();
    assert!(msg.contains("quantization_config.quant_method"), "{msg}");

    // Block scales left over beside a weight that is not FP8 are not read: refused as unread.
    let dir = broken_copy_of("kev-fp8", "base-fp8", "fp8-stray-scales");
    edit_safetensors(&weights(&dir), |t| {
        let scales = t[&format!("{weight}_scale_inv")].clone();
        t.insert(
            "model.layers.0.linear_attn.in_proj_a.weight_scale_inv".into(),
            scales,
        );
    });
    let msg = load_err(&dir).to_string();
    assert!(
        msg.contains("in_proj_a.weight_scale_inv") && msg.contains("not read"),
        "{msg}"
    );
}

#[test]
fn a_lora_on_the_fused_experts_that_does_not_fit_is_refused() {
    // The parameter wrappers without `target_parameters` to say what they adapt.
    let dir = broken_moe_copy("experts-no-params");
    assert!(DecisionModel::load(&dir, &LoadOptions::default()).is_ok());
    edit_json(&dir.join("adapter/adapter_config.json"), |c| {
        c["target_parameters"] = serde_json::Value::Null;
    });
    let msg = load_err(&dir).to_string();
    assert!(msg.contains("layers.0.mlp.experts"), "{msg}");
    assert!(msg.contains("`target_parameters` []"), "{msg}");
    // Named in the other order: down_proj's factors then meet gate_up_proj's weight.
    let dir = broken_moe_copy("experts-swapped");
    edit_json(&dir.join("adapter/adapter_config.json"), |c| {
        c["target_parameters"] =
            serde_json::json!(["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]);
    });
    let msg = load_err(&dir).to_string();
    assert!(msg.contains("does not fit base weight"), "{msg}");
    // An expert count the factors do not hold (A's rows not a multiple of the rank).
    let dir = broken_moe_copy("experts-rank");
    edit_safetensors(&adapter_file(&dir), |t| {
        let key = "base_model.model.layers.1.mlp.experts.lora_A.weight";
        let a = t[key].narrow(0, 0, 6).unwrap();
        t.insert(key.into(), a);
    });
    let msg = load_err(&dir).to_string();
    assert!(msg.contains("layers.1.mlp.experts.down_proj"), "{msg}");
    assert!(msg.contains("rank 4 per expert"), "{msg}");
    // A parameter PEFT could wrap that is not the fused experts.
    let dir = broken_moe_copy("experts-router");
    edit_json(&dir.join("adapter/adapter_config.json"), |c| {
        c["target_parameters"] = serde_json::json!(["mlp.gate.weight"]);
    });
    let msg = load_err(&dir).to_string();
    assert!(msg.contains("target_parameters[0]"), "{msg}");
}
