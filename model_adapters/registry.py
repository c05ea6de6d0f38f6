"""Adapters chosen by ``config.model_type``."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from torch import nn

if TYPE_CHECKING:
    from model_adapters.base import ModelAdapter

AdapterClass = TypeVar("AdapterClass", bound="type[ModelAdapter]")

_ADAPTERS: dict[str, type[ModelAdapter]] = {}


def register_adapter(cls: AdapterClass) -> AdapterClass:
    """Class decorator: make ``cls`` the adapter for each of its ``model_types``."""
    for model_type in cls.model_types:
        if model_type in _ADAPTERS and _ADAPTERS[model_type] is not cls:
            raise ValueError(
                f"model_type {model_type!r} already has adapter {_ADAPTERS[model_type].__name__}"
            )
        _ADAPTERS[model_type] = cls
    return cls


def supported_model_types() -> list[str]:
    return sorted(_ADAPTERS)


def adapt(model: nn.Module) -> ModelAdapter:
    """The adapter for a transformers causal LM (plain or PEFT-wrapped), by its model type."""
    from model_adapters.base import unwrap_causal_lm

    model_type = unwrap_causal_lm(model).config.model_type
    adapter_class = _ADAPTERS.get(model_type)
    if adapter_class is None:
        raise ValueError(
            f"no LongStraw adapter for model_type {model_type!r}; supported model types: "
            f"{', '.join(supported_model_types())}"
        )
    return adapter_class(model)
