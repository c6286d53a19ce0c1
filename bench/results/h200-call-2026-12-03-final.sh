#!/usr/bin/env bash
# Device call (2026-12-03, night session): the parity suite on main's final build (bench-main:
# d67525b, rotary device tables synchronised and interleaved), it against the build measured
# before (bench-ropegpu: a94a5d5) once at 0.8B, then where the GPU time goes (ncu,
# gpu__time_duration at the GPU's own clocks, the one timed pass only: --profile-timed with
# --profile-from-start off) for one 0.8B request and the 4B model's 64-record batch.
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
for bin in bench-ropegpu bench-main; do
  .gpu/$bin --checkpoint $C/kev-0.8b --records $R/one.jsonl --records $R/batch8.jsonl --records $R/batch64.jsonl \
    --records $R/batch256.jsonl --form batch --repeats 5 --warmup 2 --label "$bin" --backend cuda --dtype bf16 \
    2>>$OUT/stderr-ab.txt | tee -a $OUT/ab.jsonl | summ
done
prof() {  # checkpoint, workload, name
  ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum --log-file /tmp/$3.csv \
    .gpu/bench-main --checkpoint $C/$1 --records $R/$2.jsonl --form batch --repeats 1 --warmup 0 --profile-timed \
    --backend cuda --dtype bf16 >/dev/null 2>/tmp/$3.err
  echo "$3 rc $?"; python3 bench/ncu_summary.py /tmp/$3.csv > $OUT/ncu-$3.md; head -24 $OUT/ncu-$3.md
}
prof kev-0.8b one one-0.8b
rm -rf $C/kev-0.8b
[ -f $C/kev-4b/kev.json ] || python3 bench/make_checkpoint.py --size 4b --out $C/kev-4b --device cuda >/dev/null
prof kev-4b batch64 batch64-4b
