#!/usr/bin/env bash
# Device calls (2026-12-04, the first two): bench/gemm_probe.cu on the 0.8B and 4B projection
# shapes. First call: 32 MiB workspace, every candidate (h200-gemm-probe-2026-12-04-{08b,4b}.jsonl);
# second call: two rounds each of no workspace and no split-K (the candidates kev_kernels::linear
# times, -ws0-r{1,2}) against 32 MiB with every candidate (-ws32-r{1,2}).
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
nvcc -O2 -std=c++20 -arch=sm_90 bench/gemm_probe.cu -lcublasLt -lcublas -o /tmp/gp
S08="8224,1024 1024,2048 5120,1024 7168,1024 1024,3584"
S4="12352,2560 2560,4096 10240,2560 18432,2560 2560,9216"
if [ "${1:-first}" = first ]; then
  args=""; for m in 704 512 192 5632 45056; do for s in $S08; do args="$args $m,$s"; done; done
  /tmp/gp $args > $OUT/probe-08b.jsonl
  args=""; for m in 704 45056; do for s in $S4; do args="$args $m,$s"; done; done
  /tmp/gp $args > $OUT/probe-4b.jsonl
else
  args=""; for m in 704 192 512 5632 11264; do for s in $S08; do args="$args $m,$s"; done; done
  for r in 1 2; do
    WS_MB=0 NO_SPLITK=1 /tmp/gp $args > $OUT/probe-ws0-r$r.jsonl
    WS_MB=32 /tmp/gp $args > $OUT/probe-ws32-r$r.jsonl
  done
fi
