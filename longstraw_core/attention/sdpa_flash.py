"""PyTorch's own flash-attention kernels behind the two primitives ``segmented_attention``'s
fused backends are written against (``forward``, ``backward``, ``[B, T, H, D]`` layout).

Why: flash-attn must be built against the installed torch (no wheel matches every torch),
while every CUDA build of PyTorch ships FlashAttention-2 kernels. So a CUDA machine gets fused
attention with nothing to compile.

Forward: the public ``torch.nn.attention.varlen.varlen_attn(...,
return_aux=AuxRequest(lse=True))``, which returns the log-sum-exp the segment merge needs
(``scaled_dot_product_attention`` returns none). Inputs are packed ``[B*T, H, D]`` with
cumulative lengths; query heads may be a multiple of the key/value heads (``enable_gqa``);
causal (``window_size=(-1, 0)``) is bottom-right aligned as in flash-attn 2.1+, which the
branch's causal part needs. Its lse comes as ``[H, B*T]``.

Backward: each segment is differentiated against the *merged* ``out``/``lse`` of all segments
(the ring-attention identity). ``varlen_attn``'s autograd drops the lse gradient and uses its
own saved ``out``/``lse``, and no public torch function takes an external lse (FlexAttention
takes an lse gradient but needs ``torch.compile`` on a GPU and has no CPU backward). So the
backward calls ``aten._flash_attention_backward``, the op ``varlen_attn``'s own backward
calls, with the same arguments it passes, from ``_private_backward`` alone; ``_ops`` checks
the op's schema and refuses (naming the torch versions) where it differs.

NOTE: what has been run. On CPU, the layouts and argument handling against plain-torch
stand-ins with the two functions' contracts (``tests/support/flash_standins.py``) and the
fake-tensor dry runs. The CUDA kernels themselves have NOT run yet: ``make gpu-check``
compares them with the torch backend.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

from longstraw_core.attention.common import window_left

SUPPORTED_TEXT = "torch 2.10 or newer (torch.nn.attention.varlen.varlen_attn with return_aux)"
# What ``_private_backward`` passes to ``aten._flash_attention_backward`` (varlen's own call).
_BACKWARD_ARGUMENTS = (
    "grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k",
    "max_q", "max_k", "dropout_p", "is_causal", "rng_state", "unused", "scale",
    "window_size_left", "window_size_right",
)  # fmt: skip


@functools.cache
def _ops() -> tuple[Callable, Callable] | None:
    """``(varlen_attn, aten._flash_attention_backward)``, or None when this torch lacks them
    or their signatures differ from what this module calls."""
    try:
        from torch.nn.attention import varlen

        backward = torch.ops.aten._flash_attention_backward.default
    except (ImportError, AttributeError, RuntimeError):
        return None
    forward = getattr(varlen, "varlen_attn", None)
    if forward is None or not hasattr(varlen, "AuxRequest"):
        return None
    wanted = {"return_aux", "scale", "window_size", "enable_gqa"}
    if not wanted <= set(inspect.signature(forward).parameters):
        return None
    names = {argument.name for argument in backward._schema.arguments}
    if not set(_BACKWARD_ARGUMENTS) <= names:
        return None
    return forward, backward


def unsupported_reason(query: torch.Tensor) -> str | None:
    """Why the SDPA flash kernels cannot serve ``query``'s device (None: they can); the
    caller checks dtypes, head dims and strides, which flash-attn shares."""
    if _ops() is None:
        return f"this torch has no usable varlen flash attention (needs {SUPPORTED_TEXT})"
    if query.is_cuda and not _flash_capable(query.device):
        return "this GPU or torch build has no SDPA flash kernels (needs sm80+)"
    return None


@functools.cache
def _flash_capable(device: torch.device) -> bool:
    available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    return bool(available()) and torch.cuda.get_device_capability(device)[0] >= 8


def _packed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, T, H, D]`` as varlen's ``[B*T, H, D]`` (a view for B == 1, the prefix segments)
    and the cumulative lengths (int32, on the device: no host synchronisation)."""
    batch, tq, tk = q.shape[0], q.shape[1], k.shape[1]
    steps = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    packed = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
    return (*packed, steps * tq, steps * tk)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward in ``[B, T, H, D]`` layout: ``(out [B, T, H, D], lse [B, H, T] float32)``.
    ``window``: each query sees its own key and the ``window - 1`` before it (causal)."""
    from torch.nn.attention.varlen import AuxRequest

    batch, tq, heads, _ = q.shape
    q_, k_, v_, cu_q, cu_k = _packed(q, k, v)
    out, lse = _ops()[0](
        q_, k_, v_, cu_q, cu_k, tq, k.shape[1], return_aux=AuxRequest(lse=True), scale=scale,
        window_size=(window_left(causal, window), 0 if causal else -1), enable_gqa=True,
    )  # fmt: skip
    return out.reshape(batch, tq, heads, -1), lse.reshape(heads, batch, tq).transpose(0, 1)


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
    """One backward in ``[B, T, H, D]`` layout, writing into ``grads = (dq, dk, dv)``.

    ``out``/``lse`` may be the merged results over several key sets (the ring-attention
    identity): the gradients are then this call's keys' exact share.
    """
    batch, tq, heads, _ = q.shape
    q_, k_, v_, cu_q, cu_k = _packed(q, k, v)
    d_out_, out_ = (x.reshape(batch * tq, heads, -1).contiguous() for x in (d_out, out))
    lse_ = lse.transpose(0, 1).reshape(heads, batch * tq).contiguous()  # the kernel's [H, BT]
    results = _private_backward(d_out_, q_, k_, v_, out_, lse_, cu_q, cu_k, tq, k.shape[1],
                                scale, causal, window_left(causal, window))  # fmt: skip
    for grad, value in zip(grads, results[:3], strict=True):
        grad.copy_(value.reshape(grad.shape))


def _private_backward(
    d_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    causal: bool,
    window_left: int = -1,
) -> tuple[torch.Tensor, ...]:
    """The one private op (see the module), called as ``varlen_attn``'s backward calls it:
    no dropout, so the random state it takes is a placeholder it never reads."""
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    return _ops()[1](
        d_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, seed, unused,
        scale=scale, window_size_left=window_left, window_size_right=0 if causal else -1,
    )  # fmt: skip
