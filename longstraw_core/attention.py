"""Segmented attention: branch queries over stored prefix segments plus the branch itself.

The one attention kernel the stack shares (``docs/design.md``, "Segmented attention").
Prefill chunks attend over the prefix filled so far plus the chunk; branch replay attends over
the whole prompt state plus the branch; rollout decodes ``B`` branches that share one prefix.

Each key segment is attended separately, returning ``(out, lse)``, and the results merge by
log-sum-exp. Prefix segments are never concatenated with the branch, copied or expanded over
the batch or the GQA group: the batch and the group are folded into the query axis instead,
and keys are visited in blocks so no full score matrix is built. Backward recomputes the
probabilities block by block from the saved ``lse`` (the FlashAttention backward), so the
graph holds only ``q``, the branch K/V, ``out``, ``lse`` and references to the prefix.

Backends:
- ``"torch"``: pure PyTorch, any device, dtype and head dims. Accumulates in float32
  (float64 for float64 inputs). A prefix segment may live on another device (CPU offload):
  it is moved one block at a time.
- ``"flash"``: flash-attn 2's ``_flash_attn_forward`` / ``_flash_attn_backward`` per
  segment. Backward calls the kernel per key chunk with the *merged* ``out`` and ``lse``
  (the ring-attention identity), which yields that chunk's exact gradients.
- ``"sdpa"``: the same wrapper over PyTorch's own CUDA flash kernels
  (``aten._scaled_dot_product_flash_attention``, ``longstraw_core.sdpa_flash``): fused
  attention on CUDA with nothing to build. ``"auto"`` takes flash-attn when installed and
  usable, else these, else the torch backend.

It stays one module (about 800 lines) on purpose: each backend is the forward and backward
of one ``autograd.Function``, which must be read together (backward recomputes from what
forward saved), and both backends share the entry point's checks, the segment merging and the
block budgets that tests patch here.

NOTE: what has been run. The torch backend is tested on CPU (float64 against a plain
softmax reference, gradcheck, a no-copy check). The flash backend's wrapper logic (layouts,
batch folding, merging, chunked backward) is tested on CPU against a pure-torch stand-in for
flash-attn's two functions. The real flash-attn kernels have NOT been run: the calls were
written from the flash-attn 2.8.x source (``flash_attn/flash_attn_interface.py``) without a
GPU; a test compares them with the torch backend when CUDA and flash-attn are present. The
sdpa backend is the same wrapper over PyTorch's CUDA flash ops, tested on CPU against a
stand-in with those ops' contract; ``make gpu-check`` compares it with the torch backend.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from longstraw_core import gpu_emulation, sdpa_flash

Segment = tuple[torch.Tensor, torch.Tensor]

# Budget, in elements, for one block's scores plus its K/V when block_size is None.
_MAX_SCORE_ELEMENTS = 1 << 22  # ~16 MB of fp32 scores: big blocks thrash memory on CPU
# Keys per flash-attn backward call when block_size is None (bounds the dK/dV scratch).
_FLASH_BWD_CHUNK = 1 << 16
# Keys per fused CPU backward call (bounds its dK/dV scratch for long prefix segments).
_FUSED_BWD_CHUNK = 1 << 14
# Number of non-tensor arguments before the flat prefix tensors in ``Function.apply``.
_N_LEADING_ARGS = 8


def kernel_budgets() -> dict[str, int]:
    """The block budgets above as they are now (read when called: tests patch them), for the
    memory planner: ``score_elements``, ``flash_bwd_keys``, ``fused_bwd_keys``."""
    return {
        "score_elements": _MAX_SCORE_ELEMENTS,
        "flash_bwd_keys": _FLASH_BWD_CHUNK,
        "fused_bwd_keys": _FUSED_BWD_CHUNK,
    }


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


def segmented_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: Sequence[Segment] = (),
    *,
    scale: float,
    backend: str = "auto",
    block_size: int | None = None,
    prefix_grads: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None,
    reuse: AttentionOutput | None = None,
    keep: list[AttentionOutput] | None = None,
) -> torch.Tensor:
    """Attention of branch queries over prefix segments (fully visible) and the branch (causal).

    Args:
        q: ``[B, H, Tq, Dk]`` branch queries.
        k: ``[B, KVH, Tk, Dk]`` branch keys, ``Tk >= Tq``. Query ``i`` sits at branch position
            ``Tk - Tq + i`` and sees branch keys up to that position (bottom-right causal).
        v: ``[B, KVH, Tk, Dv]`` branch values.
        prefix: ``(k_seg [KVH, L, Dk], v_seg [KVH, L, Dv])`` pairs shared by all ``B`` rows;
            every query sees every prefix key. Gradients flow to them when they require grad.
        scale: softmax scale applied to ``q @ k^T``.
        backend: ``"auto"`` (flash-attn when usable, else PyTorch's SDPA flash kernels when
            usable, else torch), ``"torch"``, ``"flash"`` or ``"sdpa"``.
        block_size: keys per block in the torch backend (and per backward call in the flash
            backend); ``None`` keeps one block's scores and K/V under ~4M elements.
        prefix_grads: optional ``(dk_buffer, dv_buffer)`` per prefix segment, shaped like it
            (either may be ``None``). Backward *adds* the segment's gradients into them, block
            by block, instead of returning them: exact mode accumulates ``dL/dstate`` over many
            branches and chunks without a state-sized temporary per call. Backward runs only
            if some input requires grad.
        reuse: the ``AttentionOutput`` an earlier call computed from these same inputs (the
            same values, not just shapes: nothing checks that). The forward then computes
            nothing and returns ``reuse.out`` as part of the graph; backward is unchanged.
        keep: a list the forward appends this call's ``AttentionOutput`` to.

    Returns:
        ``[B, H, Tq, Dv]`` in the dtype of ``q``. Query head ``h`` reads kv head
        ``h // (H // KVH)``, as transformers' ``repeat_kv`` does.
    """
    segments = tuple((ks, vs) for ks, vs in prefix)
    _check_shapes(q, k, v, segments)
    function = _FUNCTIONS[_choose_backend(backend, q, k, v, segments)]
    flat = [t for segment in segments for t in segment]
    sinks = _check_sinks(prefix_grads, segments)
    if reuse is not None:
        _check_reuse(reuse, q, v)
    return function.apply(q, k, v, float(scale), block_size, sinks, reuse, keep, *flat)


def _check_reuse(reuse: AttentionOutput, q: torch.Tensor, v: torch.Tensor) -> None:
    batch, heads, length, _ = q.shape
    if reuse.out.shape != (batch, heads, length, v.shape[-1]) or reuse.lse.shape != (
        batch,
        heads,
        length,
    ):
        raise ValueError(
            f"reuse holds out {tuple(reuse.out.shape)} / lse {tuple(reuse.lse.shape)} for "
            f"queries {tuple(q.shape)}: it must come from the same span's attention"
        )


def _check_sinks(
    prefix_grads: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]] | None,
    segments: Sequence[Segment],
) -> tuple[tuple[torch.Tensor | None, torch.Tensor | None], ...]:
    """One ``(dk, dv)`` accumulation buffer pair per segment (``None`` where not wanted)."""
    if prefix_grads is None:
        return tuple((None, None) for _ in segments)
    sinks = tuple(tuple(pair) for pair in prefix_grads)
    if len(sinks) != len(segments):
        raise ValueError(f"prefix_grads has {len(sinks)} pairs for {len(segments)} segments")
    for i, (pair, segment) in enumerate(zip(sinks, segments, strict=True)):
        for buffer, tensor in zip(pair, segment, strict=True):
            if buffer is not None and buffer.shape != tensor.shape:
                raise ValueError(
                    f"prefix_grads[{i}] buffer {tuple(buffer.shape)} does not match its "
                    f"segment {tuple(tensor.shape)}"
                )
    return sinks


def _check_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[Segment]
) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [B, heads, T, head_dim]")
    b, h, tq, dk = q.shape
    kvh, tk, dv = k.shape[1], k.shape[2], v.shape[3]
    if k.shape != (b, kvh, tk, dk) or v.shape[:3] != (b, kvh, tk):
        raise ValueError(f"branch k {tuple(k.shape)} / v {tuple(v.shape)} do not match q")
    if h % kvh != 0:
        raise ValueError(f"query heads {h} not a multiple of kv heads {kvh}")
    if tq < 1 or tk < tq:
        raise ValueError(f"need 1 <= Tq <= Tk, got Tq={tq}, Tk={tk}")
    for i, (ks, vs) in enumerate(segments):
        length = ks.shape[1] if ks.dim() == 3 else -1
        if ks.shape != (kvh, length, dk) or vs.shape != (kvh, length, dv):
            raise ValueError(
                f"prefix segment {i}: k {tuple(ks.shape)} / v {tuple(vs.shape)}, "
                f"expected [{kvh}, L, {dk}] / [{kvh}, L, {dv}]"
            )


def _unflatten_segments(flat: Sequence[torch.Tensor]) -> list[Segment]:
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What attention scores and sums accumulate in: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attention results over disjoint key sets. ``lse_a`` must be finite."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return out_a * weight_a + out_b * weight_b, lse


# ---------------------------------------------------------------------------------------------
# Torch backend. Layouts: the branch is attended as [B, KVH, R, D] with R = n_rep * Tq (the
# GQA group folded into the query axis); prefix segments as [KVH, B * R, D] (the batch folded
# in as well), so one matmul per block serves every row without expanding the prefix.
# ---------------------------------------------------------------------------------------------


def _group_rows(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, H, T, D] -> [B, KVH, n_rep * T, D]``: query head h lands in kv head h // n_rep."""
    b, h, t, d = x.shape
    return x.reshape(b, kv_heads, (h // kv_heads) * t, d)


def _fold_batch(x: torch.Tensor) -> torch.Tensor:
    """``[B, KVH, R, ...] -> [KVH, B * R, ...]``: shared prefix keys serve all rows at once."""
    return x.transpose(0, 1).reshape(x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])


def _unfold_batch(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of ``_fold_batch`` (a view)."""
    return x.reshape(x.shape[0], batch, x.shape[1] // batch, *x.shape[2:]).transpose(0, 1)


def _branch_query_positions(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Branch position of each grouped query row (bottom-right aligned causal)."""
    n_rep, tq, tk = q.shape[1] // k.shape[1], q.shape[2], k.shape[2]
    return (tk - tq + torch.arange(tq, device=q.device)).repeat(n_rep)


def _block_length(block_size: int | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Keys per block: the given size, or one that keeps the block's scores and its K/V
    (converted to the accumulation dtype) under ``_MAX_SCORE_ELEMENTS``."""
    if block_size is not None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        return block_size
    per_key = q.numel() // q.shape[-1] + (k.numel() + v.numel()) // max(k.shape[-2], 1)
    return max(1, _MAX_SCORE_ELEMENTS // max(per_key, 1))


def _key_blocks(length: int, block: int) -> range:
    return range(0, length, block)


def _load_block(x: torch.Tensor, start: int, block: int, like: torch.Tensor) -> torch.Tensor:
    """Keys/values ``[start, start + block)`` on the device and dtype of the computation."""
    return x[..., start : start + block, :].to(device=like.device, dtype=like.dtype)


def _block_scores(
    q: torch.Tensor,
    k_block: torch.Tensor,
    scale: float,
    query_positions: torch.Tensor | None,
    start: int,
) -> torch.Tensor:
    """``scale * q @ k^T`` for one key block, causally masked when positions are given."""
    scores = (q @ k_block.transpose(-1, -2)) * scale
    if query_positions is not None:
        key_positions = torch.arange(start, start + k_block.shape[-2], device=q.device)
        hidden = key_positions[None, :] > query_positions[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def _cpu_flash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    query_positions: torch.Tensor | None,
    block_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out, lse)`` from PyTorch's fused CPU flash-attention kernel, or None if it can't.

    The forward of prefill chunks and rollout steps is compute-bound on CPU; the fused kernel
    is ~20x faster than the blocked torch loop and returns the log-sum-exp the merge needs.
    Backward still recomputes block by block (below), so only the forward changes. Used for
    float32/half inputs with equal key and value widths and no explicit ``block_size``: a
    prefix segment (``q [KVH, R, D]``, all keys visible) or a branch attending to itself
    (``Tq == Tk``, causal); decode steps (``Tq < Tk``) keep the torch path.
    """
    if not _cpu_flash_usable(q, k, v, query_positions, block_size):
        return None
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if query_positions is None:  # a shared prefix segment: [KVH, R, D] over [KVH, L, D]
        out, lse = kernel(q[None], k[None], v[None], 0.0, False, scale=scale)
        return out[0], lse[0].to(q.dtype)
    batch, kv_heads, rows, _ = q.shape
    n_rep = rows // k.shape[2]
    out, lse = kernel(*_causal_heads(q, k, v, n_rep), 0.0, True, scale=scale)
    return out.reshape(batch, kv_heads, rows, -1), lse.reshape(batch, kv_heads, rows).to(q.dtype)


def _cpu_flash_usable(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions: torch.Tensor | None,
    block_size: int | None,
) -> bool:
    """Whether PyTorch's fused CPU flash kernels can serve this segment.

    float32/half inputs on CPU with equal key and value widths and no explicit
    ``block_size`` (tests use it to exercise the blocked path); either a prefix segment (no
    ``query_positions``: every key visible) or a branch attending to itself with one query
    per key (causal). Decode steps (fewer queries than keys) keep the torch path.
    """
    if (
        q.device.type != "cpu"
        or block_size is not None
        or q.dtype not in (torch.float32, torch.bfloat16, torch.float16)
        or k.dtype != q.dtype
        or v.dtype != q.dtype
        or k.shape[-1] != v.shape[-1]
        or k.device != q.device
    ):
        return False
    return query_positions is None or int(query_positions[0]) == 0


def _causal_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped rows ``[B, KVH, n_rep * T, D]`` back to heads, with the branch K/V repeated
    per query head (the branch only: small), as the fused kernels want them."""
    batch, kv_heads, rows, dim = q.shape
    heads_q = q.reshape(batch, kv_heads * n_rep, rows // n_rep, dim)
    return heads_q, k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)


def _cpu_flash_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    d_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    query_positions: torch.Tensor | None,
    need_k: bool,
    need_v: bool,
    sinks: tuple[torch.Tensor | None, torch.Tensor | None],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``_segment_backward`` through PyTorch's fused CPU flash backward (~3x the blocked loop).

    A prefix segment is visited ``_FUSED_BWD_CHUNK`` keys per call, so the kernel's dK/dV
    scratch stays chunk-sized however long the prefix is; each call gets the merged
    ``out``/``lse`` and so returns that chunk's exact share.
    """
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    lse = lse.float()
    if query_positions is not None:  # the branch over itself, causal
        batch, kv_heads, rows, _ = q.shape
        n_rep = rows // k.shape[2]
        heads = _causal_heads(q, k, v, n_rep)
        heads_out = out.reshape(heads[0].shape[:-1] + out.shape[-1:])
        d_q, d_k, d_v = kernel(
            d_out.reshape(heads_out.shape), *heads, heads_out, lse.reshape(heads_out.shape[:-1]),
            0.0, True, scale=scale,
        )  # fmt: skip
        d_k = d_k.reshape(batch, kv_heads, n_rep, *k.shape[2:]).sum(2) if need_k else None
        d_v = d_v.reshape(batch, kv_heads, n_rep, *v.shape[2:]).sum(2) if need_v else None
        return d_q.reshape(q.shape), d_k, d_v
    d_q = torch.zeros_like(q)
    d_k = torch.empty_like(k) if need_k else None
    d_v = torch.empty_like(v) if need_v else None
    for start in _key_blocks(k.shape[-2], _FUSED_BWD_CHUNK):
        keys = _load_block(k, start, _FUSED_BWD_CHUNK, q)
        values = _load_block(v, start, _FUSED_BWD_CHUNK, q)
        chunk_d_q, chunk_d_k, chunk_d_v = kernel(
            d_out[None], q[None], keys[None], values[None], out[None], lse[None], 0.0, False,
            scale=scale,
        )  # fmt: skip
        d_q += chunk_d_q[0]
        _store(d_k, sinks[0], start, _FUSED_BWD_CHUNK, chunk_d_k[0])
        _store(d_v, sinks[1], start, _FUSED_BWD_CHUNK, chunk_d_v[0])
    return d_q, d_k, d_v


def _segment_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    block_size: int | None,
    query_positions: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax attention of ``q [..., R, Dk]`` over one non-empty segment.

    Returns ``(out [..., R, Dv], lse [..., R])`` in the dtype of ``q``.
    """
    fast = _cpu_flash_forward(q, k, v, scale, query_positions, block_size)
    if fast is not None:
        return fast
    block = _block_length(block_size, q, k, v)
    row_max = q.new_full(q.shape[:-1], float("-inf"))
    row_sum = q.new_zeros(q.shape[:-1])
    acc = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    for start in _key_blocks(k.shape[-2], block):
        scores = _block_scores(q, _load_block(k, start, block, q), scale, query_positions, start)
        new_max = torch.maximum(row_max, scores.amax(-1))
        # NOTE: a row with no visible key yet keeps max -inf; shift by 0 to avoid inf - inf.
        shift = new_max.masked_fill(new_max == float("-inf"), 0.0)
        decay = torch.exp(row_max - shift)
        probs = torch.exp(scores - shift.unsqueeze(-1))
        row_sum = row_sum * decay + probs.sum(-1)
        acc = acc * decay.unsqueeze(-1) + probs @ _load_block(v, start, block, q)
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
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """FlashAttention backward over one segment, recomputing probabilities per key block.

    ``dK``/``dV`` sum over every query row of the layout, hence over the GQA group (and the
    batch for folded prefix rows). They are written block by block into tensors shaped and
    placed like ``k``/``v``, or added into the ``sinks`` buffers when those are given.
    ``out``/``lse`` are the *merged* results over every segment, so each segment's share
    of the gradients is exact (the ring-attention identity).
    """
    if _cpu_flash_usable(q, k, v, query_positions, block_size):
        return _cpu_flash_backward(
            q, k, v, d_out, out, lse, scale, query_positions, need_k, need_v, sinks
        )
    block = _block_length(block_size, q, k, v)
    d_q = torch.zeros_like(q)
    d_k = torch.empty_like(k) if need_k else None
    d_v = torch.empty_like(v) if need_v else None
    sink_k, sink_v = sinks
    for start in _key_blocks(k.shape[-2], block):
        k_block = _load_block(k, start, block, q)
        scores = _block_scores(q, k_block, scale, query_positions, start)
        probs = torch.exp(scores - lse.unsqueeze(-1))
        if d_v is not None or sink_v is not None:
            _store(d_v, sink_v, start, block, probs.transpose(-1, -2) @ d_out)
        d_probs = d_out @ _load_block(v, start, block, q).transpose(-1, -2)
        d_scores = probs * (d_probs - d_sum.unsqueeze(-1)) * scale
        d_q += d_scores @ k_block
        if d_k is not None or sink_k is not None:
            _store(d_k, sink_k, start, block, d_scores.transpose(-1, -2) @ q)
    return d_q, d_k, d_v


def _store(
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


def _torch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    block_size: int | None,
    flat_prefix: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch backend's forward: ``out [B, H, Tq, Dv]`` in the dtype of ``q`` and the
    merged ``lse`` in grouped rows ``[B, KVH, n_rep * Tq]`` (accumulation dtype)."""
    batch, heads, tq, _ = q.shape
    q_rows = _group_rows(q, k.shape[1]).to(accumulation_dtype(q.dtype))
    positions = _branch_query_positions(q, k)
    out, lse = _segment_forward(q_rows, k, v, scale, block_size, positions)
    q_folded = _fold_batch(q_rows)
    for k_seg, v_seg in _unflatten_segments(flat_prefix):
        if k_seg.shape[1] == 0:
            continue
        seg_out, seg_lse = _segment_forward(q_folded, k_seg, v_seg, scale, block_size, None)
        out, lse = _merge(out, lse, _unfold_batch(seg_out, batch), _unfold_batch(seg_lse, batch))
    return out.to(q.dtype).reshape(batch, heads, tq, v.shape[-1]), lse


class _TorchSegmentedAttention(torch.autograd.Function):
    """Pure-torch segmented attention; see ``segmented_attention`` for the arguments."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        block_size: int | None,
        sinks: tuple[tuple[torch.Tensor | None, torch.Tensor | None], ...],
        reuse: AttentionOutput | None,
        keep: list[AttentionOutput] | None,
        *flat_prefix: torch.Tensor,
    ) -> torch.Tensor:
        batch, heads, tq, _ = q.shape
        if reuse is not None:  # lse in grouped rows, as _torch_attention returns it
            result = reuse.out.to(q.dtype, copy=True)
            lse = _group_rows(reuse.lse[..., None], k.shape[1])[..., 0]
        else:
            result, lse = _torch_attention(q, k, v, scale, block_size, flat_prefix)
        if keep is not None:
            keep.append(AttentionOutput(result.detach(), lse.reshape(batch, heads, tq)))
        ctx.save_for_backward(q, k, v, result, lse, *flat_prefix)
        ctx.scale, ctx.block_size, ctx.sinks = scale, block_size, sinks
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, d_result: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, result, lse, *flat_prefix = ctx.saved_tensors
        needs, scale, block_size = ctx.needs_input_grad, ctx.scale, ctx.block_size
        batch, kv_heads = q.shape[0], k.shape[1]
        q_rows = _group_rows(q, kv_heads).to(lse.dtype)
        d_out = _group_rows(d_result, kv_heads).to(lse.dtype)
        out = _group_rows(result, kv_heads).to(lse.dtype)
        d_sum = (d_out * out).sum(-1)

        positions = _branch_query_positions(q, k)
        d_q, d_k, d_v = _segment_backward(
            q_rows, k, v, d_out, out, lse, d_sum, scale, block_size, positions,
            needs[1], needs[2],
        )  # fmt: skip
        q_f, d_out_f, out_f, lse_f, d_sum_f = (
            _fold_batch(x) for x in (q_rows, d_out, out, lse, d_sum)
        )
        prefix_grads: list[torch.Tensor | None] = []
        for i, (k_seg, v_seg) in enumerate(_unflatten_segments(flat_prefix)):
            need_k, need_v = needs[_N_LEADING_ARGS + 2 * i : _N_LEADING_ARGS + 2 * i + 2]
            sinks = ctx.sinks[i]
            if needs[0] or need_k or need_v or any(sink is not None for sink in sinks):
                seg_d_q, seg_d_k, seg_d_v = _segment_backward(
                    q_f, k_seg, v_seg, d_out_f, out_f, lse_f, d_sum_f, scale, block_size, None,
                    need_k, need_v, sinks,
                )  # fmt: skip
                d_q += _unfold_batch(seg_d_q, batch)
                prefix_grads += [seg_d_k, seg_d_v]
            else:
                prefix_grads += [None, None]
        d_q = d_q.to(q.dtype).reshape(q.shape) if needs[0] else None
        return d_q, d_k, d_v, *([None] * (_N_LEADING_ARGS - 3)), *prefix_grads


# ---------------------------------------------------------------------------------------------
# Flash backend (flash-attn 2). Layout there is [B, T, H, D]. A prefix segment [KVH, L, D]
# becomes the view [1, L, KVH, D] (stride(-1) == 1, no copy) and the batch is folded into the
# query length, non-causal. The branch runs causal (bottom-right aligned, like ours).
# ---------------------------------------------------------------------------------------------

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
# Keyword names of flash-attn 2.8's low-level functions, used when the signature is opaque.
_FLASH_FORWARD_NAMES = frozenset(
    {"dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right"}
    | {"softcap", "alibi_slopes", "return_softmax"}
)
_FLASH_BACKWARD_NAMES = (_FLASH_FORWARD_NAMES - {"return_softmax"}) | {"deterministic"}


@functools.cache
def _flash_interface() -> ModuleType | None:
    try:
        from flash_attn import flash_attn_interface
    except ImportError:
        return None
    return flash_attn_interface


def _fused_unsupported_reason(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[Segment]
) -> str | None:
    """Why neither fused CUDA kernel (flash-attn's, SDPA's) can take these inputs, or None."""
    if not gpu_emulation.takes_gpu_path(q):
        return "inputs are not on CUDA"
    if q.dtype not in _FLASH_DTYPES:
        return f"dtype {q.dtype} (flash-attn needs float16 or bfloat16)"
    head_dim = q.shape[-1]
    if v.shape[-1] != head_dim or head_dim % 8 != 0 or head_dim > 256:
        return f"head dims q/k {head_dim}, v {v.shape[-1]} (need equal, multiple of 8, <= 256)"
    tensors = [k, v, *(t for segment in segments for t in segment)]
    if any(t.device != q.device or t.dtype != q.dtype for t in tensors):
        return "every K/V tensor must share q's device and dtype"
    if any(t.stride(-1) != 1 for t in tensors):
        return "K/V tensors need stride(-1) == 1 (flash-attn would copy them)"
    return None


def _unsupported_reason(
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Sequence[Segment],
) -> str | None:
    """Why ``backend`` (``"flash"`` or ``"sdpa"``) cannot take these inputs, or None."""
    reason = _fused_unsupported_reason(q, k, v, segments)
    if reason is not None:
        return reason
    if backend == "flash":
        return "flash_attn is not installed" if _flash_interface() is None else None
    return sdpa_flash.unsupported_reason(q)


_BACKENDS = ("auto", "torch", "flash", "sdpa")


def _choose_backend(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[Segment]
) -> str:
    """The backend that runs: the one asked for (an error if it can't), or for ``"auto"``
    the first usable of flash-attn, SDPA's flash kernels and torch."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {list(_BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return backend
    if backend != "auto":
        reason = _unsupported_reason(backend, q, k, v, segments)
        if reason is not None:
            raise RuntimeError(f"segmented_attention backend={backend!r} is unavailable: {reason}")
        return backend
    for fused in ("flash", "sdpa"):
        if _unsupported_reason(fused, q, k, v, segments) is None:
            return fused
    return "torch"


def _parameter_names(function: Callable, fallback: frozenset[str]) -> frozenset[str]:
    """Keyword names of a flash-attn function (a plain function or a torch custom op)."""
    target = getattr(function, "_init_fn", function)  # torch.library.custom_op keeps it here
    try:
        names = frozenset(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return fallback
    return names if "softmax_scale" in names else fallback


def _flash_options(function: Callable, fallback: frozenset[str], **options: object) -> dict:
    """No dropout, no window, no softcap, for whichever flash-attn 2 signature is installed."""
    names = _parameter_names(function, fallback)
    options |= {"dropout_p": 0.0, "window_size": (-1, -1)}  # window as a pair before 2.7
    options |= {"window_size_left": -1, "window_size_right": -1, "softcap": 0.0}
    options |= {"alibi_slopes": None, "return_softmax": False, "deterministic": False}
    return {name: value for name, value in options.items() if name in names}


def _flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One flash-attn forward in [B, T, H, D] layout: ``(out, lse [B, H, T] float32)``."""
    function = _flash_interface()._flash_attn_forward
    options = _flash_options(function, _FLASH_FORWARD_NAMES, softmax_scale=scale, causal=causal)
    results = function(q, k, v, **options)
    # Newer flash-attn returns (out, lse, S, rng); older (out, q, k, v, out_padded, lse, S, rng).
    lse = results[1] if len(results) == 4 else results[5]
    return results[0], lse[..., : q.shape[1]]


def _flash_backward(
    d_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    causal: bool,
) -> None:
    """One flash-attn backward, writing into ``grads = (dq, dk, dv)``."""
    function = _flash_interface()._flash_attn_backward
    options = _flash_options(function, _FLASH_BACKWARD_NAMES, softmax_scale=scale, causal=causal)
    function(d_out, q, k, v, out, lse, *grads, **options)


def _as_flash_segment(x: torch.Tensor) -> torch.Tensor:
    """``[KVH, L, D] -> [1, L, KVH, D]`` as a view."""
    return x.transpose(0, 1).unsqueeze(0)


class _FusedKernels(NamedTuple):
    """A fused kernel pair in flash-attn's ``[B, T, H, D]`` layout: ``forward(q, k, v, scale,
    causal) -> (out, lse [B, H, T])`` and ``backward(d_out, q, k, v, out, lse, (dq, dk, dv),
    scale, causal)`` writing the gradients into the given tensors."""

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., None]


# Looked up at call time (tests patch ``_flash_interface`` and ``sdpa_flash._ops``).
_FLASH_ATTN = _FusedKernels(lambda *a: _flash_forward(*a), lambda *a: _flash_backward(*a))
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
    sinks: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients from one prefix segment, one fused backward call per key chunk.

    ``folded = (q, d_out, out, lse)`` with the batch folded into the query length and the
    *merged* ``out``/``lse``: with them, the kernel returns this chunk's exact share of the
    gradients. Chunking bounds the dK/dV scratch of a segment that needs no gradient.
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
            scale, False,
        )  # fmt: skip
        d_q += grads[0]
        for sink, grad in zip(sinks, (d_keys, d_values), strict=True):
            if sink is not None:
                sink[:, start : start + chunk] += grad.to(device=sink.device, dtype=sink.dtype)
    return d_q, d_k, d_v


def _flash_attention(
    kernels: _FusedKernels,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    flat_prefix: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused backends' forward: merged ``out [B, Tq, H, D]`` and ``lse [B, H, Tq]``."""
    batch, heads, tq, dim = q.shape
    q_flash = q.transpose(1, 2)
    out, lse = kernels.forward(q_flash, k.transpose(1, 2), v.transpose(1, 2), scale, True)
    out, lse = out.float(), lse.transpose(1, 2)  # merged as [B, Tq, H, D] and [B, Tq, H]
    q_folded = q_flash.reshape(1, batch * tq, heads, dim)
    for k_seg, v_seg in _unflatten_segments(flat_prefix):
        if k_seg.shape[1] == 0:
            continue
        seg_out, seg_lse = kernels.forward(
            q_folded, _as_flash_segment(k_seg), _as_flash_segment(v_seg), scale, False
        )
        seg_lse = seg_lse[..., : batch * tq].reshape(heads, batch, tq).permute(1, 2, 0)
        out, lse = _merge(out, lse, seg_out.view(batch, tq, heads, dim).float(), seg_lse)
    return out.to(q.dtype), lse.permute(0, 2, 1).contiguous()  # flash-attn's [B, H, Tq]


def _fused_forward(
    kernels: _FusedKernels,
    ctx: FunctionCtx,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    block_size: int | None,
    sinks: tuple[tuple[torch.Tensor | None, torch.Tensor | None], ...],
    reuse: AttentionOutput | None,
    keep: list[AttentionOutput] | None,
    flat_prefix: Sequence[torch.Tensor],
) -> torch.Tensor:
    """The forward of the fused backends' ``autograd.Function`` (their kernels differ)."""
    if reuse is not None:
        out = reuse.out.transpose(1, 2).to(
            q.dtype, memory_format=torch.contiguous_format, copy=True
        )
        lse = reuse.lse.to(torch.float32, memory_format=torch.contiguous_format)
    else:
        out, lse = _flash_attention(kernels, q, k, v, scale, flat_prefix)
    if keep is not None:
        keep.append(AttentionOutput(out.transpose(1, 2).detach(), lse))
    ctx.save_for_backward(q, k, v, out, lse, *flat_prefix)
    ctx.scale, ctx.block_size, ctx.sinks = scale, block_size, sinks
    return out.transpose(1, 2)


def _fused_backward(
    kernels: _FusedKernels, ctx: FunctionCtx, d_result: torch.Tensor
) -> tuple[torch.Tensor | None, ...]:
    """The backward of the fused backends' ``autograd.Function``."""
    q, k, v, out, lse, *flat_prefix = ctx.saved_tensors
    needs, scale = ctx.needs_input_grad, ctx.scale
    batch, heads, tq, dim = q.shape
    q_flash, d_out = q.transpose(1, 2), d_result.transpose(1, 2).contiguous()
    k_flash, v_flash = k.transpose(1, 2), v.transpose(1, 2)
    grads = (torch.empty_like(out), torch.empty_like(k_flash), torch.empty_like(v_flash))
    kernels.backward(d_out, q_flash, k_flash, v_flash, out, lse, grads, scale, True)
    d_q = grads[0].float()

    folded = (
        q_flash.reshape(1, batch * tq, heads, dim),
        d_out.view(1, batch * tq, heads, dim),
        out.view(1, batch * tq, heads, dim),
        lse.transpose(0, 1).reshape(1, heads, batch * tq),
    )
    chunk = ctx.block_size or _FLASH_BWD_CHUNK
    prefix_grads: list[torch.Tensor | None] = []
    for i, (k_seg, v_seg) in enumerate(_unflatten_segments(flat_prefix)):
        need_k, need_v = needs[_N_LEADING_ARGS + 2 * i : _N_LEADING_ARGS + 2 * i + 2]
        sinks = ctx.sinks[i]
        if needs[0] or need_k or need_v or any(sink is not None for sink in sinks):
            seg_d_q, seg_d_k, seg_d_v = _flash_segment_backward(
                kernels, k_seg, v_seg, folded, need_k, need_v, scale, chunk, sinks
            )
            d_q += seg_d_q.view_as(d_q)
            prefix_grads += [seg_d_k, seg_d_v]
        else:
            prefix_grads += [None, None]
    return (
        d_q.to(q.dtype).transpose(1, 2) if needs[0] else None,
        grads[1].transpose(1, 2) if needs[1] else None,
        grads[2].transpose(1, 2) if needs[2] else None,
        *([None] * (_N_LEADING_ARGS - 3)),
        *prefix_grads,
    )


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
        scale: float,
        block_size: int | None,
        sinks: tuple[tuple[torch.Tensor | None, torch.Tensor | None], ...],
        reuse: AttentionOutput | None,
        keep: list[AttentionOutput] | None,
        *flat_prefix: torch.Tensor,
    ) -> torch.Tensor:
        return _fused_forward(
            kernels, ctx, q, k, v, scale, block_size, sinks, reuse, keep, flat_prefix
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


_FUNCTIONS: dict[str, type[torch.autograd.Function]] = {
    "torch": _TorchSegmentedAttention,
    "flash": _FlashSegmentedAttention,
    "sdpa": _SdpaSegmentedAttention,
}
