"""Tests of bench/mlx_peer.py.

    python -m pytest bench/tests                    # numpy only: configuration, adapter, head, records
    python -m pytest bench/tests -m mlx             # with mlx and mlx-lm: the fixtures' probabilities

The first group needs numpy and pytest. The second runs mlx-lm's Qwen3.5 as the peer builds it
(on mlx's CPU off a Mac: `pip install "mlx[cpu]" mlx-lm==0.32.2 tokenizers`) on the small
checkpoints of tests/fixtures and compares every form with the PyTorch reference's probabilities
(reference.json, docs/CONTRACT.md §7); without mlx those tests are reported as skipped, or fail
where KEV_REQUIRE_MLX=1 (scripts/test-mlx-peer.sh, as CI runs them).
"""

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent
FIXTURES = BENCH.parent / "tests" / "fixtures"
sys.path.insert(0, str(BENCH))

import mlx_peer  # noqa: E402
from common import segments  # noqa: E402
from mlx_peer import PeerError  # noqa: E402

# ---------------------------------------------------------------------------------------------
# numpy


def test_pointer_logits_match_a_double_loop():
    rng = np.random.default_rng(1)
    hidden, dim, n = 24, 8, 5
    head = {"q.weight": rng.normal(size=(dim, hidden)).astype(np.float32),
            "q.bias": rng.normal(size=dim).astype(np.float32),
            "k.weight": rng.normal(size=(dim, hidden)).astype(np.float32),
            "k.bias": rng.normal(size=dim).astype(np.float32)}
    h_decide = rng.normal(size=hidden).astype(np.float16)  # a 16-bit backbone, widened by the head
    h_opts = rng.normal(size=(n, hidden)).astype(np.float16)
    temperature = 0.7
    got = mlx_peer.pointer_logits(h_decide, h_opts, head, dim, temperature, np.float32)
    assert got.dtype == np.float32 and got.shape == (n,)
    for i in range(n):
        q = [float(head["q.bias"][d]) + sum(float(head["q.weight"][d, j]) * float(h_decide[j]) for j in range(hidden))
             for d in range(dim)]
        k = [float(head["k.bias"][d]) + sum(float(head["k.weight"][d, j]) * float(h_opts[i, j]) for j in range(hidden))
             for d in range(dim)]
        want = sum(a * b for a, b in zip(q, k)) / (math.sqrt(dim) * temperature)
        assert abs(got[i] - want) <= 1e-5 * max(1.0, abs(want)), (i, got[i], want)


