#!/usr/bin/env bash
# The CPU tests built for aarch64-unknown-linux-gnu and run under qemu-user, with the tolerances of
# the x86-64 run: the code a Mac's CPU backend runs that x86-64 never does (candle's NEON kernels
# and gemm's NEON matmul, the portable fallbacks of Kev's AVX2 code). Called by `scripts/test`.
#
#   scripts/test-aarch64.sh          # kev-kernels' unit and op tests, kev-candle's unit tests,
#                                    # the parity suite and the error tests of tests/ (CI's set)
#   scripts/test-aarch64.sh --all    # also tests/prefix_cache.rs and tests/concurrency.rs (~6 min more)
#
# Needs qemu-aarch64, the aarch64 cross gcc (as linker) and the aarch64 C library under
# /usr/aarch64-linux-gnu; where one is missing they are installed with apt-get (through sudo when
# not root), and the script fails, naming them, where that is not possible. qemu's `max` CPU has
# NEON, FP16 and BF16, as Apple M-series CPUs do; the op tests run a second time on `neoverse-n1`
# (no BF16), as on an M1.
#
# Left out: tests/score (its CLI tests start the aarch64 `score` binary as a child process, which
# the host kernel cannot run without a binfmt_misc entry for qemu) and the fuzz tests (input
# parsing, the same on every CPU). CARGO_TARGET_DIR is honoured: the aarch64 build goes to its
# aarch64-unknown-linux-gnu/ folder.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"

target=aarch64-unknown-linux-gnu
sysroot=/usr/aarch64-linux-gnu
linker=aarch64-linux-gnu-gcc
missing() {
  local m=()
  command -v qemu-aarch64 >/dev/null || m+=(qemu-user)
  command -v "$linker" >/dev/null || m+=(gcc-aarch64-linux-gnu)
  [ -e "$sysroot/lib/libc.so.6" ] && [ -e "$sysroot/lib/libc.so" ] || m+=(libc6-dev-arm64-cross)
  echo "${m[@]}"
}
need=$(missing)
if [ -n "$need" ]; then
  # shellcheck disable=SC2086  # $need is a list of package names
  scripts/apt-install.sh test-aarch64 $need
  need=$(missing)
  [ -z "$need" ] || { echo "test-aarch64: still missing after apt-get: $need" >&2; exit 1; }
fi
rustup target add "$target" >/dev/null

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=$linker
runner="qemu-aarch64 -L $sysroot -cpu"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="$runner max"
# One package selection for both runs: cargo unifies features over the selected packages, so
# another selection would build candle again.
packages=(-p kev-kernels -p kev-candle -p kev)
tests=(--lib --test ops --test parity --test errors)
[ "${1:-}" = --all ] && tests+=(--test prefix_cache --test concurrency)

cargo test --release --target "$target" "${packages[@]}" "${tests[@]}"
CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="$runner neoverse-n1" \
  cargo test --release --target "$target" "${packages[@]}" --lib --test ops
