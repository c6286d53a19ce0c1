//! The Qwen3.5 backbone against transformers' f32 outputs (tests/fixtures/backbone.safetensors):
//! every layer and the final norm, whole sequences and prefix + continuation, both checkpoint
//! layouts (multimodal single file; text-only sharded).

use crate::common::{check, device, fixture, TOL_HIDDEN_F32};
use candle_core::{DType, Device, Tensor};
use kev_candle::qwen35::{Cache, Config, Model};
use kev_candle::weights::Weights;
use kev_core::BaseFiles;
use kev_kernels::SplitBatch;

fn load(base: &str) -> Model {
    let files = BaseFiles::from_local(&fixture(base)).expect("fixture base resolves");
    let cfg = Config::from_json(&std::fs::read_to_string(&files.config).unwrap()).unwrap();
    let w = Weights::open(&files.weights, None, 1.0, DType::F32, device()).unwrap();
    Model::new(&cfg, &w).unwrap()
}

fn reference() -> std::collections::HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture("backbone.safetensors"), &Device::Cpu).unwrap()
}

fn ids_of(t: &Tensor) -> Tensor {
    t.to_dtype(DType::U32)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
        .to_device(&device())
        .unwrap()
}

const LENGTHS: [usize; 7] = [1, 2, 3, 63, 64, 65, 200];
const CONTINUATIONS: [(usize, usize); 4] = [(1, 3), (63, 65), (64, 130), (100, 200)];

#[test]
fn every_layer_matches_transformers() {
    let refs = reference();
    for base in ["base-mm", "base-text"] {
        let model = load(base);
        for n in LENGTHS {
            let ids = ids_of(&refs[&format!("len{n}.ids")]);
            let mut cache = model.new_cache(1).unwrap();
            let (final_, layers) = model.forward_with_layers(&ids, &mut cache, None).unwrap();
            for (i, h) in layers.iter().enumerate() {
                let what = format!("{base} len {n} layer {i}");
                check(
                    &what,
                    &h.squeeze(0).unwrap(),
                    &refs[&format!("len{n}.layer{i}")],
                    TOL_HIDDEN_F32,
                )
                .unwrap();
            }
            let what = format!("{base} len {n} final");
            check(
                &what,
                &final_.squeeze(0).unwrap(),
                &refs[&format!("len{n}.final")],
                TOL_HIDDEN_F32,
            )
            .unwrap();
        }
    }
}

#[test]
fn prefix_then_continuation_matches_transformers() {
    let refs = reference();
    for base in ["base-mm", "base-text"] {
        let model = load(base);
        for (p, n) in CONTINUATIONS {
            let ids = ids_of(&refs[&format!("cont{p}_{n}.ids")]);
            let mut cache = model.new_cache(1).unwrap();
            model
                .forward(&ids.narrow(1, 0, p).unwrap(), &mut cache, None)
                .unwrap();
            let cont = model
                .forward(&ids.narrow(1, p, n - p).unwrap(), &mut cache, None)
                .unwrap();
            let what = format!("{base} prefix {p} + {}", n - p);
            check(
                &what,
                &cont.squeeze(0).unwrap(),
                &refs[&format!("cont{p}_{n}.final")],
                TOL_HIDDEN_F32,
            )
            .unwrap();
        }
    }
}

#[test]
fn padded_batch_rows_equal_single_rows() {
    // Two sequences of different lengths, right-padded into one batch, then continued: each row
    // must equal its own unpadded run.
    let refs = reference();
    let model = load("base-mm");
    let ids = ids_of(&refs["len200.ids"]);
    let (a, b) = (
        ids.narrow(1, 0, 65).unwrap(),
        ids.narrow(1, 100, 40).unwrap(),
    );
    let pad = Tensor::zeros((1, 25), DType::U32, &device()).unwrap();
    let batch = Tensor::cat(&[a.clone(), Tensor::cat(&[&b, &pad], 1).unwrap()], 0).unwrap();
    let mut cache = model.new_cache(2).unwrap();
    let hs = model.forward(&batch, &mut cache, Some(&[65, 40])).unwrap();
    let tail = ids.narrow(1, 180, 7).unwrap();
    let next = model
        .forward(&Tensor::cat(&[&tail, &tail], 0).unwrap(), &mut cache, None)
        .unwrap();
    for (row, single) in [(0, &a), (1, &b)] {
        let len = single.dim(1).unwrap();
        let mut c = model.new_cache(1).unwrap();
        let h = model.forward(single, &mut c, None).unwrap();
        let h_next = model.forward(&tail, &mut c, None).unwrap();
        let ours = hs.narrow(0, row, 1).unwrap().narrow(1, 0, len).unwrap();
        check(&format!("padded row {row}"), &ours, &h, 1e-5).unwrap();
        check(
            &format!("padded row {row} continued"),
            &next.narrow(0, row, 1).unwrap(),
            &h_next,
            1e-5,
        )
        .unwrap();
    }
}

