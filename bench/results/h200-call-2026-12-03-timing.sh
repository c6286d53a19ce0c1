#!/usr/bin/env bash
# Device call (2026-12-03, evening session): the parity suite on the build with cached rotary
# tables (bench-rope's source), a scratch build of main with host timers around probs_batch
# (KEV_TIMING; not committed) on 8/64/256 records, then bench-rope against main's build
# (46feeab), alternating twice.
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
C=bench/.cache; R=$C/records; mkdir -p $R
for f in .gpu/*.xz; do xz -dkf "$f"; done; chmod +x .gpu/* 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
[ -f $R/batch256.jsonl ] || {
  python3 bench/records.py --out $R >/dev/null
  for b in 64 256; do python3 bench/records.py --out $R/b$b --batch $b >/dev/null; cp $R/b$b/batch$b.jsonl $R/; done
}
[ -f $C/kev-0.8b/kev.json ] || python3 bench/make_checkpoint.py --size 0.8b --out $C/kev-0.8b --device cuda >/dev/null
KEV_TEST_BACKEND=cuda .gpu/parity --test-threads 1 --nocapture > $OUT/parity.txt 2>&1
grep -E "^test result|FAILED|panicked|failed|batch of 48|late encoding" $OUT/parity.txt
for w in batch64 batch256; do
  KEV_TIMING=1 .gpu/bench-timing --checkpoint $C/kev-0.8b --records $R/$w.jsonl --form batch --repeats 3 --warmup 1 \
    --backend cuda --dtype bf16 > $OUT/timing-$w.jsonl 2> $OUT/timing-$w.err
  echo "$w: $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("median", round(d["latency_ms_median"],1), "min", round(d["latency_ms_min"],1))' $OUT/timing-$w.jsonl)"
  grep TIMING $OUT/timing-$w.err | tail -4
done
summ() { python3 -c 'import json,sys
for d in map(json.loads, sys.stdin):
    print(d.get("label",""), d["workload"], d["form"], "median", round(d["latency_ms_median"],2), "min", round(d["latency_ms_min"],2), "rec/s", round(d["records_per_s"],1), "TFLOP/s", round(d["tflop_per_s"],1))'; }
for round in 1 2; do
  for bin in bench-rope bench; do
    .gpu/$bin --checkpoint $C/kev-0.8b --records $R/one.jsonl --records $R/batch8.jsonl --records $R/batch64.jsonl \
      --records $R/batch256.jsonl --form batch --repeats 5 --warmup 2 --label "$bin-r$round" --backend cuda --dtype bf16 \
      2>>$OUT/stderr-ab.txt | tee -a $OUT/ab.jsonl | summ
  done
done
