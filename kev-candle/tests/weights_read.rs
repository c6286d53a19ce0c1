//! The weights `Weights::get_as` gives (the adapter folded from the mapped file, tensors
//! uploaded straight from the map, the rest copied first) against the tensor-op chain that
//! defines them: every text-model tensor of a small checkpoint with an adapter, in every backbone
//! dtype, at two LoRA scales, from a file whose tensors are aligned and from the same file with
//! every tensor one byte off alignment.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use kev_candle::lora::Adapter;
use kev_candle::weights::Weights;
use kev_core::AdapterConfig;

const PREFIX: &str = "model.language_model.";

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn adapter_dir() -> PathBuf {
    fixtures().join("kev-small/adapter")
}

/// `file` rewritten with its header one byte longer (a trailing space, still valid JSON), so
/// that the data, and every 2- or 4-byte tensor in it, starts one byte off alignment.
fn misaligned_copy(file: &Path, out: &Path) {
    let bytes = std::fs::read(file).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut copy = Vec::with_capacity(bytes.len() + 1);
    copy.extend_from_slice(&(len as u64 + 1).to_le_bytes());
    copy.extend_from_slice(&bytes[8..8 + len]);
    copy.push(b' ');
    copy.extend_from_slice(&bytes[8 + len..]);
    std::fs::write(out, copy).unwrap();
}

/// The base weight's tensors by text-model name, as stored.
fn stored(file: &Path) -> BTreeMap<String, Tensor> {
    candle_core::safetensors::load(file, &Device::Cpu)
        .unwrap()
        .into_iter()
        .filter_map(|(name, t)| Some((name.strip_prefix(PREFIX)?.to_string(), t)))
        .collect()
}

