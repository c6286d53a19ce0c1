"""The machine's practical matmul peak, measured with PyTorch in the same run as the benchmark,
so that "% of peak" is against what this machine delivers today rather than a data sheet.

    python bench/peak.py --device cuda --dtype bf16      # H200: 8192³ bf16 products
    python bench/peak.py --device cpu --dtype f32 --threads 2

Prints one JSON line {"impl": "peak", "device", "dtype", "tflop_per_s", "n"}; bench/report.py
takes it as the peak for that device. `tflop_per_s` is the best single product after a pause
(the GPU at its boost clock). With --sustained S the line also carries `sustained_tflop_per_s`:
products back to back for S seconds, timed as one, which on a power-capped GPU (the H200 holds
700 W by lowering its clock) is the rate a long batch can have. With --bandwidth the line also
carries `bandwidth_gb_per_s`: the best of 20 copies of a 2 GiB buffer, bytes read plus written
per second, the rate a product bound by reading its weights can have.
"""

import argparse
import json
import time

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--bandwidth", action="store_true", help="also time device memory copies")
    ap.add_argument("--sustained", type=float, default=0.0,
                    help="also time products back to back for this many seconds")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    n = 8192 if args.device.startswith("cuda") else 2048
    a = torch.randn(n, n, device=args.device, dtype=dtype)
    b = torch.randn(n, n, device=args.device, dtype=dtype)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    reps = 20 if args.device.startswith("cuda") else 5
    for _ in range(3):
        a @ b
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - start)
    best = min(times)
    line = {"impl": "peak", "device": args.device, "dtype": args.dtype, "n": n,
            "tflop_per_s": 2 * n**3 / best / 1e12}
    if args.sustained > 0:
        # Warm until the clock settles (a second of products), then time a fixed count.
        count = max(1, int(args.sustained / best))
        for _ in range(max(1, int(1.0 / best))):
            a @ b
        sync()
        start = time.perf_counter()
        for _ in range(count):
            a @ b
        sync()
        line["sustained_tflop_per_s"] = 2 * n**3 * count / (time.perf_counter() - start) / 1e12
        line["sustained_s"] = args.sustained
    if args.bandwidth:
        del a, b
        src = torch.empty(1 << 30, device=args.device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        dst.copy_(src)
        sync()
        best = float("inf")
        for _ in range(20):
            start = time.perf_counter()
            dst.copy_(src)
            sync()
            best = min(best, time.perf_counter() - start)
        line["bandwidth_gb_per_s"] = 2 * src.numel() * src.element_size() / best / 1e9
    print(json.dumps(line))


if __name__ == "__main__":
    main()
