"""Replay in pieces on pipeline stages: what stage ``s`` holds when it holds the most.

Why: on ``S > 1`` stages replay cuts each of the ``G`` branches into ``P`` pieces
(``Stage.pieces_for``; ``distributed.replay_pieces``) and runs them in the order
``pipeline.schedule.replay_orders`` gives: forwards in order, a branch's backwards last piece
first, at most ``graphs_in_flight(S, P)[s]`` piece graphs on stage ``s``. What a stage holds
then is not 1F1B's ``S - s`` whole branches but (``longstraw_core.adapters.staged_backward.replay_branches``,
``kinds.base.GrowingPiece``, ``kinds.recurrent.RecurrentPiece``):

- each held piece's graph of this stage's layers over its ``T / P`` tokens; without
  activation checkpointing its attention also saves the branch's keys and values so far
  (the earlier pieces' rows concatenated with its own; MLA: the latent and index keys);
- what each piece writes, kept as the leaves later pieces read until the branch's first piece
  has run its backward (keys and values, the latent; Gated DeltaNet's final conv and
  recurrent states, until the piece's own backward: the conv window is a view of the
  piece's conv input, which it keeps), and the gradients later pieces' backwards leave in
  those leaves, which seed the earlier pieces' backwards;
- the hidden states received and sent per held piece (``InFlight.stage_buffers``).

The count is ``most_held``; which pieces are held is a window of the order: the front
branch's first pieces (the one in its backward last) and the pieces after it in forward
order. ``piece_memory`` takes the fullest such window over the front branch's backwards, for
the number of replayed branches that holds the most (``replayed_counts``).
"""

from __future__ import annotations

from dataclasses import dataclass

from longstraw_core.pipeline.schedule import graphs_in_flight, split_pieces
from longstraw_core.pipeline.simulate import replay_pieces
from longstraw_core.plan.activations import Activations
from longstraw_core.plan.model import LayerSpec, Workload


def pieces_of(work: Workload, branches: int | None = None) -> int:
    """``P`` for ``branches`` replayed branches (default ``G``): ``distributed.replay_pieces``,
    else the schedule's choice (``simulate.replay_pieces``, as ``Stage.pieces_for``); 1 on
    one stage."""
    if work.stages <= 1:
        return 1
    if work.replay_pieces is not None:
        return work.replay_pieces
    return replay_pieces(work.stages, branches or work.group)


def replayed_counts(work: Workload) -> list[int]:
    """How many branches a step may replay, to plan for each: ``Workload.replay_branches``;
    else every count from 1 to ``G``: a branch with zero advantage and weight is skipped, and
    fewer branches get more, shorter pieces (``Stage.pieces_for``), so the last stage may
    hold more with fewer. Of the counts cut into as many pieces, the largest holds the most
    (with ``P`` configured: ``G``)."""
    if work.replay_branches is not None:
        return [work.replay_branches]
    largest = {pieces_of(work, count): count for count in range(1, work.group + 1)}
    return sorted(largest.values())


def most_held(stages: int, stage: int, pieces: int, branches: int) -> int:
    """The most piece graphs stage ``stage`` holds in ``replay_orders(stages, [pieces] *
    branches)``: its cap, ``graphs_in_flight``, unless the ``G P`` pieces are fewer. The
    schedule reaches it (``tests/plan/test_plan_stages.py`` walks the orders); this could live
    in ``pipeline/schedule.py``."""
    return min(graphs_in_flight(stages, pieces)[stage], branches * pieces)


@dataclass(frozen=True)
class PieceMemory:
    """Replay's share of a stage's peak (bytes), at the fullest moment of its schedule."""

    branches: int  # branches replayed (the count that holds the most)
    pieces: int  # P, pieces a branch
    held: int  # most piece graphs held at once (the one in its backward among them)
    tokens: int  # the longest piece
    piece: int  # the piece in its backward: its graph and its backward's working set
    waiting: int  # the other held pieces' graphs
    written: int  # the pieces' rows kept as leaves, their gradients, DeltaNet's states

    @property
    def total(self) -> int:
        return self.piece + self.waiting + self.written


