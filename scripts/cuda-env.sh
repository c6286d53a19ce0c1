#!/usr/bin/env bash
# CUDA 13.0 toolchain for `cargo build --features cuda` on a Linux x86-64 machine without a GPU.
# The binaries run on a machine with the CUDA 13.0 driver (see docs/DESIGN.md §10).
#
#   CUDA_ROOT=/some/dir scripts/cuda-env.sh install   # once: pip wheels + link-time fix-ups
#   CUDA_ROOT=/some/dir source scripts/cuda-env.sh    # each shell: export the build environment
#
# CUDA_ROOT defaults to $HOME/.cache/kev-cuda. It is not exported (cudarc's build script would
# read it as a CUDA path); CUDA_HOME is.

_kev_cuda_root="${CUDA_ROOT:-$HOME/.cache/kev-cuda}"
_kev_cuda_home="$_kev_cuda_root/nvidia/cu13"
_kev_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

_kev_cuda_install() (
  set -euo pipefail
  root="$_kev_cuda_root" home="$_kev_cuda_home"

  # 1. CUDA 13.0 from PyPI wheels: must match the run machine's driver (PTX from a newer nvcc
  #    would not load) and stay within what cudarc accepts.
  [ -x "$home/bin/nvcc" ] || python3 -m pip install --quiet --target "$root" \
    "nvidia-cuda-nvcc==13.0.88" "nvidia-cuda-crt==13.0.88" "nvidia-nvvm==13.0.88" \
    "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl==13.0.85" "nvidia-cuda-nvrtc==13.0.88" \
    "nvidia-cublas==13.0.2.14" "nvidia-curand==10.4.0.35"
  test -x "$home/bin/nvcc"

  # 2a. The wheels ship only versioned sonames; the linker wants libX.so.
  for l in cudart cublas cublasLt nvrtc; do ln -sfn "lib$l.so.13" "$home/lib/lib$l.so"; done
  ln -sfn libcurand.so.10 "$home/lib/libcurand.so"

  # 2b. libcuda belongs to the driver, so no wheel ships it. Link against a stub (soname
  #     libcuda.so.1, as the driver's) that defines every cu* symbol cudarc can reference,
  #     taken from cudarc's driver/sys loader (the version in Cargo.lock).
  ver=$(grep -A1 '^name = "cudarc"$' "$_kev_repo/Cargo.lock" | sed -n 's/^version = "\(.*\)"$/\1/p')
  reg="${CARGO_HOME:-$HOME/.cargo}/registry/src"
  src=$(ls -d "$reg"/*/"cudarc-$ver" 2>/dev/null | head -n1 || true)
  if [ -z "$src" ]; then (cd "$_kev_repo" && cargo fetch --locked); src=$(ls -d "$reg"/*/"cudarc-$ver" | head -n1); fi
  mkdir -p "$home/lib/stubs"
  grep -rhoE 'load::<_F>\("cu[A-Za-z0-9_]*"\)' "$src/src/driver/sys/" \
    | sed -E 's/.*\("(cu[A-Za-z0-9_]*)"\)/void \1(void) {}/' | sort -u > "$home/lib/stubs/libcuda_stub.c"
  test -s "$home/lib/stubs/libcuda_stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$home/lib/stubs/libcuda.so" "$home/lib/stubs/libcuda_stub.c"
  ln -sfn libcuda.so "$home/lib/stubs/libcuda.so.1"
  echo "CUDA toolchain ready in $home ($(wc -l < "$home/lib/stubs/libcuda_stub.c") stub symbols from cudarc $ver)"
)

if [ "${1:-}" = install ]; then
  _kev_cuda_install
  _kev_rc=$?
  return $_kev_rc 2>/dev/null || exit $_kev_rc
fi

# Default: the build environment (meant to be sourced).
if [ ! -x "$_kev_cuda_home/bin/nvcc" ]; then
  echo "cuda-env.sh: no nvcc in $_kev_cuda_home; run: CUDA_ROOT=$_kev_cuda_root ${BASH_SOURCE[0]} install" >&2
  return 1 2>/dev/null || exit 1
fi
export CUDA_HOME="$_kev_cuda_home"
export PATH="$CUDA_HOME/bin:$PATH"
export LIBRARY_PATH="$CUDA_HOME/lib:$CUDA_HOME/lib/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"     # sm_90a: H100/H200
export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-2}"    # parallel nvcc jobs in candle-kernels' build
export CUDARC_CUDA_VERSION=13000                      # pin cudarc's API level to the 13.0 driver
