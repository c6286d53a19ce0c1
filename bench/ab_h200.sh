#!/usr/bin/env bash
# Kev against Kev: two prebuilt CUDA bench binaries alternating in one command, so a change is
# measured against its base on the same machine and minute (the H200's run-to-run noise is
# ±5–15 %). On the GPU machine, from a copy holding both binaries (scripts/gpu-build.sh, and a
# copy of the base's .gpu/bench.xz kept aside):
#
#   bench/ab_h200.sh .gpu/bench-base .gpu/bench          # one request, 0.8B and 4B, two rounds
#   bench/ab_h200.sh .gpu/bench-base .gpu/bench-a .gpu/bench-b   # more than one change
#
# Environment knobs [defaults]: SIZES ["0.8b 4b"]  WORKLOADS ["one:prefix"] (records:form pairs,
# e.g. "one:prefix batch8:batch long:prefix")  ROUNDS [2]  REPEATS [5]  WARMUP [3]. Results:
# $OUT (or bench/.cache)/ab.jsonl, labelled with each binary's file name; a summary on stdout.
set -uo pipefail
case "${1:-}" in ""|-h|--help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2 ;; esac
[ $# -ge 2 ] || { echo "two binaries or more: the base, then the changes" >&2; exit 2; }
cd "$(dirname "$0")/.."
out=${OUT:-bench/.cache}
mkdir -p "$out"
for s in ${SIZES:-0.8b 4b}; do
  SIZES=$s bench/run_h200.sh gen > /dev/null 2>&1
  for round in $(seq "${ROUNDS:-2}"); do
    for bin in "$@"; do
      for w in ${WORKLOADS:-one:prefix}; do
        "$bin" --checkpoint "bench/.cache/kev-$s" --records "bench/.cache/records/${w%%:*}.jsonl" \
          --backend cuda --dtype bf16 --form "${w##*:}" --repeats "${REPEATS:-5}" \
          --warmup "${WARMUP:-3}" --label "$(basename "$bin")" >> "$out/ab.jsonl" 2>> "$out/ab.err" \
          || tail -3 "$out/ab.err"
      done
    done
  done
done
python3 - "$out/ab.jsonl" <<'PY'
import collections, json, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "latency_ms_median" in r:
        key = (r["checkpoint"].split("-")[-1], r["workload"], r["form"], r["label"])
        runs[key].append("%.2f (min %.2f)" % (r["latency_ms_median"], r["latency_ms_min"]))
for key in sorted(runs):
    print(*key, "  ".join(runs[key]))
PY
