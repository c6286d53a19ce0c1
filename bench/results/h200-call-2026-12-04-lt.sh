#!/usr/bin/env bash
# Device call (2026-12-04): the projections through cuBLASLt with the algorithm timed per shape
# class (bench-lt) against main's build before it (bench-main, 7a2690b): the CUDA parity suite
# on bench-lt's build, the bf16 matmul peak (burst and 5 s sustained), the two builds
# alternating twice at 0.8B (one record in both forms, 8, 64, 256 records) and once at 4B (one,
# 8, 64 records); then ncu's kernel times of one 0.8B and one 4B request on bench-lt.
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
grep -E "^test result|FAILED|panicked|failed" $OUT/parity.txt; grep -E "^linear " $OUT/parity.txt | head -30
python3 bench/peak.py --sustained 5 | tee $OUT/peak.json
summ() { python3 -c 'import json,sys
for d in map(json.loads, sys.stdin):
    print(d.get("label",""), d["workload"], d["form"], "median", round(d["latency_ms_median"],2), "min", round(d["latency_ms_min"],2), "rec/s", round(d["records_per_s"],1), "TFLOP/s", round(d["tflop_per_s"],1))'; }
for round in 1 2; do
  for bin in bench-main bench-lt; do
    .gpu/$bin --checkpoint $C/kev-0.8b --records $R/one.jsonl --form prefix --repeats 5 --warmup 2 --label "$bin-r$round" \
      --backend cuda --dtype bf16 2>>$OUT/stderr-ab.txt | tee -a $OUT/ab.jsonl | summ
    .gpu/$bin --checkpoint $C/kev-0.8b --records $R/one.jsonl --records $R/batch8.jsonl --records $R/batch64.jsonl \
      --records $R/batch256.jsonl --form batch --repeats 5 --warmup 2 --label "$bin-r$round" --backend cuda --dtype bf16 \
      2>>$OUT/stderr-ab.txt | tee -a $OUT/ab.jsonl | summ
  done
done
for bin in bench-main bench-lt; do
  .gpu/$bin --checkpoint $C/kev-4b --records $R/one.jsonl --records $R/batch8.jsonl --records $R/batch64.jsonl \
    --form batch --repeats 3 --warmup 2 --label "$bin-4b" --backend cuda --dtype bf16 \
    2>>$OUT/stderr-ab.txt | tee -a $OUT/ab.jsonl | summ
done
for size in 0.8b 4b; do
  ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum --log-file /tmp/one-$size.csv \
    .gpu/bench-lt --checkpoint $C/kev-$size --records $R/one.jsonl --form batch --repeats 1 --warmup 2 --profile-timed \
    --backend cuda --dtype bf16 >/dev/null 2>/tmp/one-$size.err
  python3 bench/ncu_summary.py /tmp/one-$size.csv > $OUT/ncu-one-$size.md; head -16 $OUT/ncu-one-$size.md
done
