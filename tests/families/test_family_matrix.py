"""The family matrix: the cross-cutting tests and benchmarks run every registered family,
asked of the registry (``adapters.matrix``), never a list typed by hand. A family registered
only inside a test appears in their parametrisation; one that leaves a capability out is
left out of that capability's tests."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import throwaway_family

from longstraw_core.adapters import matrix, registry
from longstraw_core.adapters.probe import CAPABILITIES, QLORA, TEST_CAPABILITIES

ROOT = Path(__file__).resolve().parents[2]

# The cross-cutting test files, each with a capability's family in its test ids.
CROSS_CUTTING = {
    "tests/offload/test_offload.py": "offload",
    "tests/models/test_qlora.py": QLORA,
    "tests/models/test_loading.py": "loading",
    "tests/models/test_mixed_precision.py": "mixed_precision",
    "tests/pipeline/test_pipeline.py": "pipeline",
    "tests/tools/test_tool_mask.py": "tool_mask",
    "tests/test_entry_points.py": "demo",
    "tests/adapters/test_prefill_options.py": "prefill_options",
    "tests/adapters/test_activation_checkpointing.py": None,  # every family
    "tests/test_gpu_check.py": "gpu_check",
}

# Where a sequence naming several families' model types stays: deliberate picks, not "every
# family" (each reason says why). Tables keyed by model type (a dict: per-family tuning, or
# gpu_check_plan's time budget, which needs no torch) are not sequences and not flagged.
ALLOWED = {
    "tests/adapters/test_chunked_head.py": "the two layer structures the head is chunked over",
    "tests/distributed/test_distributed.py": "dense and hybrid under two gloo ranks",
    "tests/grpo/test_decode_syncs.py": "attention and recurrent decoding's host syncs",
    "tests/grpo/test_rollout.py": "rollout cases per family variant (GLM dense and sparse)",
    "tests/models/test_lora.py": "LoRA target naming of particular model types",
    "tests/support/fsdp_lora_worker.py": "FSDP LoRA of the families with routers/recurrence",
    "tests/test_gpu_check.py": "a quick CPU check's recorded steps",
    "tests/test_layering.py": "the shipped families' registration order",
    "tests/tools/test_tool_memory.py": "tool-turn memory of the two decoding paths",
}


def _family_names() -> dict[str, str]:
    """Every model type and family name -> its family's name."""
    names = {}
    for family in registry.families():
        names[family.name] = family.name
        names |= dict.fromkeys(family.model_types, family.name)
    return names


def _hand_typed_lists(path: Path, names: dict[str, str]) -> list[str]:
    """Sequence literals (list, tuple, set) naming model types of two or more families, or
    three or more model types: a family list typed by hand."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.List | ast.Tuple | ast.Set):
            typed = [
                e.value
                for e in node.elts
                if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value in names
            ]
            if len({names[t] for t in typed}) >= 2 or len(typed) >= 3:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {typed}")
    return found


@pytest.fixture
def throwaway():
    throwaway_family.register()
    yield throwaway_family.MODEL_TYPE
    throwaway_family.unregister()


def test_a_family_registered_in_a_test_is_in_every_capability_it_declares(throwaway) -> None:
    for capability in sorted(CAPABILITIES):
        declared = capability in throwaway_family.CAPABILITIES
        assert (throwaway in matrix.probe_types(capability)) == declared, capability
    assert throwaway in matrix.probe_types()
    assert matrix.probe_of(throwaway).model_type == throwaway
    assert throwaway in registry.supported_model_types()


def test_the_throwaway_family_leaves_no_trace(throwaway) -> None:
    version = registry.version()
    throwaway_family.unregister()
    assert throwaway not in matrix.probe_types()
    assert registry.family_of(throwaway) is None and registry.version() > version
    throwaway_family.register()  # the fixture unregisters it again


def test_the_shipped_families_run_every_cpu_test() -> None:
    assert matrix.probe_types() == ["qwen3", "qwen3_5_text", "glm_moe_dsa", "gpt_oss"]
    for capability in TEST_CAPABILITIES:
        assert matrix.probe_types(capability) == matrix.probe_types()


def test_a_probe_must_name_a_tiny_config_and_known_capabilities() -> None:
    from longstraw_core.adapters.family import ModelFamily
    from longstraw_core.adapters.probe import FamilyProbe

    def family(probe: FamilyProbe) -> ModelFamily:
        return ModelFamily("x", ("x_type",), {}, {}, {"x_type": {}}, probe=probe)

    assert family(FamilyProbe()).probe.model_type == "x_type"  # the first tiny config
    with pytest.raises(ValueError, match="no tiny config"):
        family(FamilyProbe(model_type="other"))
    with pytest.raises(ValueError, match="unknown capabilities"):
        family(FamilyProbe(capabilities=frozenset({"qlora4"})))
    with pytest.raises(ValueError, match="needs GPU shapes"):
        family(FamilyProbe(capabilities=frozenset({"gpu_check"})))


def test_no_test_or_benchmark_types_a_family_list_by_hand() -> None:
    names = _family_names()
    files = sorted([*ROOT.glob("tests/**/*.py"), *ROOT.glob("benchmarks/*.py")])
    found = {}
    for path in files:
        relative = str(path.relative_to(ROOT))
        if relative.startswith("tests/families/"):  # each family's own tests name it
            continue
        if hits := _hand_typed_lists(path, names):
            found[relative] = hits
    typed = {path: hits for path, hits in found.items() if path not in ALLOWED}
    assert not typed, "ask adapters.matrix.families_for / probe_types instead:\n" + "\n".join(
        hit for hits in typed.values() for hit in hits
    )
    assert sorted(set(ALLOWED) - set(found)) == []  # an exception no longer needed goes


def test_the_cross_cutting_tests_collect_a_family_registered_only_in_a_test() -> None:
    """Collected with the throwaway family registered (a plugin): each file has its cases,
    but the QLoRA tests, whose capability it leaves out."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "throwaway_family"]
    command += ["-p", "no:cacheprovider", *CROSS_CUTTING]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    for path, capability in CROSS_CUTTING.items():
        mine = [i for i in ids if i.startswith(path)]
        has = any(throwaway_family.MODEL_TYPE in i for i in mine)
        assert mine and has == (capability != QLORA), (path, has)
