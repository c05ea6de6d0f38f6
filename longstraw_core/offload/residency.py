"""``Residency``: the accounting of streamed copies on the device, kept by the stream and
observed from the copies' storages, so tests and the state's summary can check the budget."""

from __future__ import annotations

import threading
import weakref

import torch


class Residency:
    """Which offloaded layers have a streamed copy on the compute device, and the most at once.

    Two views that must agree: ``held`` is the stream's own bookkeeping (layers it fetched and
    has not handed over or released); ``live`` is observed, from a finalizer on every copy's
    storage: layers whose copied memory is still allocated, whoever holds it. ``peak_held`` and
    ``peak_live`` are the most layers at once so far (one ``Residency`` per ``PrefixState``,
    over all its passes); ``copies``/``copied_bytes`` count the transfers.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # CUDA backward and finalizers run on other threads
        self._held: set[int] = set()
        self._live: dict[int, int] = {}
        self.peak_held = 0
        self.peak_live = 0
        self.copies = 0
        self.copied_bytes = 0

    def hold(self, layer: int) -> None:
        with self._lock:
            self._held.add(layer)
            self.peak_held = max(self.peak_held, len(self._held))

    def release(self, layer: int) -> None:
        with self._lock:
            self._held.discard(layer)

    def track(self, layer: int, tensor: torch.Tensor) -> None:
        """Count ``tensor`` (a fresh copy) as ``layer``'s until its storage is freed."""
        storage = tensor.untyped_storage()
        with self._lock:
            self.copies += 1
            self.copied_bytes += storage.nbytes()
            self._live[layer] = self._live.get(layer, 0) + 1
            self.peak_live = max(self.peak_live, len(self._live))
        weakref.finalize(storage, self._freed, layer)

    def _freed(self, layer: int) -> None:
        with self._lock:
            count = self._live.get(layer, 0) - 1
            if count > 0:
                self._live[layer] = count
            else:
                self._live.pop(layer, None)

    def held_layers(self) -> set[int]:
        with self._lock:
            return set(self._held)

    def live_layers(self) -> set[int]:
        with self._lock:
            return set(self._live)

    def resident(self) -> set[int]:
        """Layers on the device now by either view."""
        with self._lock:
            return self._held | set(self._live)
