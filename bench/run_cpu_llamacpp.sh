#!/usr/bin/env bash
# llama.cpp's CPU prefill next to Kev's, on the same random-weight checkpoint (issue 5's CPU peer).
#
#   bench/run_cpu_llamacpp.sh        # fetch and build llama.cpp and convert (once), then run both
#
# llama.cpp is the copy vendored in PyPI's llama-cpp-python source distribution (Debian 12 has no
# llama.cpp package and only PyPI, crates.io and Debian are reachable here): fetched with
# `pip download` (the sdist, no dependencies) and its sha256 checked, built with PyPI's cmake for
# this CPU (GGML_NATIVE), only the llama-bench and llama-quantize tools. The checkpoint's base model
# (random weights, LoRA not folded: prefill speed does not depend on it) is converted to GGUF with
# llama.cpp's converter (bench/llamacpp_convert.py) in each of TYPES (`--no-mtp`: the checkpoints
# have no multi-token-prediction block, and Kev does not use one); the types the converter does not
# write (q4_0, q4_k_m, ...) are made from the f32 file by llama-quantize, as CPU users make them.
# llama.cpp repacks Q4_0 and Q8_0 for its CPU GEMMs at load (its default). `llama-bench -p 512 -n 0` measures
# the prefill of 512 tokens. Kev then runs the state pass of the one-request workload (a 512-token
# state; bench example `--form state`) on the same checkpoint, in each of KEV_TYPES, in the same
# command. Where Kev runs an approximate dtype (int8), `score` then scores DRIFT_RECORDS in f32
# and in it, and bench/dtype_drift.py gives its max |Δp| and argmax flips against f32.
#
# With ISA=avx2 both sides run as on a CPU with AVX2 but no AVX-512 (Haswell to Zen 3): llama.cpp
# built without GGML_NATIVE for AVX2, FMA, F16C and BMI2 only (build-avx2/), Kev's int8 on its AVX2
# kernel (KEV_INT8_ISA=avx2); Kev's f32 and bf16 would still use AVX-512, so only int8 runs.
#
# Environment knobs (defaults in brackets):
#   ISA [native] (or avx2, above)
#   KEV_TYPES ["f32 bf16", and int8 on a CPU with AVX2; with ISA=avx2 "int8"] (Kev's dtypes; bf16 on a CPU with
#   AVX512-BF16 is bf16 weights with f32 activations, as llama.cpp's bf16)  KEV_REPS [5] (Kev's
#   repeats after one warm-up)  DRIFT_RECORDS [batch8 and 32 varied records, real tokenizer]
#   SIZE [0.8b]  THREADS [2]  REPS [3]  TYPES ["f32 bf16 f16 q8_0 q4_0 q4_k_m"]  PYTHON [/work/pyenv/bin/python if
#   present, else python3] (numpy, torch, safetensors, transformers for the converter)  JOBS [2]
# Everything goes to bench/.cache/ (ignored by git): llama.cpp/ (source and build), gguf/,
# results-cpu-llamacpp-$SIZE.jsonl (llama-bench's JSON lines, then Kev's).
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$([ -x /work/pyenv/bin/python ] && echo /work/pyenv/bin/python || echo python3)}
SIZE=${SIZE:-0.8b}
THREADS=${THREADS:-2}
REPS=${REPS:-3}
TYPES=${TYPES:-"f32 bf16 f16 q8_0 q4_0 q4_k_m"}
ISA=${ISA:-native}
case $ISA in
  native) KEV_TYPES=${KEV_TYPES:-"f32 bf16$(grep -qw avx2 /proc/cpuinfo && echo ' int8')"}; BUILD=build
          GGML_FLAGS=(-DGGML_NATIVE=ON) ;;
  avx2) KEV_TYPES=${KEV_TYPES:-int8}; BUILD=build-avx2; export KEV_INT8_ISA=avx2
        GGML_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                    -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF) ;;
  *) echo "ISA is native or avx2, not $ISA" >&2; exit 2 ;;
esac
KEV_REPS=${KEV_REPS:-5}
JOBS=${JOBS:-2}
VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
CACHE=bench/.cache
CKPT=$CACHE/kev-$SIZE
LLAMA=$CACHE/llama.cpp
SRC=$LLAMA/llama_cpp_python-$VERSION/vendor/llama.cpp
BENCH=$LLAMA/$BUILD/bin/llama-bench
QUANTIZE=$LLAMA/$BUILD/bin/llama-quantize
RESULTS=$CACHE/results-cpu-llamacpp-$SIZE$([ "$ISA" = native ] || echo "-$ISA").jsonl
mkdir -p "$LLAMA" "$CACHE/gguf"

[ -f "$CKPT/kev.json" ] || nice "$PYTHON" bench/make_checkpoint.py --size "$SIZE" --out "$CKPT"
[ -f "$CACHE/records/one.jsonl" ] || "$PYTHON" bench/records.py --out "$CACHE/records"
VARIED=$CACHE/records/varied-32.jsonl
[ -f "$VARIED" ] || "$PYTHON" bench/varied_records.py --n 32 --out "$VARIED"
DRIFT_RECORDS=${DRIFT_RECORDS:-"$CACHE/records/batch8.jsonl $VARIED"}

