"""The DSA indexer: its keys, queries and head weights, and the streamed top-k selection of
the positions each query attends to (frozen: no gradients)."""

from __future__ import annotations

import torch
from torch import nn

from longstraw_core.adapters.model_functions import RotaryFn
from longstraw_core.tensors.fake import representative
from model_adapters.glm52.absorb import PositionEmbeddings
from model_adapters.glm52.family import work_elements_like


@torch.no_grad()
def indexer_projections(
    indexer: nn.Module,
    hidden: torch.Tensor,
    q_resid: torch.Tensor,
    position_embeddings: PositionEmbeddings,
    rope: RotaryFn,
    with_queries: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The indexer's keys ``[B, T, Di]`` and, when asked, queries ``[B, T, Hi, Di]`` and
    head weights ``[B, T, Hi]``.

    Mirrors the model's indexer: ``k_norm(wk(x))``, RoPE on the leading ``rope`` dims (the
    model's own function: interleaved for GLM, half-split for DeepSeek-V3.2), head weights
    from ``weights_proj`` in float32 scaled by ``Hi ** -0.5``. Frozen: no gradients.
    """
    batch, length, _ = hidden.shape
    split = [indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim]
    cos, sin = position_embeddings
    keys = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)  # [B, T, 1, Di]
    k_rot, k_pass = keys.split(split, dim=-1)
    if not with_queries:
        _, k_rot = rope(k_rot, k_rot, cos, sin, unsqueeze_dim=2)
        return torch.cat([k_rot, k_pass], dim=-1)[:, :, 0], None, None
    queries = indexer.wq_b(q_resid).view(batch, length, indexer.n_heads, indexer.head_dim)
    q_rot, q_pass = queries.split(split, dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    queries = torch.cat([q_rot, q_pass], dim=-1)
    weights = indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float()
    weights = weights * indexer.n_heads**-0.5
    return torch.cat([k_rot, k_pass], dim=-1)[:, :, 0], queries, weights


@torch.no_grad()
def select_topk(
    queries: torch.Tensor,
    weights: torch.Tensor,
    prefix_keys: torch.Tensor,
    span_keys: torch.Tensor,
    topk: int,
    scale: float,
    branch_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``topk`` highest-scoring visible positions per query, ``[B, T, topk]``.

    ``queries`` ``[B, T, Hi, Di]`` and ``weights`` ``[B, T, Hi]`` of ``B`` branches, the
    shared ``prefix_keys`` ``[L, Di]`` and each branch's own ``span_keys`` ``[B, S, Di]``
    (``S >= T``: the queries are the last ``T`` of the branch's ``S`` positions). Index score
    of query ``t`` for key ``s``: ``sum_h w[t, h] relu(scale q[t, h] . k[s])`` in float32, as
    the model computes it; a query sees the whole prefix and its branch's keys up to itself.
    Keys are streamed in blocks of at least ``topk`` with a running top-k, so no ``[T, L]``
    score matrix is built and merging costs at most about one extra pass. Entries are
    absolute positions; ``-1`` pads the rows of queries that see fewer than ``topk``
    positions (they attend to all they see).

    ``branch_positions`` ``[B, T]``: a ragged decode step, each query at its own branch
    position (``span_keys`` then holds the slots the step reads); a query never selects its
    branch's slots past itself (the step's later inputs, the unwritten slots of a row that is
    behind the others).
    """
    batch, length = queries.shape[:2]
    prefix_length = prefix_keys.shape[0]
    if branch_positions is None:
        first = prefix_length + span_keys.shape[1] - length
        query_positions = (first + torch.arange(length, device=queries.device))[None]
    else:
        query_positions = prefix_length + branch_positions.to(queries.device)
    best_scores = queries.new_empty(batch, length, 0, dtype=torch.float32)
    best_positions = query_positions.new_empty(batch, length, 0)
    work = work_elements_like(queries)
    block = max(topk, work // (batch * length))
    blocks = _blocks(prefix_keys, 0, block) + _blocks(span_keys, prefix_length, block)
    for keys, offset in representative(blocks, queries):
        scores = _index_scores(queries, weights, keys.to(queries.device), scale, work)
        positions = offset + torch.arange(keys.shape[-2], device=queries.device)
        hidden = positions[None, None, :] > query_positions[:, :, None]  # [B or 1, T, n]
        scores = scores.masked_fill(hidden, float("-inf"))
        scores = torch.cat([best_scores, scores], dim=-1)
        positions = torch.cat([best_positions, positions.expand(batch, length, -1)], dim=-1)
        best_scores, picked = scores.topk(min(topk, scores.shape[-1]), dim=-1)
        best_positions = positions.gather(-1, picked)
    return best_positions.masked_fill(best_scores == float("-inf"), -1)


def _index_scores(
    queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float, work: int
) -> torch.Tensor:
    """``[B, T, n]`` index scores of ``n`` keys, a few indexer heads at a time (bounded memory).

    ``keys`` are ``[n, Di]`` (shared by the batch) or ``[B, n, Di]`` (one set per branch).
    """
    batch, length, heads, _ = queries.shape
    count = keys.shape[-2]
    keys_t = keys.float().transpose(-1, -2)
    if keys_t.dim() == 3:
        keys_t = keys_t[:, None]  # [B, 1, Di, n]: each branch's keys for all its queries
    scores = queries.new_zeros(batch, length, count, dtype=torch.float32)
    step = max(1, work // (batch * length * count))
    for head in representative(range(0, heads, step), queries):
        per_head = torch.relu((queries[:, :, head : head + step].float() @ keys_t) * scale)
        scores += (weights[:, :, None, head : head + step] @ per_head)[:, :, 0]
    return scores


def _blocks(x: torch.Tensor, offset: int, block: int) -> list[tuple[torch.Tensor, int]]:
    """Views of ``x`` ``[..., n, D]`` in blocks of rows, each with the absolute position of
    its first row."""
    return [
        (x[..., start : start + block, :], offset + start) for start in range(0, x.shape[-2], block)
    ]
