"""What every backend of segmented attention shares: the segment type, the saved
``AttentionOutput``, the accumulation dtype, the log-sum-exp merge of two results, the
attention sink's fold and gradient, and the fused kernels' sliding-window bound."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Segment = tuple[torch.Tensor, torch.Tensor]

# Number of arguments before the flat prefix tensors in ``Function.apply``: ``q, k, v, sink,
# scale, block_size, window, prefix_grads, reuse, keep``.
N_LEADING_ARGS = 10


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


def fold_sink(
    out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention sinks folded into a merged result: one more key per row, of logit ``sink``
    (broadcast to ``lse``'s shape) and value zero, so ``lse' = logaddexp(lse, sink)`` and
    ``out' = out * exp(lse - lse')``. Every backend folds after its merge and saves
    ``out'``/``lse'``: its FlashAttention backward against them is then exact as it stands
    (``P' = exp(S - lse')``, ``D = rowsum(dO * O')``; the sink has no value, so no ``dP``)."""
    with_sink = torch.logaddexp(lse, sink.to(lse.dtype))
    return out * torch.exp(lse - with_sink).unsqueeze(-1), with_sink


def sink_row_grads(sink: torch.Tensor, lse: torch.Tensor, d_sum: torch.Tensor) -> torch.Tensor:
    """Each row's share of the sink's gradient, ``-exp(sink - lse') * D`` with
    ``D = rowsum(dO * O')`` (``d_sum``), all three laid out as ``lse'``: the sink column's
    softmax gradient, ``P_sink * (dP_sink - D)`` with ``dP_sink = 0``. The caller sums the
    rows of each head."""
    return -torch.exp(sink.to(lse.dtype) - lse) * d_sum


def window_left(causal: bool, window: int | None) -> int:
    """The fused kernels' left window bound (flash-attn's ``window_size[0]``, varlen's
    ``window_size_left``): ``window - 1`` keys before the query's own, which is transformers'
    ``kv_idx > q_idx - sliding_window``, or -1 (unbounded) without a window. Prefix segments
    are attended non-causally, where a window has no meaning."""
    if window is None:
        return -1
    if not causal:
        raise ValueError("a sliding window applies to the causal branch segment only")
    return window - 1
