//! `DecisionModel::run` with given and kept prefixes (records with and without cached prefixes in
//! one batch) and `PrefixCache`, against scoring one by one (f32, CPU).

use std::path::Path;
use std::sync::Arc;

use kev::{Backend, DecisionModel, Error, LoadOptions, PrefixCache, Record};

const TOL: f32 = 1e-5;

fn model() -> DecisionModel {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kev-small");
    DecisionModel::load(dir, &LoadOptions::default().with_backend(Backend::Cpu)).unwrap()
}

fn records() -> Vec<Record> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/records.jsonl");
    let text = std::fs::read_to_string(path).unwrap();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| Record::from_json_str(l, None).unwrap())
        .collect()
}

fn max_delta(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

#[test]
fn mixed_cold_and_cached_equals_one_by_one() {
    let model = model();
    let recs = records();
    let want: Vec<_> = recs.iter().map(|r| model.probs(r).unwrap()).collect();
    let enc: Vec<_> = recs
        .iter()
        .map(|r| model.encode_record(r, None).unwrap())
        .collect();

    // All cold: every distinct state runs once, records with equal states share one prefix.
    let cold = model.run(&enc, &vec![None; enc.len()], true).unwrap();
    let prefix = |i: usize| Arc::clone(cold[i].prefix.as_ref().unwrap());
    let mut worst = 0f32;
    for (i, s) in cold.iter().enumerate() {
        assert!(!s.reused);
        worst = worst.max(max_delta(&s.probs, &want[i]));
        for j in 0..cold.len() {
            if enc[i].state_ids() == enc[j].state_ids() {
                assert!(Arc::ptr_eq(&prefix(i), &prefix(j)), "records {i}, {j}");
            }
        }
    }
    // Each alone on its prefix from the batch, and all of them on their prefixes together.
    for i in 0..cold.len() {
        let one = model.run(&enc[i..=i], &[Some(prefix(i))], true).unwrap();
        assert!(one[0].reused);
        worst = worst.max(max_delta(&one[0].probs, &want[i]));
    }
    let all: Vec<_> = (0..cold.len()).map(|i| Some(prefix(i))).collect();
    for (i, s) in model.run(&enc, &all, false).unwrap().iter().enumerate() {
        worst = worst.max(max_delta(&s.probs, &want[i]));
    }
    // Every other record continues a prefix (half from the batch above, half made one by one),
    // the rest run cold, records repeated and out of order.
    let order: Vec<usize> = (0..recs.len()).rev().chain(0..recs.len()).collect();
    let batch: Vec<_> = order.iter().map(|&i| enc[i].clone()).collect();
    let prefixes: Vec<_> = order
        .iter()
        .enumerate()
        .map(|(k, &i)| match k % 4 {
            0 => Some(prefix(i)),
            1 => Some(model.probs_and_prefix(&recs[i]).unwrap().1),
            _ => None,
        })
        .collect();
    let mixed = model.run(&batch, &prefixes, true).unwrap();
    for (k, (&i, s)) in order.iter().zip(&mixed).enumerate() {
        assert_eq!(s.reused, prefixes[k].is_some());
        worst = worst.max(max_delta(&s.probs, &want[i]));
        // A returned prefix serves the record again.
        let again = model
            .probs_with_prefix(&recs[i], s.prefix.as_ref().unwrap())
            .unwrap();
        worst = worst.max(max_delta(&again, &want[i]));
    }
    println!("run with prefixes vs probs one by one: max|Δp| {worst:.2e}");
    assert!(worst <= TOL, "{worst:e}");
}

#[test]
fn wrong_prefix_is_an_error() {
    let model = model();
    let recs = records();
    let a = model.encode_record(&recs[0], None).unwrap();
    let b = model.encode_record(&recs[1], None).unwrap();
    assert_ne!(a.state_ids(), b.state_ids());
    let (_, prefix) = model.probs_and_prefix(&recs[1]).unwrap();
    let err = model
        .run(std::slice::from_ref(&a), &[Some(prefix)], false)
        .err()
        .unwrap();
    assert!(matches!(err, Error::Prefix { .. }), "{err}");
    let err = model.run(&[a.clone(), a], &[None], false).err().unwrap();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert!(model.run(&[], &[], true).unwrap().is_empty());
}

#[test]
fn cache_reuses_and_evicts_within_its_budget() {
    let model = model();
    let recs = records();
    let want = model.probs_batch(&recs).unwrap();
    let sizes: Vec<usize> = recs
        .iter()
        .map(|r| model.probs_and_prefix(r).unwrap().1.bytes())
        .collect();
    assert!(sizes.iter().all(|&b| b > 0));
    // Longer states hold more keys.
    let len = |r: &Record| model.encode_record(r, None).unwrap().state_ids().len();
    for (i, a) in recs.iter().enumerate() {
        for (j, b) in recs.iter().enumerate() {
            if len(a) < len(b) {
                assert!(sizes[i] < sizes[j], "{i} {j}");
            }
        }
    }

    let enc = model.encode_records(&recs).unwrap();
    let roomy = PrefixCache::new(1 << 30);
    let first = roomy.probs(&model, &enc).unwrap();
    let second = roomy.probs(&model, &enc).unwrap();
    let stats = roomy.stats();
    assert_eq!(stats.misses as usize, recs.len());
    assert_eq!(stats.hits as usize, recs.len());
    assert_eq!(stats.evictions, 0);
    let distinct: std::collections::HashSet<Vec<u32>> = recs
        .iter()
        .map(|r| model.encode_record(r, None).unwrap().state_ids().to_vec())
        .collect();
    assert_eq!(stats.entries, distinct.len());
    for (w, (a, b)) in want.iter().zip(first.iter().zip(&second)) {
        assert!(max_delta(w, a) <= TOL && max_delta(w, b) <= TOL);
    }

    // Room for about two prefixes: entries go, bytes stay within the budget, answers stay equal.
    let budget = sizes.iter().max().unwrap() * 2 + 1;
    let tight = PrefixCache::new(budget);
    for _ in 0..3 {
        let got = tight.probs(&model, &enc).unwrap();
        for (w, g) in want.iter().zip(&got) {
            assert!(max_delta(w, g) <= TOL);
        }
        let s = tight.stats();
        assert!(s.bytes <= budget, "{s:?}");
    }
    assert!(tight.stats().evictions > 0);

    // Nothing fits: nothing kept, every lookup a miss.
    let none = PrefixCache::new(0);
    none.probs(&model, &enc).unwrap();
    let s = none.stats();
    assert_eq!((s.entries, s.bytes, s.hits), (0, 0, 0));
    assert_eq!(s.rejected as usize, recs.len());
}

fn load(name: &str, lora_scale: f64) -> DecisionModel {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let options = LoadOptions::default()
        .with_backend(Backend::Cpu)
        .with_lora_scale(lora_scale);
    DecisionModel::load(dir, &options).unwrap()
}

/// A prefix carries the id of the model that made it: another adapter or another `lora_scale`
/// refuses it (its activations are another model's), through `probs_with_prefix` and
/// `run`; a cache shared by two models never hands one the other's prefix. Two loads
/// of the same files with the same settings share an id and accept each other's prefixes.
#[test]
fn a_prefix_from_another_model_is_refused() {
    let a = load("kev-small", 1.0);
    let record = &records()[0];
    let (_, prefix) = a.probs_and_prefix(record).unwrap();
    assert_eq!(prefix.model(), a.id());

    let same = load("kev-small", 1.0);
    assert_eq!(same.id(), a.id());
    let d = max_delta(
        &same.probs_with_prefix(record, &prefix).unwrap(),
        &same.probs(record).unwrap(),
    );
    assert!(d <= TOL, "{d:e}");

    for other in [load("kev-small", 0.0), load("kev-rslora", 1.0)] {
        assert_ne!(other.id(), a.id());
        match other.probs_with_prefix(record, &prefix) {
            Err(Error::Prefix { message }) => {
                assert!(message.contains("another model"), "{message}")
            }
            r => panic!("another model's prefix: {:?}", r.map(|_| ())),
        }
        let encoded = other.encode_record(record, None).unwrap();
        let given = Some(a.prefix(&record.state).unwrap());
        assert!(matches!(
            other.run(std::slice::from_ref(&encoded), &[given], false),
            Err(Error::Prefix { .. })
        ));

        // One cache, both models: each gets its own numbers.
        let cache = PrefixCache::new(64 << 20);
        let mine = a.encode_record(record, None).unwrap();
        let first = cache.probs(&a, &[mine]).unwrap();
        let second = cache.probs(&other, &[encoded]).unwrap();
        let d = max_delta(&second[0], &other.probs(record).unwrap());
        assert!(d <= TOL, "{d:e}");
        let d = max_delta(&first[0], &a.probs(record).unwrap());
        assert!(d <= TOL, "{d:e}");
        assert_eq!(cache.stats().entries, 2);
    }
}
