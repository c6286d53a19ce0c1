#!/usr/bin/env bash
# Issue 23's streaming figures: peak RSS of `score` for 10k, 100k and 1M records (flat in the
# file's length), the validation pass against the scoring, records/s. Writes bench/.cache/stream-*.
#   bench/stream_measure.sh [SCORE_SECONDS]
# Full runs of the pipeline with the stub scorer (real validation, uniform distributions: see
# examples/stream_bench.rs) for every size; the real model for a full 10k run, and for 100k and
# 1M for the validation pass plus SCORE_SECONDS (default 300) of scoring, then stopped (the
# model scores ~20 records/s on 2 cores: 1M would take about 14 h).
set -euo pipefail
cd "$(dirname "$0")/.."
T=${CARGO_TARGET_DIR:-target}/release/examples
SECS=${1:-300}
C=bench/.cache
for n in 10000 100000 1000000; do
  [ -f $C/stream-$n.jsonl ] || python3 bench/stream_records.py --n $n --out $C/stream-$n.jsonl
done
for n in 10000 100000 1000000; do
  $T/stream_bench --stub --records $C/stream-$n.jsonl --out $C/stream-out-stub-$n.jsonl
done
/usr/bin/time -v $T/score --records $C/stream-10000.jsonl --out $C/stream-out-10000.jsonl 2>&1 \
  | grep -E "records:|Maximum resident|Elapsed"
for n in 100000 1000000; do
  rm -f $C/.stream-out-$n.jsonl.partial
  /usr/bin/time -v timeout -s INT $((SECS + n / 5000)) $T/score --records $C/stream-$n.jsonl \
    --out $C/stream-out-$n.jsonl 2>&1 | grep -E "records:|Maximum resident|Elapsed|status" || true
  echo "records $n: scored before the stop: $(wc -l < $C/.stream-out-$n.jsonl.partial)"
done
