#!/usr/bin/env bash
# Device call (2026-12-03, late session): the parity suite on cdfa7f4 plus the fused conv's
# loads global again (its arguments built field by field) and its q/k tile stores from one
# swizzled column per pair of steps (bench-new2), then it against main's build (bench-main,
# d67525b kernels) alternating twice at 0.8B (one, 8, 64, 256 records) and once at 4B (one, 64
# records); ncu's kernel times of bench-new2's 64-record batch and its preparation kernel in full.
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
C=bench/.cache; R=$C/records; mkdir -p $R
for f in .gpu/*.xz; do xz -dkf "$f"; done; chmod +x .gpu/* 2>/dev/null
[ -f $R/batch256.jsonl ] || {
  python3 bench/records.py --out $R >/dev/null
  for b in 64 256; do python3 bench/records.py --out $R/b$b --batch $b >/dev/null; cp $R/b$b/batch$b.jsonl $R/; done
}
[ -f $C/kev-0.8b/kev.json ] || python3 bench/make_checkpoint.py --size 0.8b --out $C/kev-0.8b --device cuda >/dev/null
[ -f $C/kev-4b/kev.json ] || python3 bench/make_checkpoint.py --size 4b --out $C/kev-4b --device cuda >/dev/null
KEV_TEST_BACKEND=cuda .gpu/parity --test-threads 1 --nocapture > $OUT/parity.txt 2>&1
grep -E "^test result|FAILED|panicked|failed" $OUT/parity.txt
summ() { python3 -c 'import json,sys
for d in map(json.loads, sys.stdin):
    print(d.get("label",""), d["workload"], d["form"], "median", round(d["latency_ms_median"],2), "min", round(d["latency_ms_min"],2), "rec/s", round(d["records_per_s"],1), "TFLOP/s", round(d["tflop_per_s"],1))'; }
for round in 1 2; do
  for bin in bench-main bench-new2; do
    .gpu/$bin --checkpoint $C/kev-0.8b --records $R/one.jsonl --records $R/batch8.jsonl --records $R/batch64.jsonl \
      --records $R/batch256.jsonl --form batch --repeats 5 --warmup 2 --label "$bin-r$round" --backend cuda --dtype bf16 \
      2>>$OUT/stderr-ab.txt | tee -a $OUT/ab.jsonl | summ
  done
done
for bin in bench-main bench-new2; do
  .gpu/$bin --checkpoint $C/kev-4b --records $R/one.jsonl --records $R/batch64.jsonl \
    --form batch --repeats 3 --warmup 1 --label "$bin-4b" --backend cuda --dtype bf16 \
    2>>$OUT/stderr-ab.txt | tee -a $OUT/ab.jsonl | summ
done
ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum --log-file /tmp/b64.csv \
  .gpu/bench-new2 --checkpoint $C/kev-0.8b --records $R/batch64.jsonl --form batch --repeats 1 --warmup 0 --profile-timed \
  --backend cuda --dtype bf16 >/dev/null 2>/tmp/b64.err
python3 bench/ncu_summary.py /tmp/b64.csv > $OUT/ncu-batch64.md; head -14 $OUT/ncu-batch64.md
timeout 200 ncu --set full --import-source no -k gdrc_prep2c_tc_bf16 -c 1 -o /tmp/prep .gpu/bench-new2 --checkpoint $C/kev-0.8b \
  --records $R/batch64.jsonl --form batch --backend cuda --dtype bf16 --repeats 1 --warmup 0 >/dev/null 2>/tmp/prep.err
ncu -i /tmp/prep.ncu-rep --page details > $OUT/prep-b64-details.txt 2>&1
ncu -i /tmp/prep.ncu-rep --page source --print-source sass --csv > $OUT/prep-b64-sass.csv 2>&1
grep -E '^ +(Duration|Executed Ipc Active)' $OUT/prep-b64-details.txt
