#!/usr/bin/env bash
# kev-serve on the H200: the load generator (bench/loadgen.rs) beside the library, in one process
# per size, bf16, random weights with the published shapes.
#
#   bench/run_h200_serve.sh            # 0.8B and 4B
#   SIZES=0.8b bench/run_h200_serve.sh
#
# Meant for the lent H200 machine (python3 with torch for the checkpoints; no Rust): the load
# generator is the CUDA build that scripts/gpu-build.sh packs into .gpu/. Checkpoints are
# generated into bench/.cache as bench/run_h200.sh does (kept while the machine is warm).
# Workload: 64 records of distinct ~200-word states, 4 questions of 4 options (one record a
# request); the shared-state workload: 2,000 requests over 50 such states, one question each.
# Results: RESULTS_DIR/serve-h200.jsonl (appended) and the tables on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
LOADGEN=${LOADGEN:-.gpu/loadgen}
SIZES=${SIZES:-"0.8b 4b"}
DURATION=${DURATION:-4}
TOKENS=${TOKENS:-16384}
# A 0.8B prefix of ~250 tokens holds ~20 MiB (the DeltaNet states are f32): 50 states need more
# than the server's default 1 GiB, and an LRU cycled over more states than it holds never hits.
PREFIX_MIB=${PREFIX_MIB:-8192}
CACHE=bench/.cache
RESULTS_DIR=${RESULTS_DIR:-${OUT:-$CACHE}}
mkdir -p "$CACHE" "$RESULTS_DIR"
[ -x "$LOADGEN" ] || { echo "no load generator at $LOADGEN (scripts/gpu-build.sh, then scripts/gpu-run.sh unpacks it)" >&2; exit 1; }
for s in $SIZES; do
  if [ ! -f "$CACHE/kev-$s/kev.json" ]; then
    echo "== generating kev-$s" >&2
    python3 bench/make_checkpoint.py --size "$s" --out "$CACHE/kev-$s" --device cuda >&2 || exit 1
  fi
  echo "== kev-serve $s (bf16, --max-batch-tokens $TOKENS, --prefix-cache-mib $PREFIX_MIB)" >&2
  "$LOADGEN" --checkpoint "$CACHE/kev-$s" --devices cuda:0 --dtype bf16 \
    --synthetic 64 --shared-words 200 --lib-batch 8 --concurrency 1,8,64 --rates 100,400 \
    --duration-s "$DURATION" --max-batch-tokens "$TOKENS" --max-wait-ms 0 --prefix-cache-mib "$PREFIX_MIB" \
    --shared-requests 2000 --shared-states 50 --shared-concurrency 16 \
    --label "h200 $s bf16" | tee -a "$RESULTS_DIR/serve-h200.jsonl"
done
