"""Plain-torch stand-ins for the fused attention kernels' contracts, so the fused backends'
own logic (layouts, folding, merging, chunked backward) runs on CPU in float64.

- ``FakeFlashInterface``: flash-attn 2.7/2.8's public ``flash_attn_func`` (with
  ``return_attn_probs``: ``(out, softmax_lse [B, H, T], S_dmask)``) and the private
  ``_flash_attn_backward`` that ``flash_backend._private_backward`` calls; ``[B, T, H, D]``,
  GQA, bottom-right causal. ``FakeFlashInterface26`` takes 2.6's ``window_size`` pair.
- ``FakeVarlenOps``: torch's public ``varlen_attn`` (lse ``[H, total_q]``) and
  ``aten._flash_attention_backward`` as ``sdpa_flash`` calls them, packed ``[total, H, D]``.

The signatures are the real ones (keyword names included), so a call that passes a wrong
name fails here too; ``tests/attention/test_attention.py`` checks them against torch's.
"""

from __future__ import annotations

from typing import ClassVar

import torch

__all__ = ["FakeFlashInterface", "FakeFlashInterface26", "FakeVarlenOps", "attend", "attend_grads"]


def _scores(q, k, v, scale, causal, left=-1):
    """``[B, T, H, D]`` inputs as ``[B, H, T, D]`` with K/V repeated over the GQA group, and
    the masked scores (``left >= 0``: a sliding window, the kernels' ``window_size[0]``)."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    scores = scale * q @ k.transpose(-1, -2)
    if causal:
        tq, tk = q.shape[2], k.shape[2]
        position = tk - tq + torch.arange(tq)[:, None]
        hidden = torch.arange(tk)[None, :] > position
        if left >= 0:
            hidden |= torch.arange(tk)[None, :] < position - left
        scores = scores.masked_fill(hidden, float("-inf"))
    return q, k, v, scores


def attend(q, k, v, scale, causal, left=-1):
    """``(out [B, T, H, D], lse [B, H, T] float32)``: the kernels' lse is float32."""
    _, _, v_, scores = _scores(q, k, v, scale, causal, left)
    out = (torch.softmax(scores, dim=-1) @ v_).transpose(1, 2).contiguous()
    return out, torch.logsumexp(scores, dim=-1).float()


def attend_grads(dout, q, k, v, out, lse, scale, causal, left=-1):
    """FlashAttention's backward against the given ``out``/``lse``: ``(dq, dk, dv)``."""
    kv_heads = k.shape[2]
    q_, k_, v_, scores = _scores(q, k, v, scale, causal, left)
    dout, out = dout.transpose(1, 2), out.transpose(1, 2)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    d_scores = probs * (dout @ v_.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    d_scores = d_scores * scale

    def per_kv_head(x):  # [B, H, T, D] -> [B, T, KVH, D], summed over the GQA group
        b, h, t, d = x.shape
        return x.reshape(b, kv_heads, h // kv_heads, t, d).sum(2).transpose(1, 2)

    return (
        (d_scores @ k_).transpose(1, 2),
        per_kv_head(d_scores.transpose(-1, -2) @ q_),
        per_kv_head(probs.transpose(-1, -2) @ dout),
    )


class FakeFlashInterface:
    """flash-attn 2.7/2.8's ``flash_attn_interface`` (the two functions LongStraw calls).
    ``windows``: the ``window_size`` of every call, in order (tests clear it)."""

    windows: ClassVar[list[tuple[int, int]]] = []

    @staticmethod
    def flash_attn_func(
        q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
        softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
    ):  # fmt: skip
        left, right = window_size
        assert dropout_p == 0.0 and softcap == 0.0
        assert (left, right) == (-1, -1) or (causal and left >= 0 and right == 0)
        assert all(x.stride(-1) == 1 for x in (q, k, v))
        FakeFlashInterface.windows.append(tuple(window_size))
        out, lse = attend(q, k, v, softmax_scale, causal, left)
        return (out, lse, torch.empty(0)) if return_attn_probs else out

    @staticmethod
    def _flash_attn_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
        window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
        rng_state=None,
    ):  # fmt: skip
        left, right = window_size_left, window_size_right
        assert dropout_p == 0.0
        assert (left, right) == (-1, -1) or (causal and left >= 0 and right == 0)
        FakeFlashInterface.windows.append((left, right))
        FakeFlashInterface._check_dense(dout, out, softmax_lse)
        for grad, value in zip((dq, dk, dv), attend_grads(
            dout, q, k, v, out, softmax_lse, softmax_scale, causal, left
        ), strict=True):  # fmt: skip
            grad.copy_(value)
        return torch.empty(0)

    @staticmethod
    def _check_dense(dout, out, softmax_lse):
        """What the CUDA kernel reads without checking: a dense lse, unit-stride rows."""
        assert softmax_lse.is_contiguous(), "the kernel reads softmax_lse as a dense array"
        assert dout.stride(-1) == 1 and out.stride(-1) == 1


class FakeFlashInterface26(FakeFlashInterface):
    """flash-attn 2.6's backward: the window as one ``window_size`` pair."""

    @staticmethod
    def _flash_attn_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, rng_state=None,
    ):  # fmt: skip
        return FakeFlashInterface._flash_attn_backward(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
            *window_size, softcap, alibi_slopes, deterministic, rng_state,
        )  # fmt: skip


def _unpacked(x, cu_seq):
    """``[total, H, D]`` with equal lengths as ``[B, T, H, D]`` (the wrapper packs so)."""
    batch = cu_seq.numel() - 1
    return x.reshape(batch, x.shape[0] // batch, *x.shape[1:])


class FakeVarlenOps:
    """``torch.nn.attention.varlen.varlen_attn`` and ``aten._flash_attention_backward``."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.windows: list[tuple[int, int]] = []

    def forward(
        self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
        scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None,
        num_splits=None,
    ):  # fmt: skip
        assert return_aux is not None and return_aux.lse and enable_gqa
        left, right = window_size
        assert (left, right) == (-1, -1) or (left >= -1 and right == 0)
        assert cu_seq_q.dtype == torch.int32
        self.windows.append((left, right))
        self.calls.append("forward")
        q, k, v = _unpacked(query, cu_seq_q), _unpacked(key, cu_seq_k), _unpacked(value, cu_seq_k)
        assert (max_q, max_k) == (q.shape[1], k.shape[1])
        out, lse = attend(q, k, v, scale, right == 0, left)
        return out.reshape(query.shape[0], *out.shape[2:]), lse.transpose(0, 1).reshape(
            lse.shape[1], -1
        )

    def backward(
        self, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
        dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
        window_size_right=None,
    ):  # fmt: skip
        assert dropout_p == 0.0 and rng_state.dtype == torch.uint64
        assert window_size_right == (0 if is_causal else -1)
        assert window_size_left == -1 or (is_causal and window_size_left >= 0)
        self.windows.append((window_size_left, window_size_right))
        FakeFlashInterface._check_dense(grad_out, out, logsumexp)
        self.calls.append("backward")
        batch = cum_seq_q.numel() - 1
        q, k, v = (_unpacked(x, c) for x, c in ((query, cum_seq_q), (key, cum_seq_k),
                                                (value, cum_seq_k)))  # fmt: skip
        lse = logsumexp.reshape(logsumexp.shape[0], batch, -1).transpose(0, 1)
        grads = attend_grads(
            _unpacked(grad_out, cum_seq_q), q, k, v, _unpacked(out, cum_seq_q), lse, scale,
            is_causal, window_size_left,
        )  # fmt: skip
        return tuple(g.reshape(-1, *g.shape[2:]) for g in grads)
