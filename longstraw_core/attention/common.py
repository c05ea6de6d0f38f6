"""What every backend of segmented attention shares: the segment type, the saved
``AttentionOutput``, the accumulation dtype and the log-sum-exp merge of two results."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Segment = tuple[torch.Tensor, torch.Tensor]

# Number of non-tensor arguments before the flat prefix tensors in ``Function.apply``.
N_LEADING_ARGS = 9


@dataclass(frozen=True)
class AttentionOutput:
    """What a span's attention computed and its backward needs besides the inputs.

    ``out [B, H, T, Dv]`` (the returned attention output) and ``lse [B, H, T]`` (the merged
    log-sum-exp, float32, or float64 for float64 inputs). Exact mode's sweep recomputes
    prompt chunks the prefill already ran; with the prefill's ``AttentionOutput`` kept, the
    recompute skips the attention forward, the most expensive part of a chunk's forward.
    """

    out: torch.Tensor
    lse: torch.Tensor


def unflatten_segments(flat: Sequence[torch.Tensor]) -> list[Segment]:
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What attention scores and sums accumulate in: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attention results over disjoint key sets. ``lse_a`` must be finite."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return out_a * weight_a + out_b * weight_b, lse