/// The base-mm fixture's config and weights, and token rows cut from its 200-token sequence:
/// two states (70 and 41 real tokens, padded to 70) and three branches (9, 5 and 7, padded to 9).
struct SplitFixture {
    full: Config,
    w: Weights,
    ids: Tensor,
    states: Tensor,
    branches: Tensor,
}

/// The split of [`split_fixture`]'s states and branches, the branches continuing `owners`, of
/// which `given` rows follow the two states.
fn fixture_split(owners: Vec<usize>, given: usize, device: &Device) -> SplitBatch {
    SplitBatch::with_given(70, vec![70, 41], given, 9, vec![9, 5, 7], owners, device).unwrap()
}

fn split_fixture() -> SplitFixture {
    let refs = reference();
    let ids = ids_of(&refs["len200.ids"]);
    let files = BaseFiles::from_local(&fixture("base-mm")).expect("fixture base resolves");
    let full = Config::from_json(&std::fs::read_to_string(&files.config).unwrap()).unwrap();
    let w = Weights::open(&files.weights, None, 1.0, DType::F32, device()).unwrap();
    let rows = |cuts: &[(usize, usize)], width: usize| {
        let padded: Vec<Tensor> = cuts
            .iter()
            .map(|&(start, len)| {
                let fill = Tensor::zeros((1, width - len), DType::U32, &device()).unwrap();
                Tensor::cat(&[&ids.narrow(1, start, len).unwrap(), &fill], 1).unwrap()
            })
            .collect();
        Tensor::cat(&padded, 0).unwrap()
    };
    SplitFixture {
        states: rows(&[(0, 70), (100, 41)], 70),
        branches: rows(&[(180, 9), (150, 5), (190, 7)], 9),
        full,
        w,
        ids,
    }
}

#[test]
fn split_forward_equals_states_then_branches() {
    // One pass over packed states and branches against the states' forward, then the branches'
    // on copies of their owners' cache rows. Both kinds of last layer: the pass skips the last
    // layer's state rows, which feed the branches only through that layer's cache. The branch
    // rows held padded between the layers, and packed (their real steps only).
    let SplitFixture {
        full,
        w,
        states,
        branches,
        ..
    } = split_fixture();
    let (state_lengths, lengths, owners) = (vec![70, 41], vec![9, 5, 7], vec![1, 0, 1]);
    for (layers, pack) in [
        (full.num_hidden_layers, false),
        (full.num_hidden_layers - 1, false),
        (full.num_hidden_layers, true),
        (full.num_hidden_layers - 1, true),
    ] {
        let mut cfg = full.clone();
        cfg.num_hidden_layers = layers;
        cfg.layer_types.truncate(layers);
        let last = cfg.layer_types[layers - 1];
        let model = Model::new(&cfg, &w).unwrap();
        let split = fixture_split(owners.clone(), 0, w.device());
        let tables = model.split_tables(split, None, pack).unwrap();
        assert_eq!(tables.packing().is_some(), pack);
        let (ours, _) = model
            .forward_split(&states, &branches, &tables, None, None, false)
            .unwrap();
        // Keeping the states (no given rows: the split kernels that hand back the matrices)
        // changes nothing of the branches.
        let (keeping, kept) = model
            .forward_split(&states, &branches, &tables, None, None, true)
            .unwrap();
        assert!(kept.is_some());
        let what = format!("{layers} layers (last {last:?}), packed {pack}, keeping");
        check(&what, &keeping, &ours, 1e-5).unwrap();

        let mut cache = model.new_cache(2).unwrap();
        model
            .forward(&states, &mut cache, Some(&state_lengths))
            .unwrap();
        let mut cache = cache.select_rows(&owners).unwrap();
        let theirs = model
            .forward(&branches, &mut cache, Some(&lengths))
            .unwrap();
        for (row, &len) in lengths.iter().enumerate() {
            let real = |t: &Tensor| t.narrow(0, row, 1).unwrap().narrow(1, 0, len).unwrap();
            let what = format!("{layers} layers (last {last:?}), packed {pack}, branch row {row}");
            check(&what, &real(&ours), &real(&theirs), 1e-5).unwrap();
        }
        // Only some real rows through the last layer's MLP (out of order, one twice): the same
        // rows.
        let picked = [12usize, 0, 8, 9, 24, 0];
        let held: Vec<usize> = match tables.packing() {
            Some(p) => picked.iter().map(|&r| p.branch_row(r).unwrap()).collect(),
            None => picked.to_vec(),
        };
        let index = kev_kernels::RowIndex::new(&held, &device()).unwrap();
        let (some, _) = model
            .forward_split(&states, &branches, &tables, Some(&index), None, false)
            .unwrap();
        let flat = ours.flatten(0, 1).unwrap();
        let want = Tensor::cat(
            &picked
                .iter()
                .map(|&p| flat.narrow(0, p, 1).unwrap())
                .collect::<Vec<_>>(),
            0,
        )
        .unwrap();
        let what = format!("{layers} layers (last {last:?}), packed {pack}, picked rows");
        check(&what, &some, &want, 1e-5).unwrap();
    }
}

