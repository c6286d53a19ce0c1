#!/usr/bin/env bash
# Builds the CUDA binaries (the parity test binary, the bench, encode_bench and score examples and kev-serve's load generator) on a machine without a
# GPU and packs them into .gpu/ (ignored by git) for a CUDA 13.0 machine:
#
#   CUDA_ROOT=/some/dir scripts/cuda-env.sh install     # once
#   CUDA_ROOT=/some/dir scripts/gpu-build.sh            # builds into $KEV_CUDA_TARGET (default target-cuda)
#
# Then, on the GPU machine, from a copy of the repository holding .gpu/ (scripts/gpu-run.sh):
#   KEV_TEST_BACKEND=cuda .gpu/parity --test-threads 1 --nocapture
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cuda-env.sh
target="${KEV_CUDA_TARGET:-target-cuda}"
jobs="${CARGO_BUILD_JOBS:-2}"
cargo build --release --features cuda --target-dir "$target" -j "$jobs" --example bench --example score --example encode_bench
cargo build --release --features cuda --target-dir "$target" -j "$jobs" -p kev-kernels --example gdr_bench
cargo build --release --features cuda --target-dir "$target" -j "$jobs" -p kev-serve --example loadgen
parity=$(cargo test --release --features cuda --target-dir "$target" -j "$jobs" --test parity --no-run \
  --message-format=json 2>/dev/null | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n1 || true)
if [ -z "$parity" ]; then
  echo "the parity test binary did not build:" >&2
  cargo test --release --features cuda --target-dir "$target" -j "$jobs" --test parity --no-run >&2
  exit 1
fi
mkdir -p .gpu
for bin in "$parity:parity" "$target/release/examples/bench:bench" "$target/release/examples/score:score" "$target/release/examples/gdr_bench:gdr_bench" "$target/release/examples/encode_bench:encode_bench" \
  "$target/release/examples/loadgen:loadgen"; do
  src=${bin%%:*} name=${bin##*:}
  strip -o ".gpu/$name" "$src"
  xz -T2 -6 -f ".gpu/$name"          # the GPU machine takes at most 64 MiB per call
done
ls -la .gpu
