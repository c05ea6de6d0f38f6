"""``stream_layers`` and the ``LayerStream`` behind it: one pass over the layers with at most
``resident_layers`` offloaded layers on the device, and the saved-tensor hooks that let
backward fetch them again instead of keeping them in the graph (the package docstring tells
the whole story)."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from longstraw_core.offload.policy import OffloadPolicy
from longstraw_core.offload.residency import Residency
from longstraw_core.tensors.device_copy import DeviceCopy, start_copy


@dataclass(frozen=True)
class _Saved:
    """What autograd keeps of a saved streamed tensor: where to fetch it again."""

    layer: int
    name: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _storage_key(storage: torch.UntypedStorage) -> tuple[str, int]:
    return str(storage.device), storage.data_ptr()


class LayerStream:
    """One pass over the layers of a state with offloaded records (see the package docstring).

    Iterating yields each layer as the adapter reads it: unchanged when it stays on the
    device; for an offloaded one a ``StreamedRecord`` (or an exact view reading the copy),
    valid until the next layer is taken. ``pack``/``unpack`` are the saved-tensor hooks of
    the pass.
    """

    def __init__(
        self,
        layers: Sequence[Any],
        position: int | None,
        device: torch.device,
        policy: OffloadPolicy,
        residency: Residency,
    ) -> None:
        self.layers = list(layers)
        # The record behind an exact-mode view, or the record itself.
        self.homes = [layer.reading() for layer in self.layers]
        self.offloaded = [policy.offloads(home.kind) for home in self.homes]
        self.position, self.device = position, torch.device(device)
        self.budget, self.residency = policy.resident_layers, residency
        self._lock = threading.RLock()
        self._windows: dict[int, Any] = {}
        self._held: dict[int, DeviceCopy] = {}  # fetched and not yet released or handed over
        # storage key -> (layer, tensor name, storage weakref), for copies made in forward
        self._storages: dict[tuple[str, int], tuple[int, str, weakref.ref]] = {}
        self._packed: dict[int, set[str]] = {}  # what the graph saved, by layer
        self._current: tuple[int, DeviceCopy] | None = None  # the layer backward is in
        self._callback_queued = False

    # --- forward ------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        order = [index for index, offloaded in enumerate(self.offloaded) if offloaded]
        for index, layer in enumerate(self.layers):
            if not self.offloaded[index]:
                yield layer
                continue
            self._fill_window(order, index)
            local = self._take(index)
            yield local
            _release_local(local)
            del local  # before the next fetch: nothing may keep this layer's copy alive
            self._drop(index)

    def _fill_window(self, order: list[int], index: int) -> None:
        """Fetch layer ``index`` and, within the budget, the offloaded layers after it."""
        for upcoming in order[order.index(index) :]:
            if upcoming not in self._held:
                if len(self._held) >= self.budget:
                    break
                self._held[upcoming] = self._fetch(upcoming, register=True)
                self.residency.hold(upcoming)

    def _take(self, index: int) -> Any:
        """Layer ``index`` as the adapter reads it, once its copy has arrived."""
        copy = self._held[index]
        copy.wait()
        record = dataclasses.replace(self._window(index), **copy.tensors)
        # A ``StreamedRecord`` (reads the copy, writes go home); an exact-mode view of the
        # copy whose gradients still go into ``dS`` (``LayerState.with_record``).
        return self.layers[index].with_record(record)

    def _drop(self, index: int) -> None:
        self._held.pop(index, None)
        self.residency.release(index)

    def close(self) -> None:
        """Release what the forward still holds (the graph keeps handles, not copies)."""
        for index in list(self._held):
            self._drop(index)

    # --- fetching -----------------------------------------------------------------------------

    def _window(self, index: int) -> Any:
        """The home's tensors this pass reads, as views in CPU memory (kept for backward)."""
        if index not in self._windows:
            self._windows[index] = self.homes[index].window(self.position)
        return self._windows[index]

    def _fetch(self, index: int, register: bool, names: set[str] | None = None) -> DeviceCopy:
        window = self._window(index)
        tensors = {
            field.name: value
            for field in dataclasses.fields(window)
            if isinstance(value := getattr(window, field.name), torch.Tensor)
            and (names is None or field.name in names)
        }
        copy = start_copy(tensors, self.device)
        for name, tensor in copy.tensors.items():
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                continue
            self.residency.track(index, tensor)
            if register:
                key = _storage_key(storage)
                self._storages[key] = (index, name, weakref.ref(storage))
                weakref.finalize(storage, self._storages.pop, key, None)
        return copy

    # --- saved-tensor hooks: the graph keeps handles, backward fetches again ------------------

    def pack(self, tensor: torch.Tensor) -> Any:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # tensors without storage
            return tensor
        entry = self._storages.get(_storage_key(storage))
        if entry is None or entry[2]() is not storage:
            return tensor
        index, name, _ = entry
        with self._lock:
            self._packed.setdefault(index, set()).add(name)
        return _Saved(index, name, tuple(tensor.shape), tensor.stride(), tensor.storage_offset())

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        with self._lock:
            base = self._backward_copy(saved.layer, saved.name)
        return base.as_strided(saved.size, saved.stride, saved.offset)

    def _backward_copy(self, index: int, name: str) -> torch.Tensor:
        """Layer ``index``'s copy of ``name``. The layer backward is in stays held until it
        moves to another (its nodes unpack one after another: keys, values, a recurrent
        state read by several ops), and is dropped before that layer is fetched."""
        if self._current is not None and self._current[0] == index:
            return self._current[1].tensors[name]
        self._drop_current()
        copy = self._held.pop(index, None)  # prefetched
        if copy is None:
            copy = self._fetch(index, register=False, names=self._packed[index])
            self.residency.hold(index)
        copy.wait()
        if self._queue_end_of_backward():
            self._current = (index, copy)
            self._prefetch_before(index)
        else:  # not inside a backward: nothing would release it, so do not keep it
            self.residency.release(index)
        return copy.tensors[name]

    def _drop_current(self) -> None:
        if self._current is not None:
            self.residency.release(self._current[0])
            self._current = None

    def _prefetch_before(self, index: int) -> None:
        """Start copying the next layer backward will need, if the budget allows."""
        earlier = [layer for layer in self._packed if layer < index]
        if not earlier:
            return
        target = max(earlier)
        resident = self.residency.resident() | {index}
        if target in resident or target in self._held or len(resident) >= self.budget:
            return
        self._held[target] = self._fetch(target, register=False, names=self._packed[target])
        self.residency.hold(target)

    def _queue_end_of_backward(self) -> bool:
        """Drop unused prefetches when this backward ends; False outside a backward."""
        if self._callback_queued:
            return True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        except RuntimeError:
            return False
        self._callback_queued = True
        return True

    def _end_of_backward(self) -> None:
        with self._lock:
            self._drop_current()
            self.close()
            self._callback_queued = False


