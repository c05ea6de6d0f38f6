"""Exactly sized pinned arenas for offloaded records (``longstraw_core.tensors.pinned``).

On CPU the registration calls (``cudaHostRegister`` / ``cudaHostUnregister``) are stood in
for: what is checked is the sizing (no power-of-two rounding), the layout of a record's
tensors in one arena, and that the pages are unregistered once the last view is freed. A GPU
test registers real memory.
"""

from __future__ import annotations

import gc

import pytest
import torch

from longstraw_core.kinds.attention import AttentionKV
from longstraw_core.kinds.latent import LatentKV
from longstraw_core.kinds.recurrent import RecurrentState
from longstraw_core.tensors import pinned


@pytest.fixture
def fake_pinning(monkeypatch):
    """Pinning "available" on CPU, with the registrations recorded instead of made."""
    calls: list[tuple] = []
    monkeypatch.setattr(pinned, "pinning_available", lambda: True)
    monkeypatch.setattr(pinned, "_register", lambda address, n: calls.append(("reg", address, n)))
    monkeypatch.setattr(pinned, "_unregister", lambda address: calls.append(("unreg", address)))
    return calls


def test_arena_layout_is_exact_with_aligned_starts():
    specs = [((3, 5), torch.bfloat16), ((7,), torch.float32), ((0, 4), torch.float16)]
    offsets, total = pinned.arena_layout(specs, alignment=64)
    assert offsets == [0, 64, 128]  # 30 bytes, then 28 bytes at the next 64-byte boundary
    assert total == 128
    big = [((8, 1_000_001, 128), torch.bfloat16)] * 2  # a record's keys and values
    offsets, total = pinned.arena_layout(big)
    each = 8 * 1_000_001 * 128 * 2
    assert offsets == [0, each] and total == 2 * each  # no power-of-two rounding


def test_record_tensors_share_one_registered_arena(fake_pinning):
    record = AttentionKV.empty(2, 1000, 8, dtype=torch.bfloat16, device="cpu", pin_memory=True)
    ((kind, address, nbytes),) = fake_pinning
    assert kind == "reg" and nbytes == 2 * (2 * 1000 * 8 * 2)  # exactly keys + values
    assert record.keys.data_ptr() == address
    assert record.values.data_ptr() == address + 2 * 1000 * 8 * 2
    assert record.keys.shape == record.values.shape == (2, 1000, 8)
    record.keys.fill_(1.0)
    record.values.fill_(2.0)
    assert record.keys.sum() == 16_000 and record.values.sum() == 32_000  # no overlap
    keys = record.keys[:, :10]  # a view outlives the record
    del record
    gc.collect()
    assert len(fake_pinning) == 1
    del keys
    gc.collect()
    assert fake_pinning[-1] == ("unreg", address)


def test_every_record_kind_and_pinned_copies_use_arenas(fake_pinning):
    state = RecurrentState.empty(
        12, 4, 2, 8, 8, dtype=torch.bfloat16, device="cpu", pin_memory=True
    )
    assert not state.conv.any() and not state.recurrent.any()  # zeros, as before
    latent = LatentKV.empty(50, 16, 8, 4, 32, dtype=torch.bfloat16, device="cpu", pin_memory=True)
    assert latent.index_keys is not None and latent.index_keys.shape == (50, 4)
    copy = pinned.pinned_copy(torch.arange(10.0))
    assert torch.equal(copy, torch.arange(10.0))
    sizes = [call[2] for call in fake_pinning]
    conv_bytes = 12 * 3 * 2
    recurrent_at = -(-conv_bytes // pinned.ALIGNMENT) * pinned.ALIGNMENT
    assert sizes == [recurrent_at + 2 * 8 * 8 * 4, 256 * (-(-50 * 24 * 2 // 256)) + 50 * 4 * 2, 40]


def test_without_cuda_pinning_degrades_to_plain_memory(monkeypatch):
    monkeypatch.setattr(pinned, "pinning_available", lambda: False)
    monkeypatch.setattr(pinned, "_register", lambda *a: pytest.fail("registered without CUDA"))
    record = AttentionKV.empty(2, 16, 8, dtype=torch.float32, device="cpu", pin_memory=True)
    assert record.keys.shape == (2, 16, 8) and not record.keys.is_pinned()
    (plain,) = pinned.empty_buffers([((4,), torch.float32)], device="cpu", pin_memory=False)
    assert plain.shape == (4,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_registered_arena_is_pinned_and_not_from_the_caching_allocator():
    """Real ``cudaHostRegister``: the tensors count as pinned, asynchronous copies both ways
    are correct, and the caching host allocator is not touched."""
    stats = getattr(torch.cuda, "host_memory_stats", dict)
    before = stats().get("allocated_bytes.current", 0)
    record = AttentionKV.empty(4, 3001, 64, dtype=torch.bfloat16, device="cpu", pin_memory=True)
    assert record.keys.is_pinned() and record.values.is_pinned()
    source = torch.randn(4, 3001, 64, device="cuda", dtype=torch.bfloat16)
    record.keys.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    back = record.keys.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, source)
    assert stats().get("allocated_bytes.current", 0) == before
    del record
    gc.collect()  # unregisters: a second arena at the same size must register again
    again = AttentionKV.empty(4, 3001, 64, dtype=torch.bfloat16, device="cpu", pin_memory=True)
    assert again.keys.is_pinned()
