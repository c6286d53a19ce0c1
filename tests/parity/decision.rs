//! The decision model against the PyTorch reference (tests/fixtures/kev-*/reference.json):
//! encoding, row form, prefix form, lora_scale 1.0 / 0.5 / 0.0, rsLoRA, trained tokens, one
//! question alone vs among several, prefix reuse, batched records, and reduced precision.

use std::collections::BTreeMap;
use std::io::BufReader;

use crate::common::{backend, device, fixture, TOL_FORMS_F32, TOL_PROBS_F32};
use kev::{DType, DecisionModel, JsonlRecords, LoadOptions, Record};

/// Logits per question: the prefix form ([`DecisionModel::run`]) and the row form
/// ([`kev::reference::row_logits`]).
trait Logits {
    fn logits(&self, record: &Record) -> kev::Result<Vec<Vec<f32>>>;
    fn rows_form(&self, record: &Record) -> kev::Result<Vec<Vec<f32>>>;
}

impl Logits for DecisionModel {
    fn logits(&self, record: &Record) -> kev::Result<Vec<Vec<f32>>> {
        let encoded = self.encode_record(record, None)?;
        Ok(self.run(&[encoded], &[], false)?.remove(0).logits)
    }

    fn rows_form(&self, record: &Record) -> kev::Result<Vec<Vec<f32>>> {
        kev::reference::row_logits(self, record)
    }
}
use serde::Deserialize;

#[derive(Deserialize)]
struct RefRow {
    ids: Vec<u32>,
    decide: usize,
    opts: Vec<usize>,
}

#[derive(Deserialize)]
struct RefQuestion {
    logits: Vec<f32>,
    probs: Vec<f32>,
}

#[derive(Deserialize)]
struct RefRecord {
    state_ids: Vec<u32>,
    rows: Vec<RefRow>,
    questions: Vec<RefQuestion>,
}

fn records() -> Vec<Record> {
    let file = std::fs::File::open(fixture("records.jsonl")).unwrap();
    JsonlRecords::new(BufReader::new(file), fixture("records.jsonl"))
        .map(|(_, r)| r.unwrap())
        .collect()
}

fn reference(ckpt: &str) -> BTreeMap<String, Vec<RefRecord>> {
    let text = std::fs::read_to_string(fixture(&format!("{ckpt}/reference.json"))).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn load(ckpt: &str, scale: f64, dtype: DType) -> DecisionModel {
    let opts = LoadOptions::default()
        .with_lora_scale(scale)
        .with_dtype(dtype)
        .with_backend(backend());
    DecisionModel::load(fixture(ckpt), &opts).unwrap()
}

/// Max |Δp| over all questions, and the number of argmax flips.
fn compare(ours: &[Vec<Vec<f32>>], reference: &[RefRecord], logits: bool) -> (f32, usize) {
    let (mut worst, mut flips) = (0f32, 0);
    for (rec, r) in ours.iter().zip(reference) {
        assert_eq!(rec.len(), r.questions.len());
        for (q, rq) in rec.iter().zip(&r.questions) {
            let want = if logits { &rq.logits } else { &rq.probs };
            assert_eq!(q.len(), want.len());
            for (a, b) in q.iter().zip(want) {
                worst = worst.max((a - b).abs());
            }
            flips += usize::from(argmax(q) != argmax(&rq.probs));
        }
    }
    (worst, flips)
}

/// Max |a − b| over per-question vectors, requiring the same shape (a zip would hide a
/// missing question or option).
fn max_delta(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len(), "question counts differ");
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len(), "option counts differ");
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0f32, f32::max)
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(0, |best, (i, x)| if *x > v[best] { i } else { best })
}

#[test]
fn encoding_matches_reference() {
    let model = load("kev-small", 1.0, DType::F32);
    let refs = reference("kev-small");
    for (rec, r) in records().iter().zip(&refs["1.0"]) {
        let (state, rows) = model.encode(rec).unwrap().rows();
        assert_eq!(state, r.state_ids, "state ids of {:?}", rec.id);
        for (row, rr) in rows.iter().zip(&r.rows) {
            assert_eq!(
                (&row.ids, row.decide, &row.opts),
                (&rr.ids, rr.decide, &rr.opts),
                "{:?}",
                rec.id
            );
        }
    }
}

