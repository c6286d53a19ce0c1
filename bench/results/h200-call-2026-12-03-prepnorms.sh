#!/usr/bin/env bash
# Device call (2026-12-03, late session): the parity suite on the build whose preparation kernels
# take the norms' factors, g and β a lane per step in chunk_decays and inline their body once
# (bench-new), then it against main's build (bench-main, d67525b kernels) alternating twice at
# 0.8B (one, 8, 64, 256 records) and once at 4B (one, 64 records); the matmul peak, burst and
# sustained for 5 s, with the clocks sampled; ncu's kernel times of bench-new's 64-record batch.
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
C=bench/.cache; R=$C/records; mkdir -p $R
for f in .gpu/*.xz; do xz -dkf "$f"; done; chmod +x .gpu/* 2>/dev/null
[ -f $R/batch256.jsonl ] || {
  python3 bench/records.py --out $R >/dev/null
  for b in 64 256; do python3 bench/records.py --out $R/b$b --batch $b >/dev/null; cp $R/b$b/batch$b.jsonl $R/; done
}
[ -f $C/kev-0.8b/kev.json ] || python3 bench/make_checkpoint.py --size 0.8b --out $C/kev-0.8b --device cuda >/dev/null
[ -f $C/kev-4b/kev.json ] || python3 bench/make_checkpoint.py --size 4b --out $C/kev-4b --device cuda >/dev/null
KEV_TEST_BACKEND=cuda .gpu/parity --test-threads 1 --nocapture > $OUT/parity.txt 2>&1
grep -E "^test result|FAILED|panicked|failed" $OUT/parity.txt
summ() { python3 -c 'import json,sys
for d in map(json.loads, sys.stdin):
    print(d.get("label",""), d["workload"], d["form"], "median", round(d["latency_ms_median"],2), "min", round(d["latency_ms_min"],2), "rec/s", round(d["records_per_s"],1), "TFLOP/s", round(d["tflop_per_s"],1))'; }
for round in 1 2; do
  for bin in bench-main bench-new; do
    .gpu/$bin --checkpoint $C/kev-0.8b --records $R/one.jsonl --records $R/batch8.jsonl --records $R/batch64.jsonl \
      --records $R/batch256.jsonl --form batch --repeats 5 --warmup 2 --label "$bin-r$round" --backend cuda --dtype bf16 \
      2>>$OUT/stderr-ab.txt | tee -a $OUT/ab.jsonl | summ
  done
done
for bin in bench-main bench-new; do
  .gpu/$bin --checkpoint $C/kev-4b --records $R/one.jsonl --records $R/batch64.jsonl \
    --form batch --repeats 3 --warmup 1 --label "$bin-4b" --backend cuda --dtype bf16 \
    2>>$OUT/stderr-ab.txt | tee -a $OUT/ab.jsonl | summ
done
Q=timestamp,clocks.sm,power.draw,utilization.gpu,clocks_event_reasons.active
nvidia-smi --query-gpu=$Q --format=csv,noheader -lms 50 > $OUT/clocks-peak.csv &
smi=$!
python3 bench/peak.py --device cuda --dtype bf16 --sustained 5 | tee -a $OUT/ab.jsonl
kill $smi
awk -F', ' '$4 != "0 %" {print $2}' $OUT/clocks-peak.csv | sort -n | awk '{a[NR]=$1} END {print "peak: sm MHz samples", NR, "min", a[1], "median", a[int(NR/2)+1], "max", a[NR]}'
ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum --log-file /tmp/b64.csv \
  .gpu/bench-new --checkpoint $C/kev-0.8b --records $R/batch64.jsonl --form batch --repeats 1 --warmup 0 --profile-timed \
  --backend cuda --dtype bf16 >/dev/null 2>/tmp/b64.err
python3 bench/ncu_summary.py /tmp/b64.csv > $OUT/ncu-batch64.md; head -14 $OUT/ncu-batch64.md
