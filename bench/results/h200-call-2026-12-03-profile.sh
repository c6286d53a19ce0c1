#!/usr/bin/env bash
# Device call (2026-12-03, evening session): the parity suite on main's CUDA build (with the long
# batch test), then where one request's and a 64-record batch's GPU time goes on the build with
# the new delta rule preparation (ncu at the GPU's own clocks: --clock-control none).
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
C=bench/.cache; R=$C/records; mkdir -p $R
for f in .gpu/*.xz; do xz -dkf "$f"; done; chmod +x .gpu/* 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
[ -f $R/batch64.jsonl ] || {
  python3 bench/records.py --out $R >/dev/null
  python3 bench/records.py --out $R/b64 --batch 64 >/dev/null; cp $R/b64/batch64.jsonl $R/
}
[ -f $C/kev-0.8b/kev.json ] || python3 bench/make_checkpoint.py --size 0.8b --out $C/kev-0.8b --device cuda >/dev/null
KEV_TEST_BACKEND=cuda .gpu/parity --test-threads 1 --nocapture > $OUT/parity.txt 2>&1
grep -E "^test result|FAILED|panicked|failed|batch of 48|late encoding" $OUT/parity.txt
for w in one batch64; do
  ncu --clock-control none --csv --metrics gpu__time_duration.sum --log-file $OUT/ncu-$w.csv .gpu/bench --checkpoint $C/kev-0.8b \
    --records $R/$w.jsonl --form batch --repeats 1 --warmup 0 --backend cuda --dtype bf16 >/dev/null 2>$OUT/ncu-$w.err
  echo "ncu $w rc $?"
done
