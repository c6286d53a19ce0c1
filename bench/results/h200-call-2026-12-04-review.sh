#!/usr/bin/env bash
# Device call (2026-12-04, session 2, fifth): the graphs after review (4361421): the CUDA parity
# suite, the concurrency test for 20 s (8 threads sharing one model, every call bit-identical to
# its serial result; graphs replayed and captured under threads), and the prefix form on 64
# records of one shape and on 256 varied records, with the graph counts.
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
C=bench/.cache; R=$C/records; mkdir -p $R
for f in .gpu/*.xz; do xz -dkf "$f"; done; chmod +x .gpu/* 2>/dev/null
[ -f $R/batch64.jsonl ] || {
  python3 bench/records.py --out $R >/dev/null
  python3 bench/records.py --out $R/b64 --batch 64 >/dev/null; cp $R/b64/batch64.jsonl $R/
}
[ -f $C/kev-0.8b/kev.json ] || python3 bench/make_checkpoint.py --size 0.8b --out $C/kev-0.8b --device cuda >/dev/null
[ -f $C/score-10k.jsonl ] || python3 bench/stream_records.py --n 10000 --out $C/score-10k.jsonl >/dev/null
head -n 256 $C/score-10k.jsonl > $C/score-256.jsonl
KEV_TEST_BACKEND=cuda .gpu/parity --test-threads 1 --nocapture > $OUT/parity.txt 2>&1
grep -E "^test result|FAILED|panicked" $OUT/parity.txt; grep -E "pairs; graphs|shapes, 4 rounds" $OUT/parity.txt
KEV_CONCURRENCY_SECS=20 .gpu/concurrency --nocapture > $OUT/concurrency.txt 2>&1
grep -E "^test result|FAILED|panicked|calls" $OUT/concurrency.txt | head -5
summ() { python3 -c 'import json,sys
for d in map(json.loads, sys.stdin):
    print(d.get("label",""), d["workload"], d["form"], "median", round(d["latency_ms_median"],2), "min", round(d["latency_ms_min"],2), "rec/s", round(d["records_per_s"],1), "graphs", d.get("cuda_graphs"))'; }
.gpu/bench --checkpoint $C/kev-0.8b --records $R/one.jsonl --records $R/batch64.jsonl --records $C/score-256.jsonl --form prefix \
  --repeats 5 --warmup 2 --label review --backend cuda --dtype bf16 2>>$OUT/stderr.txt | tee -a $OUT/review.jsonl | summ
