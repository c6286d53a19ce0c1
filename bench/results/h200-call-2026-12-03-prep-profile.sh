#!/usr/bin/env bash
# Device call (2026-12-03, night session): where a 64-record batch spends its time beyond the
# matmuls. ncu --set full on one launch each of the delta rule's preparation and scan and the
# norms (the batch's first forward, layer 0), then, if nsys is on the machine, the GPU's idle
# gaps over two passes of the batch (bench-rope = main's kernels and host code).
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
B=".gpu/bench-rope --checkpoint $C/kev-0.8b --records $R/batch64.jsonl --form batch --backend cuda --dtype bf16"
which ncu nsys
for k in gdrc_prep2c_tc_bf16 gdrc_scan_tc64_bf16 rmsnorm_bf16 gnorm_bf16 swiglu_bf16; do
  timeout 240 ncu --set full --import-source no -k $k -c 1 -o $OUT/$k $B --repeats 1 --warmup 0 >/dev/null 2>$OUT/ncu-$k.err
  ncu -i $OUT/$k.ncu-rep --page details > $OUT/$k-details.txt 2>&1
  ncu -i $OUT/$k.ncu-rep --page source --print-source sass --csv > $OUT/$k-sass.csv 2>&1
  echo "$k: $(grep -E '^ +Duration' $OUT/$k-details.txt | head -1)"
  rm -f $OUT/$k.ncu-rep
done
if which nsys >/dev/null; then
  nsys profile -t cuda,osrt -o $OUT/batch64 --force-overwrite true $B --repeats 2 --warmup 1 > /dev/null 2>$OUT/nsys.err
  nsys stats --report cuda_gpu_trace --format csv -o $OUT/trace $OUT/batch64.nsys-rep >/dev/null 2>&1
  nsys stats --report cuda_api_sum,osrt_sum $OUT/batch64.nsys-rep > $OUT/api-sum.txt 2>&1
  rm -f $OUT/batch64.nsys-rep $OUT/batch64.sqlite
  ls $OUT
fi
