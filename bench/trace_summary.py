"""Summarises a kernel trace (bench/kernel_trace.cpp: name, start_ns, end_ns, stream) into GPU time
per kernel name, and the range's span against the time some kernel ran: where a pass's GPU time
goes, and how long the GPU waited for the host.

    python3 bench/trace_summary.py trace.csv [--top 25]
"""
import argparse
import collections
import csv


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    with open(args.csv) as f:
        rows = [(r["name"], int(r["start_ns"]), int(r["end_ns"])) for r in csv.DictReader(f)]
    if not rows:
        print("no kernels in the trace")
        return
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for name, start, end in rows:
        by_name[name.split("(")[0][:60]][0] += 1
        by_name[name.split("(")[0][:60]][1] += (end - start) / 1e6
    # The time some kernel ran: the union of the kernels' intervals.
    busy, until = 0, None
    for _, start, end in sorted(rows, key=lambda r: r[1]):
        if until is None or start > until:
            busy += end - start
            until = end
        elif end > until:
            busy += end - until
            until = end
    span = max(r[2] for r in rows) - min(r[1] for r in rows)
    total = sum(v[1] for v in by_name.values())
    print(f"{len(rows)} launches, {total:.2f} ms of kernel time; span {span / 1e6:.2f} ms, "
          f"a kernel running {busy / 1e6:.2f} ms ({100 * busy / span:.1f} %), idle {(span - busy) / 1e6:.2f} ms")
    print("| kernel | launches | GPU ms | share |\n|---|---|---|---|")
    for name, (n, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"| `{name}` | {n} | {ms:.2f} | {100 * ms / total:.1f}% |")


if __name__ == "__main__":
    main()