/// `B·A·s` of each adapted weight (text-model names), from the adapter's files.
fn deltas() -> BTreeMap<String, (Tensor, f64)> {
    let config = AdapterConfig::load(adapter_dir().join("adapter_config.json")).unwrap();
    let tensors = candle_core::safetensors::load(
        adapter_dir().join("adapter_model.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let mut out = BTreeMap::new();
    for (key, a) in &tensors {
        let Some(module) = key.strip_suffix(".lora_A.weight") else {
            continue;
        };
        let b = &tensors[&format!("{module}.lora_B.weight")];
        let module = &module[module.find("layers.").unwrap()..];
        let delta = b.matmul(a).unwrap();
        out.insert(format!("{module}.weight"), (delta, config.scaling(module)));
    }
    out
}

/// The bits of `t` (widened to f32, which is exact).
fn bits(t: &Tensor) -> Vec<u32> {
    let values = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    values
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn weights_are_the_tensor_op_chain_bit_for_bit() {
    let base = fixtures().join("base-mm/model.safetensors");
    let shifted = std::env::temp_dir().join(format!(
        "kev-weights-read-{}.safetensors",
        std::process::id()
    ));
    misaligned_copy(&base, &shifted);
    let stored = stored(&base);
    let deltas = deltas();
    assert!(deltas.len() > 30, "{} adapted weights", deltas.len());
    let mut checked = (0, 0);
    for file in [&base, &shifted] {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for lora_scale in [1.0, -0.75] {
                let adapter = Adapter::load(
                    &adapter_dir().join("adapter_config.json"),
                    &adapter_dir().join("adapter_model.safetensors"),
                )
                .unwrap();
                let weights = Weights::open(
                    std::slice::from_ref(file),
                    Some(adapter),
                    lora_scale,
                    dtype,
                    Device::Cpu,
                )
                .unwrap();
                for (name, w) in &stored {
                    let want = match deltas.get(name) {
                        Some((delta, scaling)) => {
                            checked.0 += 1;
                            let update = (delta * (scaling * lora_scale)).unwrap();
                            (w.to_dtype(DType::F32).unwrap() + update).unwrap()
                        }
                        None => {
                            checked.1 += 1;
                            w.clone()
                        }
                    };
                    let want = want.to_dtype(dtype).unwrap();
                    let got = weights.get_as(name, w.dims(), dtype).unwrap();
                    assert_eq!(got.dtype(), dtype, "{name}");
                    assert_eq!(got.dims(), w.dims(), "{name}");
                    assert!(
                        bits(&got) == bits(&want),
                        "{name} from {}, {dtype:?}, lora_scale {lora_scale}",
                        file.display()
                    );
                }
                weights.check_all_used().unwrap();
            }
        }
    }
    std::fs::remove_file(&shifted).unwrap();
    // Every adapted weight and every other tensor, for each file, dtype and scale.
    assert_eq!(
        checked,
        (deltas.len() * 12, (stored.len() - deltas.len()) * 12)
    );
}

/// Reading from the map keeps the errors of reading a copy: a shape the model does not expect,
/// a tensor the file lacks, and a folded value the dtype cannot hold, each naming its tensor.
#[test]
fn reading_from_the_map_names_the_tensor_in_its_errors() {
    let base = fixtures().join("base-mm/model.safetensors");
    let adapter = || {
        Adapter::load(
            &adapter_dir().join("adapter_config.json"),
            &adapter_dir().join("adapter_model.safetensors"),
        )
        .unwrap()
    };
    let name = "layers.0.mlp.up_proj.weight";
    let full = format!("{PREFIX}{name}");
    let weights = Weights::open(
        std::slice::from_ref(&base),
        Some(adapter()),
        1.0,
        DType::BF16,
        Device::Cpu,
    )
    .unwrap();
    let stored = stored(&base);
    let dims = stored[name].dims().to_vec();
    let err = weights
        .get_as(name, &[dims[0], dims[1] + 1], DType::BF16)
        .unwrap_err();
    assert!(
        matches!(&err, kev_core::Error::Tensor { name, message } if *name == full && message.contains("expected shape")),
        "{err}"
    );
    let err = weights
        .get_as("layers.0.mlp.nothing.weight", &[1], DType::BF16)
        .unwrap_err();
    assert!(
        matches!(&err, kev_core::Error::Tensor { name, message } if name.ends_with("layers.0.mlp.nothing.weight") && message.contains("missing")),
        "{err}"
    );
    // A scale at which the folded weight leaves f16's range.
    let weights = Weights::open(&[base], Some(adapter()), 1e12, DType::F16, Device::Cpu).unwrap();
    let err = weights.get_as(name, &dims, DType::F16).unwrap_err();
    assert!(
        matches!(&err, kev_core::Error::Tensor { name, message } if *name == full && message.contains("cannot hold")),
        "{err}"
    );
}

/// An FP8 weight is each element times its block's scale, a last block of a side that is not a
/// whole number of blocks included (the config's block); without the config's block, the grid
/// must tile the weight whole, and a grid that is not one per block is refused, naming it.
#[test]
fn fp8_weights_dequantize_by_their_blocks() {
    let file = std::env::temp_dir().join(format!("kev-fp8-{}.safetensors", std::process::id()));
    let name = "layers.0.mlp.up_proj.weight";
    let values: Vec<f32> = (0..35).map(|i| (i as f32 - 17.0) * 0.375).collect();
    let q = Tensor::from_vec(values, (5, 7), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F8E4M3)
        .unwrap();
    let scales: Vec<f32> = (0..12).map(|i| 0.5 + i as f32).collect();
    let s = Tensor::from_vec(scales.clone(), (3, 4), &Device::Cpu).unwrap();
    let embed = Tensor::zeros((2, 7), DType::F32, &Device::Cpu).unwrap();
    let tensors = [
        (format!("model.{name}"), q.clone()),
        (format!("model.{name}_scale_inv"), s),
        ("model.embed_tokens.weight".to_string(), embed),
    ];
    candle_core::safetensors::save(&tensors.into_iter().collect(), &file).unwrap();
    let open = |block| {
        Weights::open(
            std::slice::from_ref(&file),
            None,
            1.0,
            DType::F32,
            Device::Cpu,
        )
        .unwrap()
        .with_fp8_block(block)
    };

    let got = open(Some((2, 2)))
        .get_as(name, &[5, 7], DType::F32)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let q = q.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
    for r in 0..5 {
        for c in 0..7 {
            assert_eq!(
                got[r][c],
                q[r][c] * scales[(r / 2) * 4 + c / 2],
                "({r}, {c})"
            );
        }
    }
    // 5 x 7 in a 3 x 4 grid is no whole number of blocks; a 3 x 3 block needs a 2 x 3 grid.
    for block in [None, Some((3, 3))] {
        let err = open(block).get_as(name, &[5, 7], DType::F32).unwrap_err();
        assert!(
            err.to_string().contains(&format!("model.{name}_scale_inv")),
            "{err}"
        );
    }
}
