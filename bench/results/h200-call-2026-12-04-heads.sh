#!/usr/bin/env bash
# Device call (2026-12-04, session 2, second): CUDA graphs keyed without head positions (an input
# now) and kept by how often their shape comes (bench, this tree) against main 2957ff6
# (bench-main): the CUDA parity suite on the new build, then alternating twice: the prefix form
# (`probs`, one record after another) on one, 8, 64 and 256 records of one shape, the batch form on
# 64, and the prefix form on 256 records of varied shapes (the first 256 of the 10,000 `score`
# records), with each run's graph counts.
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
[ -f $C/score-10k.jsonl ] || python3 bench/stream_records.py --n 10000 --out $C/score-10k.jsonl >/dev/null
head -n 256 $C/score-10k.jsonl > $C/score-256.jsonl
KEV_TEST_BACKEND=cuda .gpu/parity --test-threads 1 --nocapture > $OUT/parity.txt 2>&1
grep -E "^test result|FAILED|panicked" $OUT/parity.txt; grep -E "pairs; graphs|shapes, 4 rounds|^graphs:" $OUT/parity.txt
summ() { python3 -c 'import json,sys
for d in map(json.loads, sys.stdin):
    print(d.get("label",""), d["workload"], d["form"], "median", round(d["latency_ms_median"],2), "min", round(d["latency_ms_min"],2), "rec/s", round(d["records_per_s"],1), "graphs", d.get("cuda_graphs"))'; }
run() { .gpu/$1 --checkpoint $C/kev-0.8b "${@:3}" --repeats 5 --warmup 2 --label "$1-$2" --backend cuda --dtype bf16 \
  2>>$OUT/stderr.txt | tee -a $OUT/ab.jsonl | summ; }
for round in 1 2; do
  for bin in bench-main bench; do
    run $bin r$round --records $R/one.jsonl --records $R/batch8.jsonl --records $R/batch64.jsonl --records $R/batch256.jsonl --form prefix
    run $bin r$round --records $R/batch64.jsonl --form batch
    run $bin r$round --records $C/score-256.jsonl --form prefix
  done
done
