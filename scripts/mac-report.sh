#!/usr/bin/env bash
# The Apple Silicon report in one command, on a Mac (arm64 macOS) with the Rust toolchain and
# Python 3.11 or newer:
#
#   scripts/mac-report.sh                      # tests, parity, gen, bench, report
#   SIZES=0.8b scripts/mac-report.sh gen bench report   # some stages, one size
#
# Stages:
#   tests   the Metal kernels against the CPU: cargo test --release --features metal -p kev-kernels
#   parity  the parity suite on Metal: KEV_TEST_BACKEND=metal cargo test --release --features metal --test parity
#   gen     the random-weight checkpoints with the published 0.8B and 4B shapes (bench/make_checkpoint.py,
#           1.6 and 8.5 GB) and the workloads (bench/records.py) in bench/.cache, made once
#   bench   Kev (examples/bench, --backend metal) and mlx-lm's Qwen3.5 with the same pointer head and
#           encoding (bench/mlx_peer.py) on each checkpoint and workload, one after the other
#   report  the table (bench/report.py --summary, the form of BENCHMARKS.md) and the full report
#
# Python packages come from PyPI by name into a virtualenv, target/mac-venv: torch, safetensors and
# tokenizers (the generators), mlx and mlx-lm (the peer; mlx-lm pinned to the version the peer was
# written against). The 4B pair needs about 12 GB of free memory and 10 GB of disk.
#
# Knobs (defaults in brackets): SIZES ["0.8b 4b"]  WORKLOADS [one,batch8,long]  REPEATS [5]
# WARMUP [2]  DTYPE [bf16]  FORMS [prefix,row,batch]  PYTHON [python3]  RESULTS_DIR [bench/.cache/mac]
# Results: RESULTS_DIR/{kernels.txt,parity.txt,results.jsonl,report.md,summary.md}. Every stage
# runs even when an earlier one failed; the exit status is 1 if any failed.
set -uo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
cd "$(dirname "$0")/.." || exit 1

if [ "$(uname -s)" != Darwin ] || [ "$(uname -m)" != arm64 ]; then
  echo "mac-report.sh runs on Apple Silicon (arm64 macOS); this is $(uname -s) $(uname -m)" >&2
  exit 1
fi
command -v cargo >/dev/null || { echo "cargo is required (rustup toolchain)" >&2; exit 1; }

PYTHON=${PYTHON:-python3}
SIZES=${SIZES:-"0.8b 4b"}
WORKLOADS=${WORKLOADS:-one,batch8,long}
REPEATS=${REPEATS:-5}
WARMUP=${WARMUP:-2}
DTYPE=${DTYPE:-bf16}
FORMS=${FORMS:-prefix,row,batch}
MLX_LM_VERSION=0.32.2
CACHE=bench/.cache
RESULTS_DIR=${RESULTS_DIR:-$CACHE/mac}
RESULTS=$RESULTS_DIR/results.jsonl
TARGET=${CARGO_TARGET_DIR:-target}
stages=${*:-tests parity gen bench report}
mkdir -p "$CACHE" "$RESULTS_DIR"
has() { case " $stages " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
say() { echo "== $*" >&2; }
failed=()
fail() { say "FAILED: $*"; failed+=("$*"); }

say "$(sysctl -n machdep.cpu.brand_string 2>/dev/null), $(sw_vers -productVersion 2>/dev/null), \
$(( $(sysctl -n hw.memsize 2>/dev/null || echo 0) / 1073741824 )) GiB; stages: $stages"

if has gen || has bench; then
  venv=target/mac-venv
  if [ ! -x "$venv/bin/python" ]; then
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
      || { echo "Python 3.11 or newer is needed (mlx-lm $MLX_LM_VERSION); set PYTHON" >&2; exit 1; }
    "$PYTHON" -m venv "$venv" || exit 1
  fi
  "$venv/bin/python" -m pip install -q --disable-pip-version-check torch safetensors tokenizers numpy \
    mlx "mlx-lm==$MLX_LM_VERSION" || { echo "pip install into $venv failed" >&2; exit 1; }
  PY="$venv/bin/python"
fi

if has tests; then
  say "Metal kernels against the CPU (kev-kernels)"
  cargo test --release --features metal -p kev-kernels 2>&1 | tee "$RESULTS_DIR/kernels.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || fail "kev-kernels tests on Metal"
fi

if has parity; then
  say "parity suite on Metal"
  KEV_TEST_BACKEND=metal cargo test --release --features metal --test parity -- --test-threads 1 --nocapture \
    2>&1 | tee "$RESULTS_DIR/parity.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || fail "parity suite on Metal"
fi

if has gen; then
  [ -f "$CACHE/records/one.jsonl" ] || "$PY" bench/records.py --out "$CACHE/records" || fail "records"
  for s in $SIZES; do
    if [ ! -f "$CACHE/kev-$s/kev.json" ]; then
      say "generating kev-$s"
      "$PY" bench/make_checkpoint.py --size "$s" --out "$CACHE/kev-$s" --device cpu || fail "checkpoint $s"
    fi
  done
fi

if has bench; then
  record_args=()
  for w in ${WORKLOADS//,/ }; do record_args+=(--records "$CACHE/records/$w.jsonl"); done
  : > "$RESULTS"  # this run's figures only
  if cargo build --release --features metal --example bench; then
    for s in $SIZES; do
      say "kev $s ($FORMS)"
      "$TARGET/release/examples/bench" --checkpoint "$CACHE/kev-$s" "${record_args[@]}" --backend metal \
        --dtype "$DTYPE" --form "$FORMS" --repeats "$REPEATS" --warmup "$WARMUP" >> "$RESULTS" \
        || fail "kev bench $s"
      say "mlx-lm $s ($FORMS)"
      "$PY" bench/mlx_peer.py --checkpoint "$CACHE/kev-$s" "${record_args[@]}" --device gpu --dtype "$DTYPE" \
        --form "$FORMS" --repeats "$REPEATS" --warmup "$WARMUP" >> "$RESULTS" || fail "mlx-lm peer $s"
    done
  else
    fail "building examples/bench with --features metal"
  fi
fi

if has report; then
  if [ -s "$RESULTS" ]; then
    "${PY:-$PYTHON}" bench/report.py "$RESULTS" > "$RESULTS_DIR/report.md" || fail "report"
    say "the table (all forms: $RESULTS_DIR/report.md)"
    "${PY:-$PYTHON}" bench/report.py "$RESULTS" --summary | tee "$RESULTS_DIR/summary.md" || fail "summary"
  else
    fail "report: no results in $RESULTS"
  fi
  for f in kernels parity; do
    [ -f "$RESULTS_DIR/$f.txt" ] && { echo; echo "$f:"; grep -E "^test result:" "$RESULTS_DIR/$f.txt"; }
  done
fi

if [ ${#failed[@]} -gt 0 ]; then
  printf '== failed: %s\n' "${failed[@]}" >&2
  exit 1
fi
say "done; results in $RESULTS_DIR"
