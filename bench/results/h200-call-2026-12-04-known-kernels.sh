#!/usr/bin/env bash
# Device call (2026-12-04, fourth): the tuned projections as committed (bench-lt3, score-lt3:
# as in h200-call-2026-12-04-tuning.sh, and after the first class of a weight shape only the
# candidates whose kernels the process has run are timed) against 7a2690b (bench-main,
# score-main): the CUDA parity suite on bench-lt3's build, the bf16 matmul peak, 0.8B one
# record (both forms, three rounds), 8, 64 and 256 records (two rounds), 4B one and 8 records,
# `score` on 10,000 records with each build twice, alternating (and whether they wrote the same
# file), then a build of bench-lt3's code that prints each class's timing (score-trace, not
# committed) on the same file.
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
[ -f $C/score-10k.jsonl ] || python3 bench/stream_records.py --n 10000 --out $C/score-10k.jsonl >/dev/null
KEV_TEST_BACKEND=cuda .gpu/parity --test-threads 1 --nocapture > $OUT/parity.txt 2>&1
grep -E "^test result|FAILED|panicked|failed" $OUT/parity.txt
python3 bench/peak.py --sustained 5 | tee $OUT/peak.json
summ() { python3 -c 'import json,sys
for d in map(json.loads, sys.stdin):
    print(d.get("label",""), d["workload"], d["form"], "median", round(d["latency_ms_median"],2), "min", round(d["latency_ms_min"],2), "rec/s", round(d["records_per_s"],1), "TFLOP/s", round(d["tflop_per_s"],1), "first", round(d["first_run_ms"],1))'; }
for round in 1 2 3; do
  for bin in bench-main bench-lt3; do
    for form in prefix batch; do
      .gpu/$bin --checkpoint $C/kev-0.8b --records $R/one.jsonl --form $form --repeats 7 --warmup 2 --label "$bin-r$round" \
        --backend cuda --dtype bf16 2>>$OUT/stderr-ab.txt | tee -a $OUT/ab.jsonl | summ
    done
  done
done
for round in 1 2; do
  for bin in bench-main bench-lt3; do
    .gpu/$bin --checkpoint $C/kev-0.8b --records $R/batch8.jsonl --records $R/batch64.jsonl --records $R/batch256.jsonl \
      --form batch --repeats 5 --warmup 2 --label "$bin-r$round" --backend cuda --dtype bf16 \
      2>>$OUT/stderr-ab.txt | tee -a $OUT/ab.jsonl | summ
  done
done
for bin in bench-main bench-lt3; do
  .gpu/$bin --checkpoint $C/kev-4b --records $R/one.jsonl --records $R/batch8.jsonl \
    --form batch --repeats 5 --warmup 2 --label "$bin-4b" --backend cuda --dtype bf16 \
    2>>$OUT/stderr-ab.txt | tee -a $OUT/ab.jsonl | summ
done
for round in 1 2; do
  for bin in score-main score-lt3; do
    echo "$bin round $round:"
    .gpu/$bin --checkpoint $C/kev-0.8b --records $C/score-10k.jsonl --out /tmp/score-$bin.jsonl --backend cuda --dtype bf16 \
      2>&1 | tail -2 | head -1 | tee -a $OUT/score.txt
  done
done
cmp /tmp/score-score-main.jsonl /tmp/score-score-lt3.jsonl && echo "score outputs identical"
.gpu/score-trace --checkpoint $C/kev-0.8b --records $C/score-10k.jsonl --out /tmp/score-trace.jsonl --backend cuda --dtype bf16 \
  2>$OUT/score-trace.txt >/dev/null
grep records/s $OUT/score-trace.txt
grep -c "TRACE tune" $OUT/score-trace.txt
grep "TRACE tune" $OUT/score-trace.txt | sed 's/.*total=\([0-9.]*\)ms.*/\1/' | awk '{s+=$1} END {print "classes timed: total ms", s}'
