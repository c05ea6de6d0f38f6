"""segmented_attention's sliding window (``window=``) against a plain masked softmax written
here (float64, CPU): the torch backend, its ragged decode path, and the fused backends'
wrappers over the flash-attn and varlen stand-ins, which also check the ``window_size`` the
kernels are called with (``(window - 1, 0)``: flash-attn cannot run here)."""

from __future__ import annotations

import pytest
import torch
from flash_standins import FakeFlashInterface, FakeVarlenOps

from longstraw_core import attention
from longstraw_core.attention import segmented_attention

SCALE = 0.41


def windowed_reference(q, k, v, scale, window):
    """Query ``i`` at position ``tk - tq + i`` sees keys ``j`` with ``p - window < j <= p``
    (transformers' ``kv_idx > q_idx - sliding_window`` over a causal mask)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    keys = k.repeat_interleave(heads // kv_heads, dim=1)
    values = v.repeat_interleave(heads // kv_heads, dim=1)
    tq, tk = q.shape[2], k.shape[2]
    position = tk - tq + torch.arange(tq)[:, None]
    index = torch.arange(tk)[None, :]
    hidden = (index > position) | (index <= position - window)
    scores = (scale * q @ keys.transpose(-1, -2)).masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1) @ values


def _inputs(batch, heads, kv_heads, tq, tk, dim, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    return (
        rand(batch, heads, tq, dim),
        rand(batch, kv_heads, tk, dim),
        rand(batch, kv_heads, tk, dim),
    )


def _check(out, q, k, v, window, tol=1e-10):
    want = windowed_reference(q, k, v, SCALE, window)
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    grad_out = torch.randn_like(want)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    expected = torch.autograd.grad(want, (q, k, v), grad_out)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("shape", "window", "block_size"),
    [
        ((1, 4, 2, 9, 9, 8), 3, None),  # a prefill chunk longer than the window
        ((1, 4, 2, 5, 12, 8), 4, 3),  # a replayed branch after the window's stored keys
        ((3, 2, 2, 1, 7, 4), 3, None),  # decoding: one query per row
        ((2, 4, 1, 6, 6, 8), 1, 2),  # a window of the query alone
        ((1, 4, 2, 4, 4, 8), 16, None),  # a window wider than every key: plain causal
    ],
)
def test_torch_backend_matches_the_masked_reference(shape, window, block_size):
    q, k, v = _inputs(*shape)
    out = segmented_attention(q, k, v, scale=SCALE, window=window, block_size=block_size)
    _check(out, q, k, v, window)


def test_float32_skips_the_cpu_fused_kernel_that_takes_no_window():
    q, k, v = (x.detach().float().requires_grad_() for x in _inputs(1, 4, 2, 8, 8, 8))
    out = segmented_attention(q, k, v, scale=SCALE, window=3)
    want = windowed_reference(q, k, v, SCALE, 3)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_ragged_decode_step_applies_the_window():
    """Two rows at their own branch positions (forward only, as rollout runs it)."""
    q, k, v = (x.detach() for x in _inputs(2, 4, 2, 1, 8, 8, seed=3))
    positions = torch.tensor([[7], [4]])
    with torch.no_grad():
        out = segmented_attention(q, k, v, scale=SCALE, window=3, branch_positions=positions)
    for row, position in enumerate((7, 4)):
        rows = slice(row, row + 1)
        keys, values = k[rows, :, : position + 1], v[rows, :, : position + 1]
        want = windowed_reference(q[rows], keys, values, SCALE, 3)
        torch.testing.assert_close(out[rows], want, rtol=1e-10, atol=1e-10)


def test_a_window_takes_no_prefix_segments_and_must_be_positive():
    q, k, v = _inputs(1, 2, 2, 2, 2, 4)
    segment = (torch.zeros(2, 3, 4, dtype=torch.float64),) * 2
    with pytest.raises(ValueError, match="takes no prefix segments"):
        segmented_attention(q, k, v, [segment], scale=SCALE, window=2)
    with pytest.raises(ValueError, match="int >= 1"):
        segmented_attention(q, k, v, scale=SCALE, window=0)


def test_flash_wrapper_passes_flash_attns_own_window(monkeypatch):
    """flash-attn's ``window_size=(window - 1, 0)`` in the forward and the private backward
    (2.8's ``window_size_left``/``_right``), and the result of the stand-in, which applies
    it as flash-attn documents, equals the reference."""
    monkeypatch.setattr(attention.flash_backend, "flash_interface", lambda: FakeFlashInterface)
    monkeypatch.setattr(attention.flash_backend, "flash_version", lambda: (2, 8))
    monkeypatch.setattr(FakeFlashInterface, "windows", [])
    q, k, v = _inputs(1, 4, 2, 5, 9, 8, seed=1)
    out = attention._FlashSegmentedAttention.apply(q, k, v, None, SCALE, None, 4, (), None, None)
    _check(out, q, k, v, 4, tol=1e-6)
    assert FakeFlashInterface.windows == [(3, 0), (3, 0)]  # the forward, the backward


def test_flash_26_backward_takes_the_window_as_a_pair(monkeypatch):
    from flash_standins import FakeFlashInterface26

    monkeypatch.setattr(attention.flash_backend, "flash_interface", lambda: FakeFlashInterface26)
    monkeypatch.setattr(attention.flash_backend, "flash_version", lambda: (2, 6))
    monkeypatch.setattr(FakeFlashInterface, "windows", [])
    q, k, v = _inputs(1, 2, 2, 3, 6, 8, seed=2)
    out = attention._FlashSegmentedAttention.apply(q, k, v, None, SCALE, None, 2, (), None, None)
    _check(out, q, k, v, 2, tol=1e-6)
    assert set(FakeFlashInterface.windows) == {(1, 0)}


def test_sdpa_wrapper_passes_the_varlen_window(monkeypatch):
    ops = FakeVarlenOps()
    monkeypatch.setattr(attention.sdpa_flash, "_ops", lambda: (ops.forward, ops.backward))
    q, k, v = _inputs(2, 4, 2, 4, 7, 8, seed=4)
    out = attention._SdpaSegmentedAttention.apply(q, k, v, None, SCALE, None, 3, (), None, None)
    _check(out, q, k, v, 3, tol=1e-6)
    assert set(ops.windows) == {(2, 0)}


def test_fused_kernels_refuse_a_window_on_a_prefix_segment():
    """Prefix segments are attended non-causally: a window there has no meaning."""
    with pytest.raises(ValueError, match="causal branch segment only"):
        attention.flash_backend._window_size(False, 4)
    with pytest.raises(ValueError, match="causal branch segment only"):
        attention.common.window_left(False, 4)
