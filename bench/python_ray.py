#!/usr/bin/env python3
"""Records/s of the `kev` Python package and of examples/ray_score.py against the library alone
(the Rust `score` example), on the same records and checkpoint, on the CPU in f32.

    target/py-venv/bin/python bench/python_ray.py [--copies 20] [--checkpoint DIR] [--score BIN]

With `--gpu` (a GPU machine with a CUDA build of the package): the library alone is the
package's `probs_batch` in this process (bf16 on CUDA), against Ray Data with one actor holding
the GPU (`--gpus-per-actor 1`), on `--records` repeated `--copies` times:

    python bench/python_ray.py --gpu --checkpoint bench/.cache/kev-0.8b --records FILE --copies 50

The records are tests/fixtures/records.jsonl repeated `--copies` times. Figures:
- `score`: its own records/s (scoring only, batches of `--batch-size`, default 8);
- Python, `probs_batch` on batches of that size, one thread; and `probs` one record a call, 1 thread
  vs 2 threads sharing one model (the GIL released while computing);
- Ray Data, 1 actor with 2 CPUs and 2 actors with 1 CPU each, on a local cluster of 2 CPUs:
  records/s with the cluster's and actors' start left out (the difference between a run on
  all the records and a run on one copy of them), and the whole run's records/s.
Each timing is the best of `--repeat` runs. Prints a Markdown table and the JSON figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "tests/fixtures/records.jsonl"


def write_records(path: Path, copies: int, source: Path = RECORDS) -> int:
    lines = [l for l in source.read_text(encoding="utf-8").splitlines() if l.strip()]
    out = []
    for k in range(copies):
        for line in lines:
            r = json.loads(line)
            r["id"] = f"{r.get('id')}-{k}"
            out.append(json.dumps(r))
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return len(out)


def score_rate(score: str, checkpoint: str, records: Path, batch: int) -> float:
    proc = subprocess.run(
        [score, "--checkpoint", checkpoint, "--records", str(records), "--out", os.devnull,
         "--backend", "cpu", "--dtype", "f32", "--batch-size", str(batch)],
        capture_output=True, text=True, check=True,
    )
    return float(re.search(r"([\d.]+) records/s", proc.stderr).group(1))


def python_rates(checkpoint: str, records: Path, repeat: int, batch: int) -> dict:
    import kev

    model = kev.DecisionModel.load(checkpoint, backend="cpu", dtype="f32")
    recs = records.read_text(encoding="utf-8").splitlines()
    model.probs_batch(recs[:batch])

    def best(fn) -> float:
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    def batches():
        for i in range(0, len(recs), batch):
            model.probs_batch(recs[i : i + batch])

    def serial():
        for r in recs:
            model.probs(r)

    def two_threads():
        threads = [threading.Thread(target=lambda k=k: [model.probs(r) for r in recs[k::2]]) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    n = len(recs)
    return {
        "python_probs_batch": n / best(batches),
        "python_probs_1_thread": n / best(serial),
        "python_probs_2_threads": n / best(two_threads),
    }


def ray_run(checkpoint: str, records: Path, actors: int, cpus_per_actor: float, batch: int,
            gpu: bool = False, batches_per_block: int = 0) -> float:
    device = (["--gpus-per-actor", "1", "--backend", "cuda", "--dtype", "bf16", "--num-cpus", "8"]
              if gpu else ["--backend", "cpu", "--dtype", "f32", "--num-cpus", "2"])
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(ROOT / "examples/ray_score.py"), "--checkpoint", checkpoint,
             "--records", str(records), "--out", str(Path(tmp) / "out.jsonl"),
             "--actors", str(actors), "--cpus-per-actor", str(cpus_per_actor), *device,
             "--batch-size", str(batch),
             "--batches-per-block", str(batches_per_block or max(1, 16 // batch))],
            capture_output=True, text=True,
        )
        if proc.returncode != 0:
            sys.exit(f"ray_score.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return time.perf_counter() - t


def gpu_main(args) -> None:
    """The package's probs_batch alone against Ray Data with one GPU actor, same records."""
    import kev

    source = Path(args.records)
    with tempfile.TemporaryDirectory() as tmp:
        big, small = Path(tmp) / "big.jsonl", Path(tmp) / "small.jsonl"
        n_big, n_small = write_records(big, args.copies, source), write_records(small, 1, source)
        b = args.batch_size
        model = kev.DecisionModel.load(args.checkpoint, backend="cuda", dtype="bf16")
        recs = big.read_text(encoding="utf-8").splitlines()
        model.probs_batch(recs[:b])

        def batches():
            for i in range(0, len(recs), b):
                model.probs_batch(recs[i : i + b])

        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            batches()
            times.append(time.perf_counter() - t)
        figures = {"records": n_big, "batch_size": b, "python_probs_batch": n_big / min(times)}
        del model
        run = lambda path: ray_run(args.checkpoint, path, 1, 1, b, gpu=True,
                                   batches_per_block=args.batches_per_block)
        t_big = min(run(big) for _ in range(args.repeat))
        t_small = min(run(small) for _ in range(args.repeat))
        figures["ray_1_gpu_actor"] = (n_big - n_small) / (t_big - t_small)
        figures["ray_1_gpu_actor_whole_run"] = n_big / t_big
    base = figures["python_probs_batch"]
    print("| what | records/s | vs the package alone |\n|---|---|---|")
    for key in ["python_probs_batch", "ray_1_gpu_actor", "ray_1_gpu_actor_whole_run"]:
        print(f"| {key} | {figures[key]:.2f} | {figures[key] / base:.2f}× |")
    print(json.dumps(figures))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--copies", type=int, default=20)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--checkpoint", default=str(ROOT / "tests/fixtures/kev-small"))
    p.add_argument("--score", default=str(Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release/examples/score"))
    p.add_argument("--batch-size", type=int, default=8, help="records per probs_batch call")
    p.add_argument("--no-ray", action="store_true")
    p.add_argument("--gpu", action="store_true", help="the GPU form (see above)")
    p.add_argument("--batches-per-block", type=int, default=0,
                   help="Ray Data blocks of this many batches (default: 16 records a block)")
    p.add_argument("--records", default=str(RECORDS), help="records repeated --copies times (--gpu)")
    args = p.parse_args()
    if args.gpu:
        return gpu_main(args)

    with tempfile.TemporaryDirectory() as tmp:
        big, small = Path(tmp) / "big.jsonl", Path(tmp) / "small.jsonl"
        n_big, n_small = write_records(big, args.copies), write_records(small, 1)
        b = args.batch_size
        figures = {"records": n_big, "batch_size": b, "load_avg_before": os.getloadavg()[0]}
        figures["score"] = max(score_rate(args.score, args.checkpoint, big, b) for _ in range(args.repeat))
        figures.update(python_rates(args.checkpoint, big, args.repeat, b))
        if not args.no_ray:
            for actors, cpus in [(1, 2), (2, 1)]:
                t_big = min(ray_run(args.checkpoint, big, actors, cpus, b) for _ in range(args.repeat))
                t_small = min(ray_run(args.checkpoint, small, actors, cpus, b) for _ in range(args.repeat))
                figures[f"ray_{actors}_actors"] = (n_big - n_small) / (t_big - t_small)
                figures[f"ray_{actors}_actors_whole_run"] = n_big / t_big
        figures["load_avg_after"] = os.getloadavg()[0]

    base = figures["score"]
    print(f"| what | records/s | vs `score` |\n|---|---|---|")
    for key in [k for k in figures if k.startswith(("score", "python", "ray"))]:
        print(f"| {key} | {figures[key]:.2f} | {figures[key] / base:.2f}× |")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
