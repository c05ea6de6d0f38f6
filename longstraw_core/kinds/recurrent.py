"""Gated DeltaNet: the layer kind whose prefix state is a fixed-size conv window and
recurrent state.

``RecurrentState`` is the prefix record (conv ``[conv_dim, kernel - 1]`` in the model's
dtype, recurrent ``[v_heads, d_k, d_v]`` in float32, and with checkpoints the state at every
prefill chunk start for exact mode's sweep), ``BranchRecurrent`` each rollout branch's own
state, ``RecurrentStateGrad`` exact mode's ``dS``, ``RecurrentExactView`` the record as
exact mode reads it, ``RecurrentPlan`` the planner's formulas and ``LINEAR_ATTENTION`` the
registered kind (offload field ``recurrent``). Adapters call the ``RecurrentReads`` protocol
(``longstraw_core.kinds.base``). Used by the linear-attention layers of
``model_adapters/qwen36``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from longstraw_core.kinds.base import (
    ExactViewBase,
    Produced,
    Seed,
    attach_grad_sink,
    piece_leaf,
    record_writes,
    tensor_nbytes,
)
from longstraw_core.kinds.checkpoints import ChunkCheckpoints
from longstraw_core.kinds.planning import FP32, KindPlan
from longstraw_core.kinds.registry import LayerKind, register_kind
from longstraw_core.tensors.pinned import empty_buffers


@dataclass
class RecurrentState(ChunkCheckpoints):
    """One linear-attention (Gated DeltaNet) layer's prefix state: a fixed size at any length.

    ``conv``: the last ``kernel - 1`` inputs of the causal conv, ``[conv_dim, kernel - 1]`` in
    the model's dtype (zeros before the prompt, as the conv's own zero padding).
    ``recurrent``: the delta-rule state ``[v_heads, d_k, d_v]`` in float32 (zeros at start).
    ``length``: prompt positions folded in so far.
    ``checkpoints``: with ``checkpoint_device`` set, the state at the start of every prefill
    chunk (by position), which exact mode's reverse sweep restarts chunks from.
    """

    kind: ClassVar[str] = "linear_attention"
    grows_with_prompt: ClassVar[bool] = False
    state_name: ClassVar[str] = "recurrent state"

    conv: torch.Tensor
    recurrent: torch.Tensor
    length: int = 0
    checkpoint_device: torch.device | None = None
    checkpoints: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def empty(
        cls,
        conv_dim: int,
        conv_kernel: int,
        value_heads: int,
        key_dim: int,
        value_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        pin_memory: bool = False,
    ) -> RecurrentState:
        conv, recurrent = empty_buffers(
            [
                ((conv_dim, conv_kernel - 1), dtype),
                ((value_heads, key_dim, value_dim), torch.float32),
            ],
            device=device,
            pin_memory=pin_memory,
        )  # pinned: one exactly sized arena, not the caching host allocator's rounding
        return cls(conv.zero_(), recurrent.zero_(), 0)

    def read(self, start: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv, recurrent)`` at position ``start``; ``None``: after the whole prompt."""
        if start is None or start == self.length:
            return self.conv, self.recurrent
        return self.checkpoint(start, (self.conv.device, self.recurrent.device))

    def window(self, position: int | None) -> RecurrentState:
        """What a pass starting at ``position`` (``None``: after the prompt) reads: the state
        there (``longstraw_core.offload`` copies it)."""
        conv, recurrent = self.read(position)
        return RecurrentState(conv, recurrent, self.length if position is None else position)

    def update(self, start: int, length: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Fold one prefill chunk of ``length`` positions at ``start`` into the state."""
        self.check_order(start, length)
        self.keep_checkpoint(start, self.conv, self.recurrent)
        self.conv.copy_(conv)
        self.recurrent.copy_(recurrent)
        self.length = start + length

    def nbytes(self) -> int:
        return tensor_nbytes(self.conv) + tensor_nbytes(self.recurrent)

    def new_grad(self, dtype: torch.dtype) -> RecurrentStateGrad:
        return RecurrentStateGrad.zeros_like(self, dtype)

    def exact_view(self, grad: RecurrentStateGrad, produced: Produced | None) -> RecurrentExactView:
        return RecurrentExactView(self, grad, produced)

    def new_pieces(self, device: torch.device) -> RecurrentPieces:
        return RecurrentPieces(self, device)

    def new_branch(
        self, batch: int, capacity: int, device: torch.device | None = None
    ) -> BranchRecurrent:
        """Per-branch copies of the state after the whole prompt (small: a fixed size), on
        ``device`` (default: the record's)."""
        conv, recurrent = self.conv, self.recurrent
        if device is not None:
            conv, recurrent = conv.to(device), recurrent.to(device)
        return BranchRecurrent(
            conv.expand(batch, *conv.shape).clone(),
            recurrent.expand(batch, *recurrent.shape).clone(),
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RecurrentState:
        return RecurrentState(
            self.conv.to(device, non_blocking=non_blocking),
            self.recurrent.to(device, non_blocking=non_blocking),
            self.length,
            self.checkpoint_device,
            dict(self.checkpoints),
        )


@dataclass
class BranchRecurrent:
    """Each branch's Gated DeltaNet state: conv ``[batch, conv_dim, kernel - 1]`` and
    recurrent ``[batch, v_heads, d_k, d_v]`` (float32), after the positions run so far."""

    kind: ClassVar[str] = "linear_attention"

    conv: torch.Tensor
    recurrent: torch.Tensor

    def update(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.conv, self.recurrent = conv, recurrent

    def narrow(self, start: int, stop: int) -> NarrowRecurrent:
        """Branches ``start..stop``, whose updates are written back into these."""
        return NarrowRecurrent(self, start, stop)

    def nbytes(self) -> int:
        return tensor_nbytes(self.conv) + tensor_nbytes(self.recurrent)


class NarrowRecurrent:
    """Some branches of a ``BranchRecurrent`` (``narrow``): they start from its states and
    their ``update`` copies the new ones into it, in place."""

    kind: ClassVar[str] = "linear_attention"

    def __init__(self, whole: BranchRecurrent, start: int, stop: int) -> None:
        self.whole, self.rows = whole, slice(start, stop)

    @property
    def conv(self) -> torch.Tensor:
        return self.whole.conv[self.rows]

    @property
    def recurrent(self) -> torch.Tensor:
        return self.whole.recurrent[self.rows]

    def update(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        # In place (rollout runs under no_grad): the whole's tensors are its own, at most
        # views of an earlier step's outputs, which nothing reads any more.
        self.whole.conv[self.rows] = conv
        self.whole.recurrent[self.rows] = recurrent

    def narrow(self, start: int, stop: int) -> NarrowRecurrent:
        return NarrowRecurrent(self.whole, self.rows.start + start, self.rows.start + stop)

    def nbytes(self) -> int:
        return tensor_nbytes(self.conv) + tensor_nbytes(self.recurrent)


class RecurrentPieces:
    """A branch replayed in pieces: each piece starts from the states the one before it
    ended with (read as leaves, ``piece_leaf``), the first from the prompt's final states as
    ``reader`` (the record, or exact mode's view with its gradient sinks) gives them."""

    def __init__(self, reader: RecurrentState | RecurrentExactView, device: torch.device) -> None:
        self.reader, self.device = reader, device
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None

    def piece(self, produced: Produced) -> RecurrentPiece:
        if self.last is None:
            conv, recurrent = self.reader.read(None)
            self.last = (conv.to(self.device)[None], recurrent.to(self.device)[None])
        return RecurrentPiece(self, produced, *self.last)


class RecurrentPiece:
    """One piece's branch record (``BranchRecurrent``'s interface): ``conv``/``recurrent``
    are the states it starts from, also when activation checkpointing runs it again; its
    first ``update`` hands the states it ends with to the next piece and to ``produced``."""

    def __init__(
        self,
        chain: RecurrentPieces,
        produced: Produced,
        conv: torch.Tensor,
        recurrent: torch.Tensor,
    ) -> None:
        self.chain, self.produced = chain, produced
        self.conv, self.recurrent = conv, recurrent
        self.updated = False

    def update(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        if self.updated:
            return
        self.updated = True
        leaves = (piece_leaf(conv), piece_leaf(recurrent))
        self.chain.last = leaves
        record_writes(self.produced, (conv, recurrent), leaves)


# --- exact mode ------------------------------------------------------------


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


class RecurrentExactView(ExactViewBase):
    """A ``RecurrentState`` as exact mode sees it.

    Reads attach gradient sinks to the state they return: the final state for a branch, the
    checkpoint at the chunk's start during recompute. A recomputed chunk's ``update`` hands
    the state it produced to the sweep with the accumulated gradient, then clears the buffer
    for the gradient of the chunk's start, which that chunk's backward fills.
    """

    record: RecurrentState
    grad: RecurrentStateGrad

    def new_pieces(self, device: torch.device) -> RecurrentPieces:
        return RecurrentPieces(self, device)

    def read(self, start: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.produced is None and start is not None:
            raise RuntimeError("a branch reads the state after the whole prompt (start=None)")
        conv, recurrent = self.record.read(start)
        return attach_grad_sink(conv, self.grad.conv), attach_grad_sink(
            recurrent, self.grad.recurrent
        )

    def update(self, start: int, length: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        produced = self.sweep()
        for output, buffer in ((conv, self.grad.conv), (recurrent, self.grad.recurrent)):
            produced.append((output, Seed(buffer, output, clear=True)))


# --- the planner's formulas (``kinds.planning``) -------------------------------------------

DELTA_CHUNK = 64  # the gated delta rule's chunk (fla's and transformers' torch_chunk_... alike)


class RecurrentPlan(KindPlan):
    """Gated DeltaNet as the memory planner sees it (``qwen36.run_gated_deltanet``, mixer
    ``"deltanet"``): a fixed-size state, a conv and the chunked delta rule."""

    cuda_kernels = "Gated DeltaNet in flash-linear-attention"
    state_only_backward = False  # its last layer runs whole

    def mixer_dims(self, layer: Any) -> tuple[str, dict[str, int]]:
        net = layer.linear_attn
        return "deltanet", {
            "conv_dim": net.conv_dim,
            "kernel": net.conv_kernel_size,
            "key_heads": net.num_k_heads,
            "value_heads": net.num_v_heads,
            "key_dim": net.head_k_dim,
            "value_dim": net.head_v_dim,
        }

    def checkpoint_bytes(self, state_fixed: int) -> int:
        return state_fixed  # the whole (fixed-size) state at every chunk start

    # --- what autograd saves

    def saved(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        """Gated DeltaNet, ``qwen36.run_gated_deltanet``, for ``tokens`` tokens (bytes)."""
        d, b, hidden = layer.dims, act.b, act.spec.hidden
        value_width = d["value_heads"] * d["value_dim"]
        consumers = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        per_token = act.linear_input(hidden, consumers)
        conv = d["conv_dim"] * (2 * tokens + 3 * (d["kernel"] - 1)) * b  # conv in, silu in
        if act.lora:
            conv = d["conv_dim"] * (tokens + 2 * (d["kernel"] - 1)) * b  # conv weight frozen
        per_token += 3 * FP32 * d["value_heads"] + b * d["value_heads"]  # beta, g, softplus
        # Gated RMSNorm of the output: fp32 input, rsqrt, fp32 gate, silu(gate), weighted.
        per_token += 4 * FP32 * value_width + FP32 * d["value_heads"] + b * value_width
        if not act.lora:
            per_token += b * value_width
        per_token += act.linear_input(value_width, ("out_proj",))
        return per_token * tokens + conv + self.delta_rule(act, d, tokens)

    @staticmethod
    def delta_rule(act: Any, d: dict[str, int], tokens: int) -> int:
        """What the delta-rule kernel saves for ``tokens`` tokens (bytes)."""
        heads, dk, dv = d["value_heads"], d["key_dim"], d["value_dim"]
        if act.work.device == "cuda" and act.b < FP32:
            # flash-linear-attention's chunk kernel saves its inputs (q and k repeated to
            # the value heads by our wrapper), g and beta, and recomputes the rest.
            return tokens * (act.b * heads * (2 * dk + dv) + 2 * FP32 * heads)
        # transformers' torch_chunk_gated_delta_rule, padded to chunks of 64: five [64, 64]
        # matrices per chunk and head, five key-wide and three value-wide tensors per padded
        # token, the l2-normalised q and k, and the state entering every chunk.
        padded = math.ceil(tokens / DELTA_CHUNK) * DELTA_CHUNK
        chunks = padded // DELTA_CHUNK
        per_padded = heads * (5 * DELTA_CHUNK + 5 * dk + 3 * dv + 5)
        per_token = heads * (2 * dk + 2)
        states = max(chunks - 1, 0) * heads * dk * dv
        mask = DELTA_CHUNK * DELTA_CHUNK // FP32  # bool [64, 64]
        return FP32 * (padded * per_padded + tokens * per_token + states + mask)

    def state_only_saved(self, act: Any, layer: Any, tokens: int) -> int:
        return self.saved(act, layer, tokens, 0)  # the layer runs whole

    def written(self, act: Any, layer: Any, tokens: int) -> int:
        """The final states: the conv window and the fp32 recurrent state."""
        d = layer.dims
        conv = act.b * d["conv_dim"] * (d["kernel"] - 1)
        return conv + FP32 * d["value_heads"] * d["key_dim"] * d["value_dim"]

    def piece_rows(self, act: Any, layer: Any, tokens: int) -> int:
        """The final states, whose conv window is a view of the piece's whole conv input
        and keeps it alive (``qwen36.run_gated_deltanet``)."""
        return self.written(act, layer, 0) + act.b * layer.dims["conv_dim"] * tokens

    # --- working sets

    def width(self, act: Any, layer: Any) -> int:
        d = layer.dims
        return d["conv_dim"] + d["value_heads"] * d["value_dim"]

    def working(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        d = layer.dims
        width = 2 * d["conv_dim"] + 2 * d["value_heads"] * d["value_dim"]
        return tokens * act.b * width + self.delta_rule_working(act, d, tokens)

    @staticmethod
    def delta_rule_working(act: Any, d: dict[str, int], tokens: int) -> int:
        """The delta rule without autograd: torch's chunk path holds four [64, 64] matrices
        per chunk and head (decays, UT system, intra-chunk scores, a product) besides its
        padded fp32 q/k/v; flash-linear-attention's kernel keeps only its inputs/outputs."""
        heads, dk, dv = d["value_heads"], d["key_dim"], d["value_dim"]
        if act.work.device == "cuda" and act.b < FP32:
            return tokens * act.b * heads * (2 * dk + 2 * dv)
        padded = math.ceil(tokens / DELTA_CHUNK) * DELTA_CHUNK
        return FP32 * padded * heads * (4 * DELTA_CHUNK + 5 * dk + 4 * dv)

    def state_only_working(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        return act.forward_working(layer, tokens, prefix)  # the layer runs whole

    # --- FLOPs

    def token_flops(self, layer: Any) -> float:
        """The chunked recurrence per token: the state's read, correction and update (three
        ``key_dim x value_dim`` products a head) and the intra-chunk scores and values
        (chunks of 64), and the conv."""
        d = layer.dims
        heads, dk, dv = d["value_heads"], d["key_dim"], d["value_dim"]
        conv = 2 * d["conv_dim"] * d["kernel"]
        return heads * (6 * dk * dv + 4 * DELTA_CHUNK * (dk + dv)) + conv

    def mixing_flops(self, layer: Any, tokens: float, prefix: float) -> tuple[float, float]:
        return self.token_flops(layer) * tokens, 0.0


LINEAR_ATTENTION = register_kind(
    LayerKind(RecurrentState.kind, RecurrentState, offload="recurrent", plan=RecurrentPlan())
)
