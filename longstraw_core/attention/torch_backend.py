"""The torch backend: online-softmax attention per segment, key block by key block, its
FlashAttention-style backward, and their ``autograd.Function`` (``_TorchSegmentedAttention``,
with or without attention sinks).
Pure PyTorch, any device, dtype and head dims; PyTorch's fused CPU kernels take a segment's
forward and backward where they can (``cpu_flash``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from longstraw_core.attention import cpu_flash
from longstraw_core.attention.blocks import (
    block_length,
    block_scores,
    branch_query_positions,
    fold_batch,
    group_rows,
    key_blocks,
    load_block,
    store,
    unfold_batch,
)
from longstraw_core.attention.common import (
    N_LEADING_ARGS,
    AttentionOutput,
    accumulation_dtype,
    fold_sink,
    merge,
    sink_row_grads,
    unflatten_segments,
)
from longstraw_core.attention.ragged import ragged_branch


def _segment_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    block_size: int | None,
    query_positions: torch.Tensor | None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax attention of ``q [..., R, Dk]`` over one non-empty segment
    (``window``: a sliding window over the causal positions, ``block_scores``).

    Returns ``(out [..., R, Dv], lse [..., R])`` in the dtype of ``q``.
    """
    if window is None:  # PyTorch's fused CPU kernels take no window
        fast = cpu_flash.forward(q, k, v, scale, query_positions, block_size)
        if fast is not None:
            return fast
    block = block_length(block_size, q, k, v)
    row_max = q.new_full(q.shape[:-1], float("-inf"))
    row_sum = q.new_zeros(q.shape[:-1])
    acc = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    for start in key_blocks(k.shape[-2], block):
        k_block = load_block(k, start, block, q)
        scores = block_scores(q, k_block, scale, query_positions, start, window)
        new_max = torch.maximum(row_max, scores.amax(-1))
        # NOTE: a row with no visible key yet keeps max -inf; shift by 0 to avoid inf - inf.
        shift = new_max.masked_fill(new_max == float("-inf"), 0.0)
        decay = torch.exp(row_max - shift)
        probs = torch.exp(scores - shift.unsqueeze(-1))
        row_sum = row_sum * decay + probs.sum(-1)
        acc = acc * decay.unsqueeze(-1) + probs @ load_block(v, start, block, q)
        row_max = new_max
    return acc / row_sum.unsqueeze(-1), row_max + torch.log(row_sum)


def _segment_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    d_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    d_sum: torch.Tensor,
    scale: float,
    block_size: int | None,
    query_positions: torch.Tensor | None,
    need_k: bool,
    need_v: bool,
    sinks: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """FlashAttention backward over one segment, recomputing probabilities per key block.

    ``dK``/``dV`` sum over every query row of the layout, hence over the GQA group (and the
    batch for folded prefix rows). They are written block by block into tensors shaped and
    placed like ``k``/``v``, or added into the ``sinks`` buffers when those are given.
    ``out``/``lse`` are the *merged* results over every segment, so each segment's share
    of the gradients is exact (the ring-attention identity).
    """
    if window is None and cpu_flash.usable(q, k, v, query_positions, block_size):
        return cpu_flash.backward(
            q, k, v, d_out, out, lse, scale, query_positions, need_k, need_v, sinks
        )
    block = block_length(block_size, q, k, v)
    d_q = torch.zeros_like(q)
    d_k = torch.empty_like(k) if need_k else None
    d_v = torch.empty_like(v) if need_v else None
    sink_k, sink_v = sinks
    for start in key_blocks(k.shape[-2], block):
        k_block = load_block(k, start, block, q)
        scores = block_scores(q, k_block, scale, query_positions, start, window)
        probs = torch.exp(scores - lse.unsqueeze(-1))
        if d_v is not None or sink_v is not None:
            store(d_v, sink_v, start, block, probs.transpose(-1, -2) @ d_out)
        d_probs = d_out @ load_block(v, start, block, q).transpose(-1, -2)
        d_scores = probs * (d_probs - d_sum.unsqueeze(-1)) * scale
        d_q += d_scores @ k_block
        if d_k is not None or sink_k is not None:
            store(d_k, sink_k, start, block, d_scores.transpose(-1, -2) @ q)
    return d_q, d_k, d_v