#[test]
fn f32_probabilities_match_reference_for_every_checkpoint_and_scale() {
    let recs = records();
    for ckpt in [
        "kev-small",
        "kev-rslora",
        "kev-tokens",
        "kev-moe",
        "kev-fp8",
        "kev-ratios",
    ] {
        let refs = reference(ckpt);
        for (scale, want) in &refs {
            let model = load(ckpt, scale.parse().unwrap(), DType::F32);
            let prefix: Vec<_> = recs.iter().map(|r| model.probs(r).unwrap()).collect();
            let rows: Vec<_> = recs
                .iter()
                .map(|r| {
                    model
                        .rows_form(r)
                        .unwrap()
                        .iter()
                        .map(|l| kev_candle::head::softmax(l))
                        .collect()
                })
                .collect();
            let logits: Vec<_> = recs.iter().map(|r| model.logits(r).unwrap()).collect();
            let (dp, flips) = compare(&prefix, want, false);
            let (dr, flips_r) = compare(&rows, want, false);
            let (dl, _) = compare(&logits, want, true);
            println!("{ckpt} lora_scale {scale}: prefix form max|Δp| {dp:.2e} flips {flips}; row form max|Δp| {dr:.2e} flips {flips_r}; max|Δlogit| {dl:.2e}");
            assert!(
                dp <= TOL_PROBS_F32 && dr <= TOL_PROBS_F32,
                "{ckpt} {scale}: {dp:e} / {dr:e}"
            );
            assert_eq!(flips + flips_r, 0);
        }
    }
}

#[test]
fn prefix_form_equals_row_form_and_one_question_equals_many() {
    let model = load("kev-small", 1.0, DType::F32);
    let mut worst = 0f32;
    for rec in records() {
        let whole = model.probs(&rec).unwrap();
        let rows: Vec<Vec<f32>> = model
            .rows_form(&rec)
            .unwrap()
            .iter()
            .map(|l| kev_candle::head::softmax(l))
            .collect();
        for (j, q) in rec.questions.iter().enumerate() {
            let alone = Record {
                questions: vec![q.clone()],
                ..rec.clone()
            };
            let p = model.probs(&alone).unwrap().remove(0);
            for ((a, b), c) in p.iter().zip(&whole[j]).zip(&rows[j]) {
                worst = worst.max((a - b).abs()).max((b - c).abs());
            }
        }
    }
    println!("prefix vs row form, one question vs several: max|Δp| {worst:.2e}");
    assert!(worst <= TOL_FORMS_F32, "{worst:e}");
}

#[test]
fn prefix_is_reused_and_checked() {
    let model = load("kev-small", 1.0, DType::F32);
    let recs = records();
    let (r2, r3) = (&recs[1], &recs[2]);
    assert_eq!(r2.state, r3.state, "fixture records 2 and 3 share a state");
    let (p2, prefix) = model.probs_and_prefix(r2).unwrap();
    let reused = model.probs_with_prefix(r3, &prefix).unwrap();
    // Computing and keeping a prefix runs the state and the branches in one pass, continuing a
    // given one runs the branches alone: other matrix shapes, so on a GPU other summation
    // orders, as `probs`' one pass.
    let worst = max_delta(&reused, &model.probs_and_prefix(r3).unwrap().0)
        .max(max_delta(&p2, &model.probs(r2).unwrap()))
        .max(max_delta(&reused, &model.probs(r3).unwrap()));
    println!("a prefix reused vs computed, one pass vs two: max|Δp| {worst:.2e}");
    assert!(worst <= TOL_FORMS_F32, "{worst:e}");
    // The prefix is not consumed or altered by use.
    let again = model.probs_with_prefix(r3, &prefix).unwrap();
    assert_eq!(
        again, reused,
        "reusing a prefix twice gives the same numbers"
    );
    let err = model.probs_with_prefix(&recs[0], &prefix).unwrap_err();
    assert!(matches!(err, kev::Error::Prefix { .. }), "{err}");
    println!("prefix from another state: {err}");
}

/// `probs_batch(recs)` gives each record what `probs` gives it alone, in input order.
fn assert_batch_equals_one_by_one(model: &DecisionModel, recs: &[Record]) {
    let batch = model.probs_batch(recs).unwrap();
    assert_eq!(batch.len(), recs.len());
    let worst = recs
        .iter()
        .zip(&batch)
        .map(|(rec, b)| max_delta(&model.probs(rec).unwrap(), b))
        .fold(0f32, f32::max);
    println!(
        "batch of {} records vs one by one: max|Δp| {worst:.2e}",
        recs.len()
    );
    assert!(worst <= TOL_FORMS_F32, "{worst:e}");
}

#[test]
fn batch_equals_one_by_one() {
    let model = load("kev-small", 1.0, DType::F32);
    let recs = records();
    assert_batch_equals_one_by_one(&model, &recs);
}

/// A long batch of states from about 100 to 600 tokens in no order of length (so many length
/// groups, each its own pass) equals its records one by one, in input order; a record that fails
/// to encode late in the batch fails it with that record's error, the first in input order.
#[test]
fn long_batch_equals_one_by_one_in_order() {
    let model = load("kev-small", 1.0, DType::F32);
    let base = records();
    let recs: Vec<Record> = (0..48)
        .map(|i| {
            let mut r = base[i % base.len()].clone();
            r.id = Some(format!("long{i}"));
            let unit = format!("{} ", r.state);
            // (States stay short enough that the longest branch still fits `max_tokens`.)
            let want = 100 + (i * 37) % 500;
            while model.encoder().encode_state(&r.state).unwrap().len() < want {
                r.state.push_str(&unit);
            }
            r
        })
        .collect();
    assert_batch_equals_one_by_one(&model, &recs);

    let mut bad = recs.clone();
    bad[40].state = "word ".repeat(2000);
    bad[44].questions[0].prompt = "<|kev_decide|>".into();
    let err = model.probs_batch(&bad).unwrap_err();
    match &err {
        kev::Error::TooLong { id, .. } => assert_eq!(id.as_deref(), Some("long40")),
        other => panic!("expected record long40 too long, got {other}"),
    }
    println!("late encoding error: {err}");
}

