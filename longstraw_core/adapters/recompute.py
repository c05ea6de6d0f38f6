"""Activation checkpointing of decoder layers: the checkpointed call and the records it replays.

With ``ModelAdapter.activation_checkpointing``, a pass with autograd runs each layer's work
through ``checkpointed`` (non-reentrant ``torch.utils.checkpoint``, inside the layer's FSDP
forward on a sharded model), and ``ModelAdapter.layer_records`` hands it each record as a
``LayerRecord`` (``recomputable``). Backward's recompute reads the record again (an offloaded
one from its device copy, a checkpoint input the offload hooks fetch again) and drops its
writes, which the first run made. Gradients are unchanged: the recompute only rebuilds the
saved tensors of the first run's graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from longstraw_core.kinds.forwarding import ForwardedReads


class LayerRecord(ForwardedReads):
    """One layer's record in a pass whose layers are checkpointed (``layer_records``).

    Reads (the kinds' declared reads, ``ForwardedReads``) go to the record the pass gave
    (``record``: the state's own, an exact-mode view, or the offload stream's device copy).
    Writes go there too, except while backward recomputes the layer (``replaying``): the
    first run already handed them over, and a second ``update`` of an exact-mode recurrent
    view would clear the ``dS`` its backward is about to fill. ``streamed``: the record is
    the stream's short-lived copy (released after the layer's forward), so the recompute
    reads a copy fetched again instead.
    """

    def __init__(self, record: Any, home: Any) -> None:
        self._record = record
        self._replay: Any = None
        self.streamed = record is not home
        self._names: list[str] = []
        self._fields: dict[str, Any] = {}
        self._type: type | None = None
        if self.streamed:
            home = home.reading()  # the stored record (behind an exact view)
            reader = record.reading()  # the device copy
            self._type = type(home)
            for field in dataclasses.fields(home):
                if field.init:
                    value = getattr(reader, field.name)
                    if isinstance(value, torch.Tensor):
                        self._names.append(field.name)
                    else:
                        self._fields[field.name] = value

    def _reads_target(self) -> Any:
        return self._replay if self._replay is not None else self._record

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """A streamed record's tensors (the device copy), for the checkpoint to keep: the
        offload hooks turn them into handles and fetch them again for the recompute."""
        if not self.streamed:
            return ()
        reader = self._record.reading()
        return tuple(getattr(reader, name) for name in self._names)

    @contextmanager
    def replaying(self, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        """Reads from ``tensors`` (the streamed copy fetched again) or the record itself,
        writes dropped, while backward recomputes the layer."""
        target = self._record
        if self.streamed:
            copy = self._type(**self._fields, **dict(zip(self._names, tensors, strict=True)))
            target = self._record.with_record(copy)
        self._replay = target
        try:
            yield
        finally:
            self._replay = None

    def write(self, *args: Any) -> None:
        if self._replay is None:
            self._record.write(*args)

    def update(self, *args: Any) -> None:
        if self._replay is None:
            self._record.update(*args)

    def write_output(self, *args: Any) -> None:
        self._reads_target().write_output(*args)


class RecomputableRecords:
    """The records of a checkpointed pass, each as a ``LayerRecord`` (iterated once)."""

    def __init__(self, records: Sequence[Any], homes: Sequence[Any]) -> None:
        self.records, self.homes = records, homes

    def __len__(self) -> int:
        return len(self.homes)

    def __iter__(self) -> Iterator[LayerRecord]:
        for record, home in zip(self.records, self.homes, strict=True):
            yield LayerRecord(record, home)


@contextmanager
def recomputable(
    records: AbstractContextManager[Sequence[Any]], homes: Sequence[Any]
) -> Iterator[RecomputableRecords]:
    with records as layers:
        yield RecomputableRecords(layers, homes)


def checkpointed(
    fn: Callable[[torch.Tensor], Any], record: LayerRecord, hidden: torch.Tensor
) -> Any:
    """``fn(hidden)`` under non-reentrant activation checkpointing.

    The first call is the forward; a later one is backward's recompute, which reads
    ``record`` replayed (writes dropped; a streamed record from its copy fetched again,
    which the checkpoint received as inputs).
    """
    calls = 0

    def run(hidden: torch.Tensor, *tensors: torch.Tensor) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(hidden)
        with record.replaying(tensors):
            return fn(hidden)

    return checkpoint(run, hidden, *record.tensors(), use_reentrant=False)
