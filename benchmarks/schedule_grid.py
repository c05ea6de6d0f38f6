"""The pipeline's passes over a grid of stages and group sizes, under both NCCL stream models.

    python benchmarks/schedule_grid.py                  # S in 2 3 4 8 16 32, G in 1 2 4 8 16
    python benchmarks/schedule_grid.py --stages 8 --groups 8

Each pass's programs (``longstraw_core.pipeline.schedule``) played by ``simulate`` with unit
costs (a backward twice a forward), as the pipeline runs them (``pair``: one 2-rank process
group per pair of stages that exchange) and as one group per pipeline would (``one``: every
exchange of a rank on one stream). Prints the idle share (the stages' time not computing)
of rollout's ring (``Ring``, a stop check every ``rollout.STOP_CHECK_EVERY`` steps; G=1 is
the greedy evaluation) and of replay with the pieces ``replay_pieces`` picks, "hangs" where
the programs deadlock. ``tests/pipeline/test_schedule_grid.py`` proves the ``pair`` column
live over every S in 1..32 and G in 1..16; this shows what each costs.
"""

from __future__ import annotations

import argparse

from longstraw_core.pipeline.schedule import (
    MAX_OPEN_SENDS,
    Ring,
    micro_groups,
    programs,
    replay_orders,
    ring_program,
)
from longstraw_core.pipeline.simulate import (
    ONE_GROUP,
    PAIR_GROUPS,
    ScheduleDeadlock,
    replay_pieces,
    simulate,
)
from longstraw_core.rollout.decode import STOP_CHECK_EVERY

RING_STEPS = 4 * STOP_CHECK_EVERY


def idle(stage_programs: list, streams: str) -> str:
    try:
        return f"{simulate(stage_programs, streams=streams).idle_share:6.1%}"
    except ScheduleDeadlock:
        return " hangs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4, 8, 16, 32])
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    print("  S   G | ring: pair    one | replay pieces: pair    one")
    for stages in args.stages:
        for group in args.groups:
            rows = len(micro_groups(group, stages))
            ring = ring_program(Ring(stages, rows, RING_STEPS, check_every=STOP_CHECK_EVERY))
            pieces = replay_pieces(stages, group)
            replay = programs(replay_orders(stages, [pieces] * group), MAX_OPEN_SENDS)
            print(
                f"{stages:3d} {group:3d} |     {idle(ring, PAIR_GROUPS)} {idle(ring, ONE_GROUP)} "
                f"| {pieces:6d}       {idle(replay, PAIR_GROUPS)} {idle(replay, ONE_GROUP)}"
            )


if __name__ == "__main__":
    main()
