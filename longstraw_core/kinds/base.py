"""What every layer kind shares: the contracts adapters and the engine call, and helpers.

A layer kind (``docs/design.md``, "Prefix state per layer kind") is one module of this
package holding four classes: the prefix **record** (``LayerState``), the **branch record**
rollout decodes into (``BranchState``), exact mode's **gradient buffer** (``GradBuffer``,
``dS`` of one layer) and its **exact view** (``ExactView``). The record makes the other
three itself (``new_branch``, ``new_grad``, ``exact_view``), so nothing elsewhere chooses
by record class.

The protocols below name every method called from outside a kind's module:

- ``LayerState``: what ``PrefixState``, ``longstraw_core.state.exact``, ``longstraw_core.offload``
  and ``longstraw_core.adapters.base`` call on any record, whatever its kind (``RecordBase`` gives
  the defaults a kind without checkpoints, kept outputs or a compressed form inherits).
- ``AttentionReads``, ``RecurrentReads``, ``LatentReads``: what the adapter of that kind
  calls on the layer it is handed by ``ModelAdapter.layer_records``. The record, its exact
  view, the offload stream's ``StreamedRecord`` and activation checkpointing's
  ``LayerRecord`` all answer them, so adapters run the same code in every pass.
- ``ExactView``: what the engine calls on an exact view besides the kind's reads
  (``ExactViewBase`` implements it).
- ``GradBuffer``, ``BranchState``: what is called on a gradient buffer and a branch record.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from longstraw_core.kinds.forwarding import StreamedRecord
from longstraw_core.tensors.device_copy import copy_rows

if TYPE_CHECKING:
    from longstraw_core.attention import AttentionOutput


class Seed:
    """The gradient to backpropagate into a tensor a recomputed chunk wrote: its ``dS``,
    read when the chunk's backward runs (``resolve``), not when the chunk was recomputed.

    On one rank the two follow each other. On a pipeline stage a chunk may be recomputed
    before the backward of the chunk after it has added its share into this chunk's ``dS``
    (the sweep's 1F1B schedule runs forwards ahead), so the value is read as late as it can.
    ``clear``: zero the buffer once read (a recurrent record's one boundary buffer, which the
    chunk's own backward then fills with the gradient of its start).
    """

    def __init__(self, buffer: torch.Tensor, like: torch.Tensor, clear: bool = False) -> None:
        self.buffer, self.like, self.clear = buffer, like, clear

    @property
    def used(self) -> bool:
        """Whether anything read what the chunk wrote (a backward seeds only then)."""
        return True

    def resolve(self) -> torch.Tensor:
        grad = grad_like(self.buffer, self.like)
        if self.clear:
            self.buffer.zero_()
        return grad


# (tensor produced by a recomputed chunk, its gradient when the chunk's backward runs)
Produced = list[tuple[torch.Tensor, Seed]]


# --- the contracts --------------------------------------------------------------------------


class GradBuffer(Protocol):
    """Exact mode's ``dS`` of one layer (``LayerState.new_grad``)."""

    def nbytes(self) -> int: ...


class Pieces(Protocol):
    """One layer's share of a branch replayed in pieces (``LayerState.new_pieces``): each
    piece's forward reads what the earlier pieces wrote, as leaves whose gradients become
    the seeds of those pieces' backwards (run later, last piece first), as exact mode's
    sweep seeds a prompt chunk with ``dS``."""

    def piece(self, produced: Produced) -> Any:
        """The branch record the next piece's forward runs with (pieces run in order): the
        kind's branch interface (``append``, or the recurrent ``conv``/``recurrent``/
        ``update``); what the piece writes goes into ``produced`` with its seed."""


class BranchState(Protocol):
    """What ``B`` branches decoded from one prefix record hold of their own
    (``LayerState.new_branch``). Growing kinds add ``append``, recurrent ones ``update``."""

    kind: ClassVar[str]

    def nbytes(self) -> int: ...

    def narrow(self, start: int, stop: int) -> BranchState:
        """Branches ``start..stop`` as records of their own whose every write lands in these
        (rollout prefills an answer for one branch without the others' rows)."""
        ...


class LayerState(Protocol):
    """One layer's share of the prefix state: the calls every kind answers."""

    kind: ClassVar[str]  # the record kind: ``OffloadPolicy`` and ``summary()`` key on it
    grows_with_prompt: ClassVar[bool]
    # Whether its records can keep each prefill chunk's attention output for exact mode's
    # sweep (``keeps_outputs``, set by ``PrefixState.keep_attention_outputs``).
    can_keep_outputs: ClassVar[bool]
    length: int  # prompt positions stored so far

    def nbytes(self) -> int:
        """Bytes of the stored state (valid positions; checkpoints and outputs not counted)."""

    def window(self, position: int | None) -> LayerState:
        """Views of what a pass starting at ``position`` (``None``: after the prompt) reads,
        a record of the same class (``longstraw_core.offload`` copies its tensors)."""

    def to(self, device: torch.device | str, non_blocking: bool = False) -> LayerState: ...

    def new_branch(
        self, batch: int, capacity: int, device: torch.device | None = None
    ) -> BranchState:
        """Empty per-branch records for ``batch`` branches of up to ``capacity`` positions."""

    def new_grad(self, dtype: torch.dtype) -> GradBuffer:
        """Exact mode's zero ``dS`` for this record, in ``dtype``, beside the record."""

    def new_pieces(self, device: torch.device) -> Pieces:
        """What one branch replayed in pieces with autograd keeps of this layer between its
        pieces (pipeline replay), computing on ``device``."""

    def exact_view(self, grad: GradBuffer, produced: Produced | None) -> ExactView:
        """This record as exact mode reads it: gradients of reads go into ``grad``; with
        ``produced`` (the sweep's recompute) writes are handed there instead of stored."""

    def with_record(self, copy: LayerState) -> LayerState:
        """This layer reading ``copy`` (the offload stream's device copy of its ``window``)
        while its writes still go into this record."""

    def reading(self) -> LayerState:
        """The record whose tensors this layer's reads return (itself for a record)."""

    def checkpoint_nbytes(self) -> int:
        """Bytes of state kept at chunk starts for exact mode (0 for kinds without)."""

    def output_nbytes(self) -> int:
        """Bytes of attention outputs kept for exact mode's sweep (0 for kinds without)."""

    def summary_bytes(self) -> dict[str, int]:
        """Extra byte counts ``PrefixState.summary()`` adds to this kind's row."""

    def keep_checkpoints(self, device: torch.device) -> None:
        """Keep the state at every chunk start on ``device`` (no-op for kinds without)."""

    def needs_checkpoints(self) -> bool:
        """Whether exact mode needs chunk-start state this record did not keep."""


class ExactView(Protocol):
    """An exact-mode view (``LayerState.exact_view``), besides its kind's reads."""

    record: Any  # the record it reads (``None`` once the offload stream released it)
    grad: GradBuffer
    produced: Produced | None

    @property
    def length(self) -> int: ...

    def with_record(self, copy: LayerState) -> ExactView:
        """The same view reading ``copy`` (a streamed copy of its record)."""

    def reading(self) -> LayerState:
        """The record it reads."""

    def release(self) -> None:
        """Drop its reference to a streamed copy (the offload stream moved on)."""


class AttentionReads(Protocol):
    """What the full-attention code (``model_adapters/dense.py``) calls on its layer."""

    length: int
    keeps_outputs: bool

    def segments(self, end: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Key/value segments of positions ``[0, end)`` for ``segmented_attention``."""

    def grad_segments(
        self, end: int | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Where backward adds the prefix gradient of ``segments(end)`` (exact views only)."""

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store (or, recomputed, hand to the sweep) one prefill chunk's keys and values."""

    def output_for(self, start: int, length: int) -> AttentionOutput | None:
        """A kept attention output of a prefill chunk, for the sweep's recompute."""

    def write_output(self, start: int, output: AttentionOutput) -> None:
        """Keep one prefill chunk's attention output (when ``keeps_outputs``)."""


class RecurrentReads(Protocol):
    """What the Gated DeltaNet code (``model_adapters/qwen36.py``) calls on its layer."""

    length: int

    def read(self, start: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv, recurrent)`` at position ``start`` (``None``: after the whole prompt)."""

    def update(self, start: int, length: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Fold (or, recomputed, hand to the sweep) one prefill chunk's final states."""


class LatentReads(Protocol):
    """What the MLA + DSA code (``model_adapters/glm52.py``) calls on its layer."""

    length: int

    def write(self, start: int, latent: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        """Store (or, recomputed, hand to the sweep) one prefill chunk's latent/index keys."""

    def latent_prefix(self, end: int) -> torch.Tensor:
        """The latent of positions ``[0, end)``."""

    def index_key_prefix(self, end: int) -> torch.Tensor | None:
        """The DSA indexer keys of positions ``[0, end)`` (``None`` on shared layers)."""

    def latent_grad(self, end: int) -> torch.Tensor | None:
        """Where backward adds the gradient of ``latent_prefix(end)`` (exact views only)."""


# --- defaults ---------------------------------------------------------------------------------


class RecordBase:
    """Defaults of ``LayerState`` for the calls a kind need not answer specially.

    Kinds are dataclasses deriving from this (it has no fields, so ``dataclasses.fields``
    and ``vars`` of a record are the kind's own)."""

    kind: ClassVar[str]
    grows_with_prompt: ClassVar[bool]
    can_keep_outputs: ClassVar[bool] = False

    def new_grad(self, dtype: torch.dtype) -> GradBuffer:
        raise NotImplementedError(
            f"exact gradients are not implemented for {type(self).__name__} records"
        )

    def exact_view(self, grad: GradBuffer, produced: Produced | None) -> ExactView:
        raise NotImplementedError(
            f"exact gradients are not implemented for {type(self).__name__} records"
        )

    def new_pieces(self, device: torch.device) -> Pieces:
        raise NotImplementedError(
            f"replay in pieces is not implemented for {type(self).__name__} records"
        )

    def with_record(self, copy: LayerState) -> LayerState:
        return StreamedRecord(copy, self)

    def reading(self) -> LayerState:
        return self  # type: ignore[return-value]

    def checkpoint_nbytes(self) -> int:
        return 0

    def output_nbytes(self) -> int:
        return 0

    def summary_bytes(self) -> dict[str, int]:
        return {}

    def keep_checkpoints(self, device: torch.device) -> None:
        return None

    def needs_checkpoints(self) -> bool:
        return False


class ExactViewBase:
    """What every exact view shares: the record it reads, its ``dS`` and the sweep's list."""

    def __init__(self, record: Any, grad: Any, produced: Produced | None) -> None:
        self.record, self.grad, self.produced = record, grad, produced

    def with_record(self, record: Any) -> ExactViewBase:
        """The same view reading ``record`` (a streamed copy of this one's)."""
        return type(self)(record, self.grad, self.produced)

    @property
    def length(self) -> int:
        return self.record.length

    def reading(self) -> Any:
        return self.record

    def release(self) -> None:
        self.record = None

    def new_pieces(self, device: torch.device) -> Pieces:
        return self.record.new_pieces(device)

    def sweep(self) -> Produced:
        """The sweep's list, which a recomputed chunk's write hands what it produced; a
        branch's view has none (a branch must never write into the prefix state)."""
        if self.produced is None:
            raise RuntimeError("a branch must not write into the prefix state")
        return self.produced


# --- replay in pieces ------------------------------------------------------------------------


def piece_leaf(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """What later pieces read of ``tensor``: detached, so their backward stops here and adds
    into its ``.grad`` (the seed of the backward of the piece that wrote it)."""
    return None if tensor is None else tensor.detach().requires_grad_(tensor.requires_grad)


class LeafSeed(Seed):
    """The seed of what a piece wrote: the gradient later pieces' backwards left in its
    leaf (zeros when none of them read it)."""

    def __init__(self, leaf: torch.Tensor) -> None:
        self.leaf = leaf

    @property
    def used(self) -> bool:
        """Whether a later piece read it: the branch's last piece's writes are read by none,
        and seeding them (with zeros) would only reorder the backward's sums."""
        return self.leaf.grad is not None

    def resolve(self) -> torch.Tensor:
        return torch.zeros_like(self.leaf) if self.leaf.grad is None else self.leaf.grad


def record_writes(
    produced: Produced,
    written: Sequence[torch.Tensor | None],
    leaves: Sequence[torch.Tensor | None],
) -> None:
    """Hand what a piece wrote (with a graph) to ``produced``, seeded by its leaf."""
    for tensor, leaf in zip(written, leaves, strict=True):
        if tensor is not None and leaf is not None and tensor.requires_grad:
            produced.append((tensor, LeafSeed(leaf)))


class GrowingPieces:
    """The rows of one layer that grow with the branch (keys and values, a latent), for a
    branch replayed in pieces: each piece appends its rows, later pieces read them, earlier
    pieces' rows as leaves (``piece_leaf``), concatenated along ``dim`` with the piece's own."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.leaves: list[tuple[torch.Tensor | None, ...]] = []

    def piece(self, produced: Produced) -> GrowingPiece:
        return GrowingPiece(self, produced)


class GrowingPiece:
    """One piece's branch record over ``GrowingPieces`` (see ``BranchKV.append``).

    The first ``append`` is the piece's forward: it records what the piece wrote and the
    leaves later pieces will read. A second one is activation checkpointing's recompute of
    the same piece in its backward: it sees the same earlier rows and records nothing.
    """

    def __init__(self, chain: GrowingPieces, produced: Produced) -> None:
        self.chain, self.produced = chain, produced
        self.visible = list(chain.leaves)
        self.appended = False

    def append(
        self, *rows: torch.Tensor | None, ragged: object = None
    ) -> tuple[torch.Tensor | None, ...]:
        """The branch's rows so far, this piece's last. ``ragged``: a decode step's
        ``Rows``, never given here (a branch replayed in pieces is one branch, in order)."""
        if ragged is not None:
            raise RuntimeError("a branch replayed in pieces takes no ragged decode step")
        if not self.appended:
            self.appended = True
            leaves = tuple(piece_leaf(row) for row in rows)
            self.chain.leaves.append(leaves)
            record_writes(self.produced, rows, leaves)
        return tuple(
            None
            if row is None
            else torch.cat([*(earlier[i] for earlier in self.visible), row], dim=self.chain.dim)
            for i, row in enumerate(rows)
        )


# --- helpers the kinds share ----------------------------------------------------------------


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def store(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target[...] = source``. Into pinned CPU memory from CUDA (an offloaded record's
    prefill) the copy is asynchronous, row by row, on the compute stream: later kernels on
    that stream may reuse ``source`` safely, and prefill synchronises before it returns."""
    if target.device == source.device:
        target.copy_(source)
        return
    copy_rows(target, source, non_blocking=source.is_cuda and target.is_pinned())


def check_write(start: int, end: int, length: int, capacity: int) -> None:
    """A prefill chunk ``[start, end)`` must continue the record's ``length`` valid positions
    (chunks in order) and fit its ``capacity``."""
    if start != length or end > capacity:
        raise RuntimeError(
            f"prefill wrote positions {start}..{end} into a state holding {length} "
            f"of {capacity} positions; chunks must be written in order"
        )


def check_append(length: int, count: int, capacity: int) -> int:
    end = length + count
    if end > capacity:
        raise RuntimeError(
            f"branch cache holds {length} of {capacity} positions and cannot take {count} more"
        )
    return end


def grad_like(grad: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """A copy of ``dS`` for ``output``: its dtype, and its device (``dS`` of an offloaded
    record is in CPU memory while the recomputed chunk runs on the device)."""
    return grad.to(device=output.device, dtype=output.dtype, copy=True)


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
