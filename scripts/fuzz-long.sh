#!/usr/bin/env bash
# The long form of the fuzz and concurrency tests (minutes instead of seconds):
#   scripts/fuzz-long.sh [SCALE] [SECONDS]
# SCALE (default 40) multiplies every fuzz property's case count (KEV_FUZZ_SCALE); SECONDS
# (default 180) is how long 8 threads share one model in the concurrency test, whose long form
# also checks that resident memory stays flat (KEV_CONCURRENCY_SECS). Extra cargo flags can be
# given in CARGO_FLAGS (e.g. "-j 2").
set -euo pipefail
cd "$(dirname "$0")/.."
scale="${1:-40}"
secs="${2:-180}"
flags=(--release ${CARGO_FLAGS:-})
start=$(date +%s)
KEV_FUZZ_SCALE="$scale" cargo test "${flags[@]}" -p kev-core --test fuzz
KEV_FUZZ_SCALE="$scale" cargo test "${flags[@]}" -p kev-candle --test fuzz_loader
KEV_CONCURRENCY_SECS="$secs" cargo test "${flags[@]}" --test concurrency -- --nocapture
echo "fuzz-long: scale $scale, concurrency ${secs}s, $(( $(date +%s) - start ))s in all"
