"""The package's layers import only downward, and no module imports itself back (no circles).

Every import counts, at module level or inside a function, ``TYPE_CHECKING``
blocks included: a lazy import is still a dependency. The layers, bottom first,
are drawn in ``docs/design/architecture.md``; a folder may import its own
modules, without circles.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "replicator"

#: Bottom first. A module belongs to the longest prefix listed.
LAYERS: list[tuple[str, ...]] = [
    ("replicator._jax_compat", "replicator.errors"),
    ("replicator.core",),
    ("replicator.analysis",),
    ("replicator.pass_manager",),  # the Pass contract, PassManager, verify
    ("replicator.pipeline",),  # deprecated shims of replicator.pass_manager (its old name)
    ("replicator.passes",),
    ("replicator.stages",),  # pipeline parallelism: model stages (split, schedule)
    ("replicator.cost",),
    ("replicator.tensor",),  # tensor parallelism: placements over 'tensor', the rewrite, plan="auto" (cost)
    ("replicator.runtime",),
    ("replicator.tools",),
    ("replicator.launch",),  # the supervisor of a multi-process job
    ("replicator.training",),  # optim, nn, precision (used inside steps), checkpoint
    ("replicator.api", "replicator.parallelism", "replicator.axes"),
    ("replicator.loop",),  # the Trainer drives a Replicator (its own folder, above api.py)
    ("replicator", "replicator.bisect", "replicator.__main__"),  # the public surface and command lines
]


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: pathlib.Path, known: set[str]) -> set[str]:
    """The package modules that ``path`` imports (``from a.b import c``: ``a.b.c`` if it is a module, else ``a.b``)."""
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # ``from pkg import mod`` depends on ``pkg.mod``; ``from pkg import name`` on ``pkg``.
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names
            ]
        else:
            continue
        found.update(n for n in names if n in known)
    return found


def layer_of(module: str) -> int:
    best, rank = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    assert rank is not None, f"{module} is in no layer: add it to LAYERS and docs/design/architecture.md"
    return rank


def graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: imports_of(path, known) - {name} for name, path in modules.items()}


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
        for a, targets in edges.items()
        for b in targets
        if layer_of(b) > layer_of(a)
    )


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_a_higher_layer():
    assert upward_imports(graph()) == []


def test_no_import_circles():
    # A package's __init__ that re-exports its modules is a circle with any of
    # them that imports the package back: modules import siblings directly.
    assert cycles(graph()) == []


def test_every_module_has_a_layer():
    for name in _modules():
        layer_of(name)


def test_the_checks_catch_an_upward_import_and_a_circle():
    edges = {"replicator.core.x": {"replicator.passes.y"}, "replicator.passes.y": {"replicator.core.x"}}
    assert upward_imports(edges) == ["replicator.core.x (layer 1) imports replicator.passes.y (layer 5)"]
    assert cycles(edges) == [["replicator.core.x", "replicator.passes.y"]]


@pytest.mark.parametrize("source", ["import replicator.passes.fold", "from replicator.passes import fold"])
def test_imports_of_sees_both_import_forms(tmp_path, source):
    path = tmp_path / "m.py"
    path.write_text(f"def f():\n    {source}\n")
    assert imports_of(path, {"replicator.passes.fold", "replicator.passes"}) == {"replicator.passes.fold"}


def test_the_replicator_facade_stays_under_600_lines():
    """``Replicator`` (``api.py``) is a facade over the axes' builders (docs/design/architecture.md says so,
    with this bound): what a new axis or option needs goes in the module that serves it, not here."""
    lines = len((PACKAGE / "api.py").read_text().splitlines())
    assert lines < 600, f"replicator/api.py has {lines} lines: move what grew into the module it serves"
