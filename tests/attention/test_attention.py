"""segmented_attention against a plain softmax reference written here (float64, CPU).

The reference concatenates [prefix..., branch], expands K/V over the GQA group and the batch,
and applies the bottom-right-aligned causal mask to the branch part: everything the kernel
must not do, which is why it is easy to trust.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import pytest
import torch
from flash_standins import FakeFlashInterface, FakeFlashInterface26, FakeVarlenOps
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from longstraw_core import attention
from longstraw_core.attention import AttentionOutput, segmented_attention

SCALE = 0.37
TOL = 1e-10
HAS_FLASH = importlib.util.find_spec("flash_attn") is not None


def reference_attention(q, k, v, prefix, scale):
    batch, heads, tq, _ = q.shape
    kv_heads, tk = k.shape[1], k.shape[2]
    keys = torch.cat([ks.expand(batch, -1, -1, -1) for ks, _ in prefix] + [k], dim=2)
    values = torch.cat([vs.expand(batch, -1, -1, -1) for _, vs in prefix] + [v], dim=2)
    keys = keys.repeat_interleave(heads // kv_heads, dim=1)
    values = values.repeat_interleave(heads // kv_heads, dim=1)
    prefix_len = keys.shape[2] - tk
    query_pos = tk - tq + torch.arange(tq)[:, None]
    branch_hidden = torch.arange(tk)[None, :] > query_pos
    hidden = torch.cat([torch.zeros(tq, prefix_len, dtype=torch.bool), branch_hidden], dim=1)
    scores = (scale * q @ keys.transpose(-1, -2)).masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1) @ values


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    kv_heads: int
    tq: int
    tk: int
    dk: int
    dv: int
    lengths: tuple[int, ...]
    block_size: int | None


CASES = {
    "gqa-uneven-segments": Case(1, 4, 2, 7, 7, 8, 8, (5, 0, 11, 3), 3),
    "mha-one-segment": Case(2, 3, 3, 6, 6, 4, 4, (9,), None),
    "no-prefix": Case(2, 4, 2, 10, 10, 8, 8, (), 4),
    "one-token-branch": Case(1, 4, 1, 1, 1, 8, 8, (4, 6), 3),
    "one-token-no-prefix": Case(2, 2, 2, 1, 1, 4, 4, (), None),
    "decode-batch3": Case(3, 4, 2, 1, 9, 8, 8, (10, 7), 3),
    "chunk-batch3-dv-differs": Case(3, 6, 2, 3, 8, 8, 5, (0, 12, 5), 3),
    "block-larger-than-keys": Case(2, 4, 2, 4, 6, 8, 8, (5, 7), 1000),
}


def make_inputs(case, *, dtype=torch.float64, device="cpu", seed=0, prefix_grad=True):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, grad=True):
        x = torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
        return x.requires_grad_(grad)

    q = rand(case.batch, case.heads, case.tq, case.dk)
    k = rand(case.batch, case.kv_heads, case.tk, case.dk)
    v = rand(case.batch, case.kv_heads, case.tk, case.dv)
    prefix = [
        (
            rand(case.kv_heads, n, case.dk, grad=prefix_grad),
            rand(case.kv_heads, n, case.dv, grad=prefix_grad),
        )
        for n in case.lengths
    ]
    return q, k, v, prefix


def flat(prefix):
    return [t for segment in prefix for t in segment]


def assert_close(actual, expected, name="", tol=TOL):
    assert actual.shape == expected.shape, f"{name}: {actual.shape} != {expected.shape}"
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert torch.allclose(actual, expected, rtol=tol, atol=tol), f"{name}: max error {err:.3e}"


def grads_of(out, grad_out, tensors):
    return torch.autograd.grad(out, tensors, grad_out)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference_outputs_and_grads(case):
    q, k, v, prefix = make_inputs(case)
    out = segmented_attention(q, k, v, prefix, scale=SCALE, block_size=case.block_size)
    want = reference_attention(q, k, v, prefix, SCALE)
    assert out.dtype == q.dtype
    assert_close(out, want, "out")

    grad_out = torch.randn_like(want)
    inputs = [q, k, v, *flat(prefix)]
    names = ["q", "k", "v"] + [f"prefix[{i // 2}].{'kv'[i % 2]}" for i in range(2 * len(prefix))]
    got = grads_of(out, grad_out, inputs)
    expected = grads_of(want, grad_out, inputs)
    for name, g, e in zip(names, got, expected, strict=True):
        assert_close(g, e, name)


def test_default_block_size_splits_long_segments(monkeypatch):
    """block_size=None picks blocks from the element budget; shrink it so several run."""
    monkeypatch.setattr(attention.blocks, "MAX_SCORE_ELEMENTS", 300)
    case = CASES["chunk-batch3-dv-differs"]
    q, k, v, prefix = make_inputs(case)
    out = segmented_attention(q, k, v, prefix, scale=SCALE)
    want = reference_attention(q, k, v, prefix, SCALE)
    assert_close(out, want, "out")
    grad_out = torch.randn_like(want)
    inputs = [q, k, v, *flat(prefix)]
    for g, e in zip(grads_of(out, grad_out, inputs), grads_of(want, grad_out, inputs), strict=True):
        assert_close(g, e)


def test_prefix_without_grad_gets_none_and_others_stay_exact():
    case = CASES["chunk-batch3-dv-differs"]
    q, k, v, prefix = make_inputs(case)
    frozen = prefix[1]
    for t in frozen:
        t.requires_grad_(False)
    out = segmented_attention(q, k, v, prefix, scale=SCALE, block_size=case.block_size)
    want = reference_attention(q, k, v, prefix, SCALE)
    grad_out = torch.randn_like(want)
    trainable = [q, k, v, *prefix[0], *prefix[2]]
    expected = grads_of(want, grad_out, trainable)
    out.backward(grad_out)
    assert frozen[0].grad is None and frozen[1].grad is None
    for t, e in zip(trainable, expected, strict=True):
        assert_close(t.grad, e)


def test_only_query_needs_grad():
    case = CASES["decode-batch3"]
    q, k, v, prefix = make_inputs(case, prefix_grad=False)
    k.requires_grad_(False)
    out = segmented_attention(q, k, v, prefix, scale=SCALE, block_size=case.block_size)
    want = reference_attention(q, k, v, prefix, SCALE)
    grad_out = torch.randn_like(want)
    (expected,) = grads_of(want, grad_out, [q])
    out.backward(grad_out)
    assert_close(q.grad, expected, "q")
    assert k.grad is None
    assert all(t.grad is None for t in flat(prefix))


def test_strided_prefix_views_get_grads_in_place():
    """Prefix segments as views of a preallocated cache, as the prefix state holds them."""
    case = CASES["gqa-uneven-segments"]
    q, k, v, _ = make_inputs(case)
    capacity = torch.randn(case.kv_heads, 30, case.dk, dtype=torch.float64, requires_grad=True)
    token_major = torch.randn(20, case.kv_heads, case.dv, dtype=torch.float64, requires_grad=True)
    prefix = [(capacity[:, :9], token_major[:9].transpose(0, 1))]
    out = segmented_attention(q, k, v, prefix, scale=SCALE, block_size=4)
    want = reference_attention(q, k, v, prefix, SCALE)
    assert_close(out, want, "out")
    grad_out = torch.randn_like(want)
    inputs = [q, k, v, capacity, token_major]
    for g, e in zip(grads_of(out, grad_out, inputs), grads_of(want, grad_out, inputs), strict=True):
        assert_close(g, e)


def test_no_grad_call_matches_reference():
    case = CASES["decode-batch3"]
    q, k, v, prefix = make_inputs(case)
    with torch.no_grad():
        out = segmented_attention(q, k, v, prefix, scale=SCALE)
        want = reference_attention(q, k, v, prefix, SCALE)
    assert out.grad_fn is None
    assert_close(out, want)


def test_gradcheck_tiny():
    case = Case(2, 2, 1, 2, 3, 3, 2, (3, 0, 2), 2)
    q, k, v, prefix = make_inputs(case)

    def attention(q, k, v, *prefix_flat):
        segments = list(zip(prefix_flat[::2], prefix_flat[1::2], strict=True))
        return segmented_attention(q, k, v, segments, scale=SCALE, block_size=case.block_size)

    assert torch.autograd.gradcheck(attention, (q, k, v, *flat(prefix)))


def test_bfloat16_accumulates_in_float32():
    case = CASES["chunk-batch3-dv-differs"]
    q, k, v, prefix = make_inputs(case, dtype=torch.bfloat16)
    out = segmented_attention(q, k, v, prefix, scale=SCALE, block_size=case.block_size)
    assert out.dtype == torch.bfloat16
    as64 = [t.detach().double() for t in (q, k, v)]
    prefix64 = [(ks.detach().double(), vs.detach().double()) for ks, vs in prefix]
    want = reference_attention(*as64, prefix64, SCALE)
    assert_close(out.double(), want, "out", tol=2e-2)
    out.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and prefix[2][0].grad.dtype == torch.bfloat16


class _RecordOps(TorchDispatchMode):
    """Records (op, output shape, output numel) of every aten op that runs."""

    def __init__(self):
        super().__init__()
        self.records = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(result):
            if isinstance(t, torch.Tensor):
                self.records.append((func, tuple(t.shape), t.numel()))
        return result


_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


@pytest.mark.parametrize("prefix_grad", [False, True], ids=["frozen-prefix", "exact-mode"])
def test_prefix_is_never_copied(prefix_grad):
    """No op outside views produces a prefix-sized tensor, except the prefix grads themselves."""
    long = 4096
    case = Case(2, 4, 2, 3, 3, 8, 8, (long,), 256)
    q, k, v, prefix = make_inputs(case, prefix_grad=prefix_grad)
    prefix_numel = prefix[0][0].numel()
    with _RecordOps() as recorder:
        out = segmented_attention(q, k, v, prefix, scale=SCALE, block_size=case.block_size)
        out.sum().backward()
    big = [
        (str(func), shape)
        for func, shape, numel in recorder.records
        if not func.is_view and (numel >= prefix_numel or long in shape)
    ]
    allocations = [op for op in big if op[0].split(".")[1] in _ALLOCATIONS]
    assert big == allocations, f"prefix-sized non-view ops: {big}"
    assert len(allocations) == (2 if prefix_grad else 0), allocations


def test_flash_backend_unavailable_raises():
    case = CASES["mha-one-segment"]
    q, k, v, prefix = make_inputs(case)
    with pytest.raises(RuntimeError, match="flash"):
        segmented_attention(q, k, v, prefix, scale=SCALE, backend="flash")
    with pytest.raises(ValueError, match="backend"):
        segmented_attention(q, k, v, prefix, scale=SCALE, backend="triton")


def test_shape_errors():
    case = CASES["gqa-uneven-segments"]
    q, k, v, prefix = make_inputs(case)
    with pytest.raises(ValueError, match="multiple"):
        segmented_attention(q[:, :3], k, v, prefix, scale=SCALE)
    with pytest.raises(ValueError, match="Tq"):
        segmented_attention(q, k[:, :, :5], v[:, :, :5], prefix, scale=SCALE)
    with pytest.raises(ValueError, match="prefix segment 0"):
        segmented_attention(q, k, v, [(prefix[0][0], prefix[2][1])], scale=SCALE)


def _check_fused_wrapper(function: type[torch.autograd.Function]) -> torch.Tensor:
    """A fused backend's autograd function (its kernels faked by the caller) against the
    reference, float64 on CPU: the output and every gradient, with a prefix segment that
    needs no gradient getting none. Returns the output."""
    case = Case(3, 4, 2, 3, 8, 8, 8, (7, 0, 5), 3)
    q, k, v, prefix = make_inputs(case)
    for t in prefix[2]:
        t.requires_grad_(False)
    out = function.apply(
        q, k, v, None, SCALE, case.block_size, None, ((None, None),) * len(prefix), None, None,
        *flat(prefix),
    )  # fmt: skip
    want = reference_attention(q, k, v, prefix, SCALE)
    assert_close(out, want, "out", tol=1e-6)  # the wrapper merges in float32, like flash-attn
    grad_out = torch.randn_like(want)
    trainable = [q, k, v, *prefix[0], *prefix[1]]
    expected = grads_of(want, grad_out, trainable)
    out.backward(grad_out)
    for t, e in zip(trainable, expected, strict=True):
        assert_close(t.grad, e, tol=1e-6)
    assert prefix[2][0].grad is None and prefix[2][1].grad is None
    return out


def _fake_flash(monkeypatch, interface=FakeFlashInterface, version=(2, 8)) -> None:
    """flash-attn replaced by a plain-torch stand-in of the given version's signatures."""
    monkeypatch.setattr(attention.flash_backend, "flash_interface", lambda: interface)
    monkeypatch.setattr(attention.flash_backend, "flash_version", lambda: version)


