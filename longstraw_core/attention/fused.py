"""The fused backends: flash-attn's kernels (``"flash"``) and PyTorch's CUDA flash kernels
(``"sdpa"``) under one wrapper, one ``autograd.Function`` each.

Layout there is [B, T, H, D]. A prefix segment [KVH, L, D] becomes the view [1, L, KVH, D]
(stride(-1) == 1, no copy) and the batch is folded into the query length, non-causal. The
branch runs causal (bottom-right aligned, like ours). Backward calls the kernel per key chunk
with the *merged* ``out`` and ``lse`` (the ring-attention identity), which yields that chunk's
exact gradients.

Attention sinks (``sink [H]``, gpt-oss') are folded in after the merge, where neither
kernel needs to know of them (``common.fold_sink``): ``lse' = logaddexp(lse, sink)``,
``out' = out * exp(lse - lse')``. Every backward call takes ``out'``/``lse'`` and ``dout'``,
so the kernels recompute ``P' = exp(S - lse')`` and ``D = rowsum(dout' * out')``, the
sink-aware ones, and return exact dq/dk/dv; the sink's gradient,
``-sum_rows exp(sink - lse') * D``, is computed here (``_sink_grad``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from longstraw_core.attention import flash_backend, sdpa_flash
from longstraw_core.attention.blocks import group_rows
from longstraw_core.attention.common import (
    N_LEADING_ARGS,
    AttentionOutput,
    fold_sink,
    merge,
    sink_row_grads,
    unflatten_segments,
)
from longstraw_core.attention.ragged import ragged_branch

# Keys per flash-attn backward call when block_size is None (bounds the dK/dV scratch).
FLASH_BWD_CHUNK = 1 << 16


def _as_flash_segment(x: torch.Tensor) -> torch.Tensor:
    """``[KVH, L, D] -> [1, L, KVH, D]`` as a view."""
    return x.transpose(0, 1).unsqueeze(0)


class _FusedKernels(NamedTuple):
    """A fused kernel pair in flash-attn's ``[B, T, H, D]`` layout: ``forward(q, k, v, scale,
    causal, window) -> (out, lse [B, H, T])`` and ``backward(d_out, q, k, v, out, lse, (dq,
    dk, dv), scale, causal, window)`` writing the gradients into the given tensors
    (``window``: a sliding window on the causal branch segment, or None)."""

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., None]


# Looked up at call time (tests patch ``flash_backend.flash_interface`` and ``sdpa_flash._ops``).
_FLASH_ATTN = _FusedKernels(
    lambda *a: flash_backend.forward(*a), lambda *a: flash_backend.backward(*a)
)
_SDPA_FLASH = _FusedKernels(lambda *a: sdpa_flash.forward(*a), lambda *a: sdpa_flash.backward(*a))


def _flash_segment_backward(
    kernels: _FusedKernels,
    k_seg: torch.Tensor,
    v_seg: torch.Tensor,
    folded: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    need_k: bool,
    need_v: bool,
    scale: float,
    chunk: int,
    buffers: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients from one prefix segment, one fused backward call per key chunk.

    ``folded = (q, d_out, out, lse)`` with the batch folded into the query length and the
    *merged* ``out``/``lse``: with them, the kernel returns this chunk's exact share of the
    gradients. Chunking bounds the dK/dV scratch of a segment that needs no gradient.
    ``buffers``: ``prefix_grads``' pair for this segment, which the gradients are added into.
    """
    q, d_out, out, lse = folded
    d_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    d_k = torch.empty_like(k_seg) if need_k else None
    d_v = torch.empty_like(v_seg) if need_v else None
    for start in range(0, k_seg.shape[1], chunk):
        keys, values = k_seg[:, start : start + chunk], v_seg[:, start : start + chunk]
        d_keys = d_k[:, start : start + chunk] if d_k is not None else torch.empty_like(keys)
        d_values = d_v[:, start : start + chunk] if d_v is not None else torch.empty_like(values)
        grads = (torch.empty(q.shape, dtype=q.dtype, device=q.device),)
        grads += (_as_flash_segment(d_keys), _as_flash_segment(d_values))
        kernels.backward(
            d_out, q, _as_flash_segment(keys), _as_flash_segment(values), out, lse, grads,
            scale, False, None,
        )  # fmt: skip
        d_q += grads[0]
        for buffer, grad in zip(buffers, (d_keys, d_values), strict=True):
            if buffer is not None:
                buffer[:, start : start + chunk] += grad.to(buffer.device, buffer.dtype)
    return d_q, d_k, d_v