/// `record` with two words of its state swapped: other token ids, most often the same token
/// shapes (the caller checks).
fn swapped_state(record: &Record) -> Record {
    let mut words: Vec<&str> = record.state.split(' ').collect();
    let n = words.len();
    if n >= 3 {
        words.swap(1, n - 2);
    }
    let mut twin = record.clone();
    twin.state = words.join(" ");
    twin
}

/// The fixture's records paired with their state-swapped twins, where a twin has another state
/// but the same token shapes (state length, branch lengths, head positions): what one CUDA graph
/// serves. At least two pairs, so a test over them can tell a replay from a stale one.
fn same_shape_twins(model: &DecisionModel) -> Vec<(Record, Record)> {
    let shape = |r: &Record| {
        let (state, rows) = model.encode(r).unwrap().rows();
        let rows: Vec<_> = rows
            .iter()
            .map(|row| (row.ids.len(), row.decide, row.opts.clone()))
            .collect();
        (state.len(), rows)
    };
    let pairs: Vec<(Record, Record)> = records()
        .into_iter()
        .map(|r| {
            let twin = swapped_state(&r);
            (r, twin)
        })
        .filter(|(r, t)| r.state != t.state && shape(r) == shape(t))
        .collect();
    assert!(
        pairs.len() >= 2,
        "too few same-shape twins: {}",
        pairs.len()
    );
    pairs
}

/// f32 on the test backend.
fn f32_options() -> LoadOptions {
    LoadOptions::default()
        .with_dtype(DType::F32)
        .with_backend(backend())
}

/// The small fixture loaded with `opts` (CUDA graphs on by default) and with graphs off: the
/// graph tests' pair.
fn with_and_without_graphs(opts: LoadOptions) -> (DecisionModel, DecisionModel) {
    let graphs = DecisionModel::load(fixture("kev-small"), &opts).unwrap();
    let eager = DecisionModel::load(fixture("kev-small"), &opts.with_cuda_graphs(false)).unwrap();
    (graphs, eager)
}

/// On CUDA, `check` on `model`'s graph counts, no capture having failed; elsewhere, that no
/// graph is reported.
fn check_graph_stats(model: &DecisionModel, check: impl FnOnce(&kev::GraphStats)) {
    let stats = model.graph_stats();
    if model.device().is_cuda() {
        assert_eq!(stats.failed, 0, "{:?}", stats.last_failure);
        check(&stats);
    } else {
        assert_eq!(stats, kev::GraphStats::default());
    }
}

/// On CUDA, [`DecisionModel::forward`] replays a graph for a record shape seen before: the
/// replayed logits equal the eager ones for the record that was captured and for another
/// record of the same shape (its ids written into the graph's inputs). Elsewhere this checks
/// the two loads agree and that no graph is reported.
#[test]
fn graph_replays_equal_eager_forwards() {
    let (graphs, eager) = with_and_without_graphs(f32_options());
    let pairs = same_shape_twins(&graphs);
    let mut worst = 0f32;
    for (r, twin) in &pairs {
        let (want_r, want_t) = (eager.logits(r).unwrap(), eager.logits(twin).unwrap());
        assert!(
            max_delta(&want_r, &want_t) > 1e-3,
            "twins must score differently, or a replay with stale ids would pass"
        );
        // First sight (eager), second (captured), then replays with each record's ids.
        for (rec, want) in [(r, &want_r), (twin, &want_t), (r, &want_r), (twin, &want_t)] {
            worst = worst.max(max_delta(&graphs.logits(rec).unwrap(), want));
        }
    }
    assert!(worst <= 1e-6, "graph vs eager logits differ by {worst:e}");
    let stats = graphs.graph_stats();
    eprintln!("graphs: {stats:?}, max |Δ logit| vs eager {worst:e}");
    check_graph_stats(&graphs, |stats| {
        // Each shape captured at its second sight and replayed after (pairs of one shape share
        // its graph).
        assert!(stats.captured >= 1, "{stats:?}");
        assert!(stats.replayed >= 2 * stats.captured, "{stats:?}");
    });
}

/// `record` with each question's options in reverse order: the same token shapes, except for
/// where the options sit when their lengths differ.
fn reversed_options(record: &Record) -> Record {
    let mut twin = record.clone();
    for q in &mut twin.questions {
        q.options.reverse();
    }
    twin
}

