"""The import graph of the project: no cycles, no upward imports, thin experiments.

Dependency direction, bottom up (docs: README "Layout"): the primitives; the kernels
(jax + primitives only) and the codec protocol; the codecs; the spec grammar; the cache;
attention (the only importer of ``pallas_kernels``); evaluation; the models; the CLI;
the experiment scripts. Every import counts, lazy ones inside functions included: a
cycle through a function-level import is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvjax", "pallas_kernels", "models", "experiments")

#: (module prefix, rank): a module may import modules of its own rank or below
RANKS = (
    ("kvjax.primitives", 0),
    ("pallas_kernels", 1),
    ("kvjax.codec", 1),
    ("kvjax.codecs", 2),
    ("kvjax.centering", 2),
    ("kvjax.spec", 3),
    ("kvjax.cache", 4),
    ("kvjax.attention", 5),
    ("kvjax.sharding", 5),
    ("kvjax.probe", 6),
    ("kvjax.eval", 6),
    ("kvjax.checkpoint", 6),
    ("kvjax.calibration", 6),
    ("kvjax.allocation", 6),
    ("models", 7),
    ("kvjax.cli", 8),
    ("kvjax.__main__", 8),
    ("kvjax.compile_cache", 0),  # JAX's settings only
    ("kvjax", 0),  # the package's own __init__: version only
    ("experiments", 9),
)

#: what the kernels may import from the project: the packing primitives only
KERNEL_ALLOWED = ("pallas_kernels", "kvjax.primitives")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module that ``import name`` loads (longest known prefix)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def _imports(module: str) -> set[str]:
    """Project modules imported anywhere in ``module`` (function bodies included)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` loads pkg.mod when it is a module, else pkg
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                out.add(target)
    return out


GRAPH = {module: _imports(module) for module in MODULES}


def _rank(module: str) -> int:
    for prefix, rank in RANKS:
        if module == prefix or module.startswith(prefix + "."):
            return rank
    raise AssertionError(f"module {module} has no rank in RANKS")


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
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
                out.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_the_known_edges():
    # guards the analysis itself: a parser that found nothing would pass every rule
    assert "kvjax.codec" in GRAPH["kvjax.codecs.intn"]
    assert "kvjax.primitives.packing" in GRAPH["kvjax.codecs.intn"]
    assert "kvjax.cache" in GRAPH["models.llama"]
    assert len(MODULES) > 40


def test_no_import_cycles():
    assert _cycles() == []


def test_no_upward_imports():
    upward = sorted(
        f"{module} ({_rank(module)}) imports {target} ({_rank(target)})"
        for module, targets in GRAPH.items()
        for target in targets
        if _rank(target) > _rank(module)
    )
    assert upward == []


def test_kernels_import_only_jax_and_the_primitives():
    bad = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items() if module.startswith("pallas_kernels")
        for target in targets if not target.startswith(KERNEL_ALLOWED)
    )
    assert bad == []


def test_only_attention_imports_the_kernels():
    bad = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if not module.startswith(("pallas_kernels", "kvjax.attention", "experiments"))
        for target in targets if target.startswith("pallas_kernels")
    )
    assert bad == []


def test_nothing_imports_an_experiment():
    bad = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if target.startswith("experiments.") and target != module
    )
    assert bad == []


@pytest.mark.parametrize("package", ["kvjax", "pallas_kernels", "models", "experiments"])
def test_no_sys_path_edits(package):
    edits = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / package).rglob("*.py"))
        if "sys.path" in path.read_text()
    ]
    assert edits == []


#: experiment scripts with no program worth keeping: shapes from jax.eval_shape (and one
#: `iota` of a few milliseconds), or programs traced to count their operations
COMPILES_NOTHING = ("experiments.memory_table", "experiments.sharding_model",
                    "experiments.kernel_ops")


def test_every_experiment_that_compiles_takes_the_compile_cache():
    """``--no-compile-cache`` and the call that turns the cache on, from the library."""
    missing = sorted(
        f"{module} lacks {call}"
        for module, path in MODULES.items()
        if module.startswith("experiments.") and module not in COMPILES_NOTHING
        and "def main(" in path.read_text()
        for call in ("compile_cache.add_argument(", "compile_cache.from_args(")
        if call not in path.read_text()
    )
    assert missing == []
