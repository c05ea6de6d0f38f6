"""The collectives of a distributed save or load: rank 0 acts, the others wait, and a failure
on rank 0 is raised on every rank so that none is left waiting in a collective. In a single
process each helper does the plain thing."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

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
    dist.all_gather_object(values, value)
    return values


def agree(error: BaseException | None) -> None:
    """Raise rank 0's ``error`` on every rank (a collective when distributed).

    Rank 0 raises it as it is; the other ranks raise a ``RuntimeError`` that quotes it, so
    that no rank goes on to a collective that rank 0 will never join.
    """
    if not _distributed():
        if error is not None:
            raise error
        return
    message = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(message, src=0)
    if error is not None:
        raise error
    if message[0] is not None:
        raise RuntimeError(f"checkpoint failed on rank 0: {message[0]}")


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
        dist.broadcast_object_list(box, src=0)
        result = box[0]
    return result  # type: ignore[return-value]


def warn(message: str) -> None:
    """A warning from rank 0 only: the ranks see the same files."""
    if this_rank() == 0:
        warnings.warn(message, stacklevel=3)
