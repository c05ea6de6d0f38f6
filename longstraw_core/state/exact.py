"""Exact gradients through the prompt: the state gradient ``dS`` and the reverse chunk sweep.

Detached mode treats the prefix state as a constant. The full objective also depends on the
parameters through the prompt's own keys, values and recurrent states. Exact mode recovers
those paths without a graph over the prompt (``docs/design.md``, "Exact mode"):

1. A gradient buffer shaped like the state (``StateGrad``: per layer, the buffer its
   record's ``new_grad`` makes). Every branch's backward adds
   ``dL/dstate`` into it: attention through ``segmented_attention``'s ``prefix_grads``
   sinks (block by block, no state-sized temporary), small tensors through
   ``kinds.base.attach_grad_sink``.
2. After the last branch, a reverse sweep over the prefill chunks: chunk ``k`` is recomputed
   with autograd from the stored state before it, and backpropagated with the accumulated
   ``dS`` of the state it produced. Its reads of earlier state add into ``dS`` of earlier
   positions, which later iterations consume. Parameter gradients accumulate in ``.grad``.

Records take part through views: ``exact_state(state, grad, produced)`` returns a shadow
``PrefixState`` whose layers are views (``AttentionKVExactView``, ``RecurrentExactView``,
``LatentKVExactView``, each made by its record's ``exact_view`` and defined with the record
in its kind's module, ``longstraw_core.kinds``) with the record's read/write interface. They read the stored values and route gradients into ``grad``; with a
``produced`` list (the sweep's recompute) a chunk's writes are collected there, with their
graph and their ``dS`` slice, instead of being stored; without one (branch replay) a write
raises. Adapters therefore run the same code in prefill, branch replay and recompute.

Offloaded records (``longstraw_core.offload``) get their ``dS`` beside them, in CPU memory:
the sinks add each block's gradient across devices, and a view's ``with_record`` makes it
read a streamed device copy while its gradients still go into the CPU buffer. What a
recomputed chunk hands to the sweep is moved to the device its outputs are on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from longstraw_core.kinds.base import GradBuffer, Produced
from longstraw_core.state.prefix import PrefixState

__all__ = [
    "StateGrad",
    "exact_state",
    "gradient_dtype",
    "new_state_grad",
]


@dataclass
class StateGrad:
    """``dS``: one gradient record per layer of a ``PrefixState``."""

    layers: list[GradBuffer]
    owner: str
    length: int

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


def new_state_grad(state: PrefixState, dtype: torch.dtype | None = None) -> StateGrad:
    """Zero ``dS`` for ``state``, accumulated in ``dtype`` (default: float32 or wider)."""
    lacking = state.lacking_checkpoints()
    if lacking:
        raise ValueError(
            f"exact gradients through {' and '.join(lacking)} layers need their state at every "
            "chunk start, which this state was prefilled without: prefill with "
            "adapter.prefill(..., checkpoints='device') (or 'cpu')"
        )
    layers: list[GradBuffer] = [
        record.new_grad(dtype or gradient_dtype(record)) for record in state.layers
    ]
    return StateGrad(layers=layers, owner=state.owner, length=state.length)


def gradient_dtype(record: object) -> torch.dtype:
    """What ``dS`` accumulates in for ``record``: its floating dtype, at least float32."""
    stored = next(
        (v.dtype for v in vars(record).values() if torch.is_tensor(v) and v.is_floating_point()),
        torch.float32,
    )
    return torch.promote_types(stored, torch.float32)


def exact_state(state: PrefixState, grad: StateGrad, produced: Produced | None) -> PrefixState:
    """A shadow of ``state`` whose records route gradients into ``grad``.

    With ``produced`` (recompute), writes are collected with their ``dS`` instead of stored.
    """
    if grad.owner != state.owner or grad.length != state.length:
        raise ValueError("state_grad was made for another state; use new_state_grad(state)")
    views = [
        record.exact_view(layer_grad, produced)
        for record, layer_grad in zip(state.layers, grad.layers, strict=True)
    ]
    return dataclasses.replace(state, layers=views)
