"""What schedules are made of: messages between stages, a stage's computes, the steps of its
program (``Exchange``, ``Wait``, ``Collective``, ``Compute``, ``Drain``), and the unit costs
an order is chosen with."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "MAX_OPEN_SENDS",
    "Collective",
    "Compute",
    "Drain",
    "Exchange",
    "Key",
    "Message",
    "MessageOrderError",
    "ScheduleError",
    "Step",
    "UnitCosts",
    "Wait",
]

Key = Hashable
# Exchanges of sends only kept in flight before a stage waits for the oldest: bounds the
# memory of sent tensors (a long prefill, or a sweep over hundreds of chunks, would otherwise
# keep every chunk's hidden states or gradients until the pass ends).
MAX_OPEN_SENDS = 8


class Message(NamedTuple):
    """A message ``key`` from stage ``src`` to stage ``dst`` (a tuple: hashed in C, as a
    rollout's program holds hundreds of thousands)."""

    key: Key
    src: int
    dst: int


@dataclass(frozen=True)
class Compute:
    """``kind`` (``"F"``/``"B"``) of microbatch ``microbatch`` on ``stage``: what it receives
    before it runs and what it sends after."""

    stage: int
    kind: str
    microbatch: Key
    recv: tuple[Message, ...] = ()
    send: tuple[Message, ...] = ()


@dataclass(frozen=True)
class Exchange:
    """One ``batch_isend_irecv``, numbered ``ident`` in its stage's program: ``sends`` and
    ``recvs`` progress together."""

    ident: int
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]


@dataclass(frozen=True)
class Wait:
    """Wait for the exchanges numbered ``idents`` (each as a whole)."""

    idents: tuple[int, ...]


@dataclass(frozen=True)
class Collective:
    """A collective every member of its group joins (a pass's: every stage), named for
    the reports and the simulator's matching."""

    name: Key


@dataclass(frozen=True)
class Drain:
    """Wait for every exchange still open."""


Step = Compute | Exchange | Wait | Collective | Drain


class MessageOrderError(RuntimeError):
    """Two stages would issue the sends and receives between them in different orders:
    NCCL would match them by position and hang or deliver the wrong tensor."""


class ScheduleError(RuntimeError):
    """An order no stage could run (a dependency cycle, too few graphs allowed in flight)."""


@dataclass(frozen=True)
class UnitCosts:
    """The costs a schedule's order is chosen with (and ``simulate`` can replay): a piece's
    forward and backward on one stage, in units of a forward."""

    forward: float = 1.0
    backward: float = 2.0
