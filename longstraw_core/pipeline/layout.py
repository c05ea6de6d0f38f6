"""Which decoder layers each pipeline stage owns: contiguous blocks, balanced by cost.

A stage owns a contiguous block of decoder layers: their weights, their prefix state (and, in
exact mode, their dS and recurrent checkpoints). Embeddings go with the first stage, the
final norm and LM head with the last (``docs/design.md``, "One prompt across GPUs").

Each layer has a cost vector (for instance: state bytes per prompt position, parameters,
compute); every dimension is normalised by its total over the model, and a stage's load is
the sum of its layers' normalised costs. ``balanced_boundaries`` picks the contiguous
partition that minimises the largest stage load (an exact dynamic program: ``S x L^2`` for
``L`` layers, instant at a hundred layers). For Qwen3.6 (three Gated DeltaNet layers to one
full-attention layer) with state and compute as the dimensions, every stage of an even split
gets the same number of full-attention layers.

The placement is a per-layer decision (``StageLayout.stage_of``), so that sequence sharding
of a layer's state can be added later without changing who owns what.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class StageLayoutError(ValueError):
    """A stage layout that cannot work (too many stages, bad boundaries)."""


@dataclass(frozen=True)
class StageLayout:
    """``boundaries`` ``(0, b1, ..., L)``: stage ``s`` owns layers ``[b[s], b[s + 1])``."""

    boundaries: tuple[int, ...]

    def __post_init__(self) -> None:
        b = self.boundaries
        if len(b) < 2 or b[0] != 0 or any(lo >= hi for lo, hi in itertools.pairwise(b)):
            raise StageLayoutError(
                f"stage boundaries {list(b)} must start at 0 and increase strictly "
                "(every stage owns at least one layer)"
            )

    @classmethod
    def from_starts(cls, starts: Sequence[int], num_layers: int) -> StageLayout:
        """A layout from each stage's first layer (``distributed.stage_starts``)."""
        starts = [int(s) for s in starts]
        if not starts or starts[0] != 0:
            raise StageLayoutError(f"stage starts {starts} must begin with layer 0")
        if starts[-1] >= num_layers:
            raise StageLayoutError(
                f"stage starts {starts} name layer {starts[-1]}, but the model has "
                f"{num_layers} layers (0..{num_layers - 1})"
            )
        return cls((*starts, num_layers))

    @property
    def stages(self) -> int:
        return len(self.boundaries) - 1

    @property
    def num_layers(self) -> int:
        return self.boundaries[-1]

    @property
    def starts(self) -> list[int]:
        return list(self.boundaries[:-1])

    def layers_of(self, stage: int) -> range:
        """The layers stage ``stage`` owns."""
        if not 0 <= stage < self.stages:
            raise IndexError(f"stage {stage} is not in a layout of {self.stages} stages")
        return range(self.boundaries[stage], self.boundaries[stage + 1])

    def stage_of(self, layer: int) -> int:
        """The stage that owns ``layer`` (its weights and its prefix state)."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} is not in a model of {self.num_layers} layers")
        return next(s for s in range(self.stages) if layer < self.boundaries[s + 1])

    def describe(self) -> str:
        """``"0-7 | 8-15"``: each stage's layers, for logs and errors."""
        return " | ".join(
            f"{r.start}-{r.stop - 1}" for r in map(self.layers_of, range(self.stages))
        )


def check_stage_count(
    stages: int, num_layers: int | None = None, world_size: int | None = None
) -> None:
    """Refuse ``stages`` that cannot be laid out over ``num_layers`` layers and ``world_size``
    processes (each checked when given), naming ``distributed.pipeline_stages``."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise StageLayoutError(
            f"distributed.pipeline_stages={stages!r}: must be a positive integer (1: no stages)"
        )
    if num_layers is not None and stages > num_layers:
        raise StageLayoutError(
            f"distributed.pipeline_stages={stages} is more than the model's {num_layers} "
            f"decoder layers: every stage owns at least one layer; use at most {num_layers}"
        )
    if world_size is not None and world_size % stages:
        raise StageLayoutError(
            f"distributed.pipeline_stages={stages} does not divide the {world_size} processes: "
            "the world is stages x data-parallel replicas; launch a multiple of "
            f"{stages} processes"
        )


def balanced_boundaries(costs: Sequence[Sequence[float]], stages: int) -> StageLayout:
    """The contiguous split of layers (``costs[i]``: layer ``i``'s cost vector) into
    ``stages`` blocks whose largest normalised load is smallest. Among equal splits, the later
    stages get fewer layers: the last stage also runs the final norm and the LM head."""
    check_stage_count(stages, len(costs))
    return contiguous_partition(normalised_loads(costs), stages, max, prefer_later_cuts=True)


def normalised_loads(costs: Sequence[Sequence[float]]) -> list[float]:
    """Each layer's load: its cost vector with every dimension divided by its total."""
    dims = len(costs[0]) if costs else 0
    totals = [sum(float(c[d]) for c in costs) for d in range(dims)]
    return [sum(float(c[d]) / totals[d] for d in range(dims) if totals[d] > 0) for c in costs]


def contiguous_partition(
    loads: Sequence[float],
    stages: int,
    combine: Callable[[float, float], float],
    *,
    prefer_later_cuts: bool = False,
) -> StageLayout:
    """The split of ``loads`` into ``stages`` contiguous, non-empty blocks that minimises
    ``combine(value of the blocks before, load of the next block)`` over the blocks (``max``:
    the largest block; a sum of squares; ``inf`` forbids a block). An exact dynamic program,
    ``S x L^2`` steps. ``prefer_later_cuts``: among equal values, end each block as late as
    possible (else as early)."""
    count = len(loads)
    prefix = [0.0]
    for load in loads:
        prefix.append(prefix[-1] + load)
    inf = float("inf")
    # best[s][i]: the smallest value splitting [0, i) into s blocks; cut[s][i]: where the
    # last of them starts.
    best = [[inf] * (count + 1) for _ in range(stages + 1)]
    cut = [[0] * (count + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, count - (stages - s) + 1):
            for j in range(s - 1, i):
                if best[s - 1][j] == inf:
                    continue
                value = combine(best[s - 1][j], prefix[i] - prefix[j])
                better = (
                    value <= best[s][i] + 1e-12 if prefer_later_cuts else value < best[s][i] - 1e-15
                )
                if value < inf and better:
                    best[s][i], cut[s][i] = value, j
    boundaries = [count]
    for s in range(stages, 0, -1):
        boundaries.append(cut[s][boundaries[-1]])
    return StageLayout(tuple(reversed(boundaries)))