@pytest.mark.parametrize(
    ("interface", "version"), [(FakeFlashInterface, (2, 8)), (FakeFlashInterface26, (2, 6))]
)
def test_flash_wrapper_layouts_with_fake_kernel(monkeypatch, interface, version):
    """The flash backend's own logic (no GPU): against the reference, float64 on CPU, for
    2.8's and 2.6's backward signatures (the stand-ins assert a dense lse, as the kernel
    reads it)."""
    _fake_flash(monkeypatch, interface, version)
    _check_fused_wrapper(attention._FlashSegmentedAttention)


@pytest.mark.parametrize("version", [(2, 5), (3, 0), None])
def test_flash_backward_refuses_unknown_versions(monkeypatch, version):
    """The one private call (``_flash_attn_backward``) runs only on the versions whose
    signature it knows; elsewhere a clear error names them, and ``auto`` passes flash by."""
    _fake_flash(monkeypatch, version=version)
    q, k, v, prefix = make_inputs(CASES["mha-one-segment"])
    with pytest.raises(RuntimeError, match=r"2\.6\.x, 2\.7\.x or 2\.8\.x"):
        attention._FlashSegmentedAttention.apply(
            q, k, v, None, SCALE, None, None, ((None, None),), None, None, *flat(prefix)
        ).sum().backward()
    monkeypatch.setattr(attention.choice, "fused_unsupported_reason", lambda *a: None)
    monkeypatch.setattr(attention.sdpa_flash, "_ops", lambda: None)
    assert attention._choose_backend("auto", q, k, v, prefix) == "torch"


