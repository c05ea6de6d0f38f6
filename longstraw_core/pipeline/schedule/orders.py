"""The orders of the passes over the stages: forward-only passes (prefill, scoring) and passes
with autograd, branches of pieces (replay, exact mode's sweep)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from longstraw_core.pipeline.schedule.steps import Compute, Message, ScheduleError, UnitCosts

__all__ = ["forward_orders", "graphs_in_flight", "replay_orders", "split_pieces"]

_UNIT_COSTS = UnitCosts()  # the default costs (frozen: one instance serves every call)


def forward_orders(stages: int, count: int, crosses: Callable[[int], bool] | None = None):
    """Each stage runs microbatches ``0..count-1`` forward, in order. A microbatch that does
    not ``cross`` runs on each stage alone (an idle pass padding a replica to its FSDP peers'
    count): no messages."""
    orders: list[list[Compute]] = [[] for _ in range(stages)]
    for stage in range(stages):
        for k in range(count):
            crossing = crosses is None or crosses(k)
            recv = (Message(("F", k), stage - 1, stage),) if crossing and stage > 0 else ()
            last = stage == stages - 1
            send = (Message(("F", k), stage, stage + 1),) if crossing and not last else ()
            orders[stage].append(Compute(stage, "F", k, recv, send))
    return orders


def replay_orders(
    stages: int,
    pieces: Sequence[int],
    costs: UnitCosts = _UNIT_COSTS,
    in_flight: Sequence[int] | None = None,
) -> list[list[Compute]]:
    """Each stage's order of forwards and backwards for branches of ``pieces[b]`` pieces.

    Microbatch ``m`` numbers the pieces in forward order (branch by branch). Dependencies:
    ``F(s, m)`` after ``F(s - 1, m)``; ``B(s, m)`` after ``F(s, m)``, after ``B(s + 1, m)``
    (the gradient of its output) and after the backward of the branch's next piece on the
    same stage (the gradient of the state it wrote); on the last stage a branch's first
    backward waits for its last piece's forward (the loss). Each stage runs, at each free
    moment of a simulation with ``costs``, the next backward if it is ready, else the next
    forward if it is ready and the stage holds fewer than ``in_flight[s]`` graphs (default:
    ``graphs_in_flight``), else waits. The result depends only on the arguments, so every
    rank computes the same orders.
    """
    if stages < 1 or any(p < 1 for p in pieces):
        raise ScheduleError(f"need stages >= 1 and pieces >= 1, got {stages}, {list(pieces)}")
    first_piece = [0]
    for count in pieces:
        first_piece.append(first_piece[-1] + count)
    total = first_piece[-1]
    branch_of = [b for b, count in enumerate(pieces) for _ in range(count)]
    backward_order = [
        first_piece[b] + p for b, count in enumerate(pieces) for p in reversed(range(count))
    ]
    caps = list(in_flight or graphs_in_flight(stages, max(pieces, default=1), costs))
    inf = float("inf")
    forward_done = [[inf] * total for _ in range(stages)]
    backward_done = [[inf] * total for _ in range(stages)]
    next_forward = [0] * stages
    next_backward = [0] * stages
    free = [0.0] * stages
    orders: list[list[Compute]] = [[] for _ in range(stages)]

    def backward_ready(s: int) -> float:
        if next_backward[s] >= total:
            return inf
        m = backward_order[next_backward[s]]
        ready = forward_done[s][m]
        if s < stages - 1:
            ready = max(ready, backward_done[s + 1][m])
        else:
            ready = max(ready, forward_done[s][first_piece[branch_of[m] + 1] - 1])
        return ready

    def forward_ready(s: int) -> float:
        if next_forward[s] >= total or next_forward[s] - next_backward[s] >= caps[s]:
            return inf
        return 0.0 if s == 0 else forward_done[s - 1][next_forward[s]]

    def next_action(s: int) -> tuple[float, str]:
        """When stage ``s`` can start its next compute, and which: the backward if it is
        ready by then, else the forward."""
        backward = max(free[s], backward_ready(s))
        forward = max(free[s], forward_ready(s))
        return (backward, "B") if backward <= forward else (forward, "F")

    for _ in range(2 * total * stages):
        # The earliest compute any stage can start: dependencies are scheduled before what
        # needs them, so a start time is final once chosen.
        choices = []
        for stage in range(stages):
            if next_backward[stage] < total:
                when, what = next_action(stage)
                choices.append((when, -stage, what, stage))
        start, _, kind, s = min(choices)
        if start == inf:
            raise ScheduleError(
                f"no stage can proceed with at most {caps} graphs in flight per stage"
            )
        if kind == "B":
            m = backward_order[next_backward[s]]
            next_backward[s] += 1
            backward_done[s][m] = free[s] = start + costs.backward
        else:
            m = next_forward[s]
            next_forward[s] += 1
            forward_done[s][m] = free[s] = start + costs.forward
        orders[s].append(_piece_compute(stages, s, kind, m))
    return orders


def graphs_in_flight(
    stages: int,
    pieces: int,
    costs: UnitCosts = _UNIT_COSTS,
    lookahead: int | None = None,
) -> list[int]:
    """Each stage's most graphs in flight in ``replay_orders``: a whole branch of ``pieces``,
    plus ``lookahead`` per stage after it. The default, ``min(pieces, round trip)``, where the
    round trip is a piece's forward and backward in forward units (3), is the least that
    reaches 1F1B's bubble over every piece, ``(S - 1) / (G P + S - 1)``
    (``tests/pipeline/test_schedule.py``); with one piece it is 1F1B's ``S - s``."""
    if lookahead is None:
        round_trip = math.ceil((costs.forward + costs.backward) / costs.forward)
        lookahead = min(pieces, round_trip)
    return [pieces + lookahead * (stages - 1 - s) for s in range(stages)]


def _piece_compute(stages: int, stage: int, kind: str, m: int) -> Compute:
    if kind == "F":
        recv = (Message(("F", m), stage - 1, stage),) if stage > 0 else ()
        send = (Message(("F", m), stage, stage + 1),) if stage < stages - 1 else ()
    else:
        recv = (Message(("B", m), stage + 1, stage),) if stage < stages - 1 else ()
        send = (Message(("B", m), stage, stage - 1),) if stage > 0 else ()
    return Compute(stage, kind, m, recv, send)


def split_pieces(length: int, pieces: int) -> list[tuple[int, int]]:
    """``(start, length)`` of ``pieces`` contiguous pieces of a branch of ``length`` tokens,
    as equal as can be (the first ones one token longer); a branch shorter than ``pieces``
    gets one-token pieces and ``(length, 0)`` for the rest (idle pieces)."""
    base, extra = divmod(length, pieces)
    spans, start = [], 0
    for p in range(pieces):
        size = base + (1 if p < extra else 0)
        spans.append((start, size))
        start += size
    return spans