def _torch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    block_size: int | None,
    flat_prefix: Sequence[torch.Tensor],
    branch_positions: torch.Tensor | None = None,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch backend's forward: ``out [B, H, Tq, Dv]`` in the dtype of ``q`` and the
    merged ``lse`` in grouped rows ``[B, KVH, n_rep * Tq]`` (accumulation dtype).
    ``branch_positions``: a ragged decode step's (``ragged``); ``window``: the branch's
    sliding window; ``sink``: per-head attention sinks (``segmented_attention``)."""
    batch, heads, tq, _ = q.shape
    q_rows = group_rows(q, k.shape[1]).to(accumulation_dtype(q.dtype))
    if branch_positions is None:
        positions = branch_query_positions(q, k)
        out, lse = _segment_forward(q_rows, k, v, scale, block_size, positions, window)
    else:
        out, lse = ragged_branch(q_rows, k, v, scale, branch_positions, window)
    q_folded = fold_batch(q_rows)
    for k_seg, v_seg in unflatten_segments(flat_prefix):
        if k_seg.shape[1] == 0:
            continue
        seg_out, seg_lse = _segment_forward(q_folded, k_seg, v_seg, scale, block_size, None)
        out, lse = merge(out, lse, unfold_batch(seg_out, batch), unfold_batch(seg_lse, batch))
    if sink is not None:  # one more key per head, of logit ``sink`` and value zero
        out, lse = fold_sink(out, lse, sink_rows(sink, k.shape[1], tq, lse.dtype))
    return out.to(q.dtype).reshape(batch, heads, tq, v.shape[-1]), lse


def sink_rows(sink: torch.Tensor, kv_heads: int, tq: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-head sink logits ``[H]`` laid out as the grouped rows ``[KVH, n_rep * Tq]``."""
    rows = sink.to(dtype).reshape(kv_heads, -1, 1).expand(-1, -1, tq)
    return rows.reshape(kv_heads, -1)


class _TorchSegmentedAttention(torch.autograd.Function):
    """Pure-torch segmented attention, with per-head attention sinks (gpt-oss' ``sinks``) when
    ``sink`` is not None; see ``segmented_attention`` for the arguments."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sink: torch.Tensor | None,
        scale: float,
        block_size: int | None,
        window: int | None,
        prefix_grads: tuple[tuple[torch.Tensor | None, torch.Tensor | None], ...],
        reuse: AttentionOutput | None,
        keep: list[AttentionOutput] | None,
        *flat_prefix: torch.Tensor,
    ) -> torch.Tensor:
        batch, heads, tq, _ = q.shape
        if reuse is not None:  # lse in grouped rows, as _torch_attention returns it
            result = reuse.out.to(q.dtype, copy=True)  # (with the sink in, if any)
            lse = group_rows(reuse.lse[..., None], k.shape[1])[..., 0]
        else:
            result, lse = _torch_attention(
                q, k, v, scale, block_size, flat_prefix, None, window, sink
            )
        if keep is not None:
            keep.append(AttentionOutput(result.detach(), lse.reshape(batch, heads, tq)))
        extra = () if sink is None else (sink,)
        ctx.save_for_backward(q, k, v, result, lse, *flat_prefix, *extra)
        ctx.scale, ctx.block_size, ctx.window = scale, block_size, window
        ctx.prefix_grads, ctx.has_sink = prefix_grads, sink is not None
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, d_result: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """With a sink, ``result``/``lse`` were saved with the sink in (``fold_sink``), so the
        FlashAttention backward below is exact as it stands; the sink's own gradient is
        ``-sum_rows exp(sink - lse') * D`` (``sink_row_grads``)."""
        saved = ctx.saved_tensors
        sink = saved[-1] if ctx.has_sink else None
        q, k, v, result, lse, *flat_prefix = saved[:-1] if ctx.has_sink else saved
        needs, scale, block_size = ctx.needs_input_grad, ctx.scale, ctx.block_size
        batch, kv_heads = q.shape[0], k.shape[1]
        q_rows = group_rows(q, kv_heads).to(lse.dtype)
        d_out = group_rows(d_result, kv_heads).to(lse.dtype)
        out = group_rows(result, kv_heads).to(lse.dtype)
        d_sum = (d_out * out).sum(-1)
        d_sink = None
        if sink is not None and needs[3]:
            rows = sink_rows(sink, kv_heads, q.shape[2], lse.dtype)
            d_rows = sink_row_grads(rows, lse, d_sum).sum(0)  # [KVH, n_rep * Tq]
            d_sink = d_rows.reshape(kv_heads, -1, q.shape[2]).sum(-1).reshape(sink.shape)
            d_sink = d_sink.to(sink.dtype)

        positions = branch_query_positions(q, k)
        d_q, d_k, d_v = _segment_backward(
            q_rows, k, v, d_out, out, lse, d_sum, scale, block_size, positions,
            needs[1], needs[2], window=ctx.window,
        )  # fmt: skip
        folded = (fold_batch(x) for x in (q_rows, d_out, out, lse, d_sum))
        q_f, d_out_f, out_f, lse_f, d_sum_f = folded
        grads: list[torch.Tensor | None] = []
        for i, (k_seg, v_seg) in enumerate(unflatten_segments(flat_prefix)):
            need_k, need_v = needs[N_LEADING_ARGS + 2 * i : N_LEADING_ARGS + 2 * i + 2]
            buffers = ctx.prefix_grads[i]
            if needs[0] or need_k or need_v or any(b is not None for b in buffers):
                seg_d_q, seg_d_k, seg_d_v = _segment_backward(
                    q_f, k_seg, v_seg, d_out_f, out_f, lse_f, d_sum_f, scale, block_size,
                    None, need_k, need_v, buffers,
                )  # fmt: skip
                d_q += unfold_batch(seg_d_q, batch)
                grads += [seg_d_k, seg_d_v]
            else:
                grads += [None, None]
        d_q = d_q.to(q.dtype).reshape(q.shape) if needs[0] else None
        return (d_q, d_k, d_v, d_sink, *([None] * (N_LEADING_ARGS - 4)), *grads)