if [ ! -d "$SRC" ]; then
  echo "== fetching llama-cpp-python $VERSION (vendored llama.cpp) from PyPI" >&2
  rm -rf "$LLAMA/sdist" && mkdir -p "$LLAMA/sdist"
  "$PYTHON" -m pip download -q "llama-cpp-python==$VERSION" --no-deps --no-binary llama-cpp-python \
    -d "$LLAMA/sdist"
  sdist=$LLAMA/sdist/llama_cpp_python-$VERSION.tar.gz
  echo "$SHA256  $sdist" | sha256sum -c --quiet - || { echo "sha256 mismatch for $sdist" >&2; exit 1; }
  mv "$sdist" "$LLAMA/sdist.tar.gz"
  tar xzf "$LLAMA/sdist.tar.gz" -C "$LLAMA" "llama_cpp_python-$VERSION/vendor/llama.cpp"
fi
if [ ! -x "$BENCH" ] || [ ! -x "$QUANTIZE" ]; then
  # PyPI's cmake lands in the Python environment's scripts folder, which need not be on PATH.
  CMAKE=$(command -v cmake || { "$PYTHON" -m pip install -q cmake >&2 &&
    "$PYTHON" -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))'; })
  echo "== building llama-bench and llama-quantize (CPU, $ISA)" >&2
  "$CMAKE" -S "$SRC" -B "$LLAMA/$BUILD" -DCMAKE_BUILD_TYPE=Release "${GGML_FLAGS[@]}" -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >&2
  "$CMAKE" --build "$LLAMA/$BUILD" --target llama-bench llama-quantize -j "$JOBS" >&2
fi

: > "$RESULTS"
gguf_of() { echo "$CACHE/gguf/kev-$SIZE-$1.gguf"; }
convert() {
  echo "== converting to GGUF ($1)" >&2
  "$PYTHON" bench/llamacpp_convert.py "$SRC" "$CKPT/base" --no-mtp --outtype "$1" --outfile "$(gguf_of "$1")" 2>&1 \
    | grep -vE "^INFO|Writing:" >&2 || true
  [ -f "$(gguf_of "$1")" ] || { echo "converting to $1 failed" >&2; exit 1; }
}
for t in $TYPES; do
  gguf=$(gguf_of "$t")
  if [ ! -f "$gguf" ]; then
    case $t in
      f32|f16|bf16|q8_0) convert "$t" ;;
      *)
        [ -f "$(gguf_of f32)" ] || convert f32
        echo "== quantizing to $t" >&2
        "$QUANTIZE" "$(gguf_of f32)" "$gguf" "${t^^}" "$THREADS" > "$CACHE/gguf/quantize-$t.log" 2>&1 ||
          { tail -5 "$CACHE/gguf/quantize-$t.log" >&2; exit 1; }
        ;;
    esac
  fi
  echo "== llama-bench pp512 ($t), $THREADS threads" >&2
  "$BENCH" -m "$gguf" -p 512 -n 0 -t "$THREADS" -r "$REPS" -o jsonl >> "$RESULTS"
done

cargo build --release --example bench --example score -j "$JOBS" >&2
for t in $KEV_TYPES; do
  echo "== kev state pass (512 tokens), $t, $THREADS threads" >&2
  RAYON_NUM_THREADS=$THREADS target/release/examples/bench --checkpoint "$CKPT" \
    --records "$CACHE/records/one.jsonl" --backend cpu --dtype "$t" --form state \
    --repeats "$KEV_REPS" --warmup 1 >> "$RESULTS"
done

for t in $KEV_TYPES; do
  [ "$t" = int8 ] || continue
  for records in $DRIFT_RECORDS; do
    name=$(basename "$records" .jsonl)
    for d in f32 "$t"; do
      echo "== kev score $name ($d)" >&2
      RAYON_NUM_THREADS=$THREADS target/release/examples/score --checkpoint "$CKPT" --records "$records" \
        --backend cpu --dtype "$d" --out "$CACHE/score-$name-$d.jsonl" 2>/dev/null
    done
    "$PYTHON" bench/dtype_drift.py "$CACHE/score-$name-f32.jsonl" "$CACHE/score-$name-$t.jsonl" \
      --label "$t against f32, $name" >> "$RESULTS"
  done
done

"$PYTHON" - "$RESULTS" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
best = 0.0
for r in rows:
    if "avg_ts" in r:
        best = max(best, r["avg_ts"])
        print(f"llama.cpp {r.get('model_type', '')}: pp{r['n_prompt']} "
              f"{r['avg_ts']:.1f} ± {r['stddev_ts']:.1f} tok/s, {r['n_threads']} threads")
for r in rows:
    if r.get("impl") == "kev":
        kev = r["computed_tok_per_s"]
        print(f"kev {r['dtype']} state pass: {r['computed_tokens']} tokens, median {r['latency_ms_median']:.0f} ms,"
              f" {kev:.1f} tok/s" + (f" = {kev / best:.2f}x llama.cpp's best" if best else ""))
for r in rows:
    if "argmax_flips" in r:
        print(f"{r['label']}: max |dp| {r['max_abs_dp']:.2e}, mean per question {r['mean_question_max_abs_dp']:.2e},"
              f" argmax flips {r['argmax_flips']} of {r['questions']} questions")
PY
