#!/usr/bin/env bash
# Device call 2 (2026-12-03): 0.8B speed at scale, this build (bench) against the base 946c885 (bench-base), alternating twice, then cold start of both.
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}
C=bench/.cache; R=$C/records; mkdir -p $R
for f in .gpu/*.xz; do xz -dkf "$f"; done; chmod +x .gpu/* 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ -f $R/batch256.jsonl ] || {
  python3 bench/records.py --out $R >/dev/null
  for b in 64 256; do python3 bench/records.py --out $R/b$b --batch $b >/dev/null; cp $R/b$b/batch$b.jsonl $R/; done
}
[ -f $C/kev-0.8b/kev.json ] || python3 bench/make_checkpoint.py --size 0.8b --out $C/kev-0.8b --device cuda >/dev/null
summ() { python3 -c 'import json,sys
for d in map(json.loads, sys.stdin):
    print(d.get("label",""), d["workload"], d["form"], "median", round(d["latency_ms_median"],2), "min", round(d["latency_ms_min"],2), "rec/s", round(d["records_per_s"],1), "load", round(d["load_s"],2), "first_run_ms", round(d.get("first_run_ms") or 0, 1))'; }
for round in 1 2; do
  for bin in bench bench-base; do
    .gpu/$bin --checkpoint $C/kev-0.8b --records $R/one.jsonl --records $R/batch8.jsonl --records $R/batch64.jsonl \
      --records $R/batch256.jsonl --form batch --repeats 5 --warmup 2 --label "$bin-r$round" --backend cuda --dtype bf16 \
      2>>$OUT/stderr-ab.txt | tee -a $OUT/ab.jsonl | summ
    .gpu/$bin --checkpoint $C/kev-0.8b --records $R/one.jsonl --form prefix --repeats 20 --warmup 3 --label "$bin-r$round" \
      --backend cuda --dtype bf16 2>>$OUT/stderr-ab.txt | tee -a $OUT/ab.jsonl | summ
  done
done
python3 bench/peak.py --device cuda --dtype bf16 2>/dev/null | tee -a $OUT/ab.jsonl
for run in fresh:bench fresh:bench-base warm:bench warm:bench-base; do
  mode=${run%%:*} bin=${run##*:} env=""; [ $mode = fresh ] && env="CUDA_CACHE_DISABLE=1"
  s=$(date +%s.%N)
  env $env .gpu/$bin --checkpoint $C/kev-0.8b --records $R/one.jsonl --form prefix --repeats 1 --warmup 0 --label "$mode-$bin" \
    --backend cuda --dtype bf16 2>>$OUT/stderr-ab.txt | tee -a $OUT/coldstart.jsonl | summ
  echo "$mode $bin: whole process $(python3 -c "print(round($(date +%s.%N) - $s, 2))") s"
done
if command -v ncu >/dev/null; then
  ncu --csv --metrics gpu__time_duration.sum --log-file $OUT/ncu-batch256.csv .gpu/bench --checkpoint $C/kev-0.8b \
    --records $R/batch256.jsonl --form batch --repeats 1 --warmup 0 --backend cuda --dtype bf16 >/dev/null 2>$OUT/ncu-256.err
  echo "ncu batch256 rc $?"; python3 bench/ncu_summary.py $OUT/ncu-batch256.csv | head -30
fi