def _flash_attention(
    kernels: _FusedKernels,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    flat_prefix: Sequence[torch.Tensor],
    branch_positions: torch.Tensor | None = None,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused backends' forward: merged ``out [B, Tq, H, D]`` and ``lse [B, H, Tq]``.
    ``branch_positions``: a ragged decode step, whose (short) branch segment is attended
    with an explicit mask (``ragged``) and merged with the kernels' prefix segments.
    ``window``: the branch segment's sliding window (the kernels' own ``window_size``).
    ``sink``: per-head attention sinks, folded in after the merge (both results hold it)."""
    batch, heads, tq, dim = q.shape
    q_flash = q.transpose(1, 2)
    if branch_positions is None:
        k_flash, v_flash = k.transpose(1, 2), v.transpose(1, 2)
        out, lse = kernels.forward(q_flash, k_flash, v_flash, scale, True, window)
        out, lse = out.float(), lse.transpose(1, 2)  # merged as [B, Tq, H, D] and [B, Tq, H]
    else:
        rows = group_rows(q, k.shape[1])
        out, lse = ragged_branch(rows, k, v, scale, branch_positions, window)
        out = out.reshape(batch, heads, tq, -1).transpose(1, 2).float()
        lse = lse.reshape(batch, heads, tq).transpose(1, 2).float()
    q_folded = q_flash.reshape(1, batch * tq, heads, dim)
    for k_seg, v_seg in unflatten_segments(flat_prefix):
        if k_seg.shape[1] == 0:
            continue
        seg_out, seg_lse = kernels.forward(
            q_folded, _as_flash_segment(k_seg), _as_flash_segment(v_seg), scale, False, None
        )
        seg_lse = seg_lse[..., : batch * tq].reshape(heads, batch, tq).permute(1, 2, 0)
        out, lse = merge(out, lse, seg_out.view(batch, tq, heads, dim).float(), seg_lse)
    if sink is not None:  # lse is [B, Tq, H] here: the sink broadcasts over its last axis
        out, lse = fold_sink(out, lse, sink.to(lse.device))
    return out.to(q.dtype), lse.permute(0, 2, 1).contiguous()  # flash-attn's [B, H, Tq]


def ragged_forward(
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    flat_prefix: Sequence[torch.Tensor],
    branch_positions: torch.Tensor,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """A ragged decode step (forward only) on fused ``backend``: ``[B, H, Tq, Dv]``."""
    kernels = _FLASH_ATTN if backend == "flash" else _SDPA_FLASH
    out, _ = _flash_attention(kernels, q, k, v, scale, flat_prefix, branch_positions, window, sink)
    return out.transpose(1, 2)


def _fused_forward(
    kernels: _FusedKernels,
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
    flat_prefix: Sequence[torch.Tensor],
) -> torch.Tensor:
    """The forward of the fused backends' ``autograd.Function`` (their kernels differ). An
    output ``reuse`` passes in or ``keep`` takes holds the sink already, as the torch
    backend's does."""
    if reuse is not None:
        out = reuse.out.transpose(1, 2).to(
            q.dtype, memory_format=torch.contiguous_format, copy=True
        )
        lse = reuse.lse.to(torch.float32, memory_format=torch.contiguous_format)
    else:
        out, lse = _flash_attention(kernels, q, k, v, scale, flat_prefix, None, window, sink)
    if keep is not None:
        keep.append(AttentionOutput(out.transpose(1, 2).detach(), lse))
    extra = () if sink is None else (sink,)
    ctx.save_for_backward(q, k, v, out, lse, *flat_prefix, *extra)
    ctx.scale, ctx.block_size, ctx.window = scale, block_size, window
    ctx.prefix_grads, ctx.has_sink = prefix_grads, sink is not None
    return out.transpose(1, 2)


