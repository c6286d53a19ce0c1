#!/usr/bin/env bash
# Kev (CUDA) vs transformers (with and without flash-linear-attention) on the H200 machine.
#
#   bench/run_h200.sh                    # all stages: gen peak kev peers report
#   bench/run_h200.sh gen kev            # some stages (the machine keeps bench/.cache while warm)
#
# Meant for the lent H200 machine (python3 with torch, transformers, peft, safetensors,
# tokenizers; no Rust). Nothing is built there:
#   * kev: a prebuilt CUDA binary of examples/bench, $KEV_BIN [target-cuda/release/examples/bench]
#     (build it here with `source scripts/cuda-env.sh; cargo build --release --features cuda
#     --example bench --target-dir <dir>`, copy it into target-cuda/release/examples/ of the
#     checkout, which is ignored by git, and `carry` it); skipped with a note if absent;
#   * transformers + flash-linear-attention: wheels in $WHEELS [.whl] (flash-linear-attention and
#     fla-core, pure Python; `carry` the folder), installed with --no-deps into /tmp/fla-site;
#     the peers then run twice, without fla (PYTHONPATH untouched: transformers' torch paths) and
#     with it. Without wheels only the first run happens.
# Checkpoints (random weights, the published shapes) are generated on the GPU into bench/.cache
# (ignored by git, never carried: 0.8B is 1.6 GB, 4B 8.5 GB) and kept while the machine is warm.
#
# Environment knobs (defaults in brackets):
#   DEVICE [cuda] (cpu: a dry run of this script anywhere)  SIZES ["0.8b 4b"]  WORKLOADS [one,batch8,long]  REPEATS [10]  WARMUP [3]  DTYPE [bf16]
#   KEV_FORMS [prefix,row,batch]  KEV_ARGS [] (more bench flags, e.g. "--no-cuda-graphs --label eager")  PEER_FORMS [all]  KEV_BIN  WHEELS  PEAK_TFLOPS [989: H200 bf16
#   dense, spec; ~790 measured]  RESULTS_DIR [$OUT if set, else bench/.cache]  PYTHON [python3]
# Time: each device command may run 10 minutes; if all of it does not fit, run the stages (or
# one size) in separate commands. Results: RESULTS_DIR/results-h200.jsonl (appended) and
# RESULTS_DIR/report-h200.md.
set -uo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
SIZES=${SIZES:-"0.8b 4b"}
WORKLOADS=${WORKLOADS:-one,batch8,long}
REPEATS=${REPEATS:-10}
WARMUP=${WARMUP:-3}
DTYPE=${DTYPE:-bf16}
KEV_FORMS=${KEV_FORMS:-prefix,row,batch}
read -r -a KEV_ARGS <<< "${KEV_ARGS:-}"
PEER_FORMS=${PEER_FORMS:-all}
KEV_BIN=${KEV_BIN:-target-cuda/release/examples/bench}
WHEELS=${WHEELS:-.whl}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
CACHE=bench/.cache
RESULTS_DIR=${RESULTS_DIR:-${OUT:-$CACHE}}
RESULTS=$RESULTS_DIR/results-h200.jsonl
LOG=$RESULTS_DIR/log-h200.txt
mkdir -p "$CACHE" "$RESULTS_DIR"
stages=${*:-gen peak kev peers report}
has() { case " $stages " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
say() { echo "== $*" | tee -a "$LOG" >&2; }
record_args=()
for w in ${WORKLOADS//,/ }; do record_args+=(--records "$CACHE/records/$w.jsonl"); done

say "stages: $stages; sizes: $SIZES; workloads: $WORKLOADS; $REPEATS repeats after $WARMUP"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG" >&2

if has gen; then
  [ -f "$CACHE/records/one.jsonl" ] || "$PYTHON" bench/records.py --out "$CACHE/records" 2>&1 | tee -a "$LOG" >&2
  for s in $SIZES; do
    if [ ! -f "$CACHE/kev-$s/kev.json" ]; then
      say "generating kev-$s"
      ( time "$PYTHON" bench/make_checkpoint.py --size "$s" --out "$CACHE/kev-$s" --device "$DEVICE" ) 2>&1 | tee -a "$LOG" >&2
    fi
  done
  df -h "$CACHE" | tail -1 >&2
fi

if has peak; then
  say "bf16 matmul peak"
  "$PYTHON" bench/peak.py --device "$DEVICE" --dtype "$DTYPE" >> "$RESULTS" 2> >(tee -a "$LOG" >&2)
fi

if has kev; then
  if [ -x "$KEV_BIN" ]; then
    for s in $SIZES; do
      say "kev $s ($KEV_FORMS)"
      "$KEV_BIN" --checkpoint "$CACHE/kev-$s" "${record_args[@]}" --backend "$DEVICE" --dtype "$DTYPE" \
        --form "$KEV_FORMS" --repeats "$REPEATS" --warmup "$WARMUP" "${KEV_ARGS[@]}" >> "$RESULTS" 2> >(tee -a "$LOG" >&2) \
        || say "kev $s FAILED (exit $?)"
    done
  else
    say "no kev binary at $KEV_BIN: kev skipped"
  fi
fi

if has peers; then
  fla_site=""
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    fla_site=/tmp/fla-site
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$fla_site" "$WHEELS"/*.whl 2>&1 | tee -a "$LOG" >&2 || fla_site=""
  fi
  for s in $SIZES; do
    say "transformers $s, no fla ($PEER_FORMS)"
    "$PYTHON" bench/peers.py --checkpoint "$CACHE/kev-$s" "${record_args[@]}" --device "$DEVICE" \
      --dtype "$DTYPE" --form "$PEER_FORMS" --repeats "$REPEATS" --warmup "$WARMUP" \
      >> "$RESULTS" 2> >(grep -v 'falling back to its reference' | tee -a "$LOG" >&2) \
      || say "transformers $s FAILED (exit $?)"
    if [ -n "$fla_site" ]; then
      say "transformers $s, with fla ($PEER_FORMS)"
      PYTHONPATH="$fla_site${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" bench/peers.py --checkpoint "$CACHE/kev-$s" \
        "${record_args[@]}" --device "$DEVICE" --dtype "$DTYPE" --form "$PEER_FORMS" --repeats "$REPEATS" \
        --warmup "$WARMUP" >> "$RESULTS" 2> >(tee -a "$LOG" >&2) || say "transformers+fla $s FAILED (exit $?)"
    fi
  done
fi

if has report && [ -s "$RESULTS" ]; then
  "$PYTHON" bench/report.py "$RESULTS" --peak-tflops "$PEAK_TFLOPS" | tee "$RESULTS_DIR/report-h200.md"
fi
