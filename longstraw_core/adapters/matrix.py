"""The family matrix: the registered families the cross-cutting tests and benchmarks run.

Why: a test of offload, QLoRA, loading, ... that types its families by hand misses every
family added later. These helpers read the registry instead (each family's
``ModelFamily.probe``), so a family registered anywhere, a test module included, appears in
their parametrisation. A test ids its cases by ``probe.model_type``, as the hand-typed lists
did.
"""

from __future__ import annotations

from longstraw_core.adapters import registry
from longstraw_core.adapters.family import ModelFamily
from longstraw_core.adapters.probe import FamilyProbe


def families_for(capability: str | None = None) -> tuple[ModelFamily, ...]:
    """The registered families whose probe can run ``capability`` (None: every family with
    a probe model), in registration order."""
    return tuple(
        family
        for family in registry.families()
        if family.probe.model_type and (capability is None or family.probe.can(capability))
    )


def probe_types(capability: str | None = None) -> list[str]:
    """The probe model types of ``families_for(capability)``: what tests parametrise over."""
    return [family.probe.model_type for family in families_for(capability)]


def probe_of(model_type: str) -> FamilyProbe:
    """The probe of the family serving ``model_type`` (a ``KeyError`` if none does)."""
    family = registry.family_of(model_type)
    if family is None:
        raise KeyError(f"no registered family serves {model_type!r}")
    return family.probe
