#!/usr/bin/env bash
# On a machine with CUDA: the CUDA-marked tests (pytest -m cuda), a short bench at
# Qwen2.5-0.5B's shapes (random weights, nothing downloaded) in bf16, its figures printed,
# then notebook 01 (GRPO, PPO, DPO) on a model folder, the one given or that shape with random
# weights, at the llm profile: each algorithm's step time, tokens per second and the CUDA
# allocator's peak.
#
#   bash scripts/gpu_check.sh            # after README command 1 (or .ci/run) set up .venv
#   bash scripts/gpu_check.sh ~/models/Qwen2.5-0.5B-Instruct     # notebook 01 on your folder
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
MODEL=${1:-}
if [ -z "$MODEL" ]; then  # Qwen2.5-0.5B's shapes, random weights, the embedded tokenizer
  MODEL=$(mktemp -d)/qwen0.5b
  "$PY" -c "import sys; from pathlib import Path; from labkit.bench.inputs import QWEN_05B, build_small_model; print('gpu_check: a random Qwen2.5-0.5B shape,', build_small_model(Path(sys.argv[1]), QWEN_05B), 'parameters')" "$MODEL"
fi
RUNS=$(mktemp -d)
"$PY" -m labkit run notebooks/01_grpo_vs_ppo.ipynb -p model "$MODEL" -p device cuda \
  -p profile llm -p steps 6 -p eval_every 6 -p eval_n 32 -p seeds 1 -p workers 1 \
  -p algos grpo,ppo,dpo -p max_new_tokens 128 -p run_dir "$RUNS/01"
"$PY" -m labkit.bench.notebook_figures "$RUNS/01"
