#!/usr/bin/env bash
# For a session lent the GPU machine: install CuPy into the venv, run the GPU tests (marker
# gpu) and the kernel benchmark in one go. Usage: scripts/gpu_check.sh [benchmark args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { python3 -m venv .venv && PY=.venv/bin/python; }
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch
"$PY" -m pip install -q -e '.[test]'
"$PY" -c "import cupy" 2>/dev/null || "$PY" -m pip install -q 'cupy-cuda13x>=14' \
    || "$PY" -m pip install -q 'cupy-cuda12x>=13'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
"$PY" -c "import torch, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), 'cupy', cupy.__version__)"
status=0
"$PY" -m pytest -q -m gpu tests/kernels -p no:cacheprovider || status=$?
"$PY" benchmarks/kernels.py "$@" || status=$?
exit $status
