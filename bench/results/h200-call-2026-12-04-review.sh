#!/usr/bin/env bash
# Device call (2026-12-04, last): the tuned projections after review (bench-lt4, score-lt4:
# every row count of a class checked against cuBLAS before it runs the class's choice) against
# 7a2690b (bench-main, score-main): the CUDA parity suite on bench-lt4's build, 0.8B one record
# (both forms) and 8 records alternating twice, then `score` on 10,000 records with each build
# twice, alternating, and whether they wrote the same file.
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
C=bench/.cache; R=$C/records; mkdir -p $R
for f in .gpu/*.xz; do xz -dkf "$f"; done; chmod +x .gpu/* 2>/dev/null
[ -f $R/batch8.jsonl ] || python3 bench/records.py --out $R >/dev/null
[ -f $C/kev-0.8b/kev.json ] || python3 bench/make_checkpoint.py --size 0.8b --out $C/kev-0.8b --device cuda >/dev/null
[ -f $C/score-10k.jsonl ] || python3 bench/stream_records.py --n 10000 --out $C/score-10k.jsonl >/dev/null
KEV_TEST_BACKEND=cuda .gpu/parity --test-threads 1 --nocapture > $OUT/parity.txt 2>&1
grep -E "^test result|FAILED|panicked|failed" $OUT/parity.txt; grep "^linear" $OUT/parity.txt | grep -v "0.00e0" | grep "cuBLAS"
summ() { python3 -c 'import json,sys
for d in map(json.loads, sys.stdin):
    print(d.get("label",""), d["workload"], d["form"], "median", round(d["latency_ms_median"],2), "min", round(d["latency_ms_min"],2), "rec/s", round(d["records_per_s"],1), "TFLOP/s", round(d["tflop_per_s"],1))'; }
for round in 1 2; do
  for bin in bench-main bench-lt4; do
    for form in prefix batch; do
      .gpu/$bin --checkpoint $C/kev-0.8b --records $R/one.jsonl --form $form --repeats 7 --warmup 2 --label "$bin-r$round" \
        --backend cuda --dtype bf16 2>>$OUT/stderr-ab.txt | tee -a $OUT/ab.jsonl | summ
    done
    .gpu/$bin --checkpoint $C/kev-0.8b --records $R/batch8.jsonl --form batch --repeats 5 --warmup 2 --label "$bin-r$round" \
      --backend cuda --dtype bf16 2>>$OUT/stderr-ab.txt | tee -a $OUT/ab.jsonl | summ
  done
done
for round in 1 2; do
  for bin in score-main score-lt4; do
    echo "$bin round $round:"
    .gpu/$bin --checkpoint $C/kev-0.8b --records $C/score-10k.jsonl --out /tmp/score-$bin.jsonl --backend cuda --dtype bf16 \
      2>&1 | tail -2 | head -1 | tee -a $OUT/score.txt
  done
done
cmp /tmp/score-score-main.jsonl /tmp/score-score-lt4.jsonl && echo "score outputs identical" | tee -a $OUT/score.txt
