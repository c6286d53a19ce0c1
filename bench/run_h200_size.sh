#!/usr/bin/env bash
# One size, Kev and transformers (with and without fla) in one command, as BENCHMARKS.md's
# H200 table is measured (one device command per size, to stay within 10 minutes):
#
#   bench/run_h200_size.sh 0.8b      # on the GPU machine, from a copy holding .gpu/ and .whl/
#
# Kev runs the prefix and batch forms (and both once more without CUDA graphs); the peers their competitive forms only (all three for one
# request, batch for 8 records, prefix and batch for the long state). With .gpu/parity present
# (scripts/gpu-build.sh), the 0.8B command first runs the CUDA parity suite. Results go to
# $OUT (or bench/.cache): results-h200.jsonl, log-h200.txt, parity.txt. PEER_WORKLOADS ["one batch8
# long"] picks the peers' workloads (fewer to fit a command's 10 minutes).
set -uo pipefail
case "${1:-}" in 0.8b|4b) ;; *) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2 ;; esac
cd "$(dirname "$0")/.."
size=$1
out=${OUT:-bench/.cache}
mkdir -p "$out"
for f in .gpu/bench.xz .gpu/parity.xz; do [ -f "$f" ] && xz -dkf "$f"; done
chmod +x .gpu/bench .gpu/parity 2>/dev/null
if [ "$size" = 0.8b ] && [ -x .gpu/parity ]; then
  KEV_TEST_BACKEND=cuda timeout 150 .gpu/parity --test-threads 1 --nocapture > "$out/parity.txt" 2>&1
  grep -E "test result|panicked|FAILED" "$out/parity.txt" | tail -4
fi
export REPEATS=${REPEATS:-5} WARMUP=${WARMUP:-2} KEV_BIN=${KEV_BIN:-.gpu/bench} SIZES=$size KEV_FORMS=prefix,batch
quiet() { grep -vE "^\s*$" | grep -E "^==|FAILED|rror"; }
bench/run_h200.sh gen peak kev 2>&1 | quiet
# The same prefix forms, and the 8-record batch form, without CUDA graphs: the graphs' share of
# Kev's figure.
KEV_FORMS=prefix WORKLOADS=one,long KEV_ARGS="--no-cuda-graphs --label eager" bench/run_h200.sh kev 2>&1 | quiet
KEV_FORMS=batch WORKLOADS=batch8 KEV_ARGS="--no-cuda-graphs --label eager" bench/run_h200.sh kev 2>&1 | quiet
peers=${PEER_WORKLOADS:-one batch8 long}
case " $peers " in *" one "*) WORKLOADS=one PEER_FORMS=all bench/run_h200.sh peers 2>&1 | quiet ;; esac
case " $peers " in *" batch8 "*) WORKLOADS=batch8 PEER_FORMS=batch bench/run_h200.sh peers 2>&1 | quiet ;; esac
case " $peers " in *" long "*) WORKLOADS=long PEER_FORMS=prefix,batch bench/run_h200.sh peers 2>&1 | quiet ;; esac
