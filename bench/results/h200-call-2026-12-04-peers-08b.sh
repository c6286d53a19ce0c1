#!/usr/bin/env bash
# Device call (2026-12-04, session 2, first): issue 27's rows side by side with the peers on main
# (2957ff6): the CUDA parity suite, Kev 0.8B on one, 8, 64 and 256 records (prefix and batch
# forms), the bf16 matmul peak (burst and 5 s sustained), transformers and transformers +
# flash-linear-attention (batch form, their fastest at these sizes) on the same records, then Kev
# again (the lease's drift across the call).
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
C=bench/.cache; R=$C/records; mkdir -p $R
for f in .gpu/*.xz; do xz -dkf "$f"; done; chmod +x .gpu/* 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ -f $R/batch256.jsonl ] || {
  python3 bench/records.py --out $R >/dev/null
  for b in 64 256; do python3 bench/records.py --out $R/b$b --batch $b >/dev/null; cp $R/b$b/batch$b.jsonl $R/; done
}
[ -f $C/kev-0.8b/kev.json ] || python3 bench/make_checkpoint.py --size 0.8b --out $C/kev-0.8b --device cuda >/dev/null
KEV_TEST_BACKEND=cuda .gpu/parity --test-threads 1 > $OUT/parity.txt 2>&1
grep -E "^test result|FAILED|panicked" $OUT/parity.txt
summ() { python3 -c 'import json,sys
for d in map(json.loads, sys.stdin):
    if "workload" in d: print(d.get("label",""), d.get("impl",""), d.get("fla",""), d["workload"], d["form"], "median", round(d["latency_ms_median"],2), "min", round(d["latency_ms_min"],2), "rec/s", round(d["records_per_s"],1), "TFLOP/s", round(d["tflop_per_s"],1), "maxdp", d.get("max_abs_dp"))
    else: print(d)'; }
W="--records $R/one.jsonl --records $R/batch8.jsonl --records $R/batch64.jsonl --records $R/batch256.jsonl"
kev() { .gpu/bench --checkpoint $C/kev-0.8b $W --form prefix,batch --repeats 5 --warmup 2 --label "kev-$1" \
  --backend cuda --dtype bf16 2>>$OUT/stderr.txt | tee -a $OUT/scale-08b.jsonl | summ; }
kev r1
python3 bench/peak.py --device cuda --dtype bf16 --sustained 5 2>/dev/null | tee -a $OUT/scale-08b.jsonl
pip install -q --no-index --no-deps --no-compile --target /tmp/fla-site .whl/*.whl >/dev/null 2>&1
timeout 200 python3 bench/peers.py --checkpoint $C/kev-0.8b $W --device cuda --dtype bf16 --form batch --repeats 3 \
  --warmup 1 --label transformers 2>>$OUT/stderr.txt | tee -a $OUT/scale-08b.jsonl | summ
PYTHONPATH=/tmp/fla-site timeout 200 python3 bench/peers.py --checkpoint $C/kev-0.8b $W --device cuda --dtype bf16 \
  --form batch --repeats 3 --warmup 1 --label transformers-fla 2>>$OUT/stderr.txt | tee -a $OUT/scale-08b.jsonl | summ
kev r2
