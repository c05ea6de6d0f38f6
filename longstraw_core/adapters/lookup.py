"""``adapt``: the registered adapter for a model, chosen by its ``config.model_type``."""

from __future__ import annotations

from torch import nn

from longstraw_core.adapters import registry
from longstraw_core.adapters.base import ModelAdapter, unwrap_causal_lm
from longstraw_core.adapters.registry import supported_model_types


def adapt(model: nn.Module) -> ModelAdapter:
    """The adapter for a transformers causal LM (plain or PEFT-wrapped), by its model type."""
    model_type = unwrap_causal_lm(model).config.model_type
    adapter_class = registry.adapter_class(model_type)
    if adapter_class is None:
        raise ValueError(
            f"no LongStraw adapter for model_type {model_type!r}; supported model types: "
            f"{', '.join(supported_model_types())}"
        )
    return adapter_class(model)
