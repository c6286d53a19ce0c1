#!/usr/bin/env bash
# Device call (2026-12-03, late session): (1) the GPU's clocks, power and throttle reasons sampled every
# 50 ms while the 4B 64-record batch and the 0.8B 64-record batch run (bench-main = main's build,
# d67525b kernels) — does the 4B wall beyond its kernels come from clocks under sustained load?
# (2) ncu --set full with per-instruction counts on the preparation kernel of the 0.8B 64-record
# batch (after the elementwise diet), and on the preparation and scan of one 0.8B request.
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
C=bench/.cache; R=$C/records; mkdir -p $R
for f in .gpu/*.xz; do xz -dkf "$f"; done; chmod +x .gpu/* 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,enforced.power.limit --format=csv
[ -f $R/batch64.jsonl ] || {
  python3 bench/records.py --out $R >/dev/null
  python3 bench/records.py --out $R/b64 --batch 64 >/dev/null; cp $R/b64/batch64.jsonl $R/
}
[ -f $C/kev-0.8b/kev.json ] || python3 bench/make_checkpoint.py --size 0.8b --out $C/kev-0.8b --device cuda >/dev/null
[ -f $C/kev-4b/kev.json ] || python3 bench/make_checkpoint.py --size 4b --out $C/kev-4b --device cuda >/dev/null
summ() { python3 -c 'import json,sys
for d in map(json.loads, sys.stdin):
    print(d.get("label",""), d["workload"], d["form"], "median", round(d["latency_ms_median"],2), "min", round(d["latency_ms_min"],2), "rec/s", round(d["records_per_s"],1), "TFLOP/s", round(d["tflop_per_s"],1))'; }
Q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_event_reasons.active
nvidia-smi --query-gpu=$Q --format=csv,noheader || Q=${Q/clocks_event_reasons/clocks_throttle_reasons}
for size in 4b 0.8b; do
  nvidia-smi --query-gpu=$Q \
    --format=csv,noheader -lms 50 > $OUT/clocks-$size.csv &
  smi=$!
  sleep 1
  .gpu/bench-main --checkpoint $C/kev-$size --records $R/batch64.jsonl --form batch --repeats 10 --warmup 2 \
    --label "clocks-$size" --backend cuda --dtype bf16 2>>$OUT/stderr.txt | tee -a $OUT/clocks.jsonl | summ
  sleep 1
  kill $smi
  python3 - $OUT/clocks-$size.csv <<'PY'
import sys, collections
rows = [l.split(", ") for l in open(sys.argv[1]) if l.strip()]
busy = [r for r in rows if r[5].strip() not in ("0 %",)]
sm = [int(r[1].split()[0]) for r in busy]; pw = [float(r[3].split()[0]) for r in busy]
print(sys.argv[1], "samples", len(rows), "busy", len(busy), "sm MHz min/median/max", min(sm), sorted(sm)[len(sm)//2], max(sm),
      "power W median/max", sorted(pw)[len(pw)//2], max(pw), "reasons", collections.Counter(r[6].strip() for r in busy).most_common(4))
PY
done
B=".gpu/bench-main --checkpoint $C/kev-0.8b --form batch --backend cuda --dtype bf16 --repeats 1 --warmup 0"
full() {  # name, kernel, records
  timeout 200 ncu --set full --import-source no -k $2 -c 1 -o /tmp/$1 $B --records $R/$3.jsonl >/dev/null 2>$OUT/ncu-$1.err
  ncu -i /tmp/$1.ncu-rep --page details > $OUT/$1-details.txt 2>&1
  ncu -i /tmp/$1.ncu-rep --page source --print-source sass --csv > $OUT/$1-sass.csv 2>&1
  echo "$1: $(grep -E '^ +Duration' $OUT/$1-details.txt | head -1)"
}
full prep-b64 gdrc_prep2c_tc_bf16 batch64
full prep-one gdrc_prep2c_tc_bf16 one
full scan16-one gdrc_scan_tc16_bf16 one
ls -la $OUT
