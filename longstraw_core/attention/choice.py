"""Which backend runs a call: the one asked for, or for ``"auto"`` the first usable of
flash-attn, PyTorch's CUDA flash kernels and torch, with the reason a fused one cannot."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from longstraw_core.attention import flash_backend, sdpa_flash
from longstraw_core.attention.common import Segment
from longstraw_core.attention.flash_backend import FLASH_DTYPES
from longstraw_core.tensors import gpu_emulation


def fused_unsupported_reason(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[Segment]
) -> str | None:
    """Why neither fused CUDA kernel (flash-attn's, SDPA's) can take these inputs, or None."""
    if not gpu_emulation.takes_gpu_path(q):
        return "inputs are not on CUDA"
    if q.dtype not in FLASH_DTYPES:
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


def unsupported_reason(
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Sequence[Segment],
) -> str | None:
    """Why ``backend`` (``"flash"`` or ``"sdpa"``) cannot take these inputs, or None."""
    reason = fused_unsupported_reason(q, k, v, segments)
    if reason is not None:
        return reason
    if backend == "flash":
        if flash_backend.flash_interface() is None:
            return "flash_attn is not installed"
        return flash_backend.unsupported_version_reason()
    return sdpa_flash.unsupported_reason(q)


BACKENDS = ("auto", "torch", "flash", "sdpa")


def choose_backend(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[Segment]
) -> str:
    """The backend that runs: the one asked for (an error if it can't), or for ``"auto"``
    the first usable of flash-attn, SDPA's flash kernels and torch."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return backend
    if backend != "auto":
        reason = unsupported_reason(backend, q, k, v, segments)
        if reason is not None:
            raise RuntimeError(f"segmented_attention backend={backend!r} is unavailable: {reason}")
        return backend
    for fused in ("flash", "sdpa"):
        if unsupported_reason(fused, q, k, v, segments) is None:
            return fused
    return "torch"
