"""The prefix state: what later tokens read of a prompt that was run once without autograd.

Each layer keeps a record of its own kind (full-attention K/V here; recurrent and latent
records join with their adapters). Records are preallocated to the prompt length when
prefill starts and filled chunk by chunk in place, so a long prompt never triggers the
quadratic copying of a growing cache.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch


class LayerState(Protocol):
    """One layer's share of the prefix state."""

    kind: ClassVar[str]
    grows_with_prompt: ClassVar[bool]

    def nbytes(self) -> int: ...

    def to(self, device: torch.device | str, non_blocking: bool = False) -> LayerState: ...


@dataclass
class AttentionKV:
    """Keys (after any q/k norm and RoPE) and values of one full-attention layer.

    Shapes are ``[kv_heads, capacity, head_dim]``; the first ``length`` positions are valid.
    """

    kind: ClassVar[str] = "full_attention"
    grows_with_prompt: ClassVar[bool] = True

    keys: torch.Tensor
    values: torch.Tensor
    length: int = 0

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
    ) -> AttentionKV:
        keys = torch.empty(kv_heads, capacity, head_dim, dtype=dtype, device=device)
        values = torch.empty(kv_heads, capacity, value_dim or head_dim, dtype=dtype, device=device)
        return cls(keys, values, 0)

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one prefill chunk's ``[kv_heads, T, head_dim]`` keys/values at ``start``."""
        end = start + keys.shape[1]
        if start != self.length or end > self.capacity:
            raise RuntimeError(
                f"prefill wrote positions {start}..{end} into a state holding {self.length} "
                f"of {self.capacity} positions; chunks must be written in order"
            )
        self.keys[:, start:end] = keys
        self.values[:, start:end] = values
        self.length = end

    def segments(self, end: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views (never copies) of the valid prefix, as segments for ``segmented_attention``."""
        end = self.length if end is None else end
        if end == 0:
            return []
        return [(self.keys[:, :end], self.values[:, :end])]

    def nbytes(self) -> int:
        return _nbytes(self.keys[:, : self.length]) + _nbytes(self.values[:, : self.length])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> AttentionKV:
        return AttentionKV(
            self.keys.to(device, non_blocking=non_blocking),
            self.values.to(device, non_blocking=non_blocking),
            self.length,
        )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass
class PrefixState:
    """The prompt as later tokens see it: one record per decoder layer.

    ``length`` prompt positions are stored: all prompt tokens but the last. The last prompt
    token (``last_token``) is replayed at the head of every branch, because its logits score
    the branch's first token and must be computed with autograd.
    """

    layers: list[LayerState]
    last_token: torch.Tensor
    owner: str
    length: int = 0
    meta: dict[str, object] = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        return self.length + 1

    @property
    def device(self) -> torch.device:
        return self.last_token.device

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def holds_prompt(self, prompt_ids: torch.Tensor) -> bool:
        """Whether this state was prefilled from exactly ``prompt_ids``."""
        return self.meta.get("prompt_fingerprint") == prompt_fingerprint(prompt_ids)

    def summary(self) -> dict[str, dict[str, float | int | bool]]:
        """Bytes by layer type: how many layers, total bytes, bytes per stored prompt token."""
        table: dict[str, dict[str, float | int | bool]] = {}
        for layer in self.layers:
            row = table.setdefault(
                layer.kind,
                {"layers": 0, "bytes": 0, "grows_with_prompt": layer.grows_with_prompt},
            )
            row["layers"] += 1
            row["bytes"] += layer.nbytes()
        for row in table.values():
            row["bytes_per_token"] = row["bytes"] / max(self.length, 1)
        return table

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PrefixState:
        """The state on ``device``; tensors already there are shared, not copied."""
        return PrefixState(
            layers=[layer.to(device, non_blocking=non_blocking) for layer in self.layers],
            last_token=self.last_token.to(device),
            owner=self.owner,
            length=self.length,
            meta=dict(self.meta),
        )

    def __repr__(self) -> str:
        kinds = ", ".join(
            f"{kind}: {row['layers']} layers, {format_bytes(row['bytes'])}"
            for kind, row in self.summary().items()
        )
        return (
            f"PrefixState(prompt_length={self.prompt_length}, "
            f"{format_bytes(self.nbytes())} on {self.device}; {kinds})"
        )


def prompt_fingerprint(prompt_ids: torch.Tensor) -> str:
    """A short digest of the prompt, so a state handed to a step can be checked against it."""
    data = prompt_ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
