"""Adapters chosen by ``config.model_type``, and the model families they declare.

Every family is one adapter module (``_FAMILY_MODULES``) whose adapter class carries a
``ModelFamily`` (``model_adapters.family``). The tables the rest of LongStraw reads are built
here from those declarations: ``default_lora_targets``, ``tiny_configs``, ``presets``,
``layer_kinds`` (``longstraw_core.config.DEFAULT_LORA_TARGETS``,
``longstraw_core.tiny_models.TINY_CONFIGS``, ``longstraw_core.plan.PRESETS`` and
``longstraw_core.offload.LAYER_TYPES`` are views of them). This module imports no adapter at
import time; the table functions import the family modules first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, TypeVar

from torch import nn

if TYPE_CHECKING:
    from model_adapters.base import ModelAdapter
    from model_adapters.family import ModelFamily, Preset

AdapterClass = TypeVar("AdapterClass", bound="type[ModelAdapter]")

# The adapter modules of the shipped families, in the order their tables list them.
_FAMILY_MODULES = ("model_adapters.dense", "model_adapters.qwen36", "model_adapters.glm52")

_ADAPTERS: dict[str, type[ModelAdapter]] = {}
_FAMILIES: list[ModelFamily] = []  # registration order
_MODULE_OF: dict[str, str] = {}  # family name -> its adapter's module
_version = 0


def register_adapter(cls: AdapterClass) -> AdapterClass:
    """Class decorator: make ``cls`` the adapter for each model type of its ``family``."""
    global _version
    family = cls.family
    if tuple(cls.model_types) != tuple(family.model_types):
        raise ValueError(
            f"{cls.__name__}.model_types {cls.model_types} differ from its family's "
            f"{family.model_types}"
        )
    for model_type in family.model_types:
        if model_type in _ADAPTERS and _ADAPTERS[model_type] is not cls:
            raise ValueError(
                f"model_type {model_type!r} already has adapter {_ADAPTERS[model_type].__name__}"
            )
    if family not in _FAMILIES:
        _check_new_family(family)
        _FAMILIES.append(family)
        _MODULE_OF[family.name] = cls.__module__
    for model_type in family.model_types:
        _ADAPTERS[model_type] = cls
    _version += 1
    return cls


def _check_new_family(family: ModelFamily) -> None:
    """No two families may claim the same family name, preset name or layer kind placement."""
    for other in _FAMILIES:
        if other.name == family.name:
            raise ValueError(f"model family {family.name!r} is already registered")
        clash = sorted(set(other.presets) & set(family.presets))
        if clash:
            raise ValueError(f"presets {clash} of family {family.name!r} exist in {other.name!r}")
        for kind, field in family.layer_kinds.items():
            if other.layer_kinds.get(kind, field) != field:
                raise ValueError(
                    f"layer kind {kind!r}: family {family.name!r} places it by {field!r}, "
                    f"family {other.name!r} by {other.layer_kinds[kind]!r}"
                )


def version() -> int:
    """Bumped by each registration (``RegistryView`` rebuilds its table when it changes)."""
    return _version


def families() -> tuple[ModelFamily, ...]:
    """Every registered family: the shipped ones in ``_FAMILY_MODULES`` order, then others in
    registration order."""
    for module in _FAMILY_MODULES:
        importlib.import_module(module)
    order = {module: index for index, module in enumerate(_FAMILY_MODULES)}
    return tuple(
        sorted(_FAMILIES, key=lambda f: order.get(_MODULE_OF[f.name], len(_FAMILY_MODULES)))
    )


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


def layer_kinds() -> dict[str, str]:
    """Record kind -> the ``OffloadPolicy`` field placing it, sorted by kind."""
    kinds = {k: v for f in families() for k, v in f.layer_kinds.items()}
    return dict(sorted(kinds.items()))


def supported_model_types() -> list[str]:
    families()
    return sorted(_ADAPTERS)


def adapt(model: nn.Module) -> ModelAdapter:
    """The adapter for a transformers causal LM (plain or PEFT-wrapped), by its model type."""
    from model_adapters.base import unwrap_causal_lm

    families()
    model_type = unwrap_causal_lm(model).config.model_type
    adapter_class = _ADAPTERS.get(model_type)
    if adapter_class is None:
        raise ValueError(
            f"no LongStraw adapter for model_type {model_type!r}; supported model types: "
            f"{', '.join(supported_model_types())}"
        )
    return adapter_class(model)
