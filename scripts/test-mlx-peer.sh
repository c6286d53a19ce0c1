#!/usr/bin/env bash
# Tests of bench/mlx_peer.py, the mlx-lm peer of the Mac report (scripts/mac-report.sh): its
# logic with numpy, then the peer itself, run by mlx (on the CPU off a Mac) against the PyTorch
# fixtures' probabilities. A virtualenv under target/mlx-venv gets mlx, mlx-lm (the version the
# peer pins), tokenizers, numpy and pytest from PyPI. Arguments go to pytest. Called by `scripts/test`.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/mlx-venv
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
mlx="mlx[cpu]"
[ "$(uname -s)" = Darwin ] && mlx=mlx
"$venv/bin/python" -m pip install -q --disable-pip-version-check "$mlx" "mlx-lm==0.32.2" tokenizers numpy pytest
KEV_REQUIRE_MLX=1 exec "$venv/bin/python" -m pytest -q -p no:cacheprovider bench/tests "$@"