def test_stand_ins_take_the_real_signatures():
    """The stand-ins' keyword names are the real functions' (torch's, read here; flash-attn
    2.8's from its source, as flash-attn is not installed here), so a wrong name in the
    backends fails on CPU too."""
    import inspect

    from torch.nn.attention import varlen

    def names(function):
        return list(inspect.signature(function).parameters)

    ops = FakeVarlenOps()
    assert names(ops.forward) == names(varlen.varlen_attn)
    schema = torch.ops.aten._flash_attention_backward.default._schema
    assert names(ops.backward) == [argument.name for argument in schema.arguments]
    assert names(FakeFlashInterface.flash_attn_func) == [
        "q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
        "alibi_slopes", "deterministic", "return_attn_probs",
    ]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_FLASH), reason="needs CUDA and flash-attn"
)
@pytest.mark.parametrize(
    "case",
    [
        Case(2, 4, 2, 5, 9, 64, 64, (300, 0, 77), 128),  # GQA, a branch after its start
        Case(3, 8, 2, 1, 1, 128, 128, (1000,), None),  # decoding one token
    ],
    ids=["gqa-chunked", "decode"],
)
def test_flash_matches_torch_backend_bf16(case):
    results = {}
    for backend in ("flash", "torch"):
        q, k, v, prefix = make_inputs(case, dtype=torch.bfloat16, device="cuda", seed=1)
        for t in prefix[2]:
            t.requires_grad_(False)  # exercises the scratch path of the flash backward
        out = segmented_attention(
            q, k, v, prefix, scale=SCALE, backend=backend, block_size=case.block_size
        )
        assert backend in type(out.grad_fn).__name__.lower()
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        out.backward(grad_out.to(out))
        tensors = [q, k, v, *prefix[0], *prefix[1]]
        results[backend] = [out.detach(), *(t.grad for t in tensors)]
        assert prefix[2][0].grad is None
    for flash, torch_ in zip(results["flash"], results["torch"], strict=True):
        assert flash.shape == torch_.shape
        if flash.numel():
            err = (flash.float() - torch_.float()).abs().max() / torch_.float().abs().max()
            assert err < 2e-2, f"relative error {err:.3e}"


