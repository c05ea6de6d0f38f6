"""The torch backend's layouts and key blocks: the GQA group and the batch folded into the
query axis, keys visited in blocks sized by a budget, block gradients stored or accumulated.

Layouts: the branch is attended as [B, KVH, R, D] with R = n_rep * Tq (the GQA group folded
into the query axis); prefix segments as [KVH, B * R, D] (the batch folded in as well), so one
matmul per block serves every row without expanding the prefix.
"""

from __future__ import annotations

import torch

# Budget, in elements, for one block's scores plus its K/V when block_size is None.
MAX_SCORE_ELEMENTS = 1 << 22  # ~16 MB of fp32 scores: big blocks thrash memory on CPU


def group_rows(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, H, T, D] -> [B, KVH, n_rep * T, D]``: query head h lands in kv head h // n_rep."""
    b, h, t, d = x.shape
    return x.reshape(b, kv_heads, (h // kv_heads) * t, d)


def fold_batch(x: torch.Tensor) -> torch.Tensor:
    """``[B, KVH, R, ...] -> [KVH, B * R, ...]``: shared prefix keys serve all rows at once."""
    return x.transpose(0, 1).reshape(x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])


def unfold_batch(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of ``fold_batch`` (a view)."""
    return x.reshape(x.shape[0], batch, x.shape[1] // batch, *x.shape[2:]).transpose(0, 1)


def branch_query_positions(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Branch position of each grouped query row (bottom-right aligned causal)."""
    n_rep, tq, tk = q.shape[1] // k.shape[1], q.shape[2], k.shape[2]
    return (tk - tq + torch.arange(tq, device=q.device)).repeat(n_rep)


def block_length(block_size: int | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Keys per block: the given size, or one that keeps the block's scores and its K/V
    (converted to the accumulation dtype) under ``MAX_SCORE_ELEMENTS``."""
    if block_size is not None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        return block_size
    per_key = q.numel() // q.shape[-1] + (k.numel() + v.numel()) // max(k.shape[-2], 1)
    return max(1, MAX_SCORE_ELEMENTS // max(per_key, 1))


def key_blocks(length: int, block: int) -> range:
    return range(0, length, block)


def load_block(x: torch.Tensor, start: int, block: int, like: torch.Tensor) -> torch.Tensor:
    """Keys/values ``[start, start + block)`` on the device and dtype of the computation."""
    return x[..., start : start + block, :].to(device=like.device, dtype=like.dtype)


def block_scores(
    q: torch.Tensor,
    k_block: torch.Tensor,
    scale: float,
    query_positions: torch.Tensor | None,
    start: int,
    window: int | None = None,
) -> torch.Tensor:
    """``scale * q @ k^T`` for one key block, causally masked when positions are given;
    with ``window`` also every key ``window`` or more positions before its query."""
    scores = (q @ k_block.transpose(-1, -2)) * scale
    if query_positions is not None:
        key_positions = torch.arange(start, start + k_block.shape[-2], device=q.device)
        hidden = key_positions[None, :] > query_positions[:, None]
        if window is not None:
            hidden |= key_positions[None, :] <= query_positions[:, None] - window
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def store(
    grad: torch.Tensor | None,
    sink: torch.Tensor | None,
    start: int,
    block: int,
    value: torch.Tensor,
) -> None:
    """Write a block's gradient into ``grad`` and/or add it into the accumulation ``sink``."""
    if grad is not None:
        grad[..., start : start + block, :] = value
    if sink is not None:
        target = sink[..., start : start + block, :]
        target += value.to(device=sink.device, dtype=sink.dtype)
