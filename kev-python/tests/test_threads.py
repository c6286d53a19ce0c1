"""One model shared by Python threads: the GIL is released while it computes, so threads score
at once, and each gets what a single thread gets. Timing is printed, not asserted (speed is
for benchmarks: scripts/bench-python.py)."""

from __future__ import annotations

import threading
import time

import numpy as np

import kev
from conftest import FIXTURES, records


def test_two_threads_equal_one(capsys):
    model = kev.DecisionModel.load(FIXTURES / "kev-small", backend="cpu", dtype="f32")
    recs = records() * 4
    single = [model.probs(r) for r in recs]

    start = time.perf_counter()
    for r in recs:
        model.probs(r)
    serial = time.perf_counter() - start

    results: dict = {}
    errors: list = []

    def work(k: int) -> None:
        try:
            results[k] = [(i, model.probs(recs[i])) for i in range(k, len(recs), 2)]
        except Exception as e:  # reported below, so a failure is not lost in a thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    parallel = time.perf_counter() - start
    assert not errors, errors

    got = dict(pair for k in results for pair in results[k])
    assert sorted(got) == list(range(len(recs)))
    for i, want in enumerate(single):
        assert all(np.array_equal(a, b) for a, b in zip(got[i], want)), i
    with capsys.disabled():
        print(f"\n{len(recs)} records: serial {serial:.3f} s, 2 threads {parallel:.3f} s "
              f"(speed-up {serial / parallel:.2f}x)")


def test_threads_share_a_prefix():
    model = kev.DecisionModel.load(FIXTURES / "kev-small", backend="cpu", dtype="f32")
    r3 = records()[2]
    _, prefix = model.probs_and_prefix(r3)
    want = model.probs_with_prefix(r3, prefix)
    out: list = []
    threads = [threading.Thread(target=lambda: out.append(model.probs_with_prefix(r3, prefix))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 4
    assert all(np.array_equal(a, b) for got in out for a, b in zip(got, want))

def test_ctrl_c_interrupts_a_long_batch():
    """A SIGINT (here `_thread.interrupt_main`, what Ctrl-C does) during `probs_batch` raises
    KeyboardInterrupt at the next batch's start, not after the whole list: the list takes
    several batches of the CPU's token budget, and the interrupt comes a tenth of the way in."""
    import _thread

    import pytest

    model = kev.DecisionModel.load(FIXTURES / "kev-small", backend="cpu", dtype="f32")
    recs = records() * 40
    start = time.perf_counter()
    model.probs_batch(recs)
    whole = time.perf_counter() - start

    timer = threading.Timer(whole / 10, _thread.interrupt_main)
    start = time.perf_counter()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        model.probs_batch(recs)
    interrupted = time.perf_counter() - start
    timer.join()
    assert interrupted < whole * 0.6, (interrupted, whole)
