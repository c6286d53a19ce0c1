#!/usr/bin/env bash
# Runs on the CUDA machine, from a copy of the repository holding .gpu/ (see gpu-build.sh):
# the parity suite on CUDA (ops, backbone, decision model in f32 and bf16), then, when a bench
# checkpoint exists, the one-request timing of Kev and transformers side by side.
set -uo pipefail
cd "$(dirname "$0")/.."
for f in .gpu/*.xz; do xz -dkf "$f"; done
chmod +x .gpu/parity .gpu/bench .gpu/gdr_bench .gpu/loadgen 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
KEV_TEST_BACKEND=cuda .gpu/parity --test-threads 1 --nocapture 2>&1 | grep -vE "^\s*$"
