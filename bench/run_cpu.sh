#!/usr/bin/env bash
# Kev vs transformers on the CPU, one-request workload, 0.8B shapes (issue 5).
#
#   bench/run_cpu.sh                 # generate (once), build, run both, print a markdown table
#
# Environment knobs (defaults in brackets):
#   PYTHON [/work/pyenv/bin/python if present, else python3]  torch + transformers + peft
#   SIZE [0.8b]  THREADS [2]  REPEATS [2]  WARMUP [1]  WORKLOADS [one]  (one, batch8, long)
#   KEV_FORMS [prefix,row]  PEER_FORMS [both]  JOBS [1] (cargo -j)  NICE [nice]
# Everything generated goes to bench/.cache/ (ignored by git): kev-$SIZE/, records/,
# results-cpu-$SIZE.jsonl, report-cpu-$SIZE.md. The checkpoint and records are made once;
# delete them to regenerate. The CPU is slow: at 0.8B transformers' row form takes about half a
# minute per request on 2 cores, so keep REPEATS small.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$([ -x /work/pyenv/bin/python ] && echo /work/pyenv/bin/python || echo python3)}
SIZE=${SIZE:-0.8b}
THREADS=${THREADS:-2}
REPEATS=${REPEATS:-2}
WARMUP=${WARMUP:-1}
WORKLOADS=${WORKLOADS:-one}
KEV_FORMS=${KEV_FORMS:-prefix,row}
PEER_FORMS=${PEER_FORMS:-both}
JOBS=${JOBS:-1}
NICE=${NICE:-nice}
CACHE=bench/.cache
CKPT=$CACHE/kev-$SIZE
RECORDS=$CACHE/records
RESULTS=$CACHE/results-cpu-$SIZE.jsonl

[ -f "$CKPT/kev.json" ] || $NICE "$PYTHON" bench/make_checkpoint.py --size "$SIZE" --out "$CKPT"
[ -f "$RECORDS/one.jsonl" ] || "$PYTHON" bench/records.py --out "$RECORDS"
record_args=()
for w in ${WORKLOADS//,/ }; do record_args+=(--records "$RECORDS/$w.jsonl"); done

$NICE cargo build --release --example bench -j "$JOBS" >&2
: > "$RESULTS"
echo "== kev ($KEV_FORMS), $THREADS threads" >&2
RAYON_NUM_THREADS=$THREADS $NICE cargo run --release --example bench -j "$JOBS" -- \
  --checkpoint "$CKPT" "${record_args[@]}" --backend cpu --dtype f32 --form "$KEV_FORMS" \
  --repeats "$REPEATS" --warmup "$WARMUP" >> "$RESULTS"
echo "== transformers ($PEER_FORMS), $THREADS threads" >&2
OMP_NUM_THREADS=$THREADS $NICE "$PYTHON" bench/peers.py --checkpoint "$CKPT" "${record_args[@]}" \
  --device cpu --dtype f32 --form "$PEER_FORMS" --repeats "$REPEATS" --warmup "$WARMUP" \
  --threads "$THREADS" 2> >(grep -v 'falling back to its reference' >&2) >> "$RESULTS"
echo "== f32 matmul peak (PyTorch), $THREADS threads" >&2
"$PYTHON" bench/peak.py --device cpu --dtype f32 --threads "$THREADS" >> "$RESULTS"
"$PYTHON" bench/report.py "$RESULTS" | tee "$CACHE/report-cpu-$SIZE.md"
