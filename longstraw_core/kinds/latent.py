"""MLA + DSA: the layer kind whose prefix state is the compressed latent (and indexer keys).

``LatentKV`` is the prefix record (one buffer ``[L, kv_lora_rank + rope_dim]``: normalised
latent ``c_kv`` then roped ``k_pe``; DSA indexer keys ``[L, index_head_dim]`` on layers
that run their own indexer), ``BranchLatent`` what rollout's branches add, ``LatentKVGrad``
exact mode's ``dS`` (latent only: the indexer carries no gradient) and
``LatentKVExactView`` the record as exact mode reads it. Adapters call the ``LatentReads``
protocol (``longstraw_core.kinds.base``). Used by ``model_adapters/glm52.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from longstraw_core.kinds.base import (
    ExactViewBase,
    GrowingPieces,
    Produced,
    RecordBase,
    Seed,
    check_append,
    store,
    tensor_nbytes,
)
from longstraw_core.offload.pinned import empty_buffers


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
        if start != self.length or end > self.capacity:
            raise RuntimeError(
                f"prefill wrote positions {start}..{end} into a state holding {self.length} "
                f"of {self.capacity} positions; chunks must be written in order"
            )
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
        index_keys = None
        if self.index_keys is not None:
            index_keys = torch.empty(batch, capacity, self.index_keys.shape[-1], **options)
        latent = torch.empty(batch, capacity, self.latent.shape[-1], **options)
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
        self, latent: torch.Tensor, index_keys: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Store ``[batch, T, ...]`` rows after the valid positions; return views of all."""
        end = check_append(self.length, latent.shape[1], self.latent.shape[1])
        if (index_keys is None) != (self.index_keys is None):
            raise RuntimeError("index keys must be appended exactly on layers that keep them")
        self.latent[:, self.length : end] = latent
        if index_keys is not None:
            self.index_keys[:, self.length : end] = index_keys
        self.length = end
        index_view = None if self.index_keys is None else self.index_keys[:, :end]
        return self.latent[:, :end], index_view

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
        if self.produced is None:
            raise RuntimeError("a branch must not write into the prefix state")
        end = start + latent.shape[0]
        self.produced.append((latent, Seed(self.grad.latent[start:end], latent)))