def test_sdpa_wrapper_with_fake_kernel(monkeypatch):
    """The SDPA backend's own logic (no GPU): the flash wrapper over the aten ops' contract,
    against the reference, float64 on CPU; a prefix segment needing no gradient too."""
    ops = FakeVarlenOps()
    monkeypatch.setattr(attention.sdpa_flash, "_ops", lambda: (ops.forward, ops.backward))
    out = _check_fused_wrapper(attention._SdpaSegmentedAttention)
    assert "sdpa" in type(out.grad_fn).__name__.lower()
    assert "forward" in ops.calls and "backward" in ops.calls


def test_backend_choice(monkeypatch):
    """``auto`` takes flash-attn, then SDPA's flash kernels, then torch; a named fused
    backend that can't run says why. On CPU inputs every fused backend is refused."""
    case = CASES["mha-one-segment"]
    q, k, v, prefix = make_inputs(case, dtype=torch.bfloat16)
    assert attention._choose_backend("auto", q, k, v, prefix) == "torch"
    with pytest.raises(RuntimeError, match="'sdpa' is unavailable: inputs are not on CUDA"):
        attention._choose_backend("sdpa", q, k, v, prefix)
    monkeypatch.setattr(attention.choice, "fused_unsupported_reason", lambda *a: None)  # as on CUDA
    monkeypatch.setattr(attention.sdpa_flash, "_flash_capable", lambda device: True)
    monkeypatch.setattr(attention.flash_backend, "flash_interface", lambda: None)
    assert attention._choose_backend("auto", q, k, v, prefix) == "sdpa"
    with pytest.raises(RuntimeError, match="flash_attn is not installed"):
        attention._choose_backend("flash", q, k, v, prefix)
    _fake_flash(monkeypatch)
    assert attention._choose_backend("auto", q, k, v, prefix) == "flash"
    assert attention._choose_backend("sdpa", q, k, v, prefix) == "sdpa"
    assert attention._choose_backend("torch", q, k, v, prefix) == "torch"
    monkeypatch.setattr(attention.flash_backend, "flash_interface", lambda: None)
    monkeypatch.setattr(attention.sdpa_flash, "_ops", lambda: None)
    assert attention._choose_backend("auto", q, k, v, prefix) == "torch"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "case",
    [
        Case(2, 4, 2, 5, 9, 64, 64, (300, 0, 77), 128),  # GQA, a branch after its start
        Case(3, 8, 2, 1, 1, 128, 128, (1000,), None),  # decoding one token
        Case(1, 4, 4, 64, 64, 128, 128, (5000,), None),  # a prefill chunk
    ],
    ids=["gqa-chunked", "decode", "prefill-chunk"],
)
def test_sdpa_matches_torch_backend_bf16(case):
    """PyTorch's CUDA flash kernels (the ``sdpa`` backend, what ``auto`` takes without
    flash-attn) against the torch backend: outputs and every gradient."""
    results = {}
    for backend in ("sdpa", "torch"):
        q, k, v, prefix = make_inputs(case, dtype=torch.bfloat16, device="cuda", seed=1)
        for t in prefix[-1]:
            t.requires_grad_(False)
        out = segmented_attention(
            q, k, v, prefix, scale=SCALE, backend=backend, block_size=case.block_size
        )
        assert backend in type(out.grad_fn).__name__.lower()
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        out.backward(grad_out.to(out))
        tensors = [q, k, v, *(t for segment in prefix[:-1] for t in segment)]
        results[backend] = [out.detach(), *(t.grad for t in tensors)]
    for sdpa, torch_ in zip(results["sdpa"], results["torch"], strict=True):
        assert sdpa.shape == torch_.shape
        if sdpa.numel():
            err = (sdpa.float() - torch_.float()).abs().max() / torch_.float().abs().max()
            assert err < 2e-2, f"relative error {err:.3e}"


