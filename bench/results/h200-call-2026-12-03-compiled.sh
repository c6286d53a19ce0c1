#!/usr/bin/env bash
# Device call (2026-12-03, night session): the strongest peer, transformers +
# flash-linear-attention under torch.compile(mode="reduce-overhead") (CUDA graphs), on the 8-record
# batch, given most of a device call (520 s, compiling included), with dynamo's recompile and
# graph-break logs; each pass's time as it ends.
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
C=bench/.cache; R=$C/records; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
[ -f $R/batch8.jsonl ] || python3 bench/records.py --out $R >/dev/null
[ -f $C/kev-0.8b/kev.json ] || python3 bench/make_checkpoint.py --size 0.8b --out $C/kev-0.8b --device cuda >/dev/null
pip install -q --no-deps --target /tmp/fla-site .whl/*.whl >/dev/null 2>&1
s=$(date +%s)
PYTHONPATH=/tmp/fla-site TORCH_LOGS="recompiles,graph_breaks" timeout 520 python3 bench/peers.py --checkpoint $C/kev-0.8b \
  --records $R/batch8.jsonl --device cuda --dtype bf16 --form batch --repeats 3 --warmup 3 --compile reduce-overhead \
  --label compiled > $OUT/compiled.jsonl 2> $OUT/stderr-compiled.txt
echo "compiled peer: exit $? after $(( $(date +%s) - s )) s"
cat $OUT/compiled.jsonl | cut -c1-400
grep -E "pass [0-9]|loaded|peer:" $OUT/stderr-compiled.txt
echo "graph breaks: $(grep -c 'Graph break' $OUT/stderr-compiled.txt), recompiles: $(grep -c -i 'recompil' $OUT/stderr-compiled.txt)"
grep -v "^\s*$" $OUT/stderr-compiled.txt | tail -5 | cut -c1-300
