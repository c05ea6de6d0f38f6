"""flash-attn 2's kernels behind the two primitives the fused backends are written against
(``forward``, ``backward``, in flash-attn's ``[B, T, H, D]`` layout); ``flash_interface`` is
None without flash-attn.

Forward: the public ``flash_attn_func(..., return_attn_probs=True)``, which returns
``(out, softmax_lse [B, H, T], S_dmask)`` in flash-attn 2.6-2.8 (``S_dmask`` is empty without
dropout). The log-sum-exp is what the segment merge needs.

Backward: segmented attention differentiates each key segment against the *merged* ``out``
and ``lse`` of all segments (the ring-attention identity). flash-attn's public functions
cannot do that: ``FlashAttnFunc.backward(ctx, dout, *args)`` drops the gradient of the
returned lse and uses the ``out``/``lse`` it saved for its own call, so a segment's gradient
through the public API lacks the lse term (exactly ``P * rowsum(dO * (O_seg - O))``), and
recovering it costs a second forward and backward per segment. FlexAttention does take an
lse gradient but needs ``torch.compile`` on a GPU (its eager path materialises the scores)
and has no CPU backward. So the backward stays on flash-attn's ``_flash_attn_backward``,
behind ``_private_backward`` alone, checked against the versions whose signature is known
(``SUPPORTED``): another version fails with an error naming them, not with a wrong call.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from longstraw_core.attention.common import window_left

FLASH_DTYPES = (torch.float16, torch.bfloat16)
# flash-attn versions whose ``_flash_attn_backward`` signature ``_private_backward`` knows:
# 2.6.x takes ``window_size`` as a pair, 2.7 and 2.8 take ``window_size_left``/``_right``.
SUPPORTED = ((2, 6), (2, 7), (2, 8))
SUPPORTED_TEXT = "flash-attn 2.6.x, 2.7.x or 2.8.x"


@functools.cache
def flash_interface() -> ModuleType | None:
    """flash-attn's ``flash_attn_interface`` module, or None when flash-attn is absent."""
    try:
        from flash_attn import flash_attn_interface
    except ImportError:
        return None
    return flash_attn_interface


@functools.cache
def flash_version() -> tuple[int, int] | None:
    """The installed flash-attn's ``(major, minor)``, or None when absent or unreadable."""
    try:
        import flash_attn
    except ImportError:
        return None
    parts = str(getattr(flash_attn, "__version__", "")).split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def unsupported_version_reason() -> str | None:
    """Why the installed flash-attn cannot run the backward (None: it can)."""
    version = flash_version()
    if version in SUPPORTED:
        return None
    found = "an unreadable version" if version is None else f"{version[0]}.{version[1]}"
    return (
        f"flash-attn {found} is installed; the segment backward needs {SUPPORTED_TEXT} "
        "(install one, or set the attention backend to 'sdpa' or 'torch')"
    )


def _window_size(causal: bool, window: int | None) -> tuple[int, int]:
    """flash-attn's ``window_size``: query ``i`` sees keys ``[i + Tk - Tq - left, i + Tk - Tq
    + right]`` (bottom-right aligned, -1: unbounded). A sliding window is ``(window - 1, 0)``
    on the causal branch segment (``common.window_left``); none is ``(-1, -1)``."""
    left = window_left(causal, window)
    return (-1, -1) if left < 0 else (left, 0)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One flash-attn forward in [B, T, H, D] layout: ``(out, lse [B, H, T] float32)``.
    ``window``: a sliding window over the causal positions (``_window_size``)."""
    windowed = {} if window is None else {"window_size": _window_size(causal, window)}
    out, lse, _ = flash_interface().flash_attn_func(
        q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, return_attn_probs=True,
        **windowed,
    )  # fmt: skip
    return out, lse[..., : q.shape[1]]  # never padded in 2.6-2.8; sliced to be sure


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
    window: int | None = None,
) -> None:
    """One flash-attn backward against the given (merged) ``out``/``lse``, writing into
    ``grads = (dq, dk, dv)``. The kernel reads ``lse`` as a dense ``[B, H, T]`` array and
    ``d_out``/``out`` with ``stride(-1) == 1``: all are made so here."""
    reason = unsupported_version_reason()
    if reason is not None:
        raise RuntimeError(f"segmented_attention backend='flash': {reason}")
    d_out, out = (x if x.stride(-1) == 1 else x.contiguous() for x in (d_out, out))
    _private_backward(
        d_out, q, k, v, out, lse.contiguous(), grads, scale, causal, _window_size(causal, window)
    )


def _private_backward(
    d_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    causal: bool,
    window_size: tuple[int, int] = (-1, -1),
) -> None:
    """The one private flash-attn call (see the module): ``_flash_attn_backward`` with the
    signature of the versions in ``SUPPORTED``, no dropout, softcap or ALiBi; the forward's
    ``window_size``."""
    window = {"window_size": window_size}
    if flash_version() != (2, 6):
        window = {"window_size_left": window_size[0], "window_size_right": window_size[1]}
    flash_interface()._flash_attn_backward(
        d_out, q, k, v, out, lse, *grads, dropout_p=0.0, softmax_scale=scale, causal=causal,
        **window, softcap=0.0, alibi_slopes=None, deterministic=False,
    )  # fmt: skip