@pytest.mark.parametrize("batch", [1, 3])
def test_prefix_grads_accumulate_into_buffers_without_returning(batch):
    """Exact mode's sinks: backward adds dK/dV of each prefix segment into given buffers."""
    torch.manual_seed(7)
    q = torch.randn(batch, 4, 5, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    prefix = [(torch.randn(2, n, 8, dtype=torch.float64), torch.randn(2, n, 8, dtype=torch.float64))
              for n in (7, 4)]  # fmt: skip
    weights = torch.randn(batch, 4, 5, 8, dtype=torch.float64)

    leaves = [(pk.clone().requires_grad_(), pv.clone().requires_grad_()) for pk, pv in prefix]
    (segmented_attention(q, k, v, leaves, scale=0.3, block_size=3) * weights).sum().backward()
    expected_q = q.grad.clone()
    q.grad = None

    earlier = [(torch.ones_like(pk), None) for pk, _ in prefix]  # sinks start non-zero
    sinks = [(earlier[0][0].clone(), torch.zeros_like(prefix[0][1])), (earlier[1][0].clone(), None)]
    out = segmented_attention(q, k, v, prefix, scale=0.3, block_size=3, prefix_grads=sinks)
    (out * weights).sum().backward()
    assert torch.allclose(q.grad, expected_q, atol=1e-12)
    assert torch.allclose(sinks[0][0], 1 + leaves[0][0].grad, atol=1e-12)
    assert torch.allclose(sinks[0][1], leaves[0][1].grad, atol=1e-12)
    assert torch.allclose(sinks[1][0], 1 + leaves[1][0].grad, atol=1e-12)


def test_prefix_grads_shape_mismatch_is_refused():
    q = torch.randn(1, 2, 3, 4)
    k = v = torch.randn(1, 2, 3, 4)
    prefix = [(torch.randn(2, 5, 4), torch.randn(2, 5, 4))]
    with pytest.raises(ValueError, match="does not match its segment"):
        segmented_attention(q, k, v, prefix, scale=1.0, prefix_grads=[(torch.zeros(2, 4, 4), None)])
    with pytest.raises(ValueError, match="1 segments"):
        segmented_attention(q, k, v, prefix, scale=1.0, prefix_grads=[])


@pytest.mark.parametrize(("batch", "tq", "tk"), [(1, 7, 7), (3, 5, 5), (2, 1, 4), (1, 3, 6)])
def test_cpu_fused_kernels_match_plain_softmax_attention(monkeypatch, batch, tq, tk):
    """float32 on CPU takes PyTorch's fused flash kernels (forward and backward) for prefix
    segments and a branch attending to itself; the reference is plain softmax attention in
    float64. The fused backward visits a prefix segment a few keys per call (shrunk here so
    the 300-key segment takes several) and adds into sinks like the blocked one."""
    monkeypatch.setattr(attention.cpu_flash, "FUSED_BWD_CHUNK", 64)
    torch.manual_seed(11)
    q = torch.randn(batch, 4, tq, 8, requires_grad=True)
    k = torch.randn(batch, 2, tk, 8, requires_grad=True)
    v = torch.randn(batch, 2, tk, 8, requires_grad=True)
    prefix = [(torch.randn(2, n, 8), torch.randn(2, n, 8)) for n in (9, 300)]
    leaves = [tuple(t.clone().requires_grad_() for t in segment) for segment in prefix]
    sinks = [(torch.ones_like(pk), torch.zeros_like(pv)) for pk, pv in prefix]
    fused = segmented_attention(q, k, v, leaves[:1] + prefix[1:], scale=0.4,
                                prefix_grads=[(None, None), sinks[1]])  # fmt: skip
    as64 = [t.detach().double().requires_grad_() for t in (q, k, v, *leaves[0], *leaves[1])]
    segments64 = [(as64[3], as64[4]), (as64[5], as64[6])]
    expected_out = reference_attention(*as64[:3], segments64, 0.4)
    assert torch.allclose(fused.double(), expected_out, atol=2e-6)
    weights = torch.randn_like(fused)
    grads = torch.autograd.grad((fused * weights).sum(), (q, k, v, *leaves[0]))
    expected = torch.autograd.grad((expected_out * weights.double()).sum(), as64)
    for got, want in zip(grads, expected, strict=False):
        assert torch.allclose(got.double(), want, atol=2e-5)
    assert torch.allclose(sinks[1][0].double(), 1 + expected[-2], atol=2e-5)
    assert torch.allclose(sinks[1][1].double(), expected[-1], atol=2e-5)


def test_cpu_fused_backward_is_used_for_float32(monkeypatch):
    """The fused backward really runs (a regression here would silently cost ~3x)."""
    calls = []
    original = attention.cpu_flash.backward
    monkeypatch.setattr(
        attention.cpu_flash, "backward", lambda *a, **kw: calls.append(1) or original(*a, **kw)
    )
    q = torch.randn(1, 4, 5, 8, requires_grad=True)
    k = torch.randn(1, 2, 5, 8, requires_grad=True)
    v = torch.randn(1, 2, 5, 8, requires_grad=True)
    prefix = [(torch.randn(2, 30, 8), torch.randn(2, 30, 8))]
    segmented_attention(q, k, v, prefix, scale=0.4).sum().backward()
    assert len(calls) == 2  # the branch and the prefix segment


def _attention_and_grads(q, k, v, prefix, grad_out, backend, **options):
    """Output and every input's gradient (sinks included) of one segmented_attention call."""
    sinks = [(torch.zeros_like(ks), torch.zeros_like(vs)) for ks, vs in prefix]
    segments = [(ks.detach(), vs.detach()) for ks, vs in prefix]
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    out = segmented_attention(
        *inputs, segments, scale=SCALE, backend=backend, prefix_grads=sinks, **options
    )
    out.backward(grad_out)
    return out.detach(), [x.grad for x in inputs] + [g for pair in sinks for g in pair]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["blocked", "fused-cpu"])
