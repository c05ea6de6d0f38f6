"""The house's floors: imports run one way (``docs/tools/import_graph.py``; ``docs/design.md``,
"Layers"), the core never names a family, and ``model_adapters/`` holds only families."""

from __future__ import annotations

import importlib.util
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import model_adapters
from longstraw_core.adapters import registry

ROOT = Path(__file__).resolve().parents[1]


def _import_graph():
    spec = importlib.util.spec_from_file_location(
        "import_graph", ROOT / "docs/tools/import_graph.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_circles_counting_every_import_a_module_names() -> None:
    graph = _import_graph()
    assert graph.circles(graph.graph(lazy=True)) == []


def test_packages_import_each_other_without_circles() -> None:
    """Between top-level packages too (``longstraw_core.grpo`` -> ``longstraw_core.state``),
    imports run one way: a package can be read knowing only those below it."""
    graph = _import_graph()
    packages = graph.package_graph(graph.graph(lazy=True))
    assert graph.circles(packages) == []
    assert len(packages) > 20  # every package of the core and the families


def test_every_package_is_on_one_floor_named_for_it() -> None:
    """``FLOORS`` names whole top-level packages (so no package has modules on two floors),
    and every package of ``longstraw_core`` is named: none falls to a floor by default."""
    graph = _import_graph()
    named = [prefix for _, prefixes in graph.FLOORS for prefix in prefixes]
    assert len(named) == len(set(named))
    assert [p for p in named if graph.package_of(p) != p] == []
    on_disk = {
        f"longstraw_core.{path.parent.name}"
        for path in (ROOT / "longstraw_core").glob("*/__init__.py")
    } | {"longstraw_core", "model_adapters"}
    loose = sorted(
        p.name for p in (ROOT / "longstraw_core").glob("*.py") if p.name != "__init__.py"
    )
    assert loose == [], f"modules outside a package: {loose}"
    assert set(named) == on_disk


def test_imports_run_down_the_floors() -> None:
    graph = _import_graph()
    edges = graph.graph(lazy=True)
    assert graph.upward(edges) == []
    # The core never imports the families: it finds them through their entry point.
    assert not [
        (src, dst)
        for src, targets in edges.items()
        if src.startswith("longstraw_core")
        for dst in targets
        if dst.startswith("model_adapters")
    ]


def test_every_module_of_model_adapters_is_a_registered_family() -> None:
    families = {family.name: family for family in registry.families()}
    for module in pkgutil.iter_modules(model_adapters.__path__):
        family = importlib.import_module(f"model_adapters.{module.name}").FAMILY
        assert families[family.name] is family, module.name


def test_the_shipped_families_come_from_the_entry_point() -> None:
    from importlib.metadata import entry_points

    (entry,) = entry_points(group=registry.ENTRY_POINT_GROUP, name="longstraw")
    assert entry.value == "model_adapters"
    assert [f.name for f in registry.families()][:3] == ["dense", "qwen36", "glm52"]


def test_the_package_the_planner_and_the_config_checks_leave_peft_and_bitsandbytes_out() -> None:
    """peft imports bitsandbytes, and bitsandbytes torch's compiler stack (~2 s of every
    process's start): only what trains (adapters, the scheduler, rewards' ``TrainerState``)
    loads them, not ``import longstraw_core``, the planner CLI or config validation."""
    script = (
        "import sys, longstraw_core, longstraw_core.plan.cli, longstraw_core.config\n"
        "import longstraw_core.checkpoint, longstraw_core.rewards\n"
        "print(sorted(m for m in ('peft', 'bitsandbytes') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def _exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_the_floor_table_names_modules_that_exist() -> None:
    """``FLOORS`` and the table in docs/design.md ("Layers") name only modules and packages
    that exist: a renamed or removed module is taken out of both."""
    graph = _import_graph()
    named = [prefix for _, prefixes in graph.FLOORS for prefix in prefixes]
    assert [m for m in named if not _exists(m)] == []
    design = (ROOT / "docs/design.md").read_text()
    table = design[design.index("| floor | what | packages |") :].split("\n\n")[0]
    rows = [line.split("|")[3] for line in table.splitlines()[2:]]
    cited = [name.strip("/") for row in rows for name in re.findall(r"`([^`]+)`", row)]
    base = {"model_adapters/": "model_adapters"}
    missing = [
        name
        for name in cited
        if not _exists(base.get(name + "/", "longstraw_core." + name.replace("/", ".")))
        and not _exists(name.replace("/", "."))
    ]
    assert missing == [], f"docs/design.md's floor table names modules that do not exist: {missing}"
    # Every floor lists the same packages in the table as in FLOORS.
    for floor, prefixes in graph.FLOORS:
        row = next(line for line in table.splitlines() if line.startswith(f"| {floor} |"))
        listed = {name.strip("/") for name in re.findall(r"`([^`]+)`", row.split("|")[3])}
        assert listed == {p.removeprefix("longstraw_core.") for p in prefixes}, floor