def piece_rows(act: Activations, layer: LayerSpec, tokens: int) -> int:
    """What a piece of ``tokens`` tokens writes in ``layer`` and the pieces after it read
    (bytes): keys and values, the latent and index keys, or Gated DeltaNet's final states,
    whose conv window is a view of the piece's whole conv input and keeps it alive
    (``qwen36.run_gated_deltanet``); ``KindPlan.piece_rows``."""
    return layer.kind.plan.piece_rows(act, layer, tokens)


def piece_memory(act: Activations, work: Workload, stage: int) -> PieceMemory:
    """Stage ``stage``'s replay pieces at their fullest, for the number of replayed branches
    that holds the most (``replayed_counts``; see the module docstring)."""
    plans = [_fullest(act, work, stage, count) for count in replayed_counts(work)]
    return max(plans, key=lambda plan: plan.total)


def _fullest(act: Activations, work: Workload, stage: int, branches: int) -> PieceMemory:
    """The fullest moment of ``branches`` branches' pieces on stage ``stage``."""
    pieces = pieces_of(work, branches)
    held = most_held(work.stages, stage, pieces, branches)
    spans = [(start, max(size, 1)) for start, size in split_pieces(work.response_tokens, pieces)]
    recurrent = [layer for layer in act.spec.layers if not layer.kind.grows_with_prompt]
    growing = [layer for layer in act.spec.layers if layer.kind.grows_with_prompt]
    per_row = sum(piece_rows(act, layer, 1) for layer in growing)
    rows = [per_row * length for _, length in spans]
    states = [sum(piece_rows(act, layer, length) for layer in recurrent) for _, length in spans]
    state_grad = sum(act.written(layer, 0) for layer in recurrent)  # a leaf's gradient
    concatenated = [per_row * start for start, _ in spans]  # the earlier pieces' rows
    lengths = {length for _, length in spans}  # at most two: split_pieces is near-equal
    graphs = {length: act.branch_graph(length) for length in lengths}
    peaks = {length: act.branch_peak(length) for length in lengths}
    # A held piece's graph; without checkpointing its attention saves the rows so far.
    kept = [graphs[length] for _, length in spans]
    if not work.activation_checkpointing:
        kept = [graph + extra for graph, extra in zip(kept, concatenated, strict=True)]
    later_pieces = (branches - 1) * pieces
    best = PieceMemory(branches, pieces, held, max(lengths), 0, 0, 0)
    for done in range(pieces):  # the front branch has run ``done`` of its backwards
        current = pieces - 1 - done
        later = min(held - current - 1, later_pieces)  # held pieces of the next branches
        piece = peaks[spans[current][1]] + concatenated[current]
        waiting = sum(kept[:current]) + _cycled(kept, later)
        # Rows: the front branch's (leaves until its first piece's backward) and the later
        # pieces'; gradients: those of the front branch's pieces before its last.
        written = sum(rows) + _cycled(rows, later) + sum(rows[:-1])
        # DeltaNet's final states: each held piece's, the front branch's last (the chain's),
        # the gradient seeding this backward and the one it makes for the piece before.
        written += sum(states[: current + 1]) + _cycled(states, later)
        written += (states[-1] + state_grad) * (done > 0) + state_grad * (current > 0)
        if piece + waiting + written > best.total:
            best = PieceMemory(branches, pieces, held, best.tokens, piece, waiting, written)
    return best


def _cycled(values: list[int], count: int) -> int:
    """The sum of ``count`` values taken in turn from ``values`` (each piece of the branches
    after the front one, in forward order)."""
    whole, part = divmod(count, len(values))
    return whole * sum(values) + sum(values[:part])
