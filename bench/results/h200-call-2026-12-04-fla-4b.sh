#!/usr/bin/env bash
# Device call (2026-12-04, session 2, fourth): the 4B 64-record row's flash-linear-attention peer,
# which the third call's 150 s limit cut off (its Triton kernels tuned for the new shapes), with
# Kev (f367376) on the same records before and after it.
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
C=bench/.cache; R=$C/records; mkdir -p $R
for f in .gpu/*.xz; do xz -dkf "$f"; done; chmod +x .gpu/* 2>/dev/null
[ -f $R/batch64.jsonl ] || {
  python3 bench/records.py --out $R >/dev/null
  python3 bench/records.py --out $R/b64 --batch 64 >/dev/null; cp $R/b64/batch64.jsonl $R/
}
[ -f $C/kev-4b/kev.json ] || python3 bench/make_checkpoint.py --size 4b --out $C/kev-4b --device cuda >/dev/null
summ() { python3 -c 'import json,sys
for d in map(json.loads, sys.stdin):
    print(d.get("label",""), d.get("impl",""), d.get("fla",""), d["workload"], d["form"], "median", round(d["latency_ms_median"],2), "min", round(d["latency_ms_min"],2), "rec/s", round(d["records_per_s"],1), "TFLOP/s", round(d["tflop_per_s"],1))'; }
kev() { .gpu/bench --checkpoint $C/kev-4b --records $R/batch64.jsonl --form batch --repeats 3 --warmup 2 --label "kev-$1" \
  --backend cuda --dtype bf16 2>>$OUT/stderr.txt | tee -a $OUT/fla-4b.jsonl | summ; }
kev r1
pip install -q --no-index --no-deps --no-compile --target /tmp/fla-site .whl/*.whl >/dev/null 2>&1
s=$(date +%s)
PYTHONPATH=/tmp/fla-site timeout 400 python3 bench/peers.py --checkpoint $C/kev-4b --records $R/batch64.jsonl --device cuda \
  --dtype bf16 --form batch --repeats 3 --warmup 1 --label transformers-fla 2>>$OUT/stderr.txt | tee -a $OUT/fla-4b.jsonl | summ
echo "fla peer: exit ${PIPESTATUS[0]} after $(( $(date +%s) - s )) s"
kev r2
