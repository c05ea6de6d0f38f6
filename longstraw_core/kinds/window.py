"""Sliding-window attention: the layer kind whose prefix state is the K/V of the last
``width - 1`` prompt positions, a fixed size whatever the prompt's length.

A sliding-window layer of width ``W`` (transformers' ``sliding_window``) lets the query at
position ``p`` see the keys at ``p - W < j <= p``: its own and the ``W - 1`` before it. Every
later query sees at most the last ``W - 1`` stored positions, so that is all the record keeps
(``WindowKV``: ``[kv_heads, W - 1, head_dim]`` keys after q/k norm and RoPE, and values, the
oldest first), shifted along as prefill writes each chunk. ``BranchWindowKV`` holds what
rollout's branches add (their own K/V, as full attention's), ``WindowKVGrad`` is exact
mode's ``dS`` (the gradient of the window at the sweep's current chunk boundary),
``WindowExactView`` the record as exact mode reads it, ``WindowPlan`` the planner's formulas
and ``SLIDING_ATTENTION`` the registered kind (placed with full attention's K/V:
``attention``).

The layer's attention puts the stored window at the head of the span's own keys and lets
``segmented_attention(window=W)`` mask, per query, what lies outside its window (the torch
backend with an explicit mask, flash-attn and PyTorch's varlen kernels with their own
``window_size=(W - 1, 0)``). The stored window is at most ``W - 1`` rows, so it is copied
beside the span instead of being attended as a shared prefix segment.

Exact mode's reverse sweep needs the window at each chunk's start, which prefill has shifted
out: with checkpoints kept (``keep_checkpoints``, as ``GRPOConfig.recurrent_checkpoints``
asks of every kind) the record keeps it at every chunk start, and the sweep treats the
window as a recurrent state: a recomputed chunk reads the window at its start with a
gradient sink and hands the window it ends with (a function of both) to the sweep, seeded
with ``dS`` (cleared, then refilled by the chunk's backward with the gradient at its start).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from longstraw_core.kinds.attention import AttentionPlan, BranchKV
from longstraw_core.kinds.base import (
    ExactViewBase,
    GrowingPieces,
    Produced,
    Seed,
    attach_grad_sink,
    tensor_nbytes,
)
from longstraw_core.kinds.checkpoints import ChunkCheckpoints
from longstraw_core.kinds.planning import FP32, causal_pairs
from longstraw_core.kinds.registry import LayerKind, register_kind
from longstraw_core.tensors.pinned import empty_buffers


class WindowReads(Protocol):
    """What the sliding-window attention code (``model_adapters/dense.py``,
    ``attend_in_window``) calls on its layer: the record, its exact view, an offloaded
    record's ``StreamedRecord`` or a checkpointed ``LayerRecord`` (their declared reads,
    ``kinds.forwarding``, already include both)."""

    length: int

    def read(self, start: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's keys/values before ``start`` (``None``: after the whole prompt)."""

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fold (or, recomputed, hand to the sweep) one prefill chunk's keys and values."""


def _last(rows: torch.Tensor, count: int) -> torch.Tensor:
    """The last ``count`` positions of ``[kv_heads, T, dim]`` (all of them if fewer)."""
    return rows[:, max(rows.shape[1] - count, 0) :]