/// On CUDA, records that differ only in where their options sit share one graph (the head's
/// positions are a graph input), and each replay reads its own record's positions: the
/// replayed logits equal the eager ones for both records of every pair. Both plan forms: one
/// pass over state and branches, and states in pieces of 7 tokens (the head gathering from the
/// branches' joined pieces).
#[test]
fn graph_replays_read_each_records_head_positions() {
    for chunk in [None, Some(7)] {
        let opts = f32_options();
        let opts = match chunk {
            Some(chunk) => opts.with_prefill_chunk(chunk),
            None => opts,
        };
        let (graphs, eager) = with_and_without_graphs(opts);
        let rows = |r: &Record| {
            let (state, rows) = graphs.encode(r).unwrap().rows();
            let lengths: Vec<usize> = rows.iter().map(|row| row.ids.len()).collect();
            let heads: Vec<_> = rows
                .iter()
                .map(|row| (row.decide, row.opts.clone()))
                .collect();
            (state.len(), lengths, heads)
        };
        let pairs: Vec<(Record, Record)> = records()
            .into_iter()
            .map(|r| {
                let twin = reversed_options(&r);
                (r, twin)
            })
            .filter(|(r, t)| {
                let (rs, rl, rh) = rows(r);
                let (ts, tl, th) = rows(t);
                rs == ts && rl == tl && rh != th
            })
            .collect();
        assert!(
            !pairs.is_empty(),
            "no record whose options move when reversed"
        );
        let mut worst = 0f32;
        for (r, twin) in &pairs {
            let (want_r, want_t) = (eager.logits(r).unwrap(), eager.logits(twin).unwrap());
            assert!(
                max_delta(&want_r, &want_t) > 1e-3,
                "twins must score differently, or a replay at stale positions would pass"
            );
            // First sight (eager), the twin's (captured: the same shape), then replays.
            for (rec, want) in [(r, &want_r), (twin, &want_t), (r, &want_r), (twin, &want_t)] {
                worst = worst.max(max_delta(&graphs.logits(rec).unwrap(), want));
            }
        }
        assert!(worst <= 1e-6, "graph vs eager logits differ by {worst:e}");
        let stats = graphs.graph_stats();
        eprintln!(
            "prefill chunk {chunk:?}, {} pairs; graphs: {stats:?}, max |Δ logit| vs eager {worst:e}",
            pairs.len()
        );
        check_graph_stats(&graphs, |stats| {
            // A pair's shape is captured on the twin's first sight (or earlier, where pairs
            // share a shape) and replayed for both records after; keyed by head positions,
            // each record would be captured on its own second sight and never replayed.
            assert!(
                (1..=pairs.len().min(8)).contains(&stats.captured),
                "{stats:?}"
            );
            assert!(stats.replayed >= 2 * stats.captured, "{stats:?}");
        });
    }
}

/// `record` with `n` questions: its own, repeated in turn.
fn with_questions(record: &Record, n: usize) -> Record {
    let mut r = record.clone();
    r.questions = record.questions.iter().cycle().take(n).cloned().collect();
    r
}

/// On CUDA, more record shapes than graphs are kept, coming round in turn: the graphs captured
/// first stay and replay, instead of each capture evicting the graph needed next (every forward
/// a capture, slower than running eagerly). Every forward equals the eager one.
#[test]
fn graphs_stay_when_more_shapes_come_round() {
    let (graphs, eager) = with_and_without_graphs(f32_options());
    let base = records().remove(0);
    // Shapes by their number of questions (branch rows), which no padding shares.
    let shapes: Vec<Record> = (1..=16).map(|n| with_questions(&base, n)).collect();
    let want: Vec<_> = shapes.iter().map(|r| eager.logits(r).unwrap()).collect();
    let mut worst = 0f32;
    for _round in 0..4 {
        for (r, want) in shapes.iter().zip(&want) {
            worst = worst.max(max_delta(&graphs.logits(r).unwrap(), want));
        }
    }
    assert!(worst <= 1e-6, "graph vs eager logits differ by {worst:e}");
    let stats = graphs.graph_stats();
    eprintln!("{} shapes, 4 rounds; graphs: {stats:?}", shapes.len());
    check_graph_stats(&graphs, |stats| {
        // The first 8 (the graphs kept) captured in the second round, replayed in the third
        // and the fourth; the rest eager throughout.
        assert_eq!(stats.captured, 8, "{stats:?}");
        assert_eq!(stats.replayed, 2 * stats.captured, "{stats:?}");
    });
}

