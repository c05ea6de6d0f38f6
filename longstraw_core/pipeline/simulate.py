"""Play stage programs under NCCL's point-to-point rules: is the schedule live, how busy is it.

``simulate(programs, cost)`` runs every stage's program (``longstraw_core.pipeline.schedule``)
as the ranks would, with each compute taking ``cost(compute)`` and these rules for the
transfers (NCCL's, which gloo does not enforce):

- between two stages each side has one in-order stream, for both directions: an exchange (a
  ``batch_isend_irecv``) enters the stream of every peer it talks to and leaves them only
  when all its ops are done;
- a send completes only when the peer's stream reaches the matching receive (the ``n``-th
  send from ``a`` to ``b`` matches ``b``'s ``n``-th receive from ``a``), at the time both
  exchanges are at the heads of their streams (plus ``transfer``);
- ops of one exchange progress together; ``Wait`` blocks the stage until its exchange is
  done, a ``Collective`` until every stage has joined it.

It is a dataflow computation, not a clock-driven one: matching depends only on the order of
the streams, so the result does not depend on how the stages are visited. A schedule that
would hang raises ``ScheduleDeadlock`` naming what every stage waits for. The planner takes
its time estimate from here (the bubbles of the schedule's real op order), and the tests
prove each schedule live for many shapes (``tests/pipeline/test_schedule.py``).
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from longstraw_core.pipeline.schedule import (
    Collective,
    Compute,
    Drain,
    Exchange,
    Message,
    Step,
    UnitCosts,
    Wait,
    programs,
    replay_orders,
)


class ScheduleDeadlock(RuntimeError):
    """No stage can move: the programs would hang on NCCL."""


@dataclass
class Timeline:
    """What a simulation found: each compute's ``(stage, compute, start, end)``, each stage's
    busy time and finishing time."""

    computes: list[tuple[int, Compute, float, float]]
    busy: list[float]
    finish: list[float]

    @property
    def stages(self) -> int:
        return len(self.busy)

    @property
    def makespan(self) -> float:
        return max(self.finish, default=0.0)

    @property
    def idle_share(self) -> float:
        """The share of the stages' time (stages x makespan) spent not computing."""
        total = self.stages * self.makespan
        return 1.0 - sum(self.busy) / total if total > 0 else 0.0

    @property
    def busy_stages(self) -> float:
        """How many stages compute, on average over the makespan."""
        return sum(self.busy) / self.makespan if self.makespan > 0 else 0.0


@dataclass(eq=False)
class _Op:
    entry: _Entry
    send: bool
    message: Message
    partner: _Op | None = None
    time: float | None = None

    @property
    def peer(self) -> int:
        return self.message.dst if self.send else self.message.src


@dataclass(eq=False)
class _Entry:
    stage: int
    issued: float
    ops: list[_Op] = field(default_factory=list)
    head: dict[int, float] = field(default_factory=dict)  # peer -> time it became head
    done: float | None = None

    def describe(self) -> str:
        waiting = [
            f"{'send' if op.send else 'recv'} {op.message.key!r} "
            f"{'to' if op.send else 'from'} stage {op.peer}"
            for op in self.ops
            if op.time is None
        ]
        return "exchange issued at {:.3g}: waiting for {}".format(
            self.issued, ", ".join(waiting) or "nothing"
        )


def unit_cost(costs: UnitCosts = UnitCosts()) -> Callable[[Compute], float]:  # noqa: B008
    """``cost`` for ``simulate``: a forward costs ``costs.forward``, a backward
    ``costs.backward``."""
    return lambda compute: costs.forward if compute.kind == "F" else costs.backward


def simulate(
    stage_programs: Sequence[Sequence[Step]],
    cost: Callable[[Compute], float] | None = None,
    transfer: Callable[[Message], float] | None = None,
) -> Timeline:
    """Run ``stage_programs`` under NCCL's point-to-point rules (see the module docstring)."""
    return _Simulation(stage_programs, cost or unit_cost(), transfer or (lambda _: 0.0)).run()


