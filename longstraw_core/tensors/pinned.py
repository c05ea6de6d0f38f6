"""Pinned host buffers for offloaded prefix state, sized exactly.

Why not ``torch.empty(..., pin_memory=True)``: that goes through PyTorch's caching host
allocator, which rounds every block up to a power of two and keeps freed blocks cached. An
offloaded record of 600 GB would take 1 TB of page-locked memory, and what a finished step
freed stays locked. Here each record's tensors share one arena: an anonymous ``mmap`` of
exactly their bytes (rounded to a page), page-locked with ``cudaHostRegister`` and
unregistered when the last tensor viewing it is freed. ``Tensor.is_pinned()`` is true for it,
so copies from and to it stay asynchronous like those of the caching allocator's blocks.

Without CUDA nothing can be pinned: the same calls return plain memory (``torch.empty``),
which is what every CPU test sees. The arena's layout (``arena_layout``) and its lifetime are
tested on CPU with the registration calls stood in for.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Sequence

import torch

# Each tensor in an arena starts on this boundary (covers every dtype's alignment and keeps
# rows of vectorised copies aligned).
ALIGNMENT = 256
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context

Spec = tuple[Sequence[int], torch.dtype]


def arena_layout(specs: Sequence[Spec], alignment: int = ALIGNMENT) -> tuple[list[int], int]:
    """Byte offsets of tensors of ``specs`` (shape, dtype) laid one after another in one
    arena, each at a multiple of ``alignment``, and the arena's size: their bytes plus at
    most ``alignment - 1`` of padding between neighbours, nothing rounded up beyond that."""
    offsets, end = [], 0
    for shape, dtype in specs:
        start = -(-end // alignment) * alignment
        offsets.append(start)
        end = start + math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return offsets, end


def pinning_available() -> bool:
    """Whether page-locked memory can be had here (a CUDA device is present)."""
    return torch.cuda.is_available()


def empty_buffers(
    specs: Sequence[Spec], *, device: torch.device | str, pin_memory: bool = False
) -> list[torch.Tensor]:
    """Uninitialised tensors of ``specs`` on ``device``. In CPU memory with ``pin_memory``
    (and CUDA present) they share one exactly sized pinned arena; otherwise each is a plain
    ``torch.empty``."""
    device = torch.device(device)
    if device.type == "cpu" and pin_memory and pinning_available():
        return _arena_tensors(specs)
    return [torch.empty(tuple(shape), dtype=dtype, device=device) for shape, dtype in specs]


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a CPU ``tensor`` in exactly sized pinned memory (plain memory without CUDA)."""
    (copy,) = empty_buffers([(tensor.shape, tensor.dtype)], device="cpu", pin_memory=True)
    return copy.copy_(tensor)


class _RegisteredMap(mmap.mmap):
    """An anonymous mapping that unregisters its pages before it is unmapped. Tensors made
    from it with ``torch.frombuffer`` hold a reference to it, so that happens when the last
    one is freed."""

    registered: int | None = None

    def __del__(self) -> None:
        address, self.registered = self.registered, None
        if address is not None:
            with contextlib.suppress(Exception):  # at shutdown CUDA may be gone already
                _unregister(address)


def _arena_tensors(specs: Sequence[Spec]) -> list[torch.Tensor]:
    offsets, total = arena_layout(specs)
    if total == 0:
        return [torch.empty(tuple(shape), dtype=dtype) for shape, dtype in specs]
    mapping = _RegisteredMap(-1, total)
    arena = torch.frombuffer(mapping, dtype=torch.uint8, count=total)
    _register(arena.data_ptr(), total)
    mapping.registered = arena.data_ptr()
    tensors = []
    for (shape, dtype), start in zip(specs, offsets, strict=True):
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        tensors.append(arena[start : start + nbytes].view(dtype).view(tuple(shape)))
    return tensors


def _register(address: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` at ``address`` (``cudaHostRegister``); raises on failure."""
    torch.cuda.init()
    error = torch.cuda.cudart().cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE)
    if int(error) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {nbytes} bytes failed (CUDA error {int(error)}): the "
            "system may limit page-locked memory; set offload pin_memory: false to offload "
            "into pageable memory (synchronous copies)"
        )


def _unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)
