#!/usr/bin/env bash
# On a machine with CUDA: the CUDA-marked tests (pytest -m cuda), then a short bench at
# Qwen2.5-0.5B's shapes (random weights, nothing downloaded) in bf16, its figures printed.
#
#   bash scripts/gpu_check.sh            # after README command 1 (or .ci/run) set up .venv
#   PYTHON=python bash scripts/gpu_check.sh
#
# Without a CUDA device it says so in one line and exits 3, having run nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing checked" >&2
  exit 3
fi
"$PY" -c "import torch; print('gpu_check:', torch.cuda.get_device_name(0),
                            '| torch', torch.__version__, '| CUDA', torch.version.cuda)"
"$PY" -m pytest -m cuda -q -p no:cacheprovider tests/
"$PY" -m labkit bench --device cuda --scale qwen0.5b --precision bf16 --quick
