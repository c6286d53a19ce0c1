#!/usr/bin/env bash
# Device call (2026-12-03, night session): the parity suite on the build that gathers rotary rows
# from a table on the GPU (bench-ropegpu's source), then it against the previous commit's build
# (bench-diet), alternating twice at 0.8B and once at 4B.
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
C=bench/.cache; R=$C/records; mkdir -p $R
for f in .gpu/*.xz; do xz -dkf "$f"; done; chmod +x .gpu/* 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
[ -f $R/batch256.jsonl ] || {
  python3 bench/records.py --out $R >/dev/null
  for b in 64 256; do python3 bench/records.py --out $R/b$b --batch $b >/dev/null; cp $R/b$b/batch$b.jsonl $R/; done
}
[ -f $C/kev-0.8b/kev.json ] || python3 bench/make_checkpoint.py --size 0.8b --out $C/kev-0.8b --device cuda >/dev/null
KEV_TEST_BACKEND=cuda .gpu/parity --test-threads 1 --nocapture > $OUT/parity.txt 2>&1
grep -E "^test result|FAILED|panicked|failed" $OUT/parity.txt
summ() { python3 -c 'import json,sys
for d in map(json.loads, sys.stdin):
    print(d.get("label",""), d["workload"], d["form"], "median", round(d["latency_ms_median"],2), "min", round(d["latency_ms_min"],2), "rec/s", round(d["records_per_s"],1), "TFLOP/s", round(d["tflop_per_s"],1))'; }
for round in 1 2; do
  for bin in bench-diet bench-ropegpu; do
    .gpu/$bin --checkpoint $C/kev-0.8b --records $R/one.jsonl --records $R/batch8.jsonl --records $R/batch64.jsonl \
      --records $R/batch256.jsonl --form batch --repeats 5 --warmup 2 --label "$bin-r$round" --backend cuda --dtype bf16 \
      2>>$OUT/stderr-ab.txt | tee -a $OUT/ab.jsonl | summ
  done
done
rm -rf $C/kev-0.8b
[ -f $C/kev-4b/kev.json ] || python3 bench/make_checkpoint.py --size 4b --out $C/kev-4b --device cuda >/dev/null
for bin in bench-diet bench-ropegpu; do
  .gpu/$bin --checkpoint $C/kev-4b --records $R/one.jsonl --records $R/batch64.jsonl \
    --form batch --repeats 5 --warmup 2 --label "$bin-4b" --backend cuda --dtype bf16 \
    2>>$OUT/stderr-ab.txt | tee -a $OUT/ab-4b.jsonl | summ
done
