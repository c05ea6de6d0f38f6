"""A ragged decode step's branch segment: every row of the batch at its own branch position.

Rollout decodes branches that drift apart (one waits on its tool while the others go on, one
takes a tool's result as a multi-token step while the others take one token): query ``t`` of
row ``b`` sits at branch position ``positions[b, t]`` and sees that row's branch keys up to
it. The branch segment is short (at most a response), so it is attended here directly, with
an explicit mask, in the accumulation dtype; the prefix segments (the long part) still go
through the chosen backend's kernels and the two merge by log-sum-exp. Forward only: ragged
steps are rollout's, under ``no_grad``.
"""

from __future__ import annotations

import torch

from longstraw_core.attention.blocks import block_length, key_blocks
from longstraw_core.attention.common import accumulation_dtype


def ragged_branch(
    q_rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    positions: torch.Tensor,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, KVH, R, Dv], lse [B, KVH, R])`` of grouped queries ``q_rows``
    ``[B, KVH, R, Dk]`` (``R = n_rep * Tq``, ``blocks.group_rows``) over each row's branch keys
    ``k``/``v`` ``[B, KVH, K, D]``; ``positions`` ``[B, Tq]``: a query sees keys ``<=`` its
    position (and, with ``window``, ``> position - window``). Every query must see at least
    one key (its own). Keys are visited in blocks
    under the torch backend's score budget (``blocks.block_length``) with an online softmax,
    so a long tool result prefilled against a long branch builds no ``[R, K]`` matrix."""
    dtype = accumulation_dtype(q_rows.dtype)
    q = q_rows.to(dtype)
    n_rep = q.shape[2] // positions.shape[1]
    visible_to = positions.repeat(1, n_rep).to(q.device)[:, None, :, None]
    row_max = q.new_full(q.shape[:-1], float("-inf"))
    row_sum = q.new_zeros(q.shape[:-1])
    acc = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    block = block_length(None, q, k, v)
    for start in key_blocks(k.shape[2], block):
        keys = k[:, :, start : start + block].to(dtype)
        scores = (q @ keys.transpose(-1, -2)) * scale
        index = torch.arange(start, start + keys.shape[2], device=q.device)
        hidden = index > visible_to
        if window is not None:
            hidden |= index <= visible_to - window
        scores = scores.masked_fill(hidden, float("-inf"))
        new_max = torch.maximum(row_max, scores.amax(-1))
        shift = new_max.masked_fill(new_max == float("-inf"), 0.0)  # no key seen yet
        decay = torch.exp(row_max - shift)
        probs = torch.exp(scores - shift[..., None])
        row_sum = row_sum * decay + probs.sum(-1)
        acc = acc * decay[..., None] + probs @ v[:, :, start : start + block].to(dtype)
        row_max = new_max
    return acc / row_sum[..., None], row_max + torch.log(row_sum)


def check_ragged(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> None:
    """``positions`` is ``[B, Tq]``, in range of the branch keys, and nothing needs grad."""
    batch, _, length, _ = q.shape
    if positions.shape != (batch, length):
        raise ValueError(
            f"branch_positions must be [{batch}, {length}] for queries {tuple(q.shape)}, "
            f"got {tuple(positions.shape)}"
        )
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        raise RuntimeError(
            "branch_positions (a ragged decode step) is forward only: run it under "
            "torch.no_grad(), as rollout does"
        )
