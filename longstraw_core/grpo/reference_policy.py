"""The reference policy for the KL term (``beta > 0``).

With LoRA the natural reference is the same model with its adapters switched off: no second
copy of the weights. ``lora_reference(adapter)`` gives an object with the adapter's
``prefill``/``score`` that runs them under peft's ``disable_adapter()``. A separately loaded
frozen model works too: ``ls.adapt(reference_model)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from longstraw_core.adapters.base import Item, ModelAdapter
from longstraw_core.state.prefix import PrefixState
from longstraw_core.tensors.peft_types import is_peft_model


class LoraDisabledReference:
    """``adapter`` with its PEFT adapters disabled while it prefills and scores."""

    def __init__(self, adapter: ModelAdapter) -> None:
        if not is_peft_model(adapter.model):
            raise ValueError(
                "lora_reference needs an adapter of a peft model (peft.get_peft_model); for a "
                "fully fine-tuned policy pass ref_adapter=ls.adapt(frozen_reference_model)"
            )
        self.adapter = adapter

    def prefill(
        self, prompt_ids: torch.Tensor | Sequence[int], chunk_size: int = 4096, **kwargs
    ) -> PrefixState:
        with self._adapters_off():
            return self.adapter.prefill(prompt_ids, chunk_size=chunk_size, **kwargs)

    def score(
        self,
        state: PrefixState,
        response_ids: torch.Tensor | Sequence[int],
        *,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """The adapter's ``score`` (at ``temperature``) with the adapters off."""
        with self._adapters_off():
            return self.adapter.score(state, response_ids, temperature=temperature)

    @contextmanager
    def _adapters_off(self) -> Iterator[None]:
        """peft's ``disable_adapter()``, entered and left with every parameter sharded.

        peft switches the adapters' ``requires_grad`` off and back on. A sharded model reads
        ``requires_grad`` from its sharded parameters, so the switch must reach those, not
        the gathered copies FSDP may still hold (the root's, the last layer's); otherwise
        those adapters would stay frozen. No-op in one process.
        """
        self.adapter.release_parameters()
        with self.adapter.model.disable_adapter():
            try:
                yield
            finally:
                self.adapter.release_parameters()

    def in_step(self, items: Sequence[Item]) -> Iterator[Item | None]:
        """The adapter's ``in_step``: the same parameters, the same ranks to keep in step."""
        return self.adapter.in_step(items)

    def idle_forward(self) -> None:
        """The adapter's ``idle_forward``, with the releases of ``score`` around it (they
        decide what the next pass gathers, which must match across ranks)."""
        with self._adapters_off():
            self.adapter.idle_forward()


def lora_reference(adapter: ModelAdapter) -> LoraDisabledReference:
    """The reference policy of a LoRA run: the same weights, adapters disabled."""
    return LoraDisabledReference(adapter)
