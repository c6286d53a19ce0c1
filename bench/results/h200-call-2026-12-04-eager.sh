#!/usr/bin/env bash
# Device call (2026-12-04, session 2, after closing): what a record whose shape has no graph
# costs, on the final tree (073c2bd): the prefix form with and without CUDA graphs, alternating,
# on one 704-token record (its graph replayed) and on the 256 varied `score` records (mostly
# eager with graphs on: their shapes rarely repeat).
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
C=bench/.cache; R=$C/records; mkdir -p $R
for f in .gpu/*.xz; do xz -dkf "$f"; done; chmod +x .gpu/* 2>/dev/null
[ -f $R/one.jsonl ] || python3 bench/records.py --out $R >/dev/null
[ -f $C/kev-0.8b/kev.json ] || python3 bench/make_checkpoint.py --size 0.8b --out $C/kev-0.8b --device cuda >/dev/null
[ -f $C/score-10k.jsonl ] || python3 bench/stream_records.py --n 10000 --out $C/score-10k.jsonl >/dev/null
head -n 256 $C/score-10k.jsonl > $C/score-256.jsonl
python3 -c 'import json,sys
n=[0,0]
for l in open(sys.argv[1]):
    d=json.loads(l); n[0]+=1; n[1]+=len(d["state"])
print("score-256: %d records, mean state %.0f characters" % (n[0], n[1]/n[0]))' $C/score-256.jsonl
summ() { python3 -c 'import json,sys
for d in map(json.loads, sys.stdin):
    print(d.get("label",""), d["workload"], d["form"], "median", round(d["latency_ms_median"],2), "min", round(d["latency_ms_min"],2), "rec/s", round(d["records_per_s"],1), "tokens", d.get("tokens"), "graphs", d.get("cuda_graphs"))'; }
for round in 1 2; do
  for mode in graphs eager; do
    flag=""; [ $mode = eager ] && flag="--no-cuda-graphs"
    .gpu/bench --checkpoint $C/kev-0.8b --records $R/one.jsonl --records $C/score-256.jsonl --form prefix --repeats 5 --warmup 2 \
      --label "$mode-r$round" $flag --backend cuda --dtype bf16 2>>$OUT/stderr.txt | tee -a $OUT/eager.jsonl | summ
  done
done
