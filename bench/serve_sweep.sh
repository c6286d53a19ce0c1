#!/usr/bin/env bash
# kev-serve's batching settings on this machine: --max-batch-tokens and --max-wait-ms swept with
# the load generator (closed loop), one command. Usage: bench/serve_sweep.sh [extra loadgen flags]
set -euo pipefail
cd "$(dirname "$0")/.."
LOADGEN=${LOADGEN:-target/release/examples/loadgen}
for tokens in 512 2048 8192; do
  for wait in 0 5; do
    "$LOADGEN" --skip-library --shared-requests 0 --synthetic 32 --shared-words 100 \
      --concurrency 1,8 --duration-s "${DURATION:-3}" --max-batch-tokens "$tokens" --max-wait-ms "$wait" \
      --label "tokens=$tokens wait=$wait" "$@" | grep '^{'
  done
done
