#!/usr/bin/env bash
# Device call (2026-12-04, session 2, last): the CUDA parity suite on the final tree (0cbc18f: the
# graph tests' shared set-up).
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
for f in .gpu/*.xz; do xz -dkf "$f"; done; chmod +x .gpu/* 2>/dev/null
KEV_TEST_BACKEND=cuda .gpu/parity --test-threads 1 --nocapture > $OUT/parity.txt 2>&1
grep -E "^test result|FAILED|panicked" $OUT/parity.txt; grep -E "pairs; graphs|shapes, 4 rounds|^graphs:" $OUT/parity.txt
