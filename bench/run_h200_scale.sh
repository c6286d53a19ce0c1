#!/usr/bin/env bash
# Speed at scale on the H200 (issue 27's rows), from a copy of the repository holding .gpu/
# (scripts/gpu-build.sh: bench, parity; `cargo build --release --features cuda --example score`
# stripped into .gpu/score; optionally .gpu/bench-base, a build of the base commit) and .whl/
# (flash-linear-attention wheels, as for run_h200.sh):
#
#   bench/run_h200_scale.sh                       # every stage
#   bench/run_h200_scale.sh coldstart parity      # some stages (each device command: 10 minutes)
#
# Stages:
#   parity     the CUDA parity suite
#   coldstart  whole processes (load + one pass) with CUDA_CACHE_DISABLE=1 (the driver translates
#              PTX as on a fresh machine), then with the driver's cache filled; Kev and, where
#              .gpu/bench-base exists, the base build
#   scale      0.8B one, 8, 64 and 256 records (prefix and batch forms), the bf16 matmul peak,
#              then 4B one, 8 and 64 records
#   score      `score` on 10,000 records against the library's batch form on their first 256
#   load       the 4B load: Kev, the base build, transformers (the peer's load_s)
#   compiled   transformers + flash-linear-attention under torch.compile(mode="reduce-overhead")
#              on 8 records (COMPILE_TIMEOUT seconds [240], compiling included)
# Results: $OUT (or bench/.cache)/results-scale.jsonl; a summary on stdout.
set -u
cd "$(dirname "$0")/.."
stages=${*:-parity coldstart scale score load compiled}
has() { case " $stages " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
C=bench/.cache; R=$C/records; O=${OUT:-$C}; mkdir -p "$R" "$O"
RES=$O/results-scale.jsonl
for f in .gpu/*.xz; do xz -dkf "$f"; done; chmod +x .gpu/* 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ -f $R/batch256.jsonl ] || {
  python3 bench/records.py --out $R >/dev/null
  for b in 64 256; do python3 bench/records.py --out $R/b$b --batch $b >/dev/null; cp $R/b$b/batch$b.jsonl $R/; done
}
gen() { [ -f $C/kev-$1/kev.json ] || python3 bench/make_checkpoint.py --size $1 --out $C/kev-$1 --device cuda >/dev/null; }
summ() { python3 -c 'import json,sys
for d in map(json.loads, sys.stdin):
    print(d.get("label",""), d["workload"], d["form"], "median", round(d["latency_ms_median"],2), "min", round(d["latency_ms_min"],2), "rec/s", round(d["records_per_s"],1), "TFLOP/s", round(d["tflop_per_s"],1), "load", round(d["load_s"],2), "first_run_ms", d.get("first_run_ms"))'; }
kev() { "$@" --backend cuda --dtype bf16 2>>$O/stderr-scale.txt | tee -a $RES | summ; }
gen 0.8b
if has parity; then
  KEV_TEST_BACKEND=cuda .gpu/parity --test-threads 1 2>&1 | tee $O/parity.txt | grep -E "^test result|FAILED|panicked"
fi
if has coldstart; then
  runs="fresh:bench fresh:bench warm:bench warm:bench"
  [ -x .gpu/bench-base ] && runs="fresh:bench fresh:bench-base fresh:bench fresh:bench-base warm:bench warm:bench-base warm:bench warm:bench-base"
  for run in $runs; do
    mode=${run%%:*} bin=${run##*:} env=""; [ $mode = fresh ] && env="CUDA_CACHE_DISABLE=1"
    s=$(date +%s.%N)
    kev env $env .gpu/$bin --checkpoint $C/kev-0.8b --records $R/one.jsonl --form prefix --repeats 1 --warmup 0 --label "$mode-$bin"
    echo "$mode $bin: whole process $(python3 -c "print(round($(date +%s.%N) - $s, 2))") s"
  done
fi
if has scale; then
  kev .gpu/bench --checkpoint $C/kev-0.8b --records $R/one.jsonl --records $R/batch8.jsonl --records $R/batch64.jsonl \
    --records $R/batch256.jsonl --form prefix,batch --repeats 5 --warmup 2 --label scale
  python3 bench/peak.py --device cuda --dtype bf16 --sustained 5 2>/dev/null | tee -a $RES
  gen 4b
  kev .gpu/bench --checkpoint $C/kev-4b --records $R/one.jsonl --records $R/batch8.jsonl --records $R/batch64.jsonl \
    --form prefix,batch --repeats 3 --warmup 2 --label scale
fi
if has score; then
  [ -f $C/score-10k.jsonl ] || python3 bench/stream_records.py --n 10000 --out $C/score-10k.jsonl >/dev/null
  head -n 256 $C/score-10k.jsonl > $C/score-256.jsonl
  .gpu/score --checkpoint $C/kev-0.8b --records $C/score-10k.jsonl --out /tmp/score-10k.jsonl --backend cuda --dtype bf16 2>&1 | tail -2
  kev .gpu/bench --checkpoint $C/kev-0.8b --records $C/score-256.jsonl --form batch --repeats 3 --warmup 1 --label library-256
fi
if has load; then
  gen 4b
  kev .gpu/bench --checkpoint $C/kev-4b --records $R/one.jsonl --form prefix --repeats 2 --warmup 1 --label load
  [ -x .gpu/bench-base ] && kev .gpu/bench-base --checkpoint $C/kev-4b --records $R/one.jsonl --form prefix --repeats 2 --warmup 1 --label load-base
  python3 bench/peers.py --checkpoint $C/kev-4b --records $R/one.jsonl --device cuda --dtype bf16 --form batch \
    --repeats 2 --warmup 1 --label load 2>>$O/stderr-scale.txt | tee -a $RES | summ
fi
if has compiled; then
  pip install -q --no-deps --target /tmp/fla-site .whl/*.whl >/dev/null 2>&1
  s=$(date +%s)
  PYTHONPATH=/tmp/fla-site timeout "${COMPILE_TIMEOUT:-240}" python3 bench/peers.py --checkpoint $C/kev-0.8b \
    --records $R/batch8.jsonl --device cuda --dtype bf16 --form batch --repeats 3 --warmup 3 --compile reduce-overhead \
    --label compiled 2>>$O/stderr-compiled.txt | tee -a $RES | summ
  echo "compiled peer: exit ${PIPESTATUS[0]} after $(( $(date +%s) - s )) s"
  grep -v "^\s*$" $O/stderr-compiled.txt | tail -3 | cut -c1-300
fi
