#!/usr/bin/env bash
# Device call (2026-12-04, after the final read-through): the CUDA parity suite on the build
# whose tuned projections share the views of their inputs and no longer look up the cuBLASLt
# handle in `takes` (no change in what runs; bench-lt5), and a sanity run of one and 8 records.
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
for f in .gpu/*.xz; do xz -dkf "$f"; done; chmod +x .gpu/*
C=bench/.cache; R=$C/records; mkdir -p $R
python3 bench/records.py --out $R >/dev/null
python3 bench/make_checkpoint.py --size 0.8b --out $C/kev-0.8b --device cuda >/dev/null 2>&1
KEV_TEST_BACKEND=cuda .gpu/parity --test-threads 1 --nocapture > $OUT/parity.txt 2>&1
grep -E "^test result|FAILED|panicked|failed" $OUT/parity.txt
grep "^linear" $OUT/parity.txt | grep cuBLAS | grep -vc "max|Δ| 0.00e0"
.gpu/bench-lt5 --checkpoint $C/kev-0.8b --records $R/one.jsonl --records $R/batch8.jsonl --form batch --repeats 5 \
  --warmup 2 --backend cuda --dtype bf16 2>&1 | grep "median"
