"""examples/ray_serve.py on a local Ray cluster of 2 CPUs: one replica, two routed by state and
two in turn, on the shared-state workload with a prefix cache of 1.6 states' worth per state in
all (split between the replicas: room for an uneven split of the states by hashing). Answers equal `score`'s; routing by state keeps one server's
hit rate, routing in turn loses it."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from conftest import RECORDS, ROOT, TOL_FORMS_F32, run_score

EXAMPLE = ROOT / "examples" / "ray_serve.py"


def test_serve_answers_as_score_and_routing_by_state_keeps_the_hit_rate(tmp_path, score_bin):
    answers = tmp_path / "records.jsonl"
    bad = '{"id": "bad", "state": "s", "questions": []}'
    answers.write_text(RECORDS.read_text(encoding="utf-8") + bad + "\n", encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "bench", "--num-cpus", "2", "--backend", "cpu",
         "--dtype", "f32", "--requests", "300", "--states", "20", "--clients", "8",
         "--port", "8391", "--answers", str(answers)],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = {(r["replicas"], r["routing"]): r for r in map(json.loads, proc.stdout.splitlines())}
    assert set(runs) == {(1, "state"), (2, "state"), (2, "round-robin")}, runs.keys()

    want = [json.loads(l) for l in run_score(score_bin, "--records", str(RECORDS)).stdout.splitlines()]
    for run in runs.values():
        *good, (code, body) = run["answers"]
        assert code == 422, body
        assert body["error"]["message"] == "record (`bad`): field `questions`: must not be empty", body
        for (code, got), w in zip(good, want):
            assert code == 200, got
            assert got["id"] == w["id"]
            for a, b in zip(got["questions"], w["questions"]):
                assert a["id"] == b["id"]
                diff = np.abs(np.float32(a["probs"]) - np.float32(b["probs"])).max()
                assert diff <= TOL_FORMS_F32, (got["id"], diff)

    one, state, turns = runs[1, "state"], runs[2, "state"], runs[2, "round-robin"]
    print(f"\nhit rates: one replica {one['hit_rate']}, two by state {state['hit_rate']} "
          f"({state['per_replica']} requests, {state['states_per_replica']} states), two in turn {turns['hit_rate']} ({turns['per_replica']})")
    assert min(state["per_replica"]) > 0, state
    assert state["hit_rate"] >= one["hit_rate"] - 0.05
    assert state["hit_rate"] >= turns["hit_rate"] + 0.15
