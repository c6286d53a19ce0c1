"""examples/ray_score.py on a local Ray cluster of 2 CPUs with 2 actors: its output is
`score`'s on the same file, and every input record is accounted for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES, RECORDS, ROOT, TOL_FORMS_F32, run_score

EXAMPLE = ROOT / "examples" / "ray_score.py"


def ray_score(tmp_path: Path, *records: Path, batches_per_block: int = 1) -> list:
    out = tmp_path / "scored.jsonl"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--records", *map(str, records), "--out", str(out),
         "--num-cpus", "2", "--actors", "2", "--backend", "cpu", "--dtype", "f32",
         "--batches-per-block", str(batches_per_block)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]


def f32(probs) -> np.ndarray:
    return np.asarray(probs, dtype=np.float32)


def test_ray_output_equals_score(tmp_path, score_bin):
    """Blocks of one batch (8 records) each, so 2 actors share the 12 records, batched as
    `score` batches them: the same numbers, bit for bit."""
    ours = ray_score(tmp_path, RECORDS)
    want = [json.loads(l) for l in run_score(score_bin, "--records", str(RECORDS), "--batch-size", "8").stdout.splitlines()]
    assert [r["line"] for r in ours] == list(range(1, len(want) + 1))
    for got, w in zip(ours, want):
        assert got["id"] == w["id"]
        assert len(got["questions"]) == len(w["questions"])
        for a, b in zip(got["questions"], w["questions"]):
            assert (a["id"], a["argmax"], a["option"]) == (b["id"], b["argmax"], b["option"])
            assert np.array_equal(f32(a["probs"]), f32(b["probs"])), (got["id"], a["probs"], b["probs"])


def test_ray_accounts_for_every_record(tmp_path, score_bin):
    """Invalid records, blank lines and a byte order mark, in two files: every record has its
    line, invalid ones the library's message (`score --skip-invalid`'s); the valid ones score
    as `score` scores them, within the batched-vs-one-by-one tolerance (other batches)."""
    good = RECORDS.read_text(encoding="utf-8").splitlines()
    lines = [
        good[0],
        "",
        '{"id": "bad1", "state": "s", "questions": []}',
        good[1],
        "   ",
        "{not json",
        good[2],
        '{"id": "bad2", "state": "s", "questions": [{"prompt": "q", "options": ["a <|kev_option|>"]}]}',
        good[3],
    ]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode("utf-8") + b"\n\xff\xfe\n" + good[4].encode())
    ours = ray_score(tmp_path, mixed, RECORDS, batches_per_block=2)

    proc = run_score(score_bin, "--records", str(mixed), "--skip-invalid")
    skipped = [l[len("skipping: "):] for l in proc.stderr.splitlines() if l.startswith("skipping: ")]
    scored = [json.loads(l) for l in proc.stdout.splitlines()]
    want_all = [json.loads(l) for l in run_score(score_bin, "--records", str(RECORDS)).stdout.splitlines()]

    mine = [r for r in ours if r["path"].endswith("mixed.jsonl")]
    rest = [r for r in ours if r["path"].endswith("records.jsonl")]
    assert len(mine) + len(rest) == len(ours)
    # Every line, in order, blank ones (2, 5) and the one not UTF-8 (10) as errors.
    assert [r["line"] for r in mine] == list(range(1, 12))
    errors = [r for r in mine if "error" in r]
    assert [r["error"] for r in errors] == skipped and len(skipped) == 6
    assert [r["error_type"] for r in errors] == ["RecordError"] * 6
    assert [r["id"] for r in errors] == [None, "bad1", None, None, "bad2", None]
    assert [r["line"] for r in rest] == list(range(1, len(want_all) + 1))
    for got, want in [(mine, scored), (rest, want_all)]:
        got = [r for r in got if "error" not in r]
        assert [r["id"] for r in got] == [w["id"] for w in want]
        for g, w in zip(got, want):
            for a, b in zip(g["questions"], w["questions"], strict=True):
                assert (a["id"], a["option"]) == (b["id"], b["option"])
                assert np.max(np.abs(f32(a["probs"]) - f32(b["probs"]))) <= TOL_FORMS_F32
