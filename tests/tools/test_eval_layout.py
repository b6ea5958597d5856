"""``lynx_hf.eval`` (installed: what ``lynx-hf`` runs) and ``lab/`` (the checkout's scripts, not installed), read from
their source: the installed package imports nothing of lab/ and its modules import one another without a circle;
neither reaches a private name of lynx_hf beyond :data:`PRIVATE_IN_USE`, the names the library has no public API
for yet (each one a request to the core: when it gets one, the script switches and its entry goes)."""

import ast
from pathlib import Path

import lynx_hf

ROOT = Path(lynx_hf.__file__).resolve().parent.parent
LIBRARY = ("lynx_hf", "patches")  # lynx_hf (lynx_hf.kernels included), lynx_hf.patches in the checkout
#: file -> the private lynx_hf names it reaches: ``module._name`` (an import or an attribute of a lynx_hf module) or
#: ``._name`` (an attribute the library sets on its own objects)
PRIVATE_IN_USE = {
    # publishes a decode step on a patched model's step tracker around a bare router call (what the backbone's
    # pre-hook does in a forward): the tracker's step frame and context variable, and the step compiled code reads
    "lab/bench_step.py": {"lynx_hf.detection._Frame", "._var", "._traced"},
    # times the Python around the fused device step's launch on a machine without a GPU: the kernel replaced by a
    # no-op for the timing (the library has no launch hook)
    "lab/step_ops.py": {"lynx_hf.kernels.fused_step._fused_step_kernel"},
}


def _sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _library_private_attributes() -> set[str]:
    """Private names the library defines on its classes and objects (``def _x`` in a class, ``self._x = ...``)."""
    out = set()
    for folder in LIBRARY:
        for path in _sources(folder):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    out.update(n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                        and isinstance(node.value, ast.Name) and node.value.id == "self":
                    out.add(node.attr)
    return {n for n in out if _private(n)}


def _dotted(node) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _private_uses(path: Path, library_attrs: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    own |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}  # the script's own objects' names
    modules, found = {}, set()  # local name -> lynx_hf module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "lynx_hf":
                    modules[alias.asname or "lynx_hf"] = alias.name if alias.asname else "lynx_hf"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "lynx_hf":
            for alias in node.names:
                if _private(alias.name):
                    found.add(f"{node.module}.{alias.name}")
                else:
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        chain = _dotted(node)
        if chain and chain[0] in modules:
            found.add(".".join([modules[chain[0]], *chain[1:]]))
        elif node.attr in library_attrs and node.attr not in own:
            found.add(f".{node.attr}")
    return found


def test_scripts_reach_only_the_listed_private_names_of_lynx_hf():
    library_attrs = _library_private_attributes()
    found = {}
    for path in _sources("eval") + _sources("lab"):
        uses = _private_uses(path, library_attrs)
        if uses:
            found[path.relative_to(ROOT).as_posix()] = uses
    assert found == PRIVATE_IN_USE


def _imports(path: Path, package: str) -> set[str]:
    """Module names ``path`` imports, function-local imports included: ``from a import b`` gives ``a`` and ``a.b``,
    relative imports resolved against ``package``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            module = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            out |= {module, *(f"{module}.{alias.name}" for alias in node.names)}
    return out


def _eval_modules() -> dict[str, Path]:
    out = {}
    for path in _sources("eval"):
        rel = path.relative_to(ROOT / "eval").with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        out[".".join(["lynx_hf.eval", *parts])] = path
    return out


def test_installed_eval_needs_no_lab_and_has_no_import_circle():
    modules = _eval_modules()
    edges = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        imported = _imports(path, package)
        assert not {m for m in imported if m.split(".")[0] == "lab"}, (name, "imports lab/, which a wheel lacks")
        edges[name] = {m for m in imported if m in modules and m != name and m != package}
    for path in (ROOT / "lynx_hf" / "cli.py", ROOT / "lynx_hf" / "lm_eval.py"):
        assert not {m for m in _imports(path, "lynx_hf") if m.split(".")[0] == "lab"}, path.name

    state = {}  # depth-first search: 1 on the stack, 2 done

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(edges[node]):
            assert state.get(nxt) != 1, f"import circle: {' -> '.join([*stack, node, nxt])}"
            if nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = 2

    for name in sorted(modules):
        if name not in state:
            visit(name, [])
    assert "lynx_hf.eval.model_sweep" in edges["lynx_hf.eval.sweep"]  # the import the circle used to close
