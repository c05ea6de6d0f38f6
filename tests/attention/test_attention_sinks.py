"""Attention sinks (``segmented_attention(sink=)``, gpt-oss' ``sinks``) against a plain
softmax with one more logit column per head and no value: outputs and the gradients of
``q``, ``k``, ``v``, the prefix segments and the sink itself, in float64."""

from __future__ import annotations

import pytest
import torch

from longstraw_core import attention

SCALE = 0.3


def _reference(q, k, v, prefix, sink, window=None):
    """Softmax over [prefix keys, causal branch keys, sink] of each query head."""
    batch, heads, tq, _ = q.shape
    kv_heads, tk = k.shape[1], k.shape[2]
    rep = heads // kv_heads
    keys = torch.cat([*(ks.expand(batch, -1, -1, -1) for ks, _ in prefix), k], dim=2)
    values = torch.cat([*(vs.expand(batch, -1, -1, -1) for _, vs in prefix), v], dim=2)
    keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
    scores = q @ keys.transpose(-1, -2) * SCALE
    ahead = keys.shape[2] - tk
    query_pos = torch.arange(tq) + tk - tq
    key_pos = torch.arange(tk)
    hidden = key_pos[None, :] > query_pos[:, None]
    if window is not None:
        hidden |= key_pos[None, :] <= query_pos[:, None] - window
    mask = torch.cat([torch.zeros(tq, ahead, dtype=torch.bool), hidden], dim=1)
    scores = scores.masked_fill(mask, float("-inf"))
    column = sink.reshape(1, heads, 1, 1).expand(batch, -1, tq, 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return probs @ values


def _inputs(prefix_lengths, seed=0, tq=5, tk=7):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    q, k, v = rand(2, 4, tq, 8), rand(2, 2, tk, 8), rand(2, 2, tk, 8)
    prefix = [(rand(2, n, 8), rand(2, n, 8)) for n in prefix_lengths]
    return q, k, v, prefix, rand(4)


@pytest.mark.parametrize(("prefix_lengths", "window"), [((), None), ((6, 3), None), ((), 3)])
@pytest.mark.parametrize("block_size", [None, 2])
def test_sinks_equal_an_extra_softmax_column(prefix_lengths, window, block_size) -> None:
    q, k, v, prefix, sink = _inputs(prefix_lengths)
    out = attention.segmented_attention(
        q, k, v, prefix, scale=SCALE, sink=sink, window=window, block_size=block_size
    )
    want = _reference(q, k, v, prefix, sink, window)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    leaves = [q, k, v, sink, *(t for pair in prefix for t in pair)]
    got = torch.autograd.grad((out * weights).sum(), leaves)
    expected = torch.autograd.grad((want * weights).sum(), leaves)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert got[3].abs().max() > 0  # the sink learns


def test_sinks_in_a_ragged_decode_step_and_the_fused_backends() -> None:
    q, k, v, prefix, sink = _inputs((4,), tq=1)
    with torch.no_grad():
        positions = torch.full((2, 1), k.shape[2] - 1)
        ragged = attention.segmented_attention(
            q, k, v, prefix, scale=SCALE, sink=sink, branch_positions=positions
        )
        torch.testing.assert_close(ragged, _reference(q, k, v, prefix, sink))
    with pytest.raises(ValueError, match="torch backend only"):
        attention.segmented_attention(q, k, v, prefix, scale=SCALE, sink=sink, backend="flash")
    with pytest.raises(ValueError, match="sink must be"):
        attention.segmented_attention(q, k, v, prefix, scale=SCALE, sink=sink[:2])