class _Simulation:
    def __init__(
        self,
        stage_programs: Sequence[Sequence[Step]],
        cost: Callable[[Compute], float],
        transfer: Callable[[Message], float],
    ) -> None:
        self.programs = stage_programs
        self.cost, self.transfer = cost, transfer
        stages = len(stage_programs)
        self.pc = [0] * stages
        self.clock = [0.0] * stages
        self.busy = [0.0] * stages
        self.open: list[dict[int, _Entry]] = [{} for _ in range(stages)]
        self.queues: dict[tuple[int, int], deque[_Entry]] = {}
        self.unmatched: dict[tuple[str, int, int, object], _Op] = {}
        self.arrivals: dict[object, dict[int, float]] = {}
        self.computes: list[tuple[int, Compute, float, float]] = []

    def run(self) -> Timeline:
        progress = True
        while progress:
            progress = False
            for stage in range(len(self.programs)):
                progress |= self._advance(stage)
            progress |= self._match()
        stuck = [s for s, program in enumerate(self.programs) if self.pc[s] < len(program)]
        if stuck:
            raise ScheduleDeadlock(self._report(stuck))
        return Timeline(self.computes, self.busy, self.clock)

    # --- one stage's host -------------------------------------------------------------------

    def _advance(self, stage: int) -> bool:
        program, moved = self.programs[stage], False
        while self.pc[stage] < len(program):
            step = program[self.pc[stage]]
            if isinstance(step, Compute):
                start = self.clock[stage]
                self.clock[stage] += self.cost(step)
                self.busy[stage] += self.cost(step)
                self.computes.append((stage, step, start, self.clock[stage]))
            elif isinstance(step, Exchange):
                self._issue(stage, step)
            elif isinstance(step, Wait):
                entries = [self.open[stage][ident] for ident in step.idents]
                if any(entry.done is None for entry in entries):
                    return moved
                for entry in entries:
                    self.clock[stage] = max(self.clock[stage], entry.done)
            elif isinstance(step, Drain):
                if any(entry.done is None for entry in self.open[stage].values()):
                    return moved
                for entry in self.open[stage].values():
                    self.clock[stage] = max(self.clock[stage], entry.done)
            elif isinstance(step, Collective):
                arrived = self.arrivals.setdefault(step.name, {})
                arrived.setdefault(stage, self.clock[stage])
                if len(arrived) < len(self.programs):
                    return moved
                self.clock[stage] = max(arrived.values())
            self.pc[stage] += 1
            moved = True
        return moved

    def _issue(self, stage: int, exchange: Exchange) -> None:
        entry = _Entry(stage, self.clock[stage])
        for message in exchange.sends:
            entry.ops.append(_Op(entry, True, message))
        for message in exchange.recvs:
            entry.ops.append(_Op(entry, False, message))
        for op in entry.ops:
            key = ("recv" if op.send else "send", op.message.src, op.message.dst, op.message.key)
            partner = self.unmatched.pop(key, None)
            if partner is None:
                own = (
                    "send" if op.send else "recv",
                    op.message.src,
                    op.message.dst,
                    op.message.key,
                )
                self.unmatched[own] = op
            else:
                op.partner, partner.partner = partner, op
        for peer in sorted({op.peer for op in entry.ops}):
            queue = self.queues.setdefault((stage, peer), deque())
            if not queue:
                entry.head[peer] = entry.issued
            queue.append(entry)
        self.open[stage][exchange.ident] = entry

    # --- the streams ------------------------------------------------------------------------

    def _match(self) -> bool:
        moved = False
        for (a, b), queue in list(self.queues.items()):
            if a > b:
                continue
            other = self.queues.get((b, a))
            while queue and other:
                mine, theirs = queue[0], other[0]
                start = max(mine.head[b], theirs.head[a])
                matched = False
                for op in mine.ops:
                    partner = op.partner
                    if op.time is None and partner is not None and partner.entry is theirs:
                        op.time = partner.time = start + self.transfer(op.message)
                        matched = True
                completed = [e for e in (mine, theirs) if self._complete(e)]
                moved |= matched or bool(completed)
                if not (matched or completed):
                    break
        return moved

    def _complete(self, entry: _Entry) -> bool:
        if entry.done is not None or any(op.time is None for op in entry.ops):
            return False
        entry.done = max(op.time for op in entry.ops)
        for peer in entry.head:
            queue = self.queues[(entry.stage, peer)]
            assert queue[0] is entry
            queue.popleft()
            if queue:
                following = queue[0]
                following.head[peer] = max(following.issued, entry.done)
        return True

    def _report(self, stuck: list[int]) -> str:
        lines = ["the stage programs would hang on NCCL:"]
        for stage in stuck:
            step = self.programs[stage][self.pc[stage]]
            lines.append(f"  stage {stage} at step {self.pc[stage]} ({step}):")
            for entry in self.open[stage].values():
                if entry.done is None:
                    lines.append(f"    {entry.describe()}")
        return "\n".join(lines)


# The idle share ``replay_pieces`` aims for (issue #25: at S=8, G=8 at most 15%).
REPLAY_IDLE_TARGET = 0.15
MOST_PIECES = 32


@functools.cache
def replay_pieces(
    stages: int, branches: int, target: float = REPLAY_IDLE_TARGET, most: int = MOST_PIECES
) -> int:
    """How many pieces to cut each replayed branch into on ``stages`` stages: the fewest
    that bring the replay schedule's idle share (unit costs) to ``target``, at most ``most``.

    Starts from ``1F1B``'s bubble, ``(S - 1) / (G P + S - 1)``, which the schedule meets
    (``tests/pipeline/test_schedule.py``), then checks by simulation. Depends only on ``stages`` and
    ``branches``, so every rank (and every replica) cuts alike.
    """
    if stages <= 1 or branches < 1:
        return 1
    guess = math.ceil((stages - 1) * (1 - target) / (target * branches))
    pieces = max(1, min(guess, most))
    while pieces < most:
        timeline = simulate(programs(replay_orders(stages, [pieces] * branches)))
        if timeline.idle_share <= target:
            break
        pieces += 1
    return pieces
