"""Shared helpers: the repository's fixtures, the Rust `score` example as the library's own
output to compare with, and the Rust parity suite's tolerances (tests/parity/common.rs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
RECORDS = FIXTURES / "records.jsonl"
CHECKPOINTS = ["kev-small", "kev-rslora", "kev-tokens", "kev-moe", "kev-fp8", "kev-ratios"]

#: f32 probabilities vs the PyTorch reference (KEV.md parity target).
TOL_PROBS_F32 = 1e-5
#: f32 prefix form vs row form, batched vs one by one: other batch shapes, other summation orders.
TOL_FORMS_F32 = 1e-5


def score_binary() -> Path:
    """The built `score` example: $KEV_SCORE_BIN, else under $CARGO_TARGET_DIR (or target/)."""
    if os.environ.get("KEV_SCORE_BIN"):
        return Path(os.environ["KEV_SCORE_BIN"])
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return target / "release" / "examples" / "score"


@pytest.fixture(scope="session")
def score_bin() -> Path:
    path = score_binary()
    if not path.is_file():
        pytest.fail(
            f"the Rust `score` example is not built at {path}: run "
            "`cargo build --release --example score` (or set KEV_SCORE_BIN)"
        )
    return path


def run_score(
    score_bin: Path, *args: str, backend: str = "cpu", check: bool = True
) -> subprocess.CompletedProcess:
    """Runs `score` in f32 with `args` (on the CPU by default); its output goes to stdout."""
    proc = subprocess.run(
        [str(score_bin), "--backend", backend, "--dtype", "f32", *args],
        capture_output=True,
        text=True,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"score {args} failed:\n{proc.stderr}")
    return proc


def score_lines(score_bin: Path, *args: str) -> list:
    """`score`'s output records, parsed."""
    out = run_score(score_bin, *args).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def records() -> list:
    """The fixture records, as dicts."""
    return [json.loads(line) for line in RECORDS.read_text(encoding="utf-8").splitlines()]


def reference(checkpoint: str) -> dict:
    """The PyTorch reference: per lora_scale, per record, state ids, rows, logits and probs."""
    return json.loads((FIXTURES / checkpoint / "reference.json").read_text())


def copy_checkpoint(tmp: Path, name: str = "kev-small") -> Path:
    """A copy of a fixture checkpoint with its base beside it (as `kev.json` points to it)."""
    base = json.loads((FIXTURES / name / "kev.json").read_text())["base"]
    shutil.copytree(FIXTURES / name, tmp / name)
    shutil.copytree(FIXTURES / Path(base).name, tmp / Path(base).name)
    return tmp / name
