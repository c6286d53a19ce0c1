#!/usr/bin/env bash
# Device call (2026-12-04, session 2, third): on f367376 (graphs keyed without head positions),
# the CUDA parity suite, then issue 27's 4B rows side by side with the peers: Kev 4B on one, 8
# and 64 records (prefix and batch forms), the bf16 matmul peak (burst and 5 s sustained),
# transformers and transformers + flash-linear-attention (batch form) on the same records, then
# Kev again.
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
KEV_TEST_BACKEND=cuda .gpu/parity --test-threads 1 --nocapture > $OUT/parity.txt 2>&1
grep -E "^test result|FAILED|panicked" $OUT/parity.txt; grep -E "pairs; graphs|shapes, 4 rounds" $OUT/parity.txt
summ() { python3 -c 'import json,sys
for d in map(json.loads, sys.stdin):
    if "workload" in d: print(d.get("label",""), d.get("impl",""), d.get("fla",""), d["workload"], d["form"], "median", round(d["latency_ms_median"],2), "min", round(d["latency_ms_min"],2), "rec/s", round(d["records_per_s"],1), "TFLOP/s", round(d["tflop_per_s"],1), "load", round(d.get("load_s",0),2))
    else: print(d)'; }
W="--records $R/one.jsonl --records $R/batch8.jsonl --records $R/batch64.jsonl"
kev() { .gpu/bench --checkpoint $C/kev-4b $W --form prefix,batch --repeats 3 --warmup 2 --label "kev-$1" \
  --backend cuda --dtype bf16 2>>$OUT/stderr.txt | tee -a $OUT/scale-4b.jsonl | summ; }
kev r1
python3 bench/peak.py --device cuda --dtype bf16 --sustained 5 2>/dev/null | tee -a $OUT/scale-4b.jsonl
pip install -q --no-index --no-deps --no-compile --target /tmp/fla-site .whl/*.whl >/dev/null 2>&1
timeout 150 python3 bench/peers.py --checkpoint $C/kev-4b $W --device cuda --dtype bf16 --form batch --repeats 3 \
  --warmup 1 --label transformers 2>>$OUT/stderr.txt | tee -a $OUT/scale-4b.jsonl | summ
PYTHONPATH=/tmp/fla-site timeout 150 python3 bench/peers.py --checkpoint $C/kev-4b $W --device cuda --dtype bf16 \
  --form batch --repeats 3 --warmup 1 --label transformers-fla 2>>$OUT/stderr.txt | tee -a $OUT/scale-4b.jsonl | summ
kev r2
