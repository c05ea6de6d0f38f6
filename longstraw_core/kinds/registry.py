"""The registered layer kinds: what each declares about itself, and the lookups the rest of
LongStraw iterates over instead of naming kinds.

Each kind module of this package ends with ``register_kind(LayerKind(...))``: its name (the
record's ``kind``), its record class, the ``OffloadPolicy`` field that places it, and its
planner formulas (``kinds.planning.KindPlan``). Nothing elsewhere names a kind: offload, the
config checks and the planner ask ``kind(name)`` or iterate ``kinds()``. ``load_kinds``
imports every module of this package once (a kind defined elsewhere registers when its
module is imported, as a family does).

This module imports nothing of LongStraw at load time (``longstraw_core.offload`` reads it,
and the kind modules import offload).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any

_KINDS: dict[str, LayerKind] = {}
_loaded = False


@dataclass(frozen=True)
class LayerKind:
    """One layer kind, as its module declares it.

    - ``name``: the record kind (``LayerState.kind``; ``LayerSpec.record`` in the planner).
    - ``record``: the prefix record class (``kinds.base.LayerState``).
    - ``offload``: the placement that places its records (``OffloadPolicy``'s placement of
      that name, the run config's ``offload.<name>``): declared here only (``placements``).
    - ``plan``: its planner formulas (``kinds.planning.KindPlan``: memory, FLOPs, reads).
    """

    name: str
    record: type
    offload: str
    plan: Any

    @property
    def grows_with_prompt(self) -> bool:
        """Whether its state grows with the prompt (K/V, a latent) or has a fixed size."""
        return bool(self.record.grows_with_prompt)


def register_kind(kind: LayerKind) -> LayerKind:
    """Register ``kind`` (its module calls this when it loads); a name is registered once."""
    known = _KINDS.get(kind.name)
    if known is not None and known.record is not kind.record:
        raise ValueError(f"layer kind {kind.name!r} is already registered ({known.record})")
    if kind.record.kind != kind.name:
        raise ValueError(f"layer kind {kind.name!r}: its record's kind is {kind.record.kind!r}")
    _KINDS[kind.name] = kind
    return kind


def load_kinds() -> None:
    """Import every module of this package (once), so that its kinds are registered."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    package = __name__.rpartition(".")[0]
    path = importlib.import_module(package).__path__
    for module in pkgutil.iter_modules(path):
        importlib.import_module(f"{package}.{module.name}")


def kinds() -> tuple[LayerKind, ...]:
    """Every registered kind, sorted by name."""
    load_kinds()
    return tuple(_KINDS[name] for name in sorted(_KINDS))


def kind(name: str) -> LayerKind:
    """The kind named ``name``; a ``KeyError`` naming the registered ones if none is."""
    found = _KINDS.get(name)
    if found is None:
        load_kinds()
        found = _KINDS.get(name)
    if found is None:
        raise KeyError(f"unknown layer kind {name!r}; layer kinds: {sorted(_KINDS)}")
    return found


def offload_fields() -> dict[str, str]:
    """Record kind -> the ``OffloadPolicy`` field placing it, sorted by kind."""
    return {k.name: k.offload for k in kinds()}


def placements() -> tuple[str, ...]:
    """The placement names the registered kinds declare (``LayerKind.offload``), each once,
    in the order of the kinds' names: the ``OffloadPolicy`` placements and the run config's
    ``offload`` keys. The one place a placement is named is its kind's registration; a kind
    sharing another's placement (a bounded window of K/V: ``attention``) adds none."""
    return tuple(dict.fromkeys(k.offload for k in kinds()))
