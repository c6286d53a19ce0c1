//! The GPU dispatch count of whole forwards (`kev_kernels::dispatch`, the table of
//! `examples/dispatch_count`), on the CPU with the fixture model in bf16: the prefix form of
//! one record and the batch form of all fixture records, counted as CUDA and as Metal would
//! run them.
//!
//! Asserted: every composed path that ran was counted; counting changes no probability; per
//! attention layer Metal dispatches fewer than CUDA's eager path (its flash kernel against
//! CUDA's matmuls around the softmax, where CUDA's flash kernel does not run); and per DeltaNet
//! layer no more than CUDA's (the split conv's one dispatch and the split delta rule's two,
//! against CUDA's three fused launches or, where those do not run, its composition).

use std::path::Path;

use kev::{Backend, DType, DecisionModel, LoadOptions, Record};
use kev_candle::qwen35::LayerType;
use kev_kernels::dispatch::{self, count, Tally};

fn records() -> Vec<Record> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/records.jsonl");
    let text = std::fs::read_to_string(path).unwrap();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| Record::from_json_str(l, None).unwrap())
        .collect()
}

type Probabilities = Vec<Vec<Vec<f32>>>;

/// A form's scoring of the fixture records.
type Scoring<'a> = Box<dyn Fn() -> kev::Result<Probabilities> + 'a>;

/// `score` run plainly on the CPU, then counted as CUDA and as Metal.
fn counted(score: impl Fn() -> kev::Result<Probabilities>) -> [(Probabilities, Tally); 2] {
    let plain = score().unwrap();
    [dispatch::Backend::Cuda, dispatch::Backend::Metal].map(|backend| {
        let (probs, tally) = count(backend, &score);
        let probs = probs.unwrap();
        assert!(tally.is_complete(), "{backend:?}: {tally:?}");
        assert_eq!(
            probs, plain,
            "{backend:?}: counting changed the probabilities"
        );
        (probs, tally)
    })
}

/// The fixture model loaded as a GPU loads it (the projections' layout, bf16 activations).
fn gpu_model() -> DecisionModel {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kev-small");
    let options = LoadOptions {
        backend: Backend::Cpu,
        dtype: DType::BF16,
        ..LoadOptions::default()
    };
    let (model, _) = count(dispatch::Backend::Cuda, || {
        DecisionModel::load(&dir, &options)
    });
    model.unwrap()
}

/// The prefix form of the first fixture record and the batch form of all of them.
fn forms<'a>(model: &'a DecisionModel, records: &'a [Record]) -> [(&'static str, Scoring<'a>); 2] {
    [
        (
            "prefix",
            Box::new(|| model.probs(&records[0]).map(|p| vec![p])),
        ),
        ("batch", Box::new(|| model.probs_batch(records))),
    ]
}

/// A CUDA forward launches Kev's kernels, cuBLAS GEMMs, memsets and device-to-device copies,
/// and no kernel of candle's: those come in PTX modules that the driver translates when a
/// process first uses one, seconds each on a fresh machine (the cold start in BENCHMARKS.md).
/// Metal's count, whose GEMMs are candle's, shows the tally does see candle kernels.
#[test]
fn cuda_forward_launches_no_candle_kernel() {
    let model = gpu_model();
    let records = records();
    for (form, score) in forms(&model, &records) {
        let [(_, cuda), (_, metal)] = counted(score);
        assert_eq!(cuda.candle_kernels(), vec![], "{form}: CUDA");
        assert!(
            metal
                .candle_kernels()
                .iter()
                .any(|(_, op, _)| *op == "matmul"),
            "{form}: Metal's GEMMs are not counted as candle's: {metal:?}"
        );
    }
}

#[test]
fn metal_dispatches_no_more_than_cuda_per_layer() {
    let model = gpu_model();
    let kinds = model.backbone().config().layer_types.clone();
    assert!(kinds.contains(&LayerType::FullAttention));
    let records = records();
    for (form, score) in forms(&model, &records) {
        let [(_, cuda), (_, metal)] = counted(score);
        for (layer, kind) in kinds.iter().enumerate() {
            let (on_cuda, on_metal) = (cuda.of_layer(Some(layer)), metal.of_layer(Some(layer)));
            assert!(
                on_cuda > 0 && on_metal > 0,
                "{form}: layer {layer} counted nothing"
            );
            // The fixture's head dim (32) leaves CUDA's flash kernel out (it takes 256), so
            // Metal's flash kernel makes its count strictly lower, not merely no higher.
            if *kind == LayerType::FullAttention {
                assert!(
                    on_metal < on_cuda,
                    "{form}: attention layer {layer}: Metal {on_metal}, CUDA {on_cuda}"
                );
            } else {
                assert!(
                    on_metal <= on_cuda,
                    "{form}: DeltaNet layer {layer}: Metal {on_metal}, CUDA {on_cuda}"
                );
            }
        }
    }
}

/// The MoE fixture loaded as CUDA loads it (every expert's weights joined into two fused
/// tensors, the MLP through `kev_kernels::moe_mlp`, here its composed stand-in) scores as the
/// CPU's per-expert path does, and its CUDA forward launches no candle kernel either.
#[test]
fn moe_forward_on_cuda_is_the_cpu_s_and_launches_no_candle_kernel() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kev-moe");
    let options = LoadOptions {
        backend: Backend::Cpu,
        dtype: DType::F32,
        ..LoadOptions::default()
    };
    let (gpu, _) = count(dispatch::Backend::Cuda, || {
        DecisionModel::load(&dir, &options)
    });
    let gpu = gpu.unwrap();
    let cpu = DecisionModel::load(&dir, &options).unwrap();
    let records = records();
    let (probs, tally) = count(dispatch::Backend::Cuda, || gpu.probs_batch(&records));
    let probs = probs.unwrap();
    assert!(tally.is_complete(), "{tally:?}");
    assert_eq!(tally.candle_kernels(), vec![]);
    let layers = gpu.backbone().config().layer_types.len();
    let moe: Vec<_> = tally.entries().filter(|(_, op, _)| *op == "moe").collect();
    assert_eq!(
        moe.len(),
        layers,
        "one MoE launch sequence a layer: {moe:?}"
    );
    let want = cpu.probs_batch(&records).unwrap();
    let worst = probs
        .iter()
        .flatten()
        .flatten()
        .zip(want.iter().flatten().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        worst <= 1e-5,
        "max |Δp| {worst:e} between the fused and per-expert forms"
    );
}
