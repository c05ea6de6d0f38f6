"""The reference policy for the KL term (``beta > 0``).

With LoRA the natural reference is the same model with its adapters switched off: no second
copy of the weights. ``lora_reference(adapter)`` gives an object with the adapter's
``prefill``/``score`` that runs them under peft's ``disable_adapter()``. A separately loaded
frozen model works too: ``ls.adapt(reference_model)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from peft import PeftModel

from longstraw_core.state import PrefixState
from model_adapters.base import ModelAdapter


class LoraDisabledReference:
    """``adapter`` with its PEFT adapters disabled while it prefills and scores."""

    def __init__(self, adapter: ModelAdapter) -> None:
        if not isinstance(adapter.model, PeftModel):
            raise ValueError(
                "lora_reference needs an adapter of a peft model (peft.get_peft_model); for a "
                "fully fine-tuned policy pass ref_adapter=ls.adapt(frozen_reference_model)"
            )
        self.adapter = adapter

    def prefill(
        self, prompt_ids: torch.Tensor | Sequence[int], chunk_size: int = 4096, **kwargs
    ) -> PrefixState:
        with self.adapter.model.disable_adapter():
            return self.adapter.prefill(prompt_ids, chunk_size=chunk_size, **kwargs)

    def score(self, state: PrefixState, response_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        with self.adapter.model.disable_adapter():
            return self.adapter.score(state, response_ids)


def lora_reference(adapter: ModelAdapter) -> LoraDisabledReference:
    """The reference policy of a LoRA run: the same weights, adapters disabled."""
    return LoraDisabledReference(adapter)
