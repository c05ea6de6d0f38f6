"""Attention sinks (``segmented_attention(sink=)``, gpt-oss' ``sinks``) against a plain
softmax with one more logit column per head and no value: outputs and the gradients of
``q``, ``k``, ``v``, the prefix segments and the sink itself, in float64 (torch backend).

The fused backends (flash-attn's, PyTorch's varlen flash kernels) fold the sink in after
their merge; their wrapper runs here over the kernels' plain-torch stand-ins
(``tests/support/flash_standins.py``) and is held to the torch backend with the same sink.
No GPU has run these: the stand-ins have the kernels' contracts, not their code."""

from __future__ import annotations

import pytest
import torch
from flash_standins import FakeFlashInterface, FakeFlashInterface26, FakeVarlenOps
from torch._subclasses.fake_tensor import FakeTensorMode

from longstraw_core import attention
from longstraw_core.attention import AttentionOutput
from longstraw_core.tensors import gpu_emulation

SCALE = 0.3
# The fused wrapper merges and folds in float32, as flash-attn does, whatever the inputs'
# dtype (the stand-ins return a float32 lse): a few float32 roundings of O(1) values.
FUSED_TOL = 16 * torch.finfo(torch.float32).eps


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


def test_sinks_in_a_ragged_decode_step() -> None:
    q, k, v, prefix, sink = _inputs((4,), tq=1)
    with torch.no_grad():
        positions = torch.full((2, 1), k.shape[2] - 1)
        ragged = attention.segmented_attention(
            q, k, v, prefix, scale=SCALE, sink=sink, branch_positions=positions
        )
        torch.testing.assert_close(ragged, _reference(q, k, v, prefix, sink))
    with pytest.raises(ValueError, match="sink must be"):
        attention.segmented_attention(q, k, v, prefix, scale=SCALE, sink=sink[:2])


@pytest.fixture(params=["flash-2.8", "flash-2.6", "sdpa"])
def fused(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fused backend over its kernels' stand-in, which ``segmented_attention`` takes on
    CPU (the device check is what refuses it here, as on a machine without CUDA)."""
    monkeypatch.setattr(attention.choice, "fused_unsupported_reason", lambda *a: None)
    if request.param == "sdpa":
        ops = FakeVarlenOps()
        monkeypatch.setattr(attention.sdpa_flash, "_ops", lambda: (ops.forward, ops.backward))
        monkeypatch.setattr(attention.flash_backend, "flash_interface", lambda: None)
        return "sdpa"
    interface, version = {
        "flash-2.8": (FakeFlashInterface, (2, 8)),
        "flash-2.6": (FakeFlashInterface26, (2, 6)),
    }[request.param]
    monkeypatch.setattr(attention.flash_backend, "flash_interface", lambda: interface)
    monkeypatch.setattr(attention.flash_backend, "flash_version", lambda: version)
    return "flash"


def _run(backend, q, k, v, prefix, sink, weights, **kwargs):
    """Output and the gradients of ``q, k, v, sink`` and every prefix tensor of one call."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v, sink)]
    segments = [tuple(t.detach().requires_grad_() for t in pair) for pair in prefix]
    out = attention.segmented_attention(
        *leaves[:3], segments, scale=SCALE, sink=leaves[3], backend=backend, **kwargs
    )
    assert backend in type(out.grad_fn).__name__.lower()
    (out * weights).sum().backward()
    return out.detach(), [t.grad for t in (*leaves, *(t for pair in segments for t in pair))]


def _assert_all_close(got, want, tol=FUSED_TOL) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("prefix_lengths", "window", "block_size"),
    [
        ((), None, None),  # the branch alone
        ((6, 3), None, 2),  # prefix + branch, the prefix backward in chunks of 2 keys
        ((6, 0, 3), None, None),  # an empty segment among them
        ((), 3, None),  # a sliding window
    ],
    ids=["branch", "prefix-chunked", "empty-segment", "window"],
)
def test_fused_sinks_equal_the_torch_backend(fused, prefix_lengths, window, block_size) -> None:
    """Output and the gradients of q, k, v, the sink and every prefix segment."""
    q, k, v, prefix, sink = _inputs(prefix_lengths, seed=1)
    weights = torch.randn(2, 4, 5, 8, generator=torch.Generator().manual_seed(3)).double()
    kwargs = {"window": window, "block_size": block_size}
    got = _run(fused, q, k, v, prefix, sink, weights, **kwargs)
    want = _run("torch", q, k, v, prefix, sink, weights, **kwargs)
    _assert_all_close([got[0], *got[1]], [want[0], *want[1]])
    assert got[1][3].abs().max() > 0.05  # the sink's gradient is not vacuous


def test_fused_sinks_change_the_result(fused) -> None:
    """Without the sink the fused output differs: the equality above is not vacuous."""
    q, k, v, prefix, sink = _inputs((6, 3), seed=2)
    with torch.no_grad():
        run = {"scale": SCALE, "backend": fused}
        with_sink = attention.segmented_attention(q, k, v, prefix, sink=sink, **run)
        without = attention.segmented_attention(q, k, v, prefix, **run)
        torch.testing.assert_close(with_sink, _reference(q, k, v, prefix, sink), atol=FUSED_TOL,
                                   rtol=FUSED_TOL)  # fmt: skip
    assert (with_sink - without).abs().max() > 0.05