/// On CUDA in bf16 (where the split kernels read the rows' lengths from the split's table),
/// records whose states differ in length but pad to the same width, and whose option counts
/// pad to the same count, share one graph, and each replay reads its own record's lengths and
/// options: every forward equals that record's eager forward (its first sight in a model of its
/// own, padded the same) bit for bit. Elsewhere nothing pads and no graph is reported.
#[test]
fn graph_replays_read_each_records_lengths() {
    let opts = LoadOptions::default()
        .with_dtype(DType::BF16)
        .with_backend(backend());
    let load = || DecisionModel::load(fixture("kev-small"), &opts).unwrap();
    let graphs = load();
    let base = records().remove(0);
    let words: Vec<String> = (0..40).map(|i| format!("w{i}")).collect();
    let state_len = |r: &Record| graphs.encode(r).unwrap().rows().0.len();
    // States of distinct lengths that pad to one width (64); every other record with its first
    // question's last option dropped (5 options or 4: both pad to 16).
    let mut recs: Vec<Record> = Vec::new();
    let mut lengths = std::collections::BTreeSet::new();
    for n in 1..=words.len() {
        let mut r = base.clone();
        r.state = words[..n].join(" ");
        let len = state_len(&r);
        if (49..=64).contains(&len) && lengths.insert(len) {
            if recs.len() % 2 == 1 {
                r.questions[0].options.pop();
                r.questions[0].answer = None;
            }
            recs.push(r);
        }
    }
    assert!(recs.len() >= 4, "{} state lengths in 49..=64", recs.len());
    let branches = |r: &Record| graphs.encode(r).unwrap().rows().1;
    let options = |r: &Record| branches(r).iter().map(|b| b.opts.len()).sum::<usize>();
    assert_ne!(options(&recs[0]), options(&recs[1]));
    // One branch width bucket (a multiple of 16) for all: only the option counts differ.
    let width = |r: &Record| branches(r).iter().map(|b| b.ids.len().div_ceil(16)).max();
    let widths: Vec<_> = recs.iter().map(width).collect();
    assert!(widths.iter().all(|w| *w == widths[0]), "{widths:?}");
    let want: Vec<_> = recs.iter().map(|r| load().logits(r).unwrap()).collect();
    assert!(
        max_delta(&want[0], &want[2]) > 1e-3,
        "records must score differently, or a replay with stale lengths would pass"
    );
    // The first round: the first record eager, the second captured, the rest replayed; the
    // second round all replayed.
    let mut worst = 0f32;
    for _round in 0..2 {
        for (r, want) in recs.iter().zip(&want) {
            worst = worst.max(max_delta(&graphs.logits(r).unwrap(), want));
        }
    }
    let stats = graphs.graph_stats();
    eprintln!(
        "{} state lengths in one bucket, bf16; graphs: {stats:?}, max |Δ logit| against each \
         record's own eager forward {worst:e}",
        recs.len()
    );
    assert!(
        worst <= 1e-6,
        "replays differ from eager forwards by {worst:e}"
    );
    check_graph_stats(&graphs, |stats| {
        assert_eq!(stats.captured, 1, "{stats:?}");
        assert_eq!(stats.replayed, 2 * recs.len() - 2, "{stats:?}");
    });
}

/// The same for [`DecisionModel::probs_batch`]: a batch of records and a batch of their
/// same-shape twins, each run eagerly, captured, then replayed, against a model without graphs.
#[test]
fn graph_replays_equal_eager_batches() {
    let (graphs, eager) = with_and_without_graphs(f32_options());
    let (batch, twins): (Vec<Record>, Vec<Record>) = same_shape_twins(&graphs).into_iter().unzip();
    let flat = |p: Vec<Vec<Vec<f32>>>| -> Vec<Vec<f32>> { p.into_iter().flatten().collect() };
    let want_b = flat(eager.probs_batch(&batch).unwrap());
    let want_t = flat(eager.probs_batch(&twins).unwrap());
    assert!(
        max_delta(&want_b, &want_t) > 1e-3,
        "twin batches must score differently, or a replay with stale ids would pass"
    );
    let mut worst = 0f32;
    // First sight (eager), second (captured), then replays with each batch's ids.
    for (recs, want) in [
        (&batch, &want_b),
        (&twins, &want_t),
        (&batch, &want_b),
        (&twins, &want_t),
    ] {
        worst = worst.max(max_delta(&flat(graphs.probs_batch(recs).unwrap()), want));
    }
    assert!(
        worst <= 1e-6,
        "graph vs eager probabilities differ by {worst:e}"
    );
    let stats = graphs.graph_stats();
    eprintln!("graphs: {stats:?}, max |Δp| vs eager {worst:e}");
    check_graph_stats(&graphs, |stats| {
        // One graph per group of similar state lengths (`probs_batch` groups a batch by them),
        // each captured once and replayed for both later batches.
        assert!(stats.captured >= 1, "{stats:?}");
        assert_eq!(stats.replayed, 2 * stats.captured, "{stats:?}");
    });
}

#[test]
fn threads_share_one_model() {
    let model = load("kev-small", 1.0, DType::F32);
    let recs = records();
    let single: Vec<_> = recs.iter().map(|r| model.probs(r).unwrap()).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|_| {
                s.spawn(|| {
                    recs.iter()
                        .map(|r| model.probs(r).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), single);
        }
    });
}

