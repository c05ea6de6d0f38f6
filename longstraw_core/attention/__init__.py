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
- ``"flash"``: flash-attn 2's public ``flash_attn_func`` (``return_attn_probs`` for the lse)
  per segment. Backward calls the kernel per key chunk with the *merged* ``out`` and ``lse``
  (the ring-attention identity), which yields that chunk's exact gradients; no public
  function takes an external lse, so that one call is flash-attn's ``_flash_attn_backward``,
  version-checked (``flash_backend``'s docstring says why).
- ``"sdpa"``: the same wrapper over PyTorch's own CUDA flash kernels (``sdpa_flash``): the
  public ``torch.nn.attention.varlen.varlen_attn`` forward and, for the merged-lse backward,
  the op its own backward calls. Fused attention on CUDA with nothing to build. ``"auto"``
  takes flash-attn when installed and usable, else these, else the torch backend.

Attention sinks (``sink=``) run on every backend, folded in after the merge
(``common.fold_sink``); the fused kernels never see them (``fused``'s docstring).

The modules: ``common`` (``AttentionOutput``, ``accumulation_dtype``, the merge, the sink's
fold and gradient, the fused kernels' window bound),
``blocks`` (the torch backend's layouts and key blocks), ``cpu_flash`` (PyTorch's fused CPU
kernels under the torch backend), ``torch_backend``, ``flash_backend`` (flash-attn's two
functions), ``sdpa_flash`` (PyTorch's CUDA flash kernels behind the same two), ``fused`` (the
wrapper of the two fused backends) and ``choice`` (which backend runs). Each backend's forward
and backward, one ``autograd.Function``, stay in one module: backward recomputes from what
forward saved. Tests patch the block budgets and kernel lookups in the modules that read them
(``blocks.MAX_SCORE_ELEMENTS``, ``cpu_flash.FUSED_BWD_CHUNK``, ``fused.FLASH_BWD_CHUNK``,
``flash_backend.flash_interface``/``flash_version``, ``choice.fused_unsupported_reason``).

NOTE: what has been run. The torch backend is tested on CPU (float64 against a plain
softmax reference, gradcheck, a no-copy check). The flash backend's wrapper logic (layouts,
batch folding, merging, chunked backward) is tested on CPU against a pure-torch stand-in for
flash-attn's two functions. The real flash-attn kernels have NOT been run: the calls were
written from the flash-attn 2.8.x source (``flash_attn/flash_attn_interface.py``) without a
GPU; a test compares them with the torch backend when CUDA and flash-attn are present. The
sdpa backend is the same wrapper over PyTorch's CUDA flash ops, tested on CPU against a
stand-in with those ops' contract; ``make gpu-check`` compares it with the torch backend.
Attention sinks (``sink=``) run on every backend: the torch backend is tested against a
plain softmax with one more column (float64); the fused backends fold the sink in after
their merge and are tested on CPU against the torch backend through the stand-ins only
(``tests/attention/test_attention_sinks.py``): the sink path has NOT run on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from longstraw_core.attention import blocks, cpu_flash, fused, torch_backend
from longstraw_core.attention.choice import choose_backend as _choose_backend
from longstraw_core.attention.common import AttentionOutput, Segment, accumulation_dtype

# The autograd Functions keep their names, which autograd graphs show (``grad_fn``).
from longstraw_core.attention.fused import _FlashSegmentedAttention, _SdpaSegmentedAttention
from longstraw_core.attention.ragged import check_ragged
from longstraw_core.attention.torch_backend import _TorchSegmentedAttention

__all__ = [
    "AttentionOutput",
    "Segment",
    "accumulation_dtype",
    "kernel_budgets",
    "segmented_attention",
]


def kernel_budgets() -> dict[str, int]:
    """The block budgets as they are now (read when called: tests patch them in their
    modules), for the memory planner: ``score_elements``, ``flash_bwd_keys``,
    ``fused_bwd_keys``."""
    return {
        "score_elements": blocks.MAX_SCORE_ELEMENTS,
        "flash_bwd_keys": fused.FLASH_BWD_CHUNK,
        "fused_bwd_keys": cpu_flash.FUSED_BWD_CHUNK,
    }


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
    branch_positions: torch.Tensor | None = None,
    window: int | None = None,
    sink: torch.Tensor | None = None,
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
        branch_positions: ``[B, Tq]``, a ragged decode step (``attention.ragged``): each
            row's queries at their own branch positions, seeing that row's branch keys up to
            them (keys past them, e.g. stale slots of a row that fell behind, are masked).
            ``None``: bottom-right causal, as above. Forward only (under ``no_grad``).
        window: a sliding window (``None``: none): query ``i`` at branch position ``p`` sees
            only branch keys at positions ``> p - window`` (its own and the ``window - 1``
            before it: transformers' ``sliding_window``, flash-attn's ``window_size=(window -
            1, 0)``). Only with no prefix segments: a sliding-window layer passes the
            window's stored keys at the head of ``k``/``v`` (``kinds.window``).
        sink: ``[H]`` attention sinks (gpt-oss' ``sinks``), or ``None``: every softmax row of
            query head ``h`` gets one more logit, ``sink[h]``, of a key with no value, which
            takes probability mass and adds nothing to the output (transformers'
            ``eager_attention_forward`` of gpt-oss). Gradients flow to it when it requires
            grad. Every backend takes it: each folds it in after its merge (``common.fold_sink``;
            the fused backends' kernels never see it).

    Returns:
        ``[B, H, Tq, Dv]`` in the dtype of ``q``. Query head ``h`` reads kv head
        ``h // (H // KVH)``, as transformers' ``repeat_kv`` does.
    """
    segments = tuple((ks, vs) for ks, vs in prefix)
    _check_shapes(q, k, v, segments)
    _check_window(window, segments)
    _check_sink(sink, q)
    chosen = _choose_backend(backend, q, k, v, segments)
    flat = [t for segment in segments for t in segment]
    if branch_positions is not None:
        check_ragged(q, k, branch_positions)
        if chosen == "torch":
            out, _ = torch_backend._torch_attention(
                q, k, v, scale, block_size, flat, branch_positions, window, sink
            )
            return out
        return fused.ragged_forward(chosen, q, k, v, scale, flat, branch_positions, window, sink)
    buffers = _check_prefix_grads(prefix_grads, segments)
    if reuse is not None:
        _check_reuse(reuse, q, v)
    return _FUNCTIONS[chosen].apply(
        q, k, v, sink, float(scale), block_size, window, buffers, reuse, keep, *flat
    )


def _check_sink(sink: torch.Tensor | None, q: torch.Tensor) -> None:
    """A sink is one logit per query head. Every backend takes it: none refuses a sink.

    NOTE: the fused backends (flash-attn 2's ``flash_attn_func``, PyTorch's flash kernels)
    take no sink logit; they fold it in after their merge (``fused``'s docstring) and their
    backward calls take the folded ``out'``/``lse'``. That path is checked on CPU against
    the kernels' plain-torch stand-ins only (``tests/attention/test_attention_sinks.py``),
    not yet on a GPU. flash-attn 3 / 4's kernels with a sink argument are not wired in.
    """
    if sink is None:
        return
    if sink.shape != (q.shape[1],):
        raise ValueError(f"sink must be [heads] = [{q.shape[1]}], got {tuple(sink.shape)}")


def _check_window(window: int | None, segments: Sequence[Segment]) -> None:
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")
    if segments:
        raise ValueError(
            "a sliding window takes no prefix segments: pass the window's keys and values at "
            "the head of the branch's k/v"
        )


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


def _check_prefix_grads(
    prefix_grads: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]] | None,
    segments: Sequence[Segment],
) -> tuple[tuple[torch.Tensor | None, torch.Tensor | None], ...]:
    """One ``(dk, dv)`` accumulation buffer pair per segment (``None`` where not wanted)."""
    if prefix_grads is None:
        return tuple((None, None) for _ in segments)
    buffers = tuple(tuple(pair) for pair in prefix_grads)
    if len(buffers) != len(segments):
        raise ValueError(f"prefix_grads has {len(buffers)} pairs for {len(segments)} segments")
    for i, (pair, segment) in enumerate(zip(buffers, segments, strict=True)):
        for buffer, tensor in zip(pair, segment, strict=True):
            if buffer is not None and buffer.shape != tensor.shape:
                raise ValueError(
                    f"prefix_grads[{i}] buffer {tuple(buffer.shape)} does not match its "
                    f"segment {tuple(tensor.shape)}"
                )
    return buffers


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


_FUNCTIONS: dict[str, type[torch.autograd.Function]] = {
    "torch": _TorchSegmentedAttention,
    "flash": _FlashSegmentedAttention,
    "sdpa": _SdpaSegmentedAttention,
}