def test_fused_sinks_add_prefix_gradients_into_buffers(fused) -> None:
    """Exact mode's accumulation buffers (``prefix_grads``) with a sink: each buffer gains
    the torch backend's prefix gradient, and ``q``'s gradient is unchanged by them."""
    q, k, v, prefix, sink = _inputs((6, 3), seed=4)
    weights = torch.randn(2, 4, 5, 8, generator=torch.Generator().manual_seed(5)).double()
    _, want = _run("torch", q, k, v, prefix, sink, weights, block_size=2)
    detached = [tuple(t.detach() for t in pair) for pair in prefix]
    buffers = [(torch.ones_like(ks), torch.ones_like(vs)) for ks, vs in detached]
    leaves = [x.detach().requires_grad_() for x in (q, k, v, sink)]
    out = attention.segmented_attention(
        *leaves[:3], detached, scale=SCALE, sink=leaves[3], backend=fused, block_size=2,
        prefix_grads=buffers,
    )  # fmt: skip
    (out * weights).sum().backward()
    _assert_all_close([t.grad for t in leaves], want[:4])
    _assert_all_close([b - 1 for pair in buffers for b in pair], want[4:])


def test_fused_sinks_keep_and_reuse(fused) -> None:
    """A kept output holds the sink; reusing it gives the same output and gradients."""
    q, k, v, _, sink = _inputs((), seed=6, tq=7)
    weights = torch.randn(2, 4, 7, 8, generator=torch.Generator().manual_seed(7)).double()
    kept: list[AttentionOutput] = []
    with torch.no_grad():
        attention.segmented_attention(q, k, v, scale=SCALE, sink=sink, backend=fused, keep=kept)
    want = _run(fused, q, k, v, [], sink, weights)
    got = _run(fused, q, k, v, [], sink, weights, reuse=kept[0])
    assert torch.equal(kept[0].out, want[0]) and torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b)


def test_fused_sinks_in_a_ragged_decode_step(fused) -> None:
    q, k, v, prefix, sink = _inputs((4,), tq=1)
    with torch.no_grad():
        positions = torch.full((2, 1), k.shape[2] - 1)
        ragged = attention.segmented_attention(
            q, k, v, prefix, scale=SCALE, sink=sink, backend=fused, branch_positions=positions
        )
    want = _reference(q, k, v, prefix, sink)
    torch.testing.assert_close(ragged, want, rtol=FUSED_TOL, atol=FUSED_TOL)


def test_auto_takes_a_usable_fused_backend_with_a_sink(fused) -> None:
    """A sink no longer sends ``auto`` to the torch backend; a sink that needs no gradient
    gets none (and the rest theirs)."""
    q, k, v, prefix, sink = _inputs((3,), seed=8)
    out = attention.segmented_attention(q, k, v, prefix, scale=SCALE, sink=sink.detach())
    assert fused in type(out.grad_fn).__name__.lower()
    out.sum().backward()
    assert sink.grad is None and q.grad is not None and prefix[0][0].grad is not None


def test_gpu_dry_run_takes_the_fused_kernels_with_a_sink() -> None:
    """Under the dry runs' GPU emulation (fake tensors, ``gpu_emulation``) a call with a
    sink takes PyTorch's real CUDA flash ops' shape rules (their fake kernels), forward and
    backward, and every input gets a gradient of its shape."""
    with FakeTensorMode(), gpu_emulation.gpu_kernels():
        q = torch.empty(1, 8, 16, 64, dtype=torch.bfloat16).requires_grad_()
        k, v = (torch.empty(1, 2, 16, 64, dtype=torch.bfloat16).requires_grad_() for _ in "kv")
        prefix = tuple(torch.empty(2, 100, 64, dtype=torch.bfloat16).requires_grad_() for _ in "kv")
        sink = torch.empty(8, dtype=torch.bfloat16).requires_grad_()
        out = attention.segmented_attention(q, k, v, [prefix], scale=0.125, sink=sink)
        assert type(out.grad_fn).__name__.startswith(("_Flash", "_Sdpa"))  # not torch's
        assert out.shape == q.shape and out.dtype == torch.bfloat16
        out.sum().backward()
        for tensor in (q, k, v, sink, *prefix):
            assert tensor.grad.shape == tensor.shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["sdpa", "flash"])
@pytest.mark.parametrize("window", [None, 64])
def test_fused_sinks_match_the_torch_backend_on_a_gpu(backend, window) -> None:
    """The real kernels (not run yet: no GPU where this was written) against the torch
    backend in bfloat16: output and every gradient, within bfloat16's rounding."""
    if backend == "flash" and attention.flash_backend.flash_interface() is None:
        pytest.skip("flash-attn is not installed")
    g = torch.Generator().manual_seed(11)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to("cuda", torch.bfloat16)

    q, k, v, sink = rand(2, 8, 96, 64), rand(2, 2, 160, 64), rand(2, 2, 160, 64), rand(8)
    prefix = [] if window else [(rand(2, 300, 64), rand(2, 300, 64))]
    weights = rand(2, 8, 96, 64)
    got = _run(backend, q, k, v, prefix, sink, weights, window=window)
    want = _run("torch", q, k, v, prefix, sink, weights, window=window)
    for a, b in zip([got[0], *got[1]], [want[0], *want[1]], strict=True):
        error = (a.float() - b.float()).abs().max() / b.float().abs().max()
        assert error < 2e-2, f"relative error {error:.3e}"