# Reuse serves prompt chunks, which attend to themselves: one query per key.
@pytest.mark.parametrize(
    "case",
    [c for c in CASES.values() if c.tq == c.tk],
    ids=[n for n, c in CASES.items() if c.tq == c.tk],
)
def test_reusing_a_kept_output_gives_the_same_output_and_gradients(case, dtype):
    """``keep`` then ``reuse`` (what exact mode's sweep does with the prefill's attention):
    the same output and gradients as computing the attention again, bit for bit."""
    q, k, v, prefix = make_inputs(case, dtype=dtype)
    grad_out = torch.randn(case.batch, case.heads, case.tq, case.dv, dtype=dtype)
    kept: list[AttentionOutput] = []
    with torch.no_grad():
        segmented_attention(q, k, v, prefix, scale=SCALE, backend="torch", keep=kept)
    assert len(kept) == 1 and kept[0].lse.shape == (case.batch, case.heads, case.tq)
    want_out, want_grads = _attention_and_grads(q, k, v, prefix, grad_out, "torch")
    got_out, got_grads = _attention_and_grads(q, k, v, prefix, grad_out, "torch", reuse=kept[0])
    assert torch.equal(got_out, want_out) and torch.equal(kept[0].out, want_out)
    for got, want in zip(got_grads, want_grads, strict=True):
        assert torch.equal(got, want)


