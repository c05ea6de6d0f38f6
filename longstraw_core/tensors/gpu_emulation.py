"""Fake CPU tensors that take a CUDA run's code paths, for dry runs at real dimensions.

Why: ``longstraw_core.scale_check`` runs whole GRPO steps on ``FakeTensor``s (shapes, no
memory) to measure what a GPU run would hold. Its tensors must stay on the CPU: a fake CUDA
tensor cannot even be sliced in a CPU build of PyTorch (indexing takes a CUDA device guard).
Inside ``gpu_kernels()`` the code chooses, for fake tensors, what it chooses on a GPU:

- attention: PyTorch's flash SDPA kernels (``sdpa_flash``), whose aten ops have fake
  implementations, instead of the CPU's blocked loop or fused CPU kernel;
- Gated DeltaNet: flash-linear-attention's chunked and fused-recurrent kernels. They are
  Triton kernels with no fake implementation, so the stand-ins below allocate what fla's
  Python allocates around each launch (same shapes, dtypes and lifetimes) and save what it
  saves for backward, and compute nothing. Modelled on fla 0.6
  (``fla/ops/gated_delta_rule/chunk.py``, ``fused_recurrent.py``).

Real tensors are never affected: a real CPU tensor runs the CPU's kernels, in or out of the
context.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from longstraw_core.tensors.fake import is_fake

_EMULATING: ContextVar[bool] = ContextVar("longstraw_gpu_emulation", default=False)
_CHUNK = 64  # fla's chunk length for the gated delta rule


@contextmanager
def gpu_kernels() -> Iterator[None]:
    """Fake tensors choose the CUDA kernels inside this context (see the module)."""
    token = _EMULATING.set(True)
    try:
        yield
    finally:
        _EMULATING.reset(token)


def emulating() -> bool:
    """Whether fake tensors take CUDA's code paths now (``gpu_kernels``)."""
    return _EMULATING.get()


def emulated(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor standing in for a CUDA one."""
    return emulating() and is_fake(tensor)


def takes_gpu_path(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is on CUDA, or a fake tensor standing in for one."""
    return tensor.is_cuda or emulated(tensor)


# --- flash-linear-attention stand-ins -------------------------------------------------------


def _l2norm(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's ``l2norm_fwd``: the normalised copy and one float32 rstd per row."""
    rows = x.numel() // x.shape[-1]
    return torch.empty_like(x), x.new_empty(rows, dtype=torch.float32)


class _ChunkGatedDeltaRule(torch.autograd.Function):
    """``ChunkGatedDeltaRuleFunction``'s allocations; no values."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor | None,
        output_final_state: bool,
        l2norm: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        q_rstd = k_rstd = None
        if l2norm:
            (q, q_rstd), (k, k_rstd) = _l2norm(q), _l2norm(k)
        batch, length, heads_v, dv = v.shape
        dk, chunks = k.shape[-1], math.ceil(length / _CHUNK)
        g = torch.empty_like(g, dtype=torch.float32)  # chunk_local_cumsum
        a = k.new_empty(batch, length, heads_v, _CHUNK)  # the solved (I + A)^-1 per chunk
        w, u = k.new_empty(batch, length, heads_v, dk), torch.empty_like(v)  # WY form
        h = k.new_empty(batch, chunks, heads_v, dk, dv)  # the state entering every chunk
        final = None
        if output_final_state:
            final = k.new_empty(batch, heads_v, dk, dv, dtype=torch.float32)
        v_new = torch.empty_like(u)
        out = torch.empty_like(v_new)  # chunk_fwd_o, while w, u, h and v_new are alive
        del w, u, h, v_new
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, a, initial_state)
        ctx.l2norm = l2norm
        return out, final

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        d_out: torch.Tensor,
        d_final: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        q, _, k, _, v, g, beta, _, initial_state = ctx.saved_tensors
        batch, length, heads_v, dv = v.shape
        dk, chunks = k.shape[-1], math.ceil(length / _CHUNK)
        w, u = k.new_empty(batch, length, heads_v, dk), torch.empty_like(v)  # recompute_w_u
        h, v_new = k.new_empty(batch, chunks, heads_v, dk, dv), torch.empty_like(u)
        d_v = torch.empty_like(d_out)  # chunk_bwd_dv_local
        d_h = q.new_empty(batch, chunks, heads_v, dk, dv)  # chunk_gated_delta_rule_bwd_dhu
        d_h0 = None if initial_state is None else torch.empty_like(initial_state)
        d_v = torch.empty_like(d_v)
        d_q, d_k = q.new_empty(q.shape), k.new_empty(k.shape)  # chunk_bwd_dqkwg
        d_g, d_w = torch.empty_like(g), torch.empty_like(w)
        del h, d_h
        d_k2, d_v = k.new_empty(k.shape), torch.empty_like(v)  # prepare_wy_repr_bwd
        d_beta, d_g2 = torch.empty_like(beta), torch.empty_like(g)
        del w, u, v_new, d_w, d_k2, d_g2
        d_g = torch.empty_like(d_g)  # the reverse cumsum
        if ctx.l2norm:
            d_q, d_k = torch.empty_like(q), torch.empty_like(k)  # l2norm_bwd
        return d_q, d_k, d_v, d_g, d_beta, d_h0, None, None


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_gated_delta_rule`` for fake tensors (the keywords LongStraw passes)."""
    return _ChunkGatedDeltaRule.apply(
        q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel
    )


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``fused_recurrent_gated_delta_rule`` (decoding, no backward) for fake tensors:
    the output and the float32 final state; the kernel normalises q and k in registers."""
    batch, _, heads_v, dv = v.shape
    final = None
    if output_final_state:
        final = q.new_empty(batch, heads_v, k.shape[-1], dv, dtype=torch.float32)
    return torch.empty_like(v), final
