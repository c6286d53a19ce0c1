"""The Rust suite's bad inputs (tests/errors.rs, and record faults of kev-core) raise the
package's exception classes with the library's message: the same text `score` prints."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import kev
import safetensors_io as st
from conftest import FIXTURES, copy_checkpoint, run_score

CKPT = FIXTURES / "kev-small"


@pytest.fixture(scope="module")
def model() -> kev.DecisionModel:
    return kev.DecisionModel.load(CKPT, backend="cpu", dtype="f32")


#: (JSONL line, exception class, field), one per line of the file given to `score`.
BAD_RECORDS = [
    (json.dumps({"state": "word " * 3000, "questions": [{"prompt": "q", "options": ["a"]}]}), kev.TooLongError, None),
    ('{"state": "s", "questions": [{"prompt": "q", "options": ["a <|kev_option|>"]}]}', kev.RecordError, "questions[0].options[0]"),
    ('{"id": "e", "state": "s", "questions": []}', kev.RecordError, "questions"),
    ('{"id": "m", "questions": [{"prompt": "q", "options": ["a"]}]}', kev.RecordError, "state"),
    ('{"id": "u", "state": "s", "questions": [{"prompt": "q", "options": ["a"]}], "extra": 1}', kev.RecordError, "extra"),
    ('{"id": "o", "state": "s", "questions": [{"prompt": "q", "options": ["a", "b"], "answer": 2}]}', kev.RecordError, "questions[0].answer"),
    ('{"id": "t", "state": "s", "questions": [{"prompt": "q", "options": ["a", 3]}]}', kev.RecordError, "questions[0].options[1]"),
    ('{"id": 5, "state": "s", "questions": []}', kev.RecordError, "id"),
    ("[1, 2]", kev.RecordError, None),
    ("{not json", kev.RecordError, None),
]


def test_bad_records_raise_the_librarys_errors(model, score_bin, tmp_path):
    good = (FIXTURES / "records.jsonl").read_text(encoding="utf-8").splitlines()[0]
    lines = [good] + [line for line, _, _ in BAD_RECORDS] + [good]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    proc = run_score(score_bin, "--records", str(path), "--skip-invalid")
    skipped = [l[len("skipping: ") :] for l in proc.stderr.splitlines() if l.startswith("skipping: ")]
    assert len(skipped) == len(BAD_RECORDS), proc.stderr
    for n, ((line, cls, field), want) in enumerate(zip(BAD_RECORDS, skipped), start=2):
        with pytest.raises(cls) as err:
            model.encode(line, line=n)
        assert type(err.value) is cls
        assert str(err.value) == want
        assert isinstance(err.value, ValueError) and isinstance(err.value, kev.KevError)
        assert err.value.line == n and err.value.field == field
        # Without a line, as a record built in code: the same fault, no line in the message.
        with pytest.raises(cls) as err:
            model.probs(line)
        assert str(err.value) == want.replace(f" at line {n}", "")
        assert err.value.line is None
    too_long = pytest.raises(kev.TooLongError)
    with too_long as err:
        model.probs_batch([good, BAD_RECORDS[0][0]])
    assert err.value.max_tokens == 1024 and err.value.tokens > 1024


def test_what_json_cannot_hold_is_a_record_error(model):
    with pytest.raises(
        kev.RecordError, match=r"^record: not representable as JSON: a value of type `set`"
    ):
        model.probs({"state": "s", "questions": [{"prompt": "q", "options": {"a"}}]})
    with pytest.raises(kev.RecordError, match=r"^record: not valid UTF-8"):
        model.probs(b'{"state": "\xff", "questions": []}')
    # NaN and infinity are not JSON: refused as such, not read as malformed JSON text.
    for bad in (float("nan"), float("inf")):
        with pytest.raises(kev.RecordError, match=r"^record: not representable as JSON: Out of range"):
            model.probs({"id": bad, "state": "s", "questions": [{"prompt": "q", "options": ["a"]}]})
    # A lone surrogate in text given as str is text that is not UTF-8.
    with pytest.raises(kev.RecordError, match=r"^record: not valid UTF-8"):
        model.probs('{"state": "\ud800", "questions": []}')


def test_numpy_scalars_are_their_numbers(model):
    import numpy as np

    record = {"state": "s", "questions": [{"prompt": "q", "options": ["a", "b"], "answer": 1}]}
    want = model.probs(record)
    record["questions"][0]["answer"] = np.int64(1)
    got = model.probs(record)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    # A numpy float where an index belongs is the library's field error, as a float would be.
    record["questions"][0]["answer"] = np.float64(1.5)
    with pytest.raises(kev.RecordError, match="answer"):
        model.probs(record)
    with pytest.raises(TypeError, match="sequence of records"):
        model.probs_batch({"state": "s", "questions": [{"prompt": "q", "options": ["a"]}]})


def test_a_record_built_in_code_without_questions(model):
    with pytest.raises(kev.RecordError, match=r"^record: field `questions`: must not be empty$"):
        model.probs({"state": "s", "questions": []})


def break_and_load(tmp_path: Path, score_bin: Path, edit) -> kev.KevError:
    """Breaks a copy of kev-small with `edit`, loads it from Python, and checks the message
    against `score`'s on the same copy."""
    ckpt = copy_checkpoint(tmp_path)
    edit(ckpt)
    with pytest.raises(kev.KevError) as err:
        kev.DecisionModel.load(ckpt, backend="cpu", dtype="f32")
    proc = run_score(score_bin, "--checkpoint", str(ckpt), check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == f"error: loading checkpoint `{ckpt}`: {err.value}"
    return err.value


def edit_tensors(path: Path, edit) -> None:
    tensors = st.load(path)
    edit(tensors)
    st.save(tensors, path)


def test_unknown_adapter_tensor_is_named(tmp_path, score_bin):
    def edit(ckpt):
        def add(t):
            a = t["base_model.model.layers.0.mlp.up_proj.lora_A.weight"]
            t["base_model.model.layers.0.mlp.nonexistent.lora_A.weight"] = a
            t["base_model.model.layers.0.mlp.nonexistent.lora_B.weight"] = st.transpose_2d(a)

        edit_tensors(ckpt / "adapter" / "adapter_model.safetensors", add)

    err = break_and_load(tmp_path, score_bin, edit)
    assert type(err) is kev.CheckpointError and isinstance(err, OSError)
    assert "layers.0.mlp.nonexistent" in str(err) and "layers.0.mlp.nonexistent" in err.name


def test_misshaped_adapter_tensor_is_named(tmp_path, score_bin):
    key = "base_model.model.layers.2.mlp.down_proj.lora_B.weight"

    def edit(ckpt):
        edit_tensors(ckpt / "adapter" / "adapter_model.safetensors", lambda t: t.update({key: st.narrow_rows(t[key], 10)}))

    err = break_and_load(tmp_path, score_bin, edit)
    assert isinstance(err, kev.KevError) and "layers.2.mlp.down_proj" in str(err)


def test_missing_base_tensor_is_named(tmp_path, score_bin):
    def edit(ckpt):
        edit_tensors(ckpt.parent / "base-mm" / "model.safetensors",
                     lambda t: t.pop("model.language_model.layers.3.self_attn.k_norm.weight"))

    err = break_and_load(tmp_path, score_bin, edit)
    assert type(err) is kev.CheckpointError and "layers.3.self_attn.k_norm.weight" in str(err)


def test_mlx_layout_is_refused(tmp_path, score_bin):
    def rename(t):
        for k in list(t):
            t[k.replace("model.language_model.", "language_model.model.", 1)] = t.pop(k)

    err = break_and_load(tmp_path, score_bin, lambda ckpt: edit_tensors(ckpt.parent / "base-mm" / "model.safetensors", rename))
    assert "mlx-community" in str(err)


def test_head_errors_are_named(tmp_path, score_bin):
    err = break_and_load(tmp_path, score_bin, lambda ckpt: edit_tensors(ckpt / "head.safetensors", lambda t: t.pop("k.bias")))
    assert type(err) is kev.CheckpointError and err.name == "k.bias" and "k.bias" in str(err)


def test_missing_adapter_file_is_reported(tmp_path, score_bin):
    err = break_and_load(tmp_path, score_bin, lambda ckpt: (ckpt / "adapter" / "adapter_model.safetensors").unlink())
    assert type(err) is kev.CheckpointError and "adapter_model.safetensors" in str(err)
    assert err.path is not None and err.path.endswith("adapter_model.safetensors")


def test_bad_kev_json_is_a_config_error(tmp_path, score_bin):
    def edit(ckpt):
        cfg = json.loads((ckpt / "kev.json").read_text())
        cfg["head"]["dim"] = "sixteen"
        (ckpt / "kev.json").write_text(json.dumps(cfg))

    err = break_and_load(tmp_path, score_bin, edit)
    assert type(err) is kev.ConfigError and isinstance(err, ValueError)
    assert err.field == "head.dim" and err.path.endswith("kev.json")


@pytest.mark.skipif(sys.platform == "darwin", reason="a Metal build may well have the device")
def test_unavailable_backend_is_an_error(score_bin):
    with pytest.raises(kev.DeviceError) as err:
        kev.DecisionModel.load(CKPT, backend="metal")
    assert isinstance(err.value, RuntimeError)
    proc = run_score(score_bin, "--checkpoint", str(CKPT), backend="metal", check=False)
    assert proc.stderr.strip().splitlines()[-1] == f"error: loading checkpoint `{CKPT}`: {err.value}"


def test_bad_arguments(tmp_path):
    with pytest.raises(kev.ArgumentError, match=re.escape("invalid argument `backend`")) as err:
        kev.DecisionModel.load(CKPT, backend="tpu")
    assert err.value.name == "backend" and isinstance(err.value, ValueError)
    with pytest.raises(kev.ArgumentError, match="dtype"):
        kev.DecisionModel.load(CKPT, dtype="f8")
    with pytest.raises(kev.ArgumentError, match="lora_scale"):
        kev.DecisionModel.load(CKPT, lora_scale=float("nan"))
    with pytest.raises(kev.CheckpointError, match="kev.json") as err:
        kev.DecisionModel.load(tmp_path / "nowhere")
    assert isinstance(err.value, OSError)
