"""Exact tensor-memory measurement on any device: live storages, peak per phase.

RSS measures the allocator's history as much as live memory, and ``max_memory_allocated``
exists only on CUDA. ``LiveTensorMemory`` is a ``TorchDispatchMode`` that sees every tensor an
aten op returns, keeps a weak reference to its storage, and sums the bytes of the storages
still alive: the same quantity a caching GPU allocator reports as "allocated", deterministic
and independent of glibc or the machine's load.

What is counted: every storage created by an op while the mode is active (activations,
autograd's saved tensors, gradients, optimizer state, the prefix state), plus the storages of
tensors handed to ``track`` (parameters, buffers, optimizer state made earlier). Views share
their base's storage and are counted once.
What is not: scratch a single kernel allocates and frees internally (e.g. inside a fused CPU
attention kernel or a matmul), tensors made before the mode and never passed to ``track``,
and Python objects. CUDA's allocator rounding (512-byte blocks) is not applied.

    with LiveTensorMemory(model.parameters()) as memory:
        with memory.phase("prefill"):
            state = adapter.prefill(ids)
    memory.peak, memory.phases["prefill"]
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorMemory(TorchDispatchMode):
    """Sum of the bytes of live tensor storages, with its peak overall and per phase.

    ``device``: count only storages on this device type (``None``: all devices).
    """

    def __init__(self, tensors: Iterable[torch.Tensor] = (), device: str | None = None) -> None:
        super().__init__()
        self.device = device
        self.current = 0
        self.peak = 0
        self.phases: dict[str, int] = {}
        self._phase: str | None = None
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.track(tensors)

    # --- bookkeeping -------------------------------------------------------------------------

    def track(self, tensors: Iterable[Any]) -> None:
        """Count the storages of ``tensors`` (made before the mode) from now on."""
        for leaf in tree_leaves(list(tensors)):
            if isinstance(leaf, torch.Tensor):
                self._see(leaf)

    def _see(self, tensor: torch.Tensor, resize_only: bool = False) -> None:
        if tensor.device.type == "meta" or (
            self.device is not None and tensor.device.type != self.device
        ):
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        size = storage.nbytes()
        known = self._sizes.get(key)
        if known is None:
            if size == 0 or resize_only:
                return
            # NOTE: the callback fires when the storage itself is freed (not a view of it),
            # which is exactly when its bytes return to the allocator.
            self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._free(key))
        elif known == size:
            return
        self._sizes[key] = size
        self.current += size - (known or 0)
        self._update_peak()

    def _free(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _update_peak(self) -> None:
        self.peak = max(self.peak, self.current)
        if self._phase is not None:
            self.phases[self._phase] = max(self.phases[self._phase], self.current)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record the peak of the enclosed code as ``phases[name]`` (from the current bytes)."""
        previous = self._phase
        self._phase = name
        self.phases[name] = max(self.phases.get(name, 0), self.current)
        try:
            yield
        finally:
            self._phase = previous

    # --- the dispatch hook -------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._see(leaf)
        # In-place and out= ops may resize a storage that is already counted (and must not
        # start counting one made before the mode that was never passed to ``track``).
        if func._schema.is_mutable:
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor):
                    self._see(leaf, resize_only=True)
        return out


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str | int | float) -> int:
    """``"96GiB"`` -> 103079215104, ``"80GB"`` -> 80e9, ``"1.5 TiB"``, plain numbers: bytes.

    GB is 10**9 and GiB 2**30, as GPU vendors and ``nvidia-smi`` use them respectively.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int | float):
        value, unit = float(text), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"not a size: {text!r} (a number and a unit: 96GiB, 80GB, 512MiB)")
        value, unit = float(match.group(1)), match.group(2).lower()
    if not value > 0 or value == float("inf"):
        raise ValueError(f"a size must be positive, got {text!r}")
    return int(value * _UNITS[unit])
