"""Markdown tables from the JSON lines of examples/bench.rs, bench/peers.py and bench/mlx_peer.py.

    python bench/report.py results.jsonl [more.jsonl ...] [--peak-tflops 989] [--summary]

One table per checkpoint and device: a row per (workload, form), a column group per
implementation (kev; transformers, and transformers+fla where it ran), latency median (min),
records/s, tokens/s (encoded tokens), TFLOP/s (and % of --peak-tflops when given), peak memory
(GPU where measured, else RSS), then the ratio of each peer's median latency to kev's (> 1: kev is
faster) and the largest |Δp| between kev's and the peer's probabilities for the first record.
`--summary` prints instead one table of every checkpoint and workload with each side's fastest
form (ms median, records/s), the ratio of the peer's to Kev's, and max |Δp| (the BENCHMARKS.md form).
"""

import argparse
import json
import sys
from collections import OrderedDict


def impl_name(line):
    if line["impl"] in ("kev", "mlx-lm"):
        name = line["impl"]
    else:
        name = "transformers" + ("+fla" if line.get("fla") == "yes" else "")
    return name + (f" [{line['label']}]" if line.get("label") else "")


def max_dp(a, b):
    if not a or not b or len(a) != len(b):
        return None
    return max(abs(x - y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def device_kind(line):
    """cuda, metal or cpu, from either side's `device` (Kev: `Cuda { gpu_id: 0 }`, `Metal {..}`, `Cpu`)."""
    dev = line["device"].lower()
    return next((k for k in ("cuda", "metal") if dev.startswith(k)), "cpu")


def mem(line):
    # Tensors alone first (Kev: the CUDA pool's high-water mark; transformers:
    # max_memory_allocated), then the wider figure each side has.
    if "peak_gpu_alloc_mib" in line:
        wide = f" ({line['peak_gpu_mib'] / 1024:.2f} process)" if "peak_gpu_mib" in line else ""
        return f"{line['peak_gpu_alloc_mib'] / 1024:.2f} GiB alloc{wide}"
    if "peak_gpu_reserved_mib" in line:
        return (f"{line['peak_gpu_mib'] / 1024:.2f} GiB alloc "
                f"({line['peak_gpu_reserved_mib'] / 1024:.2f} reserved)")
    if "peak_gpu_mib" in line:
        return f"{line['peak_gpu_mib'] / 1024:.2f} GiB GPU"
    if line.get("peak_rss_mib") is None:  # Kev reads VmHWM, which macOS does not have
        return "–"
    return f"{line['peak_rss_mib'] / 1024:.2f} GiB RSS"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="the machine's peak for the dtype (H200 bf16 dense: 989), for %% of peak")
    ap.add_argument("--summary", action="store_true", help="one table, each side's fastest form")
    args = ap.parse_args()

    lines = []
    for f in args.files:
        for raw in open(f):
            raw = raw.strip()
            if raw.startswith("{"):
                lines.append(json.loads(raw))
    if not lines:
        sys.exit("no result lines")
    # Measured peaks (bench/peak.py) override --peak-tflops for their device.
    peaks = {device_kind(x): x["tflop_per_s"] for x in lines if x.get("impl") == "peak"}
    lines = [x for x in lines if x.get("impl") != "peak"]

    if args.summary:
        summary(lines)
        return
    groups = OrderedDict()
    for ln in lines:
        dev = device_kind(ln)
        key = (ln["checkpoint"], dev, ln["dtype"].lower().replace("float32", "f32").replace("bfloat16", "bf16"))
        groups.setdefault(key, []).append(ln)

    for (ckpt, dev, dtype), ls in groups.items():
        peak = peaks.get(dev, args.peak_tflops)
        impls = list(OrderedDict.fromkeys(impl_name(x) for x in ls))
        if "kev" in impls:
            impls = ["kev"] + [i for i in impls if i != "kev"]
        cells = OrderedDict()
        for x in ls:
            cells[(x["workload"], x["form"], impl_name(x))] = x
        rows = list(OrderedDict.fromkeys((w, f) for w, f, _ in cells))
        threads = sorted({x.get("threads") for x in ls if x.get("threads")})
        print(f"\n### {ckpt}, {dev}, {dtype}" + (f", threads {threads}" if dev == "cpu" else ""))
        loads = ", ".join(f"{i} {next(x['load_s'] for x in ls if impl_name(x) == i):.2f} s" for i in impls)
        print(f"\nload: {loads}" + (f"; matmul peak {peak:.3g} TFLOP/s" if peak else "") + "\n")
        head = ["workload", "form"]
        for i in impls:
            head += [f"{i} ms median (min)", f"{i} rec/s", f"{i} tok/s", f"{i} TFLOP/s", f"{i} peak mem"]
        peers = [i for i in impls if i != "kev"]
        if "kev" in impls:
            head += [f"{p} / kev latency" for p in peers] + [f"max |Δp| vs {p}" for p in peers]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for w, f in rows:
            out = [w, f]
            for i in impls:
                x = cells.get((w, f, i))
                if x is None:
                    out += ["–"] * 5
                    continue
                tf = f"{x['tflop_per_s']:.3f}"
                if peak:
                    tf += f" ({100 * x['tflop_per_s'] / peak:.1f}%)"
                out += [f"{x['latency_ms_median']:.1f} ({x['latency_ms_min']:.1f})", f"{x['records_per_s']:.3g}",
                        f"{x['tok_per_s']:.0f}", tf, mem(x)]
            if "kev" in impls:
                k = cells.get((w, f, "kev"))
                for p in peers:
                    x = cells.get((w, f, p))
                    out.append(f"{x['latency_ms_median'] / k['latency_ms_median']:.2f}×" if k and x else "–")
                for p in peers:
                    x = cells.get((w, f, p))
                    d = max_dp(k.get("first_probs"), x.get("first_probs")) if k and x else None
                    out.append(f"{d:.1e}" if d is not None else "–")
            print("| " + " | ".join(out) + " |")
        # Same-implementation cross-form ratios: what the prefix / batch forms buy over rows.
        print()
        for i in impls:
            for w in OrderedDict.fromkeys(w for w, _ in rows):
                r = cells.get((w, "row", i))
                for f in ("prefix", "batch"):
                    x = cells.get((w, f, i))
                    if r and x:
                        print(f"- {i}, {w}: {f} form {r['latency_ms_median'] / x['latency_ms_median']:.2f}× "
                              f"faster than row form")


def summary(lines):
    """| size | workload | per side: fastest form's median ms (min) and records/s | peer / kev | |Δp| |."""
    cells = OrderedDict()
    for x in lines:
        cells.setdefault((x["checkpoint"], x["workload"]), OrderedDict()).setdefault(impl_name(x), []).append(x)
    impls = list(OrderedDict.fromkeys(i for sides in cells.values() for i in sides))
    if "kev" in impls:
        impls = ["kev"] + [i for i in impls if i != "kev"]
    peers = [i for i in impls if i != "kev"] if "kev" in impls else []
    head = ["checkpoint", "workload"]
    for i in impls:
        head += [f"{i} ms median (min), form", f"{i} records/s"]
    head += [f"{p} / kev" for p in peers] + [f"max |Δp| vs {p}" for p in peers]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for (ckpt, workload), sides in cells.items():
        best = {i: min(xs, key=lambda x: x["latency_ms_median"]) for i, xs in sides.items()}
        out = [ckpt, workload]
        for i in impls:
            x = best.get(i)
            out += ([f"{x['latency_ms_median']:.2f} ({x['latency_ms_min']:.2f}), {x['form']}", f"{x['records_per_s']:.3g}"]
                    if x else ["–", "–"])
        k = best.get("kev")
        for p in peers:
            x = best.get(p)
            out.append(f"{x['latency_ms_median'] / k['latency_ms_median']:.2f}×" if k and x else "–")
        for p in peers:
            x = best.get(p)
            d = max_dp(k.get("first_probs"), x.get("first_probs")) if k and x else None
            out.append(f"{d:.1e}" if d is not None else "–")
        print("| " + " | ".join(out) + " |")


if __name__ == "__main__":
    main()