@dataclass
class WindowKV(ChunkCheckpoints):
    """The keys and values of the last ``width - 1`` positions of one sliding-window layer.

    ``keys``/``values``: ``[kv_heads, width - 1, dim]``; the first ``min(length, width - 1)``
    rows are valid, the oldest first. ``length``: prompt positions folded in so far.
    ``checkpoints``: with ``checkpoint_device`` set, the window at the start of every prefill
    chunk (by position), which exact mode's sweep restarts chunks from.
    """

    kind: ClassVar[str] = "sliding_attention"
    grows_with_prompt: ClassVar[bool] = False
    state_name: ClassVar[str] = "sliding window"

    keys: torch.Tensor
    values: torch.Tensor
    width: int
    length: int = 0
    checkpoint_device: torch.device | None = None
    checkpoints: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def empty(
        cls,
        kv_heads: int,
        width: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        value_dim: int | None = None,
        pin_memory: bool = False,
    ) -> WindowKV:
        if width < 1:
            raise ValueError(f"a sliding window holds at least one position, got {width}")
        keys, values = empty_buffers(
            [
                ((kv_heads, width - 1, head_dim), dtype),
                ((kv_heads, width - 1, value_dim or head_dim), dtype),
            ],
            device=device,
            pin_memory=pin_memory,
        )
        return cls(keys, values, width)

    @property
    def capacity(self) -> int:
        """Positions kept: ``width - 1`` (what any later query can see besides itself)."""
        return self.width - 1

    def read(self, start: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the window before position ``start`` (``None``: after the whole prompt),
        ``[kv_heads, min(start, width - 1), dim]`` each."""
        if start is None or start == self.length:
            valid = min(self.length, self.capacity)
            return self.keys[:, :valid], self.values[:, :valid]
        return self.checkpoint(start, (self.keys.device, self.values.device))

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fold one prefill chunk's ``[kv_heads, T, dim]`` keys/values at ``start`` in: the
        window becomes the last ``width - 1`` positions of the old one and the chunk."""
        self.check_order(start, keys.shape[1])
        old_keys, old_values = self.read(start)
        self.keep_checkpoint(start, old_keys, old_values)
        for target, old, new in ((self.keys, old_keys, keys), (self.values, old_values, values)):
            window = _last(torch.cat([old.to(new), new], dim=1), self.capacity)
            # A blocking copy, as the recurrent state's: the next chunk's checkpoint reads it
            # on the host (an asynchronous copy into pinned memory could still be running).
            target[:, : window.shape[1]].copy_(window)
        self.length = start + keys.shape[1]

    def window(self, position: int | None) -> WindowKV:
        """What a pass starting at ``position`` (``None``: after the prompt) reads: the window
        there, as a record of its own (``longstraw_core.offload`` copies it)."""
        keys, values = self.read(position)
        length = self.length if position is None else position
        return WindowKV(keys, values, self.width, length)

    def nbytes(self) -> int:
        keys, values = self.read(None)
        return tensor_nbytes(keys) + tensor_nbytes(values)

    def new_branch(
        self, batch: int, capacity: int, device: torch.device | None = None
    ) -> BranchWindowKV:
        """Empty per-branch keys/values for ``batch`` branches of up to ``capacity`` positions
        (the branch's own, as full attention's; the stored window stays shared)."""
        kv_heads, _, head_dim = self.keys.shape
        options = {"dtype": self.keys.dtype, "device": device or self.keys.device}
        return BranchWindowKV(
            torch.zeros(batch, kv_heads, capacity, head_dim, **options),
            torch.zeros(batch, kv_heads, capacity, self.values.shape[-1], **options),
        )

    def new_grad(self, dtype: torch.dtype) -> WindowKVGrad:
        return WindowKVGrad(
            self.keys.new_zeros(self.keys.shape, dtype=dtype),
            self.values.new_zeros(self.values.shape, dtype=dtype),
        )

    def new_pieces(self, device: torch.device) -> GrowingPieces:
        """A branch replayed in pieces: its own keys/values ``[1, kv_heads, T, dim]``."""
        return GrowingPieces(dim=2)

    def exact_view(self, grad: WindowKVGrad, produced: Produced | None) -> WindowExactView:
        return WindowExactView(self, grad, produced)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> WindowKV:
        return WindowKV(
            self.keys.to(device, non_blocking=non_blocking),
            self.values.to(device, non_blocking=non_blocking),
            self.width,
            self.length,
            self.checkpoint_device,
            dict(self.checkpoints),
        )


class BranchWindowKV(BranchKV):
    """The branches' own keys and values of one sliding-window layer (``BranchKV``'s)."""

    kind: ClassVar[str] = "sliding_attention"

    def narrow(self, start: int, stop: int) -> BranchWindowKV:
        return BranchWindowKV(self.keys[start:stop], self.values[start:stop], self.length)


# --- exact mode ------------------------------------------------------------


@dataclass
class WindowKVGrad:
    """``dL/d(keys, values)`` of one sliding-window layer's window at the current chunk
    boundary, ``[kv_heads, width - 1, dim]`` (the first rows valid, as in the record)."""

    keys: torch.Tensor
    values: torch.Tensor

    def nbytes(self) -> int:
        return tensor_nbytes(self.keys) + tensor_nbytes(self.values)


class WindowExactView(ExactViewBase):
    """A ``WindowKV`` as exact mode sees it.

    Reads attach gradient sinks to the window they return: the final window for a branch,
    the checkpoint at the chunk's start during recompute. A recomputed chunk's ``write``
    hands the window it ends with (the last ``width - 1`` rows of the window it started from
    and its own keys/values, with their graph) to the sweep, seeded with ``dS`` and clearing
    it; the chunk's backward then fills ``dS`` with the gradient of the window at its start.
    """

    record: WindowKV
    grad: WindowKVGrad

    def read(self, start: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.produced is None and start is not None:
            raise RuntimeError("a branch reads the window after the whole prompt (start=None)")
        keys, values = self.record.read(start)
        count = keys.shape[1]
        return (
            attach_grad_sink(keys, self.grad.keys[:, :count]),
            attach_grad_sink(values, self.grad.values[:, :count]),
        )

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        produced = self.sweep()
        old = self.read(start)
        capacity = self.record.width - 1
        buffers = (self.grad.keys, self.grad.values)
        for before, new, buffer in zip(old, (keys, values), buffers, strict=True):
            window = _last(torch.cat([before.to(new), new], dim=1), capacity)
            if window.numel():
                produced.append((window, Seed(buffer[:, : window.shape[1]], window, clear=True)))


# --- the planner's formulas (``kinds.planning``) -------------------------------------------


class WindowPlan(AttentionPlan):
    """Sliding-window attention as the memory planner sees it (dense GQA's widths, plus the
    window ``W``: ``LayerSpec.dims["window"]``).

    Its state is a fixed ``W - 1`` positions (the record's bytes, read from it); a query sees
    at most ``W`` keys: the stored window's last rows and the span's own. So every formula
    that reads the prefix reads ``min(prefix, W - 1)`` stored rows instead: the rows copied
    beside the span (saved for backward with it), the attention kernel's key blocks in
    prefill, replay and the sweep, and the FLOPs (``causal_pairs`` with the window: at most
    ``W`` pairs per query, a cost per token that does not grow with the context). A rollout
    branch keeps its own K/V (``BranchWindowKV``, as full attention's) and a decode step
    reads at most ``W - 1`` of them. Exact mode's checkpoint at a chunk start holds the
    window there: ``min(start, W - 1)`` rows."""

    cuda_kernels = "windowed attention in flash-attn (window_size)"
    offload_label = "sliding-window K/V"
    full_attention = False  # a query reads W keys, not every prefix position
    reuses_kept_outputs = False  # the window keeps no attention outputs

    def mixer_dims(self, layer: Any) -> tuple[str, dict[str, int]]:
        mixer, dims = super().mixer_dims(layer)
        return mixer, {**dims, "window": int(layer.self_attn.sliding_window)}

    @staticmethod
    def seen(layer: Any, prefix: float) -> float:
        """Stored rows a span after ``prefix`` positions reads: the window's, at most."""
        return min(prefix, layer.dims["window"] - 1)

    @staticmethod
    def row_bytes(layer: Any) -> float:
        """Bytes of one stored position (its key and value), from the record's bytes."""
        capacity = layer.dims["window"] - 1
        return layer.state_fixed / capacity if capacity else 0.0

    def kept_positions(self, layer: Any, positions: float) -> float:
        return self.seen(layer, positions)

    def checkpoint_bytes(self, state_fixed: int) -> int:
        return state_fixed  # at most the whole window (``checkpoints_bytes`` sums them)

    def checkpoints_bytes(self, layer: Any, stored: int, chunk: int) -> int:
        """The window at every chunk start ``k x chunk``: ``min(k x chunk, W - 1)`` rows."""
        starts = range(0, stored, chunk)
        return round(self.row_bytes(layer) * sum(self.seen(layer, start) for start in starts))

    def branch_bytes(self, layer: Any, positions: float) -> float:
        return self.row_bytes(layer) * positions  # its own K/V, preallocated

    def branch_read_bytes(self, layer: Any, positions: float) -> float:
        return self.row_bytes(layer) * self.seen(layer, positions)

    def decode_read_bytes(self, layer: Any, context: float, group: int, cb: int) -> float:
        """The stored window, shared by the branches (at most its ``W - 1`` rows)."""
        return self.row_bytes(layer) * self.seen(layer, context)

    # --- what autograd saves: the stored rows copied beside the span's keys

    def saved(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        copied = 2 * act.b * layer.dims["kv_heads"] * layer.dims["head_dim"]
        return super().saved(act, layer, tokens, prefix) + copied * int(self.seen(layer, prefix))

    # --- working sets: one segment of at most ``W - 1`` stored rows and the span

    def working(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        d = layer.dims
        q, kv = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
        copied = 2 * act.b * kv * (int(self.seen(layer, prefix)) + tokens)  # keys beside
        return (
            tokens * act.b * (2 * q + 3 * kv)
            + copied
            + self.forward_scratch(act, layer, tokens, prefix)
        )

    @staticmethod
    def window_path(act: Any, dims: dict[str, int]) -> str:
        """``"flash"`` (flash-attn's ``window_size``) or ``"blocked"``: PyTorch's fused CPU
        kernel takes no window."""
        head_dim = dims["head_dim"]
        path = AttentionPlan.path(act, head_dim, head_dim)
        return "blocked" if path == "fused" else path

    def forward_scratch(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        d = layer.dims
        q, kv = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
        keys = int(self.seen(layer, prefix)) + tokens
        scratch = tokens * (4 * FP32 * q + 2 * act.b * q)
        if act.b < FP32:
            scratch += FP32 * (tokens * q + 2 * kv * keys)  # cast to the accumulation dtype
        if self.window_path(act, d) == "blocked":
            rows = d["heads"] // d["kv_heads"] * tokens
            dims = (d["kv_heads"], rows, d["head_dim"], d["head_dim"])
            scratch += act.kernels.blocked_scratch(*dims, keys, act.b, backward=False)
        return scratch

    def prefix_backward_scratch(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        d = layer.dims
        kv, head = d["kv_heads"], d["head_dim"]
        keys = int(self.seen(layer, prefix)) + tokens
        if self.window_path(act, d) == "flash":
            return act.kernels.flash_backward_scratch(kv, d["heads"] * tokens, head, keys, act.b)
        group_rows = d["heads"] // kv * tokens
        return act.kernels.blocked_scratch(kv, group_rows, head, head, keys, act.b, True)

    def decode_scratch(self, act: Any, layer: Any, group: int, prefix: int) -> int:
        d = layer.dims
        if self.window_path(act, d) != "blocked":
            return 0
        rows = group * d["heads"] // d["kv_heads"]
        dims = (d["kv_heads"], rows, d["head_dim"], d["head_dim"])
        keys = int(self.seen(layer, prefix)) + 1
        return act.kernels.blocked_scratch(*dims, keys, act.b, backward=False)

    # --- FLOPs: at most ``W`` keys per query

    def pair_flops(self, layer: Any) -> float:
        return 0.0  # nothing grows with a long context

    def token_flops(self, layer: Any) -> float:
        return super().pair_flops(layer) * layer.dims["window"]

    def mixing_flops(self, layer: Any, tokens: float, prefix: float) -> tuple[float, float]:
        pairs = causal_pairs(tokens, prefix, layer.dims["window"])
        return super().pair_flops(layer) * pairs, 0.0


SLIDING_ATTENTION = register_kind(
    LayerKind(WindowKV.kind, WindowKV, offload="attention", plan=WindowPlan())
)
