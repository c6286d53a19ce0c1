"""Summarises an Nsight Compute CSV (`ncu --metrics gpu__time_duration.sum --csv`) into GPU time
per kernel name: where the GPU time of a run goes, and how many launches it takes.

    ncu --metrics gpu__time_duration.sum --csv --log-file ncu.csv <program>
    python3 bench/ncu_summary.py ncu.csv [--skip N]   # --skip: ignore the first N launches (loading)
"""
import argparse
import collections
import csv


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--skip", type=int, default=0)
    args = ap.parse_args()
    with open(args.csv) as f:
        lines = [l for l in f if l.startswith('"')]
    rows = list(csv.DictReader(lines))
    launches = {}
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        scale = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "s": 1e3, "second": 1e3}[r["Metric Unit"]]
        launches[int(r["ID"])] = (r["Kernel Name"].split("(")[0][:60], float(r["Metric Value"].replace(",", "")) * scale)
    ids = sorted(launches)[args.skip:]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for i in ids:
        name, ms = launches[i]
        by_name[name][0] += 1
        by_name[name][1] += ms
    total = sum(v[1] for v in by_name.values())
    print(f"{len(ids)} launches, {total:.2f} ms of GPU time")
    print("| kernel | launches | GPU ms | share |\n|---|---|---|---|")
    for name, (n, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"| `{name}` | {n} | {ms:.2f} | {100 * ms / total:.1f}% |")


if __name__ == "__main__":
    main()
