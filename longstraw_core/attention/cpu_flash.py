"""PyTorch's fused CPU flash-attention kernels under the torch backend: the forward of a
prefix segment or of a branch over itself, and its backward, where they can serve the inputs
(``usable``); the blocked loop (``torch_backend``) serves the rest."""

from __future__ import annotations

import torch

from longstraw_core.attention.blocks import key_blocks, load_block, store
from longstraw_core.tensors import gpu_emulation

# Keys per fused CPU backward call (bounds its dK/dV scratch for long prefix segments).
FUSED_BWD_CHUNK = 1 << 14


def forward(
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
    if not usable(q, k, v, query_positions, block_size):
        return None
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if query_positions is None:  # a shared prefix segment: [KVH, R, D] over [KVH, L, D]
        out, lse = kernel(q[None], k[None], v[None], 0.0, False, scale=scale)
        return out[0], lse[0].to(q.dtype)
    batch, kv_heads, rows, _ = q.shape
    n_rep = rows // k.shape[2]
    out, lse = kernel(*_causal_heads(q, k, v, n_rep), 0.0, True, scale=scale)
    return out.reshape(batch, kv_heads, rows, -1), lse.reshape(batch, kv_heads, rows).to(q.dtype)


def usable(
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
    per key (causal). Decode steps (fewer queries than keys) keep the torch path. A fake
    tensor standing in for a CUDA one (a dry run, ``gpu_emulation``) takes the GPU's path:
    the blocked loop, as the torch backend runs on a GPU.
    """
    if (
        q.device.type != "cpu"
        or gpu_emulation.takes_gpu_path(q)
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


def backward(
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
    """``torch_backend._segment_backward`` through PyTorch's fused CPU flash backward (~3x the blocked loop).

    A prefix segment is visited ``FUSED_BWD_CHUNK`` keys per call, so the kernel's dK/dV
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
    for start in key_blocks(k.shape[-2], FUSED_BWD_CHUNK):
        keys = load_block(k, start, FUSED_BWD_CHUNK, q)
        values = load_block(v, start, FUSED_BWD_CHUNK, q)
        chunk_d_q, chunk_d_k, chunk_d_v = kernel(
            d_out[None], q[None], keys[None], values[None], out[None], lse[None], 0.0, False,
            scale=scale,
        )  # fmt: skip
        d_q += chunk_d_q[0]
        store(d_k, sinks[0], start, FUSED_BWD_CHUNK, chunk_d_k[0])
        store(d_v, sinks[1], start, FUSED_BWD_CHUNK, chunk_d_v[0])
    return d_q, d_k, d_v
