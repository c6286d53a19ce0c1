#!/usr/bin/env bash
# Device call 1 (2026-12-03): parity, cold start (fresh x2 / warm x2), kernel names of whole processes under ncu, speed at scale.
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}
if [ "${1:-a}" = b ]; then bench/run_h200_scale.sh scale 2>&1 | tee $OUT/call1-b.txt; exit; fi
bench/run_h200_scale.sh parity coldstart 2>&1 | tee $OUT/call1-a.txt
C=bench/.cache; R=$C/records
if command -v ncu >/dev/null; then
  for w in one batch64; do
    ncu --csv --metrics gpu__time_duration.sum .gpu/bench --checkpoint $C/kev-0.8b --records $R/$w.jsonl --form batch \
      --repeats 1 --warmup 0 --backend cuda --dtype bf16 > $OUT/ncu-names-$w.csv 2>$OUT/ncu-$w.err
    echo "ncu $w: rc $? launches $(grep -c gpu__time_duration $OUT/ncu-names-$w.csv)"
    python3 - $OUT/ncu-names-$w.csv <<'PY'
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
h = next(i for i, r in enumerate(rows) if "Kernel Name" in r); k = rows[h].index("Kernel Name")
names = collections.Counter(r[k].split("(")[0].split("<")[0] for r in rows[h + 1:] if len(r) > k)
for n, c in sorted(names.items()): print(f"  {c:5d} {n}")
PY
  done
else
  echo "no ncu"
fi
cp bench/.cache/results-scale.jsonl bench/.cache/stderr-scale.txt $OUT/ 2>/dev/null
