"""The import graph of LongStraw's packages: circles and imports that run back up.

    python docs/tools/import_graph.py --lazy     # circles, imports up a floor, core -> families

The floors (``FLOORS``, lowest first; ``docs/design.md``, "Layers"): a module may import its
own floor and those below. ``FLOORS`` names top-level packages only, so a package's modules
are all on its floor; the package-level graph (``package_graph``) has no circle either.

Edges are the ``import``/``from ... import`` statements at module level (``TYPE_CHECKING``
blocks excluded: they never run); ``--lazy`` adds the imports inside functions. A package's
``__init__`` counts as a module of its own. ``tests/test_layering.py`` holds the project to
what this prints: no circles (between modules or packages), and no module of ``longstraw_core`` importing ``model_adapters``.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("longstraw_core", "model_adapters")
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "foundation",  # tensors, records and plain declarations: no model, no run
        (
            "longstraw_core.tensors", "longstraw_core.process", "longstraw_core.metrics",
            "longstraw_core.attention", "longstraw_core.kinds", "longstraw_core.offload",
            "longstraw_core.state", "longstraw_core.schema", "longstraw_core.distributed",
        ),
    ),
    ("adapters", ("longstraw_core.adapters", "longstraw_core.pipeline")),  # the contract
    # GRPO over an adapter; the package's own module (``import longstraw_core as ls``) too
    ("algorithms", ("longstraw_core.grpo", "longstraw_core.rollout", "longstraw_core")),
    ("inputs", ("longstraw_core.data", "longstraw_core.rewards", "longstraw_core.tools")),
    ("config", ("longstraw_core.config",)),  # loaded and checked against the inputs
    (
        "run parts",  # what a run is made of: checkpoints, the plan, the ranks, the model
        (
            "longstraw_core.checkpoint", "longstraw_core.plan", "longstraw_core.parallel",
            "longstraw_core.models", "longstraw_core.launch",
        ),
    ),
    ("run", ("longstraw_core.training", "longstraw_core.scale_check")),
    ("families", ("model_adapters",)),
)  # fmt: skip


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.AST, lazy: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module loads.

    ``lazy``: every import the module names: inside functions, under ``TYPE_CHECKING``, and
    ``importlib.import_module("a.literal")`` calls (as an ``import`` of that name).
    """
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node) and not lazy:
            stack.extend(node.orelse)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and not lazy:
            continue
        else:
            if lazy and _is_import_module_call(node):
                yield ast.Import(names=[ast.alias(name=node.args[0].value)])
            stack.extend(ast.iter_child_nodes(node))


def _is_import_module_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    )


def imports_of(name: str, path: Path, known: dict[str, Path], lazy: bool) -> set[str]:
    """The project modules ``name`` imports (``from pkg import sub`` counts ``pkg.sub``)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _statements(tree, lazy):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph(lazy: bool = False) -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known, lazy) for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10_000)

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def package_of(module: str) -> str:
    """The top-level package ``module`` belongs to (``longstraw_core.grpo``, ``model_adapters``);
    the package's own ``__init__`` (``longstraw_core``) is a package of its own."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "longstraw_core" else parts[0]


def package_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The imports between top-level packages (a module's imports, its package's)."""
    found: dict[str, set[str]] = {package_of(name): set() for name in edges}
    for src, targets in edges.items():
        found[package_of(src)] |= {package_of(dst) for dst in targets} - {package_of(src)}
    return found


def floor_of(module: str) -> int:
    """The index in ``FLOORS`` of the longest prefix naming ``module``."""
    best, length = -1, -1
    for index, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            named = module == prefix or module.startswith(prefix + ".")
            if named and len(prefix) > length:
                best, length = index, len(prefix)
    if best < 0:
        raise ValueError(f"{module} is on no floor of FLOORS")
    return best


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a floor to a higher one (the core importing the families among them)."""
    return sorted(
        (src, dst) for src, targets in edges.items() for dst in targets
        if floor_of(dst) > floor_of(src)
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lazy",
        action="store_true",
        help="also imports inside functions, under TYPE_CHECKING and by import_module",
    )
    args = parser.parse_args()
    edges = graph(lazy=args.lazy)
    found = circles(edges)
    packages = package_graph(edges)
    print(
        f"{len(edges)} modules, {sum(map(len, edges.values()))} imports, {len(packages)} packages"
    )
    found += circles(packages)
    for component in found:
        print(f"circle of {len(component)}: {', '.join(component)}")
    for src, dst in upward(edges):
        print(f"up: {src} ({FLOORS[floor_of(src)][0]}) -> {dst} ({FLOORS[floor_of(dst)][0]})")
    return 1 if found or upward(edges) else 0


if __name__ == "__main__":
    raise SystemExit(main())
