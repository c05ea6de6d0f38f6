"""The families a benchmark runs, asked of the registry (``longstraw_core.adapters.matrix``)
instead of typed here: a family registered later gets its benchmarks by declaring them
(``ModelFamily.probe``: capabilities, GPU shapes, expected kernels).

Read on the first call, not at import: ``gpu_check.py``'s parent process plans and reports
without torch until it needs a family (the registry imports the families, and they torch).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from longstraw_core.adapters.probe import FamilyProbe, GpuShapes


@functools.cache
def probe_types(capability: str) -> tuple[str, ...]:
    """The probe model types of the families declaring ``capability``, in registration order."""
    from longstraw_core.adapters import matrix

    return tuple(matrix.probe_types(capability))


def gpu_check_models() -> tuple[str, ...]:
    """The families ``make gpu-check`` runs a recipe step of (capability ``gpu_check``)."""
    from longstraw_core.adapters.probe import GPU_CHECK

    return probe_types(GPU_CHECK)


def prefill_bench_models() -> tuple[str, ...]:
    """The families of gpu-check's prefill benchmark (capability ``prefill_benchmark``)."""
    from longstraw_core.adapters.probe import PREFILL_BENCHMARK

    return probe_types(PREFILL_BENCHMARK)


def prefix_memory_models() -> tuple[str, ...]:
    """The families ``benchmarks/report.py`` measures the prefix memory of."""
    from longstraw_core.adapters.probe import PREFIX_MEMORY

    return probe_types(PREFIX_MEMORY)


def probe(model_type: str) -> FamilyProbe:
    """The declared probe of the family serving ``model_type``."""
    from longstraw_core.adapters import matrix

    return matrix.probe_of(model_type)


def gpu_shapes(model_type: str) -> GpuShapes:
    """The GPU shapes the family serving ``model_type`` declares (a ``KeyError`` if none)."""
    shapes = probe(model_type).gpu
    if shapes is None:
        raise KeyError(f"the family of {model_type!r} declares no GPU shapes (probe.gpu)")
    return shapes


def full_attention_only(model_type: str) -> bool:
    """Whether every layer of ``model_type`` keeps full-attention K/V (its family names that
    one layer kind): the benchmarks' dense shapes (heads, head dims) fit it."""
    from longstraw_core.adapters import registry
    from longstraw_core.kinds.attention import AttentionKV

    family = registry.family_of(model_type)
    return family is not None and set(family.layer_kinds) == {AttentionKV.kind}
