"""MLA + DSA: the layer kind whose prefix state is the compressed latent (and indexer keys).

``LatentKV`` is the prefix record (one buffer ``[L, kv_lora_rank + rope_dim]``: normalised
latent ``c_kv`` then roped ``k_pe``; DSA indexer keys ``[L, index_head_dim]`` on layers
that run their own indexer), ``BranchLatent`` what rollout's branches add, ``LatentKVGrad``
exact mode's ``dS`` (latent only: the indexer carries no gradient),
``LatentKVExactView`` the record as exact mode reads it, ``LatentPlan`` the planner's
formulas and ``MLA_DSA`` the registered kind (offload field ``latent``). Adapters call the
``LatentReads`` protocol (``longstraw_core.kinds.base``). Used by ``model_adapters/glm52``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

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
from longstraw_core.kinds.planning import FP32, INT64, KindPlan, causal_pairs
from longstraw_core.kinds.registry import LayerKind, register_kind
from longstraw_core.kinds.rows import Rows
from longstraw_core.tensors.pinned import empty_buffers


@dataclass
class LatentKV(RecordBase):
    """One multi-head latent attention (MLA) layer, kept compressed (GLM-5.x, DeepSeek-V3.2).

    ``latent`` is ``[capacity, kv_lora_rank + rope_dim]``: per position the normalised latent
    ``c_kv`` followed by the roped shared key ``k_pe`` (one buffer, so attention reads it as a
    single-head key without concatenating anything). ``index_keys`` ``[capacity,
    index_head_dim]`` holds the DSA indexer's keys on layers that run their own indexer
    (``None`` on layers that reuse another layer's selection). ``expanded_width`` is the number
    of elements per position a naive cache would hold: per-head keys and values.
    """

    kind: ClassVar[str] = "mla_dsa"
    grows_with_prompt: ClassVar[bool] = True

    latent: torch.Tensor
    index_keys: torch.Tensor | None
    kv_lora_rank: int
    expanded_width: int
    length: int = 0

    @classmethod
    def empty(
        cls,
        capacity: int,
        kv_lora_rank: int,
        rope_dim: int,
        index_dim: int | None,
        expanded_width: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        pin_memory: bool = False,
    ) -> LatentKV:
        specs = [((capacity, kv_lora_rank + rope_dim), dtype)]
        if index_dim is not None:
            specs.append(((capacity, index_dim), dtype))
        # pinned: one exactly sized arena, not the caching host allocator's rounding
        latent, *index_keys = empty_buffers(specs, device=device, pin_memory=pin_memory)
        return cls(latent, index_keys[0] if index_keys else None, kv_lora_rank, expanded_width, 0)

    @property
    def capacity(self) -> int:
        return self.latent.shape[0]

    @property
    def c_kv(self) -> torch.Tensor:
        """The normalised latent of the valid positions, ``[length, kv_lora_rank]`` (a view)."""
        return self.latent[: self.length, : self.kv_lora_rank]

    @property
    def k_pe(self) -> torch.Tensor:
        """The roped shared key of the valid positions, ``[length, rope_dim]`` (a view)."""
        return self.latent[: self.length, self.kv_lora_rank :]

    def write(self, start: int, latent: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        """Store one prefill chunk's ``[T, kv_lora_rank + rope_dim]`` latent (and index keys)."""
        end = start + latent.shape[0]
        check_write(start, end, self.length, self.capacity)
        if (index_keys is None) != (self.index_keys is None):
            raise RuntimeError("index keys must be written exactly on layers that keep them")
        store(self.latent[start:end], latent)
        if index_keys is not None:
            store(self.index_keys[start:end], index_keys)
        self.length = end

    def latent_prefix(self, end: int) -> torch.Tensor:
        """The latent of positions ``[0, end)``, ``[end, kv_lora_rank + rope_dim]`` (a view)."""
        return self.latent[:end]

    def index_key_prefix(self, end: int) -> torch.Tensor | None:
        """The indexer keys of positions ``[0, end)`` (a view), ``None`` on shared layers."""
        return None if self.index_keys is None else self.index_keys[:end]

    def window(self, position: int | None) -> LatentKV:
        """What a pass starting at ``position`` (``None``: after the prompt) reads: views of
        the valid latent and index keys before it (``longstraw_core.offload`` copies them)."""
        end = self.length if position is None else position
        index_keys = None if self.index_keys is None else self.index_keys[:end]
        return LatentKV(self.latent[:end], index_keys, self.kv_lora_rank, self.expanded_width, end)

    def latent_grad(self, end: int) -> None:
        """Gradient buffer for ``latent_prefix(end)``: none here (exact mode's views give one)."""
        return None

    def nbytes(self) -> int:
        total = tensor_nbytes(self.latent[: self.length])
        if self.index_keys is not None:
            total += tensor_nbytes(self.index_keys[: self.length])
        return total

    def expanded_nbytes(self) -> int:
        """Bytes of the per-head K/V a naive cache would hold for the same positions."""
        return self.length * self.expanded_width * self.latent.element_size()

    def new_branch(
        self, batch: int, capacity: int, device: torch.device | None = None
    ) -> BranchLatent:
        """Empty per-branch latent (and index keys) for ``batch`` branches of ``capacity``,
        on ``device`` (default: the record's)."""
        options = {"dtype": self.latent.dtype, "device": device or self.latent.device}
        # Zeros, not empty: a ragged step's padding queries may read slots nothing wrote.
        index_keys = None
        if self.index_keys is not None:
            index_keys = torch.zeros(batch, capacity, self.index_keys.shape[-1], **options)
        latent = torch.zeros(batch, capacity, self.latent.shape[-1], **options)
        return BranchLatent(latent, index_keys)

    def summary_bytes(self) -> dict[str, int]:
        """``expanded_bytes``: what a naive per-head K/V cache would hold."""
        return {"expanded_bytes": self.expanded_nbytes()}

    def new_pieces(self, device: torch.device) -> GrowingPieces:
        """A branch replayed in pieces: its latent and index keys ``[1, T, ...]`` per piece."""
        return GrowingPieces(dim=1)

    def new_grad(self, dtype: torch.dtype) -> LatentKVGrad:
        return LatentKVGrad.zeros_like(self, dtype)

    def exact_view(self, grad: LatentKVGrad, produced: Produced | None) -> LatentKVExactView:
        return LatentKVExactView(self, grad, produced)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> LatentKV:
        index_keys = self.index_keys
        if index_keys is not None:
            index_keys = index_keys.to(device, non_blocking=non_blocking)
        return LatentKV(
            self.latent.to(device, non_blocking=non_blocking),
            index_keys,
            self.kv_lora_rank,
            self.expanded_width,
            self.length,
        )


@dataclass
class BranchLatent:
    """The branches' own MLA latent ``[batch, capacity, kv_lora_rank + rope_dim]`` and DSA
    indexer keys ``[batch, capacity, index_head_dim]`` (``None`` on layers that reuse another
    layer's selection); the first ``length`` positions are valid."""

    kind: ClassVar[str] = "mla_dsa"

    latent: torch.Tensor
    index_keys: torch.Tensor | None
    length: int = 0

    def append(
        self, latent: torch.Tensor, index_keys: torch.Tensor | None, ragged: Rows | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Store ``[batch, T, ...]`` rows after the valid positions; return views of all.
        A ragged step (``ragged``) stores each row's kept inputs at its own slots and returns
        the slots the step reads (``ragged.read``); ``length`` is then not kept."""
        if (index_keys is None) != (self.index_keys is None):
            raise RuntimeError("index keys must be appended exactly on layers that keep them")
        if ragged is not None:
            slots, kept = (
                (ragged.kept_rows, ragged.kept_slots),
                (ragged.kept_rows, ragged.kept_inputs),
            )
            self.latent[slots] = latent[kept]
            if index_keys is not None:
                self.index_keys[slots] = index_keys[kept]
            end = ragged.read
        else:
            end = check_append(self.length, latent.shape[1], self.latent.shape[1])
            self.latent[:, self.length : end] = latent
            if index_keys is not None:
                self.index_keys[:, self.length : end] = index_keys
            self.length = end
        index_view = None if self.index_keys is None else self.index_keys[:, :end]
        return self.latent[:, :end], index_view

    def narrow(self, start: int, stop: int) -> BranchLatent:
        """Views of branches ``start..stop`` (their appends land here)."""
        keys = None if self.index_keys is None else self.index_keys[start:stop]
        return BranchLatent(self.latent[start:stop], keys, self.length)

    def nbytes(self) -> int:
        total = tensor_nbytes(self.latent)
        return total if self.index_keys is None else total + tensor_nbytes(self.index_keys)


# --- exact mode ------------------------------------------------------------


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


class LatentKVExactView(ExactViewBase):
    """A ``LatentKV`` as exact mode sees it: gradients of latent reads go into ``grad``.

    Reads return the stored tensors; ``latent_grad`` hands the attention the buffer slice
    its backward adds the prefix gradient into (no state-sized temporary). During recompute
    a chunk's ``write`` hands its latent (with its graph) and ``dS`` slice to the sweep; its
    index keys carry no gradient and are dropped (the stored ones are the same values).
    """

    record: LatentKV
    grad: LatentKVGrad

    def latent_prefix(self, end: int) -> torch.Tensor:
        return self.record.latent_prefix(end)

    def index_key_prefix(self, end: int) -> torch.Tensor | None:
        return self.record.index_key_prefix(end)

    def latent_grad(self, end: int) -> torch.Tensor:
        return self.grad.latent[:end]

    def write(self, start: int, latent: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        """During recompute: hand the chunk's latent and its ``dS`` to the sweep."""
        produced = self.sweep()
        end = start + latent.shape[0]
        produced.append((latent, Seed(self.grad.latent[start:end], latent)))


# --- the planner's formulas (``kinds.planning``) -------------------------------------------


class LatentPlan(KindPlan):
    """MLA with weight absorption and the DSA indexer as the memory planner sees them
    (``glm52.GlmMoeDsaAdapter.run_attention``, mixer ``"mla"``): attention in the latent
    space, over the indexer's ``index_topk`` selection once the context is longer."""

    cuda_kernels = "MLA's latent attention and the DSA top-k search in pure-torch blocks"
    offload_label = "the MLA latent"

    def mixer_dims(self, layer: Any) -> tuple[str, dict[str, int]]:
        attention = layer.self_attn
        indexer = attention.indexer
        return "mla", {
            "heads": attention.num_heads,
            "q_rank": attention.q_a_proj.out_features,
            "qk_dim": attention.qk_head_dim,
            "rope_dim": attention.qk_rope_head_dim,
            "kv_rank": attention.kv_lora_rank,
            "v_dim": attention.v_head_dim,
            "indexer": int(indexer is not None),
            "index_heads": indexer.n_heads if indexer is not None else 0,
            "index_dim": indexer.head_dim if indexer is not None else 0,
            "index_topk": attention.config.index_topk,  # shared layers reuse a selection
        }

    @staticmethod
    def sparse(d: dict[str, int], tokens: float, prefix: float) -> bool:
        """Whether attention reads the DSA selection (the context is longer than top-k)."""
        return d["index_topk"] < prefix + tokens

    # --- what autograd saves

    def saved(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        d = layer.dims
        return self.per_token(act, d, self.sparse(d, tokens, prefix)) * tokens

    @staticmethod
    def per_token(act: Any, d: dict[str, int], sparse: bool) -> int:
        """MLA with weight absorption, ``glm52.GlmMoeDsaAdapter.run_attention``, per token."""
        b, heads, latent = act.b, d["heads"], d["kv_rank"] + d["rope_dim"]
        saved = act.linear_input(act.spec.hidden, ("q_a_proj", "kv_a_proj_with_mqa"))
        saved += act.norm(d["q_rank"]) + act.linear_input(d["q_rank"], ("q_b_proj",))
        if act.trains("kv_b_proj"):
            saved += b * heads * d["qk_dim"]  # q_b_proj's output, for q_nope @ W_uk
        # kv_a_layernorm reads the c_kv view: in fp32 the whole [T, rank + rope] output.
        saved += act.norm(d["kv_rank"]) + (FP32 * d["rope_dim"] if b == FP32 else 0)
        saved += b * heads * latent + b * latent  # absorbed queries, the span's latent
        saved += b * heads * d["kv_rank"] + FP32 * heads  # attention output, lse
        if sparse and d["indexer"]:
            saved += INT64 * d["index_topk"]  # the DSA selection
        return saved + act.linear_input(heads * d["v_dim"], ("o_proj",))

    def state_only_saved(self, act: Any, layer: Any, tokens: int) -> int:
        latent = act.linear_input(act.spec.hidden, ("kv_a_proj_with_mqa",))
        return (latent + act.norm(layer.dims["kv_rank"])) * tokens

    def kept_beside_input(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        """The DSA selection the layer passes on (the next layer's work holds it)."""
        d = layer.dims
        if d["indexer"] and self.sparse(d, tokens, prefix):
            return INT64 * d["index_topk"] * tokens
        return 0

    def written(self, act: Any, layer: Any, tokens: int) -> int:
        """The latent."""
        d = layer.dims
        return act.b * (d["kv_rank"] + d["rope_dim"]) * tokens

    def piece_rows(self, act: Any, layer: Any, tokens: int) -> int:
        """The latent and the index keys."""
        d = layer.dims
        return act.b * (d["kv_rank"] + d["rope_dim"] + d["indexer"] * d["index_dim"]) * tokens

    # --- working sets

    def width(self, act: Any, layer: Any) -> int:
        d = layer.dims
        return d["heads"] * (d["qk_dim"] + d["kv_rank"] + d["rope_dim"])

    def working(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        d = layer.dims
        latent = d["kv_rank"] + d["rope_dim"]
        width = d["heads"] * (d["qk_dim"] + 2 * latent) + 2 * latent
        return tokens * act.b * width + self.search(act, d, tokens, prefix, batch=1)

    def decode_scratch(self, act: Any, layer: Any, group: int, prefix: int) -> int:
        """The DSA search and latent gathers of one decoding step."""
        return self.search(act, layer.dims, 1, prefix, batch=group)

    def forward_scratch(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        return self.search(act, layer.dims, tokens, prefix, batch=1)

    @classmethod
    def search(cls, act: Any, d: dict[str, int], tokens: int, prefix: int, batch: int) -> int:
        """The DSA indexer's top-k search plus the latent attention's gather blocks."""
        kernels, device = act.kernels, act.work.device
        if not cls.sparse(d, tokens, prefix):  # dense: segmented attention over the latent
            latent = d["kv_rank"] + d["rope_dim"]
            rows = batch * d["heads"] * tokens  # one latent "head" for every query head
            return kernels.blocked_scratch(1, rows, latent, d["kv_rank"], prefix, act.b, False)
        scratch = kernels.sparse_attention_scratch(d, tokens, batch, device, act.b, False)
        if d["indexer"]:
            scratch = max(scratch, kernels.select_topk_peak(d, tokens, prefix, batch, device))
        return scratch

    def prefix_backward_scratch(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        d, kernels = layer.dims, act.kernels
        if self.sparse(d, tokens, prefix):
            return kernels.sparse_attention_scratch(d, tokens, 1, act.work.device, act.b, True)
        rows, latent = d["heads"] * tokens, d["kv_rank"] + d["rope_dim"]
        return kernels.blocked_scratch(1, rows, latent, d["kv_rank"], prefix, act.b, True)

    # --- FLOPs and reads

    @staticmethod
    def latent_pair_flops(d: dict[str, int]) -> float:
        """Per query-key pair: scores over the latent and its rope part, values over the
        latent."""
        return 2 * d["heads"] * (2 * d["kv_rank"] + d["rope_dim"])

    def pair_flops(self, layer: Any) -> float:
        """The DSA indexer's scores (``2 x index_heads x index_dim`` per pair): MLA's own
        attention reads ``index_topk`` keys."""
        d = layer.dims
        return 2 * d["index_heads"] * d["index_dim"] if d["indexer"] else 0.0

    def token_flops(self, layer: Any) -> float:
        """The sparse attention over the ``index_topk`` selected keys."""
        return self.latent_pair_flops(layer.dims) * layer.dims["index_topk"]

    def mixing_flops(self, layer: Any, tokens: float, prefix: float) -> tuple[float, float]:
        d = layer.dims
        mixing = self.latent_pair_flops(d) * causal_pairs(tokens, prefix, d["index_topk"])
        return mixing, self.pair_flops(layer) * causal_pairs(tokens, prefix)

    def decode_read_bytes(self, layer: Any, context: float, group: int, cb: int) -> float:
        """The indexer's keys of the whole context, and each branch's selected latents."""
        d = layer.dims
        latent = (d["kv_rank"] + d["rope_dim"]) * cb
        index = d["index_dim"] * cb * d["indexer"]
        keys = min(context, d["index_topk"])
        return index * context + group * keys * latent


MLA_DSA = register_kind(LayerKind(LatentKV.kind, LatentKV, offload="latent", plan=LatentPlan()))
