"""CPU offload of the prefix state: where each layer type's state lives, and the stream that
brings offloaded layers to the compute device one layer at a time.

At millions of tokens the state outgrows the accelerator (every full-attention layer's K/V
grows with the prompt). ``OffloadPolicy`` keeps chosen layer types in CPU memory (pinned when
the model runs on CUDA): prefill copies each chunk's state out as soon as it is computed, and every
pass that reads the state (branch replay, exact mode's sweep, rollout) goes through
``stream_layers``, which hands the adapter each offloaded layer as a short-lived device copy.

- **Forward.** At most ``resident_layers`` offloaded layers are on the device at once: the
  layer computing and the next ones in flight. On CUDA the copies run on a side stream that
  first waits for the compute stream (so a copy reads what prefill has already written); the
  compute stream waits on the copy's event before it reads it, and the copy is marked as used
  by the compute stream (``record_stream``) so the allocator cannot hand its memory out while
  kernels still read it. A layer's copy is dropped before the next one beyond the budget is
  fetched.
- **Backward.** Autograd would keep every layer's copy alive in the graph until backward,
  pinning the whole state on the device. Saved-tensor hooks replace a saved copy (or any view
  of one) by a handle, and backward fetches it again when a node needs it: layers stream back
  in reverse order, with the previous layer prefetched while the budget allows.
- **Exact mode.** ``dS`` of an offloaded layer is created beside its state (in CPU memory).
  The attention kernels and gradient sinks add each block's gradient straight into it (they
  move the block to the sink's device), so no state-sized buffer ever appears on the device.
  The D2H traffic is one state's worth per branch, inherent to keeping ``dS`` off the device;
  on CUDA each block's copy is synchronous (correct; not yet overlapped with compute).

Without CUDA the same code runs with both sides in CPU memory: the "device" copy is a real
copy, so the residency accounting (``Residency``) means the same thing and tests can check it.

NOTE: what has been run. Everything on CPU. The CUDA path (pinned memory, side stream, events,
``record_stream``, asynchronous copies into pinned memory at prefill) has NOT been run: it was
written from the PyTorch stream semantics without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from longstraw_core.kinds.forwarding import ForwardedReads
from longstraw_core.registry_view import RegistryView

PLACEMENTS = ("device", "cpu")
# The policy field that places each record kind (``LayerState.kind``), as the model families
# declare it (``model_adapters.registry.layer_kinds``; built on first use: the adapters import
# this module).
LAYER_TYPES: Mapping[str, str] = RegistryView("layer_kinds")
_FIELDS = ("attention", "recurrent", "latent")


@dataclass(frozen=True)
class OffloadPolicy:
    """Where each layer type keeps its prefix state, and how much of it may be on the device.

    ``attention`` (full-attention K/V), ``recurrent`` (Gated DeltaNet conv and recurrent
    states, and their chunk-start checkpoints) and ``latent`` (MLA latent and DSA indexer keys)
    are each ``"device"`` (kept on the compute device) or ``"cpu"`` (kept in CPU memory and
    streamed in layer by layer). ``resident_layers``: the most offloaded layers on the device at
    once during a pass (1: no overlap of copy and compute; 2: the next layer is copied while the
    current one computes). ``pin_memory``: pin the CPU copies when the model runs on CUDA
    (asynchronous copies need it).
    """

    attention: str = "device"
    recurrent: str = "device"
    latent: str = "device"
    resident_layers: int = 2
    pin_memory: bool = True

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            if value not in PLACEMENTS:
                raise ValueError(f"offload {name}={value!r}: a placement is 'device' or 'cpu'")
        count = self.resident_layers
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(
                f"offload resident_layers={count!r}: at least one layer must fit on the device"
            )
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"offload pin_memory={self.pin_memory!r}: must be True or False")

    @classmethod
    def cpu(cls, resident_layers: int = 2, pin_memory: bool = True) -> OffloadPolicy:
        """Every layer type in CPU memory."""
        return cls("cpu", "cpu", "cpu", resident_layers, pin_memory)

    @classmethod
    def parse(cls, value: OffloadPolicy | str | Mapping[str, Any] | None) -> OffloadPolicy | None:
        """A policy from config: ``None``, a policy, ``"device"``/``"cpu"`` for every layer
        type, or a mapping of the dataclass's fields (``{"attention": "cpu", ...}``)."""
        if value is None or isinstance(value, OffloadPolicy):
            return value
        if isinstance(value, str):
            if value not in PLACEMENTS:
                raise ValueError(f"offload={value!r}: a placement is 'device' or 'cpu'")
            return cls(value, value, value)
        if isinstance(value, Mapping):
            known = {field.name for field in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(
                    f"offload has unknown keys {unknown}; known: {sorted(known)} "
                    f"(layer types: {list(_FIELDS)})"
                )
            return cls(**value)
        raise ValueError(
            f"offload must be None, 'device', 'cpu', a mapping or an OffloadPolicy, got {value!r}"
        )

    def placement(self, kind: str) -> str:
        """``"device"`` or ``"cpu"`` for a layer type (``"attention"``, ...) or record kind."""
        name = LAYER_TYPES.get(kind, kind)
        if name not in _FIELDS:
            raise ValueError(
                f"unknown layer type {kind!r}; layer types: {list(_FIELDS)}, record kinds: "
                f"{list(LAYER_TYPES)}"
            )
        return getattr(self, name)

    def offloads(self, kind: str) -> bool:
        return self.placement(kind) == "cpu"

    @property
    def active(self) -> bool:
        """Whether any layer type is kept in CPU memory."""
        return any(getattr(self, name) == "cpu" for name in _FIELDS)


def home_options(policy: OffloadPolicy | None, kind: str, device: torch.device) -> dict[str, Any]:
    """``device`` and ``pin_memory`` for a new record of ``kind`` computed on ``device``: where
    its state lives. Pinned only for a CUDA device (asynchronous copies need it; elsewhere it
    would only take page-locked memory from the system)."""
    if policy is None or not policy.offloads(kind):
        return {"device": device, "pin_memory": False}
    pin = policy.pin_memory and torch.device(device).type == "cuda"
    return {"device": torch.device("cpu"), "pin_memory": pin}


# --- residency --------------------------------------------------------------------------------


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


# --- transfers --------------------------------------------------------------------------------


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def copy_rows(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """``dst.copy_(src)``, one contiguous row of the leading axis at a time when ``src`` or
    ``dst`` is strided (a slice of a preallocated buffer): a strided copy between CPU and CUDA
    would go through a pageable temporary and lose the asynchrony of pinned memory."""
    if dst.device == src.device or (dst.is_contiguous() and src.is_contiguous()):
        dst.copy_(src, non_blocking=non_blocking)
        return
    for dst_row, src_row in zip(dst, src, strict=True):
        dst_row.copy_(src_row, non_blocking=non_blocking)


class _Copy:
    """One layer's tensors copied to the device, and the event that says they are there."""

    def __init__(self, tensors: dict[str, torch.Tensor], event: torch.cuda.Event | None) -> None:
        self.tensors = tensors
        self.event = event

    def wait(self) -> None:
        """Make the current stream wait for the copy and own its memory from now on."""
        if self.event is None:
            return
        stream = torch.cuda.current_stream(self.event_device)
        stream.wait_event(self.event)
        for tensor in self.tensors.values():
            tensor.record_stream(stream)  # freed memory waits for this stream's kernels
        self.event = None

    @property
    def event_device(self) -> torch.device:
        return next(iter(self.tensors.values())).device


def _start_copy(tensors: dict[str, torch.Tensor], device: torch.device) -> _Copy:
    """Fresh contiguous copies of ``tensors`` on ``device``; on CUDA through the side stream."""
    if device.type != "cuda":
        copies = {}
        for name, source in tensors.items():
            copies[name] = torch.empty(source.shape, dtype=source.dtype, device=device)
            copy_rows(copies[name], source)
        return _Copy(copies, None)
    compute, side = torch.cuda.current_stream(device), _side_stream(device)
    side.wait_stream(compute)  # the state prefill has queued must land before it is read
    with torch.cuda.stream(side):
        copies = {}
        for name, source in tensors.items():
            copies[name] = torch.empty(source.shape, dtype=source.dtype, device=device)
            copy_rows(copies[name], source, non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    return _Copy(copies, event)


# --- the stream -------------------------------------------------------------------------------


class StreamedRecord(ForwardedReads):
    """An offloaded record during one layer of a pass: reads (the kinds' declared reads,
    ``ForwardedReads``) come from its device copy, writes (a prefill chunk's) go to its home
    in CPU memory."""

    def __init__(self, local: Any, home: Any) -> None:
        self._local, self._home = local, home

    def _reads_target(self) -> Any:
        if self._local is None:
            raise RuntimeError(f"a streamed {type(self._home).__name__} was read after release")
        return self._local

    def reading(self) -> Any:
        """The device copy this layer reads (``LayerState.reading``)."""
        return self._reads_target()

    def with_record(self, copy: Any) -> StreamedRecord:
        """The same home reading ``copy`` instead (``LayerState.with_record``)."""
        return StreamedRecord(copy, self._home)

    def write(self, *args: Any) -> None:
        self._home.write(*args)

    def update(self, *args: Any) -> None:
        self._home.update(*args)

    def write_output(self, *args: Any) -> None:
        self._home.write_output(*args)

    def release(self) -> None:
        self._local = None


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
    """One pass over the layers of a state with offloaded records (see the module docstring).

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
        self._held: dict[int, _Copy] = {}  # fetched and not yet released or handed over
        # storage key -> (layer, tensor name, storage weakref), for copies made in forward
        self._storages: dict[tuple[str, int], tuple[int, str, weakref.ref]] = {}
        self._packed: dict[int, set[str]] = {}  # what the graph saved, by layer
        self._current: tuple[int, _Copy] | None = None  # the layer backward is in
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

    def _fetch(self, index: int, register: bool, names: set[str] | None = None) -> _Copy:
        window = self._window(index)
        tensors = {
            field.name: value
            for field in dataclasses.fields(window)
            if isinstance(value := getattr(window, field.name), torch.Tensor)
            and (names is None or field.name in names)
        }
        copy = _start_copy(tensors, self.device)
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
