#!/usr/bin/env bash
# Build (or refresh) .venv-next: the newest leg for the releases the main venv does not reach (docs/setup.md#dependency-policy).
#  - torch 2.14.1: the newest torch pyproject.toml admits (what vLLM 0.34 needs; the main venv holds the local CPU wheel
#    2.13.0). PyPI has only CUDA builds of it; on this project's machines pip takes 2.14.1 and its CUDA libraries from
#    the local disk (about 6.7 GB in the venv, no download); it runs on the CPU. Its CUDA build pins triton ~=3.8.0.
#  - transformers 5.25.0 installed over it with --no-deps: beyond pyproject's cap (5.25 requires kernels >= 0.19.1,
#    which the package index does not have, and its from_pretrained kernelizes with hub kernels by default), so it is
#    tested without `kernels`, with USE_HUB_KERNELS=0 set by the caller (.ci/test), so that the day the cap is
#    lifted the new families and the checkpoint-config change are already covered.
#  - everything else: the newest release that resolves with those.
# Idempotent. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${LYNX_NEXT_VENV:-.venv-next}"
TORCH_NEXT=2.14.1
TRANSFORMERS_NEXT=5.25.0
t0=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q "torch==$TORCH_NEXT"
printf 'torch==%s\n' "$TORCH_NEXT" > "$VENV/lynx-constraints.txt"
python -m pip install -q -c "$VENV/lynx-constraints.txt" -e ".[eval,test]"
# the newest of everything else that resolves with torch held at $TORCH_NEXT (transformers: 5.24, before the override)
python .ci/deps.py check-newest --skip torch eval test
python -m pip install -q --no-deps "transformers==$TRANSFORMERS_NEXT"
python - <<PY
import torch, transformers, triton
assert torch.__version__.split("+")[0] == "$TORCH_NEXT", torch.__version__
assert transformers.__version__ == "$TRANSFORMERS_NEXT", transformers.__version__
import lynx_hf  # noqa: F401
print("next env ok: torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)
PY
echo "next env built in $(( $(date +%s) - t0 )) s"