#[test]
fn reduced_precision() {
    // bf16 keeps 8 bits of mantissa, f16 11: weights, activations, RoPE and gates round at every
    // layer, and the fixture's peaked heads (logits up to ~12) amplify that into probabilities.
    // On CPUs with AVX512-BF16 a bf16 model rounds only its weights and its matmuls' inputs
    // (f32 activations, Kev's bf16 matmul). Measured on the CPU: max|Δp| 6.8e-2 (bf16 without
    // AVX512-BF16), 3.7e-2 (with it) and 1.1e-2 (f16), no flips. The bounds leave room for
    // other backends' summation orders; flips are reported, not asserted.
    let recs = records();
    let refs = reference("kev-small");
    for (dtype, tol) in [(DType::BF16, 0.1f32), (DType::F16, 0.05)] {
        let model = load("kev-small", 1.0, dtype);
        let ours: Vec<_> = recs.iter().map(|r| model.probs(r).unwrap()).collect();
        let (dp, flips) = compare(&ours, &refs["1.0"], false);
        println!(
            "kev-small {dtype:?} on {:?}: max|Δp| {dp:.2e}, argmax flips {flips} of 21",
            backend()
        );
        assert!(dp <= tol, "{dtype:?}: {dp:e}");
    }
}

/// `kev-small` loaded in the quantized `dtype` where it `runs` (its weights' dtype checked), or
/// `None` after checking that the load is refused there, naming the dtype.
fn quantized(dtype: DType, runs: bool) -> Option<DecisionModel> {
    let opts = LoadOptions::default()
        .with_dtype(dtype)
        .with_backend(backend());
    let loaded = DecisionModel::load(fixture("kev-small"), &opts);
    if !runs {
        let err = loaded.err().expect("loaded where it cannot run");
        assert!(
            matches!(&err, kev::Error::InvalidArgument { name, .. } if name == "dtype"),
            "{err}"
        );
        println!("{dtype} refused here, as it should be: {err}");
        return None;
    }
    let model = loaded.unwrap();
    assert_eq!(model.weights_dtype(), dtype);
    Some(model)
}

#[test]
fn int8_weights_on_the_cpu() {
    // The `int8` dtype quantizes the projections' weights per output column and their inputs per
    // block of 32 values: not exact, so its drift from the reference is measured and bounded
    // loosely: on the CPU max|Δp| 1.2e-1 and 1 argmax flip of 21, three times bf16's drift (the
    // fixture's peaked heads amplify it; flips are reported, not asserted). Its AVX2 and AVX-512
    // VNNI kernels give the same outputs bit for bit (`packed_int8_matmul_matches_its_blockwise_
    // definition`). Where it cannot run (a GPU backend, a CPU with neither) the load is refused,
    // naming the dtype.
    let Some(model) = quantized(
        DType::Int8,
        backend() == kev::Backend::Cpu && kev_kernels::int8_gemm_available(),
    ) else {
        return;
    };
    let recs = records();
    let ours: Vec<_> = recs.iter().map(|r| model.probs(r).unwrap()).collect();
    let (dp, flips) = compare(&ours, &reference("kev-small")["1.0"], false);
    println!("kev-small int8 on the CPU: max|Δp| {dp:.2e}, argmax flips {flips} of 21");
    assert!(dp <= 0.2, "int8: {dp:e}");
    // One path: the batch gives each record's numbers.
    assert_batch_equals_one_by_one(&model, &recs);
}

/// The `fp8` dtype: bf16 with the projections' weights quantized to e4m3 per 128 × 128 block
/// and their inputs per token and block of 128, products on FP8 tensor cores. Not exact, so its
/// drift from the reference (and from bf16 on the same GPU) is measured, bounded loosely, and
/// reported; argmax flips are reported, not asserted. On the H100: max|Δp| 0.46 and 2 flips of
/// 21 (bf16: 0.047, 0), four times int8's drift on the CPU, as e4m3's 3 mantissa bits against
/// int8's per-feature 8 bits give (the fixture's peaked heads amplify it; the product itself is
/// checked against its reference in `fp8_linear_on_device_matches_its_reference`). Where it
/// cannot run (the CPU, Metal, a GPU other than compute capability 9.0) the load is refused,
/// naming the dtype.
#[test]
fn fp8_products_on_hopper() {
    let Some(model) = quantized(DType::Fp8, kev_kernels::fp8_available(&device())) else {
        return;
    };
    let recs = records();
    let ours: Vec<_> = recs.iter().map(|r| model.probs(r).unwrap()).collect();
    let (dp, flips) = compare(&ours, &reference("kev-small")["1.0"], false);
    let bf16 = load("kev-small", 1.0, DType::BF16);
    let plain: Vec<_> = recs.iter().map(|r| bf16.probs(r).unwrap()).collect();
    let (dp_bf16, flips_bf16) = compare(&plain, &reference("kev-small")["1.0"], false);
    let against_bf16 = ours
        .iter()
        .zip(&plain)
        .map(|(a, b)| max_delta(a, b))
        .fold(0f32, f32::max);
    println!(
        "kev-small fp8: max|Δp| {dp:.2e} ({flips} argmax flips of 21) against the reference, \
         {against_bf16:.2e} against bf16 (bf16: {dp_bf16:.2e}, {flips_bf16} flips)"
    );
    assert!(dp <= 0.6, "fp8: {dp:e}");
    let batch = model.probs_batch(&recs).unwrap();
    let worst = ours
        .iter()
        .zip(&batch)
        .map(|(a, b)| max_delta(a, b))
        .fold(0f32, f32::max);
    println!("fp8 batch vs one by one: max|Δp| {worst:.2e}");
    assert!(worst <= 0.05, "fp8 batch vs one by one: {worst:e}");
}

