"""Exact gradients through the prompt: the state gradient ``dS`` and the reverse chunk sweep.

Detached mode treats the prefix state as a constant. The full objective also depends on the
parameters through the prompt's own keys, values and recurrent states. Exact mode recovers
those paths without a graph over the prompt (``docs/design.md``, "Exact mode"):

1. A gradient buffer shaped like the state (``StateGrad``). Every branch's backward adds
   ``dL/dstate`` into it: attention through ``segmented_attention``'s ``prefix_grads``
   sinks (block by block, no state-sized temporary), small tensors through
   ``attach_grad_sink``.
2. After the last branch, a reverse sweep over the prefill chunks: chunk ``k`` is recomputed
   with autograd from the stored state before it, and backpropagated with the accumulated
   ``dS`` of the state it produced. Its reads of earlier state add into ``dS`` of earlier
   positions, which later iterations consume. Parameter gradients accumulate in ``.grad``.

Records take part through views: ``exact_state(state, grad, produced)`` returns a shadow
``PrefixState`` whose layers are views (``AttentionKVExactView``, ``RecurrentExactView``,
``LatentKVExactView``, chosen by record class in ``VIEW_FACTORIES``) with the record's
read/write interface. They read the stored values and route gradients into ``grad``; with a
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
from torch.autograd.function import FunctionCtx, once_differentiable

from longstraw_core.attention import AttentionOutput
from longstraw_core.state import AttentionKV, LatentKV, PrefixState, RecurrentState

# (tensor produced by a recomputed chunk, gradient to backpropagate into it)
Produced = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class AttentionKVGrad:
    """``dL/dK`` and ``dL/dV`` of one full-attention layer's prefix, ``[kv_heads, L, dim]``."""

    keys: torch.Tensor
    values: torch.Tensor

    @classmethod
    def zeros_like(cls, record: AttentionKV, dtype: torch.dtype) -> AttentionKVGrad:
        length = record.length
        return cls(
            record.keys.new_zeros(record.keys[:, :length].shape, dtype=dtype),
            record.values.new_zeros(record.values[:, :length].shape, dtype=dtype),
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))


