"""Every third-party module ``longstraw_core/``, ``model_adapters/`` and ``recipes/`` import is
declared in ``pyproject.toml``: a package that only arrives through another's requirements
(numpy, safetensors, tokenizers through transformers) can leave with that package's next
release, and then ``pip install longstraw`` makes a LongStraw that does not import.

An import at a module's top (it runs when the module is imported) needs a runtime
dependency; one inside a function (an optional GPU kernel, a plotting library) may be
declared by an extra instead. Imports under ``TYPE_CHECKING`` never run and count as the
latter."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("longstraw_core", "model_adapters", "recipes")

# Import names whose distribution is named otherwise (beyond case and -/_ spelling).
DISTRIBUTIONS = {"yaml": "pyyaml", "fla": "flash-linear-attention"}


def _normalized(name: str) -> str:
    """A distribution's name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _distribution(spec: str) -> str:
    """The distribution a requirement (``"torch>=2.6"``) names."""
    return _normalized(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec).group())


class _Imports(ast.NodeVisitor):
    """A module's absolute imports by top-level name: ``eager`` (run at import) or ``lazy``
    (inside a function or under ``TYPE_CHECKING``)."""

    def __init__(self) -> None:
        self.eager: set[str] = set()
        self.lazy: set[str] = set()
        self._depth = 0

    def _nested(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _nested

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test):
            self._nested(node)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            self._add(node.module)

    def _add(self, module: str) -> None:
        (self.lazy if self._depth else self.eager).add(module.split(".")[0])


def _third_party_imports() -> dict[str, dict[str, list[str]]]:
    """``{"eager"|"lazy": {top-level module: [files importing it]}}`` over ``PACKAGES``."""
    ours = {*PACKAGES, *sys.stdlib_module_names}
    found: dict[str, dict[str, list[str]]] = {"eager": {}, "lazy": {}}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            imports = _Imports()
            imports.visit(ast.parse(path.read_text(encoding="utf-8")))
            where = path.relative_to(ROOT).as_posix()
            for kind, names in (("eager", imports.eager), ("lazy", imports.lazy)):
                for name in names - ours:
                    found[kind].setdefault(name, []).append(where)
    return found


def test_every_imported_third_party_package_is_declared_in_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    runtime = {_distribution(spec) for spec in project["dependencies"]}
    extras = {
        _distribution(s) for specs in project["optional-dependencies"].values() for s in specs
    }
    found = _third_party_imports()
    assert {"torch", "transformers", "numpy"} <= found["eager"].keys()  # the scan sees imports

    def missing(kind: str, declared: set[str]) -> dict[str, list[str]]:
        return {
            name: files
            for name, files in found[kind].items()
            if _normalized(DISTRIBUTIONS.get(name, name)) not in declared
        }

    assert missing("eager", runtime) == {}, "imported at module level: add to dependencies"
    assert missing("lazy", runtime | extras) == {}, (
        "imported lazily: add to dependencies or an extra"
    )
