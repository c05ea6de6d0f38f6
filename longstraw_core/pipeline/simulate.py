"""Play stage programs under NCCL's rules: is the schedule live, how busy is it.

``simulate(programs, cost)`` runs every stage's program (``longstraw_core.pipeline.schedule``)
as the ranks would, with each compute taking ``cost(compute)`` and ProcessGroupNCCL's rules
for the transfers (which gloo does not enforce):

- a ``batch_isend_irecv`` runs on its process group's device communicator, whose one
  in-order stream per rank also carries that group's collectives: a rank's batches on one
  group run one after another in issue order, whatever their peers, and a batch leaves the
  stream only when all its ops are done;
- a send completes only when the peer's stream reaches the matching receive (the ``n``-th
  send from ``a`` to ``b`` matches ``b``'s ``n``-th receive from ``a``), at the time both
  batches are at the heads of their streams (plus ``transfer``), whatever the size;
- ``Wait`` blocks the stage until its exchange is done, a ``Collective`` (on another
  communicator: the pipeline's stage group, a replica group) until every program that
  names it has joined it (its group's members: programs of several replicas simulated
  together join the rollout's stop check across replicas, FSDP's gathers per stage).

``streams`` says how the programs' exchanges map onto process groups:

- ``PAIR_GROUPS`` (what the pipeline runs, ``pipeline.mesh.stage_link``): every pair of
  stages that talk has a 2-rank group of its own, so an exchange is one batch per peer, each
  on its own stream: a receive from stage ``s - 1`` never queues behind a send to ``s + 1``;
- ``ONE_GROUP``: one group for all of a pipeline's point-to-point ops, so every exchange of
  a stage is one batch on one stream. The ring rollout with fewer micro-groups than stages
  hangs there at ``S >= 3`` (``tests/pipeline/test_schedule.py`` keeps that case), which is
  why the pipeline runs pair groups.

It is a dataflow computation, not a clock-driven one: matching depends only on the order of
the streams, so the result does not depend on how the stages are visited. A schedule that
would hang raises ``ScheduleDeadlock`` naming what every stage waits for. The planner takes
its time estimate from here (the bubbles of the schedule's real op order), and the tests
prove each schedule live for many shapes (``tests/pipeline/test_schedule.py``).
"""

from __future__ import annotations

import functools
import gc
import math
from collections import deque
from collections.abc import Callable, Hashable, Sequence
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

PAIR_GROUPS = "pair"
ONE_GROUP = "one"
STREAM_MODELS = (PAIR_GROUPS, ONE_GROUP)


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


@dataclass(eq=False, slots=True)
class _Op:
    batch: _Batch
    send: bool
    message: Message
    partner: _Op | None = None
    time: float | None = None

    @property
    def peer(self) -> int:
        return self.message.dst if self.send else self.message.src


@dataclass(eq=False, slots=True)
class _Batch:
    """One ``batch_isend_irecv`` on one stream: ``head`` is when it reached the stream's
    head (``None`` while queued behind another), ``done`` when all its ops were."""

    stage: int
    stream: Hashable
    issued: float
    ops: list[_Op] = field(default_factory=list)
    head: float | None = None
    done: float | None = None

    def describe(self) -> str:
        waiting = [
            f"{'send' if op.send else 'recv'} {op.message.key!r} "
            f"{'to' if op.send else 'from'} stage {op.peer}"
            for op in self.ops
            if op.time is None
        ]
        where = "at the head of its stream" if self.head is not None else "queued"
        return "batch issued at {:.3g} ({}): waiting for {}".format(
            self.issued, where, ", ".join(waiting) or "nothing"
        )


def unit_cost(costs: UnitCosts = UnitCosts()) -> Callable[[Compute], float]:  # noqa: B008
    """``cost`` for ``simulate``: a forward costs ``costs.forward``, a backward
    ``costs.backward``."""
    return lambda compute: costs.forward if compute.kind == "F" else costs.backward


def simulate(
    stage_programs: Sequence[Sequence[Step]],
    cost: Callable[[Compute], float] | None = None,
    transfer: Callable[[Message], float] | None = None,
    streams: str = PAIR_GROUPS,
) -> Timeline:
    """Run ``stage_programs`` under NCCL's rules with the ``streams`` model (see the module
    docstring)."""
    if streams not in STREAM_MODELS:
        raise ValueError(f"streams={streams!r}: one of {STREAM_MODELS}")
    simulation = _Simulation(
        stage_programs, cost or unit_cost(), transfer or (lambda _: 0.0), streams
    )
    # The ops and batches point at each other (hundreds of thousands in a long pass): the
    # cyclic collector would rescan them all again and again while nothing is garbage yet.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return simulation.run()
    finally:
        if collecting:
            gc.enable()