def test_softmax64_is_the_f64_softmax_rounded_to_f32():
    logits = np.array([1000.0, 999.0, -5.0], dtype=np.float32)  # large: needs the max shift
    got = mlx_peer.softmax64(logits)
    e = [math.exp(x - 1000.0) for x in (1000.0, 999.0, -5.0)]
    want = np.array([x / sum(e) for x in e], dtype=np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    assert mlx_peer.softmax64(np.array([3.5], dtype=np.float32)).tolist() == [1.0]  # one option


def test_merge_lora_sums_in_f32_and_rounds_once():
    rng = np.random.default_rng(2)
    w = rng.normal(size=(6, 5)).astype(np.float16)
    a = rng.normal(size=(3, 5)).astype(np.float32)
    b = rng.normal(size=(6, 3)).astype(np.float32)
    got = mlx_peer.merge_lora(w, a, b, 0.75, np.float32)
    assert got.dtype == np.float16
    for i in range(6):
        for j in range(5):
            exact = float(w[i, j]) + 0.75 * sum(float(b[i, r]) * float(a[r, j]) for r in range(3))
            # one rounding of the f32 sum: within half an f16 ulp of the exact value (plus f32 noise)
            ulp = float(np.spacing(np.float16(abs(exact))))
            assert abs(float(got[i, j]) - exact) <= ulp / 2 + 1e-5, (i, j)
    with pytest.raises(PeerError, match="does not fit"):
        mlx_peer.merge_lora(w, a, b[:5], 1.0, np.float32)


def test_replaced_rows_interpolate_between_base_and_trained_rows():
    base = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    new = np.array([[5.0, 6.0], [7.0, 8.0]], dtype=np.float32)
    np.testing.assert_array_equal(mlx_peer.replaced_rows(base, new, 0.0, np.float32), base)
    np.testing.assert_array_equal(mlx_peer.replaced_rows(base, new, 1.0, np.float32), new)
    np.testing.assert_array_equal(mlx_peer.replaced_rows(base, new, 0.5, np.float32), [[3.0, 4.0], [5.0, 6.0]])


def adapter_config(name):
    return json.loads((FIXTURES / name / "adapter" / "adapter_config.json").read_text())


def test_adapter_scale_of_the_fixtures():
    assert mlx_peer.adapter_scale(adapter_config("kev-small")) == 8 / 4
    assert mlx_peer.adapter_scale(adapter_config("kev-rslora")) == 6 / math.sqrt(4)
    assert mlx_peer.adapter_scale(adapter_config("kev-small"), 0.5) == 1.0
    assert mlx_peer.token_row_ids(adapter_config("kev-tokens")) == [3, 4]
    assert mlx_peer.token_row_ids(adapter_config("kev-small")) == []


@pytest.mark.parametrize("key, value, message", [
    ("use_dora", True, "use_dora"), ("bias", "all", "bias"), ("peft_type", "IA3", "peft_type"),
    ("rank_pattern", {"q_proj": 8}, "rank_pattern"), ("r", 0, "positive"), ("fan_in_fan_out", True, "fan_in_fan_out"),
])
def test_adapter_settings_the_peer_does_not_implement_are_refused(key, value, message):
    cfg = adapter_config("kev-small")
    cfg[key] = value
    with pytest.raises(PeerError, match=message):
        mlx_peer.adapter_scale(cfg)


def test_split_adapter_reads_every_prefix_and_the_token_rows():
    a, b, rows = np.zeros((2, 3)), np.zeros((4, 2)), np.zeros((2, 3))
    pairs, got_rows = mlx_peer.split_adapter({
        "base_model.model.layers.0.mlp.up_proj.lora_A.weight": a,
        "base_model.model.layers.0.mlp.up_proj.lora_B.weight": b,
        "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight": a,
        "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight": b,
        "base_model.model.model.language_model.layers.2.linear_attn.in_proj_z.lora_A.weight": a,
        "base_model.model.model.language_model.layers.2.linear_attn.in_proj_z.lora_B.weight": b,
        "base_model.model.embed_tokens.token_adapter.trainable_tokens_delta": rows,
    })
    assert sorted(pairs) == ["layers.0.mlp.up_proj", "layers.1.self_attn.q_proj", "layers.2.linear_attn.in_proj_z"]
    assert pairs["layers.0.mlp.up_proj"][0] is a and pairs["layers.0.mlp.up_proj"][1] is b
    assert got_rows is rows
    assert mlx_peer.weight_name("layers.0.mlp.up_proj") == "language_model.model.layers.0.mlp.up_proj.weight"


@pytest.mark.parametrize("tensors, message", [
    ({"base_model.model.layers.0.mlp.up_proj.lora_A.weight": 0}, "lora_B missing"),
    ({"base_model.model.layers.0.mlp.up_proj.lora_B.weight": 0}, "lora_A missing"),
    ({"model.layers.0.mlp.up_proj.lora_A.weight": 0}, "PEFT prefixes"),
    ({"base_model.model.layers.0.mlp.up_proj.lora_magnitude_vector": 0}, "neither"),
])
def test_split_adapter_refuses_what_it_cannot_place(tensors, message):
    with pytest.raises(PeerError, match=message):
        mlx_peer.split_adapter(tensors)


def test_mlx_config_moves_top_level_rope_settings_and_keeps_rope_parameters():
    text = json.loads((FIXTURES / "base-text" / "config.json").read_text())
    got = mlx_peer.mlx_config(text)
    assert got["model_type"] == "qwen3_5"
    assert got["text_config"]["rope_parameters"]["rope_theta"] == 1e7
    assert got["text_config"]["rope_parameters"]["partial_rotary_factor"] == 0.25
    multimodal = json.loads((FIXTURES / "base-mm" / "config.json").read_text())
    got = mlx_peer.mlx_config(multimodal)["text_config"]
    assert got["rope_parameters"]["mrope_section"] == [2, 1, 1] and got["num_hidden_layers"] == 8
    # Defaults as Kev's (docs/BACKBONE.md §1) where nothing is given.
    bare = {k: v for k, v in text.items() if k not in ("rope_theta", "partial_rotary_factor")}
    assert mlx_peer.mlx_config(bare)["text_config"]["rope_parameters"]["rope_theta"] == 1e7


def test_mlx_config_refuses_layer_types_mlx_lm_would_not_build():
    cfg = json.loads((FIXTURES / "base-mm" / "config.json").read_text())
    cfg["text_config"]["layer_types"][0] = "full_attention"
    with pytest.raises(PeerError, match="layer_types"):
        mlx_peer.mlx_config(cfg)


def reference(name):
    return json.loads((FIXTURES / name / "reference.json").read_text())


def encoded(records):
    return [(r["state_ids"], r["rows"]) for r in records]


def test_record_handling_on_the_reference_encoding():
    recs = reference("kev-small")["1.0"]
    enc = encoded(recs)
    for state, rows in enc:
        for r in rows:
            decide, opts = mlx_peer.head_positions(len(state), r)
            row = state + r["ids"]
            assert row[decide] == 4 and all(row[o] == 3 for o in opts)  # [DECIDE] and [OPTION] ids
    state, rows = enc[0]
    padded = mlx_peer.right_padded(rows)
    assert len({len(p) for p in padded}) == 1
    for p, r in zip(padded, rows):
        assert p[:len(r["ids"])] == r["ids"] and set(p[len(r["ids"]):]) <= {0}
    own = mlx_peer.owners(enc)
    assert len(own) == sum(len(rows) for _, rows in enc)
    assert own == sorted(own) and [own.count(i) for i in range(len(enc))] == [len(rows) for _, rows in enc]
    flat = [(i, j) for i, (_, rows) in enumerate(enc) for j in range(len(rows))]
    assert mlx_peer.per_record(flat, enc) == [[(i, j) for j in range(len(rows))] for i, (_, rows) in enumerate(enc)]
    assert sum(n for _, n in segments(enc, "prefix")) == sum(len(s) + sum(len(r["ids"]) for r in rows) for s, rows in enc)


# ---------------------------------------------------------------------------------------------
# mlx (the peer itself, on mlx's CPU where there is no Metal)


def mlx_or_skip():
    if os.environ.get("KEV_REQUIRE_MLX") == "1":
        import mlx.core as mx
        import mlx_lm  # noqa: F401
    else:
        mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'mlx[cpu]' off a Mac)")
        pytest.importorskip("mlx_lm", reason="mlx-lm is not installed")

    if not mx.metal.is_available():
        mx.set_default_device(mx.cpu)
    return mx


