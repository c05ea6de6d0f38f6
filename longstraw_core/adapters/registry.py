"""Adapters chosen by ``config.model_type``, and the model families they declare.

Families plug in: each family module (the shipped ones in ``model_adapters/``, or a package of
one's own) registers its adapter class with ``@register_adapter``, the class carrying a
``ModelFamily`` (``longstraw_core.adapters.family``). The core never imports a family by name:
it finds them through the ``longstraw.families`` entry points of the installed distributions
(``pyproject.toml`` names ``model_adapters``, which imports the shipped three in the order
their tables list them), loaded the first time a table or an adapter is asked for. A family
imported directly (a test's, a user's) registers when its module loads.

The tables the rest of LongStraw reads are built here from those declarations:
``default_lora_targets``, ``tiny_configs``, ``presets``, ``kernel_budget``. The layer kinds
are not a family's: each declares itself (``longstraw_core.kinds.registry``); a family's
``layer_kinds`` must name registered kinds.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any, TypeVar

from longstraw_core.adapters.family import ModelFamily, Preset
from longstraw_core.kinds import registry as kinds

# An adapter class (a ``ModelAdapter`` subclass: typed loosely so that this module, which
# the offload policy and the config read, imports nothing that imports them back).
AdapterClass = TypeVar("AdapterClass", bound=type)

ENTRY_POINT_GROUP = "longstraw.families"

_ADAPTERS: dict[str, type] = {}
_FAMILIES: list[ModelFamily] = []  # registration order
_version = 0
_loaded = False


def register_adapter(cls: AdapterClass) -> AdapterClass:
    """Class decorator: make ``cls`` the adapter for each model type of its ``family``."""
    global _version
    family = cls.family
    for model_type in family.model_types:
        if model_type in _ADAPTERS and _ADAPTERS[model_type] is not cls:
            raise ValueError(
                f"model_type {model_type!r} already has adapter {_ADAPTERS[model_type].__name__}"
            )
    if family not in _FAMILIES:
        _check_new_family(family)
        _FAMILIES.append(family)
    for model_type in family.model_types:
        _ADAPTERS[model_type] = cls
    _version += 1
    return cls


def unregister_adapter(cls: type) -> None:
    """Undo ``register_adapter(cls)``: its model types and family leave the tables. For a
    family registered only for a while (a test's throwaway one)."""
    global _version
    for model_type in cls.family.model_types:
        if _ADAPTERS.get(model_type) is cls:
            del _ADAPTERS[model_type]
    if cls.family in _FAMILIES and cls not in _ADAPTERS.values():
        _FAMILIES.remove(cls.family)
    _version += 1


def _check_new_family(family: ModelFamily) -> None:
    """No two families may claim the same family name or preset name; the layer kinds a
    family names are registered (each declares its own placement)."""
    for name in family.layer_kinds:
        try:
            kinds.kind(name)
        except KeyError as exc:
            raise ValueError(f"family {family.name!r}: {exc.args[0]}") from None
    for other in _FAMILIES:
        if other.name == family.name:
            raise ValueError(f"model family {family.name!r} is already registered")
        clash = sorted(set(other.presets) & set(family.presets))
        if clash:
            raise ValueError(f"presets {clash} of family {family.name!r} exist in {other.name!r}")


def version() -> int:
    """Bumped by each registration: a table built from the families is stale when it moves."""
    return _version


def load_families() -> None:
    """Import every family module the ``longstraw.families`` entry points name (once)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    found = entry_points(group=ENTRY_POINT_GROUP)
    if not found:
        raise RuntimeError(
            f"no model families: no installed distribution declares {ENTRY_POINT_GROUP!r} "
            "entry points; install LongStraw (`pip install -e .` in its checkout, or "
            "`make test`) so its metadata names model_adapters' families"
        )
    for entry in found:
        entry.load()


def families() -> tuple[ModelFamily, ...]:
    """Every registered family, in registration order."""
    load_families()
    return tuple(_FAMILIES)


def family_of(model_type: str) -> ModelFamily | None:
    """The family serving ``model_type`` (None: no adapter)."""
    return next((f for f in families() if model_type in f.model_types), None)


def default_lora_targets() -> dict[str, list[str]]:
    """``config.model_type`` -> LoRA targets when ``lora.target_modules`` is null."""
    return {k: v for f in families() for k, v in f.lora_targets.items()}


def tiny_configs() -> dict[str, dict[str, Any]]:
    """``config.model_type`` -> transformers config kwargs of its toy model."""
    return {k: v for f in families() for k, v in f.tiny_configs.items()}


def presets() -> dict[str, Preset]:
    """Preset name -> the paper-scale model the planner knows by that name."""
    return {k: v for f in families() for k, v in f.presets.items()}


def supported_model_types() -> list[str]:
    """Every ``config.model_type`` some registered family serves, sorted (the one list:
    ``longstraw_core.supported_model_types`` is this)."""
    families()
    return sorted(_ADAPTERS)


def adapter_class(model_type: str) -> type | None:
    """The adapter class registered for ``model_type`` (None: none is)."""
    load_families()
    return _ADAPTERS.get(model_type)


def kernel_budget(name: str, device_type: str) -> int:
    """The block budget ``name`` of a family's own kernel on a ``device_type`` device, as the
    family declares it now (``ModelFamily.kernel_budgets``)."""
    for family in families():
        budgets = family.kernel_budgets(device_type) if family.kernel_budgets else {}
        if name in budgets:
            return budgets[name]
    raise KeyError(f"no registered model family declares the kernel budget {name!r}")