#[test]
fn split_forward_continues_given_rows_and_keeps_its_states() {
    // One pass where branch rows continue computed states or given rows (a cached prefix of 40
    // tokens, longer keys than neither state, one of 90, longer than both, and one of an empty
    // state, which holds no keys at all), keeping the
    // states' cache: against the states' forward, its rows joined with the given ones, then the
    // branches on copies. The kept cache continues a branch as the states' forward's does.
    let SplitFixture {
        full,
        w,
        ids,
        states,
        branches,
    } = split_fixture();
    let (state_lengths, lengths) = (vec![70, 41], vec![9, 5, 7]);
    for (given_len, layers, pack) in [
        (40, full.num_hidden_layers, false),
        (90, full.num_hidden_layers - 1, false),
        (0, full.num_hidden_layers, false),
        (40, full.num_hidden_layers, true),
        (90, full.num_hidden_layers - 1, true),
    ] {
        let mut cfg = full.clone();
        cfg.num_hidden_layers = layers;
        cfg.layer_types.truncate(layers);
        let model = Model::new(&cfg, &w).unwrap();
        let mut given = model.new_cache(1).unwrap();
        if given_len > 0 {
            model
                .forward(&ids.narrow(1, 20, given_len).unwrap(), &mut given, None)
                .unwrap();
        }
        let owners = vec![2, 0, 2];
        let split = fixture_split(owners.clone(), 1, w.device());
        let tables = model.split_tables(split, Some(&given), pack).unwrap();
        assert_eq!(tables.packing().is_some(), pack);
        let (ours, kept) = model
            .forward_split(&states, &branches, &tables, None, Some(&given), true)
            .unwrap();
        let kept = kept.expect("kept states");

        let mut cache = model.new_cache(2).unwrap();
        model
            .forward(&states, &mut cache, Some(&state_lengths))
            .unwrap();
        let joined = Cache::join(&[&cache, &given]).unwrap();
        let mut rows = joined.select_rows(&owners).unwrap();
        let theirs = model.forward(&branches, &mut rows, Some(&lengths)).unwrap();
        for (row, &len) in lengths.iter().enumerate() {
            let real = |t: &Tensor| t.narrow(0, row, 1).unwrap().narrow(1, 0, len).unwrap();
            let what = format!("given {given_len}, {layers} layers, packed {pack}, row {row}");
            check(&what, &real(&ours), &real(&theirs), 1e-5).unwrap();
        }
        let (kept, cache) = (kept.rows_apart(2).unwrap(), cache.rows_apart(2).unwrap());
        for (r, (mut a, mut b)) in kept.into_iter().zip(cache).enumerate() {
            let branch = branches.narrow(0, 1, 1).unwrap().narrow(1, 0, 5).unwrap();
            let from_kept = model.forward(&branch, &mut a, None).unwrap();
            let from_states = model.forward(&branch, &mut b, None).unwrap();
            let what = format!("given {given_len}, {layers} layers, kept state {r}");
            check(&what, &from_kept, &from_states, 1e-5).unwrap();
        }
    }
}
