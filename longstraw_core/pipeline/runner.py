"""Run one stage's program (``schedule.programs``) with real transfers (``StageLink``).

The program fixes the order of every compute, exchange, wait and collective; the pass gives
what only it knows: what a compute does (``compute``), the shape of each message
(``spec``), and what a collective does (``collective``). A compute receives the payloads of
the messages it waits for and returns the one payload it sends (to every message in
``Compute.send``; ``None`` when it sends nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from longstraw_core.pipeline.schedule import (
    Collective,
    Compute,
    Drain,
    Exchange,
    Key,
    Message,
    Step,
    Wait,
)
from longstraw_core.pipeline.transport import MessageSpec, Payload, PendingExchange

if TYPE_CHECKING:
    from longstraw_core.pipeline.transport import StageLink

ComputeFn = Callable[[Compute, dict[Key, Payload]], Payload | None]


def run_program(
    link: StageLink,
    program: Iterable[Step],
    compute: ComputeFn,
    spec: Callable[[Message], MessageSpec],
    collective: Callable[[Key], None] | None = None,
) -> None:
    """Run ``program`` (this rank's stage's) step by step; see the module docstring."""
    pending: dict[int, tuple[PendingExchange, Exchange]] = {}
    inbox: dict[Message, Payload] = {}
    outbox: dict[Message, Payload] = {}
    for step in program:
        if isinstance(step, Compute):
            received = {message.key: inbox.pop(message) for message in step.recv}
            payload = compute(step, received)
            for message in step.send:
                if payload is None:
                    raise RuntimeError(f"{step} produced nothing to send as {message.key!r}")
                outbox[message] = payload
        elif isinstance(step, Exchange):
            sends = [(m.dst, outbox.pop(m), spec(m)) for m in step.sends]
            recvs = [(m.src, spec(m)) for m in step.recvs]
            pending[step.ident] = (link.exchange(sends, recvs), step)
        elif isinstance(step, Wait):
            for ident in step.idents:
                _complete(pending.pop(ident), inbox)
        elif isinstance(step, Collective):
            if collective is None:
                raise RuntimeError(f"the program joins collective {step.name!r}, none given")
            collective(step.name)
        elif isinstance(step, Drain):
            for ident in sorted(pending):
                _complete(pending.pop(ident), inbox)
    if outbox or inbox:
        unsent = [m.key for m in outbox] + [m.key for m in inbox]
        raise RuntimeError(f"messages left over after the program: {unsent}")


def _complete(entry: tuple[PendingExchange, Exchange], inbox: dict[Message, Payload]) -> None:
    exchange, step = entry
    for message, payload in zip(step.recvs, exchange.wait(), strict=True):
        inbox[message] = payload
