#!/usr/bin/env bash
# Builds and tests the `kev` Python package and the Ray example on this machine: a virtualenv
# under target/py-venv (ignored by git) with maturin, pytest, numpy and Ray from PyPI, the
# package built from ./kev-python, then its pytest suite (which compares against the Rust
# `score` example, built here first). Needs the Rust toolchain and Python 3 with pip.
#
#   scripts/test-python.sh                 # everything
#   scripts/test-python.sh -k parity -x    # arguments go to pytest
#
# PYTHON picks the interpreter (default python3); CARGO_TARGET_DIR is honoured.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
venv="$root/target/py-venv"
target="${CARGO_TARGET_DIR:-$root/target}"

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet maturin pytest numpy "ray[data,serve]"

cargo build --release --example score
export PATH="$venv/bin:$PATH"   # the virtualenv's maturin, for the build without isolation
# Built by the virtualenv's maturin from the working tree (never a cached wheel of an older one).
"$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps --no-cache-dir \
    --no-build-isolation ./kev-python

export KEV_SCORE_BIN="$target/release/examples/score"
cd kev-python
exec "$venv/bin/python" -m pytest "$@"