#[test]
fn chunked_state_equals_whole_state() {
    // The 400-token state of r7 in pieces of 7 and 64 tokens, against one piece.
    let recs = records();
    let whole = load("kev-small", 1.0, DType::F32);
    for chunk in [7, 64] {
        let opts = LoadOptions::default()
            .with_backend(backend())
            .with_dtype(DType::F32)
            .with_prefill_chunk(chunk);
        let chunked = DecisionModel::load(fixture("kev-small"), &opts).unwrap();
        let mut worst = 0f32;
        for rec in &recs {
            worst = worst.max(max_delta(
                &whole.probs(rec).unwrap(),
                &chunked.probs(rec).unwrap(),
            ));
            // Logits, compared at the scale of probabilities.
            let rows = max_delta(
                &chunked.rows_form(rec).unwrap(),
                &whole.rows_form(rec).unwrap(),
            );
            worst = worst.max(rows / 10.0);
        }
        let batch = chunked.probs_batch(&recs).unwrap();
        assert_eq!(batch.len(), recs.len());
        for (rec, b) in recs.iter().zip(&batch) {
            worst = worst.max(max_delta(&whole.probs(rec).unwrap(), b));
        }
        println!("state in pieces of {chunk} vs whole (prefix, row and batch forms): max|Δp| {worst:.2e}");
        assert!(worst <= TOL_FORMS_F32, "{worst:e}");
    }
}

/// On CUDA, a device allocation that fails is an error the caller can recover from, not an
/// abort: with the GPU's memory taken by other tensors, a large batch fails with an error; once
/// the memory is free again, the same model scores the batch exactly as before (eager forwards),
/// another model that was loaded before the failure still replays its CUDA graph to the same
/// numbers, and a model loaded after it scores as the first model's first (eager) run did.
#[cfg(feature = "cuda")]
#[test]
fn out_of_device_memory_is_a_recoverable_error() {
    let eager = LoadOptions::default()
        .with_dtype(DType::F32)
        .with_backend(kev::Backend::Cuda(0))
        .with_cuda_graphs(false);
    let model = DecisionModel::load(fixture("kev-small"), &eager).unwrap();
    let graphs = eager.clone().with_cuda_graphs(true);
    let other = DecisionModel::load(fixture("kev-small"), &graphs).unwrap();
    let batch: Vec<Record> = (0..50).flat_map(|_| records()).collect();
    let want = model.probs_batch(&batch).unwrap();
    let want_one = model.probs(&batch[0]).unwrap();
    let small = &batch[..3];
    // The first sight of a shape runs eagerly, the second captures a graph, the third replays it.
    let other_eager = other.probs_batch(small).unwrap();
    other.probs_batch(small).unwrap();
    let other_want = other.probs_batch(small).unwrap();
    assert_eq!(other.graph_stats().replayed, 1, "{:?}", other.graph_stats());
    let dev = model.device().clone();
    let free_gib = || {
        let (free, _) = dev
            .as_cuda_device()
            .unwrap()
            .cuda_stream()
            .context()
            .mem_get_info()
            .unwrap();
        free as f64 / (1u64 << 30) as f64
    };
    // Take the device's memory, in ever smaller pieces, until not even 1 MiB is left.
    let mut hog = Vec::new();
    for chunk in [1usize << 30, 1 << 26, 1 << 20] {
        while let Ok(t) = candle_core::Tensor::zeros(chunk, candle_core::DType::U8, &dev) {
            hog.push(t);
        }
    }
    let taken: usize = hog.iter().map(|t| t.elem_count()).sum();
    let err = model
        .probs_batch(&batch)
        .expect_err("a batch cannot fit in under 1 MiB of device memory");
    eprintln!(
        "with {:.1} GiB taken ({:.2} GiB free): {err:#}",
        taken as f64 / (1u64 << 30) as f64,
        free_gib()
    );
    drop(hog);
    eprintln!("after the hog is dropped: {:.2} GiB free", free_gib());
    // Every step is printed before anything is asserted, so one run shows them all.
    let again = model.probs_batch(&batch);
    let report =
        |what: &str, got: &kev::Result<Vec<Vec<Vec<f32>>>>, want: &[Vec<Vec<f32>>]| match got {
            Ok(got) => {
                let worst = got
                    .iter()
                    .zip(want)
                    .map(|(g, w)| max_delta(g, w))
                    .fold(0f32, f32::max);
                eprintln!("{what}: max|Δp| {worst:.2e} against before the failure");
            }
            Err(e) => eprintln!("{what}: error {e:#}"),
        };
    report("the same model, eager", &again, &want);
    let other_again = other.probs_batch(small);
    report("a model loaded before, graphs", &other_again, &other_want);
    let fresh =
        DecisionModel::load(fixture("kev-small"), &graphs).and_then(|m| m.probs_batch(small));
    report("a model loaded after, eager", &fresh, &other_eager);
    assert_eq!(
        again.unwrap(),
        want,
        "the model must be usable, and unchanged, after the failure"
    );
    assert_eq!(model.probs(&batch[0]).unwrap(), want_one);
    assert_eq!(other_again.unwrap(), other_want);
    assert_eq!(fresh.unwrap(), other_eager);
}

