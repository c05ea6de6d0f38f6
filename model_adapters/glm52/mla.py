"""Attention in latent space: dense causal through ``segmented_attention``, or sparse over
each query's DSA selection (``_SparseLatentAttention``, with its flash-style backward that
adds the prefix rows' gradient into exact mode's sink)."""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from longstraw_core.attention import accumulation_dtype, segmented_attention
from longstraw_core.tensors.fake import is_fake, representative
from model_adapters.glm52.family import work_elements_like


def latent_attention(
    queries: torch.Tensor,
    span_latent: torch.Tensor,
    prefix_latent: torch.Tensor,
    selection: torch.Tensor | None,
    value_dim: int,
    scale: float,
    prefix_grad: torch.Tensor | None = None,
    branch_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention in latent space: ``[B, H, T, value_dim]`` from absorbed ``queries``.

    ``queries`` ``[B, H, T, D]``; ``span_latent`` ``[B, S, D]``, each branch's own rows (``S >=
    T``: the queries are its last ``T`` positions), or ``[T, D]`` when ``B = 1``;
    ``prefix_latent`` ``[L, D]`` shared by the batch; ``selection`` ``[B, T, k]`` absolute
    positions (``[T, k]`` when ``B = 1``). Keys are latent rows ``[c_kv, k_pe]`` (one head
    shared by all query heads), values their first ``value_dim`` columns (``c_kv``), as views
    of one buffer. ``selection=None`` is dense causal attention over prefix + span through
    ``segmented_attention`` (prefix by reference); otherwise each query attends to its
    selected positions only. ``prefix_grad`` (exact mode), shaped like ``prefix_latent``:
    backward *adds* the prefix's gradient into it, block by block, instead of returning one
    (no prefix-sized temporary). ``branch_positions`` ``[B, T]``: a ragged decode step's
    query positions in each branch (``segmented_attention``; a sparse ``selection`` already
    holds each query's own positions).
    """
    if span_latent.dim() == 2:
        span_latent = span_latent[None]
        selection = None if selection is None else selection[None]
    if selection is None:
        keys = span_latent[:, None]
        prefix, sinks = [], []
        if prefix_latent.shape[0]:
            prefix = [(prefix_latent[None], prefix_latent[None, :, :value_dim])]
            if prefix_grad is not None:  # key and value views of one buffer: both add into it
                sinks = [(prefix_grad[None], prefix_grad[None, :, :value_dim])]
        return segmented_attention(
            queries,
            keys,
            keys[..., :value_dim],
            prefix,
            scale=scale,
            prefix_grads=sinks or None,
            branch_positions=branch_positions,
        )
    output = _SparseLatentAttention.apply(
        queries.transpose(1, 2),
        span_latent,
        prefix_latent,
        selection,
        value_dim,
        scale,
        prefix_grad,
    )
    return output.transpose(1, 2)


def _query_blocks(positions: torch.Tensor, dim: int, heads: int) -> list[slice]:
    """Query blocks (of ``positions`` ``[B, T, k]``) whose gathered rows and scores stay
    under the block budget (``work_elements``); on fake tensors only the representative ones."""
    batch, length, topk = positions.shape
    step = max(1, work_elements_like(positions) // (batch * topk * 3 * (dim + heads)))
    blocks = [slice(start, start + step) for start in range(0, length, step)]
    return list(representative(blocks, positions))


def _gather_rows(
    prefix_latent: torch.Tensor, span_latent: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Latent rows ``[B, b, k, D]`` at absolute ``positions`` ``[B, b, k]``, without joining
    the prefix and the span: each is gathered where it lives (``span_latent`` ``[B, S, D]``,
    one set of rows per branch) and the two are selected per entry. Padding entries (``-1``)
    yield an arbitrary row; callers mask them."""
    prefix_length = prefix_latent.shape[0]
    branch = torch.arange(span_latent.shape[0], device=positions.device)[:, None, None]
    rows = span_latent[branch, (positions - prefix_length).clamp(min=0)]
    if prefix_length:
        index = positions.clamp(0, prefix_length - 1).to(prefix_latent.device)
        prefix_rows = prefix_latent[index].to(rows.device)
        rows = torch.where((positions < prefix_length)[..., None], prefix_rows, rows)
    return rows


def _scatter_rows(
    d_span: torch.Tensor,
    d_prefixes: list[torch.Tensor],
    prefix_length: int,
    positions: torch.Tensor,
    d_rows: torch.Tensor,
) -> None:
    """Add ``d_rows [B, b, k, D]`` into the gradients of the rows they were gathered from.

    ``d_span``: ``[B, S, D]`` (contiguous); ``d_prefixes``: the buffers (any device and dtype)
    that take the prefix rows' share.
    """
    batch, span_length, dim = d_span.shape
    offsets = torch.arange(batch, device=positions.device)[:, None, None] * span_length
    span_rows = (positions - prefix_length + offsets).reshape(-1)
    positions, d_rows = positions.reshape(-1), d_rows.reshape(-1, dim)
    in_span = positions >= prefix_length
    if is_fake(positions):  # a dry run: no values to select by; the worst case, every row
        rows = d_rows.clone()  # what a boolean selection of every row copies
        d_span.view(-1, dim).index_add_(0, span_rows.clamp(min=0), rows)
        for d_prefix in d_prefixes:
            d_prefix.index_add_(0, positions.clamp(min=0).to(d_prefix.device),
                                rows.to(device=d_prefix.device, dtype=d_prefix.dtype))  # fmt: skip
        return
    d_span.view(-1, dim).index_add_(0, span_rows[in_span], d_rows[in_span])
    if d_prefixes:
        in_prefix = (positions >= 0) & ~in_span
        rows, index = d_rows[in_prefix], positions[in_prefix]
        for d_prefix in d_prefixes:
            d_prefix.index_add_(
                0,
                index.to(d_prefix.device),
                rows.to(device=d_prefix.device, dtype=d_prefix.dtype),
            )


class _SparseLatentAttention(torch.autograd.Function):
    """Each query attends to its own selected latent rows; flash-style recompute in backward.

    Arguments: ``queries [B, T, H, D]``, ``span_latent [B, S, D]`` (each branch's rows),
    ``prefix_latent [L, D]`` (shared, read by reference), ``positions [B, T, k]`` (absolute,
    ``-1`` = none), ``value_dim``, ``scale``,
    ``prefix_grad`` (``[L, D]`` or ``None``). Saves only the inputs, the output and the
    log-sum-exp; rows are gathered again per query block in backward. The prefix rows'
    gradient is added into ``prefix_grad`` (exact mode's sink) when given, and returned only
    when the prefix requires grad.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        queries: torch.Tensor,
        span_latent: torch.Tensor,
        prefix_latent: torch.Tensor,
        positions: torch.Tensor,
        value_dim: int,
        scale: float,
        prefix_grad: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if prefix_grad is not None and prefix_grad.shape != prefix_latent.shape:
            raise ValueError(
                f"prefix_grad {tuple(prefix_grad.shape)} does not match the prefix latent "
                f"{tuple(prefix_latent.shape)}"
            )
        batch, length, heads, dim = queries.shape
        dtype = accumulation_dtype(queries.dtype)
        output = queries.new_empty(batch, length, heads, value_dim)
        lse = queries.new_empty(batch, length, heads, dtype=dtype)
        for block in _query_blocks(positions, dim, heads):
            rows = _gather_rows(prefix_latent, span_latent, positions[:, block]).to(dtype)
            scores = _masked_scores(queries[:, block].to(dtype), rows, positions[:, block], scale)
            lse[:, block] = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - lse[:, block, :, None])
            output[:, block] = (probs @ rows[..., :value_dim]).to(queries.dtype)
        ctx.save_for_backward(queries, span_latent, prefix_latent, positions, output, lse)
        ctx.value_dim, ctx.scale, ctx.prefix_grad = value_dim, scale, prefix_grad
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, d_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        queries, span_latent, prefix_latent, positions, output, lse = ctx.saved_tensors
        need_query, need_span, need_prefix = ctx.needs_input_grad[:3]
        value_dim, scale, dtype = ctx.value_dim, ctx.scale, lse.dtype
        heads, dim = queries.shape[2:]
        d_queries = torch.zeros(queries.shape, dtype=dtype, device=queries.device)
        d_span = torch.zeros(span_latent.shape, dtype=dtype, device=span_latent.device)
        d_prefix = None
        if need_prefix:
            d_prefix = torch.zeros(prefix_latent.shape, dtype=dtype, device=prefix_latent.device)
        d_prefixes = [t for t in (d_prefix, ctx.prefix_grad) if t is not None]
        for block in _query_blocks(positions, dim, heads):
            rows = _gather_rows(prefix_latent, span_latent, positions[:, block]).to(dtype)
            q = queries[:, block].to(dtype)
            scores = _masked_scores(q, rows, positions[:, block], scale)
            probs = torch.exp(scores - lse[:, block, :, None])
            d_out = d_output[:, block].to(dtype)  # [B, b, H, r]
            d_sum = (d_out * output[:, block].to(dtype)).sum(-1, keepdim=True)
            d_probs = d_out @ rows[..., :value_dim].transpose(-1, -2)  # [B, b, H, k]
            d_scores = probs * (d_probs - d_sum) * scale
            d_queries[:, block] = d_scores @ rows
            if need_span or d_prefixes:
                d_rows = d_scores.transpose(-1, -2) @ q  # [B, b, k, D]
                d_rows[..., :value_dim] += probs.transpose(-1, -2) @ d_out
                _scatter_rows(
                    d_span, d_prefixes, prefix_latent.shape[0], positions[:, block], d_rows
                )
        return (
            d_queries.to(queries.dtype) if need_query else None,
            d_span.to(span_latent.dtype) if need_span else None,
            d_prefix.to(prefix_latent.dtype) if d_prefix is not None else None,
            None,
            None,
            None,
            None,
        )


def _masked_scores(
    queries: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """``scale * q . row`` ``[B, b, H, k]``, ``-inf`` at padding entries."""
    scores = (queries @ rows.transpose(-1, -2)) * scale
    return scores.masked_fill((positions < 0)[..., None, :], float("-inf"))
