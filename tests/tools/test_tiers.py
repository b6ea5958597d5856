"""The tiers, read from the import statements (``docs/design.md`` "Layout"): kernels/ imports neither transformers
nor lynx_hf internals; the engine-independent core imports no HF block state, detection or family spec; the vLLM
plugin imports only the core, the policies, telemetry, config and errors (never the HF block state, detection or
the family specs)."""

import ast
from pathlib import Path

import lynx_hf

ROOT = Path(lynx_hf.__file__).resolve().parent.parent


def _imports(path: Path, package: str) -> set[str]:
    """Absolute module names ``path`` imports (relative imports resolved against ``package``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
    return out


def test_kernels_import_neither_transformers_nor_lynx_hf():
    for path in (ROOT / "kernels").glob("*.py"):
        bad = {m for m in _imports(path, "lynx_hf.kernels") if m.split(".")[0] == "transformers"
               or (m.startswith("lynx_hf.") and not m.startswith("lynx_hf.kernels"))}
        assert not bad, (path.name, bad)


def test_core_knows_no_hf_block_state_detection_or_family_spec():
    # the cost gate and the selection-bias rule are core tier too (the HF path and the vLLM plugin both use them)
    for name in ("core.py", "gate.py", "selection.py"):
        bad = {m for m in _imports(ROOT / "lynx_hf" / name, "lynx_hf")
               if m.split(".")[0] == "transformers" or m.startswith(("lynx_hf.block", "lynx_hf.detection",
                                                                     "lynx_hf.patches", "lynx_hf.patcher"))}
        assert not bad, (name, bad)


def test_vllm_plugin_imports_only_the_core_policies_and_telemetry():
    allowed = ("lynx_hf.core", "lynx_hf.gate", "lynx_hf.selection", "lynx_hf.policies", "lynx_hf.telemetry", "lynx_hf.config",
               "lynx_hf.errors", "lynx_hf.vllm")
    for path in (ROOT / "lynx_hf" / "vllm").glob("*.py"):
        ours = {m for m in _imports(path, "lynx_hf.vllm") if m.startswith("lynx_hf")}
        assert ours and all(m.startswith(allowed) for m in ours), (path.name, sorted(ours))
