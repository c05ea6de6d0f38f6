"""Full attention (GQA): the layer kind whose prefix state is every position's K and V.

``AttentionKV`` is the prefix record (``[kv_heads, L, head_dim]`` keys after q/k norm and
RoPE, and values; optionally each prefill chunk's attention output for exact mode's sweep),
``BranchKV`` what rollout's branches add, ``AttentionKVGrad`` exact mode's ``dS``,
``AttentionKVExactView`` the record as exact mode reads it, ``AttentionPlan`` the planner's
formulas and ``FULL_ATTENTION`` the registered kind (offload field ``attention``). Adapters
call the ``AttentionReads`` protocol (``longstraw_core.kinds.base``) on whichever of these
they get. Used by ``model_adapters/dense.py`` and the full-attention layers of ``qwen36``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from longstraw_core.attention import AttentionOutput
from longstraw_core.kinds.base import (
    ExactViewBase,
    GrowingPieces,
    Produced,
    RecordBase,
    Seed,
    check_append,
    check_write,
    store,
    tensor_nbytes,
)
from longstraw_core.kinds.planning import FP32, KindPlan, causal_pairs
from longstraw_core.kinds.registry import LayerKind, register_kind
from longstraw_core.kinds.rows import Rows
from longstraw_core.tensors.pinned import empty_buffers


@dataclass
class AttentionKV(RecordBase):
    """Keys (after any q/k norm and RoPE) and values of one full-attention layer.

    Shapes are ``[kv_heads, capacity, head_dim]``; the first ``length`` positions are valid.

    With ``keeps_outputs`` (exact mode's ``keep_attention_outputs``), prefill also keeps each
    chunk's attention output ``[heads, capacity, value_dim]`` and log-sum-exp
    ``[heads, capacity]``, so the sweep's recompute of that chunk skips the attention
    forward (``output_for``).
    """

    kind: ClassVar[str] = "full_attention"
    grows_with_prompt: ClassVar[bool] = True
    can_keep_outputs: ClassVar[bool] = True

    keys: torch.Tensor
    values: torch.Tensor
    length: int = 0
    keeps_outputs: bool = False
    outputs: torch.Tensor | None = None
    output_lse: torch.Tensor | None = None
    outputs_length: int = 0

    @classmethod
    def empty(
        cls,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        value_dim: int | None = None,
        pin_memory: bool = False,
    ) -> AttentionKV:
        keys, values = empty_buffers(
            [
                ((kv_heads, capacity, head_dim), dtype),
                ((kv_heads, capacity, value_dim or head_dim), dtype),
            ],
            device=device,
            pin_memory=pin_memory,
        )  # pinned: one exactly sized arena, not the caching host allocator's rounding
        return cls(keys, values, 0)

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one prefill chunk's ``[kv_heads, T, head_dim]`` keys/values at ``start``."""
        end = start + keys.shape[1]
        check_write(start, end, self.length, self.capacity)
        store(self.keys[:, start:end], keys)
        store(self.values[:, start:end], values)
        self.length = end

    def segments(self, end: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views (never copies) of the valid prefix, as segments for ``segmented_attention``."""
        end = self.length if end is None else end
        if end == 0:
            return []
        return [(self.keys[:, :end], self.values[:, :end])]

    def write_output(self, start: int, output: AttentionOutput) -> None:
        """Keep one prefill chunk's attention output (``B = 1``) at ``start``, beside the
        keys and values (in CPU memory for an offloaded record)."""
        out, lse = output.out[0], output.lse[0]  # [heads, T, value_dim], [heads, T]
        if self.outputs is None:
            home = {"device": self.keys.device, "pin_memory": self.keys.is_pinned()}
            heads, capacity = out.shape[0], self.capacity
            self.outputs, self.output_lse = empty_buffers(
                [((heads, capacity, out.shape[-1]), out.dtype), ((heads, capacity), lse.dtype)],
                **home,
            )
        end = start + out.shape[1]
        if start != self.outputs_length:
            raise RuntimeError(f"attention outputs written at {start}, after {self.outputs_length}")
        store(self.outputs[:, start:end], out)
        store(self.output_lse[:, start:end], lse)
        self.outputs_length = end

    def output_for(
        self, start: int, length: int, device: torch.device | None = None
    ) -> AttentionOutput | None:
        """The kept attention output of positions ``[start, start + length)``, as a batch of
        one, copied to ``device`` (default: the record's); None when prefill kept none."""
        if self.outputs is None or start + length > self.outputs_length:
            return None
        end = start + length
        return AttentionOutput(
            *(
                t[None, :, start:end].to(device or t.device, copy=True)
                for t in (self.outputs, self.output_lse)
            )
        )

    def output_nbytes(self) -> int:
        """Bytes of the kept attention outputs (0 unless ``keeps_outputs``)."""
        if self.outputs is None:
            return 0
        end = self.outputs_length
        return tensor_nbytes(self.outputs[:, :end]) + tensor_nbytes(self.output_lse[:, :end])

    def window(self, position: int | None) -> AttentionKV:
        """What a pass starting at ``position`` (``None``: after the prompt) reads: views of
        the valid keys/values before it (``longstraw_core.offload`` copies them)."""
        end = self.length if position is None else position
        return AttentionKV(self.keys[:, :end], self.values[:, :end], end, self.keeps_outputs)

    def grad_segments(self, end: int | None = None) -> None:
        """Gradient buffers for the segments: none here (exact mode's views provide them)."""
        return None

    def nbytes(self) -> int:
        return tensor_nbytes(self.keys[:, : self.length]) + tensor_nbytes(
            self.values[:, : self.length]
        )

    def new_branch(self, batch: int, capacity: int, device: torch.device | None = None) -> BranchKV:
        """Empty per-branch keys/values for ``batch`` branches of up to ``capacity`` positions,
        on ``device`` (default: the record's; an offloaded record's branches compute on the
        device)."""
        kv_heads, _, head_dim = self.keys.shape
        options = {"dtype": self.keys.dtype, "device": device or self.keys.device}
        # Zeros, not empty: a ragged step's padding queries may read slots nothing wrote.
        return BranchKV(
            torch.zeros(batch, kv_heads, capacity, head_dim, **options),
            torch.zeros(batch, kv_heads, capacity, self.values.shape[-1], **options),
        )

    def summary_bytes(self) -> dict[str, int]:
        """``kept_output_bytes`` for a record that keeps attention outputs."""
        return {"kept_output_bytes": self.output_nbytes()} if self.keeps_outputs else {}

    def new_grad(self, dtype: torch.dtype) -> AttentionKVGrad:
        return AttentionKVGrad.zeros_like(self, dtype)

    def new_pieces(self, device: torch.device) -> GrowingPieces:
        """A branch replayed in pieces: its keys/values ``[1, kv_heads, T, dim]`` per piece."""
        return GrowingPieces(dim=2)

    def exact_view(self, grad: AttentionKVGrad, produced: Produced | None) -> AttentionKVExactView:
        return AttentionKVExactView(self, grad, produced)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> AttentionKV:
        moved = [
            None if t is None else t.to(device, non_blocking=non_blocking)
            for t in (self.keys, self.values, self.outputs, self.output_lse)
        ]
        return AttentionKV(
            moved[0], moved[1], self.length, self.keeps_outputs, *moved[2:], self.outputs_length
        )


@dataclass
class BranchKV:
    """The branches' own keys and values of one full-attention layer.

    ``[batch, kv_heads, capacity, head_dim]``; the first ``length`` positions are valid.
    """

    kind: ClassVar[str] = "full_attention"

    keys: torch.Tensor
    values: torch.Tensor
    length: int = 0

    def append(
        self, keys: torch.Tensor, values: torch.Tensor, ragged: Rows | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``[batch, kv_heads, T, dim]`` after the valid positions; return views of all.
        A ragged step (``ragged``) stores each row's kept inputs at its own slots and returns
        the slots the step reads (``ragged.read``); ``length`` is then not kept."""
        if ragged is not None:
            slots = (ragged.kept_rows, slice(None), ragged.kept_slots)
            kept = (ragged.kept_rows, slice(None), ragged.kept_inputs)
            self.keys[slots] = keys[kept]
            self.values[slots] = values[kept]
            return self.keys[:, :, : ragged.read], self.values[:, :, : ragged.read]
        end = check_append(self.length, keys.shape[2], self.keys.shape[2])
        self.keys[:, :, self.length : end] = keys
        self.values[:, :, self.length : end] = values
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def narrow(self, start: int, stop: int) -> BranchKV:
        """Views of branches ``start..stop`` (their appends land here)."""
        return BranchKV(self.keys[start:stop], self.values[start:stop], self.length)

    def nbytes(self) -> int:
        return tensor_nbytes(self.keys) + tensor_nbytes(self.values)


# --- exact mode ------------------------------------------------------------


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


class AttentionKVExactView(ExactViewBase):
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
        super().__init__(record, grad, produced)
        self.home = record if home is None else home

    def with_record(self, record: AttentionKV) -> AttentionKVExactView:
        """The same view reading ``record`` (a streamed copy of this one's)."""
        return AttentionKVExactView(record, self.grad, self.produced, self.home)

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
        produced = self.sweep()
        end = start + keys.shape[1]
        produced.append((keys, Seed(self.grad.keys[:, start:end], keys)))
        produced.append((values, Seed(self.grad.values[:, start:end], values)))


# --- the planner's formulas (``kinds.planning``) -------------------------------------------


class AttentionPlan(KindPlan):
    """Full attention as the memory planner sees it: dense GQA (``dense.run_full_attention``,
    mixer ``"attention"``) or Qwen3.5's gated attention (``qwen36.run_gated_attention``,
    ``"gated_attention"``)."""

    cuda_kernels = "attention in flash-attn or PyTorch's SDPA flash kernels"
    offload_label = "attention K/V"
    full_attention = True
    reuses_kept_outputs = True

    def mixer_dims(self, layer: Any) -> tuple[str, dict[str, int]]:
        attention = layer.self_attn
        head_dim = attention.head_dim
        q_out = attention.q_proj.out_features
        gated = q_out == 2 * attention.config.num_attention_heads * head_dim
        q_width = q_out // 2 if gated else q_out
        return ("gated_attention" if gated else "attention"), {
            "heads": q_width // head_dim,
            "kv_heads": attention.k_proj.out_features // head_dim,
            "head_dim": head_dim,
            "qk_norm": int(hasattr(attention, "q_norm")),
        }

    # --- what autograd saves

    def saved(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        d = layer.dims
        if layer.mixer == "gated_attention":
            return self.gated_per_token(act, d) * tokens
        return self.per_token(act, d) * tokens

    @staticmethod
    def per_token(act: Any, d: dict[str, int]) -> int:
        """Dense GQA attention (Qwen3 / Llama), ``dense.run_full_attention``, per token."""
        b, q, kv = act.b, d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
        saved = act.linear_input(act.spec.hidden, ("q_proj", "k_proj", "v_proj"))
        if d["qk_norm"]:
            saved += act.norm(q, d["heads"]) + act.norm(kv, d["kv_heads"])
        saved += b * (2 * q + 2 * kv) + FP32 * d["heads"]  # q, k, v, output; lse
        return saved + act.linear_input(q, ("o_proj",))

    @staticmethod
    def gated_per_token(act: Any, d: dict[str, int]) -> int:
        """Qwen3.5's gated attention, ``qwen36.run_gated_attention``, per token."""
        b, q, kv = act.b, d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
        saved = act.linear_input(act.spec.hidden, ("q_proj", "k_proj", "v_proj"))
        # q_norm reads a view of q_proj's [T, 2q] output: in fp32 it keeps all of it alive.
        saved += act.norm(q, d["heads"]) + (FP32 * q if b == FP32 else 0)
        saved += act.norm(kv, d["kv_heads"])
        saved += b * (2 * q + 2 * kv) + FP32 * d["heads"]  # q, k, v, output; lse
        saved += 2 * b * q  # sigmoid(gate) and the reshaped output, saved by their product
        return saved + act.linear_input(q, ("o_proj",))

    def state_only_saved(self, act: Any, layer: Any, tokens: int) -> int:
        d = layer.dims
        kv = d["kv_heads"] * d["head_dim"]
        keys = act.linear_input(act.spec.hidden, ("k_proj", "v_proj"))
        return (keys + act.norm(kv, d["kv_heads"])) * tokens

    def written(self, act: Any, layer: Any, tokens: int) -> int:
        """Keys and values."""
        d = layer.dims
        return 2 * act.b * d["kv_heads"] * d["head_dim"] * tokens

    def kept_output_bytes(self, act: Any, layer: Any, lse: int) -> int:
        return layer.dims["heads"] * (layer.dims["head_dim"] * act.b + lse)

    # --- working sets

    def width(self, act: Any, layer: Any) -> int:
        d = layer.dims
        return (2 + (layer.mixer == "gated_attention")) * d["heads"] * d["head_dim"]

    def working(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        d = layer.dims
        q, kv = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
        width = (3 if layer.mixer == "gated_attention" else 2) * q + 3 * kv
        return tokens * act.b * width + self.forward_scratch(act, layer, tokens, prefix)

    def decode_scratch(self, act: Any, layer: Any, group: int, prefix: int) -> int:
        """The pure-torch loop over the prefix when no fused kernel serves it."""
        d = layer.dims
        if self.path(act, d["head_dim"], d["head_dim"]) != "blocked":
            return 0
        rows = group * d["heads"] // d["kv_heads"]
        dims = (d["kv_heads"], rows, d["head_dim"], d["head_dim"])
        return act.kernels.blocked_scratch(*dims, prefix, act.b, backward=False)

    @staticmethod
    def path(act: Any, dk: int, dv: int) -> str:
        """Which kernel ``segmented_attention`` runs: ``"flash"`` (flash-attn on CUDA, 16-bit,
        equal head dims), ``"fused"`` (PyTorch's CPU flash kernel: float32, equal head dims)
        or ``"blocked"`` (the pure-torch loop over key blocks: everything else). Attention
        with sinks takes the same kernels: the fused backends fold the sink in after them."""
        if dk != dv:
            return "blocked"
        if act.work.device == "cuda":
            ok = act.b < FP32 and dk % 8 == 0 and dk <= 256
            return "flash" if ok else "blocked"
        return "fused" if act.b == FP32 else "blocked"

    def forward_scratch(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        """Segmented attention's forward: per segment an fp32 output merged by log-sum-exp
        (two products alive), the branch K/V repeated per query head for the fused kernels,
        and the pure-torch loop's score blocks over the prefix."""
        d = layer.dims
        q, kv = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
        scratch = tokens * (4 * FP32 * q + 2 * act.b * q)
        if act.b < FP32:
            scratch += tokens * FP32 * (q + 2 * kv)  # rows cast to the accumulation dtype
        if self.path(act, d["head_dim"], d["head_dim"]) == "blocked" and prefix:
            rows = d["heads"] // d["kv_heads"] * tokens
            dims = (d["kv_heads"], rows, d["head_dim"], d["head_dim"])
            scratch += act.kernels.blocked_scratch(*dims, prefix, act.b, backward=False)
        return scratch

    def prefix_backward_scratch(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        d = layer.dims
        kv, head = d["kv_heads"], d["head_dim"]
        rows = d["heads"] * tokens
        path = self.path(act, head, head)
        if path == "flash":
            return act.kernels.flash_backward_scratch(kv, rows, head, prefix, act.b)
        if path == "blocked":
            group_rows = d["heads"] // kv * tokens
            return act.kernels.blocked_scratch(kv, group_rows, head, head, prefix, act.b, True)
        return act.kernels.fused_backward_scratch(kv, rows, head, prefix)

    # --- FLOPs

    def pair_flops(self, layer: Any) -> float:
        """``Q K^T`` and ``P V``: ``4 x heads x head_dim`` per query-key pair."""
        return 4 * layer.dims["heads"] * layer.dims["head_dim"]

    def mixing_flops(self, layer: Any, tokens: float, prefix: float) -> tuple[float, float]:
        return self.pair_flops(layer) * causal_pairs(tokens, prefix), 0.0


FULL_ATTENTION = register_kind(
    LayerKind(AttentionKV.kind, AttentionKV, offload="attention", plan=AttentionPlan())
)