class _Simulation:
    def __init__(
        self,
        stage_programs: Sequence[Sequence[Step]],
        cost: Callable[[Compute], float],
        transfer: Callable[[Message], float],
        streams: str,
    ) -> None:
        self.programs = stage_programs
        self.cost, self.transfer, self.streams = cost, transfer, streams
        stages = len(stage_programs)
        self.pc = [0] * stages
        self.clock = [0.0] * stages
        self.busy = [0.0] * stages
        self.open: list[dict[int, list[_Batch]]] = [{} for _ in range(stages)]
        self.queues: dict[Hashable, deque[_Batch]] = {}
        self.unmatched: dict[tuple[str, int, int, object], _Op] = {}
        self.arrivals: dict[object, dict[int, float]] = {}
        self.computes: list[tuple[int, Compute, float, float]] = []
        self.members: dict[Hashable, int] = {}  # collective -> how many programs join it
        for program in stage_programs:
            for name in {step.name for step in program if isinstance(step, Collective)}:
                self.members[name] = self.members.get(name, 0) + 1

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
            elif isinstance(step, (Wait, Drain)):
                idents = step.idents if isinstance(step, Wait) else tuple(self.open[stage])
                batches = [b for ident in idents for b in self.open[stage][ident]]
                if any(batch.done is None for batch in batches):
                    return moved
                for batch in batches:
                    self.clock[stage] = max(self.clock[stage], batch.done)
            elif isinstance(step, Collective):
                arrived = self.arrivals.setdefault(step.name, {})
                arrived.setdefault(stage, self.clock[stage])
                if len(arrived) < self.members[step.name]:
                    return moved
                self.clock[stage] = max(arrived.values())
            self.pc[stage] += 1
            moved = True
        return moved

    def _issue(self, stage: int, exchange: Exchange) -> None:
        ops = [(True, m) for m in exchange.sends] + [(False, m) for m in exchange.recvs]
        batches: dict[Hashable, _Batch] = {}
        for send, message in ops:
            peer = message.dst if send else message.src
            stream = (stage, peer) if self.streams == PAIR_GROUPS else (stage,)
            batch = batches.get(stream)
            if batch is None:
                batch = batches[stream] = _Batch(stage, stream, self.clock[stage])
            op = _Op(batch, send, message)
            batch.ops.append(op)
            self._pair(op)
        for stream, batch in batches.items():
            queue = self.queues.setdefault(stream, deque())
            if not queue:
                batch.head = batch.issued
            queue.append(batch)
        self.open[stage][exchange.ident] = list(batches.values())

    def _pair(self, op: _Op) -> None:
        """Meet ``op`` with its partner by order: the n-th send from a to b with b's n-th
        receive from a (messages are named, and ``programs`` checks the orders agree)."""
        message = op.message
        kind, other = ("send", "recv") if op.send else ("recv", "send")
        partner = self.unmatched.pop((other, message.src, message.dst, message.key), None)
        if partner is None:
            self.unmatched[(kind, message.src, message.dst, message.key)] = op
        else:
            op.partner, partner.partner = partner, op

    # --- the streams ------------------------------------------------------------------------

    def _match(self) -> bool:
        moved = False
        for queue in self.queues.values():
            if not queue:
                continue
            mine = queue[0]
            for op in mine.ops:
                theirs = op.partner.batch if op.partner is not None else None
                if op.time is None and theirs is not None and theirs.head is not None:
                    start = max(mine.head, theirs.head)
                    op.time = op.partner.time = start + self.transfer(op.message)
                    moved = True
        for queue in self.queues.values():
            while queue and all(op.time is not None for op in queue[0].ops):
                finished = queue.popleft()
                finished.done = max(op.time for op in finished.ops)
                if queue:
                    queue[0].head = max(queue[0].issued, finished.done)
                moved = True
        return moved

    def _report(self, stuck: list[int]) -> str:
        lines = [f"the stage programs would hang on NCCL ({self.streams} streams):"]
        for stage in stuck:
            step = self.programs[stage][self.pc[stage]]
            lines.append(f"  stage {stage} at step {self.pc[stage]} ({step}):")
            for batches in self.open[stage].values():
                for batch in batches:
                    if batch.done is None:
                        lines.append(f"    {batch.describe()}")
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