@pytest.mark.mlx
@pytest.mark.parametrize("name, scale", [
    ("kev-small", "1.0"),   # multimodal layout, untied, LoRA on every module
    ("kev-small", "0.0"),   # the base alone
    ("kev-rslora", "1.0"),  # text-only layout, tied, top-level RoPE settings, rsLoRA
    ("kev-tokens", "0.5"),  # trained token rows, halfway
])
def test_f32_peer_matches_the_pytorch_reference(name, scale):
    mx = mlx_or_skip()
    model, head, kev = mlx_peer.load(FIXTURES / name, "f32", float(scale))
    scorer = mlx_peer.Scorer(model, head, kev)
    recs = reference(name)[scale]
    enc = encoded(recs)
    want = [[q["probs"] for q in r["questions"]] for r in recs]
    got = {"row": mlx_peer.evaluate(mx, scorer.row(enc)), "prefix": mlx_peer.evaluate(mx, scorer.prefix(enc))}
    # The batch form needs states of one length: the two records that share a state.
    groups = {}
    for i, (state, _) in enumerate(enc):
        groups.setdefault(len(state), []).append(i)
    batched = [idx for idx in groups.values() if len(idx) > 1]
    assert batched, "the fixture records have no two states of one length"
    for form, probs in got.items():
        worst = max(abs(float(p) - w) for gr, wr in zip(probs, want) for gq, wq in zip(gr, wr) for p, w in zip(gq, wq))
        assert worst <= 1e-5, f"{name} scale {scale} {form}: max |Δp| {worst:.2e}"
    for idx in batched:
        probs = mlx_peer.evaluate(mx, scorer.batch([enc[i] for i in idx]))
        worst = max(abs(float(p) - w) for i, gr in zip(idx, probs) for gq, wq in zip(gr, want[i]) for p, w in zip(gq, wq))
        assert worst <= 1e-5, f"{name} scale {scale} batch {idx}: max |Δp| {worst:.2e}"


@pytest.mark.mlx
def test_peer_encoding_is_the_reference_encoding():
    mlx_or_skip()
    from tokenizers import Tokenizer

    from common import encode, read_jsonl

    kev = json.loads((FIXTURES / "kev-small" / "kev.json").read_text())
    tok = Tokenizer.from_file(str(FIXTURES / "tokenizer.json"))
    for rec, ref in zip(read_jsonl(FIXTURES / "records.jsonl"), reference("kev-small")["1.0"]):
        state, rows = encode(tok, rec, kev["template"])
        assert state == ref["state_ids"] and rows == ref["rows"]
