"""flash-attn 2's kernels behind the two primitives the fused backends are written against
(``forward``, ``backward``, in flash-attn's ``[B, T, H, D]`` layout), for whichever 2.x
signature is installed; ``flash_interface`` is None without flash-attn."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import ModuleType

import torch

FLASH_DTYPES = (torch.float16, torch.bfloat16)
# Keyword names of flash-attn 2.8's low-level functions, used when the signature is opaque.
_FLASH_FORWARD_NAMES = frozenset(
    {"dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right"}
    | {"softcap", "alibi_slopes", "return_softmax"}
)
_FLASH_BACKWARD_NAMES = (_FLASH_FORWARD_NAMES - {"return_softmax"}) | {"deterministic"}


@functools.cache
def flash_interface() -> ModuleType | None:
    try:
        from flash_attn import flash_attn_interface
    except ImportError:
        return None
    return flash_attn_interface


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


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One flash-attn forward in [B, T, H, D] layout: ``(out, lse [B, H, T] float32)``."""
    function = flash_interface()._flash_attn_forward
    options = _flash_options(function, _FLASH_FORWARD_NAMES, softmax_scale=scale, causal=causal)
    results = function(q, k, v, **options)
    # Newer flash-attn returns (out, lse, S, rng); older (out, q, k, v, out_padded, lse, S, rng).
    lse = results[1] if len(results) == 4 else results[5]
    return results[0], lse[..., : q.shape[1]]


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
    """One flash-attn backward, writing into ``grads = (dq, dk, dv)``."""
    function = flash_interface()._flash_attn_backward
    options = _flash_options(function, _FLASH_BACKWARD_NAMES, softmax_scale=scale, causal=causal)
    function(d_out, q, k, v, out, lse, *grads, **options)
