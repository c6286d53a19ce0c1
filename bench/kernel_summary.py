"""Summarises kernel times into GPU time per kernel name: where the GPU time of a run goes, and how
many launches it takes. Reads Nsight Compute's CSV (`ncu --metrics gpu__time_duration.sum --csv`)
or a kernel trace (bench/kernel_trace.cpp: name, start_ns, end_ns, stream), which also gives the
range's span against the time some kernel ran (how long the GPU waited for the host).

    ncu --metrics gpu__time_duration.sum --csv --log-file ncu.csv <program>
    python3 bench/kernel_summary.py ncu.csv [--skip N]   # --skip: ignore the first N launches (loading)
    python3 bench/kernel_summary.py --trace trace.csv
"""
import argparse
import collections
import csv

UNITS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "s": 1e3, "second": 1e3}


def ncu_launches(path, skip):
    """(name, ms) per launch of ncu's CSV, in launch order, past the first `skip`."""
    with open(path) as f:
        rows = list(csv.DictReader(l for l in f if l.startswith('"')))
    launches = {}
    for r in rows:
        if r.get("Metric Name") == "gpu__time_duration.sum":
            ms = float(r["Metric Value"].replace(",", "")) * UNITS[r["Metric Unit"]]
            launches[int(r["ID"])] = (r["Kernel Name"], ms)
    return [launches[i] for i in sorted(launches)[skip:]]


def busy_ns(intervals):
    """The time some interval covers: their union's length."""
    busy, until = 0, None
    for start, end in sorted(intervals):
        if until is None or start > until:
            busy, until = busy + end - start, end
        elif end > until:
            busy, until = busy + end - until, end
    return busy


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--trace", action="store_true", help="the CSV is a kernel trace, not ncu's")
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    span = None
    if args.trace:
        with open(args.csv) as f:
            rows = [(r["name"], int(r["start_ns"]), int(r["end_ns"])) for r in csv.DictReader(f)][args.skip:]
        launches = [(name, (end - start) / 1e6) for name, start, end in rows]
        if rows:
            span = (max(r[2] for r in rows) - min(r[1] for r in rows), busy_ns((r[1], r[2]) for r in rows))
    else:
        launches = ncu_launches(args.csv, args.skip)
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for name, ms in launches:
        entry = by_name[name.split("(")[0][:60]]
        entry[0] += 1
        entry[1] += ms
    total = sum(v[1] for v in by_name.values())
    print(f"{len(launches)} launches, {total:.2f} ms of GPU time")
    if span and span[0]:
        print(f"span {span[0] / 1e6:.2f} ms, a kernel running {span[1] / 1e6:.2f} ms "
              f"({100 * span[1] / span[0]:.1f} %), idle {(span[0] - span[1]) / 1e6:.2f} ms")
    print("| kernel | launches | GPU ms | share |\n|---|---|---|---|")
    for name, (n, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"| `{name}` | {n} | {ms:.2f} | {100 * ms / max(total, 1e-12):.1f}% |")


if __name__ == "__main__":
    main()
