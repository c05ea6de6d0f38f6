"""The collectives of a distributed save or load: rank 0 acts, the others wait, and a failure
on rank 0 is raised on every rank so that none is left waiting in a collective. In a single
process each helper does the plain thing.

The waits and the gathers go through a gloo group (the default group when it is gloo already)
with the world's timeout (``distributed.timeout_minutes``): while rank 0 writes a large
checkpoint the other ranks wait on the CPU, with no NCCL collective pending whose watchdog
could abort the job, and for as long as the run's timeout allows; objects never touch a GPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from longstraw_core.checkpoint.errors import CheckpointError
from longstraw_core.distributed import cpu_group

T = TypeVar("T")


def this_rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def gather(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order; ``[value]`` in a single process."""
    if not _distributed():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value, group=coordination_group())
    return values


def agree(error: BaseException | None) -> None:
    """Raise rank 0's ``error`` on every rank (a collective when distributed).

    Rank 0 raises it as it is; the other ranks raise a ``RuntimeError`` that quotes it (a
    ``CheckpointError``, whose message is written for the user, as the same one), so that no
    rank goes on to a collective that rank 0 will never join.
    """
    if not _distributed():
        if error is not None:
            raise error
        return
    message = [None if error is None else (type(error).__name__, str(error))]
    dist.broadcast_object_list(message, src=0, group=coordination_group())
    if error is not None:
        raise error
    if message[0] is not None:
        kind, text = message[0]
        if kind == CheckpointError.__name__:
            raise CheckpointError(text)
        raise RuntimeError(f"checkpoint failed on rank 0: {kind}: {text}")


def on_rank0(action: Callable[[], T]) -> T:
    """``action()`` on rank 0 alone while the others wait; its error is raised on every
    rank and its (picklable) result returned on every rank."""
    result, error = None, None
    if this_rank() == 0:
        try:
            result = action()
        except BaseException as caught:  # re-raised by agree, on every rank
            error = caught
    agree(error)
    if _distributed():
        box = [result]
        dist.broadcast_object_list(box, src=0, group=coordination_group())
        result = box[0]
    return result  # type: ignore[return-value]


def coordination_group() -> dist.ProcessGroup | None:
    """The group rank 0's waits and every object collective here go through
    (``distributed.cpu_group``): the default group when that is gloo, else a gloo group of
    every rank with the world's timeout, made on first use (every rank reaches the first
    ``gather`` or ``agree`` together, so they make it together)."""
    return cpu_group()


def warn(message: str) -> None:
    """A warning from rank 0 only: the ranks see the same files."""
    if this_rank() == 0:
        warnings.warn(message, stacklevel=3)
