#!/usr/bin/env bash
# Build (or refresh) .venv-next: torch's newest release, which the main venv does not reach
# (docs/setup.md#dependency-policy).
#  - torch 2.15.0: the newest torch release (the main venv holds the local CPU wheel 2.13.0 on purpose). PyPI has only
#    its CUDA build (about 3 GB of wheels, ~8 GB installed; CI turns pip's cache off); it runs on the CPU. It pins triton 3.9.
#  - transformers 5.25.0 installed together with it, as a user who has both would: then `pip install -e ".[eval,test]"`
#    must leave both in place (no cap of pyproject.toml downgrades a user's newest torch or transformers); checked below.
#  - everything else: the newest release that resolves with those (`.ci/deps.py check-newest`).
# Idempotent. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${LYNX_NEXT_VENV:-.venv-next}"
TORCH_NEXT=2.15.0
TRANSFORMERS_NEXT=5.25.0
t0=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q "torch==$TORCH_NEXT" "transformers==$TRANSFORMERS_NEXT"
python -m pip install -q -e ".[eval,test]"
# the newest of everything that resolves with the project (torch and transformers included: a newer release shows here)
python .ci/deps.py check-newest eval test
python - <<PY
import torch, transformers, triton
assert torch.__version__.split("+")[0] == "$TORCH_NEXT", f"pip install -e . replaced torch $TORCH_NEXT: {torch.__version__}"
assert transformers.__version__ == "$TRANSFORMERS_NEXT", \
    f"pip install -e . replaced transformers $TRANSFORMERS_NEXT: {transformers.__version__}"
import lynx_hf  # noqa: F401
print("next env ok: torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)
PY
echo "next env built in $(( $(date +%s) - t0 )) s"
