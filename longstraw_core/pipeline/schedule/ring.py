"""Rollout on stages: micro-groups of branches that follow each other around the ring of
stages, one stop collective every ``check_every`` decode steps, the program planned again
once it decides."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from longstraw_core.pipeline.schedule.programs import programs, stage_program
from longstraw_core.pipeline.schedule.steps import (
    MAX_OPEN_SENDS,
    Compute,
    Key,
    Message,
    ScheduleError,
    Step,
)

__all__ = ["Ring", "micro_groups", "ring_orders", "ring_program", "ring_steps"]


def micro_groups(branches: int, stages: int) -> list[range]:
    """Rows of the ``m = min(branches, stages)`` micro-groups rollout decodes in turn
    (contiguous, sizes differing by at most one)."""
    count = min(branches, stages)
    sizes = [len(s) for s in _even(branches, count)]
    rows, start = [], 0
    for size in sizes:
        rows.append(range(start, start + size))
        start += size
    return rows


def _even(total: int, parts: int) -> list[range]:
    base, extra = divmod(total, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


@dataclass
class Ring:
    """The shape of a rollout on ``stages`` stages: ``groups`` micro-groups, at most
    ``max_steps`` decode steps. A stage works on micro-group ``j`` of step ``t`` at tick
    ``t * S + j + s``; at every ``check_every``-th step ``t`` (``t + 1`` a multiple of it)
    every stage joins ``Collective(("stop", t))`` right after its work of tick
    ``t * S + m + S - 2``, when the last stage has sampled every micro-group of step ``t``:
    the collective that tells every stage whether to stop (each is a host read, so there is
    one every ``check_every`` steps, not one a step). When it says stop after ``t``, the run
    ends after step ``t + 1`` (the first stage has started that step already), so steps
    beyond are never issued (``stop_at``)."""

    stages: int
    groups: int
    max_steps: int
    steps: int | None = field(default=None)  # decided: the run's number of steps
    check_every: int = 1  # decode steps between two stop collectives

    def __post_init__(self) -> None:
        if self.groups > self.stages:
            raise ScheduleError(f"{self.groups} micro-groups on {self.stages} stages")
        if self.check_every < 1:
            raise ScheduleError(f"a stop collective every {self.check_every} steps")

    def stop_at(self, t: int) -> None:
        """The collective of step ``t`` said every branch has ended."""
        self.steps = min(self.max_steps, t + 2)

    @property
    def planned_steps(self) -> int:
        return self.max_steps if self.steps is None else self.steps

    def collective_steps(self) -> range:
        """Steps that have a stop collective: every ``check_every``-th, up to the last that
        can end the run earlier (the run ends at ``t + 2`` steps)."""
        every = self.check_every
        return range(every - 1, max(0, self.max_steps - 2), every)


def ring_orders(ring: Ring) -> list[list[Compute]]:
    """Each stage's decode computes for ``ring.planned_steps`` steps (``F`` of ``(j, t)``):
    hidden states ``("H", j, t)`` forward, the last stage's tokens ``("T", j, t)`` back to
    the first stage for step ``t + 1``."""
    stages, groups, steps = ring.stages, ring.groups, ring.planned_steps
    orders: list[list[Compute]] = [[] for _ in range(stages)]
    last = stages - 1
    for s in range(stages):
        for t in range(steps):
            for j in range(groups):
                recv: list[Message] = []
                send: list[Message] = []
                if s > 0:
                    recv.append(Message(("H", j, t), s - 1, s))
                elif t > 0 and stages > 1:
                    recv.append(Message(("T", j, t - 1), last, 0))
                if s < last:
                    send.append(Message(("H", j, t), s, s + 1))
                elif t < steps - 1 and stages > 1:
                    send.append(Message(("T", j, t), last, 0))
                orders[s].append(Compute(s, "F", (j, t), tuple(recv), tuple(send)))
    return orders


def ring_program(ring: Ring, stage: int | None = None) -> list[list[Step]]:
    """``ring_orders`` as programs, with each step's stop collective in its place (with
    ``stage``: that stage's alone, in a list of one)."""
    orders = ring_orders(ring)
    stages, groups = ring.stages, ring.groups
    collectives: dict[tuple[int, int], list[Key]] = {}
    for s, order in enumerate(orders):
        index = -1  # the stage's last compute at a tick <= the collective's (ticks increase)
        for t in ring.collective_steps():
            if ring.steps is not None and t > ring.steps - 2:
                break
            tick = t * stages + groups + stages - 2
            while index + 1 < len(order) and _tick(order[index + 1], stages, s) <= tick:
                index += 1
            collectives.setdefault((s, index), []).append(("stop", t))
    if stage is not None:
        return [stage_program(orders, stage, MAX_OPEN_SENDS, collectives)]
    return programs(orders, MAX_OPEN_SENDS, collectives)


def ring_steps(ring: Ring, stage: int) -> Iterator[Step]:
    """Stage ``stage``'s program for ``ring``, planned again whenever a stop collective
    decides the number of steps: the steps run so far are the same in the new plan (they
    come before the first step that differs), so the run goes on where it was."""
    planned = ring.steps
    program = ring_program(ring, stage)[0]
    index = 0
    while index < len(program):
        yield program[index]
        index += 1
        if ring.steps != planned:
            replanned = ring_program(ring, stage)[0]
            if replanned[:index] != program[:index]:
                raise ScheduleError("the ring's plan changed before its decision point")
            program, planned = replanned, ring.steps


def _tick(compute: Compute, stages: int, stage: int) -> int:
    j, t = compute.microbatch
    return t * stages + j + stage
