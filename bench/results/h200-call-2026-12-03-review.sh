#!/usr/bin/env bash
# Device call (2026-12-03, review): the parity suite on the build whose load_chunk branches once
# on its tile kind (bench-review), and one 0.8B pass of it beside bench-new2 (bae23e3).
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
C=bench/.cache; R=$C/records; mkdir -p $R
for f in .gpu/*.xz; do xz -dkf "$f"; done; chmod +x .gpu/* 2>/dev/null
[ -f $R/batch64.jsonl ] || {
  python3 bench/records.py --out $R >/dev/null
  python3 bench/records.py --out $R/b64 --batch 64 >/dev/null; cp $R/b64/batch64.jsonl $R/
}
[ -f $C/kev-0.8b/kev.json ] || python3 bench/make_checkpoint.py --size 0.8b --out $C/kev-0.8b --device cuda >/dev/null
KEV_TEST_BACKEND=cuda .gpu/parity --test-threads 1 --nocapture > $OUT/parity.txt 2>&1
grep -E "^test result|FAILED|panicked|failed" $OUT/parity.txt
for bin in bench-new2 bench-review; do
  .gpu/$bin --checkpoint $C/kev-0.8b --records $R/one.jsonl --records $R/batch64.jsonl --form batch --repeats 5 \
    --warmup 2 --label $bin --backend cuda --dtype bf16 2>/dev/null | tee -a $OUT/ab.jsonl | python3 -c 'import json,sys
for d in map(json.loads, sys.stdin): print(d["label"], d["workload"], round(d["latency_ms_median"],2))'
done
