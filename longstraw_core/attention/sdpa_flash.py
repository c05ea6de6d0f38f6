"""PyTorch's own flash-attention kernels (the CUDA SDPA flash backend) behind the two
primitives ``segmented_attention``'s flash backend is written against.

Why: flash-attn must be built against the installed torch (no wheel matches every torch),
while every CUDA build of PyTorch ships the same FlashAttention-2 kernels as
``aten._scaled_dot_product_flash_attention`` and its backward, which return and take the
log-sum-exp the segment merge needs. So a CUDA machine gets fused attention with nothing
to compile. The ops take ``[B, H, T, D]`` and transpose to flash's ``[B, T, H, D]``
internally; the primitives here take ``[B, T, H, D]`` like flash-attn's, so the transposes
are views both ways (no copy). Query heads may be a multiple of the key/value heads (the
vendored kernel reads the group natively); causal masking is bottom-right aligned, as in
flash-attn 2.1+, which is what the branch's causal part needs.

Dropout is always 0, so the random-number state the backward takes is never read: a
placeholder is passed for it (a prefix segment's backward runs per key chunk, with no
matching forward call to take it from).

NOTE: what has been run. On CPU, the layouts and argument handling against a plain-torch
stand-in with the ops' contract (``tests/attention/test_attention.py``). The CUDA ops themselves have
NOT run yet: ``make gpu-check`` compares them with the torch backend.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256


@functools.cache
def _ops() -> tuple[Callable, Callable] | None:
    """``(forward, backward)`` aten ops, or None when this torch build has none."""
    aten = torch.ops.aten
    try:
        return (
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_backward.default,
        )
    except (AttributeError, RuntimeError):
        return None


def unsupported_reason(query: torch.Tensor) -> str | None:
    """Why the SDPA flash kernels cannot serve ``query``'s device (None: they can); the
    caller checks dtypes, head dims and strides, which flash-attn shares."""
    if _ops() is None:
        return "this torch has no aten._scaled_dot_product_flash_attention"
    if query.is_cuda and not _flash_capable(query.device):
        return "this GPU or torch build has no SDPA flash kernels (needs sm80+)"
    return None


@functools.cache
def _flash_capable(device: torch.device) -> bool:
    available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    return bool(available()) and torch.cuda.get_device_capability(device)[0] >= 8


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward in ``[B, T, H, D]`` layout: ``(out [B, T, H, D], lse [B, H, T] float32)``."""
    op = _ops()[0]
    out, lse, *_ = op(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, False, scale=scale
    )
    return out.transpose(1, 2).contiguous(), lse  # contiguous: a view already on CUDA


def backward(
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
    """One backward in ``[B, T, H, D]`` layout, writing into ``grads = (dq, dk, dv)``.

    ``out``/``lse`` may be the merged results over several key sets (the ring-attention
    identity): the gradients are then this call's keys' exact share.
    """
    op = _ops()[1]
    seed = torch.zeros(2, dtype=torch.int64, device=q.device)  # never read: no dropout
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    results = op(
        *(x.transpose(1, 2) for x in (d_out, q, k, v, out)), lse.contiguous(), None, None,
        q.shape[1], k.shape[1], 0.0, causal, seed, offset, scale=scale,
    )  # fmt: skip
    for grad, value in zip(grads, results[:3], strict=True):
        grad.copy_(value.transpose(1, 2))
