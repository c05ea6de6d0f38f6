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

from longstraw_core.attention.common import accumulation_dtype


def ragged_branch(
    q_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, KVH, R, Dv], lse [B, KVH, R])`` of grouped queries ``q_rows``
    ``[B, KVH, R, Dk]`` (``R = n_rep * Tq``, ``blocks.group_rows``) over each row's branch keys
    ``k``/``v`` ``[B, KVH, K, D]``; ``positions`` ``[B, Tq]``: a query sees keys ``<=`` its
    position. Every query must see at least one key (its own)."""
    dtype = accumulation_dtype(q_rows.dtype)
    n_rep = q_rows.shape[2] // positions.shape[1]
    scores = (q_rows.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
    keys = torch.arange(k.shape[2], device=q_rows.device)
    hidden = keys > positions.repeat(1, n_rep).to(q_rows.device)[:, None, :, None]
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse[..., None]) @ v.to(dtype)
    return out, lse


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