def test_reuse_through_the_flash_wrapper_with_fake_kernel(monkeypatch):
    _fake_flash(monkeypatch)
    case = Case(1, 4, 2, 5, 5, 8, 8, (7, 0, 3), None)
    q, k, v, prefix = make_inputs(case)
    grad_out = torch.randn(1, 4, 5, 8, dtype=torch.float64)
    kept: list[AttentionOutput] = []
    with torch.no_grad():
        attention._FlashSegmentedAttention.apply(
            q, k, v, None, SCALE, None, None, ((None, None),) * 3, None, kept, *flat(prefix)
        )
    assert kept[0].out.shape == (1, 4, 5, 8) and kept[0].lse.shape == (1, 4, 5)

    def run(reuse):
        inputs = [x.detach().requires_grad_() for x in (q, k, v)]
        sinks = tuple((torch.zeros_like(ks), torch.zeros_like(vs)) for ks, vs in prefix)
        segments = [t.detach() for t in flat(prefix)]
        out = attention._FlashSegmentedAttention.apply(
            *inputs, None, SCALE, None, None, sinks, reuse, None, *segments
        )
        out.backward(grad_out)
        return out.detach(), [x.grad for x in inputs] + [g for pair in sinks for g in pair]

    (want_out, want_grads), (got_out, got_grads) = run(None), run(kept[0])
    assert torch.equal(got_out, want_out)
    for got, want in zip(got_grads, want_grads, strict=True):
        assert torch.equal(got, want)


