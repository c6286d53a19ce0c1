#!/usr/bin/env bash
# Device call (2026-12-03, night session): the parity suite on the build whose elementwise
# kernels round to bf16 with one conversion and take e^{-x} without the subnormal fix-up
# (bench-diet's source); host marks through one 64-record batch (a scratch build of main with
# KEV_TIMING marks, not committed); where the 64-record batch's GPU time goes on bench-diet (ncu
# at the GPU's own clocks); then bench-diet against main's build (bench-rope), alternating twice.
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
KEV_TIMING=1 .gpu/bench-timing --checkpoint $C/kev-0.8b --records $R/batch64.jsonl --form batch --repeats 3 --warmup 1 \
  --backend cuda --dtype bf16 2>&1 >/dev/null | grep TMARK > $OUT/timing.txt
tail -n 16 $OUT/timing.txt
ncu --clock-control none --csv --metrics gpu__time_duration.sum --log-file /tmp/ncu-b64.csv .gpu/bench-diet --checkpoint $C/kev-0.8b \
  --records $R/batch64.jsonl --form batch --repeats 1 --warmup 0 --backend cuda --dtype bf16 >/dev/null 2>/tmp/ncu.err
python3 bench/ncu_summary.py /tmp/ncu-b64.csv > $OUT/ncu-batch64.md; head -16 $OUT/ncu-batch64.md
summ() { python3 -c 'import json,sys
for d in map(json.loads, sys.stdin):
    print(d.get("label",""), d["workload"], d["form"], "median", round(d["latency_ms_median"],2), "min", round(d["latency_ms_min"],2), "rec/s", round(d["records_per_s"],1), "TFLOP/s", round(d["tflop_per_s"],1))'; }
for round in 1 2; do
  for bin in bench-rope bench-diet; do
    .gpu/$bin --checkpoint $C/kev-0.8b --records $R/one.jsonl --records $R/batch8.jsonl --records $R/batch64.jsonl \
      --records $R/batch256.jsonl --form batch --repeats 5 --warmup 2 --label "$bin-r$round" --backend cuda --dtype bf16 \
      2>>$OUT/stderr-ab.txt | tee -a $OUT/ab.jsonl | summ
  done
done