def _release_local(local: Any) -> None:
    """Drop a layer's reference to its device copy (the adapter's loop variables still hold
    the wrapper when the next layer is fetched): a ``StreamedRecord`` or an exact view."""
    local.release()


class _StreamContext(AbstractContextManager):
    """``stream_layers`` for a state with offloaded layers: the stream plus its hooks."""

    def __init__(self, stream: LayerStream) -> None:
        self.stream = stream
        self.hooks: AbstractContextManager = nullcontext()
        if torch.is_grad_enabled():
            self.hooks = torch.autograd.graph.saved_tensors_hooks(stream.pack, stream.unpack)

    def __enter__(self) -> LayerStream:
        self.hooks.__enter__()
        return self.stream

    def __exit__(self, *exc: object) -> None:
        try:
            self.stream.close()
        finally:
            self.hooks.__exit__(*exc)


def stream_layers(
    state: Any, position: int | None, device: torch.device
) -> AbstractContextManager[Sequence[Any]]:
    """The layers of ``state`` as one pass over them reads them (``with ... as layers``).

    ``position``: where the pass starts reading (a prefill chunk or a recomputed chunk reads
    the state before its start), ``None`` for the whole prompt (branches, decoding). With
    nothing offloaded this is ``state.layers`` itself: no copies, no hooks.
    """
    policy = state.offload
    if policy is None or not policy.active:
        return nullcontext(state.layers)
    stream = LayerStream(state.layers, position, device, policy, state.residency)
    return _StreamContext(stream)