def _fused_backward(
    kernels: _FusedKernels, ctx: FunctionCtx, d_result: torch.Tensor
) -> tuple[torch.Tensor | None, ...]:
    """The backward of the fused backends' ``autograd.Function``: every kernel call takes the
    saved ``out``/``lse`` (the sink folded in, if any), so each returns its exact share."""
    saved = ctx.saved_tensors
    sink = saved[-1] if ctx.has_sink else None
    q, k, v, out, lse, *flat_prefix = saved[:-1] if ctx.has_sink else saved
    needs, scale = ctx.needs_input_grad, ctx.scale
    batch, heads, tq, dim = q.shape
    q_flash, d_out = q.transpose(1, 2), d_result.transpose(1, 2).contiguous()
    k_flash, v_flash = k.transpose(1, 2), v.transpose(1, 2)
    grads = (torch.empty_like(out), torch.empty_like(k_flash), torch.empty_like(v_flash))
    kernels.backward(d_out, q_flash, k_flash, v_flash, out, lse, grads, scale, True, ctx.window)
    d_q = grads[0].float()
    d_sink = _sink_grad(sink, d_out, out, lse) if sink is not None and needs[3] else None

    folded = (
        q_flash.reshape(1, batch * tq, heads, dim),
        d_out.view(1, batch * tq, heads, dim),
        out.view(1, batch * tq, heads, dim),
        lse.transpose(0, 1).reshape(1, heads, batch * tq),
    )
    chunk = ctx.block_size or FLASH_BWD_CHUNK
    prefix_grads: list[torch.Tensor | None] = []
    for i, (k_seg, v_seg) in enumerate(unflatten_segments(flat_prefix)):
        need_k, need_v = needs[N_LEADING_ARGS + 2 * i : N_LEADING_ARGS + 2 * i + 2]
        buffers = ctx.prefix_grads[i]
        if needs[0] or need_k or need_v or any(buffer is not None for buffer in buffers):
            seg_d_q, seg_d_k, seg_d_v = _flash_segment_backward(
                kernels, k_seg, v_seg, folded, need_k, need_v, scale, chunk, buffers
            )
            d_q += seg_d_q.view_as(d_q)
            prefix_grads += [seg_d_k, seg_d_v]
        else:
            prefix_grads += [None, None]
    return (
        d_q.to(q.dtype).transpose(1, 2) if needs[0] else None,
        grads[1].transpose(1, 2) if needs[1] else None,
        grads[2].transpose(1, 2) if needs[2] else None,
        d_sink,
        *([None] * (N_LEADING_ARGS - 4)),
        *prefix_grads,
    )


def _sink_grad(
    sink: torch.Tensor, d_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> torch.Tensor:
    """``d_sink [H]`` from ``d_out``/``out`` ``[B, Tq, H, D]`` (with the sink in) and ``lse'``
    ``[B, H, Tq]``: ``D = rowsum(dout' * out')`` in float32, as the kernels form it."""
    d_sum = (d_out.float() * out.float()).sum(-1).transpose(1, 2)  # [B, H, Tq]
    rows = sink_row_grads(sink.to(lse.device)[:, None], lse, d_sum)
    return rows.sum((0, 2)).to(sink.dtype)


def _fused_attention_function(
    name: str, kernels: _FusedKernels, doc: str
) -> type[torch.autograd.Function]:
    """A segmented-attention autograd function over fused ``kernels`` (one per backend; same
    arguments as ``_TorchSegmentedAttention``): the kernels are all that differ."""

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
        return _fused_forward(
            kernels,
            ctx,
            q,
            k,
            v,
            sink,
            scale,
            block_size,
            window,
            prefix_grads,
            reuse,
            keep,
            flat_prefix,
        )

    def backward(ctx: FunctionCtx, d_result: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _fused_backward(kernels, ctx, d_result)

    body = {"__doc__": doc, "forward": staticmethod(forward)}
    body["backward"] = staticmethod(once_differentiable(backward))
    return type(name, (torch.autograd.Function,), body)


_FlashSegmentedAttention = _fused_attention_function(
    "_FlashSegmentedAttention", _FLASH_ATTN, "flash-attn 2 segmented attention."
)
_SdpaSegmentedAttention = _fused_attention_function(
    "_SdpaSegmentedAttention",
    _SDPA_FLASH,
    "The flash backend's wrapper over PyTorch's CUDA flash kernels (``sdpa_flash``).",
)
