#!/usr/bin/env bash
# Device call (2026-12-03, late session): where one 0.8B request's GPU time goes on bae23e3
# (bench-new2: the preparation's body inlined once), ncu at the GPU's own clocks on the timed
# pass only, and ncu's full set on that request's preparation launch (instruction-fetch stalls).
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
C=bench/.cache; R=$C/records; mkdir -p $R
for f in .gpu/*.xz; do xz -dkf "$f"; done; chmod +x .gpu/* 2>/dev/null
[ -f $R/one.jsonl ] || python3 bench/records.py --out $R >/dev/null
[ -f $C/kev-0.8b/kev.json ] || python3 bench/make_checkpoint.py --size 0.8b --out $C/kev-0.8b --device cuda >/dev/null
B=".gpu/bench-new2 --checkpoint $C/kev-0.8b --records $R/one.jsonl --form batch --backend cuda --dtype bf16"
ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum --log-file /tmp/one.csv \
  $B --repeats 1 --warmup 0 --profile-timed >/dev/null 2>/tmp/one.err
python3 bench/ncu_summary.py /tmp/one.csv > $OUT/ncu-one.md; head -14 $OUT/ncu-one.md
timeout 200 ncu --set full --import-source no -k gdrc_prep2c_tc_bf16 -c 1 -o /tmp/prep $B --repeats 1 --warmup 0 >/dev/null 2>/tmp/prep.err
ncu -i /tmp/prep.ncu-rep --page details > $OUT/prep-one-details.txt 2>&1
ncu -i /tmp/prep.ncu-rep --page source --print-source sass --csv > $OUT/prep-one-sass.csv 2>&1
grep -E '^ +(Duration|Executed Ipc Active|Grid Size)' $OUT/prep-one-details.txt