class AttentionKVExactView:
    """An ``AttentionKV`` as exact mode sees it: gradients of reads go into ``grad``.

    ``home`` is the record itself, also when ``record`` is a streamed copy of it (CPU
    offload): the attention outputs prefill kept are read from there, one chunk at a time.
    """

    def __init__(
        self,
        record: AttentionKV,
        grad: AttentionKVGrad,
        produced: Produced | None,
        home: AttentionKV | None = None,
    ):
        self.record, self.grad, self.produced = record, grad, produced
        self.home = record if home is None else home

    def with_record(self, record: AttentionKV) -> AttentionKVExactView:
        """The same view reading ``record`` (a streamed copy of this one's)."""
        return AttentionKVExactView(record, self.grad, self.produced, self.home)

    @property
    def length(self) -> int:
        return self.record.length

    def segments(self, end: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.record.segments(end)

    @property
    def keeps_outputs(self) -> bool:
        return False  # a view never stores; the record kept what prefill computed

    def output_for(self, start: int, length: int) -> AttentionOutput | None:
        """During recompute: the prefill's attention output for this chunk, if kept, on the
        device the chunk computes on."""
        if self.produced is None:
            return None
        return self.home.output_for(start, length, device=self.record.keys.device)

    def grad_segments(self, end: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        end = self.record.length if end is None else end
        return [(self.grad.keys[:, :end], self.grad.values[:, :end])] if end else []

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """During recompute: hand the chunk's keys/values and their ``dS`` to the sweep."""
        if self.produced is None:
            raise RuntimeError("a branch must not write into the prefix state")
        end = start + keys.shape[1]
        self.produced.append((keys, _grad_like(self.grad.keys[:, start:end], keys)))
        self.produced.append((values, _grad_like(self.grad.values[:, start:end], values)))


@dataclass
class RecurrentStateGrad:
    """``dL/d(conv, recurrent)`` of one linear-attention layer at the current chunk boundary.

    During the sweep it holds the gradient of the state at the end of the chunk being
    recomputed; that chunk's backward replaces it with the gradient at the chunk's start.
    """

    conv: torch.Tensor
    recurrent: torch.Tensor

    @classmethod
    def zeros_like(cls, record: RecurrentState, dtype: torch.dtype) -> RecurrentStateGrad:
        return cls(
            record.conv.new_zeros(record.conv.shape, dtype=dtype),
            record.recurrent.new_zeros(record.recurrent.shape, dtype=dtype),
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))


class RecurrentExactView:
    """A ``RecurrentState`` as exact mode sees it.

    Reads attach gradient sinks to the state they return: the final state for a branch, the
    checkpoint at the chunk's start during recompute. A recomputed chunk's ``update`` hands
    the state it produced to the sweep with the accumulated gradient, then clears the buffer
    for the gradient of the chunk's start, which that chunk's backward fills.
    """

    def __init__(self, record: RecurrentState, grad: RecurrentStateGrad, produced: Produced | None):
        self.record, self.grad, self.produced = record, grad, produced

    def with_record(self, record: RecurrentState) -> RecurrentExactView:
        """The same view reading ``record`` (a streamed copy of this one's)."""
        return RecurrentExactView(record, self.grad, self.produced)

    @property
    def length(self) -> int:
        return self.record.length

    def read(self, start: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.produced is None and start is not None:
            raise RuntimeError("a branch reads the state after the whole prompt (start=None)")
        conv, recurrent = self.record.read(start)
        return attach_grad_sink(conv, self.grad.conv), attach_grad_sink(
            recurrent, self.grad.recurrent
        )

    def update(self, start: int, length: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        if self.produced is None:
            raise RuntimeError("a branch must not write into the prefix state")
        for output, buffer in ((conv, self.grad.conv), (recurrent, self.grad.recurrent)):
            self.produced.append((output, _grad_like(buffer, output)))
            buffer.zero_()


@dataclass
class LatentKVGrad:
    """``dL/dlatent`` of one MLA layer's prefix, ``[L, kv_lora_rank + rope_dim]``.

    The DSA indexer keys get no buffer: the indexer runs without autograd (as in
    transformers), so no gradient flows to or through them.
    """

    latent: torch.Tensor

    @classmethod
    def zeros_like(cls, record: LatentKV, dtype: torch.dtype) -> LatentKVGrad:
        return cls(record.latent.new_zeros(record.latent[: record.length].shape, dtype=dtype))

    def nbytes(self) -> int:
        return self.latent.numel() * self.latent.element_size()


class LatentKVExactView:
    """A ``LatentKV`` as exact mode sees it: gradients of latent reads go into ``grad``.

    Reads return the stored tensors; ``latent_grad`` hands the attention the buffer slice
    its backward adds the prefix gradient into (no state-sized temporary). During recompute
    a chunk's ``write`` hands its latent (with its graph) and ``dS`` slice to the sweep; its
    index keys carry no gradient and are dropped (the stored ones are the same values).
    """

    def __init__(self, record: LatentKV, grad: LatentKVGrad, produced: Produced | None):
        self.record, self.grad, self.produced = record, grad, produced

    def with_record(self, record: LatentKV) -> LatentKVExactView:
        """The same view reading ``record`` (a streamed copy of this one's)."""
        return LatentKVExactView(record, self.grad, self.produced)

    @property
    def length(self) -> int:
        return self.record.length

    def latent_prefix(self, end: int) -> torch.Tensor:
        return self.record.latent_prefix(end)

    def index_key_prefix(self, end: int) -> torch.Tensor | None:
        return self.record.index_key_prefix(end)

    def latent_grad(self, end: int) -> torch.Tensor:
        return self.grad.latent[:end]

    def write(self, start: int, latent: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        """During recompute: hand the chunk's latent and its ``dS`` to the sweep."""
        if self.produced is None:
            raise RuntimeError("a branch must not write into the prefix state")
        end = start + latent.shape[0]
        self.produced.append((latent, _grad_like(self.grad.latent[start:end], latent)))


def _grad_like(grad: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """A copy of ``dS`` for ``output``: its dtype, and its device (``dS`` of an offloaded
    record is in CPU memory while the recomputed chunk runs on the device)."""
    return grad.to(device=output.device, dtype=output.dtype, copy=True)


# Each record kind's gradient buffer and exact-mode view, by record class.
GRAD_FACTORIES: dict[type, object] = {
    AttentionKV: AttentionKVGrad.zeros_like,
    RecurrentState: RecurrentStateGrad.zeros_like,
    LatentKV: LatentKVGrad.zeros_like,
}
VIEW_FACTORIES: dict[type, object] = {
    AttentionKV: AttentionKVExactView,
    RecurrentState: RecurrentExactView,
    LatentKV: LatentKVExactView,
}


@dataclass
class StateGrad:
    """``dS``: one gradient record per layer of a ``PrefixState``."""

    layers: list
    owner: str
    length: int

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


def new_state_grad(state: PrefixState, dtype: torch.dtype | None = None) -> StateGrad:
    """Zero ``dS`` for ``state``, accumulated in ``dtype`` (default: float32 or wider)."""
    if state.needs_checkpoints():
        raise ValueError(
            "exact gradients through recurrent layers need their state at every chunk start: "
            "prefill with adapter.prefill(..., checkpoints='device') (or 'cpu')"
        )
    layers = []
    for record in state.layers:
        factory = GRAD_FACTORIES.get(type(record))
        if factory is None:
            raise NotImplementedError(
                f"exact gradients are not implemented for {type(record).__name__} records"
            )
        record_dtype = _record_dtype(record)
        layers.append(factory(record, dtype or torch.promote_types(record_dtype, torch.float32)))
    return StateGrad(layers=layers, owner=state.owner, length=state.length)


def _record_dtype(record: object) -> torch.dtype:
    for value in vars(record).values():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.dtype
    return torch.float32


def exact_state(state: PrefixState, grad: StateGrad, produced: Produced | None) -> PrefixState:
    """A shadow of ``state`` whose records route gradients into ``grad``.

    With ``produced`` (recompute), writes are collected with their ``dS`` instead of stored.
    """
    if grad.owner != state.owner or grad.length != state.length:
        raise ValueError("state_grad was made for another state; use new_state_grad(state)")
    views = [
        VIEW_FACTORIES[type(record)](record, layer_grad, produced)
        for record, layer_grad in zip(state.layers, grad.layers, strict=True)
    ]
    return dataclasses.replace(state, layers=views)


class _GradSink(torch.autograd.Function):
    """Identity on ``x`` whose backward adds the incoming gradient into ``sink``."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, sink: torch.Tensor, anchor: torch.Tensor
    ) -> torch.Tensor:
        ctx.sink = sink
        return x.view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        ctx.sink += grad.to(device=ctx.sink.device, dtype=ctx.sink.dtype)
        return None, None, grad.new_zeros(0)


def attach_grad_sink(x: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """``x`` as part of the graph: gradients reaching it are added into ``sink``.

    For small state (recurrent states, conv windows): no leaf, no ``.grad`` bookkeeping.
    """
    # NOTE: an empty anchor that requires grad makes the output part of the graph even
    # though ``x`` itself is a constant; its own gradient is an empty tensor.
    anchor = torch.empty(0, device=x.device, dtype=x.dtype, requires_grad=True)
    return _GradSink.apply(x.detach(), sink, anchor)