/// A MoE base whose routed experts are stored fused (`experts.gate_up_proj: [E, 2·I, H]`,
/// `experts.down_proj: [E, H, I]`, as transformers holds them) scores as the published
/// per-expert layout does, bit for bit; a fused file missing `down_proj` is refused naming it.
#[test]
fn moe_experts_read_fused_or_per_expert() {
    use std::collections::HashMap;

    let dir = tempfile::tempdir().unwrap();
    let (base, ckpt) = (dir.path().join("base-fused"), dir.path().join("kev-fused"));
    std::fs::create_dir_all(&base).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(fixture(&format!("base-moe/{f}")), base.join(f)).unwrap();
    }
    let stored = candle_core::safetensors::load(
        fixture("base-moe/model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let mut fused: HashMap<String, candle_core::Tensor> = HashMap::new();
    let mut per_layer: BTreeMap<String, BTreeMap<usize, [Option<candle_core::Tensor>; 3]>> =
        BTreeMap::new();
    for (name, t) in stored {
        let Some((stem, rest)) = name.split_once(".mlp.experts.") else {
            fused.insert(name, t);
            continue;
        };
        let (e, proj) = rest.split_once('.').unwrap();
        let slot = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
            .iter()
            .position(|p| *p == proj)
            .unwrap();
        per_layer
            .entry(stem.to_string())
            .or_default()
            .entry(e.parse().unwrap())
            .or_default()[slot] = Some(t);
    }
    for (stem, experts) in &per_layer {
        let part = |slot: usize| -> Vec<candle_core::Tensor> {
            experts.values().map(|e| e[slot].clone().unwrap()).collect()
        };
        let gate_up: Vec<_> = part(0)
            .iter()
            .zip(part(1))
            .map(|(g, u)| candle_core::Tensor::cat(&[g, &u], 0).unwrap())
            .collect();
        let key = |p: &str| format!("{stem}.mlp.experts.{p}");
        fused.insert(
            key("gate_up_proj"),
            candle_core::Tensor::stack(&gate_up, 0).unwrap(),
        );
        fused.insert(
            key("down_proj"),
            candle_core::Tensor::stack(&part(2), 0).unwrap(),
        );
    }
    candle_core::safetensors::save(&fused, base.join("model.safetensors")).unwrap();
    std::fs::create_dir_all(ckpt.join("adapter")).unwrap();
    let kev_json = std::fs::read_to_string(fixture("kev-moe/kev.json")).unwrap();
    std::fs::write(
        ckpt.join("kev.json"),
        kev_json.replace("../base-moe", "../base-fused"),
    )
    .unwrap();
    for f in [
        "head.safetensors",
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
    ] {
        std::fs::copy(fixture(&format!("kev-moe/{f}")), ckpt.join(f)).unwrap();
    }

    let opts = LoadOptions::default()
        .with_dtype(DType::F32)
        .with_backend(backend());
    let published = load("kev-moe", 1.0, DType::F32);
    let from_fused = DecisionModel::load(&ckpt, &opts).unwrap();
    for rec in records() {
        assert_eq!(
            from_fused.probs(&rec).unwrap(),
            published.probs(&rec).unwrap(),
            "{:?}",
            rec.id
        );
    }

    let first = per_layer.keys().next().unwrap();
    fused.remove(&format!("{first}.mlp.experts.down_proj"));
    candle_core::safetensors::save(&fused, base.join("model.safetensors")).unwrap();
    let err = DecisionModel::load(&ckpt, &opts)
        .err()
        .expect("a base without down_proj");
    assert!(err.to_string().contains("mlp.experts.down_proj"), "{err}");
}
