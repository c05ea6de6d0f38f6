"""Every pass the stages run is live under NCCL's stream model, for every S in 1..32 and
G in 1..16, alone and as replicas.

The programs are played by ``simulate`` with the pipeline's process groups
(``PAIR_GROUPS``: one 2-rank group per pair of stages that exchange, each its own in-order
stream; the stage group's collectives on another): prefill (a forward over prompt chunks),
rollout (the ring of ``min(G, S)`` micro-groups; the greedy evaluation is its G=1 and the
agents' turns run the same ring program over their micro-groups, ``rollout_turns``),
replay (``G`` branches in pieces) and exact mode's sweep (1F1B over prompt chunks). With
one group for a whole pipeline (``ONE_GROUP``, one stream per rank) the ring hangs whenever
G < S at S >= 3: the reason the pipeline runs pair groups, checked on the same grid.

A ring's decode steps repeat one pattern, so a few steps (with two stop checks) show what
every step does; replay uses one and two pieces a branch (the piece counts ``replay_pieces``
picks are checked at the targets in ``test_schedule.py``). The idle shares over the grid:
``python benchmarks/schedule_grid.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from longstraw_core.pipeline.schedule import (
    MAX_OPEN_SENDS,
    Collective,
    Compute,
    Drain,
    Exchange,
    Message,
    Ring,
    Step,
    Wait,
    forward_orders,
    micro_groups,
    programs,
    replay_orders,
    ring_program,
)
from longstraw_core.pipeline.simulate import ONE_GROUP, ScheduleDeadlock, replay_pieces, simulate

STAGES = range(1, 33)
BRANCHES = range(1, 17)
RING_STEPS, CHECK_EVERY = 4, 2  # two stop checks
CHUNKS = 12  # prefill's and the sweep's prompt chunks


def ring_shapes() -> list[tuple[int, int]]:
    """Every (S, micro-groups) a rollout of 1..16 branches makes: ``min(G, S)``."""
    shapes = {(s, len(micro_groups(g, s))) for s, g in itertools.product(STAGES, BRANCHES)}
    return sorted(shapes)


def test_every_ring_is_live_and_needs_pair_groups():
    """Rollout, greedy evaluation and agents' turns at every S and G: live with pair groups,
    each stage computing every micro-group every step; with one group a pipeline, hung
    exactly where the micro-groups are fewer than the stages (S >= 3)."""
    for stages, groups in ring_shapes():
        ring_programs = ring_program(Ring(stages, groups, RING_STEPS, check_every=CHECK_EVERY))
        timeline = simulate(ring_programs)
        assert len(timeline.computes) == stages * groups * RING_STEPS, (stages, groups)
        assert timeline.busy_stages <= groups + 1e-9  # each micro-group on one stage at a time
        if stages >= 3 and groups < stages:
            with pytest.raises(ScheduleDeadlock):
                simulate(ring_programs, streams=ONE_GROUP)
        else:
            simulate(ring_programs, streams=ONE_GROUP)


@pytest.mark.parametrize("pieces", [1, 2])
def test_every_replay_is_live(pieces):
    """Replay of G branches of ``pieces`` pieces at every S, G: live, every forward and
    backward run, and never idler than 1F1B's bubble over its pieces allows."""
    for stages, branches in itertools.product(STAGES, BRANCHES):
        orders = replay_orders(stages, [pieces] * branches)
        timeline = simulate(programs(orders, MAX_OPEN_SENDS))
        assert len(timeline.computes) == 2 * stages * branches * pieces
        bubble = (stages - 1) / (branches * pieces + stages - 1)
        assert timeline.idle_share <= bubble + 1e-9, (stages, branches)


@pytest.mark.parametrize("stages", STAGES)
def test_prefill_and_the_sweep_are_live(stages):
    """Prefill's forward over the chunks (the last two idle padding, as an FSDP replica
    runs) and exact mode's sweep (1F1B over the chunks, last first)."""
    prefill = programs(forward_orders(stages, CHUNKS, lambda k: k < CHUNKS - 2), MAX_OPEN_SENDS)
    assert simulate(prefill).makespan == CHUNKS + stages - 1
    sweep = simulate(programs(replay_orders(stages, [1] * CHUNKS), MAX_OPEN_SENDS))
    assert len(sweep.computes) == 2 * stages * CHUNKS


def replicated(
    stage_programs: list[list[Step]], replicas: int, shared: Callable[[object], bool]
) -> list[list[Step]]:
    """``replicas`` copies of one pipeline's programs as one world (rank ``d S + s``), each
    pipeline's messages its own, FSDP's gathers before every compute (a collective of the
    stage's replicas, ``("gather", s, i)``), and the collectives ``shared`` names joined by
    every replica (the rollout's stop check on a sharded model), the rest per pipeline."""
    stages, world = len(stage_programs), []

    def moved(message: Message, d: int) -> Message:
        return Message((d, message.key), message.src + d * stages, message.dst + d * stages)

    for d in range(replicas):
        for stage, program in enumerate(stage_programs):
            steps: list[Step] = []
            computes = 0
            for step in program:
                if isinstance(step, Compute):
                    steps.append(Collective(("gather", stage, computes)))
                    computes += 1
                    steps.append(
                        Compute(
                            step.stage + d * stages,
                            step.kind,
                            (d, step.microbatch),
                            tuple(moved(m, d) for m in step.recv),
                            tuple(moved(m, d) for m in step.send),
                        )
                    )
                elif isinstance(step, Exchange):
                    sends = tuple(moved(m, d) for m in step.sends)
                    steps.append(
                        Exchange(step.ident, sends, tuple(moved(m, d) for m in step.recvs))
                    )
                elif isinstance(step, Collective):
                    steps.append(step if shared(step.name) else Collective((d, step.name)))
                else:
                    assert isinstance(step, (Wait, Drain))
                    steps.append(step)
            world.append(steps)
    return world


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
def test_replicas_are_live_together(stages, replicas):
    """``replicas`` pipelines whose stages gather their FSDP shards before every compute,
    and whose rollouts join one stop check: every pass live, and as busy as one pipeline
    (the replicas run the same programs in step)."""
    passes = {
        "prefill": programs(forward_orders(stages, CHUNKS), MAX_OPEN_SENDS),
        "sweep": programs(replay_orders(stages, [1] * CHUNKS), MAX_OPEN_SENDS),
    }
    for branches in (1, 2, 8):
        ring = Ring(
            stages, len(micro_groups(branches, stages)), RING_STEPS, check_every=CHECK_EVERY
        )
        passes[f"ring G={branches}"] = ring_program(ring)
        orders = replay_orders(stages, [replay_pieces(stages, branches)] * branches)
        passes[f"replay G={branches}"] = programs(orders, MAX_OPEN_SENDS)
    for name, stage_programs in passes.items():
        alone = simulate(stage_programs)
        together = simulate(
            replicated(stage_programs, replicas, shared=lambda key: key[0] == "stop")
        )
        assert len(together.computes) == replicas * len(alone.computes), name
        assert together.idle_share == pytest.approx(alone.idle_share), name


def test_replica_collectives_out_of_order_hang():
    """The simulator's check on itself: one replica joining its stage's gathers in another
    order than its peer (NCCL's rule: the same collective order on every rank) hangs."""
    stage_programs = programs(forward_orders(2, 3), MAX_OPEN_SENDS)
    world = replicated(stage_programs, 2, shared=lambda key: False)
    simulate(world)
    late = Collective(("gather", 1, 2))
    world[3] = [late, *(step for step in world[3] if step != late)]
    with pytest.raises(ScheduleDeadlock):
        simulate(world)