def test_reuse_from_another_span_is_refused():
    q, k, v, prefix = make_inputs(CASES["mha-one-segment"])
    wrong = AttentionOutput(torch.zeros(2, 3, 5, 4), torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="same span"):
        segmented_attention(q, k, v, prefix, scale=SCALE, reuse=wrong)


def test_the_public_flash_api_alone_misses_the_lse_term():
    """Why the fused backends keep one private backward call (``flash_backend``'s docstring):
    segment results merged by log-sum-exp and differentiated through each segment's public
    autograd, which drops the lse's gradient as ``FlashAttnFunc.backward(ctx, dout, *args)``
    does, get wrong gradients; with the lse's gradient they are exact. float64 on CPU."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    keys = [torch.randn(1, 2, n, 4, dtype=torch.float64, generator=generator) for n in (5, 6)]
    values = [torch.randn(1, 2, n, 4, dtype=torch.float64, generator=generator) for n in (5, 6)]
    grad_out = torch.randn(1, 2, 3, 4, dtype=torch.float64, generator=generator)

    def merged_grad(lse_gradient: bool) -> torch.Tensor:
        results = []
        for k, v in zip(keys, values, strict=True):
            scores = SCALE * q @ k.transpose(-1, -2)
            lse = torch.logsumexp(scores, dim=-1)
            out = torch.softmax(scores, dim=-1) @ v
            results.append((out, lse if lse_gradient else lse.detach()))
        out, _ = attention.common.merge(*results[0], *results[1])
        (grad,) = torch.autograd.grad(out, q, grad_out)
        return grad

    scores = SCALE * q @ torch.cat(keys, dim=2).transpose(-1, -2)
    want = torch.autograd.grad(torch.softmax(scores, -1) @ torch.cat(values, 2), q, grad_out)[0]
    assert_close(merged_grad(lse_gradient=True), want, tol=TOL)
    assert (merged_grad(lse_gradient=False) - want).abs().max() > 1e-3 * want.abs().max()
